"""``metp plan --timeline``: the simulator on hand-built traces with hand-computed answers, the
recorder on a real (fake-tensor) layer, the Chrome trace, and the flags. Single process, cheap."""

from __future__ import annotations

import json
from dataclasses import replace

import pytest
import torch

from megatron_metp.measure.op_trace import TraceOp
from megatron_metp.measure.timeline import (Link, Machine, chrome_trace, comm_time,
                                            layer_in_stack, simulate, stack_of_two,
                                            tp_comm_overlap)

MS = 1e-3
# 1 TFLOP/s at efficiency 1, memory never the bound, a 1 GB/s link with no latency: a compute op
# of 1e9 FLOPs takes 1 ms, a send of 1e6 bytes 1 ms.
LINK = Link("test", 1e9, 0.0, efficiency=1.0)
M = Machine("test", 1e12, 1e18, LINK, LINK, efficiency=1.0, mem_efficiency=1.0)


def comp(ms: float, name: str = "mm") -> TraceOp:
    return TraceOp("compute", name, flops=ms * 1e9)


def comm(cid: int, ms: float, group: str = "g", op: str = "send", p: int = 2) -> TraceOp:
    return TraceOp("comm", op, bytes=ms * 1e6, group=group, group_size=p, comm_id=cid)


def wait(cid: int) -> TraceOp:
    return TraceOp("wait", "wait", comm_id=cid)


def test_comm_hidden_behind_compute():
    # send 1 ms posted at 0, compute 2 ms, wait (comm ended at 1 ms), compute 1 ms: 3 ms, all
    # communication hidden.
    sch = simulate([comm(0, 1), comp(2), wait(0), comp(1)], M)
    assert sch.step == pytest.approx(3 * MS)
    assert sch.exposed_comm == pytest.approx(0.0, abs=1e-12)


def test_comm_exposed_when_longer_than_compute():
    # send 3 ms, compute 1 ms, wait until 3 ms, compute 1 ms: step 4 ms, computing 2 ms, so
    # 2 ms of communication are exposed.
    sch = simulate([comm(0, 3), comp(1), wait(0), comp(1)], M)
    assert sch.step == pytest.approx(4 * MS)
    assert sch.exposed_comm == pytest.approx(2 * MS)


def test_fifo_per_communicator_and_links_shared_between_communicators():
    # Two 1 ms broadcasts (p = 2: alpha + S/B) posted at 0. One group: the second starts when
    # the first ends, step 2 ms. Two groups: both run at once on the GPU's one link, each at
    # half the rate, both end at 2 ms (until the eighteenth stop each ran at the full rate,
    # step 1 ms: two communicators' bytes on one link in the time of one's).
    one = [comm(0, 1, "a", "broadcast"), comm(1, 1, "a", "broadcast"), wait(0), wait(1)]
    two = [comm(0, 1, "a", "broadcast"), comm(1, 1, "b", "broadcast"), wait(0), wait(1)]
    assert simulate(one, M).step == pytest.approx(2 * MS)
    assert simulate(two, M).step == pytest.approx(2 * MS)
    # Waiting on the first: 1 ms behind the FIFO, 2 ms beside another communicator.
    assert simulate(one[:1] + [wait(0)], M).step == pytest.approx(1 * MS)
    assert simulate(two[:2] + [wait(0), comp(0.25)], M).step == pytest.approx(2.25 * MS)
    # The same two on one group but the second waited for before a 1.5 ms compute: the weight
    # broadcast queued behind the ring ends at 2 ms, then compute: 3.5 ms.
    queued = [comm(0, 1, "a", "broadcast"), comm(1, 1, "a", "broadcast"), wait(1), comp(1.5)]
    assert simulate(queued, M).step == pytest.approx(3.5 * MS)


