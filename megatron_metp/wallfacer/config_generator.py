"""WallFacer's communication configuration generator (paper Sec. 3.3, Alg. 2-3).

Vocabulary (P ranks of one context-parallel group, team size C, ``C^2 | P``)::

    teams         T = P / C       team t = (team group g, index j in the group): t = g * G + j
    team groups   C               each of G = P / C^2 consecutive teams
    sub-rings     C^2             ring (g, m): member m of every team of team group g, length G
    member        m in [0, C)     a rank's index inside its team

Every rank is a logical coordinate ``(t, m)``; a *placement* maps it to an index in the
context-parallel group (the order of ``sorted(get_context_parallel_global_ranks())``, which is
Megatron's context-parallel rank):

    collective_intra   idx = t * C + m            teams on consecutive ranks (paper's Alg. 2):
                                                 all-gather / reduce-scatter stay inside a node
    p2p_intra          idx = (g * C + m) * G + j  sub-rings on consecutive ranks: the ring P2P
                                                 stays inside a node

Receive map (derived from Alg. 2): rank (g, j, m) receives the team K/V of team ``j * C + m``
from that team's member ``g``. Its sub-ring (g, m) therefore carries the K/V of the G teams
``j' * C + m`` (all teams congruent to m mod C); the C members of a team together see every
team's K/V exactly once. Rank (t, m) sends its team's K/V to team ``m * G + t // C``, member
``t % C``. The ranks that send to themselves solve ``q (C - 1) = m (G - 1)`` with
``t = q C + m``: there are ``gcd(C - 1, G - 1) + 1`` of them (:func:`num_self_sends`) -- C when
G = 1 or C = 2 or C = G, all P when C = 1, but e.g. 2 (not C = 4) for P = 32, C = 4.

Ring (Alg. 3): rank (g, j, m) sends to (g, j + 1, m) and receives from (g, j - 1, m), both mod G.
After ring step s it holds the K/V of team ``((j - s) mod G) * C + m``.
"""

from __future__ import annotations

import math
from typing import List, Optional, Tuple

PLACEMENTS = ("collective_intra", "p2p_intra")


def check_team_size(cp_size: int, team_size: int) -> None:
    """C must be a positive integer with C^2 dividing P (so C <= sqrt(P))."""
    if team_size < 1 or cp_size % (team_size * team_size) != 0:
        valid = valid_team_sizes(cp_size)
        raise ValueError(
            f"--wallfacer-team-size {team_size}: WallFacer needs C^2 to divide the "
            f"context-parallel size P = {cp_size} (--context-parallel-size); valid team sizes "
            f"for P = {cp_size} are {valid}"
        )


def valid_team_sizes(cp_size: int) -> List[int]:
    """Every C in [1, sqrt(P)] with C^2 | P."""
    return [c for c in range(1, math.isqrt(cp_size) + 1) if cp_size % (c * c) == 0]


def num_self_sends(cp_size: int, team_size: int) -> int:
    """How many ranks send their initial K/V to themselves: gcd(C - 1, G - 1) + 1."""
    G = cp_size // (team_size * team_size)
    return math.gcd(team_size - 1, G - 1) + 1


def check_placement(placement: str) -> None:
    if placement not in PLACEMENTS:
        raise ValueError(
            f"--wallfacer-placement {placement!r}: choose one of {', '.join(PLACEMENTS)}"
        )


# ----------------------------------------------------------------------------------------------
# The paper's Alg. 2 and 3, literally (placement collective_intra; ranks are group indices).
# d_t = number of teams (P / C), d_a = team size (C); r_t = team index, r_a = member index.
# ----------------------------------------------------------------------------------------------


def get_init_send(r_t: int, r_a: int, d_t: int, d_a: int) -> int:
    """Alg. 2: the group index this rank sends its gathered team K/V to (teams consecutive)."""
    team_group_size = d_t // d_a
    target_team_group = r_a
    target_team = target_team_group * team_group_size + r_t // d_a
    target_member = r_t % d_a
    return target_team * d_a + target_member


def get_init_recv(r_t: int, r_a: int, d_t: int, d_a: int) -> int:
    """The inverse of Alg. 2 (the paper: "the receiving source can be calculated similarly").

    Rank (team r_t = g * G + j, member r_a) receives the K/V of team j * d_a + r_a from its
    member g.
    """
    team_group_size = d_t // d_a
    g, j = divmod(r_t, team_group_size)
    source_team = j * d_a + r_a
    return source_team * d_a + g


def get_P2P_config(r_t: int, r_a: int, d_t: int, d_a: int) -> Tuple[int, int]:  # noqa: N802
    """Alg. 3: (next, last) group indices of this rank's sub-ring (teams consecutive)."""
    team_group_size = d_t // d_a
    self_team_group = r_t // team_group_size
    next_team = (r_t + 1) % team_group_size + team_group_size * self_team_group
    last_team = (r_t - 1) % team_group_size + team_group_size * self_team_group
    return r_a + next_team * d_a, r_a + last_team * d_a


# ----------------------------------------------------------------------------------------------
# Placement-independent form: logical coordinates (t, m) and a placement map.
# ----------------------------------------------------------------------------------------------


