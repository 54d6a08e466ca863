"""One device against the timeline: rank r's share of one layer, measured with its communication
stubbed, next to the per-rank ESTIMATE ``metp plan --timeline`` makes for it
(``metp bench --calibrate``; the GPU tier runs it when a GPU is lent).

How the communication is stubbed: this process joins torch.distributed's ``fake`` backend as rank
``r`` of ``p`` (``planner.FakeWorld``, Megatron's and the plugin's groups on it). Every
collective and P2P op then returns at once, so the layer runs exactly rank r's kernels (its ring
pieces, its GEMMs, in its order) on real tensors on one device, with no transfer. Values
received are not a peer's: P2P receives leave their buffers as they were, and torch's
``FakeProcessGroup`` copies the input into every chunk of an all-gather's output and a chunk
into a reduce-scatter's. Those copies run on the device inside the timed step; one profiled
step finds them under the c10d ops, and ``measured_net_s`` leaves them out. The timing is
real, the numbers are not (none are checked).

The estimate is the same layer traced under FakeTensorMode for the same rank (``op_trace``),
its communication and waits removed, replayed by ``timeline.simulate`` on the device's machine
model: a GPU's data sheet (``timeline.GPUS``, its fitted efficiencies and host cost), or on a CPU
this machine's measured matmul FLOP/s, copy bandwidth and per-op time (``timeline_validate``;
efficiencies 1). ``measured / estimate`` calibrates the timeline: on a GPU it says how far the
roofline, the fitted efficiencies and the host cost are from that GPU
(``docs/calibration/README.md`` holds the one run on record, which fitted them).
"""

from __future__ import annotations

import time
from dataclasses import replace
from typing import Dict, List, Optional

import torch


def machine_for(device: torch.device, gpu: str, efficiency: float, host_op_us: float):
    """The timeline's machine model for ``device`` (module docstring)."""
    from megatron_metp.measure.timeline import GPUS, Link, Machine

    if device.type == "cuda":
        return replace(GPUS[gpu], efficiency=efficiency, host_op_s=host_op_us * 1e-6)
    from megatron_metp.measure.comm_modes import matmul_flops
    from megatron_metp.measure.timeline_validate import copy_bandwidth, op_overhead

    threads = torch.get_num_threads()
    none = Link("none", 1e18, 0.0, efficiency=1.0)   # no communication in this replay
    return Machine(f"this CPU ({threads} threads)", matmul_flops(dtype=torch.bfloat16),
                   copy_bandwidth(threads), none, none, efficiency=1.0,
                   attention_efficiency=1.0, mem_efficiency=1.0, strided_mem_efficiency=1.0,
                   op_overhead=op_overhead())


