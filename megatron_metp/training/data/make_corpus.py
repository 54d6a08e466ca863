"""Regenerate ``corpus.txt``, the English prose corpus shipped for ``metp train``.

Source: the prose of the Python Language Reference as bundled with CPython in
``pydoc_data/topics.py`` (the text ``help('while')`` prints). Licence: the Python
documentation is distributed under the PSF License Agreement, which permits redistribution of
derivative works provided the PSF's notice and licence are retained; they are in
``CORPUS_LICENSE.txt`` beside the corpus.

Only running prose is kept: paragraphs that are not indented (indented blocks are grammar
productions and code examples), re-wrapped into one line each, documents separated by a blank
line. The result is deterministic for a given CPython release (3.11.7 was used).

    python -m megatron_metp.training.data.make_corpus [OUT]
"""

from __future__ import annotations

import re
import sys
from pathlib import Path

_HEADING_RULE = re.compile(r"^[*=\-~^\"]{3,}$")


def prose_paragraphs(text: str):
    """Yield the un-indented, multi-word paragraphs of one reference topic, one line each."""
    for block in re.split(r"\n\s*\n", text):
        lines = block.split("\n")
        if not lines or lines[0].startswith((" ", "\t")):
            continue  # grammar production or code example
        if any(_HEADING_RULE.match(ln.strip()) for ln in lines):
            continue  # section title
        para = " ".join(ln.strip() for ln in lines)
        if len(para.split()) >= 8 and not para.startswith((">>>", "...")):
            yield para


def build_corpus() -> str:
    from pydoc_data.topics import topics

    docs = []
    for name in sorted(topics):
        paras = list(prose_paragraphs(topics[name]))
        if paras:
            docs.append("\n".join(paras))
    return "\n\n".join(docs) + "\n"


def main(argv=None) -> None:
    argv = sys.argv[1:] if argv is None else argv
    out = Path(argv[0]) if argv else Path(__file__).with_name("corpus.txt")
    text = build_corpus()
    out.write_text(text, encoding="utf-8")
    print(f"wrote {out} ({len(text.encode('utf-8'))} bytes)")


if __name__ == "__main__":
    main()
