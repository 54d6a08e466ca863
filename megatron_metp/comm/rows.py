"""Row-wise all-gather and reduce-scatter over a group, posted asynchronously: METP's way of
moving weight shards whole (the whole attention pass's ``linear_qkv`` / ``linear_proj`` shards,
the gathered MLP's fc1 / fc2 shards) and their gradients back to their owners.

Several tensors posted at the same point go as one coalesced call (:func:`gather_rows_together`,
:func:`scatter_rows_together`: ``torch.distributed._coalescing_manager``, one NCCL group, one
host call where there were one per tensor), with one handle for all of them
(:class:`SharedWork`). The same bytes to the same ranks, so the same values: what it changes is
the host's issue time, about 30 us per call (``measure.timeline``), and that every tensor of
the call is ready only when all of them are."""

from __future__ import annotations

from typing import List, Optional, Sequence, Tuple

import torch
import torch.distributed as dist
from torch._subclasses.fake_tensor import FakeTensor


def gather_rows(t: Optional[torch.Tensor], group, p: int, async_op: bool = True):
    """Every rank's ``t`` stacked along dim 0 in rank order: ``(full, handle)``. ``t`` None
    gives ``(None, None)``; a group of one returns ``t`` itself; ``handle`` is None unless
    ``async_op``."""
    if t is None:
        return None, None
    if p == 1:
        return t, None
    t = t.contiguous()
    full = torch.empty((p * t.shape[0], *t.shape[1:]), dtype=t.dtype, device=t.device)
    handle = dist.all_gather_into_tensor(full, t, group=group, async_op=async_op)
    return full, handle if async_op else None