def index_of(team: int, member: int, cp_size: int, team_size: int, placement: str) -> int:
    """Group index of logical rank (team, member)."""
    C, G = team_size, cp_size // (team_size * team_size)
    if placement == "collective_intra":
        return team * C + member
    g, j = divmod(team, G)
    return (g * C + member) * G + j


def coords_of(index: int, cp_size: int, team_size: int, placement: str) -> Tuple[int, int]:
    """(team, member) of group index ``index``; the inverse of :func:`index_of`."""
    C, G = team_size, cp_size // (team_size * team_size)
    if placement == "collective_intra":
        return divmod(index, C)
    gm, j = divmod(index, G)
    g, m = divmod(gm, C)
    return g * G + j, m


def team_members(team: int, cp_size: int, team_size: int, placement: str) -> List[int]:
    """Group indices of a team, in member order."""
    return [index_of(team, m, cp_size, team_size, placement) for m in range(team_size)]


def sub_ring(team_group: int, member: int, cp_size: int, team_size: int, placement: str):
    """Group indices of sub-ring (g, m), in ring order."""
    G = cp_size // (team_size * team_size)
    return [index_of(team_group * G + j, member, cp_size, team_size, placement) for j in range(G)]


def init_send_to(index: int, cp_size: int, team_size: int, placement: str) -> int:
    t, m = coords_of(index, cp_size, team_size, placement)
    C, G = team_size, cp_size // (team_size * team_size)
    return index_of(m * G + t // C, t % C, cp_size, team_size, placement)


def init_recv_from(index: int, cp_size: int, team_size: int, placement: str) -> int:
    t, m = coords_of(index, cp_size, team_size, placement)
    C, G = team_size, cp_size // (team_size * team_size)
    g, j = divmod(t, G)
    return index_of(j * C + m, g, cp_size, team_size, placement)


def ring_next_prev(index: int, cp_size: int, team_size: int, placement: str) -> Tuple[int, int]:
    t, m = coords_of(index, cp_size, team_size, placement)
    G = cp_size // (team_size * team_size)
    g, j = divmod(t, G)
    nxt = index_of(g * G + (j + 1) % G, m, cp_size, team_size, placement)
    prv = index_of(g * G + (j - 1) % G, m, cp_size, team_size, placement)
    return nxt, prv


def kv_team_at_step(index: int, step: int, cp_size: int, team_size: int, placement: str) -> int:
    """The team whose K/V rank ``index`` holds at forward ring step ``step`` (0-based)."""
    t, m = coords_of(index, cp_size, team_size, placement)
    C, G = team_size, cp_size // (team_size * team_size)
    j = t % G
    return ((j - step) % G) * C + m


def q_team_at_step(index: int, step: int, cp_size: int, team_size: int, placement: str) -> int:
    """The team whose queries rank ``index`` holds at backward ring step ``step``."""
    t, _ = coords_of(index, cp_size, team_size, placement)
    G = cp_size // (team_size * team_size)
    g, j = divmod(t, G)
    return g * G + (j - step) % G


def validate_wallfacer(cp_size: int, team_size, seq_length: int, *,
                       num_attention_heads: Optional[int] = None,
                       num_query_groups: Optional[int] = None,
                       tensor_model_parallel_size: int = 1,
                       placement: str = "collective_intra",
                       cp_comm_type: Optional[str] = "wallfacer") -> None:
    """Start-up checks for ``--tensor-parallel-mode wallfacer`` (pure; raises ValueError).

    ``team_size`` may be ``"auto"`` (the topology scheduler picks a valid C later). Heads need
    not divide P (WallFacer shards the sequence, not heads); query groups must divide the heads
    and the tensor-parallel size, as for Megatron's attention.
    """
    if cp_size < 1:
        raise ValueError(f"--context-parallel-size must be >= 1, got {cp_size}")
    if team_size != "auto":
        if not isinstance(team_size, int):
            raise ValueError(f"--wallfacer-team-size must be an integer or 'auto', got "
                             f"{team_size!r}")
        check_team_size(cp_size, team_size)
    check_placement(placement)
    if seq_length % (2 * cp_size) != 0:
        raise ValueError(
            f"--seq-length {seq_length} must be divisible by 2 x --context-parallel-size = "
            f"{2 * cp_size}: WallFacer keeps Megatron's zigzag layout (2P chunks); pad the "
            f"sequence to a multiple of {2 * cp_size}"
        )
    if num_query_groups is not None:
        heads = num_attention_heads if num_attention_heads is not None else num_query_groups
        if num_query_groups < 1 or heads % num_query_groups != 0:
            raise ValueError(
                f"--num-query-groups {num_query_groups} must divide --num-attention-heads "
                f"{heads}"
            )
        if num_query_groups % tensor_model_parallel_size != 0:
            raise ValueError(
                f"--num-query-groups {num_query_groups} must be divisible by "
                f"--tensor-model-parallel-size {tensor_model_parallel_size} (each TP rank keeps "
                f"whole K/V heads, which then travel WallFacer's rings)"
            )
    if cp_comm_type not in (None, "wallfacer"):
        raise ValueError(
            f"--cp-comm-type {cp_comm_type!r} conflicts with --tensor-parallel-mode wallfacer: "
            f"drop it or pass --cp-comm-type wallfacer"
        )
