"""WallFacer's configuration generator (Alg. 2-3), both placements, and the zigzag balance.

Pure logic, no ranks: every claim of ``config_generator``'s docstring is checked by brute force
over the schedule it produces.
"""

import inspect
import itertools

import pytest
import torch

from megatron_metp.wallfacer import config_generator as cg
from megatron_metp.wallfacer import zigzag

CASES = [(P, C, pl) for P in (1, 4, 8, 16, 32, 64) for C in cg.valid_team_sizes(P)
         for pl in cg.PLACEMENTS]


def test_valid_team_sizes():
    assert cg.valid_team_sizes(4) == [1, 2]
    assert cg.valid_team_sizes(8) == [1, 2]
    assert cg.valid_team_sizes(16) == [1, 2, 4]
    assert cg.valid_team_sizes(64) == [1, 2, 4, 8]
    with pytest.raises(ValueError, match="--wallfacer-team-size 3.*--context-parallel-size"):
        cg.check_team_size(8, 3)
    with pytest.raises(ValueError, match="--wallfacer-team-size 4"):
        cg.check_team_size(8, 4)   # 16 does not divide 8
    with pytest.raises(ValueError, match="--wallfacer-placement"):
        cg.check_placement("nodes")


@pytest.mark.parametrize("P,C", [(P, C) for P in (4, 8, 16, 64) for C in cg.valid_team_sizes(P)])
def test_paper_algorithms_match_general_form(P, C):
    """Alg. 2/3 as printed equal the placement-independent form for teams on consecutive ranks."""
    T = P // C
    for idx in range(P):
        r_t, r_a = divmod(idx, C)
        assert cg.get_init_send(r_t, r_a, T, C) == cg.init_send_to(idx, P, C, "collective_intra")
        assert cg.get_init_recv(r_t, r_a, T, C) == cg.init_recv_from(idx, P, C, "collective_intra")
        assert cg.get_P2P_config(r_t, r_a, T, C) == cg.ring_next_prev(idx, P, C, "collective_intra")


