"""The package's import graph: no circles, and no layer imports a layer above it.

Read from the source with ``ast`` (one process, nothing imported), every ``import`` counted,
also those inside functions: a lazy import still ties the two modules together.
"""

from __future__ import annotations

import ast
from pathlib import Path
from typing import Dict, List, Set

PACKAGE = Path(__file__).resolve().parent.parent / "megatron_metp"

# Lowest first. A module may import its own layer and the layers below it, never one above.
# Longest prefix wins (``measure.flops`` before ``measure``).
LAYERS = [
    # models: the model configs and Megatron-LM's FLOPs formula, read by the planner, the
    # Megatron-LM entry points and the trainer alike.
    # aten_calls: PyTorch's ops called by argument name, below the kernel boundary.
    ("core", ["comm", "kernels", "aten_calls", "packing", "parallel_state", "errors",
              "token_layout", "models"]),
    # ulysses: stock's --cp-comm-type a2a, the planner's CPU stand-in for TE's kernel.
    ("algorithms", ["metp", "wallfacer", "ulysses"]),
    ("integration", ["layers", "te_backend", "cpu_compat", "specs", "model", "validation",
                     "launch", "checkpoint_keys"]),
    # Megatron-LM's entry points sit beside measure: --tensor-parallel-mode auto plans there.
    ("measure", ["measure", "megatron_lm", "megatron_lm_hooks", "megatron_lm_cpu"]),
    ("trainer", ["training"]),
]


def _modules() -> Dict[str, Path]:
    out = {}
    for path in PACKAGE.rglob("*.py"):
        parts = path.relative_to(PACKAGE.parent).with_suffix("").parts
        if parts[-1] == "__init__":
            parts = parts[:-1]
        out[".".join(parts)] = path
    return out


def _imports(name: str, path: Path, known: Set[str]) -> Set[str]:
    """The package modules ``name`` imports (a ``from pkg import mod`` names ``pkg.mod``)."""
    found = set()
    package = name if path.name == "__init__.py" else name.rpartition(".")[0]
    for node in ast.walk(ast.parse(path.read_text(), str(path))):
        if isinstance(node, ast.Import):
            targets = [a.name for a in node.names]
        elif isinstance(node, ast.ImportFrom):
            base = node.module or ""
            if node.level:
                up = package.split(".")[:len(package.split(".")) - (node.level - 1)]
                base = ".".join(up + ([base] if base else []))
            targets = [f"{base}.{a.name}" if f"{base}.{a.name}" in known else base
                       for a in node.names]
        else:
            continue
        for t in targets:
            while t and t not in known:  # an attribute of a module: the module
                t = t.rpartition(".")[0]
            if t.startswith("megatron_metp") and t != name:
                found.add(t)
    return found


def _layer(module: str) -> int:
    rel = module.split(".")[1:]
    best = None
    for i, (_, prefixes) in enumerate(LAYERS):
        for p in prefixes:
            n = len(p.split("."))
            if rel[:n] == p.split(".") and (best is None or n > best[1]):
                best = (i, n)
    assert best is not None, f"{module} is in no layer: add it to LAYERS"
    return best[0]


def _graph() -> Dict[str, Set[str]]:
    mods = _modules()
    return {m: _imports(m, p, set(mods)) for m, p in mods.items()}


def _cycles(graph: Dict[str, Set[str]]) -> List[List[str]]:
    """Strongly connected components of more than one module (Tarjan)."""
    index: Dict[str, int] = {}
    low: Dict[str, int] = {}
    stack: List[str] = []
    on: Set[str] = set()
    out = []

    def visit(v):
        index[v] = low[v] = len(index)
        stack.append(v)
        on.add(v)
        for w in graph.get(v, ()):
            if w not in index:
                visit(w)
                low[v] = min(low[v], low[w])
            elif w in on:
                low[v] = min(low[v], index[w])
        if low[v] == index[v]:
            comp = []
            while True:
                w = stack.pop()
                on.discard(w)
                comp.append(w)
                if w == v:
                    break
            if len(comp) > 1:
                out.append(sorted(comp))

    for v in sorted(graph):
        if v not in index:
            visit(v)
    return out


def test_cycle_finder_finds_a_cycle():
    # The checker itself: a known three-module circle and a chain.
    assert _cycles({"a": {"b"}, "b": {"c"}, "c": {"a"}, "d": {"a"}}) == [["a", "b", "c"]]
    assert _cycles({"a": {"b"}, "b": {"c"}, "c": set()}) == []


def test_no_import_circles():
    assert _cycles(_graph()) == []


def test_no_upward_imports():
    graph = _graph()
    assert "megatron_metp.wallfacer.attention" in graph and len(graph) > 40  # the walk found it
    upward = sorted(f"{a} ({LAYERS[_layer(a)][0]}) imports {b} ({LAYERS[_layer(b)][0]})"
                    for a, targets in graph.items() for b in targets
                    if a != "megatron_metp" and _layer(b) > _layer(a))
    assert upward == []


def test_top_level_shows_the_plugin():
    # The layout rule: the top level holds the plugin (what a Megatron-LM run imports); the
    # trainer, its data and its CLI live in ``training/``. A new top-level module must be added
    # here on purpose.
    top = {p.stem if p.is_file() else p.name for p in PACKAGE.iterdir()
           if (p.suffix == ".py" or (p / "__init__.py").exists()) and p.name != "__init__.py"}
    assert top == {"comm", "kernels", "aten_calls", "packing", "parallel_state", "errors", "token_layout",
                   "models",
                   "metp", "wallfacer", "ulysses", "layers",
                   "te_backend", "cpu_compat", "specs", "model", "validation", "megatron_lm",
                   "megatron_lm_hooks", "launch", "measure", "training", "checkpoint_keys",
                   "megatron_lm_cpu"}


def test_measure_never_imports_the_trainer():
    # measure/ (bench, plan, timeline) serves the plugin and the trainer; it reads the model
    # configs and the FLOPs formula from models/, never anything from training/.
    graph = _graph()
    bad = sorted((a, b) for a, targets in graph.items() if a.startswith("megatron_metp.measure")
                 for b in targets if b.startswith("megatron_metp.training"))
    assert bad == []

