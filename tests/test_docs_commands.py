"""The docs tier: every command block in README.md, docs/*.md,
docs/calibration/README.md, docs/timeline/README.md and scripts/slurm/README.md runs, as
written, in a test.

Each block carries a marker on the line before it (an HTML comment, so it does not render):

    <!-- docs-tier: run -->                        runs as written, must exit 0
    <!-- docs-tier: run; append: ARGS -->          ARGS (tiny sizes only) appended to each command
    <!-- docs-tier: fails N "TEXT"; append: ... --> must exit N and print TEXT
    <!-- docs-tier: not run: REASON -->            a GPU-only or template command; REASON says why
    <!-- docs-tier: not a command -->              a file tree, a table, Python's output ...

The appended arguments are the one place a run differs from the text: later flags win in
argparse, so ``--seq-lengths 4k`` appended replaces the block's own. Blocks run with bash from a
scratch copy of the repository (their outputs, such as ``docs/frontier``, land there, not in the
checkout), with the venv on PATH as the README asks (``. .venv/bin/activate``) and
``MEGATRON_LM_PATH`` as the environment has it.

``test_every_block_is_marked`` (default tier) fails on a block without a marker; the runs are in
the full tier for their time (~20 launches).
"""

from __future__ import annotations

import os
import re
import shutil
import subprocess
import sys
from dataclasses import dataclass
from pathlib import Path
from typing import List, Optional

import pytest

ROOT = Path(__file__).resolve().parents[1]
FILES = ["README.md", *sorted(str(p.relative_to(ROOT)) for p in (ROOT / "docs").glob("*.md")),
         "docs/calibration/README.md", "docs/timeline/README.md", "scripts/slurm/README.md"]
_MARK = re.compile(r"^\s*<!-- docs-tier: (.*?) -->\s*$")
_FAILS = re.compile(r'^fails (\d+) "([^"]*)"$')


@dataclass
class Block:
    file: str
    line: int           # 1-based line of the block's first line
    text: str           # dedented
    kind: str           # run | fails | not run | not a command | (unmarked)
    append: str = ""
    rc: int = 0
    expect: str = ""
    reason: str = ""

    @property
    def id(self) -> str:
        return f"{self.file}:{self.line}"


def _blocks(rel: str) -> List[Block]:
    """Every fenced or indented block of a Markdown file, with its marker."""
    lines = (ROOT / rel).read_text().split("\n")
    out, i, marker, in_list = [], 0, None, False
    while i < len(lines):
        ln = lines[i]
        m = _MARK.match(ln)
        if m:
            marker, i = m.group(1), i + 1
            continue
        if ln.lstrip().startswith("```"):
            j = i + 1
            while j < len(lines) and not lines[j].lstrip().startswith("```"):
                j += 1
            body = lines[i + 1:j]
            out.append(_block(rel, i + 2, body, marker))
            marker, i = None, j + 1
            continue
        indent = len(ln) - len(ln.lstrip(" "))
        prev_blank = i == 0 or not lines[i - 1].strip() or _MARK.match(lines[i - 1])
        # An indented code block: 4+ spaces beyond the enclosing list item's text, after a blank.
        base = 4 + (3 if in_list else 0)
        if ln.strip() and prev_blank and indent >= base and not ln.lstrip().startswith(("- ", "|")):
            j = i
            while j < len(lines) and (not lines[j].strip() or
                                      len(lines[j]) - len(lines[j].lstrip(" ")) >= indent):
                j += 1
            while j > i and not lines[j - 1].strip():
                j -= 1
            out.append(_block(rel, i + 1, [x[indent:] for x in lines[i:j]], marker))
            marker, i = None, j
            continue
        if ln.strip():
            in_list = bool(re.match(r"^\s*(\d+\.|-|\*) ", ln)) or (in_list and indent > 0)
            marker = None if not _MARK.match(ln) else marker
        i += 1
    return out


def _block(rel: str, line: int, body: List[str], marker: Optional[str]) -> Block:
    b = Block(rel, line, "\n".join(body), "(unmarked)")
    if marker is None:
        return b
    head, _, append = marker.partition("; append: ")
    b.append = append.strip()
    if head == "run":
        b.kind = "run"
    elif _FAILS.match(head):
        b.kind, b.rc, b.expect = "fails", int(_FAILS.match(head).group(1)), _FAILS.match(head).group(2)
    elif head.startswith("not run: "):
        b.kind, b.reason = "not run", head[len("not run: "):]
    elif head == "not a command":
        b.kind = "not a command"
    else:
        b.kind = f"(bad marker {marker!r})"
    return b


ALL = [b for f in FILES for b in _blocks(f)]
RUN = [b for b in ALL if b.kind in ("run", "fails")]


_ASSIGN = re.compile(r"^[A-Z_][A-Z0-9_]*=")


def _assignments(text: str) -> str:
    """The shell variables a block sets (``NAME=word`` or ``NAME="..."`` alone on its lines,
    the quoted value spanning lines too; not ``NAME=1 command``): a later block of the same file
    uses them as a reader following the file in one shell would."""
    out, lines, i = [], text.split("\n"), 0
    while i < len(lines):
        j = i
        if _ASSIGN.match(lines[i]):
            value = lines[i].split("=", 1)[1]
            if value.startswith('"'):
                while lines[i:j + 1] and "\n".join(lines[i:j + 1]).count('"') % 2 and \
                        j + 1 < len(lines):
                    j += 1
                if "\n".join(lines[i:j + 1]).rstrip().endswith('"'):
                    out.extend(lines[i:j + 1])
            elif not value.split():
                pass
            elif len(value.split()) == 1:
                out.append(lines[i])
        i = j + 1
    return "\n".join(out)


