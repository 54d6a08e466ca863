"""``metp plan`` runner: the tables (Markdown on stdout) and the JSON of the planner's points.

Tables
  1. per-rank memory (GiB of tensor bytes: model state + activation peak) per sequence length,
     the METP/TP ratio in brackets, ``*`` where the point does not fit the budget;
  2. longest sequence that fits the budget (bisection), METP vs TP, per p;
  3. communication per step per rank and ESTIMATED step times on H100 / A100 at one sequence.
"""

from __future__ import annotations

import json
import os
import sys
import time
from typing import List, Optional

from megatron_metp.measure import timeline_report
from megatron_metp.measure.planner import (
    CP_A2A_STAND_IN,
    CP_STAND_IN,
    GIB,
    Planner,
    PlanSettings,
    memory_table,
    point_dict,
    recompute_flags,
    seq_label,
)
from megatron_metp.measure.timeline import ATTENTION_EFFICIENCY, GEMM_EFFICIENCY

DEFAULT_MODELS = ("bert-large", "llama-7b", "llama-70b", "gpt-175b")
DEFAULT_SEQS = tuple(2**k * 1024 for k in range(2, 10))  # 4k .. 512k
PLAN_MODES = ("tp", "metp")
ALL_MODES = ("tp", "metp", "wallfacer")  # wallfacer: team size C = 1 (ring attention), CP = p


def _ints(value: str) -> List[int]:
    out = []
    for tok in value.split(","):
        tok = tok.strip().lower()
        if tok:
            out.append(int(tok[:-1]) * 1024 if tok.endswith("k") else int(tok))
    return out


def _add_cluster_arguments(a) -> None:
    """``--frontier --gpus-total``'s flags (``measure.cluster``)."""
    a("--gpus-total", default=None, metavar="N[,N...]",
      help="--frontier on jobs of N GPUs (e.g. 8,32,64; nodes of --gpus-per-node): each "
           "family's fastest TP x CP x DP split and micro-batch under --global-batch-tokens, "
           "written to --frontier-dir as cluster.json, cluster.md and cluster-<model>.svg "
           "(measure/cluster.py); --p is then not used")
    a("--global-batch-tokens", type=int, default=None, metavar="T",
      help="--gpus-total: tokens per optimizer step (default 4,194,304 = 4M); each "
           "configuration runs T / s sequences as micro-batches of its own choice")
    a("--each-team-size", action="store_true",
      help="--gpus-total: a row for WallFacer's fastest at every valid team size C (C = 1 is "
           "ring attention), not only for its fastest")
    a("--wallfacer-optimizers", default=None, metavar="LIST",
      help="--gpus-total: WallFacer's optimizers to plan, comma-separated: distributed "
           "(Megatron's distributed optimizer), optim_grads (Megatron-FSDP's ZeRO-2, the "
           "WallFacer paper's sharding), optim_grads_params (its ZeRO-3); default "
           "distributed,optim_grads_params")
    a("--longest", action="store_true",
      help="--frontier with --seq-lengths: also search each family's longest sequence (a "
           "bisection; without --seq-lengths it is always searched, to end the grid)")