def test_a_short_call_beside_a_long_one_shares_the_link():
    # A 4 ms broadcast on one group and a 1 ms one on another, posted together: the short one
    # runs at half the rate while both run (ends at 2 ms), the long one then alone: its 4 ms of
    # bytes end at 5 ms. A compute waiting on the short one starts at 2 ms.
    ops = [comm(0, 4, "w", "broadcast"), comm(1, 1, "tp", "broadcast"), wait(1), comp(1),
           wait(0)]
    sch = simulate(ops, M)
    assert sch.step == pytest.approx(5 * MS)
    (c,) = [iv for iv in sch.intervals if iv.lane == "compute"]
    assert c.start == pytest.approx(2 * MS)
    # Posted 1 ms apart: the long one runs alone for 1 ms, then both at half the rate for 2 ms
    # (the short one ends at 3 ms, the long one has 2 ms of bytes left), then the long one
    # alone: 5 ms.
    ops = [comm(0, 4, "w", "broadcast"), comp(1), comm(1, 1, "tp", "broadcast"), wait(1),
           wait(0)]
    sch = simulate(ops, M)
    assert sch.step == pytest.approx(5 * MS)
    (short,) = [iv for iv in sch.intervals if iv.lane == "comm:tp"]
    assert (short.start, short.end) == (pytest.approx(1 * MS), pytest.approx(3 * MS))
    # A group over InfiniBand (more ranks than a node's GPUs) does not share NVLink.
    ib = [comm(0, 1, "a", "broadcast"), comm(1, 1, "b", "broadcast", p=16), wait(0), wait(1)]
    two_links = replace(M, inter=Link("ib", 1e9, 0.0, efficiency=1.0), gpus_per_node=8)
    assert simulate(ib, two_links).step == pytest.approx(1 * MS)


def test_send_and_recv_of_one_batch_run_together():
    # batch_isend_irecv: a 1 ms send and a 1 ms receive posted together end at 1 ms (full
    # duplex); the next batch on the group (after a compute) starts after them.
    ops = [comm(0, 1, op="send"), comm(1, 1, op="recv"), comp(0.5), comm(2, 1), wait(0),
           wait(1), wait(2)]
    sch = simulate(ops, M)
    assert sch.step == pytest.approx(2 * MS)


def test_sends_of_one_batch_share_the_outgoing_link():
    # Two 1 ms sends and two 1 ms receives in one batch (the MLP weight ring's two weights):
    # each direction carries both, one after the other, the two directions at once: 2 ms, not
    # 1 ms (every op at the full rate). Then a 0.5 ms compute and a wait on the last send.
    ops = [comm(0, 1, op="send"), comm(1, 1, op="recv"), comm(2, 1, op="send"),
           comm(3, 1, op="recv"), wait(0), wait(1), wait(2), wait(3), comp(0.5)]
    assert simulate(ops, M).step == pytest.approx(2.5 * MS)
    # One send and three receives: the incoming direction decides, 3 ms.
    ops = [comm(0, 1, op="send"), comm(1, 1, op="recv"), comm(2, 1, op="recv"),
           comm(3, 1, op="recv"), wait(0), wait(1), wait(2), wait(3)]
    assert simulate(ops, M).step == pytest.approx(3 * MS)


def test_alpha_beta_formulas():
    link = Link("l", 100e9, 10e-6, efficiency=0.5)  # 50 GB/s achievable
    # all_gather of 8 GB over 8 ranks: 10 us + 7/8 x 8e9 / 50e9 = 0.14001 s
    assert comm_time("all_gather", 8e9, 8, link) == pytest.approx(10e-6 + 0.14)
    # all_reduce: twice the volume
    assert comm_time("all_reduce", 8e9, 8, link) == pytest.approx(10e-6 + 0.28)


def test_tp_comm_overlap_pipelines_all_gather_with_its_gemm():
    # All-gather of S = 4e6 B over p = 4 (3 ms: 3/4 S / 1 GB/s), then a 4 ms GEMM: 7 ms.
    # Overlapped: 3 ring steps of 1 ms; GEMM chunk i (1 ms) waits for step i: chunk 0 [0, 1],
    # chunk 1 [1, 2], chunk 2 [2, 3], chunk 3 [3, 4]: 4 ms, 0 exposed.
    ops = [comm(0, 4, "tp", "all_gather", p=4), wait(0), comp(4)]
    assert simulate(ops, M).step == pytest.approx(7 * MS)
    sch = simulate(tp_comm_overlap(ops), M)
    assert sch.step == pytest.approx(4 * MS)
    # Reduce-scatter after a 4 ms GEMM: 4 + 3 = 7 ms; pipelined: step k (1 ms) posted after
    # chunk k-1, the last one after chunk 2 (at 3 ms) ends at 4 ms, with chunk 3: 4 ms.
    rs = [comp(4), comm(0, 4, "tp", "reduce_scatter", p=4), wait(0)]
    assert simulate(rs, M).step == pytest.approx(7 * MS)
    assert simulate(tp_comm_overlap(rs), M).step == pytest.approx(4 * MS)


