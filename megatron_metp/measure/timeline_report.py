"""``metp plan --timeline``: ESTIMATED per-layer step time, MFU and exposed communication on
H100 / A100 from one layer's traced ops (``op_trace``) replayed on a GPU model (``timeline``).

Per (model, p, mode, s) one layer's forward + backward is traced at the full sequence length
(fake tensors cost no memory): on every rank for METP (its rows report the slowest rank and the
max / mean of the ranks' compute), on rank p - 1 for tp and WallFacer (every rank runs the same
ops), then replayed per GPU and scenario:
``tp`` (stock Megatron-Core TP+SP as traced), ``tp+overlap`` (the trace rewritten by
``timeline.tp_comm_overlap``: Megatron's ``--tp-comm-overlap``), ``metp``, ``wallfacer`` (C = 1,
ring attention over CP = p). MFU = Megatron-LM's model FLOPs of one layer (``flops``) / p /
(step x bf16 peak). Each row also carries the executed FLOPs and the bytes the compute ops
read and write (one rank, fwd + bwd: METP's Q/K/V recompute and merges next to tp's),
compute ops and comm calls, and the layer's time in a stack (``timeline.layer_in_stack``: what
one more layer adds to a device's step, the slowest rank's trace; the frontier's steps use it).
``--validate BENCH_JSON`` replays ``metp bench``'s layers on this machine's
measured FLOP/s, memory bandwidth and gloo ring step instead, and compares.
"""

from __future__ import annotations

import json
import os
import time
from typing import Dict, Optional

from megatron_metp.measure.planner import SAVED_MARK, saved_notes
from megatron_metp.measure.timeline import (ATTENTION_EFFICIENCY, ESTIMATE, GPUS, HOST_OP_US,
                                            chrome_trace, layer_in_stack, simulate)

TIMELINE_MODELS = ("llama-7b", "gpt-175b")
TIMELINE_SEQS = "32k,128k,512k,1024k"
TRACE_DEFAULT = "128k"
SCENARIOS = {"tp": ("tp", "tp+overlap"), "metp": ("metp",), "wallfacer": ("wallfacer",)}


def add_arguments(parser) -> None:
    a = parser.add_argument
    a("--timeline", action="store_true",
      help="ESTIMATED per-layer step time, MFU and exposed communication on H100/A100 from a "
           "traced layer (defaults: --models llama-7b,gpt-175b --p 8 --seq-lengths "
           "32k,128k,512k,1024k --modes tp,metp,wallfacer)")
    a("--timeline-dir", default="timeline", metavar="DIR",
      help="where --timeline writes timeline.json/.md, trace_<model>.json, timeline.svg")
    a("--gpus", default="H100,A100", help=f"GPU models for --timeline: {', '.join(GPUS)}")
    a("--trace-seq-length", default=TRACE_DEFAULT,
      help="sequence of the Chrome trace (--timeline; one of --seq-lengths; by default 128k, "
           "or the longest of --seq-lengths up to 128k when 128k is not one of them)")
    a("--host-op-us", type=float, default=HOST_OP_US, metavar="US",
      help="host time to issue one traced op, compute or communication, in microseconds "
           "(default 30: measured per traced op on one H200 machine, docs/calibration; see "
           "megatron_metp/measure/timeline.py); 0 leaves the host out")
    a("--gpus-per-node", type=int, default=8,
      help="groups up to this size run on NVLink, larger ones on InfiniBand (--timeline)")
    a("--validate", default=None, metavar="BENCH_JSON",
      help="with --timeline: replay metp bench's layers (its --json) on this machine's measured "
           "FLOP/s and gloo ring and report the error against its measured step times")


def _defaults(args, ints):
    """--timeline's own defaults for the flags the command left out (``args.named``:
    ``plan_report.fill_defaults``)."""
    named = args.named
    models = tuple(m.strip() for m in args.models.split(",") if m.strip()) \
        if "models" in named else TIMELINE_MODELS
    seqs = ints(args.seq_lengths if "seq_lengths" in named else TIMELINE_SEQS)
    ps = ints(args.p) if "p" in named else [8]
    modes = tuple(m.strip() for m in args.modes.split(",") if m.strip()) \
        if "modes" in named else ("tp", "metp", "wallfacer")
    return models, seqs, ps, modes


