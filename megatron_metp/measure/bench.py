"""``metp bench``: one layer or a whole model under tp, metp, wallfacer and ring attention, measured.

Every mode runs on the real backend (gloo on CPU, NCCL on GPU) on the same ranks, one after the
other, at each sequence length. Per (mode, s), one training step (forward + backward) gives:

===================  ============================================================================
memory               per-rank peak of tracked tensor bytes (``PeakMemory``, MemTracker), the
                     parameters and the input included, and what the step added over them
communication        per op: calls and payload bytes (``CommCounter``), elements sent per rank in
                     the papers' convention; for ``--scope layer`` also the attention and the MLP
                     sublayers counted alone
time                 best of ``--iters`` steps, each timed on the slowest rank:
                     ``overlapped`` (the normal code), ``serialised`` (each communication
                     completes before computation goes on), ``compute`` (communication stubbed
                     out); ``comm`` = serialised - compute. Shares as in the METP paper's
                     Fig. 7: comp = compute / serialised, comm = comm / serialised,
                     async = overlapped / serialised
throughput           tokens/s (overlapped); model FLOPs (``megatron_metp.models.flops``) per second per
                     rank, and MFU on a GPU with a known peak; ``vs_tp``: each mode's tokens/s
                     over tp's at the same s, from the same run
busy per rank        each rank's own time in the ``compute`` variant (communication stubbed):
                     its CPU time on CPU (one torch thread per rank, so ranks sharing cores do
                     not inflate each other's), its wall time on a GPU; max / mean over ranks
                     shows how evenly a causal ring spreads the work
===================  ============================================================================

Modes: ``tp`` (Megatron TP+SP, TP = p), ``tp+full`` / ``metp+full`` (the same with Megatron's full
recompute of every layer), ``metp`` (METP weight rings and two-level attention,
TP = p), ``metp+a2a`` (METP with ``--metp-ring-pass a2a``: all-to-alls in place of its K/V ring),
``metp+ring-mlp`` (METP with ``--metp-mlp-pass ring``: the paper's MLP weight ring, which
``auto`` leaves for all-gathered weights at short lengths), ``metp+save`` / ``metp+keep`` (the
a2a pass with ``--metp-qkv-backward save+fc1`` / ``save+fc1+weights``: Q/K/V and fc1 kept, and
with ``keep`` the gathered weights too; named only), ``wallfacer`` (CP = p, team size C = ``--wallfacer-team-size``, default the largest
valid C > 1; skipped when only C = 1 is valid, i.e. it would be ``ring``), ``ring`` (WallFacer with
C = 1: plain ring attention). Shapes per rank: ``x_shard_s [s/p, b, h]`` into the layer.

Eq. 5 (METP Sec. 3.3): the weight ring overlaps its transfers when the arithmetic intensity
2 m / (p e) FLOPs per byte (m = b s tokens, e bytes per element; the paper's m/p at e = 2) exceeds
the machine's FLOP/s over its bandwidth, i.e. s > p e F / (2 W b). ``overlap`` in the JSON holds
F (a matmul microbenchmark), W (a gloo/NCCL ring step), the threshold and, for metp above it,
overlapped / max(compute, comm).
"""

from __future__ import annotations

import argparse
import contextlib
import json
import os
import platform
import time
import warnings
from typing import Callable, Dict, List

import torch
import torch.distributed as dist

from megatron_metp.launch import mode_list
from megatron_metp.measure.bench_report import markdown, plot
from megatron_metp.measure.bench_setup import (layer_step, model_flops, model_step, setup,
                                               team_size, teardown)
from megatron_metp.measure.comm_counter import CommCounter
from megatron_metp.measure.comm_modes import (matmul_flops, ring_bandwidth, serialised_comm,
                                              stubbed_comm, sync)
from megatron_metp.measure.memory import PeakMemory

__all__ = ["BENCH_MODES", "add_arguments", "main", "bench_in_rank", "eq5_threshold"]

