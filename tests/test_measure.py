"""The communication counter and the memory tracker read known payloads and known allocations.

Every expected number here is written from the op's definition (e.g. an all-gather of a 3-element
shard on 2 ranks has a 6-element payload), never from the counter's own output.
"""

import subprocess
import sys
import textwrap

import pytest
import torch
import torch.distributed as dist

from megatron_metp.measure.comm_counter import CommCounter, sent_elements
from megatron_metp.measure.memory import PeakMemory
from tests._harness import run_ranks


class _AllReduceInBackward(torch.autograd.Function):
    """Identity forward, all-reduce of the gradient in backward (Megatron's ``f`` operator)."""

    @staticmethod
    def forward(ctx, x):
        return x.view_as(x)

    @staticmethod
    def backward(ctx, g):
        g = g.clone()
        dist.all_reduce(g)
        return g


def _every_op():
    import torch.distributed._functional_collectives as fc

    rank, p = dist.get_rank(), dist.get_world_size()
    peer = 1 - rank
    x = torch.ones(3, dtype=torch.float32)
    h = torch.ones(5, dtype=torch.bfloat16)
    with CommCounter() as cc:
        dist.all_gather_into_tensor(torch.empty(3 * p), x)                   # payload 6 (output)
        dist.all_gather([torch.empty(3) for _ in range(p)], x)               # 6
        dist.reduce_scatter_tensor(torch.empty(2), torch.ones(2 * p))        # 4 (input)
        dist.reduce_scatter(torch.empty(2), [torch.ones(2) for _ in range(p)])  # 4
        dist.all_reduce(h)                                                   # 5 bf16
        dist.broadcast(x, src=0)                                             # 3
        dist.reduce(x, dst=0)                                                # 3
        dist.all_to_all_single(torch.empty(4), torch.ones(4))                # 4
        # batch_isend_irecv: two sends and two receives in one batch.
        ops = [dist.P2POp(dist.isend, torch.ones(7), peer),
               dist.P2POp(dist.isend, torch.ones(2, 3), peer),
               dist.P2POp(dist.irecv, torch.empty(7), peer),
               dist.P2POp(dist.irecv, torch.empty(2, 3), peer)]
        for req in dist.batch_isend_irecv(ops):
            req.wait()
        # Blocking send/recv, in an order that cannot deadlock.
        if rank == 0:
            dist.send(torch.ones(11), 1)
        else:
            dist.recv(torch.empty(11), 0)
        # Functional collectives.
        y = fc.all_gather_tensor(x, 0, dist.group.WORLD)                     # 6
        y = fc.wait_tensor(y)
        fc.wait_tensor(fc.all_reduce(x, "sum", dist.group.WORLD))            # 3
        fc.wait_tensor(fc.reduce_scatter_tensor(torch.ones(4), "sum", 0, dist.group.WORLD))  # 4
        # Inside autograd backward.
        w = torch.ones(9, requires_grad=True)
        _AllReduceInBackward.apply(w).sum().backward()                       # 9
    s = cc.stats
    return {op: (st.calls, st.elements, st.bytes) for op, st in s.items()}, rank, \
        cc.sent_elements(), cc.sent_elements(broadcast_model="ring"), cc.sent_bytes()


def test_counter_reads_every_op_type(report):
    results = run_ranks(2, _every_op)
    for stats, rank, sent_tree, sent_ring, sent_bytes in results:
        f4, bf2 = 4, 2
        expect = {
            "all_gather": (3, 6 + 6 + 6, 4 * 18),
            "reduce_scatter": (3, 4 + 4 + 4, 4 * 12),
            "all_reduce": (3, 5 + 3 + 9, bf2 * 5 + f4 * 12),
            "broadcast": (1, 3, 12),
            "reduce": (1, 3, 12),
            "all_to_all": (1, 4, 16),
            "send": (2 + (rank == 0), 13 + 11 * (rank == 0), 4 * (13 + 11 * (rank == 0))),
            "recv": (2 + (rank == 1), 13 + 11 * (rank == 1), 4 * (13 + 11 * (rank == 1))),
            "gather": (0, 0, 0),
            "scatter": (0, 0, 0),
            "barrier": (0, 0, 0),
        }
        assert stats == expect, (rank, stats)
        # The papers' per-rank volume on p = 2: AG, RS, A2A move (p-1)/p S = S/2, all-reduce
        # 2(p-1)/p S = S, broadcast/reduce log2(2) S = S (tree) or S/2 (ring), sends S.
        base = 18 / 2 + 12 / 2 + 17 + 4 / 2 + (13 + 11 * (rank == 0))
        assert sent_tree == pytest.approx(base + 3 + 3)
        assert sent_ring == pytest.approx(base + 1.5 + 1.5)
        # The same in bytes: everything fp32 except the 5-element bf16 all-reduce.
        assert sent_bytes == pytest.approx(4 * (base + 3 + 3 - 5) + 2 * 5)
    report(f"comm counter, 2 gloo ranks: every op type read at its payload (rank0 sent "
           f"{results[0][2]:.1f} elements, paper convention)")