@pytest.mark.parametrize("P,C,placement", CASES)
def test_schedule_covers_every_pair_once(P, C, placement):
    G = P // (C * C)
    # placement is a bijection
    assert sorted(cg.index_of(*cg.coords_of(i, P, C, placement), P, C, placement)
                  for i in range(P)) == list(range(P))
    send = [cg.init_send_to(i, P, C, placement) for i in range(P)]
    recv = [cg.init_recv_from(i, P, C, placement) for i in range(P)]
    assert sorted(send) == list(range(P))                    # a permutation ...
    assert all(recv[send[i]] == i for i in range(P))         # ... whose inverse is recv
    assert sum(send[i] == i for i in range(P)) == cg.num_self_sends(P, C)
    # The K/V a rank receives at init is the team of its sender, as the ring's step 0 assumes.
    for i in range(P):
        assert cg.coords_of(recv[i], P, C, placement)[0] == cg.kv_team_at_step(i, 0, P, C,
                                                                              placement)
    # Ring: next/prev inverse; ring steps move K/V as kv_team_at_step says.
    for i in range(P):
        nxt, prv = cg.ring_next_prev(i, P, C, placement)
        assert cg.ring_next_prev(nxt, P, C, placement)[1] == i
        for s in range(1, G):
            assert cg.kv_team_at_step(nxt, s, P, C, placement) == cg.kv_team_at_step(
                i, s - 1, P, C, placement)
    # Every team's queries meet every team's keys exactly once (forward) ...
    met = {}
    for i in range(P):
        t, _ = cg.coords_of(i, P, C, placement)
        for s in range(G):
            key = (t, cg.kv_team_at_step(i, s, P, C, placement))
            met[key] = met.get(key, 0) + 1
    assert met == {(a, b): 1 for a in range(P // C) for b in range(P // C)}
    # ... and in the backward, where queries travel and K/V stay put.
    met = {}
    for i in range(P):
        kv = cg.kv_team_at_step(i, 0, P, C, placement)
        for s in range(G):
            key = (cg.q_team_at_step(i, s, P, C, placement), kv)
            met[key] = met.get(key, 0) + 1
    assert met == {(a, b): 1 for a in range(P // C) for b in range(P // C)}
    # Placement: teams or sub-rings on consecutive ranks.
    for t in range(P // C):
        m = cg.team_members(t, P, C, placement)
        if placement == "collective_intra":
            assert m == list(range(t * C, t * C + C))
    for g, mm in itertools.product(range(C), range(C)):
        ring = cg.sub_ring(g, mm, P, C, placement)
        assert len(ring) == G
        if placement == "p2p_intra":
            assert ring == list(range(ring[0], ring[0] + G))


def test_paper_figure5_example():
    """Fig. 5: 8 GPUs, C = 2, teams consecutive: teams 0,1 form team group 0."""
    P, C = 8, 2
    # Team 0 = ranks 0,1; member 0 of team 0 keeps its K/V (sub-ring (0,0) carries teams 0, 2).
    assert cg.init_send_to(0, P, C, "collective_intra") == 0
    assert cg.init_send_to(1, P, C, "collective_intra") == 4   # member 1 -> team group 1
    assert cg.sub_ring(0, 0, P, C, "collective_intra") == [0, 2]
    assert [cg.kv_team_at_step(0, s, P, C, "collective_intra") for s in (0, 1)] == [0, 2]


@pytest.mark.parametrize("P,C,placement", [c for c in CASES if c[0] > 1])
def test_zigzag_causal_work_is_balanced(P, C, placement):
    """Megatron's layout: every rank does 2 C^2 chunk-pair units at every ring step."""
    work = zigzag.causal_work_per_step(P, C, placement, causal=True)
    assert all(w == 2 * C * C for row in work for w in row)
    # The contiguous layout is not balanced (the reason to keep Megatron's).
    cont = zigzag.causal_work_per_step(P, C, placement, causal=True, layout="contiguous")
    totals = [sum(r) for r in cont]
    if P // (C * C) > 1 or C > 1:
        assert max(totals) > min(totals)


def test_positions_match_megatron_slicing(monkeypatch):
    from megatron.core import utils as mcore_utils

    s, P = 16, 4
    full = torch.arange(s)
    shards = [zigzag.shard_sequence(full, r, P) for r in range(P)]
    for r in range(P):
        # Megatron's own slicing of a [b, s] batch as context-parallel rank r of P (its rank and
        # size come from parallel_state, set here without a process group).
        monkeypatch.setattr(mcore_utils.parallel_state, "get_context_parallel_world_size",
                            lambda: P)
        monkeypatch.setattr(mcore_utils.parallel_state, "get_context_parallel_rank", lambda: r)
        kw = {}
        if "is_hybrid_cp" in inspect.signature(mcore_utils.get_batch_on_this_cp_rank).parameters:
            # core 0.19 reads rank and size from torch.distributed on its cp_group argument.
            monkeypatch.setattr(torch.distributed, "get_world_size", lambda group=None: P)
            monkeypatch.setattr(torch.distributed, "get_rank", lambda group=None: r)
            kw["is_hybrid_cp"] = False
        ref = mcore_utils.get_batch_on_this_cp_rank({"tokens": full[None].clone()},
                                                    **kw)["tokens"][0]
        # ... which is chunks r and 2P-1-r of 2P, written out: the layout the code relies on.
        assert ref.tolist() == full.view(2 * P, -1)[[r, 2 * P - 1 - r]].reshape(-1).tolist()
        assert torch.equal(shards[r], ref)
        assert torch.equal(zigzag.position_ids(s, r, P), ref)
    assert torch.equal(zigzag.unshard_sequence(shards), full)
    emb = torch.randn(s, 1, 1, 4)
    assert torch.equal(zigzag.slice_rotary_pos_emb(emb, 1, P)[:, 0, 0],
                       emb[zigzag.position_ids(s, 1, P)][:, 0, 0])
