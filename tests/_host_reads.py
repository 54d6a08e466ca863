"""Count the host reads of tensor values (``.tolist()``, ``.item()``, ``int()``, ``float()``,
``bool()`` of a tensor) made while a block runs: on a GPU each one waits for the compute
stream, and the queued NCCL waits with it. Test-only: it replaces ``torch.Tensor``'s methods
for the block and puts them back after."""

from __future__ import annotations

import collections
import traceback
from contextlib import contextmanager

import torch

_METHODS = ("tolist", "item", "__int__", "__float__", "__bool__", "__index__")


@contextmanager
def count_host_reads(package: str = "megatron_metp"):
    """Yields a Counter of ``'file:line method'`` for each host read, by the line that made it:
    a line of ``package`` (``'packing.py:136 tolist'``), or one of torch or Megatron-Core
    (``'outside megatron/core/...:512 tolist'``)."""
    seen: collections.Counter = collections.Counter()
    saved = {m: getattr(torch.Tensor, m) for m in _METHODS}
    busy = [False]

    def wrap(name, fn):
        def counted(self, *a, **k):
            if not busy[0]:
                busy[0] = True
                try:
                    fr = traceback.extract_stack()[-2]
                    if f"/{package}/" in fr.filename:
                        where = f"{fr.filename.split(f'/{package}/')[1]}:{fr.lineno}"
                    else:
                        parts = fr.filename.split("/site-packages/")
                        where = f"outside {parts[-1]}:{fr.lineno}"
                    seen[f"{where} {name}"] += 1
                finally:
                    busy[0] = False
            return fn(self, *a, **k)
        return counted

    for m, fn in saved.items():
        setattr(torch.Tensor, m, wrap(m, fn))
    try:
        yield seen
    finally:
        for m, fn in saved.items():
            setattr(torch.Tensor, m, fn)