def check(args, ints) -> None:
    gpus = [g.strip() for g in args.gpus.split(",") if g.strip()]
    bad = [g for g in gpus if g not in GPUS]
    if bad or not gpus:
        raise ValueError(f"--gpus {args.gpus!r}: choose from {', '.join(GPUS)} (e.g. H100,A100)")
    if args.host_op_us < 0:
        raise ValueError(f"--host-op-us {args.host_op_us}: must be >= 0 (microseconds per op)")
    if args.gpus_per_node < 1:
        raise ValueError(f"--gpus-per-node {args.gpus_per_node}: must be >= 1 (GPUs per node)")
    ts = ints(args.trace_seq_length)
    if len(ts) != 1 or ts[0] < 1024 or ts[0] % 1024:
        raise ValueError(f"--trace-seq-length {args.trace_seq_length}: give one multiple of "
                         "1024, e.g. 128k")
    if args.validate and not os.path.isfile(args.validate):
        raise ValueError(f"--validate {args.validate}: no such file; give the JSON that "
                         "`metp bench --json PATH` wrote")
    if os.path.exists(args.timeline_dir) and not os.path.isdir(args.timeline_dir):
        raise ValueError(f"--timeline-dir {args.timeline_dir}: exists and is not a directory")


def _flop_model(cfg):
    from megatron_metp.models.flops import FlopModel

    return FlopModel(num_layers=1, hidden_size=cfg.hidden_size,
                     num_attention_heads=cfg.num_attention_heads,
                     num_query_groups=cfg.num_query_groups, kv_channels=cfg.kv_channels,
                     ffn_hidden_size=cfg.ffn_hidden_size, padded_vocab_size=0,
                     swiglu=cfg.swiglu, causal=cfg.causal)


# Modes whose ranks run different ops (METP's ring pieces differ by rank): traced on every rank.
PER_RANK_MODES = ("metp",)


def _mode_configs(mode: str, p: int, team_size: int):
    """``(team size, placement, scenarios)`` of ``mode`` at ``p``: WallFacer's teams of
    ``team_size`` in every placement the topology scheduler tells apart
    (``wallfacer.scheduler.candidates``), labelled by both; one plain entry otherwise."""
    if mode != "wallfacer" or team_size == 1:
        return [(1, "collective_intra", SCENARIOS[mode])]
    from megatron_metp.wallfacer.scheduler import candidates

    return [(c, pl, (f"wallfacer C={c} {pl}",)) for c, pl in candidates(p) if c == team_size]


def timeline_rows(cfgs, ps, modes, seqs, gpus, efficiency, gpus_per_node, keep=None,
                  host_op_s: float = 0.0, ring_pass: str = "auto", qkv_backward: str = "auto",
                  attention_efficiency: Optional[float] = None, team_size: int = 1):
    """Every (model, p, s, scenario, GPU) row; ``keep`` collects schedules for the trace:
    ``{(model, s): {label: Schedule}}``. ``host_op_s``: host seconds per issued op.
    ``ring_pass`` / ``qkv_backward``: METP's --metp-ring-pass / --metp-qkv-backward; "auto" is
    resolved per row by the planner at 80 GiB (``planner.resolve_metp_attention``), as a
    launcher resolves it on an 80 GiB GPU. ``attention_efficiency``: fused attention kernels'
    fraction of peak (None: the timeline's fitted default). ``team_size``: WallFacer's C,
    traced with its team group and sub-rings in each placement (:func:`_mode_configs`)."""
    rows = []
    for cfg in cfgs:
        for p in ps:
            for mode in modes:
                for team, placement, scenarios in _mode_configs(mode, p, team_size):
                    rows += _mode_rows(cfg, p, mode, seqs, gpus, efficiency, gpus_per_node,
                                       keep, host_op_s, ring_pass, qkv_backward,
                                       attention_efficiency, team, placement, scenarios)
    return rows