def test_chrome_trace_is_valid_json_labelled_estimate(tmp_path):
    sch = simulate([comm(0, 1), comp(2), wait(0), comp(1)], M)
    path = tmp_path / "t.json"
    chrome_trace({"hand": sch}, str(path))
    doc = json.loads(path.read_text())
    assert "ESTIMATE" in doc["metadata"]["label"]
    xs = [e for e in doc["traceEvents"] if e["ph"] == "X"]
    assert len(xs) == 3 and all({"pid", "tid", "ts", "dur", "name"} <= set(e) for e in xs)
    names = {e["args"]["name"] for e in doc["traceEvents"] if e["ph"] == "M"}
    assert "ESTIMATE hand" in names and {"compute", "comm:g"} <= names
    # the send on the communicator's thread, 0 .. 1000 us
    send = next(e for e in xs if e["name"] == "send")
    assert send["tid"] == 1 and send["ts"] == 0 and send["dur"] == pytest.approx(1000)


def test_host_issue_time_bounds_many_small_ops():
    from dataclasses import replace

    # Ten 0.1 ms ops issued at 1 ms each: the GPU waits for the host, step 10.1 ms, host-bound.
    slow_host = replace(M, host_op_s=1 * MS)
    sch = simulate([comp(0.1) for _ in range(10)], slow_host)
    assert sch.step == pytest.approx(10.1 * MS) and sch.host == pytest.approx(10 * MS)
    assert sch.host_bound
    # Two 5 ms ops: the host issues the second while the first runs; hidden, not host-bound.
    sch = simulate([comp(5), comp(5)], slow_host)
    assert sch.step == pytest.approx(11 * MS) and not sch.host_bound
    # A send is issued by the host too (at 1 ms: it runs 1..2 ms); the wait costs the host
    # nothing and holds the stream to 2 ms; the compute op is issued at 2 ms and runs 2..3 ms.
    sch = simulate([comm(0, 1), wait(0), comp(1)], slow_host)
    assert sch.step == pytest.approx(3 * MS) and sch.host == pytest.approx(2 * MS)
    # With no host cost (the default Machine) nothing changes.
    assert simulate([comp(0.1) for _ in range(10)], M).step == pytest.approx(1 * MS)


def test_a_layer_in_a_stack_does_not_pay_the_host_start_again():
    # One layer: a 1 ms forward op and a 2 ms backward op, issued at 0.5 ms each. Alone the GPU
    # waits 0.5 ms for the first issue: 3.5 ms. In a stack of two (fwd, fwd, bwd, bwd) the host
    # is ahead from the second op on: 0.5 + 1 + 1 + 2 + 2 = 6.5 ms, so a layer adds 3.0 ms.
    host = replace(M, host_op_s=0.5 * MS)
    ops = [comp(1), replace(comp(2), phase="bwd")]
    assert [o.flops for o in stack_of_two(ops)] == [1e9, 1e9, 2e9, 2e9]
    first, steady = layer_in_stack(ops, host)
    assert first == pytest.approx(3.5 * MS) and steady == pytest.approx(3.0 * MS)
    # A forward transfer waited for at once: a stack hides nothing of it (1 + 1 per layer).
    ops = [comm(0, 1), wait(0), comp(1), replace(comp(1), phase="bwd")]
    assert layer_in_stack(ops, M) == (pytest.approx(3 * MS), pytest.approx(3 * MS))
    # The second layer's calls are renumbered: its waits wait for its own calls.
    two = stack_of_two(ops)
    assert [o.comm_id for o in two if o.kind != "compute"] == [0, 0, 1, 1]


