"""The topology scheduler: candidates, locality, the pick, and a real profile on 8 ranks."""

import torch.distributed as dist

from megatron_metp.wallfacer import scheduler
from tests._harness import run_ranks


def test_candidates_and_locality():
    assert scheduler.candidates(16) == [(1, "collective_intra"), (2, "collective_intra"),
                                        (2, "p2p_intra"), (4, "collective_intra")]
    # The placements are the same rank map when C = 1 or C = sqrt(P): one candidate each.
    from megatron_metp.wallfacer import config_generator as cg
    for P, C in ((16, 1), (16, 4), (4, 2)):
        assert [cg.index_of(*cg.coords_of(i, P, C, "collective_intra"), P, C, "p2p_intra")
                for i in range(P)] == list(range(P))
    # 16 ranks on nodes of 4, C = 2 (G = 4): teams consecutive keep the team in a node but
    # spread each sub-ring over nodes; sub-rings consecutive do the opposite.
    assert scheduler.locality(16, 2, "collective_intra", 4) == dict(team_intra_node=True,
                                                                    ring_intra_node=False)
    assert scheduler.locality(16, 2, "p2p_intra", 4) == dict(team_intra_node=False,
                                                             ring_intra_node=True)
    times = {(1, "collective_intra"): 3.0, (2, "collective_intra"): 2.0, (2, "p2p_intra"): 2.0}
    assert scheduler.pick_fastest(times) == (2, "collective_intra")
    times[(2, "p2p_intra")] = 1.0
    assert scheduler.pick_fastest(times) == (2, "p2p_intra")


def _schedule(shape):
    P = dist.get_world_size()
    sched = scheduler.auto_select(shape=shape, gpus_per_node=2, warmup=1, iters=1,
                                  all_cp_groups=[list(range(P))], my_cp_ranks=list(range(P)),
                                  cp_group=None, verbose=False)
    return sched.team_size, sched.placement, sched.times, sched.table


def test_auto_select_profiles_every_candidate(report):
    shape = dict(b=1, s=64, n=4, n_kv=2, d=8)
    res = run_ranks(8, _schedule, shape, timeout=300)
    c, pl, times, table = res[0]
    assert set(times) == set(scheduler.candidates(8))
    assert all(t > 0 for t in times.values())
    # Every rank made the same choice, from the same (all-reduced) times, and it is the argmin.
    assert all(r[:3] == (c, pl, times) for r in res)
    assert (c, pl) == scheduler.pick_fastest(times)
    report("wallfacer scheduler (P=8, 2 ranks per node, s=64, CPU gloo):\n" + table)
