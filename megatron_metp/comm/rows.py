"""Row-wise all-gather and reduce-scatter over a group, posted asynchronously: METP's way of
moving weight shards whole (the whole attention pass's ``linear_qkv`` / ``linear_proj`` shards,
the gathered MLP's fc1 / fc2 shards) and their gradients back to their owners."""

from __future__ import annotations

from typing import Optional

import torch
import torch.distributed as dist


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