@pytest.mark.parametrize("mode,kw", [
    ("tp", {}), ("metp", {}), ("wallfacer", {}), ("tp", {"full_recompute": True}),
    ("metp", {"full_recompute": True}), ("tp", {"cp": 2, "cp_comm_type": "p2p"}),
], ids=["tp", "metp", "wallfacer", "tp-full", "metp-full", "tp-cp2"])
def test_stack_of_two_is_what_two_traced_layers_run(mode, kw):
    # The frontier's steady layer time simulates one layer's trace run twice in a stack's order
    # (stack_of_two); two real layers traced one after the other (each fed the first's output,
    # autograd ordering their backwards) must give the very same ops, op for op, comm calls
    # renumbered. METP's layer (tiny-llama at p = 2 takes the gathered MLP: the layer schedule's
    # link and its deferred gradient node are in the trace) included.
    import warnings

    from megatron_metp.models.config import load_config
    from megatron_metp.measure.op_trace import trace_layer
    from megatron_metp.measure.planner import FakeWorld

    def canon(ops):
        ids = {}
        return [(o.kind, o.name, o.phase, o.flops, o.bytes, o.group, o.group_size, o.strided,
                 ids.setdefault(o.comm_id, len(ids)) if o.comm_id >= 0 else -1) for o in ops]

    from tests import _models as M

    warnings.filterwarnings("ignore")
    cfg = load_config("tiny-llama")
    p = 4 if "cp" in kw else 2

    def traces():
        world = FakeWorld(rank=1)
        try:
            return (trace_layer(cfg, mode, p, 256, world=world, **kw),
                    trace_layer(cfg, mode, p, 256, world=world, layers=2, **kw))
        finally:
            world.teardown()

    if mode == "metp" and not kw:
        # A small layer's paths (tiny-llama's are: tests._models.large_layers): each
        # sublayer's weight gradients in one reduce-scatter call; with the weights kept the
        # second attention's go in the first MLP's call, one call fewer than two layers that
        # hand nothing across.
        rs = lambda ops: sum(o.name == "reduce_scatter" for o in ops)  # noqa: E731
        for extra, fewer in (({}, 0), ({"qkv_backward": "save+fc1+weights"}, 1)):
            world = FakeWorld(rank=1)
            try:
                one, two = (trace_layer(cfg, mode, p, 256, world=world, layers=n, **extra)
                            for n in (1, 2))
            finally:
                world.teardown()
            assert rs(one) == 2 and rs(two) == 2 * rs(one) - fewer, (extra, rs(one), rs(two))
        # The rest on a large layer's paths.
        with M.large_layers():
            one, two = traces()
    else:
        one, two = traces()
    expected = stack_of_two(one)
    if mode == "metp" and not kw:
        # The layer schedule is in the trace: the MLP's gathers are posted before the
        # attention's kernel, beside the attention's own. W_qkv's two parts go first (no bias:
        # a call each), then W_proj^T with the MLP's fc1 and fc2 in one coalesced call (tiny:
        # comm.call_groups); their bytes are every weight of the layer, bf16, gathered whole.
        kernel = next(i for i, o in enumerate(one) if "attention" in o.name)
        posted = [o for o in one[:kernel] if o.kind == "comm" and o.group == "metp_weight"]
        h, f = cfg.hidden_size, cfg.ffn_hidden_size
        d = h // cfg.num_attention_heads
        weights = ((cfg.num_attention_heads + 2 * cfg.num_query_groups) * d * h   # W_qkv
                   + h * h + 2 * f * h + h * f)                                  # W_proj, fc1, fc2
        assert len(posted) == 3 and sum(o.bytes for o in posted) == 2 * weights, posted
        # ... and the chain: the first layer's MLP posts the second's whole W_qkv gather, and
        # the second layer runs one GEMM on it instead of cutting two parts (a copy each,
        # tiny-llama has no biases), gathering each and running a GEMM each; Q's rows are
        # then one dense copy: 2 ops fewer. The backwards are the same ops, op for op.
        n_fwd = sum(1 for o in one if o.phase == "fwd")
        assert len(two) == 2 * len(one) - 2
        fwd = [o for o in two if o.phase == "fwd"]
        assert len(fwd) == 2 * n_fwd - 2
        assert sum(o.name == "mm" for o in fwd) == 2 * sum(o.name == "mm" for o in one[:n_fwd]) - 1
        assert sum(o.kind == "comm" for o in fwd) == 2 * sum(
            o.kind == "comm" for o in one[:n_fwd]) - 1
        assert canon(two[len(fwd):]) == canon(expected[2 * n_fwd:])
    else:
        assert len(two) == 2 * len(one)
        assert canon(expected) == canon(two)


