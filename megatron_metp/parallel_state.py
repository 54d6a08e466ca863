"""Process groups of the plugin, built beside Megatron-Core's ``parallel_state``.

METP
    The METP ring *is* Megatron's tensor-model-parallel group: the same ranks, the same
    ``--tensor-model-parallel-size``, the same weight shards; its P2P (K/V blocks, MLP weight
    shards) runs on it. METP attention's weight broadcasts and gradient reduces run on a second
    group over the same ranks, the *weight group*: on NCCL one group is one communicator with one
    stream whose operations run in issue order, so head group j+1's prefetched broadcast would
    otherwise queue behind head group j's K/V ring instead of overlapping it.

WallFacer
    Teams, team groups and sub-rings are carved out of Megatron's context-parallel group (see
    ``megatron_metp.wallfacer.groups``) and registered here with :func:`set_wallfacer_groups`.

Modules receive their groups explicitly at construction; no autograd Function reads this module.
"""

from __future__ import annotations

import datetime
from typing import Any, FrozenSet, Iterable, List, Optional

import torch.distributed as dist

_METP_GROUP: Optional[dist.ProcessGroup] = None
_METP_WEIGHT_GROUP: Optional[dist.ProcessGroup] = None
_WALLFACER_GROUPS: Optional[Any] = None


def initialize_metp(tp_group: Optional[dist.ProcessGroup] = None,
                    tp_rank_lists: Optional[List[List[int]]] = None,
                    timeout: Optional[datetime.timedelta] = None) -> None:
    """Register the METP ring and create its weight group. Call on every rank after Megatron's
    ``initialize_model_parallel``.

    ``tp_group`` defaults to Megatron's tensor-model-parallel group. ``tp_rank_lists``: every TP
    group's global ranks, the same on every rank (``new_group`` is collective over the world, so
    every rank creates every group in one order); default: gathered from all ranks.
    """
    global _METP_GROUP, _METP_WEIGHT_GROUP
    if tp_group is None:
        from megatron.core import parallel_state as mpu

        if not mpu.model_parallel_is_initialized():
            raise RuntimeError(
                "megatron_metp.parallel_state.initialize_metp: Megatron-Core's model parallel "
                "state is not initialised; call megatron.core.parallel_state."
                "initialize_model_parallel(...) first"
            )
        tp_group = mpu.get_tensor_model_parallel_group()
    _METP_GROUP = tp_group
    _METP_WEIGHT_GROUP = None
    if dist.get_world_size(tp_group) > 1:
        mine = sorted(dist.get_process_group_ranks(tp_group))
        if tp_rank_lists is None:
            gathered: List[Any] = [None] * dist.get_world_size()
            dist.all_gather_object(gathered, mine)
            tp_rank_lists = [list(g) for g in sorted({tuple(g) for g in gathered})]
        for ranks in sorted(sorted(r) for r in tp_rank_lists):
            pg = dist.new_group(ranks, timeout=timeout)
            if ranks == mine:
                _METP_WEIGHT_GROUP = pg


def metp_weight_group(tp_group: Optional[dist.ProcessGroup]) -> Optional[dist.ProcessGroup]:
    """The weight group over ``tp_group``'s ranks, or ``tp_group`` itself when none was created
    (one rank, or a ring built outside ``initialize_metp``): read once, at construction."""
    g = _METP_WEIGHT_GROUP
    if g is None or tp_group is None:
        return tp_group
    if tp_group is _METP_GROUP or (sorted(dist.get_process_group_ranks(g))
                                   == sorted(dist.get_process_group_ranks(tp_group))):
        return g
    return tp_group


def metp_is_initialized() -> bool:
    return _METP_GROUP is not None


def set_wallfacer_groups(groups: Any) -> None:
    """Register the WallFacer groups object built by ``megatron_metp.wallfacer.groups``."""
    global _WALLFACER_GROUPS
    _WALLFACER_GROUPS = groups


def wallfacer_is_initialized() -> bool:
    return _WALLFACER_GROUPS is not None


def get_wallfacer_groups() -> Any:
    if _WALLFACER_GROUPS is None:
        raise RuntimeError(
            "WallFacer groups are not initialised: call "
            "megatron_metp.wallfacer.scheduler.initialize_wallfacer(...) after Megatron-Core's "
            "initialize_model_parallel(context_parallel_size=P)"
        )
    return _WALLFACER_GROUPS


def destroy() -> None:
    """Forget the plugin's groups. This only drops references; the groups themselves are ended
    by :func:`destroy_groups` (``megatron_metp.model.destroy_parallel`` does both)."""
    global _METP_GROUP, _METP_WEIGHT_GROUP, _WALLFACER_GROUPS
    _METP_GROUP = None
    _METP_WEIGHT_GROUP = None
    _WALLFACER_GROUPS = None


# ------------------------------------------------------------------------------------------
# Ending process groups.
#
# A gloo group keeps two worker threads, a TCP loop thread and a socket per peer until
# ``torch.distributed.destroy_process_group(group)`` is called on it; an NCCL group keeps its
# communicator and its GPU buffers. Dropping the Python references (all Megatron-Core's
# ``destroy_model_parallel`` does) is not enough: torch's own registry still holds every group.
# So the groups that a set-up creates are found by difference with the registry before it.


def live_groups() -> FrozenSet[dist.ProcessGroup]:
    """Every process group this rank belongs to, the default (world) group excluded."""
    if not dist.is_initialized():
        return frozenset()
    from torch.distributed import distributed_c10d as c10d

    world = c10d._get_default_group()
    return frozenset(pg for pg in c10d._world.pg_map if pg is not world)


def destroy_groups(groups: Iterable[Optional[dist.ProcessGroup]]) -> int:
    """``destroy_process_group`` on each group still registered; returns how many were ended.

    Local to the calling rank (no collective), so ranks may call it at different times. Newest
    first, the reverse of creation order, as torch ends the world's groups.
    """
    if not dist.is_initialized():
        return 0
    from torch.distributed import distributed_c10d as c10d

    wanted = {g for g in groups if g is not None}
    # pg_map keeps creation order; end the newest first.
    todo = [g for g in reversed(list(c10d._world.pg_map)) if g in wanted]
    world = c10d._get_default_group()
    for g in todo:
        if g is world:
            continue
        dist.destroy_process_group(g)
    return sum(g is not world for g in todo)