def add_arguments(parser) -> None:
    a = parser.add_argument
    # None: not named (fill_defaults), so that --timeline and --frontier can tell a value left
    # out from one named that equals plan's default.
    a("--models", default=None,
      help="comma-separated configs (configs/<name>.yaml); default: METP Table 3's four")
    a("--modes", default=None,
      help="comma-separated: tp, metp, wallfacer (C = 1: ring attention, CP = p, TP = 1, "
           "distributed optimizer over CP)")
    a("--tensor-model-parallel-size", "--p", dest="p", default=None,
      help="parallel degrees p (default 2,4,8)")
    a("--seq-lengths", default=None,
      help="sequence lengths, e.g. 4k,32k,512k (default 4k..512k)")
    a("--longest-p", default="8", help="p values for the longest-sequence bisection ('' = skip)")
    a("--memory-gb", type=float, default=80.0, help="memory per GPU, GiB (default 80)")
    a("--reserve-gb", type=float, default=4.0,
      help="reserve for CUDA context, NCCL buffers, workspaces, GiB (default 4)")
    a("--communicator-gb", type=float, default=0.0,
      help="GiB per NCCL communicator a layout uses beyond the three the reserve covers (TP, "
           "DP, world): METP's weight group and K/V ring, stock's CP group, WallFacer's team "
           "group; about 1.0 on H100 with NVLS, 0.7 on A100 (default 0: not counted)")
    a("--fragmentation", type=float, default=0.05,
      help="allocator fragmentation on top of tensor bytes (default 0.05)")
    a("--use-distributed-optimizer", action="store_true",
      help="shard fp32 master weights and Adam states over the data-parallel group")
    a("--grad-reduce-in-bf16", action="store_true",
      help="Megatron-LM's --grad-reduce-in-bf16: DDP's main_grad and the gradient reductions "
           "in bf16 (2 B per parameter instead of 4), METP's weight-gradient reductions with "
           "them; every family (--frontier: a flag of every row)")
    a("--use-megatron-fsdp", action="store_true",
      help="plan Megatron-FSDP (optim_grads_params: parameters, gradients and optimizer "
           "state sharded over the data-parallel x context-parallel group, each layer "
           "all-gathered when it runs; its optimizer is the distributed one, so "
           "--use-distributed-optimizer may be passed with it, as Megatron-LM's guide does); "
           "changes wallfacer, whose CP = p ranks share weights")
    a("--wallfacer-team-size", type=int, default=1, metavar="C",
      help="plan WallFacer with teams of C (C^2 divides p; default 1): C - 1 more "
           "query/key/value shards at the attention peak")
    a("--efficiency", type=float, default=GEMM_EFFICIENCY,
      help="fraction of bf16 peak FLOP/s for GEMMs in the time ESTIMATES (default "
           f"{GEMM_EFFICIENCY}, fitted to the H100 calibrations: docs/calibration/README.md)")
    a("--attention-efficiency", type=float, default=ATTENTION_EFFICIENCY,
      help="fraction of bf16 peak FLOP/s for fused attention kernels in the time ESTIMATES "
           f"(default {ATTENTION_EFFICIENCY}: cuDNN's Hopper kernel, measured in the same "
           "calibrations)")
    a("--time-seq-length", default="128k", help="sequence of the comm/time table")
    a("--count-send-buffers", action="store_true",
      help="add the largest P2P send per layer, as if a live request held it (upper bound)")
    a("--recompute-modules", default=None, metavar="M1,M2",
      help="Megatron's selective recompute in every mode (--recompute-granularity selective), "
           "e.g. layernorm: norm outputs are recomputed in backward")
    a("--metp-ring-pass", choices=("auto", "whole", "head-group", "a2a"), default="auto",
      help="METP attention: every head group in one K/V ring pass (whole: fewer, larger "
           "operations, all heads' Q/K/V at once), one pass per head group (head-group: the "
           "paper's Alg. 5-6, least memory), the whole pass with all-to-alls in place of its "
           "ring (a2a), or auto (the first of a2a, whole, head-group that fits --memory-gb)")
    a("--metp-qkv-backward",
      choices=("auto", "recompute", "save", "save+fc1", "save+fc1+weights"), default="auto",
      help="METP's one ring pass: keep Q/K/V for backward (save: one GEMM less per layer, "
           "2(n+2ng)d bytes more per token and layer) or recompute them (the paper's Alg. 6); "
           "save+fc1: keep the MLP's fc1 output too (2F' bytes more per token and layer); "
           "save+fc1+weights: keep the weights the forward gathered too (the backward gathers "
           "none; 2 bytes per layer parameter held from forward to backward); auto: the first "
           "of save+fc1, save, recompute with which the point fits --memory-gb (never "
           "save+fc1+weights; --frontier plans it)")
    a("--cpu-offloading-num-layers", type=int, default=0, metavar="N",
      help="plan Megatron-LM's --cpu-offloading --cpu-offloading-num-layers N "
           "(TransformerEngine, GPU only): N layers' saved activations in host memory, "
           "printed per GPU; at most the layers per device - 1")
    a("--host-memory-gb", type=float, default=None, metavar="GIB",
      help="with --cpu-offloading-num-layers: pinned host memory per GPU the offloaded "
           "activations may use (a DGX H100: 2 TiB per node = 256 per GPU); default no limit")
    a("--recompute-granularity", choices=("selective", "full"), default=None,
      help="Megatron's recompute in every mode: selective (--recompute-modules, default "
           "core_attn) or full (--recompute-method, --recompute-num-layers): the layer runs "
           "inside Megatron's CheckpointFunction")
    a("--recompute-method", choices=("uniform", "block"), default=None,
      help="full recompute: uniform (chunks of --recompute-num-layers, default) or block (the "
           "first --recompute-num-layers layers of the stage)")
    a("--recompute-num-layers", type=int, default=None, metavar="N",
      help="full recompute: layers per chunk (uniform) or checkpointed layers (block); "
           "default 1")
    a("--context-parallel-size", type=int, default=1, metavar="CP",
      help="stock tp as TP x CP = p (TP = p / CP, --cp-comm-type, the distributed "
           "optimizer over CP); Transformer Engine's CP attention is stood in for by the "
           "plugin's ring attention or all-to-all (megatron_metp/measure/planner.py, "
           "CP_STAND_IN, CP_A2A_STAND_IN)")
    a("--cp-comm-type", choices=("p2p", "a2a"), default="p2p",
      help="with --context-parallel-size > 1: Megatron's CP communication, p2p (the K/V ring, "
           "default) or a2a (all-to-all, heads for sequence; the heads per TP rank must split "
           "over CP)")
    a("--frontier", action="store_true",
      help="the throughput-vs-length frontier: for each model, p and GPU and each s from 4k "
           "to the longest any configuration fits (or each of --seq-lengths when named), the fastest configuration that fits per "
           "family (stock: TP x CP, --tp-comm-overlap, selective and full recompute; metp; "
           "wallfacer), its Megatron-LM flags, ESTIMATED step time, tokens/s, MFU and memory "
           "(defaults: the four paper models, --p 8, --gpus H100,A100)")
    a("--frontier-dir", default="frontier", metavar="DIR",
      help="where --frontier writes frontier.json, frontier.md and frontier.svg")
    a("--jobs", type=int, default=1, metavar="N",
      help="--frontier: plan N models (each p apart) at a time, each in a process of its "
           "own; the same output as one process (default 1; the four paper models "
           "take ~33 min with --jobs 2 on 2 cores)")
    _add_cluster_arguments(a)
    a("--json", default=None, metavar="PATH", help="write every planned point as JSON")
    timeline_report.add_arguments(parser)


