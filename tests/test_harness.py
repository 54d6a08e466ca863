"""The rank pool's failure reports (tests/_harness.py): a rank that has not reported when the
pool gives up shows where it waited. CI's only view of a multi-rank failure is this message; a
gloo error on one rank ("Connection closed by peer") says little without its peer's stack."""

from __future__ import annotations

import os

import pytest

from tests._harness import RankPool


def _waits_in_a_barrier():
    import torch.distributed as dist

    dist.barrier()  # blocks in gloo's C++ until its peer comes, or the 90 s group timeout


def _rank0_fails_rank1_waits():
    import torch.distributed as dist

    if dist.get_rank() == 0:
        raise RuntimeError("rank 0 fails at once")
    _waits_in_a_barrier()


def _every_rank_waits():
    import time

    time.sleep(120)


def _pool(grace: float) -> RankPool:
    pool = RankPool(2, keeps_workers=False)
    pool.grace = grace
    return pool


def test_a_silent_rank_s_stack_is_in_the_failure():
    """Rank 0 raises; rank 1 waits in a collective for it. The failure names rank 0's error and
    shows rank 1's Python stack at the barrier (the handler writes while gloo blocks in C++).
    Then the same for a timeout, where no rank reports: both stacks. No worker or stack file
    is left behind."""
    pool = _pool(grace=1.0)
    stack_dir = pool._stack_dir
    procs = list(pool._procs)
    with pytest.raises(AssertionError) as err:
        pool.run(_rank0_fails_rank1_waits, timeout=120)
    msg = str(err.value)
    assert "failed on ranks [0]" in msg and "rank 0 fails at once" in msg, msg
    assert "--- rank 1 did not report" in msg, msg
    assert "in _waits_in_a_barrier" in msg and "in _rank0_fails_rank1_waits" in msg, msg
    assert "--- rank 0 did not report" not in msg, msg
    assert not pool._procs and not any(p.is_alive() for p in procs)
    assert not os.path.exists(stack_dir)

    pool = _pool(grace=1.0)
    with pytest.raises(TimeoutError) as err:
        pool.run(_every_rank_waits, timeout=3)
    msg = str(err.value)
    assert "ranks [0, 1] did not finish within 3 s" in msg, msg
    for r in (0, 1):
        section = msg.split(f"--- rank {r} did not report")[1]
        assert "in _every_rank_waits" in section.split("--- rank")[0], msg
    assert not pool._procs