def test_sent_elements_conventions():
    # Megatron TP+SP MLP on p ranks (Sec. 3.2.2): 3 all-gathers + 2 reduce-scatters of bsh.
    p, bsh = 4, 1000
    tp = 3 * sent_elements("all_gather", bsh, p) + 2 * sent_elements("reduce_scatter", bsh, p)
    assert tp == pytest.approx(5 * (p - 1) / p * bsh)
    assert sent_elements("broadcast", 10, 8) == pytest.approx(30)  # log2(8) * 10 (Sec. 4.2)
    assert sent_elements("recv", 10, 8) == 0
    with pytest.raises(ValueError, match="unknown"):
        sent_elements("gossip", 1, 2)


def _peak_of_known_allocation():
    # 33 MiB live at once (a 32 MiB and a 1 MiB tensor), then 32 MiB freed and 16 MiB allocated.
    keep = torch.ones(1024)  # 4 KiB registered as "other" before the region
    with PeakMemory(keep) as pm:
        a = torch.empty(8 * 2**20, dtype=torch.float32)
        b = torch.empty(2**20, dtype=torch.uint8)
        del a
        c = torch.empty(4 * 2**20, dtype=torch.float32)
        del b, c
    return pm.peak_bytes, pm.baseline_bytes, pm.peak_increase, pm.peak_by_category


def test_peak_of_known_allocation(report):
    peak, base, inc, cats = _peak_of_known_allocation()
    assert base == 4096
    assert inc == 33 * 2**20
    assert peak == 33 * 2**20 + 4096
    assert cats["activation"] == 33 * 2**20 and cats["other"] == 4096
    report(f"PeakMemory: known 33 MiB allocation read as {inc / 2**20:.2f} MiB")


def test_peak_tracks_module_forward_backward():
    lin = torch.nn.Linear(64, 32, bias=False)  # 8 KiB of weight
    x = torch.randn(16, 64, requires_grad=False)
    with PeakMemory(lin, x) as pm:
        lin(x).sum().backward()
    # Baseline: weight 8192 B + input 4096 B. The peak comes in backward, when the weight
    # gradient (8192 B, "temp": created in backward) is allocated; the [16, 32] output was freed
    # after sum() (its gradient is an expanded scalar), so less than 2048 B rides on top.
    assert pm.baseline_bytes == 8192 + 4096
    assert pm.peak_by_category["temp"] == 8192
    assert 8192 <= pm.peak_increase < 8192 + 2048
    lin.weight.grad = None


_FAKE_SCRIPT = textwrap.dedent(
    """
    import torch, torch.distributed as dist
    from torch._subclasses.fake_tensor import FakeTensorMode
    from torch.testing._internal.distributed.fake_pg import FakeStore
    from megatron_metp.measure.comm_counter import CommCounter
    from megatron_metp.measure.memory import PeakMemory
    dist.init_process_group("fake", rank=0, world_size=8, store=FakeStore())
    with FakeTensorMode():
        x = torch.empty(1024, 1024)                      # 4 MiB shard
        with PeakMemory(x) as pm, CommCounter() as cc:
            out = torch.empty(8 * 1024, 1024)            # 32 MiB gathered
            dist.all_gather_into_tensor(out, x)
            req = dist.isend(x, 1)
            req.wait()
    print(pm.peak_bytes, cc.stats["all_gather"].elements, cc.stats["send"].elements,
          cc.events[0].group_size)
    """
)


def test_fake_backend_counts_and_tracks():
    out = subprocess.run([sys.executable, "-c", _FAKE_SCRIPT], capture_output=True, text=True,
                         timeout=120)
    assert out.returncode == 0, out.stderr[-3000:]
    peak, ag, send, p = map(int, out.stdout.split()[-4:])
    assert peak == (4 + 32) * 2**20
    assert ag == 8 * 2**20 and send == 2**20 and p == 8
