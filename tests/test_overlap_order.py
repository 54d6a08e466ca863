"""Overlap order: each transfer is posted before the compute it hides behind
and waited on after it, for METP's MLP, METP attention at both levels, and WallFacer.

On every gloo rank a recorder logs, in program order, one forward and one backward of each
algorithm as a trace of events:

=========  ===================================================================================
post       a c10d op as launched: ``send`` / ``recv`` (one per op of a ``batch_isend_irecv``),
           ``broadcast``, ``reduce``, ``all_gather``, ``reduce_scatter``; with its process group,
           the storages it sends (``reads``) and those it receives into (``fills``)
wait       ``Work.wait()`` on that op (a synchronous collective waits right after its post)
compute    an aten op and the storages it reads; *heavy* when it has a FLOP count: the GEMMs
           (mm, addmm, bmm, baddbmm) and the flash attention kernels, forward and backward
mark       set by this test around calls it wraps (METP attention's ring, per head group)
=========  ===================================================================================

The recorder is ``megatron_metp.measure.op_trace.OpRecorder`` (a dispatch mode over aten and
c10d ops whose ``Work`` handles log their ``wait``), extended here with the storages each op
touches. Nothing in the library is switched: the code under test runs as in training.

A transfer *overlaps* when at least one heavy op lies strictly between its post and its wait:
on a GPU, the communication stream then runs while that kernel does. Only the order is checked,
never the time (on gloo a transfer may finish before the compute starts, and that is fine). Every
trace also checks that each transfer is waited on exactly once and that no compute op reads a
receive buffer between its post and its wait.

What each test asserts overlapped, and what it asserts exposed (so that a change either way
shows, and this list stays the truth):

* METP MLP, forward: every weight hop (steps 0..p-2), posted before its step's GEMMs, which
  compute on the very block being sent, and waited after them. Backward: the weight hops, the
  gradient accumulators' hops, and their last hop home (behind the deferred dX GEMM). Nothing
  exposed.
* METP attention, outer level: head group j+1's weight broadcast is posted before head group
  j's projection and waited after its whole K/V ring (forward and backward); head group j's
  gradient reduce is waited after head group j+1's ring. Inner level: each K/V hop behind the
  kernel of the block it sends; in backward each dK/dV accumulator hop behind the next step's
  kernel, and the last one behind dQ's back-projection (dX += dQ W_q, dW_q), which needs no
  dK/dV. Exposed by construction, since nothing precedes or follows them inside the layer:
  head group 0's weights and the last head group's gradient reduce.
* WallFacer: every sub-ring hop (forward K/V, backward query package with its lse and D, and
  the dQ accumulator) behind the kernels of its member shard; the forward's initial send of
  member shards 1..C-1 behind shard 0's kernels onwards, chunk 0's lse all-gather behind
  chunk 1's kernels (last step, G > 1); the backward's last dQ hops and dK/dV returns of all
  but the last shard behind the next shard's kernels. Exposed: the team all-gathers and
  shard 0's initial send (forward) or the whole initial send (backward: its first query shard
  reads every K/V shard), waited on before the first kernel; after the last kernel, the
  output reduce-scatters and the last lse all-gather (forward), the last shard's dQ hop and
  dK/dV return and the gradient reduce-scatter (backward).

One 4-rank pool serves every case (spawning ranks costs ~14 s on two cores; each case ~1 s).
P = 4 admits WallFacer teams of C = 1 (one ring of 4) and C = 2 (rings of length 1); a team
with C > 1 *and* a ring (P = 8, C = 2) runs in the full tier (``-m full``).
"""

from __future__ import annotations

import contextlib
from collections import Counter
from dataclasses import dataclass
from typing import Dict, List

import pytest
import torch
import torch.distributed as dist

from tests._harness import run_ranks

P = 4

# ----------------------------------------------------------------------------------------------
# Recording (runs on the ranks)

# c10d op -> the arguments it receives into (written by the transfer, valid only after wait).
_FILLS = {
    "recv_": "tensors",
    "allgather_": "output_tensors",
    "_allgather_base_": "output_tensor",
    "reduce_scatter_": "output_tensors",
    "_reduce_scatter_base_": "output_tensor",
    "allreduce_": "tensors",
}
# Rooted collectives write only off (broadcast) or on (reduce) the root.
_ROOTED = {"broadcast_": False, "reduce_": True}