RECOMPUTE_MODULES = ("layernorm", "mlp", "core_attn")


def _modules(value: Optional[str]) -> Optional[List[str]]:
    return [m.strip() for m in value.split(",") if m.strip()] if value else None


# The flags that take lists of whole numbers (a "k" suffix: x 1024 tokens).
INT_LIST_FLAGS = (("p", "--tensor-model-parallel-size"), ("longest_p", "--longest-p"),
                  ("seq_lengths", "--seq-lengths"), ("time_seq_length", "--time-seq-length"),
                  ("gpus_total", "--gpus-total"))


def _check_int_lists(args) -> None:
    """One line naming the flag for a malformed list (``--seq-lengths 256q``)."""
    for attr, flag in INT_LIST_FLAGS:
        value = getattr(args, attr, None)
        if value is None:
            continue
        try:
            _ints(value)
        except ValueError:
            raise ValueError(f"{flag} {value!r}: give comma-separated whole numbers, each "
                             f"optionally ending in k (x 1024 tokens), e.g. 4k,32k,1024k") \
                from None


def _check_cluster(args) -> None:
    """The flags of the cluster frontier (``--gpus-total``): values, and what they need."""
    for n in _ints(args.gpus_total or ""):
        if n < 1:
            raise ValueError(f"--gpus-total {n}: must be >= 1 (GPUs in the job)")
    if args.global_batch_tokens is not None and args.global_batch_tokens < 1:
        raise ValueError(f"--global-batch-tokens {args.global_batch_tokens}: must be >= 1 "
                         "(tokens per optimizer step, e.g. 4194304)")
    for flag, given in (("--gpus-total", args.gpus_total is not None),
                        ("--global-batch-tokens", args.global_batch_tokens is not None),
                        ("--longest", args.longest),
                        ("--each-team-size", args.each_team_size),
                        ("--wallfacer-optimizers", args.wallfacer_optimizers is not None)):
        if given and not args.frontier:
            raise ValueError(f"{flag}: only --frontier uses it; add --frontier or drop {flag}")
    if args.wallfacer_optimizers is not None:
        from megatron_metp.measure.frontier import WALLFACER_OPTIMIZERS

        names = [n.strip() for n in args.wallfacer_optimizers.split(",") if n.strip()]
        if not names or any(n not in WALLFACER_OPTIMIZERS for n in names):
            raise ValueError(f"--wallfacer-optimizers {args.wallfacer_optimizers!r}: choose "
                             f"from {', '.join(WALLFACER_OPTIMIZERS)}, comma-separated")
    for flag, given in (("--global-batch-tokens", args.global_batch_tokens is not None),
                        ("--each-team-size", args.each_team_size),
                        ("--wallfacer-optimizers", args.wallfacer_optimizers is not None)):
        if given and args.gpus_total is None:
            raise ValueError(f"{flag}: it plans jobs of N GPUs; add --gpus-total N or drop "
                             f"{flag}")