def scatter_rows(full: Optional[torch.Tensor], group, p: int):
    """``full`` summed over the group, this rank's rows kept (posted asynchronously):
    ``(mine, handle)``."""
    if full is None:
        return None, None
    if p == 1:
        return full, None
    mine = torch.empty((full.shape[0] // p, *full.shape[1:]), dtype=full.dtype,
                       device=full.device)
    return mine, dist.reduce_scatter_tensor(mine, full, group=group, async_op=True)


# A weight joins the coalesced call of the weights posted beside it while the call's gathered
# bytes stay within this; a bias always joins its weight's call. Coalesced, the first weight's
# GEMM waits for the whole call: worth it where the rest travels in about the host time that
# the calls saved take to issue (``measure.timeline``: 30 us per call; 32 MiB crosses an H100's
# NVLink in ~75 us, the time of two or three calls). BERT-Large's attention output and MLP
# weights at p = 8 (18 MiB gathered) go as one call; LLaMA-7B's (32 + 172 MiB) one call each.
COALESCE_MAX_BYTES = 32 << 20


def call_groups(ts: Sequence[Optional[torch.Tensor]], p: int,
                max_bytes: int = COALESCE_MAX_BYTES) -> List[List[int]]:
    """The indices of ``ts`` (None left out) split into coalesced calls, in order: a 1-D
    tensor (a bias) goes with the call before it; a matrix opens a new call unless the call's
    gathered bytes (``p`` times each tensor's) stay within ``max_bytes`` with it."""
    calls: List[List[int]] = []
    size = 0
    for i, t in enumerate(ts):
        if t is None:
            continue
        nbytes = p * t.numel() * t.element_size()
        if calls and (t.dim() < 2 or size + nbytes <= max_bytes):
            calls[-1].append(i)
            size += nbytes
        else:
            calls.append([i])
            size = nbytes
    return calls


class SharedWork:
    """The one handle of a coalesced call, handed out for each of its tensors: the first
    :meth:`wait` waits for the call, later ones return at once. It holds the call's tensors
    until then: gloo's coalesced reduce-scatter keeps no reference to its inputs (a caller
    that drops its input after posting would free memory gloo's thread still reads), and
    NCCL's work stashes them until waited for anyway. Fake tensors (the planner's traces,
    where nothing runs) are not held, as a single call's ``FakeWork`` holds none."""

    def __init__(self, works, tensors=()) -> None:
        self._works = list(works)
        self._tensors = [t for t in tensors if not isinstance(t, FakeTensor)]

    def wait(self) -> bool:
        # Each work leaves the list only once waited for: if one wait raises, a later wait
        # (``layer_schedule.drop``) still waits for the rest before their buffers go.
        while self._works:
            self._works[0].wait()
            self._works.pop(0)
        self._tensors = []
        return True


_COALESCED_OPS = ("allgather_into_tensor_coalesced_", "reduce_scatter_tensor_coalesced_")
_meta_lib = None


def _register_coalesced_meta() -> None:
    """Meta kernels for the two coalesced c10d ops, which PyTorch registers for the others
    (``torch.distributed._meta_registrations``) but not for these: without them a
    ``FakeTensorMode`` trace (the planner, ``measure.op_trace``) cannot run a coalesced call.
    Like PyTorch's, each returns a ``FakeWork`` and touches no tensor; registered once, and
    only where PyTorch has none."""
    global _meta_lib
    if _meta_lib is not None:
        return
    from torch._C._distributed_c10d import FakeWork

    def fake_work(*args):
        return FakeWork().boxed()

    lib = torch.library.Library("c10d", "IMPL")
    for op in _COALESCED_OPS:
        if not torch._C._dispatch_has_kernel_for_dispatch_key(f"c10d::{op}", "Meta"):
            lib.impl(op, fake_work, "Meta")
    _meta_lib = lib


def _together(post, pairs, group) -> Optional[SharedWork]:
    """Post ``post(out, inp)`` for each ``(out, inp)`` inside one coalescing manager per
    dtype."""
    if not pairs:
        return None
    # One call per dtype: gloo's coalesced collectives treat every tensor of a call as the
    # first one's dtype (mixed, they deliver garbage); weights and their biases share one.
    kinds: dict = {}
    for pair in pairs:
        kinds.setdefault(pair[1].dtype, []).append(pair)
    works = []
    tensors = [t for pair in pairs for t in pair]
    for same in kinds.values():
        if len(same) == 1:
            works.append(post(*same[0]))
            continue
        _register_coalesced_meta()
        with dist._coalescing_manager(group=group, async_ops=True) as cm:
            for out, inp in same:
                post(out, inp)
        works += cm.works
    return SharedWork(works, tensors)


def _dense(ts: Sequence[Optional[torch.Tensor]]) -> List[Optional[torch.Tensor]]:
    """``ts`` made contiguous for the gather, the strided ones (a row-parallel weight's shard
    as rows of its transpose) of one row shape and dtype in one copy: one ``cat`` into one
    buffer, each its contiguous rows of it, where each would be copied on its own."""
    out = list(ts)
    strided = [i for i, t in enumerate(ts) if t is not None and not t.is_contiguous()]
    for i in strided:
        if out[i] is not ts[i]:
            continue   # packed with an earlier one
        same = [j for j in strided if ts[j].shape[1:] == ts[i].shape[1:]
                and ts[j].dtype == ts[i].dtype and ts[j].device == ts[i].device]
        if len(same) == 1:
            out[i] = ts[i].contiguous()
            continue
        buf = torch.cat([ts[j] for j in same])
        start = 0
        for j in same:
            out[j] = buf[start:start + ts[j].shape[0]]
            start += ts[j].shape[0]
    return out


def _each_together(ts, group, p: int, rows, post, given=None):
    """For each of ``ts`` (None stays None) an output of ``rows(t)`` rows (``given[i]`` where
    the caller laid it out), posted with ``post(out, t)`` in one call: ``(outs, handle)``."""
    outs, pairs = [], []
    for i, t in enumerate(ts):
        if t is None:
            outs.append(None)
            continue
        out = given[i] if given is not None and given[i] is not None else torch.empty(
            (rows(t), *t.shape[1:]), dtype=t.dtype, device=t.device)
        outs.append(out)
        pairs.append((out, t))
    return outs, _together(post, pairs, group)


def gather_rows_together(ts: Sequence[Optional[torch.Tensor]], group, p: int
                         ) -> Tuple[List[Optional[torch.Tensor]], Optional[SharedWork]]:
    """:func:`gather_rows` of each of ``ts`` (None stays None) in one call: ``(fulls,
    handle)``, one handle for all (None for a group of one, or no tensor)."""
    if p == 1:
        return list(ts), None
    return _each_together(
        _dense(ts), group, p, lambda t: p * t.shape[0],
        lambda out, inp: dist.all_gather_into_tensor(out, inp, group=group, async_op=True))


def scatter_rows_together(fulls: Sequence[Optional[torch.Tensor]], group, p: int,
                          outs: Optional[Sequence[Optional[torch.Tensor]]] = None
                          ) -> Tuple[List[Optional[torch.Tensor]], Optional[SharedWork]]:
    """:func:`scatter_rows` of each of ``fulls`` (None stays None) in one call: ``(mines,
    handle)``; ``outs``: where to put them (dense tensors of the shards' shapes, e.g. views of
    one buffer; None: new ones)."""
    if p == 1:
        return list(fulls), None
    return _each_together(
        fulls, group, p, lambda t: t.shape[0] // p,
        lambda out, inp: dist.reduce_scatter_tensor(out, inp, group=group, async_op=True),
        outs)
