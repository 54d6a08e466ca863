"""The ring communicator: blocks arrive from the right neighbour, in order, on every ring length."""

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
