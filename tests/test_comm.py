"""The ring communicator: blocks arrive from the right neighbour, in order, on every ring length."""

import gc
import weakref

import pytest
import torch
import torch.distributed as dist

from megatron_metp.comm import DoubleBuffer, P2PComm, RingComm
from tests._harness import run_ranks


def _ring_rotation(steps_per_block: int):
    rank, world = dist.get_rank(), dist.get_world_size()
    comm = RingComm(None)
    # A non-contiguous view, as chunk(dim=1) produces, must still be sendable.
    mine = torch.arange(6.0).reshape(2, 3).add(100 * rank).t()
    buf = DoubleBuffer(mine)
    seen = [buf.current.clone()]
    for _ in range(world - 1):
        comm.send_recv(buf.current, buf.recv_buffer())
        comm.commit()
        comm.wait()
        seen.append(buf.advance().clone())
    # After k steps, rank r holds the block of rank r - k.
    for k, blk in enumerate(seen):
        expect = torch.arange(6.0).reshape(2, 3).add(100 * ((rank - k) % world)).t()
        assert torch.equal(blk, expect), (rank, k)
    # The borrowed first block was never written.
    assert torch.equal(mine, torch.arange(6.0).reshape(2, 3).add(100 * rank).t())
    return len(seen)


@pytest.mark.parametrize("world", [1, 2, 4])
def test_ring_visits_every_block_once(world):
    assert run_ranks(world, _ring_rotation, 1) == [world] * world


def _sub_rings():
    # Two rings of length 2 on 4 ranks (0<->2, 1<->3) on subgroups, and a ring of length 1.
    rank = dist.get_rank()
    groups = [dist.new_group([0, 2]), dist.new_group([1, 3])]
    g = groups[rank % 2]
    comm = RingComm(g)
    out = comm.send_recv(torch.tensor([float(rank)]))
    comm.commit()
    comm.wait()
    partner = (rank + 2) % 4
    assert out.item() == partner
    solo = P2PComm(None, send_to=rank, recv_from=rank)
    got = solo.send_recv(torch.tensor([7.0 + rank]))
    solo.commit()
    solo.wait()
    assert got.item() == 7.0 + rank
    return True


def test_sub_rings_and_self_ring():
    assert all(run_ranks(4, _sub_rings))


def _misuse():
    comm = RingComm(None)
    comm.send_recv(torch.ones(1))
    comm.commit()
    with pytest.raises(RuntimeError, match="not waited"):
        comm.send_recv(torch.ones(1))
    comm.wait()
    return True


def test_misuse_is_refused():
    assert all(run_ranks(2, _misuse))


def _equal_one_by_one(ins, outs, single, p):
    """Each of ``outs`` equals ``single`` (one call) on its input; None stays None."""
    for t, out in zip(ins, outs):
        if t is None:
            assert out is None
            continue
        ref, h = single(t, None, p)
        h.wait()
        assert torch.equal(out, ref)


def _together():
    """gather_rows_together / scatter_rows_together against one gather_rows / scatter_rows per
    tensor: equal tensors (the same collectives' bytes), one handle waited for once, and the
    calls counted by the project's CommCounter (one per coalesced call)."""
    from megatron_metp.comm import (gather_rows, gather_rows_together, scatter_rows,
                                    scatter_rows_together)
    from megatron_metp.measure.comm_counter import CommCounter

    r, p = dist.get_rank(), dist.get_world_size()
    g = torch.Generator().manual_seed(r)
    # Two strided shards of one row shape (a row-parallel weight's rows of its transpose,
    # packed in one copy), a bias, a dense matrix, a None, another dtype (a call of its own).
    ts = [torch.randn(6, 3, generator=g).t(), torch.randn(5, generator=g), None,
          torch.randn(4, 3, generator=g), torch.randn(6, 2, generator=g).t(),
          torch.randn(2, 2, generator=g).to(torch.float64)]
    with CommCounter() as c:
        fulls, handle = gather_rows_together(ts, None, p)
    assert c.stats["all_gather"].calls == 2   # one per dtype
    handle.wait()
    handle.wait()   # a second wait returns at once
    _equal_one_by_one(ts, fulls, gather_rows, p)
    big = [torch.randn(3 * p, 4, generator=g), None, torch.randn(2 * p, generator=g)]
    with CommCounter() as c:
        mines, handle = scatter_rows_together([t.clone() if t is not None else None
                                               for t in big], None, p)
    assert c.stats["reduce_scatter"].calls == 1
    # The caller's inputs are gone (the clones above): the handle holds them until waited
    # for, since gloo's coalesced reduce-scatter does not (else its thread reads freed memory).
    gc.collect()
    held = [weakref.ref(t) for t in handle._tensors]
    assert len(held) == 4 and all(r() is not None for r in held)
    handle.wait()
    gc.collect()
    assert not handle._tensors
    _equal_one_by_one(big, mines, scatter_rows, p)
    return True


def test_rows_together_equal_one_call_per_tensor():
    assert all(run_ranks(4, _together))


def test_call_groups():
    from megatron_metp.comm import call_groups

    w = torch.empty(4, 4)             # 64 bytes; 4 x 64 = 256 gathered
    b = torch.empty(4)
    # A bias always goes with the call before it; matrices join while the call's gathered
    # bytes stay within the limit.
    assert call_groups([w, b, w, None, w], 4, max_bytes=600) == [[0, 1, 2], [4]]
    assert call_groups([w, b, w, b], 4, max_bytes=512) == [[0, 1], [2, 3]]
    assert call_groups([None, b, w], 4, max_bytes=10 ** 6) == [[1, 2]]


def test_shared_work_waits_for_every_call_even_after_a_failed_wait():
    """A coalesced call's handle: waited for once; a work whose wait raised is waited for
    again by the next wait, and the works after it too (nothing is left in flight)."""
    from megatron_metp.comm import SharedWork

    class Work:
        def __init__(self, fails):
            self.fails, self.waits = fails, 0

        def wait(self):
            self.waits += 1
            if self.waits <= self.fails:
                raise RuntimeError("timed out")

    a, b = Work(1), Work(0)
    shared = SharedWork([a, b])
    with pytest.raises(RuntimeError):
        shared.wait()
    assert (a.waits, b.waits) == (1, 0)
    shared.wait()
    assert (a.waits, b.waits) == (2, 1)
    shared.wait()   # done: returns at once
    assert (a.waits, b.waits) == (2, 1)