def _mode_rows(cfg, p, mode, seqs, gpus, efficiency, gpus_per_node, keep, host_op_s, ring_pass,
               qkv_backward, attention_efficiency, team, placement, scenarios):
    """:func:`timeline_rows` of one (model, p, mode, team)."""
    from dataclasses import replace

    from megatron_metp.models.flops import training_flops
    from megatron_metp.measure.op_trace import summary, trace_layer
    from megatron_metp.measure.planner import (FakeWorld, chains_layers, resolve_metp_attention,
                                               seq_label)
    from megatron_metp.measure.timeline import tp_comm_overlap

    rows = []
    ranks = range(p) if mode in PER_RANK_MODES else [p - 1]
    for s in seqs:
        t0 = time.time()
        qkv = qkv_backward if mode == "metp" else "recompute"
        ring = ring_pass
        if mode == "metp" and "auto" in (qkv, ring):
            ring, qkv, _ = resolve_metp_attention(
                cfg, p, s, memory_gib=80.0, ring_pass=ring, qkv_backward=qkv)
        traces, stacks = [], {}
        for r in ranks:
            world = FakeWorld(rank=r)
            traces.append(trace_layer(cfg, mode, p, s, world=world, ring_pass=ring,
                                      qkv_backward=qkv, team_size=team,
                                      placement=placement))
            world.teardown()
        traced_s = time.time() - t0

        def stack(i):
            """Rank ``ranks[i]``'s stack of two where layers hand work to the next
            (else None: ``layer_in_stack`` runs its trace twice), traced once."""
            if i not in stacks:
                stacks[i] = None
                if chains_layers(cfg, mode, p, s):
                    world = FakeWorld(rank=ranks[i])
                    stacks[i] = trace_layer(cfg, mode, p, s, world=world,
                                            ring_pass=ring, qkv_backward=qkv, layers=2,
                                            team_size=team, placement=placement)
                    world.teardown()
            return stacks[i]

        model_flops = training_flops(_flop_model(cfg), 1, s) / p
        for scen in scenarios:
            for g in gpus:
                m = replace(GPUS[g], efficiency=efficiency,
                            attention_efficiency=(
                                ATTENTION_EFFICIENCY if attention_efficiency is None
                                else attention_efficiency),
                            gpus_per_node=gpus_per_node, host_op_s=host_op_s).per_gpu()
                runs = []
                for i, ops in enumerate(traces):
                    trace = tp_comm_overlap(ops) if scen == "tp+overlap" else ops
                    runs.append((simulate(trace, m), summary(trace), trace, i))
                # The synchronous ring runs at its slowest rank's pace; its stack
                # alone is traced.
                sch, sm, slowest, i = max(runs, key=lambda run: run[0].step)
                steady = layer_in_stack(slowest, m,
                                        stack(i) if slowest is traces[i] else None)[1]
                busy = [run[0].compute for run in runs]
                rows.append(dict(
                    model=cfg.name, p=p, seq_length=s, scenario=scen, gpu=g,
                    step_s=sch.step, compute_s=sch.compute,
                    exposed_comm_s=sch.exposed_comm,
                    comm_busy_s=dict(sch.comm), mfu=model_flops / sch.step /
                    m.peak_flops, model_flops=model_flops,
                    executed_flops=sm["flops"], compute_bytes=sm["compute_bytes"],
                    comm_ops=sm["comm_ops"], trace_s=traced_s,
                    # added fields (older readers ignore them)
                    compute_ops=sm["compute_ops"], host_op_s=host_op_s,
                    host_s=sch.host, host_bound=sch.host_bound,
                    ranks_traced=len(runs), rank_compute_s=busy,
                    rank_compute_max_over_mean=max(busy) / (sum(busy) / len(busy)),
                    qkv_backward=qkv if mode == "metp" else "",
                    ring_pass=ring if mode == "metp" else "",
                    steady_s=steady, team_size=team,
                    placement=placement if mode == "wallfacer" else ""))
                if keep is not None:
                    keep.setdefault((cfg.name, g, s), {})[
                        f"{cfg.name} p={p} s={seq_label(s)} {scen} {g}"] = sch
    return rows


