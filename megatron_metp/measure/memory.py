"""Peak tensor memory of a region, per rank and by category, from PyTorch's ``MemTracker``.

``torch.distributed._tools.mem_tracker.MemTracker`` is a dispatch mode that follows every tensor
storage created inside it (and those registered with ``track_external``) until it is freed, so
its peak is the exact high-water mark of live tensor bytes on this rank. It works on CPU, where
the allocator's own statistics do not exist, and under ``FakeTensorMode`` with the ``fake``
process-group backend, where no memory is allocated at all (see ``../shared/FACTS.md``).

    with PeakMemory(model, x) as pm:          # model's params/buffers and x count from the start
        model(x).sum().backward()
    pm.peak_bytes                             # high-water mark of all tracked tensors
    pm.peak_by_category["activation"]         # at that moment, per category
    pm.peak_increase                          # peak_bytes - baseline_bytes (what the region added)

Categories (MemTracker's): ``parameter``, ``buffer``, ``gradient``, ``activation`` (created in
forward), ``temp`` (created in backward), ``optstate``, ``other`` (registered tensors that are
not parameters). Tensors created before the region and not passed in are invisible; so is a
buffer a live communication handle keeps alive after its Python tensor is dropped (a gloo
``Work``): fake runs do not see those either.

Under ``FakeTensorMode``: create the fake inputs and module inside the fake mode, then enter
``PeakMemory`` inside it too, so the tracker's "fake mode at entry" matches the ops' mode.
"""

from __future__ import annotations

from typing import Any, Dict, Optional

import torch
from torch.distributed._tools.mem_tracker import MemTracker

__all__ = ["PeakMemory", "CATEGORIES"]

CATEGORIES = ("parameter", "buffer", "gradient", "activation", "temp", "optstate", "other")
_FROM_TRACKER = {
    "Parameter": "parameter",
    "Buffer": "buffer",
    "Gradient": "gradient",
    "Activation": "activation",
    "Temp": "temp",
    "Optstate": "optstate",
    "Other": "other",
}


def _by_category(snap: Dict[Any, int]) -> Dict[str, int]:
    out = dict.fromkeys(CATEGORIES, 0)
    for key, val in snap.items():
        name = getattr(key, "value", key)
        if name in _FROM_TRACKER:
            out[_FROM_TRACKER[name]] += int(val)
    return out


class PeakMemory:
    """Context manager measuring the peak tracked tensor bytes of one device on this rank.

    ``external``: modules, optimizers and tensors that exist before the region and should count
    (passed to ``MemTracker.track_external``). ``device``: which device to report when tensors
    live on more than one (default: the only one, else the one with the largest peak).
    """

    def __init__(self, *external: Any, device: Optional[torch.device] = None):
        self._external = external
        self._device = torch.device(device) if device is not None else None
        self._tracker: Optional[MemTracker] = None
        self._baseline: Dict[Any, Dict[Any, int]] = {}
        self._peak: Dict[Any, Dict[Any, int]] = {}

    def __enter__(self) -> "PeakMemory":
        self._tracker = MemTracker()
        if self._external:
            self._tracker.track_external(*self._external)
        self._tracker.__enter__()
        self._baseline = self._tracker.get_tracker_snapshot("current")
        return self

    def __exit__(self, *exc: Any) -> None:
        tracker = self._tracker
        assert tracker is not None
        tracker.__exit__(*exc)
        self._peak = tracker.get_tracker_snapshot("peak")

    # -- results -----------------------------------------------------------------------------

    def _pick(self, snaps: Dict[Any, Dict[Any, int]]) -> Dict[Any, int]:
        if not snaps:
            return {}
        if self._device is not None:
            for dev, snap in snaps.items():
                if torch.device(dev) == self._device:
                    return snap
            return {}
        if len(snaps) == 1:
            return next(iter(snaps.values()))
        return max(snaps.values(), key=lambda s: s.get("Total", 0))

    @property
    def peak_bytes(self) -> int:
        """Largest total of live tracked tensor bytes seen in the region."""
        return int(self._pick(self._peak).get("Total", 0))

    @property
    def peak_by_category(self) -> Dict[str, int]:
        """Bytes per category at the moment of the peak."""
        return _by_category(self._pick(self._peak))

    @property
    def baseline_bytes(self) -> int:
        """Tracked bytes at entry (the external modules and tensors)."""
        return int(self._pick(self._baseline).get("Total", 0))

    @property
    def peak_increase(self) -> int:
        """``peak_bytes - baseline_bytes``: what the region itself added at its peak."""
        return self.peak_bytes - self.baseline_bytes

    def summary(self, unit: str = "MiB") -> str:
        div = {"B": 1, "KiB": 2**10, "MiB": 2**20, "GiB": 2**30}[unit]
        cats = ", ".join(
            f"{k} {v / div:.2f}" for k, v in self.peak_by_category.items() if v
        )
        return (f"peak {self.peak_bytes / div:.2f} {unit} (baseline "
                f"{self.baseline_bytes / div:.2f}; at peak: {cats})")
