"""The rank pool's failure reports (tests/_harness.py): CI's only view of a multi-rank failure is
this message. A failed rank reports at once and keeps its groups open until the pool ends it;
a rank that has not reported when the pool gives up shows where it waited. Before, a peer of the
failed rank reported only gloo's "Connection closed by peer", and the failed rank's own error
could be lost behind its tear-down."""

from __future__ import annotations

import os

import pytest

from tests._harness import RankPool

# In the full tier: ~15 s of pools killed on purpose, for the harness's own messages.
pytestmark = pytest.mark.full


def _nothing():
    return True


def _waits_in_a_barrier():
    import torch.distributed as dist

    dist.barrier()  # blocks in gloo's C++ until its peer comes (the group's timeout is 90 s)


def _sleeps():
    import time

    time.sleep(120)


def _rank0_fails_rank1_waits_for_it():
    import torch.distributed as dist

    dist.barrier()  # both ranks are in the task
    if dist.get_rank() == 0:
        raise RuntimeError("rank 0 fails")
    _waits_in_a_barrier()


def _rank0_sleeps_rank1_waits_for_it():
    import torch.distributed as dist

    dist.barrier()
    if dist.get_rank() == 0:
        _sleeps()
    _waits_in_a_barrier()


def _started_pool(grace: float) -> RankPool:
    """A pool whose ranks have finished starting (a first task), so that what a test measures
    against ``grace`` and ``timeout`` is the task, not the workers' start-up."""
    pool = RankPool(2, keeps_workers=False)
    pool.grace = grace
    assert pool.run(_nothing, timeout=120) == [True, True]
    return pool


def _failure(fn, error, timeout: float) -> str:
    """The message of the ``error`` that ``fn`` raises on a started 2-rank pool; checks that
    the pool's workers and stack files are gone afterwards."""
    pool = _started_pool(grace=3.0)
    stack_dir, procs = pool._stack_dir, list(pool._procs)
    try:
        with pytest.raises(error) as err:
            pool.run(fn, timeout=timeout)
    finally:
        pool.close(kill=True)
    assert not any(p.is_alive() for p in procs)
    assert not os.path.exists(stack_dir)
    return str(err.value)


def test_a_silent_rank_s_stack_is_in_the_failure():
    """Stop 61's CI failure, told completely: rank 0 raises while rank 1 waits for it in a
    collective. The failure names rank 0's error as the first reported, and shows rank 1's
    stack in the collective (the handler writes while gloo blocks in C++); rank 1 does not fail
    with "Connection closed by peer", since rank 0 keeps its groups open. Then a timeout, no
    rank reporting: both stacks. No worker or stack file is left behind."""
    msg = _failure(_rank0_fails_rank1_waits_for_it, AssertionError, timeout=120)
    assert "failed on ranks [0] (first reported: rank 0)" in msg, msg
    assert "RuntimeError: rank 0 fails" in msg, msg
    rank1 = msg.split("--- rank 1 did not report; its threads' Python stacks ---")[1]
    assert "in barrier" in rank1 and "in _waits_in_a_barrier" in rank1, msg
    assert "Connection closed" not in msg, msg
    assert "--- rank 0 did not report" not in msg, msg

    msg = _failure(_rank0_sleeps_rank1_waits_for_it, TimeoutError, timeout=5)
    assert "ranks [0, 1] did not finish within 5 s" in msg, msg
    rank0, rank1 = msg.split("--- rank 0 did not report")[1].split("--- rank 1 did not report")
    assert "in _sleeps" in rank0, msg
    assert "in barrier" in rank1 and "in _waits_in_a_barrier" in rank1, msg