def test_timeline_rows_trace_every_metp_rank():
    # tiny-gpt at p = 2: METP's rows come from both ranks (balanced: max/mean near 1), keep the
    # fields scripts read, and add the host and per-rank ones.
    import warnings

    from megatron_metp.models.config import load_config
    from megatron_metp.measure.timeline_report import timeline_rows

    warnings.filterwarnings("ignore")
    rows = timeline_rows([load_config("tiny-gpt")], [2], ("tp", "metp"), [1024], ["H100"], 0.5,
                         8, host_op_s=10e-6)
    by = {r["scenario"]: r for r in rows}
    for r in rows:
        assert {"model", "p", "gpu", "seq_length", "scenario", "step_s", "mfu",
                "comm_ops"} <= set(r)
        assert r["host_s"] == pytest.approx(10e-6 * (r["compute_ops"] + r["comm_ops"]))
        assert r["step_s"] >= r["host_s"]
    assert by["metp"]["ranks_traced"] == 2 and by["tp"]["ranks_traced"] == 1
    # Equal FLOPs on both ranks; the balanced rule's pieces differ only in shape.
    assert by["metp"]["rank_compute_max_over_mean"] < 1.05


@pytest.fixture(scope="module")
def traces():
    """tiny-gpt (h = 64) traced at p = 2, s = 256 in every mode, on rank 1."""
    import warnings

    from megatron_metp.models.config import load_config
    from megatron_metp.measure.op_trace import trace_layer
    from megatron_metp.measure.planner import FakeWorld

    warnings.filterwarnings("ignore")
    cfg, world = load_config("tiny-gpt"), FakeWorld(rank=1)
    try:
        yield {m: trace_layer(cfg, m, 2, 256, world=world) for m in ("tp", "metp", "wallfacer")}
    finally:
        world.teardown()


def _comms(ops):
    return {(o.name, o.group) for o in ops if o.kind == "comm"}


def test_recorder_sees_each_mode_on_its_groups(traces):
    # tp: Megatron's SP all-gathers and reduce-scatters, all on the TP group.
    assert _comms(traces["tp"]) == {("all_gather", "tp"), ("reduce_scatter", "tp")}
    # metp: ring P2P on the ring (= TP group); weights on the weight group: at 128 tokens per
    # rank every head group runs in one ring pass, so they are all-gathered and their
    # gradients reduce-scattered (the per-head-group loop broadcasts and reduces them); so are
    # the MLP's (metp.gathered_mlp: short inputs gather its weights too).
    assert _comms(traces["metp"]) == {("send", "tp"), ("recv", "tp"),
                                      ("all_gather", "metp_weight"),
                                      ("reduce_scatter", "metp_weight")}
    # wallfacer (C = 1): ring P2P over the context-parallel group.
    assert {g for _, g in _comms(traces["wallfacer"])} == {"cp"}
    for ops in traces.values():
        posted = {o.comm_id for o in ops if o.kind == "comm"}
        waited = [o.comm_id for o in ops if o.kind == "wait"]
        assert set(waited) == posted           # every comm waited on exactly once ...
        assert len(waited) == len(set(waited))
        first = {}
        for i, o in enumerate(ops):
            first.setdefault((o.kind, o.comm_id), i)
        assert all(first[("comm", c)] < first[("wait", c)] for c in posted)  # ... after posting
        assert any(o.phase == "bwd" for o in ops)