# "+full": the same mode with Megatron's --recompute-granularity full --recompute-method uniform
# --recompute-num-layers 1 (every layer inside CheckpointFunction: only its input is kept, and
# the backward runs the forward again), e.g. stock's longest-sequence configuration "tp+full".
# "metp+a2a": METP with --metp-ring-pass a2a (all-to-alls in place of its K/V ring);
# "metp+ring-mlp": METP with --metp-mlp-pass ring (the weight ring where auto gathers the MLP's
# weights: short inputs); "metp" keeps the model's own rules (the one ring pass and, at these
# lengths, the gathered MLP). "metp+save" / "metp+keep": the a2a pass with --metp-qkv-backward
# save+fc1 / save+fc1+weights (the second also keeps the weights its forward gathered: its
# backward gathers none); not run unless named.
DEFAULT_MODES = ("tp", "metp", "wallfacer", "ring", "tp+full", "metp+full", "metp+a2a",
                 "metp+ring-mlp")
BENCH_MODES = DEFAULT_MODES + ("metp+save", "metp+keep")
VARIANTS = ("overlapped", "serialised", "compute")


def _ints(value: str) -> List[int]:
    try:
        return [int(v) for v in value.split(",") if v.strip()]
    except ValueError:
        raise argparse.ArgumentTypeError(f"{value!r}: give comma-separated integers") from None


def add_arguments(p: argparse.ArgumentParser) -> None:
    a = p.add_argument
    a("--modes", type=mode_list("--modes", BENCH_MODES), default=list(DEFAULT_MODES),
      help=f"comma-separated, of {','.join(BENCH_MODES)} (default: all but metp+save and "
           "metp+keep)")
    a("--scope", choices=("layer", "model"), default="layer",
      help="layer: one TransformerLayer (attention + MLP); model: a GPTModel with its loss")
    a("--style", choices=("gpt", "llama"), default="gpt")
    a("--seq-lengths", type=_ints, default=[256, 512, 1024, 2048], metavar="S1,S2,...")
    a("--micro-batch-size", type=int, default=1)
    a("--hidden-size", type=int, default=256)
    a("--num-attention-heads", type=int, default=8)
    a("--num-query-groups", type=int, default=None, help="llama style; default: the heads")
    a("--ffn-hidden-size", type=int, default=None, help="default 4 x hidden")
    a("--num-layers", type=int, default=2, help="--scope model only")
    a("--vocab-size", type=int, default=1024, help="--scope model only")
    a("--wallfacer-team-size", type=int, default=None,
      help="C for the wallfacer mode (C^2 divides p); default the largest valid C > 1")
    a("--bf16", action="store_true", help="bf16 parameters and compute")
    a("--iters", type=int, default=3, help="timed steps per variant (the fastest is reported)")
    a("--warmup", type=int, default=1)
    a("--no-microbench", action="store_true", help="skip the FLOP/s and bandwidth probes")
    a("--json", default=None, metavar="PATH", help="write every figure as JSON")
    a("--plot", default=None, metavar="PATH", help="PNG of memory and time against s "
      "(needs matplotlib: pip install 'megatron-metp[plot]')")
    a("--nproc-per-node", type=int, default=None,
      help="ranks to launch when not under torchrun/srun (default: 4 on CPU, #GPUs)")
    c = p.add_argument_group("calibration (one device, no launcher)")
    c.add_argument("--calibrate", action="store_true",
                   help="run one rank's share of one layer of --calibrate-model on this device "
                        "with its communication stubbed, at each --seq-lengths, and compare "
                        "with the per-rank ESTIMATE of metp plan --timeline "
                        "(megatron_metp/measure/calibrate.py)")
    c.add_argument("--calibrate-model", default="llama-7b", help="configs/<name>.yaml")
    c.add_argument("--calibrate-mode", choices=("tp", "metp", "wallfacer"), default="metp")
    c.add_argument("--calibrate-p", type=int, default=8, help="ranks the layer is split over")
    c.add_argument("--calibrate-rank", type=int, default=None, help="default p - 1")
    c.add_argument("--calibrate-gpu", choices=("H100", "A100"), default="H100",
                   help="the data sheet the estimate uses on a GPU")
    c.add_argument("--calibrate-host-op-us", type=float, default=None,
                   help="host time per op in the GPU estimate, microseconds (default: the "
                        "timeline's, 30)")
    c.add_argument("--calibrate-recompute-modules", nargs="+", default=None, metavar="MODULE",
                   help="Megatron's selective recompute in the calibrated layer (layernorm, mlp, "
                        "core_attn), as --recompute-modules")
    c.add_argument("--calibrate-recompute-full", action="store_true",
                   help="the layer inside Megatron's CheckpointFunction, as "
                        "--recompute-granularity full --recompute-method uniform "
                        "--recompute-num-layers 1")
    c.add_argument("--calibrate-metp-ring-pass", choices=("auto", "whole", "head-group", "a2a"),
                   default="auto", help="METP's --metp-ring-pass in the calibrated layer")
    c.add_argument("--calibrate-metp-qkv-backward", choices=("recompute", "save", "save+fc1",
                                                                 "save+fc1+weights"),
                   default="recompute", help="METP's --metp-qkv-backward in the calibrated layer")
    c.add_argument("--calibrate-profile", action="store_true",
                   help="profile one more step (torch.profiler): its kernels by name and class "
                        "(GEMM, attention, other), and the aten ops that launched them by input "
                        "shapes, go into the JSON")