@dataclass(frozen=True)
class Ev:
    kind: str                       # "post" | "wait" | "compute" | "mark"
    name: str                       # c10d op key, aten op, or mark label
    group: str = ""                 # post: process group name
    cid: int = -1                   # post / wait: transfer id
    heavy: bool = False             # compute: has a FLOP count (GEMM, attention kernel)
    reads: frozenset = frozenset()  # storages read (compute), or sent (post)
    fills: frozenset = frozenset()  # post: storages received into


def _storages(x) -> set:
    if isinstance(x, torch.Tensor):
        return {x.untyped_storage().data_ptr()} if x.numel() else set()
    if isinstance(x, (list, tuple)):
        return set().union(*(_storages(i) for i in x)) if x else set()
    return set()


def _recorder_cls():
    # Imported on the ranks only: the parent process never needs the measure package.
    from megatron_metp.measure.op_trace import OpRecorder, TraceOp

    class Recorder(OpRecorder):
        """OpRecorder that also keeps the storages each event touches (``touched``)."""

        def __init__(self):
            super().__init__()
            self.touched: Dict[int, tuple] = {}

        def mark(self, label: str) -> None:
            self.ops.append(TraceOp("mark", label, self.phase))

        def __torch_dispatch__(self, func, types, args=(), kwargs=None):
            kwargs = kwargs or {}
            n = len(self.ops)
            out = super().__torch_dispatch__(func, types, args, kwargs)
            if len(self.ops) > n:  # one compute or comm event was appended at index n
                bound = {a.name: v for a, v in zip(func._schema.arguments, args)}
                bound.update(kwargs)
                name = func._schema.name.split("::", 1)[1]
                fill_arg = _FILLS.get(name)
                if name in _ROOTED:
                    pg = dist.ProcessGroup.unbox(bound["process_group"])
                    on_root = bound["root_rank"] == pg.rank()
                    fill_arg = "tensors" if on_root == _ROOTED[name] else None
                # What the op reads: every other tensor argument. An all-gather's own slot may
                # be its input (WallFacer's shards): that storage is read, not received into.
                reads = _storages([v for k, v in bound.items() if k != fill_arg])
                fills = _storages(bound[fill_arg]) - reads if fill_arg else set()
                self.touched[n] = (frozenset(reads), frozenset(fills))
            return out

        def trace(self, phase: str) -> List[Ev]:
            out = []
            for i, op in enumerate(self.ops):
                if op.phase != phase:
                    continue
                reads, fills = self.touched.get(i, (frozenset(), frozenset()))
                if op.kind == "comm":
                    out.append(Ev("post", op.name, op.group, op.comm_id, reads=reads,
                                  fills=fills))
                elif op.kind == "wait":
                    out.append(Ev("wait", "wait", cid=op.comm_id))
                elif op.kind == "compute":
                    out.append(Ev("compute", op.name, heavy=op.flops > 0, reads=reads))
                else:
                    out.append(Ev(op.kind, op.name))
            return out

    return Recorder


def _record(fwd, bwd, rec=None):
    """Run ``y = fwd()`` then ``bwd(y)`` under a recorder; ``{"fwd": [Ev], "bwd": [Ev]}``."""
    rec = rec or _recorder_cls()()
    with rec:
        y = fwd()
        rec.phase = "bwd"
        bwd(y)
    return {"fwd": rec.trace("fwd"), "bwd": rec.trace("bwd")}


# ----------------------------------------------------------------------------------------------
# Analysis (runs in the test process)


@dataclass
class Transfer:
    op: str
    group: str
    post: int       # index of the post in the trace
    wait: int       # index of its wait
    batch: int      # transfers posted back to back on one group share a batch
    reads: frozenset
    fills: frozenset