def markdown(rows) -> str:
    from megatron_metp.measure.planner import seq_label

    out = ["ESTIMATE: simulated, not measured on a GPU (megatron_metp/measure/timeline.py "
           "states every input).\n",
           "| model | p | GPU | s | scenario | step ms (ESTIMATE) | ms in a stack (ESTIMATE) | "
           "MFU (ESTIMATE) | "
           "exposed comm ms (ESTIMATE) | exposed / step | TFLOP executed | GB moved | "
           "compute ops | comm calls | host ms (ESTIMATE) | host-bound | rank compute max/mean |",
           "|---|---:|---|---:|---|---:|---:|---:|---:|---:|---:|---:|---:|---:|---:|---|---:|"]
    for r in rows:
        scen = r["scenario"] + (f" ({r['ring_pass']})" if r.get("ring_pass") else "")
        out.append(f"| {r['model']} | {r['p']} | {r['gpu']} | {seq_label(r['seq_length'])} | "
                   f"{scen} | {r['step_s'] * 1e3:,.1f} | {r['steady_s'] * 1e3:,.1f} | "
                   f"{r['mfu']:.1%} | "
                   f"{r['exposed_comm_s'] * 1e3:,.1f} | {r['exposed_comm_s'] / r['step_s']:.1%} | "
                   f"{r['executed_flops'] / 1e12:,.1f} | {r['compute_bytes'] / 1e9:,.1f} | "
                   f"{r['compute_ops']:,} | {r['comm_ops']:,} | {r['host_s'] * 1e3:,.1f} | "
                   f"{'yes' if r['host_bound'] else 'no'} | "
                   f"{r['rank_compute_max_over_mean']:.3f} ({r['ranks_traced']} ranks)"
                   f"{SAVED_MARK.get(r.get('qkv_backward'), '')} |")
    out += saved_notes(r.get("qkv_backward") for r in rows)
    return "\n".join(out)


def svg(rows, path: str) -> None:
    """MFU against s per scenario, one panel per (model, GPU): a dependency-free SVG (no
    matplotlib on these machines), titled ESTIMATE."""
    import math

    panels = sorted({(r["model"], r["gpu"]) for r in rows})
    scen = list(dict.fromkeys(r["scenario"] for r in rows))
    colours = ["#1f77b4", "#ff7f0e", "#2ca02c", "#d62728", "#9467bd"]
    W, H, m = 360, 240, 45
    parts = [f'<svg xmlns="http://www.w3.org/2000/svg" width="{W * len(panels)}" '
             f'height="{H + 60}" font-family="sans-serif" font-size="11">',
             '<text x="10" y="16" font-size="14">ESTIMATE (simulated, not measured): MFU per '
             'layer vs sequence length</text>']
    for k, (model, gpu) in enumerate(panels):
        x0, y0 = k * W + m, 30
        pr = [r for r in rows if r["model"] == model and r["gpu"] == gpu]
        seqs = sorted({r["seq_length"] for r in pr})
        lo, hi = math.log2(seqs[0]), math.log2(seqs[-1]) or 1
        xs = lambda s: x0 + (W - m - 15) * ((math.log2(s) - lo) / ((hi - lo) or 1))  # noqa
        ys = lambda v: y0 + (H - 40) * (1 - v / 0.6)  # noqa: E731 - MFU axis 0..60 %
        parts.append(f'<text x="{x0}" y="{y0 - 2}">ESTIMATE {model}, {gpu}, p={pr[0]["p"]}'
                     f'</text>')
        parts.append(f'<rect x="{x0}" y="{y0}" width="{W - m - 15}" height="{H - 40}" '
                     f'fill="none" stroke="#888"/>')
        for v in (0.0, 0.2, 0.4, 0.6):
            parts.append(f'<text x="{x0 - 30}" y="{ys(v) + 4}">{v:.0%}</text>')
        for s in seqs:
            parts.append(f'<text x="{xs(s) - 12}" y="{y0 + H - 25}">{s // 1024}k</text>')
        parts.append(f'<text x="{x0 + 60}" y="{y0 + H - 10}">sequence length s</text>')
        for j, sc in enumerate(scen):
            pts = sorted((r["seq_length"], r["mfu"]) for r in pr if r["scenario"] == sc)
            if not pts:
                continue
            c = colours[j % len(colours)]
            d = " ".join(f"{xs(s):.1f},{ys(v):.1f}" for s, v in pts)
            parts.append(f'<polyline points="{d}" fill="none" stroke="{c}" stroke-width="2"/>')
            parts.append(f'<text x="{x0 + 8}" y="{y0 + 14 + 13 * j}" fill="{c}">{sc}</text>')
    parts.append("</svg>")
    with open(path, "w") as f:
        f.write("\n".join(parts))