def calibrate(cfg, mode: str, p: int, rank: int, seq_length: int, device: torch.device, *,
              iters: int = 5, warmup: int = 2, gpu: str = "H100",
              efficiency: Optional[float] = None, host_op_us: Optional[float] = None,
              ring_pass: str = "auto", profile: bool = False,
              recompute_modules: Optional[List[str]] = None, full_recompute: bool = False,
              qkv_backward: str = "recompute") -> Dict:
    """Measure rank ``rank``'s share of one layer of ``cfg`` (a model config) at ``p`` ranks and
    ``seq_length`` on ``device`` (fwd + bwd, best of ``iters``), and estimate it; returns both.
    ``profile``: one more step under ``torch.profiler``, its kernels summed by name
    (:func:`_profile`). ``recompute_modules`` / ``full_recompute`` / ``qkv_backward``: the
    frontier's configurations (Megatron's selective or full recompute, METP's
    ``--metp-qkv-backward``), planned and run alike."""
    from megatron_metp.measure import layer_probe
    from megatron_metp.measure.comm_modes import sync
    from megatron_metp.measure.op_trace import summary, trace_layer
    from megatron_metp.measure.planner import FakeWorld, transformer_config
    from megatron_metp.measure.timeline import GEMM_EFFICIENCY, HOST_OP_US, simulate

    if not 0 <= rank < p:
        raise ValueError(f"--calibrate-rank {rank}: must be in 0..{p - 1}")
    world = FakeWorld(rank=rank)
    try:
        ops = trace_layer(cfg, mode, p, seq_length, world=world, ring_pass=ring_pass,
                          recompute_modules=recompute_modules, qkv_backward=qkv_backward,
                          full_recompute=full_recompute)
        compute_ops = [op for op in ops if op.kind == "compute"]
        machine = machine_for(device, gpu, GEMM_EFFICIENCY if efficiency is None else efficiency,
                              HOST_OP_US if host_op_us is None else host_op_us)
        est = simulate(compute_ops, machine)
        tcfg = transformer_config(cfg, p, mode, recompute_modules, ring_pass, qkv_backward,
                                  full_recompute=full_recompute)
        causal = getattr(cfg, "causal", True)
        rope = cfg.position_embedding_type == "rope" and mode != "wallfacer"
        layer = layer_probe.build_layer(tcfg, mode, causal).to(device)
        layer, x, _extra, fwd = layer_probe._layer_step(
            tcfg, mode, seq_length, 1, causal, rope, getattr(cfg, "rotary_base", 10000), layer,
            device)
        layer_probe.give_main_grads(layer)
        grad = torch.randn_like(x)
        samples = []
        for i in range(warmup + iters):
            x.grad = None
            sync(device)
            t0 = time.perf_counter()
            fwd(x).backward(grad)
            sync(device)
            if i >= warmup:
                samples.append(time.perf_counter() - t0)
        # One more step under the profiler: the tables of --calibrate-profile, and always the
        # time of the copies the fake process group makes inside its collectives (below).
        kernels = _profile(lambda x=x, grad=grad: fwd(x).backward(grad), device)
        del layer, x, grad
    finally:
        world.teardown()
    measured = min(samples)
    # The ``fake`` backend is not free: to hand back defined values it copies the input into
    # every chunk of an all-gather's output and a chunk into a reduce-scatter's (torch's
    # FakeProcessGroup). Those copies run on this device's stream in the timed step, where a
    # real backend runs communication kernels that the estimate leaves out as well; stock
    # TP + SP gathers whole activations (56 copies of [s/p, b, h], 5.0 ms of its 128k layer
    # with layernorm + mlp recompute on an H100), METP only weights. So the comparison with
    # the estimate uses the measured step without them.
    stub = kernels["stub_copies"]["time_s"]
    net = max(measured - stub, 0.0)
    estimate = max(est.compute, est.host)
    if not profile:
        kernels = {"stub_copies": kernels["stub_copies"]}
    return {"model": cfg.name, "mode": mode, "p": p, "rank": rank, "seq_length": seq_length,
            "ring_pass": ring_pass, "recompute_modules": list(recompute_modules or []),
            "full_recompute": full_recompute, "qkv_backward": qkv_backward,
            "device": str(device), "machine": machine.name,
            "measured_s": measured, "samples_s": samples,
            "stub_copies_s": stub, "measured_net_s": net,
            "estimate_s": estimate, "estimate_compute_s": est.compute,
            "estimate_host_s": est.host, "compute_ops": summary(compute_ops)["compute_ops"],
            "measured_over_estimate": net / estimate,
            "kernels": kernels,
            "label": "estimate: simulated (megatron_metp/measure/timeline.py); measured: this "
                     "device, communication stubbed; measured_net_s: less the fake process "
                     "group's copies (stub_copies_s, from one profiled step)"}


def _kind(name: str) -> str:
    """A kernel's class, by its name: GEMM, attention, or the rest (elementwise, reductions,
    copies)."""
    low = name.lower()
    if "flash" in low or "fmha" in low or "attention" in low:
        return "attention"
    if any(k in low for k in ("gemm", "cutlass", "nvjet", "sm90_xmma", "aten::mm", "aten::addmm",
                              "aten::bmm", "aten::matmul")):
        return "gemm"
    return "other"


