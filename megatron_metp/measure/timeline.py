"""ESTIMATE: a discrete-event model of one GPU running one layer's op trace (``op_trace``).

Nothing here is measured; the compute efficiencies and the host cost are fitted to the one GPU
measurement on record (below). The model (every number below is an input, stated):

* One compute stream. A compute op takes ``max(flops / (peak x efficiency), bytes / (HBM x
  mem_efficiency))`` (a roofline), in program order.
* One FIFO per communicator (process group: on NCCL one group = one communicator = one stream;
  ../shared/FACTS.md). A comm op is posted when the compute stream has reached it
  (ProcessGroupNCCL makes its stream wait for the current stream) and starts when its group's
  FIFO is free.
* A ``wait`` makes the compute stream wait until that comm op ends (``Work.wait()`` on NCCL).
* The GPU's links are shared by whatever runs on them at once: each link (NVLink, InfiniBand)
  has an outgoing and an incoming direction; a send uses the outgoing one, a receive the
  incoming one, every collective both. Calls in flight at once share each direction equally
  (a call runs at 1/k of its rate where k calls use its busiest direction), so two
  communicators' traffic takes as long on one link as the same bytes on one communicator,
  and a short call beside a long one runs at half its rate instead of waiting for it. Sends
  and receives posted together on one group (no compute or wait between them: one
  ``batch_isend_irecv``, one ``ncclGroupStart/End``) are one FIFO entry: the sends share the
  outgoing direction, the receives the incoming one (NVSwitch: one per-direction figure per
  GPU, whatever the peer), and a wait on any of them waits for the batch. The ops of a batch
  share the link's rate, and so do different communicators on one link: METP's weight traffic
  (its own communicator) is not free beside its all-to-alls (the TP group's).
* Alpha-beta links (NCCL's ring algorithms), S = payload (CommCounter's convention), p = group
  size, B = link bandwidth per direction x bus efficiency, alpha per call:
  all_gather, reduce_scatter, all_to_all: alpha + (p-1)/p S/B;  all_reduce: alpha + 2(p-1)/p S/B;
  broadcast, reduce (pipelined chain): alpha + S/B;  send, recv, ring_step: alpha + S/B.
  A group of at most ``gpus_per_node`` ranks runs on NVLink, a larger one on InfiniBand (its
  slowest link).

GPU data (NVIDIA data sheets; dense, no sparsity):

============  ==================  ===============  ==========================  ================
GPU           bf16 dense peak     HBM              NVLink per GPU              InfiniBand / GPU
============  ==================  ===============  ==========================  ================
H100 SXM      989 TFLOP/s         3.35 TB/s HBM3   NVLink 4: 900 GB/s bidir.   NDR 400 Gb/s
                                                   = 450 GB/s per direction    = 50 GB/s
A100 80GB     312 TFLOP/s         2.039 TB/s       NVLink 3: 600 GB/s bidir.   HDR 200 Gb/s
SXM                               HBM2e            = 300 GB/s per direction    = 25 GB/s
============  ==================  ===============  ==========================  ================

(H100 SXM data sheet: 1,979 TFLOP/s bf16 *with sparsity*, 989 dense; A100 data sheet: 312 dense,
624 sparse. DGX H100: 8 ConnectX-7 NDR 400 Gb/s, one per GPU; DGX A100: 8 ConnectX-6 HDR
200 Gb/s, one per GPU.) Bus efficiency 0.8: NCCL-tests' all_reduce bus bandwidth on an 8-GPU
DGX reaches about 80 % of the NVLink per-direction figure for large messages (~230-240 GB/s of
300 on A100, ~360-370 GB/s of 450 on H100 without NVLink SHARP); the same fraction is assumed for
InfiniBand. Alpha (per call): 10 us on NVLink, 20 us over InfiniBand: the order of NCCL-tests'
small-message (8 B-64 KiB) times inside a DGX and across two; assumptions, not measured here.
Compute efficiency (``measure.fitted``, fitted to the GPU calibrations on record,
``docs/calibration/README.md``: LLaMA-7B rank 7 of 8, stock tp and METP, communication stubbed;
one H200 at 4k-128k, then two H100 measurements at 32k-256k): GEMMs at 0.86 of bf16 peak
(``--efficiency``; 0.84-0.88 measured on the H100s for both families' GEMMs, since METP's ring
steps run whole-token GEMMs; the H200 fit was 0.75, between stock's 0.85-0.87 and METP's then
ring-sliced 0.63-0.70), fused attention kernels at 0.66 (``--attention-efficiency``; cuDNN's
Hopper kernel, which stock's SDPA and METP's ring both run: 0.64-0.68 measured), HBM at 0.8 for
the other ops (a dense copy measures 0.80), and at 0.60 for element-wise ops on strided or
broadcast operands (``TraceOp.strided``: PyTorch's unvectorised kernels, fitted by op to the
fourth measurement's profiles; METP's online-softmax merges and ring accumulators, RoPE's
products). Until the first calibration the model assumed 0.5 for every kernel; it
over-estimated stock's step by 1.3x and under-estimated METP's by up to 1.26x.

A layer in a stack (:func:`layer_in_stack`): a device runs its L layers back to back (forward of
every layer, then the backwards in reverse order), and the host, issuing ahead of the GPU, has
the next layer's first ops queued when the previous one ends. One layer simulated alone starts
with the GPU idle while the host issues its first ops, and ends with nothing after it to hide
its last transfers behind. So a device's step is the first layer's time plus L - 1 times the
*steady* one: the time a second layer adds to a stack of two, simulated as the stack runs them
(forward of both, backward of the second, backward of the first). Every family alike.

Host: one CPU thread issues the ops in program order, ``host_op_s`` each (compute and comm
alike; a wait costs nothing on the host: ``Work.wait()`` on NCCL only orders streams). No op starts
on the GPU before the host has issued it, so a layer of many small ops becomes host-bound: its
step is then set by the host's issue time, not by the GPU's. The default is 30 us per traced op
(``--host-op-us``), measured: at 4k, where both families are host-bound, the calibration's H200
machine took 35 us per traced op for stock's layer (125 ops in 4.4 ms) and 33 us for METP's (553
ops in 18.5 ms): PyTorch eager dispatch, autograd and the modules' Python, not only the CUDA
launch (an earlier default assumed 10 us). A row is flagged host-bound when the host's issue
time is at least the compute stream's busy time.
"""