def preflight(args: argparse.Namespace, world: int) -> None:
    """Configuration errors before any rank starts (flag names as Megatron-LM spells them)."""
    from megatron_metp.validation import check_output_file, check_values

    if args.iters < 1 or args.warmup < 0:
        raise ValueError("--iters must be >= 1 and --warmup >= 0")
    check_values(args)  # micro batch, hidden size, heads, layers, vocabulary: each >= 1
    for flag, path in (("--json", args.json), ("--plot", args.plot)):
        if path:
            check_output_file(flag, path)
    if args.plot:
        import importlib.util

        if importlib.util.find_spec("matplotlib") is None:
            raise ValueError(f"--plot {args.plot}: needs matplotlib, which is not installed: "
                             f"pip install 'megatron-metp[plot]' (or drop --plot)")
    for flag, v in (("--ffn-hidden-size", args.ffn_hidden_size),
                    ("--num-query-groups", args.num_query_groups)):
        if v is not None and v < 1:
            raise ValueError(f"{flag} {v}: must be >= 1")
    if world < 2:
        raise ValueError("metp bench compares parallel modes: --nproc-per-node must be >= 2")
    for s in args.seq_lengths:
        # wallfacer/ring shard the sequence in 2p zigzag chunks.
        if s < 1 or s % (2 * world):
            raise ValueError(f"--seq-lengths: {s} is not divisible by 2 x {world} ranks "
                             "(the zigzag layout of wallfacer/ring needs 2p chunks)")
    if args.num_attention_heads % world:
        raise ValueError(f"--num-attention-heads {args.num_attention_heads} must be divisible "
                         f"by the {world} ranks (--tensor-model-parallel-size = p for tp/metp)")
    c = args.wallfacer_team_size
    if c is not None and (c < 1 or world % (c * c)):
        raise ValueError(f"--wallfacer-team-size {c}: C^2 must divide the {world} ranks")


def eq5_threshold(p: int, flops: float, bandwidth: float, bytes_per_element: int,
                  micro_batch: int = 1) -> float:
    """Sequence length above which METP's weight ring hides its transfers (Eq. 5 generalised).

    Per ring step a rank computes 2 (m/p) k1 k2/p + 2 (m/p) k2 n/p FLOPs and sends
    e (k1 k2 + k2 n)/p bytes: intensity 2m/(p e). Overlap needs it above F/W:
    m = b s > p e F / (2 W).
    """
    return p * bytes_per_element * flops / (2 * bandwidth * micro_batch)


# ------------------------------------------------------------------------------------------
# measuring one (mode, s)


def _comm_stats(cc: CommCounter) -> Dict:
    return {
        "ops": {op: {"calls": st.calls, "payload_elements": st.elements,
                     "payload_bytes": st.bytes}
                for op, st in cc.stats.items() if st.calls},
        "sent_elements": cc.sent_elements(),
        "sent_bytes": cc.sent_bytes(),
        "calls": cc.calls(),
    }


def _timed(step: Callable, device, group=None):
    """``(slowest rank's wall time, this rank's busy time)`` of one step (busy: module
    docstring)."""
    dist.barrier(group)
    sync(device)
    t0, c0 = time.perf_counter(), time.process_time()
    step()
    sync(device)
    wall = time.perf_counter() - t0
    busy = wall if device.type == "cuda" else time.process_time() - c0
    t = torch.tensor([wall], dtype=torch.float64, device=device)
    dist.all_reduce(t, op=dist.ReduceOp.MAX, group=group)  # a step ends on the slowest rank
    return float(t), busy


