"""Check the timeline simulator where it can be checked: against ``metp bench`` on this machine.

``metp bench --json PATH`` measures each mode's layer step three ways (overlapped, serialised,
compute = communication stubbed) and this machine's matmul FLOP/s and gloo ring step (bandwidth
and latency), all ranks running at once. :func:`validate` traces the same layer shapes
(``op_trace.trace_layer`` with the bench's ``TransformerConfig``, rank p - 1), replays them on a
``Machine`` built from those measurements (plus a memory-copy bandwidth measured here with the
bench's thread count, and the time of one tiny op as a per-op overhead; efficiencies 1) and reports simulated / measured - 1 per variant:
``overlapped`` (the trace as is), ``serialised`` (a wait after every comm op) and ``compute``
(comm ops removed).
"""

from __future__ import annotations

import time
from typing import Dict, List

import torch

from megatron_metp.measure.op_trace import TraceOp
from megatron_metp.measure.timeline import Link, Machine, simulate


def copy_bandwidth(threads: int, nbytes: int = 64 << 20, iters: int = 5) -> float:
    """Bytes moved per second (read + write) by ``dst.copy_(src)`` of ``nbytes``, best of
    ``iters``, on ``threads`` threads (the bench's per-rank count)."""
    old = torch.get_num_threads()
    torch.set_num_threads(max(1, threads))
    try:
        src = torch.ones(nbytes // 4)
        dst = torch.empty_like(src)
        dst.copy_(src)
        best = float("inf")
        for _ in range(iters):
            t0 = time.perf_counter()
            dst.copy_(src)
            best = min(best, time.perf_counter() - t0)
        return 2 * nbytes / best
    finally:
        torch.set_num_threads(old)


def op_overhead(iters: int = 200) -> float:
    """Seconds of one tiny eager op (``torch.add`` of 8 elements), best of ``iters``: the
    per-op dispatch cost a CPU pays (on a GPU launches are queued ahead of the stream)."""
    a = torch.ones(8)
    best = float("inf")
    for _ in range(iters):
        t0 = time.perf_counter()
        torch.add(a, a)
        best = min(best, time.perf_counter() - t0)
    return best


def serialise(ops: List[TraceOp]) -> List[TraceOp]:
    """Every comm op waited for right after it is posted (``metp bench``'s serialised variant)."""
    out: List[TraceOp] = []
    for o in ops:
        out.append(o)
        if o.kind == "comm":
            out.append(TraceOp("wait", "wait", o.phase, comm_id=o.comm_id))
    return out


def compute_only(ops: List[TraceOp]) -> List[TraceOp]:
    return [o for o in ops if o.kind == "compute"]


def _bench_config(settings: dict, mode: str):
    import torch.nn.functional as F  # noqa: F401 - make_config picks the activation by style

    from megatron_metp.model import make_config

    dtype = torch.bfloat16 if settings["bf16"] else torch.float32
    kw = dict(num_layers=1, hidden_size=settings["hidden_size"],
              num_attention_heads=settings["num_attention_heads"], params_dtype=dtype,
              bf16=settings["bf16"], stock=True)
    if settings.get("ffn_hidden_size"):
        kw["ffn_hidden_size"] = settings["ffn_hidden_size"]
    if settings["style"] == "llama":
        kw["num_query_groups"] = settings.get("num_query_groups") or \
            settings["num_attention_heads"]
    if mode == "wallfacer":
        kw["cp_comm_type"] = "wallfacer"
    return make_config(settings["style"], **kw)


def validate(bench_json: str) -> Dict:
    """Per (mode, s) of the bench: measured and simulated seconds and their relative error."""
    import json

    from megatron_metp.measure.op_trace import trace_layer
    from megatron_metp.measure.planner import FakeWorld

    with open(bench_json) as f:
        res = json.load(f)
    if "overlap" not in res:
        raise ValueError(f"--validate {bench_json}: the bench ran with --no-microbench; rerun "
                         "metp bench without it (the simulator needs its FLOP/s and bandwidth)")
    if res["settings"].get("scope") != "layer":
        raise ValueError(f"--validate {bench_json}: use a `metp bench --scope layer` JSON")
    p = res["world_size"]
    mem_bw = copy_bandwidth(res.get("torch_threads", 1))
    overhead = op_overhead()
    machine = _machine_from_bench(res, mem_bw, overhead)
    world = FakeWorld(rank=p - 1)
    points = []
    for pt in res["points"]:
        if pt["mode"] == "wallfacer":
            continue  # C > 1 teams: the fake world builds C = 1 only (the bench's ring mode)
        mode = "wallfacer" if pt["mode"] == "ring" else pt["mode"]
        world.setup(mode, p)
        ops = trace_layer(None, mode, p, pt["seq_length"], world=world,
                          micro_batch=res["settings"]["micro_batch_size"],
                          tcfg=_bench_config(res["settings"], mode))
        sim = {"overlapped": simulate(ops, machine).step,
               "serialised": simulate(serialise(ops), machine).step,
               "compute": simulate(compute_only(ops), machine).step}
        meas = {k: pt["time_s"][k] for k in sim}
        points.append(dict(mode=pt["mode"], seq_length=pt["seq_length"], measured_s=meas,
                           simulated_s=sim,
                           error={k: sim[k] / meas[k] - 1 for k in sim if meas[k] > 0}))
    world.teardown()
    summary: Dict[str, Dict[str, float]] = {}
    for mode in dict.fromkeys(q["mode"] for q in points):
        mine = [q for q in points if q["mode"] == mode]
        summary[mode] = {k: sum(abs(q["error"][k]) for q in mine) / len(mine)
                         for k in ("overlapped", "serialised", "compute")}
    lines = [f"Simulator vs metp bench on this machine ({bench_json}; p = {p}; machine: "
             f"{machine.peak_flops / 1e9:.1f} GFLOP/s matmul, {mem_bw / 1e9:.1f} GB/s copy, "
             f"{overhead * 1e6:.1f} us per op, gloo "
             f"ring {machine.intra.bandwidth / 1e9:.2f} GB/s + {machine.intra.alpha * 1e6:.0f} "
             "us per call)\n",
             "| mode | s | overlapped ms meas / sim | serialised ms meas / sim | "
             "compute ms meas / sim | error overlapped |", "|---|---:|---:|---:|---:|---:|"]
    for q in points:
        m, s_ = q["measured_s"], q["simulated_s"]
        lines.append(f"| {q['mode']} | {q['seq_length']} | "
                     + " | ".join(f"{m[k] * 1e3:.1f} / {s_[k] * 1e3:.1f}"
                                  for k in ("overlapped", "serialised", "compute"))
                     + f" | {q['error']['overlapped']:+.0%} |")
    lines.append("\nMean |error| per mode: " + "; ".join(
        f"{m}: overlapped {v['overlapped']:.0%}, serialised {v['serialised']:.0%}, compute "
        f"{v['compute']:.0%}" for m, v in summary.items()))
    return dict(bench=bench_json, p=p, machine=dict(
        flops_per_s=machine.peak_flops, copy_bytes_per_s=mem_bw, op_overhead_s=overhead,
        ring_bandwidth=machine.intra.bandwidth, ring_latency_s=machine.intra.alpha),
        points=points, mean_abs_error=summary, markdown="\n".join(lines))


def _machine_from_bench(res: dict, mem_bw: float, op_overhead: float = 0.0) -> Machine:
    ov = res["overlap"]
    ring = ov["ring"]
    gloo = Link("gloo (measured ring step)", ring["bandwidth"], ring["latency"], efficiency=1.0)
    return Machine("this CPU (measured)", ov["flops_per_s"], mem_bw, gloo, gloo,
                   efficiency=1.0, attention_efficiency=1.0, mem_efficiency=1.0,
                   strided_mem_efficiency=1.0, gpus_per_node=1 << 20,
                   op_overhead=op_overhead)
