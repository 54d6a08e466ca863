"""WallFacer process groups: teams, team groups and sub-rings inside Megatron's CP group.

The WallFacer group *is* Megatron-Core's context-parallel group (weights are replicated across
it; Megatron's DDP already reduces gradients over data x context ranks), so WallFacer composes
with TP, DP and PP exactly as Megatron's own context parallelism does. Megatron has no hook for
extra groups, so ``scheduler.initialize_wallfacer`` builds them beside Megatron's: it learns every
context-parallel group (one ``all_gather_object`` of each rank's
``get_context_parallel_global_ranks()``), then every rank creates every team's process group in
the same order (``new_group`` is collective over the world). Sub-rings need no process group:
their P2P runs on the context-parallel group, addressed by context-parallel rank.

Context-parallel rank = index in ``sorted(global ranks)`` = Megatron's
``get_context_parallel_rank()``, so the token layout of ``get_batch_on_this_cp_rank`` holds.
"""

from __future__ import annotations

import datetime

from dataclasses import dataclass
from typing import List, Optional, Sequence

import torch
import torch.distributed as dist

from megatron_metp.wallfacer import config_generator as cg


@dataclass
class WallFacerGroups:
    """Everything one rank needs to run WallFacer attention (read once, at construction).

    Indices (``idx``, ``init_send_to``, ...) are context-parallel ranks (``cp_group`` ranks).
    """

    cp_group: Optional[dist.ProcessGroup]
    cp_global_ranks: List[int]   # sorted; position = context-parallel rank
    team_group_pg: Optional[dist.ProcessGroup]   # the C ranks of this rank's team
    cp_size: int
    team_size: int
    placement: str
    idx: int                     # this rank's context-parallel rank
    team: int
    member: int                  # == rank in team_group_pg (new_group sorts; members ascend)
    init_send_to: int
    init_recv_from: int
    ring_next: int
    ring_prev: int
    layout: str = "zigzag"

    @property
    def ring_length(self) -> int:
        """G = P / C^2 (ring steps per attention)."""
        return self.cp_size // (self.team_size * self.team_size)


def plan_for(idx: int, cp_size: int, team_size: int, placement: str,
             cp_global_ranks: Optional[Sequence[int]] = None, layout: str = "zigzag",
             cp_group=None, team_pg=None) -> WallFacerGroups:
    """The pure part of a rank's configuration (no process group is created)."""
    cg.check_team_size(cp_size, team_size)
    cg.check_placement(placement)
    team, member = cg.coords_of(idx, cp_size, team_size, placement)
    nxt, prv = cg.ring_next_prev(idx, cp_size, team_size, placement)
    return WallFacerGroups(
        cp_group=cp_group,
        cp_global_ranks=list(cp_global_ranks if cp_global_ranks is not None else range(cp_size)),
        team_group_pg=team_pg,
        cp_size=cp_size, team_size=team_size, placement=placement, idx=idx,
        team=team, member=member,
        init_send_to=cg.init_send_to(idx, cp_size, team_size, placement),
        init_recv_from=cg.init_recv_from(idx, cp_size, team_size, placement),
        ring_next=nxt, ring_prev=prv, layout=layout,
    )


def _warm_up(cp_group: Optional[dist.ProcessGroup], team_pg: Optional[dist.ProcessGroup]) -> None:
    """Create the NCCL communicators now, with every member present.

    NCCL builds a group's communicator lazily, collectively over all its ranks, on first use.
    With ring length P/C^2 = 1 the only P2P on the CP group is the initial K/V send, which the
    ranks that keep their own K/V skip; a sender would then wait for a communicator its skipping
    peers never help create. One all-reduce per group here cannot deadlock: every rank of the
    CP group (and of its team) calls it in the same order.
    """
    if dist.get_backend() != "nccl":
        return
    probe = torch.zeros(1, device=torch.device("cuda", torch.cuda.current_device()))
    for pg in (cp_group, team_pg):
        if pg is not None:
            dist.all_reduce(probe, group=pg)


def build_wallfacer_groups(all_cp_groups: Sequence[Sequence[int]], my_cp_ranks: Sequence[int],
                           cp_group: Optional[dist.ProcessGroup], team_size: int,
                           placement: str = "collective_intra",
                           layout: str = "zigzag",
                           timeout: Optional[datetime.timedelta] = None) -> WallFacerGroups:
    """Create every team's group (collective over the world, same order everywhere).

    all_cp_groups   every context-parallel group's global ranks (identical on every rank)
    my_cp_ranks     this rank's context-parallel group
    cp_group        the process group over ``my_cp_ranks`` (None: the world, if that is the CP
                    group)
    """
    groups = sorted(sorted(g) for g in all_cp_groups)
    mine = sorted(my_cp_ranks)
    cp_size = len(mine)
    cg.check_team_size(cp_size, team_size)
    cg.check_placement(placement)
    me = dist.get_rank()
    my_team_pg = None
    for ranks in groups:
        if len(ranks) != cp_size:
            raise ValueError("context-parallel groups of different sizes")
        for team in range(cp_size // team_size):
            members = [ranks[i] for i in cg.team_members(team, cp_size, team_size, placement)]
            # Every rank calls new_group for every team, in this fixed order (it is collective).
            # The timeout is Megatron's --distributed-timeout-minutes: new_group does not inherit
            # the world group's, so a dead peer would otherwise block a team collective 30 min.
            pg = dist.new_group(members, timeout=timeout) if team_size > 1 else None
            if me in members:
                my_team_pg = pg
    idx = mine.index(me)
    plan = plan_for(idx, cp_size, team_size, placement, mine, layout, cp_group, my_team_pg)
    _warm_up(cp_group, my_team_pg)
    if my_team_pg is not None and dist.get_rank(my_team_pg) != plan.member:
        raise RuntimeError("team process group rank differs from the member index")
    return plan