def _measure(step, external, sublayers, args, device) -> Dict:
    # One step counted and tracked (the dispatch modes slow it, so it is not timed).
    with PeakMemory(*external) as pm, CommCounter() as cc:
        step()
    out = {"memory": {"peak_bytes": pm.peak_bytes, "peak_increase": pm.peak_increase,
                      "baseline_bytes": pm.baseline_bytes, "by_category": pm.peak_by_category},
           "comm": {"step": _comm_stats(cc)}}
    for name, sub in sublayers.items():
        with CommCounter() as sc:
            sub()
        out["comm"][name] = _comm_stats(sc)
    # Variants interleaved per iteration, so that a change in the machine's load (it is shared)
    # hits all three alike.
    contexts = {"overlapped": contextlib.nullcontext, "serialised": serialised_comm,
                "compute": stubbed_comm}
    times: Dict[str, List[float]] = {v: [] for v in VARIANTS}
    busy: List[float] = []
    for i in range(args.warmup + args.iters):
        for v in VARIANTS:
            with contexts[v]():
                t, mine = _timed(step, device)
            if i >= args.warmup:
                times[v].append(t)
                if v == "compute":
                    busy.append(mine)
    # Best of the timed steps: on a shared machine other jobs only ever add time, so the
    # minimum is the least disturbed estimate (timeit's rule); every sample is kept in the JSON.
    best = {v: min(ts) for v, ts in times.items()}
    # Clamped at 0: under load a stubbed step can come out slower than a serialised one.
    best["comm"] = max(best["serialised"] - best["compute"], 0.0)
    out["time_s"] = best
    out["time_samples_s"] = times
    ser = best["serialised"]
    out["shares"] = {"comp": best["compute"] / ser, "comm": best["comm"] / ser,
                     "async": best["overlapped"] / ser}
    out["overlap_vs_max"] = best["overlapped"] / max(best["compute"], best["comm"])
    every: List = [None] * dist.get_world_size()
    dist.all_gather_object(every, min(busy))
    out["busy_s_per_rank"] = every
    out["busy_max_over_mean"] = max(every) / (sum(every) / len(every))
    return out