def _profile(step, device: torch.device, top: int = 25) -> Dict:
    """One ``step()`` under ``torch.profiler``: device kernels (on a CPU, aten ops' self time)
    summed by name, the ``top`` longest listed, and totals per class (:func:`_kind`). ``ops``
    attributes the same time to the aten ops that launched it, by name and input shapes (every
    op, longest first, so that the time can be split by kind of op): a kernel's name alone
    rarely says which line of the layer it came from."""
    from torch.autograd import DeviceType
    from torch.profiler import ProfilerActivity, profile

    from megatron_metp.measure.comm_modes import sync

    cuda = device.type == "cuda"
    acts = [ProfilerActivity.CPU] + ([ProfilerActivity.CUDA] if cuda else [])
    sync(device)
    with profile(activities=acts, record_shapes=True) as prof:
        step()
        sync(device)
    by_name: Dict[str, list] = {}
    for evt in prof.events():
        if cuda:
            if evt.device_type != DeviceType.CUDA:
                continue
            t = evt.device_time
        else:
            if not evt.name.startswith("aten::"):
                continue
            t = evt.self_cpu_time_total
        entry = by_name.setdefault(evt.name, [0, 0.0])
        entry[0] += 1
        entry[1] += t * 1e-6
    # The copies the fake process group makes inside its collectives: the ``copy_`` ops whose
    # caller chain holds a c10d op (their self CPU time; on a GPU, the kernels they launched).
    stub_count, stub_time = 0, 0.0
    for evt in prof.events():
        if evt.device_type != DeviceType.CPU or evt.name != "aten::copy_":
            continue
        parent = evt.cpu_parent
        while parent is not None and not parent.name.startswith("c10d::"):
            parent = parent.cpu_parent
        if parent is None:
            continue
        t = evt.self_device_time_total if cuda else evt.self_cpu_time_total
        if t > 0:
            stub_count += 1
            stub_time += t * 1e-6
    rows = sorted(({"name": n[:160], "kind": _kind(n), "count": c, "time_s": t}
                   for n, (c, t) in by_name.items()), key=lambda r: -r["time_s"])
    totals: Dict[str, Dict[str, float]] = {}
    for r in rows:
        k = totals.setdefault(r["kind"], {"count": 0, "time_s": 0.0})
        k["count"] += r["count"]
        k["time_s"] += r["time_s"]
    return {"source": "CUDA kernels" if cuda else "aten ops (self CPU time)",
            "count": sum(r["count"] for r in rows), "time_s": sum(r["time_s"] for r in rows),
            "by_kind": totals, "top": rows[:top], "ops": _ops_by_shape(prof, cuda),
            "stub_copies": {"count": stub_count, "time_s": stub_time}}


def _ops_by_shape(prof, cuda: bool) -> list:
    """The profiled step's aten ops grouped by name and input shapes, each with the device time
    of the kernels it launched (on a CPU: its self CPU time), longest first."""
    rows = []
    for avg in prof.key_averages(group_by_input_shape=True):
        if not avg.key.startswith("aten::"):
            continue
        t = (getattr(avg, "self_device_time_total", None) if cuda
             else avg.self_cpu_time_total) or 0.0
        if t > 0:
            rows.append({"op": avg.key, "shapes": [list(x) for x in avg.input_shapes if x],
                         "count": avg.count, "time_s": t * 1e-6})
    return sorted(rows, key=lambda r: -r["time_s"])


def _setting(res: Dict) -> str:
    """The calibrated configuration beyond the mode, as its flags ('' for the defaults)."""
    parts = []
    if res.get("full_recompute"):
        parts.append("full recompute")
    if res.get("recompute_modules"):
        parts.append("recompute " + " ".join(res["recompute_modules"]))
    if res.get("ring_pass", "auto") != "auto":
        parts.append(f"ring pass {res['ring_pass']}")
    if res.get("qkv_backward", "recompute") != "recompute":
        parts.append(f"qkv-backward {res['qkv_backward']}")
    return f" [{', '.join(parts)}]" if parts else ""


def markdown(res: Dict) -> str:
    return (f"metp bench --calibrate: {res['model']} {res['mode']}{_setting(res)} "
            f"p={res['p']} rank "
            f"{res['rank']} s={res['seq_length']} on {res['device']}: measured "
            f"{res['measured_s'] * 1e3:,.2f} ms (best of {len(res['samples_s'])}, communication "
            f"stubbed), {res['measured_net_s'] * 1e3:,.2f} ms without the fake process group's "
            f"copies ({res['kernels']['stub_copies']['count']} in "
            f"{res['stub_copies_s'] * 1e3:,.2f} ms); ESTIMATE {res['estimate_s'] * 1e3:,.2f} ms "
            f"on {res['machine']} "
            f"(compute {res['estimate_compute_s'] * 1e3:,.2f}, host "
            f"{res['estimate_host_s'] * 1e3:,.2f}; {res['compute_ops']} ops); measured / "
            f"estimate = {res['measured_over_estimate']:.2f}")


