#!/usr/bin/env python
"""Check a Megatron-LM checkout's hook points for ``--tensor-parallel-mode``, statically.

    python scripts/check_megatron_lm_release.py /path/to/Megatron-LM [--release core_v0.19.0]

Reads (never imports) ``pretrain_gpt.py`` and the modules the hooks wrap, prints the route that
``megatron_metp.megatron_lm_hooks.plan_hooks`` picks and, for every hook point, whether the
module defines or imports that name at top level. Exit status 1 when one is missing. Runs where
the checkout's Python requirement cannot be met (megatron-core 0.17+ needs Python 3.12).
"""

from __future__ import annotations

import argparse
import ast
import os
import sys

from megatron_metp import megatron_lm_hooks as hooks


def top_level_names(source: str) -> set:
    """Names a module defines or imports at top level."""
    names = set()
    for node in ast.parse(source).body:
        if isinstance(node, (ast.FunctionDef, ast.ClassDef)):
            names.add(node.name)
        elif isinstance(node, (ast.Import, ast.ImportFrom)):
            names.update((a.asname or a.name).split(".")[0] for a in node.names)
        elif isinstance(node, ast.Assign):
            names.update(t.id for t in node.targets if isinstance(t, ast.Name))
    return names


def check(root: str, release: str) -> int:
    with open(os.path.join(root, "pretrain_gpt.py")) as f:
        names = hooks.main_names(f.read())
    try:
        plan = hooks.plan_hooks(names, release)
    except hooks.MetpConfigError as e:
        print(f"FAIL {e}")
        return 1
    print(f"{release}: route {plan.route}")
    missing = 0
    points = plan.points + [hooks.ARGS_ALIAS, ("megatron.training", "get_args")]
    for module, name in points:
        rel = module.replace(".", os.sep)
        path = next((p for p in (os.path.join(root, rel + ".py"),
                                 os.path.join(root, rel, "__init__.py")) if os.path.isfile(p)), None)
        found = path is not None and name in top_level_names(open(path).read())
        optional = (module, name) == hooks.ARGS_ALIAS
        status = "ok" if found else ("absent (optional)" if optional else "MISSING")
        missing += not found and not optional
        print(f"  {module}.{name}: {status}")
    return 1 if missing else 0


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("root", help="a Megatron-LM checkout (the directory holding pretrain_gpt.py)")
    p.add_argument("--release", default="this checkout", help="the name to print (its tag)")
    a = p.parse_args(argv)
    return check(a.root, a.release)


if __name__ == "__main__":
    sys.exit(main())