from __future__ import annotations

import json
from dataclasses import dataclass, field, replace
from typing import Dict, List, Optional

from megatron_metp.measure.fitted import (ATTENTION_EFFICIENCY, GEMM_EFFICIENCY, HOST_OP_US,
                                           MEM_EFFICIENCY, STRIDED_MEM_EFFICIENCY)
from megatron_metp.measure.op_trace import GEMMS, TraceOp, is_attention_kernel

__all__ = ["Link", "Machine", "GPUS", "simulate", "Schedule", "tp_comm_overlap", "comm_time",
           "stack_of_two", "layer_in_stack",
           "GEMM_EFFICIENCY", "ATTENTION_EFFICIENCY", "HOST_OP_US", "MEM_EFFICIENCY",
           "STRIDED_MEM_EFFICIENCY",
           "chrome_trace"]

ESTIMATE = "ESTIMATE (simulated, not measured on a GPU)"


@dataclass(frozen=True)
class Link:
    name: str
    bandwidth: float          # bytes/s per direction, peak
    alpha: float              # seconds per call
    efficiency: float = 0.8   # achievable fraction of ``bandwidth`` (bus efficiency)
    # ``bandwidth`` is one NIC per node that the node's GPUs share: the frontier gives each
    # GPU 1 / (GPUs per node) of it (``Machine.per_gpu``).
    shared_by_node: bool = False

    @property
    def beta(self) -> float:  # achievable bytes/s
        return self.bandwidth * self.efficiency