def test_recorder_flops_match_megatron_gemms(traces):
    # tp at p = 2, s = 256, h = 64, f = 256, b = 1: forward GEMMs per rank = 2 s h (3h + h + 2f)
    # / p = 2 * 256 * 64 * 768 / 2 = 12,582,912; backward twice that (dgrad + wgrad).
    fwd = sum(o.flops for o in traces["tp"] if o.kind == "compute" and o.phase == "fwd"
              and o.name in ("mm", "addmm", "bmm", "baddbmm"))
    bwd = sum(o.flops for o in traces["tp"] if o.kind == "compute" and o.phase == "bwd"
              and o.name in ("mm", "addmm", "bmm", "baddbmm"))
    assert fwd == 2 * 256 * 64 * 768 / 2
    assert bwd == 2 * fwd


def test_a_matmul_is_charged_its_gemm_alone():
    # torch.matmul of [s, b, h] by W^T (each Megatron linear layer's call) folds the input to
    # 2-D, runs one mm and puts ``_unsafe_view`` on its output. The view launches no kernel and
    # moves no bytes, so the trace holds the mm alone: its FLOPs 2 s b h f and its bytes the
    # input, the weight and the output once each (fp32: 4 B), counted here by hand.
    from torch._subclasses.fake_tensor import FakeTensorMode

    from megatron_metp.measure.op_trace import OpRecorder

    s, b, h, f = 64, 2, 32, 48
    with FakeTensorMode():
        x, w = torch.empty(s, b, h), torch.empty(f, h)
        with OpRecorder() as rec:
            y = torch.matmul(x, w.t())
    assert y.shape == (s, b, f)
    ops = [o for o in rec.ops if o.kind == "compute"]
    assert [o.name for o in ops] == ["mm"], ops
    assert ops[0].flops == 2 * s * b * h * f
    assert ops[0].bytes == 4 * (s * b * h + f * h + s * b * f)


def test_strided_and_broadcast_elementwise_ops_are_marked_and_charged_slower():
    # The trace marks an element-wise op whose operands are strided or broadcast (the merges'
    # per-row rescale, a transposing copy, an add into a view of a larger accumulator), which a
    # GPU runs in its unvectorised kernel, and nothing else: a dense add, a dense copy, a cat, a
    # reduction, a GEMM. The machine charges marked ops at strided_mem_efficiency.
    from torch._subclasses.fake_tensor import FakeTensorMode

    from megatron_metp.measure.op_trace import OpRecorder

    with FakeTensorMode():
        a, b = torch.empty(4, 8, 16), torch.empty(4, 8, 16)
        row = torch.empty(4, 8, 1)
        acc = torch.empty(4, 16, 16)
        with OpRecorder() as rec:
            a.mul_(row)                          # broadcast
            a.transpose(0, 1).contiguous()       # transposing copy
            acc[:, :8].add_(b)                   # into a strided view
            torch.add(a, b)                      # dense
            a.clone()                            # dense copy
            torch.cat([a, b], dim=-1)            # a join, never element-wise
            a.sum(dim=-1)                        # a reduction
            torch.mm(a[0], b[0].t())             # a GEMM
    marks = [(o.name, o.strided) for o in rec.ops if o.kind == "compute"]
    assert marks == [("mul_", True), ("clone", True), ("add_", True), ("add", False),
                     ("clone", False), ("cat", False), ("sum", False), ("mm", False)], marks
    m = Machine("m", 1e12, 1e9, LINK, LINK, mem_efficiency=0.8, strided_mem_efficiency=0.5)
    dense = TraceOp("compute", "add", bytes=1e6)
    strided = TraceOp("compute", "add", bytes=1e6, strided=True)
    assert m.compute_time(dense) == pytest.approx(1e6 / (1e9 * 0.8))
    assert m.compute_time(strided) == pytest.approx(1e6 / (1e9 * 0.5))


def test_stock_layer_trace_holds_no_kernel_less_op(traces):
    # Megatron's linear layers call torch.matmul on 3-D activations; their _unsafe_view
    # outputs were charged as copies (8 in tiny-gpt's tp layer here, 12 in wallfacer's; 17 GB
    # of LLaMA-7B's traces at 32k).
    for ops in traces.values():
        assert not {o.name for o in ops if o.kind == "compute"} & {"_unsafe_view", "set_"}