def transfers(evs: List[Ev]) -> List[Transfer]:
    """Every transfer of a trace, with the invariants that hold for all of them checked: waited
    on exactly once, after its post; no compute reads its receive buffer before the wait."""
    waits: Dict[int, List[int]] = {}
    for i, e in enumerate(evs):
        if e.kind == "wait":
            waits.setdefault(e.cid, []).append(i)
    out, batch = [], -1
    for i, e in enumerate(evs):
        if e.kind != "post":
            continue
        prev = evs[i - 1] if i else None
        if prev is None or prev.kind != "post" or prev.group != e.group:
            batch += 1
        got = waits.get(e.cid, [])
        assert len(got) == 1 and got[0] > i, f"{e.name} #{e.cid}: waits at {got}, post at {i}"
        t = Transfer(e.name, e.group, i, got[0], batch, e.reads, e.fills)
        # gloo completes an async reduce-scatter by copying its result into the output inside
        # wait(): a copy_ right before the wait is the transfer's own write, not a read.
        early = [w.name for j, w in enumerate(window(evs, t), t.post + 1)
                 if w.kind == "compute" and w.reads & t.fills
                 and not (w.name == "copy_" and j == t.wait - 1)]
        assert not early, (f"{e.name} #{e.cid}: receive buffer read before its wait by "
                           f"{early}: {_describe(evs, t)}")
        out.append(t)
    return out


def window(evs: List[Ev], t: Transfer) -> List[Ev]:
    """The events strictly between a transfer's post and its wait."""
    return evs[t.post + 1:t.wait]


def kernels(evs: List[Ev]) -> List[Ev]:
    return [e for e in evs if e.kind == "compute" and e.heavy]


def overlapped(evs: List[Ev], t: Transfer) -> bool:
    return bool(kernels(window(evs, t)))


def computes_on_sent(evs: List[Ev], t: Transfer) -> bool:
    """A heavy op in the window reads what the transfer sends: the block is computed on while
    it is passed on (a ring step's send of its current block)."""
    return any(k.reads & t.reads for k in kernels(window(evs, t)))


def batches(ts: List[Transfer]) -> List[List[Transfer]]:
    out: Dict[int, List[Transfer]] = {}
    for t in ts:
        out.setdefault(t.batch, []).append(t)
    return [out[b] for b in sorted(out)]


def marks(evs: List[Ev], label: str) -> List[int]:
    return [i for i, e in enumerate(evs) if e.kind == "mark" and e.name == label]


def heavy_span(evs: List[Ev]):
    """Indices of the first and last heavy op."""
    idx = [i for i, e in enumerate(evs) if e.kind == "compute" and e.heavy]
    return idx[0], idx[-1]


def _describe(evs: List[Ev], t: Transfer) -> str:
    inside = [e.name for e in window(evs, t) if e.kind in ("compute", "post", "mark")][:12]
    return f"{t.op} on group {t.group} (batch {t.batch}, events between post and wait: {inside})"


def assert_all_overlap(evs, ts, what: str) -> None:
    bad = [_describe(evs, t) for t in ts if not overlapped(evs, t)]
    assert not bad, f"{what}: not overlapped with compute:\n" + "\n".join(bad)


def assert_exposed(evs, ts, what: str) -> None:
    hidden = [_describe(evs, t) for t in ts if overlapped(evs, t)]
    assert not hidden, (f"{what}: now overlapped with compute; update the table in this test's "
                        f"docstring and this assertion:\n" + "\n".join(hidden))


# ----------------------------------------------------------------------------------------------
# The checker itself, on hand-written traces (no ranks).


def _toy(order: str) -> List[Ev]:
    """``order``: P = post, K = heavy compute reading what P sends, R = compute reading what P
    receives, W = wait."""
    ev = {"P": Ev("post", "send", "g", 0, reads=frozenset({1}), fills=frozenset({2})),
          "K": Ev("compute", "mm", heavy=True, reads=frozenset({1})),
          "R": Ev("compute", "mm", heavy=True, reads=frozenset({2})),
          "W": Ev("wait", "wait", cid=0)}
    return [ev[c] for c in order]


def test_checker_on_hand_written_traces():
    evs = _toy("PKWR")
    (t,) = transfers(evs)
    assert overlapped(evs, t) and computes_on_sent(evs, t)
    evs = _toy("PWKR")  # waited at once: exposed
    (t,) = transfers(evs)
    assert not overlapped(evs, t)
    with pytest.raises(AssertionError, match="read before its wait"):
        transfers(_toy("PRW"))
    with pytest.raises(AssertionError, match="waits at"):
        transfers(_toy("PK"))