__all__ = ["calibrate", "machine_for", "markdown"]


def run(args) -> int:
    """``metp bench --calibrate``: one process, no launcher (module docstring)."""
    import json
    import warnings

    from megatron_metp.models.config import load_config

    warnings.filterwarnings("ignore")
    device = (torch.device("cuda", torch.cuda.current_device()) if torch.cuda.is_available()
              else torch.device("cpu"))
    cfg = load_config(args.calibrate_model)
    results = [calibrate(cfg, args.calibrate_mode, args.calibrate_p,
                         args.calibrate_p - 1 if args.calibrate_rank is None
                         else args.calibrate_rank, s, device, iters=args.iters,
                         warmup=args.warmup, gpu=args.calibrate_gpu,
                         host_op_us=args.calibrate_host_op_us,
                         profile=args.calibrate_profile,
                         recompute_modules=args.calibrate_recompute_modules,
                         full_recompute=args.calibrate_recompute_full,
                         qkv_backward=args.calibrate_metp_qkv_backward,
                         ring_pass=args.calibrate_metp_ring_pass)
               for s in args.seq_lengths]
    for res in results:
        print(markdown(res))
        if "top" in res["kernels"]:
            k = res["kernels"]
            print(f"  profiled step: {k['count']} {k['source']}, {k['time_s'] * 1e3:,.2f} ms; "
                  + ", ".join(f"{kind} {v['count']} in {v['time_s'] * 1e3:,.2f} ms"
                              for kind, v in sorted(k["by_kind"].items())))
            for r in k["ops"][:8]:
                print(f"    {r['time_s'] * 1e3:8.3f} ms  {r['count']:4d} x {r['op']} "
                      f"{r['shapes']}"[:160])
    if args.json:
        with open(args.json, "w") as f:
            json.dump({"calibration": results}, f, indent=1)
        print(f"[metp bench --calibrate] wrote {args.json}")
    return 0


def check(args, rank: Optional[int] = None) -> None:
    """Start-up checks of the calibration flags (exit code 2 through the CLI)."""
    if args.calibrate_p < 1:
        raise ValueError(f"--calibrate-p {args.calibrate_p}: must be >= 1")
    r = args.calibrate_rank
    if r is not None and not 0 <= r < args.calibrate_p:
        raise ValueError(f"--calibrate-rank {r}: must be in 0..{args.calibrate_p - 1}")
    from megatron_metp.measure.plan_report import RECOMPUTE_MODULES

    bad = [m for m in args.calibrate_recompute_modules or [] if m not in RECOMPUTE_MODULES]
    if bad:
        raise ValueError(f"--calibrate-recompute-modules {' '.join(bad)}: choose from "
                         f"{', '.join(RECOMPUTE_MODULES)}")
    from megatron_metp.measure.frontier import mlp_recompute_refusal
    from megatron_metp.models.config import load_config

    refusal = mlp_recompute_refusal(load_config(args.calibrate_model),
                                    args.calibrate_recompute_modules,
                                    "--calibrate-recompute-modules")
    if refusal:
        raise ValueError(refusal)
    if args.calibrate_recompute_modules and args.calibrate_recompute_full:
        raise ValueError("--calibrate-recompute-full: give it or --calibrate-recompute-modules, "
                         "not both (Megatron's granularity is full or selective)")
    for flag, value, default in (("--calibrate-metp-qkv-backward",
                                  args.calibrate_metp_qkv_backward, "recompute"),
                                 ("--calibrate-metp-ring-pass", args.calibrate_metp_ring_pass,
                                  "auto")):
        if value != default and args.calibrate_mode != "metp":
            raise ValueError(f"{flag} {value}: METP's option; drop it or use "
                             f"--calibrate-mode metp")
    for s in args.seq_lengths:
        if s % (2 * args.calibrate_p):
            raise ValueError(f"--seq-lengths: {s} is not divisible by 2 x --calibrate-p "
                             f"{args.calibrate_p}")