def bench_in_rank(args: argparse.Namespace) -> Dict:
    """Every mode at every sequence length; returns the result dict (see the module docstring).

    Times, per-rank lists and the Eq. 5 figures are the same on every rank; per-op counts and
    memory by category are this rank's.

    Needs ``torch.distributed`` initialised and ``cpu_compat.apply()`` called (``main`` does
    both; the tests' harness too).
    """
    from megatron_metp.models.flops import gpu_peak_tflops, throughput

    p = dist.get_world_size()
    preflight(args, p)
    device = torch.device("cuda", torch.cuda.current_device()) if dist.get_backend() == "nccl" \
        else torch.device("cpu")
    dtype = torch.bfloat16 if args.bf16 else torch.float32
    e = torch.finfo(dtype).bits // 8
    result: Dict = {"world_size": p, "backend": dist.get_backend(), "device": str(device),
                    "host": platform.node(), "cpu_count": os.cpu_count(),
                    "torch_threads": torch.get_num_threads(),
                    "settings": {k: v for k, v in vars(args).items()
                                 if k not in ("json", "plot", "nproc_per_node", "func")},
                    "points": [], "skipped": []}
    if not args.no_microbench:
        f = torch.tensor([matmul_flops(dtype=dtype, device=device)], dtype=torch.float64,
                         device=device)
        dist.all_reduce(f, op=dist.ReduceOp.MIN)  # the slowest rank bounds a ring step
        bw = ring_bandwidth(device=device)
        thr = eq5_threshold(p, float(f), bw["bandwidth"], e, args.micro_batch_size)
        result["overlap"] = {"flops_per_s": float(f), "ring": bw, "bytes_per_element": e,
                             "intensity_needed_flops_per_byte": float(f) / bw["bandwidth"],
                             "eq5_threshold_seq_length": thr, "ranks": p}
    peak = gpu_peak_tflops() if device.type == "cuda" else None
    for mode in args.modes:
        if mode.startswith("wallfacer") and team_size(args, p) is None:
            result["skipped"].append(f"wallfacer: p={p} allows only C=1, which is the ring mode")
            continue
        spec_mode, config, label = setup(mode, args, p)
        try:
            for s in args.seq_lengths:
                if args.scope == "layer":
                    step, ext, subs = layer_step(config, spec_mode, s, args.micro_batch_size,
                                                  device)
                    vocab = 0
                else:
                    step, ext, subs, vocab = model_step(config, spec_mode, s,
                                                         args.micro_batch_size, args.vocab_size,
                                                         device, args.style)
                pt = {"mode": mode, "label": label, "seq_length": s}
                pt.update(_measure(step, ext, subs, args, device))
                # Per-rank memory and traffic (ranks differ: e.g. WallFacer's self-sends).
                mine = (pt["memory"]["peak_bytes"], pt["memory"]["peak_increase"],
                        pt["comm"]["step"]["sent_bytes"])
                every: List = [None] * p
                dist.all_gather_object(every, mine)
                pt["memory"]["peak_bytes_per_rank"] = [m[0] for m in every]
                pt["memory"]["peak_increase_per_rank"] = [m[1] for m in every]
                pt["comm"]["step"]["sent_bytes_per_rank"] = [m[2] for m in every]
                t = pt["time_s"]["overlapped"]
                flops = model_flops(config, args, s, vocab)
                tflops, mfu = throughput(flops, t, p, peak)
                pt["throughput"] = {"tokens_per_s": args.micro_batch_size * s / t,
                                    "model_flops": flops, "tflops_per_rank": tflops, "mfu": mfu}
                if "overlap" in result:
                    ov = result["overlap"]
                    pt["above_eq5_threshold"] = s > ov["eq5_threshold_seq_length"]
                    # Cross-check of the measured comm time (an estimate, alpha-beta): the
                    # busiest rank's bytes over the ring bandwidth, one latency per launch.
                    launches = sum(o["calls"] for op, o in pt["comm"]["step"]["ops"].items()
                                   if op != "recv")
                    pt["comm_alpha_beta_estimate_s"] = (
                        max(pt["comm"]["step"]["sent_bytes_per_rank"]) / ov["ring"]["bandwidth"]
                        + launches * ov["ring"]["latency"])
                result["points"].append(pt)
                del step, ext, subs
        finally:
            teardown()
    tp = {pt["seq_length"]: pt["throughput"]["tokens_per_s"] for pt in result["points"]
          if pt["mode"] == "tp"}
    result["vs_tp"] = [{"mode": pt["mode"], "seq_length": pt["seq_length"],
                        "tokens_per_s_over_tp": pt["throughput"]["tokens_per_s"]
                        / tp[pt["seq_length"]],
                        "busy_max_over_mean": pt["busy_max_over_mean"]}
                       for pt in result["points"] if pt["seq_length"] in tp]
    return result


def _rank_entry(args: argparse.Namespace) -> int:
    from megatron_metp import cpu_compat

    own = not dist.is_initialized()
    if own:
        if torch.cuda.is_available():
            torch.cuda.set_device(int(os.environ.get("LOCAL_RANK", 0)))
        dist.init_process_group("nccl" if torch.cuda.is_available() else "gloo")
    try:
        for cat in (UserWarning, FutureWarning, DeprecationWarning):
            warnings.filterwarnings("ignore", category=cat)
        cpu_compat.apply()
        result = bench_in_rank(args)
        if dist.get_rank() == 0:
            print(markdown(result), flush=True)
            if args.json:
                with open(args.json, "w") as fh:
                    json.dump(result, fh, indent=1)
                print(f"[metp bench] wrote {args.json}")
            if args.plot:
                print(plot(result, args.plot))
        return 0
    finally:
        if own:
            dist.destroy_process_group()


def main(args: argparse.Namespace, argv: List[str]) -> int:
    """``metp bench``: run in place under torchrun/srun, else launch the ranks
    (``megatron_metp.launch``)."""
    from megatron_metp.launch import launch_or_run

    if args.calibrate:
        from megatron_metp.measure import calibrate

        calibrate.check(args)
        return calibrate.run(args)
    return launch_or_run(argv, args.nproc_per_node, lambda: _rank_entry(args),
                         lambda world: preflight(args, world))