def _check(args) -> None:
    from megatron_metp.models.config import load_config
    from megatron_metp.validation import check_output_file

    _check_int_lists(args)

    modes = [m.strip() for m in args.modes.split(",") if m.strip()]
    bad = [m for m in modes if m not in ALL_MODES]
    if bad or not modes:
        raise ValueError(f"--modes {args.modes!r}: metp plan supports {', '.join(ALL_MODES)} "
                         "(wallfacer: team size --wallfacer-team-size, default 1)")
    for p in _ints(args.p) + _ints(args.longest_p):
        if p < 1:
            raise ValueError(f"--tensor-model-parallel-size {p}: must be >= 1")
    for s in _ints(args.seq_lengths) + _ints(args.time_seq_length):
        if s < 1024 or s % 1024:
            raise ValueError(f"--seq-lengths {s}: use positive multiples of 1024 (e.g. 4k, 32k)")
    for name in args.models.split(","):
        load_config(name.strip())
    if args.reserve_gb < 0 or args.memory_gb <= args.reserve_gb:
        raise ValueError(f"--memory-gb {args.memory_gb} / --reserve-gb {args.reserve_gb}: the "
                         f"reserve must be >= 0 and below the memory per GPU")
    if args.communicator_gb < 0:
        raise ValueError(f"--communicator-gb {args.communicator_gb}: must be >= 0 (GiB per "
                         f"communicator, e.g. 1)")
    if not 0 <= args.fragmentation < 1:
        raise ValueError(f"--fragmentation {args.fragmentation}: must be in [0, 1) (a fraction "
                         f"of the tensor bytes, e.g. 0.05)")
    if not 0 < args.attention_efficiency <= 1:
        raise ValueError(f"--attention-efficiency {args.attention_efficiency}: must be in (0, 1] "
                         "(a fraction of the bf16 peak)")
    if not 0 < args.efficiency <= 1:
        raise ValueError(f"--efficiency {args.efficiency}: must be in (0, 1] (a fraction of the "
                         f"peak FLOP/s, e.g. 0.5)")
    if args.json:
        check_output_file("--json", args.json)
    C = args.wallfacer_team_size
    if C > 1 and "wallfacer" in modes:
        for p in _ints(args.p) + _ints(args.longest_p):
            if p % (C * C):
                raise ValueError(f"--wallfacer-team-size {C}: C^2 = {C * C} must divide every "
                                 f"--tensor-model-parallel-size, not {p} (drop it or pick C)")
    elif C < 1:
        raise ValueError(f"--wallfacer-team-size {C}: must be >= 1")
    if args.cpu_offloading_num_layers < 0:
        raise ValueError(f"--cpu-offloading-num-layers {args.cpu_offloading_num_layers}: must be "
                         f">= 0 (0 = no offloading)")
    if args.host_memory_gb is not None and args.host_memory_gb <= 0:
        raise ValueError(f"--host-memory-gb {args.host_memory_gb}: must be > 0 (GiB per GPU)")
    if args.recompute_modules and args.recompute_granularity == "full":
        raise ValueError("--recompute-modules is for --recompute-granularity selective; drop "
                         "one of them")
    if (args.recompute_method or args.recompute_num_layers is not None) and \
            args.recompute_granularity != "full":
        raise ValueError("--recompute-method / --recompute-num-layers need "
                         "--recompute-granularity full")
    if args.recompute_num_layers is not None and args.recompute_num_layers < 1:
        raise ValueError(f"--recompute-num-layers {args.recompute_num_layers}: must be >= 1")
    cp = args.context_parallel_size
    if cp < 1:
        raise ValueError(f"--context-parallel-size {cp}: must be >= 1")
    if cp > 1:
        for p in _ints(args.p) + _ints(args.longest_p):
            if p % cp:
                raise ValueError(f"--context-parallel-size {cp} must divide every "
                                 f"--tensor-model-parallel-size, not {p}")
    if cp > 1 and args.cp_comm_type == "a2a":
        from megatron_metp.measure.planner import a2a_heads_split

        for name in args.models.split(","):
            cfg = load_config(name.strip())
            for p in _ints(args.p) + _ints(args.longest_p):
                if not a2a_heads_split(cfg, p // cp, cp):
                    raise ValueError(
                        f"--cp-comm-type a2a: {cfg.name}'s {cfg.num_attention_heads} heads and "
                        f"{cfg.num_query_groups} query groups over TP {p // cp} do not split "
                        f"over --context-parallel-size {cp}; use --cp-comm-type p2p")
    if args.frontier and args.timeline:
        raise ValueError("--frontier and --timeline are two reports: run one at a time")
    if args.jobs < 1:
        raise ValueError(f"--jobs {args.jobs}: give 1 or more processes")
    _check_cluster(args)
    if args.jobs > 1 and not args.frontier:
        raise ValueError(f"--jobs {args.jobs}: only --frontier plans in several processes; "
                         "drop --jobs or add --frontier")
    if os.path.exists(args.frontier_dir) and not os.path.isdir(args.frontier_dir):
        raise ValueError(f"--frontier-dir {args.frontier_dir}: exists and is not a directory")
    bad = [m for m in _modules(args.recompute_modules) or [] if m not in RECOMPUTE_MODULES]
    if bad:
        raise ValueError(f"--recompute-modules {args.recompute_modules}: {bad[0]!r} is not one "
                         f"of Megatron's dense-layer modules {', '.join(RECOMPUTE_MODULES)}")
    if "mlp" in (_modules(args.recompute_modules) or []) and not args.frontier:
        from megatron_metp.measure.frontier import mlp_recompute_refusal

        for name in args.models.split(","):
            refusal = mlp_recompute_refusal(load_config(name.strip()),
                                            _modules(args.recompute_modules))
            if refusal:
                raise ValueError(refusal)


def fill_defaults(args) -> None:
    """Note which of --models, --modes, --p and --seq-lengths the command named
    (``args.named``) and give the others plan's defaults. --timeline and --frontier have
    defaults of their own for the ones left out, never for one named (even as plan's
    default: ``--models bert-large,llama-7b,llama-70b,gpt-175b --timeline`` traces all
    four)."""
    defaults = dict(models=",".join(DEFAULT_MODELS), modes=",".join(PLAN_MODES), p="2,4,8",
                    seq_lengths=",".join(seq_label(s) for s in DEFAULT_SEQS))
    if getattr(args, "named", None) is None:
        args.named = {k for k in defaults if getattr(args, k, None) is not None}
    for k, v in defaults.items():
        if getattr(args, k, None) is None:
            setattr(args, k, v)


def named(args, flag: str) -> bool:
    """Whether the command named ``flag`` (an ``args`` attribute; :func:`fill_defaults`)."""
    return flag in args.named


def _plan_settings(args) -> PlanSettings:
    """The planner's settings for a plain ``metp plan`` (memory tables, longest sequences)."""
    return PlanSettings(memory_gib=args.memory_gb, reserve_gib=args.reserve_gb,
                        communicator_gib=args.communicator_gb,
                        fragmentation=args.fragmentation,
                        distributed_optimizer=args.use_distributed_optimizer,
                        efficiency=args.efficiency,
                        attention_efficiency=args.attention_efficiency,
                        count_send_buffers=args.count_send_buffers,
                        **_recompute(args),
                        context_parallel=args.context_parallel_size,
                        cp_comm_type=args.cp_comm_type,
                        offload_layers=args.cpu_offloading_num_layers,
                        host_memory_gib=args.host_memory_gb,
                        megatron_fsdp=args.use_megatron_fsdp,
                        grad_reduce_in_bf16=args.grad_reduce_in_bf16,
                        wallfacer_team=args.wallfacer_team_size,
                        metp_ring_pass=args.metp_ring_pass,
                        metp_qkv_backward=args.metp_qkv_backward)


def _memory_head(settings: PlanSettings) -> List[str]:
    """The lines above the memory table: the settings every mode runs with, and its title."""
    head: List[str] = []
    if settings.recompute_granularity:
        head.append(f"Recompute in every mode: {' '.join(recompute_flags(settings))}\n")
    if settings.context_parallel > 1:
        head.append(f"Stock tp as TP x CP: --context-parallel-size "
                    f"{settings.context_parallel} --cp-comm-type {settings.cp_comm_type} "
                    f"({CP_A2A_STAND_IN if settings.cp_comm_type == 'a2a' else CP_STAND_IN})\n")
    if settings.offload_layers:
        head.append(f"Activation offloading in every mode: --cpu-offloading "
                    f"--cpu-offloading-num-layers {settings.offload_layers} (at most the layers "
                    f"per device - 1; host RAM per GPU in the breakdown below)\n")
    head.append(f"## Per-rank memory of a training step, GiB (state + activation peak; one row "
                f"per model, p and mode; * = exceeds {settings.memory_gib:g} GiB with "
                f"{settings.reserve_gib:g} GiB reserve and {settings.fragmentation:.0%} "
                f"fragmentation)\n")
    return head


def run(args) -> int:
    import warnings

    from megatron_metp.models.config import load_config

    fill_defaults(args)
    _check(args)
    if args.frontier:
        return run_frontier(args)
    if args.timeline:
        return timeline_report.run(args, _ints)
    if args.validate:
        raise ValueError("--validate compares the --timeline simulator with metp bench: add "
                         "--timeline")
    warnings.filterwarnings("ignore")
    settings = _plan_settings(args)
    planner = Planner(settings)
    modes = [m.strip() for m in args.modes.split(",") if m.strip()]
    cfgs = [load_config(n.strip()) for n in args.models.split(",") if n.strip()]
    ps, seqs = _ints(args.p), _ints(args.seq_lengths)
    t0 = time.time()
    grid = [(cfg, p, mode, s) for cfg in cfgs for p in ps for mode in modes for s in seqs]
    say = _progress(t0)
    points = []
    for i, (cfg, p, mode, s) in enumerate(grid):
        say(f"memory {i + 1}/{len(grid)}: {cfg.name} p={p} {mode} s={seq_label(s)}",
            done=i, total=len(grid))
        points.append(planner.plan(cfg, mode, p, s))
    head = _memory_head(settings)
    head.append(memory_table(points))
    _emit(head)           # each table as soon as it is complete
    longest = []
    lp = _ints(args.longest_p)
    if lp:
        _emit([f"\n## Longest sequence within {settings.memory_gib:g} GiB per GPU\n",
               "| model | p | " + " | ".join(modes) + " | metp / tp |",
               "|---|---|" + "---:|" * (len(modes) + 1)])
        searches, n = len(cfgs) * len(lp) * len(modes), 0
        for cfg in cfgs:
            for p in lp:
                best = {}
                for m in modes:
                    probes = []

                    def tick(s, pt, cfg=cfg, p=p, m=m, probes=probes):
                        probes.append(s)
                        say(f"longest {n + 1}/{searches}: {cfg.name} p={p} {m}, probe "
                            f"{len(probes)} at s={seq_label(s)} "
                            f"({'fits' if pt is not None and pt.fits else 'does not fit'})",
                            done=n, total=searches)

                    best[m] = planner.longest_sequence(cfg, m, p, progress=tick)
                    n += 1
                longest += [point_dict(v) for v in best.values() if v is not None]
                cells = [seq_label(best[m].seq_length) if best[m] else "none" for m in modes]
                ratio = ""
                if best.get("tp") and best.get("metp"):
                    ratio = f"{best['metp'].seq_length / best['tp'].seq_length:.2f}x"
                _emit([f"| {cfg.name} | {p} | " + " | ".join(cells) + f" | {ratio} |"])
    out: List[str] = []
    if longest:
        out.append("\n### Where the memory goes at the longest sequence (GiB per rank; R in "
                   "bsh/p, one bf16 [s/p, b, h] tensor)\n")
        out.append("| model | mode | s | state | layers' saved L R | R per layer | head H | "
                   "last layer P1 | offloaded layers | host RAM per GPU |")
        out.append("|---|---|---:|---:|---:|---:|---:|---:|---:|---:|")
        hidden = {c.name: c.hidden_size for c in cfgs}
        for pt in longest:
            bsh_p = pt["seq_length"] // pt["p"] * hidden[pt["model"]] * 2
            out.append(
                f"| {pt['model']} | {pt['mode']} | {seq_label(pt['seq_length'])} | "
                f"{pt['state_bytes'] / GIB:.1f} | "
                f"{pt['layers'] * pt['layer_retained'] / GIB:.1f} | "
                f"{pt['layer_retained'] / bsh_p:.1f} | {pt['head_peak'] / GIB:.1f} | "
                f"{pt['layer_peak'] / GIB:.1f} | {pt['offloaded_layers']} | "
                f"{pt['host_bytes'] / GIB:.1f} |")
    if lp:
        say("saved-tensor tables", done=0, total=0)
        out.append(saved_tensor_tables(planner, cfgs, [m for m in modes if m in ("tp", "metp")],
                                       lp[0], _ints(args.time_seq_length)[0]))
    _emit(out)
    ts = _ints(args.time_seq_length)[0]
    out = [f"\n## Communication per step per rank at s = {seq_label(ts)} (counted under fake "
           f"tensors: bytes each rank sends and collective/P2P calls, one training step)\n",
           "| model | p | mode | sent GiB | calls |", "|---|---|---|---:|---:|"]
    timed = []
    for cfg in cfgs:
        for p in ps:
            for mode in modes:
                pt = planner.plan(cfg, mode, p, ts)
                timed.append(_without_times(point_dict(pt)))
                out.append(f"| {cfg.name} | {p} | {mode} | {pt.sent_bytes / GIB:.2f} | "
                           f"{pt.comm_calls} |")
    out.append("\nStep times on a GPU (ESTIMATES) come from one model, the timeline: "
               "`metp plan --timeline` (per-layer traces, overlap as scheduled) and "
               "`metp plan --frontier` (against stock's best).")
    out.append(f"\n(planned in {time.time() - t0:.0f} s)")
    _emit(out)
    if args.json:
        with open(args.json, "w") as f:
            json.dump(dict(settings=vars(settings),
                           points=[_without_times(point_dict(x)) for x in points],
                           longest=[_without_times(x) for x in longest], timed=timed),
                      f, indent=1)
    planner.world.teardown()
    return 0


def _emit(lines: List[str]) -> None:
    if lines:
        print("\n".join(lines), flush=True)


def _without_times(d: dict) -> dict:
    """A plan point for the JSON, without the planner's alpha-beta step time (the timeline is
    the one estimator of GPU time: ``metp plan --timeline`` / ``--frontier``)."""
    return {k: v for k, v in d.items() if k != "est_time_s"}


def _progress(t0: float):
    """``say(msg, done, total)``: a progress line on stderr, at most one every 2 s, with the
    elapsed time and, once something is done, the time left at the rate so far."""
    last = [0.0]

    def say(msg: str, done: int, total: int) -> None:
        now = time.time()
        if now - last[0] < 2.0 and done:
            return
        last[0] = now
        el = now - t0
        left = f", ~{el / done * (total - done):.0f} s left" if done and total else ""
        print(f"[metp plan] {msg} ({el:.0f} s{left})", file=sys.stderr, flush=True)

    return say


def _recompute(args) -> dict:
    """PlanSettings fields of the plan's recompute flags."""
    gran = args.recompute_granularity
    modules = _modules(args.recompute_modules)
    if gran == "full":
        return dict(recompute_granularity="full",
                    recompute_method=args.recompute_method or "uniform",
                    recompute_num_layers=args.recompute_num_layers or 1)
    if gran == "selective" or modules:  # --recompute-modules alone: selective, as before
        return dict(recompute_granularity="selective",
                    recompute_modules=modules or ["core_attn"])
    return {}


def run_frontier(args) -> int:
    """``metp plan --frontier`` (``measure.frontier``): progress on stderr, the table on stdout,
    frontier.json / .md / .svg in --frontier-dir."""
    import warnings

    from megatron_metp.measure import frontier
    from megatron_metp.measure.planner import quiet_megatron
    from megatron_metp.measure.timeline import GPUS
    from megatron_metp.models.config import load_config

    warnings.filterwarnings("ignore")
    gpus = [g.strip() for g in args.gpus.split(",") if g.strip()]
    bad = [g for g in gpus if g not in GPUS]
    if bad or not gpus:
        raise ValueError(f"--gpus {args.gpus!r}: choose from {', '.join(GPUS)}")
    ps = _ints(args.p) if named(args, "p") else [8]
    settings = PlanSettings(memory_gib=args.memory_gb, reserve_gib=args.reserve_gb,
                            communicator_gib=args.communicator_gb,
                            fragmentation=args.fragmentation, efficiency=args.efficiency,
                            attention_efficiency=args.attention_efficiency,
                            distributed_optimizer=args.use_distributed_optimizer,
                            grad_reduce_in_bf16=args.grad_reduce_in_bf16)
    cfgs = [load_config(n.strip()) for n in args.models.split(",") if n.strip()]
    # --seq-lengths named on the command line: those lengths instead of 4k .. the longest.
    seqs = _ints(args.seq_lengths) if named(args, "seq_lengths") else None
    if args.gpus_total is not None:
        return run_cluster(args, cfgs, gpus, settings, seqs)
    with quiet_megatron():
        doc = frontier.run_frontier(cfgs, ps, gpus, settings, args.host_op_us * 1e-6,
                                    args.gpus_per_node, seqs=seqs, jobs=args.jobs,
                                    longest=args.longest or seqs is None)
    md = frontier.markdown(doc)
    print(md)
    d = args.frontier_dir
    os.makedirs(d, exist_ok=True)
    with open(os.path.join(d, "frontier.md"), "w") as f:
        f.write(md + "\n")
    frontier.write(doc, args.json or os.path.join(d, "frontier.json"),
                   os.path.join(d, "frontier.svg"))
    print(f"\n[metp plan --frontier] {doc['seconds']:.0f} s; wrote "
          f"{args.json or os.path.join(d, 'frontier.json')}, {d}/frontier.md, "
          f"{d}/frontier.svg (ESTIMATES)")
    return 0


def run_cluster(args, cfgs, gpus, settings, seqs) -> int:
    """``metp plan --frontier --gpus-total N`` (``measure.cluster``): progress on stderr, the
    table on stdout, cluster.json / .md / -<model>.svg in --frontier-dir."""
    from megatron_metp.measure import cluster
    from megatron_metp.measure.planner import quiet_megatron

    if args.jobs > 1:
        raise ValueError(f"--jobs {args.jobs}: --gpus-total plans in one process (its traces "
                         "serve every N); drop --jobs")
    # --modes named: those families (tp is stock's), else all three.
    families = ([{"tp": "stock"}.get(m.strip(), m.strip()) for m in args.modes.split(",")
                 if m.strip()] if named(args, "modes") else list(cluster.FAMILIES))
    with quiet_megatron():
        doc = cluster.run_cluster(
            cfgs, _ints(args.gpus_total), gpus, settings, args.host_op_us * 1e-6,
            args.gpus_per_node, families=families, seqs=seqs, longest=args.longest,
            global_batch_tokens=args.global_batch_tokens or cluster.GLOBAL_BATCH_TOKENS,
            each_team=args.each_team_size,
            wallfacer_optimizers=tuple(n.strip() for n in args.wallfacer_optimizers.split(",")
                                       if n.strip()) if args.wallfacer_optimizers else None)
    print(cluster.markdown(doc))
    paths = cluster.write(doc, args.frontier_dir)
    print(f"\n[metp plan --frontier --gpus-total] {doc['seconds']:.0f} s; wrote "
          f"{', '.join(paths)} (ESTIMATES)")
    return 0


def saved_tensor_tables(planner, cfgs, modes, p: int, s: int) -> str:
    """Markdown: what one layer keeps for backward, tensor by tensor, per model and mode."""
    out = [f"\n## What one layer keeps for backward, itemised (p = {p}, s = {seq_label(s)}; "
           f"bytes per token of the whole sequence, and in bsh/p = one bf16 [s/p, b, h])\n"]
    for cfg in cfgs:
        for mode in modes:
            items = planner.saved_tensors(cfg, mode, p, s)
            unit = s // p * cfg.hidden_size * 2
            total = sum(it.bytes for it in items)
            label = ("tp (stock Megatron-Core modules, Megatron-LM's default fusions)"
                     if mode == "tp" else mode)
            out.append(f"**{cfg.name}, {label}**: {total / s:,.0f} B/token = "
                       f"{total / unit:.2f} bsh/p\n")
            out.append("| saved by | shape (this rank) | dtype | B/token | bsh/p |")
            out.append("|---|---|---|---:|---:|")
            for it in items:
                out.append(f"| {it.module or '(layer)'} | {list(it.shape)} | {it.dtype} | "
                           f"{it.bytes / s:,.1f} | {it.bytes / unit:.3f} |")
            out.append("")
    return "\n".join(out)


def main(argv: Optional[List[str]] = None) -> int:
    import argparse

    parser = argparse.ArgumentParser(prog="metp plan")
    add_arguments(parser)
    return run(parser.parse_args(argv))


if __name__ == "__main__":
    sys.exit(main())
