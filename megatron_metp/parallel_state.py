"""Process groups of the plugin, built beside Megatron-Core's ``parallel_state``.

METP
    The METP ring *is* Megatron's tensor-model-parallel group: the same ranks, the same
    ``--tensor-model-parallel-size``, the same weight shards; its P2P (K/V blocks, MLP weight
    shards) runs on it. METP attention's weight broadcasts and gradient reduces run on a second
    group over the same ranks, the *weight group*: on NCCL one group is one communicator with one
    stream whose operations run in issue order, so head group j+1's prefetched broadcast would
    otherwise queue behind head group j's K/V ring instead of overlapping it.

METP under context parallelism (``--context-parallel-size`` CP > 1)
    The CP split comes first (Megatron's load-balanced layout, ``get_batch_on_this_cp_rank``:
    CP rank c holds chunks c and 2CP-1-c of 2CP), then METP splits the CP rank's tokens
    contiguously over its TP ranks. With an even TP size every rank then holds ONE contiguous
    block of s/(TP CP) tokens, block :func:`zigzag_block` of the sequence. The outer level
    (weights) stays on the TP group and its weight group; the K/V ring must visit every block
    of the sequence, so it runs on a third group per tensor-and-context set of ranks, the
    *K/V ring* (:func:`metp_kv_ring`), whose ranks carry their block indices.

WallFacer
    Teams, team groups and sub-rings are carved out of Megatron's context-parallel group (see
    ``megatron_metp.wallfacer.groups``) and registered here with :func:`set_wallfacer_groups`.

Modules receive their groups explicitly at construction; no autograd Function reads this module.
"""

from __future__ import annotations

import datetime
from typing import Any, Dict, FrozenSet, Iterable, List, Optional, Tuple

import torch.distributed as dist

_METP_GROUP: Optional[dist.ProcessGroup] = None
_METP_WEIGHT_GROUP: Optional[dist.ProcessGroup] = None
_WALLFACER_GROUPS: Optional[Any] = None
# Under CP > 1: (K/V ring group, block index of each of its ranks in the contiguous layout, and
# in the balanced one), see metp_kv_ring.
_METP_KV_RING: Optional[Tuple[dist.ProcessGroup, Tuple[int, ...], Tuple[int, ...]]] = None


def zigzag_block(tp_rank: int, tp_size: int, cp_rank: int, cp_size: int) -> int:
    """Index of the block of s/(TP CP) consecutive tokens that TP rank ``tp_rank`` of CP rank
    ``cp_rank`` holds, when the CP split is Megatron's load-balanced one (CP rank c: chunks c
    and 2CP-1-c of 2CP) and METP splits each CP rank's tokens contiguously over an even number
    of TP ranks: the first TP/2 ranks share chunk c, the others chunk 2CP-1-c."""
    if cp_size == 1:
        return tp_rank
    if tp_size % 2:
        raise ValueError(f"METP with --context-parallel-size {cp_size} needs an even "
                         f"--tensor-model-parallel-size, got {tp_size}")
    half = tp_size // 2
    chunk = cp_rank if tp_rank < half else 2 * cp_size - 1 - cp_rank
    return chunk * half + tp_rank % half


def initialize_metp(tp_group: Optional[dist.ProcessGroup] = None,
                    tp_rank_lists: Optional[List[List[int]]] = None,
                    timeout: Optional[datetime.timedelta] = None,
                    *,
                    kv_ring: bool = True,
                    rank_layout: Optional[Dict[int, Tuple[int, int, Tuple[int, ...]]]] = None
                    ) -> None:
    """Register the METP ring and create its weight group. Call on every rank after Megatron's
    ``initialize_model_parallel``.

    ``tp_group`` defaults to Megatron's tensor-model-parallel group. ``tp_rank_lists``: every TP
    group's global ranks, the same on every rank (``new_group`` is collective over the world, so
    every rank creates every group in one order); default: gathered from all ranks.

    Under Megatron's context parallelism (CP > 1) and with ``kv_ring``, also the K/V ring groups
    (module docstring). ``rank_layout``: ``{global rank: (tp rank, cp rank, its tensor-and-
    context ranks)}`` for every rank, the same on every rank; default: gathered from all ranks.
    """
    global _METP_GROUP, _METP_WEIGHT_GROUP, _METP_KV_RING
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
    _METP_KV_RING = None
    from megatron.core import parallel_state as mpu

    cp = mpu.get_context_parallel_world_size() if mpu.model_parallel_is_initialized() else 1
    if kv_ring and cp > 1:
        _METP_KV_RING = _create_kv_rings(dist.get_world_size(tp_group), cp, rank_layout, timeout)