def _script(block: Block) -> str:
    """What runs: the variables earlier run blocks of the file set, then the block, with its
    appended arguments."""
    before = [_assignments(b.text) for b in RUN if b.file == block.file and b.line < block.line]
    return "\n".join([x for x in before if x] + [_with_args(block.text, block.append)])


def _with_args(text: str, extra: str) -> str:
    """``extra`` appended to each command of the block (continuation lines joined first; a
    trailing ``# comment`` kept after it; variable assignments left alone)."""
    if not extra:
        return text
    joined = re.sub(r"\\\n\s*", " ", text)
    out = []
    for ln in joined.split("\n"):
        s = ln.strip()
        if not s or s.startswith("#") or _ASSIGN.match(s):
            out.append(ln)
            continue
        cmd, sep, comment = ln.partition("  # ")
        out.append(f"{cmd.rstrip()} {extra}" + (f"  # {comment}" if sep else ""))
    return "\n".join(out)


def test_every_block_is_marked(report):
    bad = [f"{b.id} {b.kind}: {b.text.splitlines()[0][:80]!r}" for b in ALL
           if b.kind not in ("run", "fails", "not run", "not a command")]
    assert not bad, "blocks without a valid docs-tier marker:\n" + "\n".join(bad)
    # A block whose marker does not say it fails must not be one of the refusals it documents.
    assert all(b.reason for b in ALL if b.kind == "not run")
    n = {k: sum(b.kind == k for b in ALL) for k in ("run", "fails", "not run", "not a command")}
    report(f"docs tier: {len(ALL)} blocks in {len(FILES)} files: {n['run']} run, {n['fails']} "
           f"expected to fail, {n['not run']} not run here (GPU or template, reason beside "
           f"each), {n['not a command']} not commands")
    assert n["run"] >= 10


@pytest.fixture(scope="module")
def scratch(tmp_path_factory) -> Path:
    """A copy of the tracked tree, the venv linked in (its editable install is this checkout)."""
    dst = tmp_path_factory.mktemp("docs") / "repo"
    files = subprocess.run(["git", "ls-files", "-co", "--exclude-standard"], cwd=ROOT,
                           capture_output=True, text=True, check=True).stdout.split()
    for f in files:
        src = ROOT / f
        if src.is_file():
            (dst / f).parent.mkdir(parents=True, exist_ok=True)
            shutil.copy2(src, dst / f)
    venv = Path(os.environ.get("METP_VENV", ROOT / ".venv"))
    venv = venv if venv.is_absolute() else ROOT / venv
    (dst / ".venv").symlink_to(Path(sys.prefix) if not venv.exists() else venv)
    return dst


# Blocks of one process (metp plan, python -c, a dry run) run two at a time before the tests
# read their results, one per core; blocks that start ranks (torchrun, metp train / bench,
# run_main.sh, the test suite) run alone, in their own test.
_MULTI = ("torchrun", "run_main.sh", "run_tests.sh", "metp bench", "metp train")


def _solo(block: Block) -> bool:
    return not any(m in block.text for m in _MULTI)


def _execute(block: Block, scratch: Path) -> subprocess.CompletedProcess:
    env = dict(os.environ, OMP_NUM_THREADS="1")
    env["PATH"] = f"{Path(sys.executable).parent}{os.pathsep}{env.get('PATH', '')}"
    for k in ("RANK", "WORLD_SIZE", "LOCAL_RANK", "MASTER_ADDR", "MASTER_PORT"):
        env.pop(k, None)
    return subprocess.run(["bash", "-c", "set -eo pipefail\n" + _script(block)], cwd=scratch,
                          env=env, capture_output=True, text=True, timeout=900,
                          start_new_session=True)


def _expected_seconds(block: Block) -> int:
    text = block.text
    return (60 * (len(re.findall(r"--frontier(?![-\w])", text)) + text.count("auto.choose"))
            + 20 * text.count("metp plan") + 1)


@pytest.fixture(scope="module")
def solo_results(request, scratch) -> dict:
    """The selected one-process blocks, run two at a time: {block id: CompletedProcess}."""
    from concurrent.futures import ThreadPoolExecutor

    chosen = {item.callspec.params["block"].id for item in request.session.items
              if item.originalname == "test_block_runs_as_written"
              and hasattr(item, "callspec")}
    # Longest first, so that the two cores end together (the frontier and auto blocks take
    # about a minute each on 2 cores, another metp plan 15-35 s, a dry run a second).
    todo = sorted((b for b in RUN if b.id in chosen and _solo(b)), key=_expected_seconds,
                  reverse=True)
    with ThreadPoolExecutor(max_workers=2) as pool:
        return dict(zip([b.id for b in todo], pool.map(lambda b: _execute(b, scratch), todo)))


@pytest.mark.full
@pytest.mark.parametrize("block", RUN, ids=[b.id for b in RUN])
def test_block_runs_as_written(block, scratch, solo_results, report):
    script = _script(block)
    if "pretrain_gpt" in script and not os.environ.get("MEGATRON_LM_PATH"):
        pytest.skip("the block runs Megatron-LM's pretrain_gpt.py: set MEGATRON_LM_PATH")
    proc = solo_results.get(block.id) or _execute(block, scratch)
    tail = (proc.stdout[-3000:], proc.stderr[-3000:])
    assert proc.returncode == block.rc, (block.id, script, *tail)
    if block.kind == "fails":
        assert block.expect in proc.stdout + proc.stderr, (block.id, script, *tail)
    report(f"docs tier {block.id}: rc {proc.returncode}"
           + (f" with {block.append!r} appended" if block.append else " as written"))