def assert_posted_before_compute(evs, bs, start: int = 0) -> None:
    """Each batch is posted before any heavy op of the step it hides behind: no heavy op lies
    between the previous batch's last wait (or ``start``) and the batch's first post."""
    prev = start
    for k, b in enumerate(bs):
        first = min(t.post for t in b)
        late = kernels(evs[prev:first])
        assert not late, f"batch {k} ({b[0].op}) posted after {[e.name for e in late]}"
        prev = max(t.wait for t in b)


def _ops(ts) -> Counter:
    """How many transfers of each op (compares equal to a plain dict)."""
    return Counter(t.op for t in ts)


@contextlib.contextmanager
def _marked(module, rec, *names):
    """Put marks around calls of ``module.<name>`` (the test's wrappers, removed on exit)."""
    saved = {n: getattr(module, n) for n in names}

    def wrap(name, fn):
        def call(*args, **kwargs):
            rec.mark(f"{name}:begin")
            out = fn(*args, **kwargs)
            rec.mark(f"{name}:end")
            return out
        return call

    for n, fn in saved.items():
        setattr(module, n, wrap(n, fn))
    try:
        yield
    finally:
        for n, fn in saved.items():
            setattr(module, n, fn)


def _backward(y) -> None:
    y.backward(torch.ones_like(y))


# ----------------------------------------------------------------------------------------------
# METP MLP (Alg. 1-2): the weight shards travel the ring.