@pytest.mark.parametrize("argv,flag", [
    (["plan", "--timeline", "--gpus", "V100"], "--gpus"),
    (["plan", "--timeline", "--gpus-per-node", "0"], "--gpus-per-node"),
    (["plan", "--timeline", "--host-op-us", "-1"], "--host-op-us"),
    (["plan", "--timeline", "--trace-seq-length", "1000"], "--trace-seq-length"),
    (["plan", "--timeline", "--validate", "/nonexistent.json"], "--validate"),
    (["plan", "--validate", "/nonexistent.json"], "--validate"),
])
def test_timeline_refuses_bad_flag(argv, flag, capsys):
    from megatron_metp.training.cli import main

    rc = main(argv)
    lines = [ln for ln in capsys.readouterr().err.splitlines() if ln.strip()]
    assert rc == 2 and len(lines) == 1 and flag in lines[0], lines


def test_trace_length_follows_the_sequence_lengths(tmp_path):
    """``metp plan --timeline --seq-lengths 32k`` without --trace-seq-length:
    the trace follows --seq-lengths instead of failing on the 128k default; a named trace
    length that is not planned still exits 2 with the fix."""
    import subprocess
    import sys
    from pathlib import Path

    root = Path(__file__).resolve().parents[1]
    base = [sys.executable, "-m", "megatron_metp.training.cli", "plan", "--timeline",
            "--models", "llama-7b", "--seq-lengths", "32k", "--modes", "tp", "--gpus", "H100",
            "--timeline-dir", str(tmp_path)]
    ok = subprocess.run(base, capture_output=True, text=True, timeout=300, cwd=str(root))
    assert ok.returncode == 0, ok.stderr[-2000:]
    assert (tmp_path / "trace_llama-7b.json").is_file()
    bad = subprocess.run(base + ["--trace-seq-length", "64k"], capture_output=True, text=True,
                         timeout=300, cwd=str(root))
    assert bad.returncode == 2 and "pass one of them" in bad.stderr, bad.stderr[-2000:]


def test_timeline_prints_no_megatron_spec_notes(tmp_path):
    """``metp plan --timeline`` traces METP's layer, whose MLP Megatron-Core does not know: its
    "Unknown MLP type" note printed once per trace before the tracing ran under the planner's
    quiet_megatron, as ``metp plan`` and auto do."""
    import subprocess
    import sys
    from pathlib import Path

    root = Path(__file__).resolve().parents[1]
    out = subprocess.run([sys.executable, "-m", "megatron_metp.training.cli", "plan", "--timeline",
                          "--models", "tiny-llama", "--p", "2", "--seq-lengths", "4k",
                          "--modes", "metp", "--gpus", "H100", "--timeline-dir", str(tmp_path)],
                         capture_output=True, text=True, timeout=300, cwd=str(root))
    assert out.returncode == 0, out.stderr[-2000:]
    # The METP row names the attention pass the planner resolved (auto: the all-to-all pass).
    assert "| tiny-llama | 2 | H100 | 4k | metp (a2a) |" in out.stdout, out.stdout[-2000:]
    assert "Unknown MLP type" not in out.stdout + out.stderr, out.stderr[-2000:]


@pytest.mark.parametrize("argv, want", [
    # Named, even as plan's own defaults: traced as named.
    (["--models", "bert-large,llama-7b,llama-70b,gpt-175b", "--modes", "tp,metp", "--p",
      "2,4,8", "--seq-lengths", "4k"],
     (("bert-large", "llama-7b", "llama-70b", "gpt-175b"), [4096], [2, 4, 8], ("tp", "metp"))),
    # Left out: --timeline's own defaults.
    ([], (("llama-7b", "gpt-175b"), [32768, 131072, 524288, 1048576], [8],
          ("tp", "metp", "wallfacer"))),
])
def test_timeline_takes_named_flags_as_named(argv, want):
    """A flag named with plan's default value is named: ``metp plan --timeline --models
    bert-large,llama-7b,llama-70b,gpt-175b`` once traced only --timeline's default two."""
    import argparse

    from megatron_metp.measure import plan_report, timeline_report

    parser = argparse.ArgumentParser()
    plan_report.add_arguments(parser)
    args = parser.parse_args(["--timeline"] + argv)
    plan_report.fill_defaults(args)
    assert timeline_report._defaults(args, plan_report._ints) == want