def run(args, ints) -> int:
    import warnings

    from megatron_metp.models.config import load_config
    from megatron_metp.measure.planner import quiet_megatron, seq_label

    check(args, ints)
    warnings.filterwarnings("ignore")
    os.makedirs(args.timeline_dir, exist_ok=True)
    if args.validate:
        from megatron_metp.measure.timeline_validate import validate

        res = validate(args.validate)
        path = os.path.join(args.timeline_dir, "validation.json")
        with open(path, "w") as f:
            json.dump(res, f, indent=1)
        print(res["markdown"])
        print(f"[metp plan --timeline --validate] wrote {path}")
        return 0
    models, seqs, ps, modes = _defaults(args, ints)
    gpus = [g.strip() for g in args.gpus.split(",") if g.strip()]
    trace_s = ints(args.trace_seq_length)[0]
    if trace_s not in seqs and args.trace_seq_length == TRACE_DEFAULT:
        # Left at its default: the trace follows --seq-lengths (the longest up to 128k).
        trace_s = max([s for s in seqs if s <= trace_s] or [min(seqs)])
    if trace_s not in seqs:
        raise ValueError(f"--trace-seq-length {args.trace_seq_length}: not one of --seq-lengths "
                         f"{','.join(seq_label(s) for s in seqs)}; pass one of them (or add "
                         f"{seq_label(trace_s)} to --seq-lengths)")
    keep: Dict = {}
    t0 = time.time()
    import torch

    from megatron_metp.measure.layer_probe import main_grads_in

    bf16_grads = getattr(args, "grad_reduce_in_bf16", False)   # DDP's main_grad dtype
    # Megatron-Core's spec notes ("Unknown MLP type") once per layer
    with quiet_megatron(), main_grads_in(torch.bfloat16 if bf16_grads else torch.float32):
        rows = timeline_rows([load_config(m) for m in models], ps, modes, seqs, gpus,
                             args.efficiency, args.gpus_per_node, keep,
                             host_op_s=args.host_op_us * 1e-6,
                             ring_pass=getattr(args, "metp_ring_pass", "auto"),
                             qkv_backward=getattr(args, "metp_qkv_backward", "auto"),
                             attention_efficiency=args.attention_efficiency,
                             team_size=getattr(args, "wallfacer_team_size", 1))
    md = markdown(rows)
    print(md)
    print(f"\n(traced and simulated in {time.time() - t0:.0f} s)")
    d = args.timeline_dir
    with open(os.path.join(d, "timeline.md"), "w") as f:
        f.write(md + "\n")
    with open(os.path.join(d, "timeline.json"), "w") as f:
        json.dump(dict(label=ESTIMATE, efficiency=args.efficiency,
                       attention_efficiency=args.attention_efficiency,
                       host_op_us=args.host_op_us,
                       gpus={g: {"name": GPUS[g].name, "peak_flops": GPUS[g].peak_flops,
                                 "hbm_bandwidth": GPUS[g].hbm_bandwidth,
                                 "intra": vars(GPUS[g].intra), "inter": vars(GPUS[g].inter)}
                             for g in gpus},
                       rows=rows), f, indent=1)
    for m in models:
        scen = keep.get((m, gpus[0], trace_s), {})
        chrome_trace(scen, os.path.join(d, f"trace_{m}.json"), min_us=20.0,
                     meta={"model": m, "gpu": gpus[0], "seq_length": trace_s})
    svg(rows, os.path.join(d, "timeline.svg"))
    print(f"[metp plan --timeline] wrote {d}/timeline.md, timeline.json, timeline.svg, "
          f"trace_<model>.json (ESTIMATES; open the traces in https://ui.perfetto.dev)")
    return 0


__all__ = ["add_arguments", "run", "timeline_rows", "markdown", "check"]