def _mlp_traces():
    from megatron.core import parallel_state as mpu

    from megatron_metp.metp.weight_ring import MetpMLPFunction
    from tests._models import setup

    setup(tp=P, mode="metp")
    group = mpu.get_tensor_model_parallel_group()
    g = torch.Generator().manual_seed(dist.get_rank())
    h, f, n = 16, 32, 8  # 8 tokens per rank: token_chunks keeps one chunk (fewer than 256)
    x = torch.randn(n, h, generator=g).requires_grad_()
    w_in = torch.randn(f // P, h, generator=g).requires_grad_()
    b_in = torch.randn(f // P, generator=g).requires_grad_()  # a bias travels with w_in
    w_out = torch.randn(h, f // P, generator=g).requires_grad_()
    gelu = torch.nn.functional.gelu
    traces = _record(lambda: MetpMLPFunction.apply(x, w_in, b_in, w_out, gelu, group), _backward)
    return traces, group.group_name


def test_metp_mlp_ring_order(report):
    for traces, ring in run_ranks(P, _mlp_traces):
        # Forward (Alg. 1): p - 1 hops of (w_in, b_in, w_out); step i posts the hop of the block
        # it computes on before its GEMMs and waits after them; the last step has no hop.
        evs = traces["fwd"]
        ts = transfers(evs)
        assert {t.group for t in ts} == {ring}
        bs = batches(ts)
        assert [_ops(b) for b in bs] == [{"send": 3, "recv": 3}] * (P - 1)
        assert_all_overlap(evs, ts, "METP MLP forward ring")
        assert_posted_before_compute(evs, bs)
        assert all(computes_on_sent(evs, t) for t in ts if t.op == "send")
        assert kernels(evs[max(t.wait for t in ts):]), "the last step computes after the last hop"

        # Backward (Alg. 2): weight hops at steps 0..p-2, accumulator hops at steps 2..p-1 (in
        # the same batch), then the accumulators' last hop home, which hides the deferred
        # input-gradient GEMM. Every transfer overlaps.
        evs = traces["bwd"]
        ts = transfers(evs)
        assert {t.group for t in ts} == {ring}
        bs = batches(ts)
        assert [_ops(b) for b in bs] == ([{"send": 3, "recv": 3}] * 2
                                         + [{"send": 6, "recv": 6}] * (P - 3)
                                         + [{"send": 3, "recv": 3}] * 2)
        assert_all_overlap(evs, ts, "METP MLP backward ring")
        assert_posted_before_compute(evs, bs[:-1])
        # The three weight shards are computed on while they travel (steps 0..p-2); the
        # accumulators only travel.
        on_sent = [sum(computes_on_sent(evs, t) for t in b if t.op == "send") for b in bs]
        assert on_sent == [3] * (P - 1) + [0, 0], on_sent
        assert [len(kernels(window(evs, t))) for t in bs[-1]] == [1] * 6  # the dX GEMM
    report(f"overlap order, METP MLP p={P}: fwd {P - 1} weight hops, bwd {P + 1} batches "
           f"(weights, accumulators, last hop): all posted before the GEMMs they hide behind")


# ----------------------------------------------------------------------------------------------
# METP attention (Alg. 5-6): outer level, head group j's weights broadcast from rank j (one
# step ahead) and its gradients reduced to rank j (completed one step late), on the weight
# group; inner level, K/V blocks on the ring group (Alg. 3-4).

_RING_CALLS = ("ring_attention_forward", "ring_attention_backward")


def _attention_traces():
    from megatron_metp.metp import head_group_pass  # the pass whose ring calls are marked
    from megatron_metp.model import make_config
    from tests._models import setup
    from tests.test_metp_attention import _build

    setup(tp=P, mode="metp")
    # GPT preset: biases, so w_qkv, b_qkv and w_proj travel. No mask: with a causal mask and
    # contiguous shards rank r skips the K/V blocks of ranks > r, and a hop in a skipped step
    # has no kernel to hide behind on that rank (METP's causal imbalance, not an order bug).
    config = make_config("gpt", hidden_size=32, num_attention_heads=P)
    # The per-head-group loop (Alg. 5-6), whose prefetch and reduce order this checks; the one
    # pass over every head group has no per-head-group weight traffic to order.
    attn = _build(config, "metp", causal=False, ring_pass="head-group")
    x = torch.randn(4, 2, 32, generator=torch.Generator().manual_seed(dist.get_rank()))
    x.requires_grad_()
    rec = _recorder_cls()()
    with _marked(head_group_pass, rec, *_RING_CALLS):
        traces = _record(lambda: attn(x, None)[0], _backward, rec)
    ranks = {pg.group_name: dist.get_process_group_ranks(pg)
             for pg in (attn.tp_group, attn.weight_group)}
    return traces, attn.tp_group.group_name, attn.weight_group.group_name, ranks


def _check_weight_prefetch(evs, ts, call: str) -> None:
    """Head group j + 1's weight broadcast is posted before head group j's compute and waited
    after its whole K/V ring; head group 0's is needed at once (nothing precedes it)."""
    bs = batches([t for t in ts if t.op == "broadcast"])
    assert [_ops(b) for b in bs] == [{"broadcast": 3}] * P  # w_qkv_j, b_qkv_j, w_proj_j
    begins, ends = marks(evs, f"{call}:begin"), marks(evs, f"{call}:end")
    assert len(begins) == len(ends) == P
    assert_exposed(evs, bs[0], f"{call}: head group 0's weights")
    assert max(t.wait for t in bs[0]) < heavy_span(evs)[0]
    for j in range(1, P):
        for t in bs[j]:
            assert t.post < begins[j - 1] and ends[j - 1] < t.wait, (
                f"{call}: head group {j}'s broadcast does not enclose head group {j - 1}'s ring")
    assert_posted_before_compute(evs, bs)


def _ring_segments(evs, ts, call: str):
    """The ring transfers of each head group, by the marks around its ring call."""
    begins, ends = marks(evs, f"{call}:begin"), marks(evs, f"{call}:end")
    return [(b, [t for t in ts if b < t.post < e]) for b, e in zip(begins, ends)]


def test_metp_attention_order_both_levels(report):
    for traces, ring, weight, ranks in run_ranks(P, _attention_traces):
        # Two communicators over the same ranks: weights on one, K/V on the other.
        assert ring != weight and ranks[ring] == ranks[weight] == list(range(P))
        for phase, call in zip(("fwd", "bwd"), _RING_CALLS):
            evs = traces[phase]
            ts = transfers(evs)
            assert {t.group for t in ts if t.op in ("broadcast", "reduce")} == {weight}
            assert {t.group for t in ts if t.op in ("send", "recv")} == {ring}
            _check_weight_prefetch(evs, ts, call)
            for j, (start, seg) in enumerate(_ring_segments(evs, ts, call)):
                bs = batches(seg)
                where = f"{call} head group {j}"
                if phase == "fwd":
                    # Alg. 3: block i is sent on while the kernel attends to it; p - 1 hops,
                    # K and V in one buffer (one send, one receive per hop).
                    assert [_ops(b) for b in bs] == [{"send": 1, "recv": 1}] * (P - 1)
                    assert_all_overlap(evs, seg, where)
                    assert all(computes_on_sent(evs, t) for t in seg if t.op == "send")
                    assert_posted_before_compute(evs, bs, start)
                    continue
                # Alg. 4: K/V hops (steps 0..p-2) hide behind their step's backward kernel, the
                # dK/dV accumulator hops (steps 1..p-2) behind the next step's. The last one
                # (step p-1, the segment's last post) has no next step: it hides behind dQ's
                # back-projection GEMMs instead. K/V and dK/dV each travel as one buffer.
                assert [_ops(b) for b in bs] == [{"send": 1, "recv": 1}] * (2 * P - 2)
                assert_all_overlap(evs, seg, where)
                inside = [[k.name for k in kernels(window(evs, b[0]))] for b in bs]
                attn_kernels = [sum("attention" in n for n in names) for names in inside]
                assert attn_kernels == [1] * (2 * P - 3) + [0], f"{where}: {inside}"
                kv = [b for b in bs if all(computes_on_sent(evs, t) for t in b if t.op == "send")]
                assert len(kv) == P - 1, f"{where}: {len(kv)} K/V hops computed on while sent"
                assert_posted_before_compute(evs, kv, start)
            if phase == "bwd":
                # Alg. 6 line 11: head group j's gradient reduce completes while head group
                # j + 1 computes (its ring inside the window); the last one has nothing after it.
                bs = batches([t for t in ts if t.op == "reduce"])
                assert [_ops(b) for b in bs] == [{"reduce": 3}] * P
                begins, ends = marks(evs, f"{call}:begin"), marks(evs, f"{call}:end")
                for j in range(P - 1):
                    for t in bs[j]:
                        assert t.post < begins[j + 1] and ends[j + 1] < t.wait, (
                            f"head group {j}'s reduce does not enclose head group {j + 1}'s ring")
                assert_exposed(evs, bs[-1], "the last head group's gradient reduce")
    report(f"overlap order, METP attention p={P}: weights j+1 around ring j (fwd, bwd), "
           f"reduce j around ring j+1, K/V and dK/dV hops around kernels (the last dK/dV hop "
           f"around dQ's back-projection); exposed: head group 0's weights, the last reduce")


# ----------------------------------------------------------------------------------------------
# WallFacer: team all-gather (team group), initial send, sub-ring hops (context-parallel group),
# lse-merged reduce-scatter (team group); backward the transposes, queries on the ring.


def _wallfacer_traces(team_size: int):
    from megatron_metp.wallfacer.attention import wallfacer_attention
    from megatron_metp.wallfacer.groups import build_wallfacer_groups

    world = dist.get_world_size()
    plan = build_wallfacer_groups([list(range(world))], list(range(world)), None, team_size,
                                  "collective_intra")
    # 4 tokens per rank = its two zigzag chunks of 2; causal: with the zigzag layout every
    # (query team, K/V team) pair has a visible chunk pair, so every ring step has a kernel.
    b, n, d, s_local = 1, 2, 8, 4
    g = torch.Generator().manual_seed(dist.get_rank())
    q, k, v = (torch.randn(s_local, b, n, d, generator=g).requires_grad_() for _ in range(3))
    traces = _record(
        lambda: wallfacer_attention(q, k, v, plan, causal=True, softmax_scale=d ** -0.5),
        _backward)
    info = dict(G=plan.ring_length, self_send=plan.init_send_to == plan.idx,
                cp=dist.distributed_c10d._get_default_group().group_name,
                team=plan.team_group_pg.group_name if plan.team_group_pg is not None else None)
    return traces, info


def _phases_of(evs, ts):
    """(set-up, ring, final) transfers: waited on before the first kernel, posted after the
    last one, and the others. Set-up and final transfers cannot overlap compute."""
    first, last = heavy_span(evs)
    setup = [t for t in ts if t.wait < first]
    final = [t for t in ts if t.post > last]
    ring = [t for t in ts if t not in setup and t not in final]
    return setup, ring, final


def _check_wallfacer(traces, info, C: int) -> Dict[str, Counter]:
    """Checks one rank's traces; returns the ops of its exposed transfers per phase."""
    G, team, cp = info["G"], info["team"], info["cp"]
    ss = info["self_send"]  # this rank keeps its K/V: no initial send, no dK/dV return
    exposed = {}
    for phase in ("fwd", "bwd"):
        evs = traces[phase]
        ts = transfers(evs)
        where = f"WallFacer C={C} G={G} {phase}"
        # Team collectives and sub-ring P2P on different communicators.
        assert {t.group for t in ts if t.op in ("all_gather", "reduce_scatter")} <= {team}
        assert {t.group for t in ts if t.op in ("send", "recv")} <= {cp}
        assert team != cp
        setup, ring, final = _phases_of(evs, ts)
        # K/V move as member shards, one buffer (one send) each.
        if phase == "fwd":
            # Waited on before the first kernel: the team all-gathers (K/V and q, one call
            # each) and the initial send of member shard 0; the other shards' initial send
            # runs behind shard 0's kernels onwards.
            head = (Counter(all_gather=2) if C > 1 else Counter()) \
                + (Counter() if ss else Counter(send=1, recv=1))
            # After the last kernel: the team merge, one lse all-gather and one
            # reduce-scatter.
            tail = Counter(all_gather=1, reduce_scatter=1) if C > 1 else Counter()
            middle = (Counter() if ss else Counter(send=C - 1, recv=C - 1)) \
                + Counter(send=C * (G - 1), recv=C * (G - 1))
        else:
            # Before the first kernel: the team all-gathers (K/V and the query packages) and
            # the whole initial send (step 0's first query shard reads every K/V shard).
            head = (Counter(all_gather=2) if C > 1 else Counter()) \
                + (Counter() if ss else Counter(send=C, recv=C))
            # After the last kernel: the last query shard's dq hop home, the last K/V shard's
            # dK/dV return, the team reduce-scatter.
            tail = (Counter(reduce_scatter=1) if C > 1 else Counter()) \
                + (Counter(send=1, recv=1) if G > 1 else Counter()) \
                + (Counter() if ss else Counter(send=1, recv=1))
            # Behind kernels: one hop per member shard and step that moves a package head
            # (steps 0..G-2) or a dq one step behind (steps 2..G-1), the other query shards'
            # hops home and the other K/V shards' returns.
            hops = (G - 1) + (1 if G >= 3 else 0)
            n = C * hops + (C - 1 if G > 1 else 0) + (0 if ss else C - 1)
            middle = Counter(send=n, recv=n)
        assert _ops(setup) == head, f"{where}: waited on before any kernel: {_ops(setup)}"
        assert _ops(final) == tail, f"{where}: after the last kernel: {_ops(final)}"
        assert _ops(ring) == middle, f"{where}: behind kernels: {_ops(ring)}"
        exposed[phase] = _ops(setup) + _ops(final)
        # Everything else is posted before kernels and waited after them; a sub-ring hop's
        # kernels read the block it sends (forward K/V, backward the query package).
        assert_all_overlap(evs, ring, f"{where}: transfers behind kernels")
        read = [b for b in batches(ring)
                if any(t.op == "send" and computes_on_sent(evs, t) for t in b)]
        assert len(read) >= C * (G - 1), f"{where}: {len(read)} batches computed on"
        # Sub-ring hops are posted before the kernels they hide behind. (The lse all-gather,
        # the last dq hops and the dK/dV returns are posted once their data is final, after
        # the kernels that made it, and hide behind the next ones: assert_all_overlap above.)
        prev = max((t.wait for t in setup), default=0)
        assert_posted_before_compute(evs, read, prev)
    return exposed


@pytest.mark.parametrize("team_size", [1, 2])
def test_wallfacer_order(team_size, report):
    exposed = {"fwd": Counter(), "bwd": Counter()}
    for traces, info in run_ranks(P, _wallfacer_traces, team_size):
        for phase, ops in _check_wallfacer(traces, info, team_size).items():
            exposed[phase] += ops
    report(f"overlap order, WallFacer P={P} C={team_size}: every sub-ring hop overlapped; "
           f"exposed transfers summed over ranks: "
           + "; ".join(f"{ph} {dict(ops) or 'none'}" for ph, ops in exposed.items()))


@pytest.mark.full
def test_wallfacer_order_team_and_ring():
    """P = 8, C = 2: teams of two and sub-rings of two (the only case with both below P = 16)."""
    for traces, info in run_ranks(8, _wallfacer_traces, 2, timeout=300):
        assert info["G"] == 2
        _check_wallfacer(traces, info, 2)