@dataclass(frozen=True)
class Machine:
    name: str
    peak_flops: float
    hbm_bandwidth: float
    intra: Link
    inter: Link
    efficiency: float = GEMM_EFFICIENCY   # fraction of peak FLOP/s (all but attention)
    mem_efficiency: float = MEM_EFFICIENCY   # fraction of HBM bandwidth
    gpus_per_node: int = 8
    op_overhead: float = 0.0      # seconds per compute op (GPUs: 0, launches are queued ahead)
    host_op_s: float = 0.0        # host seconds to issue one op (module docstring)
    attention_efficiency: float = ATTENTION_EFFICIENCY   # fraction of peak, attention kernels
    # fraction of HBM bandwidth for element-wise ops on strided / broadcast operands
    strided_mem_efficiency: float = STRIDED_MEM_EFFICIENCY

    def compute_time(self, op: TraceOp) -> float:
        eff = self.attention_efficiency if is_attention_kernel(op.name) else self.efficiency
        mem = self.strided_mem_efficiency if op.strided else self.mem_efficiency
        return self.op_overhead + max(op.flops / (self.peak_flops * eff),
                                      op.bytes / (self.hbm_bandwidth * mem))

    def per_gpu(self) -> "Machine":
        """This machine with a node-shared inter-node link split over its GPUs per node (every
        GPU of a node crossing at once: the DP and CP collectives, and rings whose every member
        sends across)."""
        if not self.inter.shared_by_node:
            return self
        return replace(self, inter=replace(self.inter, shared_by_node=False,
                                           bandwidth=self.inter.bandwidth / self.gpus_per_node))

    def link(self, group_size: int) -> Link:
        """The link of a group of ``group_size`` consecutive ranks (filling nodes in order)."""
        return self.intra if group_size <= self.gpus_per_node else self.inter

    def link_of(self, op) -> Link:
        """The link a traced comm op runs on: NVLink when every rank it connects is in one
        node (``op.ranks``; ranks fill nodes in order), else InfiniBand; by its group's size
        when the ranks are unknown."""
        if op.ranks:
            return self.intra if len({r // self.gpus_per_node for r in op.ranks}) == 1 \
                else self.inter
        return self.link(op.group_size)


GPUS: Dict[str, Machine] = {
    "H100": Machine("H100 SXM", 989e12, 3.35e12,
                    Link("NVLink 4", 450e9, 10e-6), Link("IB NDR 400G", 50e9, 20e-6)),
    "A100": Machine("A100 80GB SXM", 312e12, 2.039e12,
                    Link("NVLink 3", 300e9, 10e-6), Link("IB HDR 200G", 25e9, 20e-6)),
    # The WallFacer paper's Google Cloud A100 40GB nodes (8 or 16 GPUs, NVLink inside): one
    # 100 Gb/s Ethernet per node, 12.5 GB/s, which a single flow may fill ("A100-40GB-eth") or
    # the node's GPUs share when each sends across at once ("A100-40GB-eth-shared"); 50 us per
    # call over TCP (an assumption, twice InfiniBand's). HBM2 1.555 TB/s (data sheet).
    "A100-40GB-eth": Machine("A100 40GB SXM, 100 GbE", 312e12, 1.555e12,
                             Link("NVLink 3", 300e9, 10e-6), Link("100 GbE", 12.5e9, 50e-6)),
    "A100-40GB-eth-shared": Machine(
        "A100 40GB SXM, 100 GbE shared", 312e12, 1.555e12, Link("NVLink 3", 300e9, 10e-6),
        Link("100 GbE per node", 12.5e9, 50e-6, shared_by_node=True)),
}


def comm_time(op: str, payload: float, p: int, link: Link) -> float:
    """Seconds of one call (module docstring: alpha-beta, NCCL's ring algorithms)."""
    if op in ("send", "recv", "ring_step", "broadcast", "reduce"):
        factor = 1.0
    elif op in ("all_gather", "reduce_scatter", "all_to_all", "gather", "scatter"):
        factor = (p - 1) / p
    elif op == "all_reduce":
        factor = 2 * (p - 1) / p
    elif op == "barrier":
        factor = 0.0
    else:
        raise ValueError(f"comm_time: unknown op {op!r}")
    if p <= 1 and op not in ("send", "recv", "ring_step"):
        return 0.0
    return link.alpha + factor * payload / link.beta


@dataclass
class Interval:
    lane: str        # "compute" or "comm:<group>"
    name: str
    phase: str
    start: float
    end: float


@dataclass
class Schedule:
    intervals: List[Interval] = field(default_factory=list)
    step: float = 0.0
    compute: float = 0.0            # busy time of the compute stream
    comm: Dict[str, float] = field(default_factory=dict)   # busy time per communicator
    host: float = 0.0               # time the host spends issuing the ops

    @property
    def host_bound(self) -> bool:
        """The host issues ops no faster than the GPU runs them (module docstring)."""
        return self.host > 0 and self.host >= self.compute

    @property
    def exposed_comm(self) -> float:
        """Step time during which the compute stream is not computing (waiting on comm)."""
        return max(self.step - self.compute, 0.0)


# The link directions each kind of call uses: a send only the outgoing one, a receive only
# the incoming one, every collective (and tp_comm_overlap's ring steps) both.
_DIRECTIONS = {"send": ("out",), "recv": ("in",)}


class _Job:
    __slots__ = ("op", "lane", "d", "left", "uses", "start", "end", "unit")

    def __init__(self, op: TraceOp, lane: str, d: float, uses: tuple, unit: list):
        self.op, self.lane, self.d, self.left, self.uses = op, lane, d, d, uses
        self.start = self.end = None
        self.unit = unit           # the jobs posted as one (a P2P batch), this one included


class _Links:
    """The communication calls in flight on one GPU (module docstring): one FIFO per
    communicator, the GPU's links shared by whatever runs on them at once."""

    def __init__(self, sch: Schedule):
        self.sch = sch
        self.now = 0.0
        self.queues: Dict[str, List[tuple]] = {}    # group -> [(release, unit)] not started
        self.running: Dict[str, list] = {}          # group -> its unit in flight
        self.active: List[_Job] = []

    def post(self, group: str, release: float, unit: list) -> None:
        self.queues.setdefault(group, []).append((release, unit))

    def _start_ready(self) -> None:
        for group, queue in self.queues.items():
            if group not in self.running and queue and queue[0][0] <= self.now + 1e-15:
                _, unit = queue.pop(0)
                self.running[group] = unit
                for job in unit:
                    job.start = self.now
                    self.active.append(job)

    def _next_release(self) -> float:
        return min((q[0][0] for g, q in self.queues.items() if q and g not in self.running),
                   default=float("inf"))

    def run(self, until=None) -> None:
        """Advance until every job of ``until`` (a unit) has ended, or until all have."""
        while True:
            self._start_ready()
            if until is not None and all(j.end is not None for j in until):
                return
            if not self.active:
                nxt = self._next_release()
                if nxt == float("inf"):
                    return
                self.now = nxt
                continue
            users: Dict[tuple, int] = {}
            for j in self.active:
                for u in j.uses:
                    users[u] = users.get(u, 0) + 1
            rates = {j: 1.0 / max(users[u] for u in j.uses) for j in self.active}
            step = min(min(j.left / rates[j] for j in self.active),
                       self._next_release() - self.now)
            self.now += step
            done = []
            for j in self.active:
                j.left -= rates[j] * step
                if j.left <= 1e-15 * max(1.0, j.d) or j.left / rates[j] <= 1e-15:
                    j.left, j.end = 0.0, self.now
                    done.append(j)
                    self.sch.intervals.append(Interval(j.lane, j.op.name, j.op.phase,
                                                       j.start, j.end))
            for j in done:
                self.active.remove(j)
                group = j.op.group
                unit = self.running.get(group)
                if unit is not None and all(x.end is not None for x in unit):
                    del self.running[group]


def simulate(ops: List[TraceOp], machine: Machine) -> Schedule:
    """Replay ``ops`` on ``machine`` (module docstring) and return the schedule."""
    sch = Schedule()
    links = _Links(sch)
    t = 0.0                                   # compute stream clock
    jobs: Dict[int, _Job] = {}                # comm id -> its job
    batch: Dict[str, tuple] = {}              # group -> (position, unit) of an open P2P batch
    position = 0                              # counts computes and waits (batch boundaries)
    host = 0.0                                # host clock: when the next op is issued
    for op in ops:
        if op.kind != "wait":
            host += machine.host_op_s
        if op.kind == "compute":
            d = machine.compute_time(op)
            if d > 0:
                t = max(t, host)
                sch.intervals.append(Interval("compute", op.name, op.phase, t, t + d))
                t += d
                sch.compute += d
            position += 1
        elif op.kind == "wait":
            job = jobs.get(op.comm_id)
            if job is not None:
                # A wait on one call of a P2P batch waits for the batch (one NCCL group).
                links.run(until=job.unit)
                t = max(t, max(j.end for j in job.unit))
            position += 1
        else:
            link = machine.link_of(op)
            d = comm_time(op.name, op.bytes, op.group_size, link)
            lane = f"comm:{op.group}"
            uses = tuple((link.name, way) for way in _DIRECTIONS.get(op.name, ("out", "in")))
            open_batch = batch.get(op.group)
            if op.name in ("send", "recv") and open_batch and open_batch[0] == position:
                unit = open_batch[1]
            else:
                unit = []
                links.post(op.group, max(t, host), unit)
                batch[op.group] = (position if op.name in ("send", "recv") else None, unit)
            job = _Job(op, lane, d, uses, unit)
            unit.append(job)
            jobs[op.comm_id] = job
            sch.comm[lane] = sch.comm.get(lane, 0.0) + d
    links.run()
    sch.step = max([t, host] + [j.end for j in jobs.values() if j.end is not None])
    sch.host = host
    return sch


def stack_of_two(ops: List[TraceOp]) -> List[TraceOp]:
    """One layer's trace ``ops`` run as a stack of two such layers runs it: the forward of the
    first, the forward of the second, the backward of the second, the backward of the first
    (the second's comm calls renumbered). Two layers that hand nothing from one to the other
    trace to exactly this (``tests/test_timeline.py``); METP's chained layers do hand work
    across (``planner.chains_layers``), and are traced as two."""
    off = max([o.comm_id for o in ops] + [0]) + 1
    second = [replace(o, comm_id=o.comm_id + off) if o.comm_id >= 0 else o for o in ops]
    fwd = lambda lst: [o for o in lst if o.phase == "fwd"]  # noqa: E731
    bwd = lambda lst: [o for o in lst if o.phase != "fwd"]  # noqa: E731
    return fwd(ops) + fwd(second) + bwd(second) + bwd(ops)


def layer_in_stack(ops: List[TraceOp], machine: Machine, stacked: Optional[List[TraceOp]] = None
                   ) -> tuple:
    """``(first, steady)`` seconds of one layer (module docstring): alone, and what one more
    adds to a stack (``stacked``: the trace of two layers, :func:`stack_of_two` by default).
    A device of L such layers takes ``first + (L - 1) steady``."""
    first = simulate(ops, machine).step
    two = simulate(stacked if stacked is not None else stack_of_two(ops), machine).step
    return first, two - first


def tp_comm_overlap(ops: List[TraceOp], group: str = "tp", window: int = 12) -> List[TraceOp]:
    """Model of Megatron's ``--tp-comm-overlap`` (Transformer Engine userbuffers) on a trace.

    Each all-gather on ``group`` is split into p - 1 ring steps of S/p bytes, and the first GEMM
    after its wait into p chunks; chunk i waits only for step i (chunk 0 is the local shard): the
    AG+GEMM pipeline. Each reduce-scatter on ``group`` becomes p - 1 ring steps, step i posted
    after chunk i - 1 of the GEMM before it (GEMM+RS pipeline); its wait waits for the last step.
    What it leaves out: the SMs or copy engines the overlap takes from the GEMMs, and TE's
    fused kernels; an AG or RS with no GEMM within ``window`` ops stays as it was.
    """
    new_id = max([o.comm_id for o in ops] + [0]) + 1
    wait_at = {o.comm_id: i for i, o in enumerate(ops) if o.kind == "wait"}
    gemm = lambda o: o.kind == "compute" and o.name in GEMMS and o.flops > 0  # noqa: E731
    plan: Dict[int, tuple] = {}               # op index -> replacement list
    drop: set = set()

    def free_gemm(indices):  # the first GEMM among ``indices`` no other rewrite took
        return next((j for j in indices if gemm(ops[j]) and j not in plan), None)

    for i, c in enumerate(ops):
        if c.kind != "comm" or c.group != group or c.name not in ("all_gather", "reduce_scatter"):
            continue
        p = c.group_size
        if p <= 1 or i in plan:
            continue
        step = [TraceOp("comm", "ring_step", c.phase, bytes=c.bytes / p, group=c.group,
                        group_size=p, comm_id=new_id + k) for k in range(p - 1)]
        if c.name == "all_gather":
            w = wait_at.get(c.comm_id)
            if w is None:
                continue
            g = free_gemm(range(w + 1, min(w + 1 + window, len(ops))))
            if g is None:
                continue
            # chunk k consumes the block that step k - 1 brought
            plan[i], plan[g] = step, _interleave(ops[g], p, lambda k: TraceOp(
                "wait", "wait", c.phase, comm_id=step[k - 1].comm_id))
            drop.add(w)
        else:
            g = free_gemm(range(i - 1, max(i - 1 - window, -1), -1))
            if g is None:
                continue
            # step k - 1 sends what chunk k - 1 produced
            plan[g], plan[i] = _interleave(ops[g], p, lambda k: step[k - 1]), []
            w = wait_at.get(c.comm_id)
            if w is not None:
                plan[w] = [TraceOp("wait", "wait", c.phase, comm_id=step[-1].comm_id)]
        new_id += p - 1
    out: List[TraceOp] = []
    for i, o in enumerate(ops):
        if i in drop:
            continue
        out.extend(plan.get(i, [o]))
    return out


def _split(op: TraceOp, p: int) -> List[TraceOp]:
    return [replace(op, flops=op.flops / p, bytes=op.bytes / p) for _ in range(p)]


def _interleave(op: TraceOp, p: int, between) -> List[TraceOp]:
    """GEMM ``op`` in ``p`` chunks, ``between(k)`` placed before chunk k (k = 1 .. p - 1)."""
    chunks = _split(op, p)
    out = [chunks[0]]
    for k in range(1, p):
        out += [between(k), chunks[k]]
    return out


def chrome_trace(scenarios: Dict[str, Schedule], path: Optional[str] = None,
                 min_us: float = 0.0, meta: Optional[dict] = None) -> dict:
    """Chrome trace-event JSON (opens in Perfetto / chrome://tracing): one process per scenario,
    one thread per stream (compute, each communicator). Adjacent compute intervals shorter than
    ``min_us`` are merged (keeps files small). Labelled ESTIMATE in every process name and in
    ``metadata``."""
    events: List[dict] = []
    for pid, (label, sch) in enumerate(scenarios.items(), start=1):
        events.append({"ph": "M", "pid": pid, "tid": 0, "name": "process_name",
                       "args": {"name": f"ESTIMATE {label}"}})
        lanes = ["compute"] + sorted({iv.lane for iv in sch.intervals} - {"compute"})
        for tid, lane in enumerate(lanes):
            events.append({"ph": "M", "pid": pid, "tid": tid, "name": "thread_name",
                           "args": {"name": lane}})
        tids = {lane: tid for tid, lane in enumerate(lanes)}
        pending = None
        for iv in sch.intervals:
            ts, dur = iv.start * 1e6, (iv.end - iv.start) * 1e6
            if iv.lane == "compute" and dur < min_us:
                if pending and abs(pending["ts"] + pending["dur"] - ts) < 1e-6 \
                        and pending["args"]["phase"] == iv.phase:
                    pending["dur"] = ts + dur - pending["ts"]
                    pending["args"]["ops"] += 1
                    pending["name"] = "small ops"
                    continue
                if pending:
                    events.append(pending)
                pending = {"ph": "X", "pid": pid, "tid": 0, "name": iv.name, "ts": ts,
                           "dur": dur, "args": {"phase": iv.phase, "ops": 1}}
                continue
            if pending:
                events.append(pending)
                pending = None
            events.append({"ph": "X", "pid": pid, "tid": tids[iv.lane], "name": iv.name,
                           "ts": round(ts, 3), "dur": round(dur, 3),
                           "args": {"phase": iv.phase}})
        if pending:
            events.append(pending)
    for e in events:
        if "ts" in e:
            e["ts"], e["dur"] = round(e["ts"], 3), round(e["dur"], 3)
    doc = {"traceEvents": events, "displayTimeUnit": "ms",
           "metadata": {"label": ESTIMATE, **(meta or {})}}
    if path:
        with open(path, "w") as f:
            json.dump(doc, f, separators=(",", ":"))
    return doc
