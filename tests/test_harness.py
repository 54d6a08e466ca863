"""The rank pool's failure reports (tests/_harness.py): CI's only view of a multi-rank failure is
this message. A rank reports its error before its tear-down; a rank that has not reported when
the pool gives up shows where it waited (a gloo error on one rank, such as "Connection closed by
peer", says little without its peer's stack)."""

from __future__ import annotations

import os

import pytest

from tests._harness import RankPool

# In the full tier: ~10 s of pools killed on purpose, for the harness's own messages.
pytestmark = pytest.mark.full


def _sleeps():
    import time

    time.sleep(120)


def _waits_in_a_barrier():
    import torch.distributed as dist

    dist.barrier()  # blocks in gloo's C++ until its peer comes, or the 90 s group timeout


def _rank0_fails_rank1_sleeps():
    import torch.distributed as dist

    if dist.get_rank() == 0:
        raise RuntimeError("rank 0 fails at once")
    _sleeps()


def _rank0_sleeps_rank1_waits():
    import torch.distributed as dist

    if dist.get_rank() == 0:
        _sleeps()
    _waits_in_a_barrier()


def _pool(grace: float) -> RankPool:
    pool = RankPool(2, keeps_workers=False)
    pool.grace = grace
    return pool


def test_a_silent_rank_s_stack_is_in_the_failure():
    """Rank 0 raises while rank 1 is busy: the failure shows rank 0's error and rank 1's Python
    stack. Then a timeout, with rank 1 blocked in a collective (the handler writes while gloo
    blocks in C++): both ranks' stacks. No worker or stack file is left behind."""
    pool = _pool(grace=1.0)
    stack_dir, procs = pool._stack_dir, list(pool._procs)
    with pytest.raises(AssertionError) as err:
        pool.run(_rank0_fails_rank1_sleeps, timeout=120)
    msg = str(err.value)
    assert "failed on ranks [0] (first reported: rank 0)" in msg, msg
    assert "RuntimeError: rank 0 fails at once" in msg, msg
    rank1 = msg.split("--- rank 1 did not report; its threads' Python stacks ---")[1]
    assert "in _sleeps" in rank1 and "in _rank0_fails_rank1_sleeps" in rank1, msg
    assert "--- rank 0 did not report" not in msg, msg
    assert not pool._procs and not any(p.is_alive() for p in procs)
    assert not os.path.exists(stack_dir)

    pool = _pool(grace=1.0)
    with pytest.raises(TimeoutError) as err:
        pool.run(_rank0_sleeps_rank1_waits, timeout=3)
    msg = str(err.value)
    assert "ranks [0, 1] did not finish within 3 s" in msg, msg
    rank0, rank1 = msg.split("--- rank 0 did not report")[1].split("--- rank 1 did not report")
    assert "in _sleeps" in rank0, msg
    assert "in barrier" in rank1 and "in _waits_in_a_barrier" in rank1, msg
    assert not pool._procs