def _create_kv_rings(tp: int, cp: int, rank_layout, timeout):
    """One group per tensor-and-context set of ranks (every rank creates every group, in one
    order); returns this rank's group and the block index of each of its group ranks, in the
    contiguous layout and in the balanced one (``megatron_metp.token_layout.balanced_block``)."""
    from megatron.core import parallel_state as mpu

    if rank_layout is None:
        mine = (mpu.get_tensor_model_parallel_rank(), mpu.get_context_parallel_rank(),
                tuple(sorted(dist.get_process_group_ranks(
                    mpu.get_tensor_and_context_parallel_group()))))
        gathered: List[Any] = [None] * dist.get_world_size()
        dist.all_gather_object(gathered, mine)
        rank_layout = dict(enumerate(gathered))
    me = dist.get_rank()
    result = None
    for ranks in sorted({tuple(sorted(v[2])) for v in rank_layout.values()}):
        pg = dist.new_group(list(ranks), timeout=timeout)
        if me in ranks:
            # new_group numbers its ranks in sorted order: group rank i is global ranks[i].
            blocks = tuple(zigzag_block(rank_layout[g][0], tp, rank_layout[g][1], cp)
                           for g in ranks)
            from megatron_metp.token_layout import balanced_block

            balanced = tuple(balanced_block(rank_layout[g][0], tp, rank_layout[g][1])
                             for g in ranks)
            if sorted(blocks) != list(range(tp * cp)) or sorted(balanced) != list(range(tp * cp)):
                raise RuntimeError(f"METP K/V ring over ranks {ranks}: blocks {blocks} "
                                   f"(balanced {balanced}) do not cover the sequence once")
            result = (pg, blocks, balanced)
    return result


def metp_kv_ring(tp_group: Optional[dist.ProcessGroup], cp_group: Optional[dist.ProcessGroup]):
    """``(group, blocks)`` of METP attention's K/V ring: the TP group and ``None`` (block index
    = ring rank) without context parallelism; under CP the K/V ring registered by
    :func:`initialize_metp` (it must hold ``tp_group``'s and ``cp_group``'s ranks) and the block
    index of each of its ranks. Read once, at construction."""
    cp = cp_group.size() if cp_group is not None else 1
    if cp == 1:
        return tp_group, None
    ring = _METP_KV_RING
    if ring is None:
        raise RuntimeError(
            "METP under --context-parallel-size > 1 needs its K/V ring: call "
            "megatron_metp.parallel_state.initialize_metp() after Megatron-Core's "
            "initialize_model_parallel")
    members = set(dist.get_process_group_ranks(ring[0]))
    wanted = set(dist.get_process_group_ranks(cp_group))
    if tp_group is not None:
        wanted |= set(dist.get_process_group_ranks(tp_group))
    if not wanted <= members:
        raise RuntimeError(f"METP's K/V ring {sorted(members)} does not hold the TP and CP "
                           f"ranks {sorted(wanted)}")
    return ring[0], ring[1]


def metp_kv_balanced_blocks(cp_group: Optional[dist.ProcessGroup]) -> Optional[Tuple[int, ...]]:
    """Under CP, each K/V ring rank's block index in the balanced layout (TP rank t of CP rank
    c: ``c TP + t``, ``megatron_metp.token_layout``); None without CP (index = ring rank).
    Read once, at construction, after :func:`metp_kv_ring`."""
    cp = cp_group.size() if cp_group is not None else 1
    if cp == 1 or _METP_KV_RING is None:
        return None
    return _METP_KV_RING[2]


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
    global _METP_GROUP, _METP_WEIGHT_GROUP, _WALLFACER_GROUPS, _METP_KV_RING
    _METP_GROUP = None
    _METP_WEIGHT_GROUP = None
    _METP_KV_RING = None
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
