"""``metp plan --frontier --gpus-total N``: each family at its best on a job of N GPUs, trained
under a fixed global batch (ESTIMATES: every time comes from the timeline model, as in
``measure.frontier``, which this module extends).

A job of N GPUs is TP x CP x DP = N in Megatron's rank order (TP fastest, then CP, then DP;
nodes of ``--gpus-per-node`` GPUs filled in rank order), so a model-parallel group of
p = TP x CP GPUs is contiguous and its DP replicas lie beside it. The configurations searched:

==========  =====================================================================================
stock       every DP that divides N, and on the p = N / DP GPUs left every TP x CP split the
            frontier searches (``Frontier.base_variants``) with TP inside a node: CP p2p and
            a2a, --tp-comm-overlap, selective and full recompute
metp        DP x TP x CP = N with an even TP inside a node (METP x CP: its K/V ring over the
            TP x CP ranks, p2p), METP's attention choices (its a2a ring pass at CP = 1
            only), recompute as the frontier searches it
wallfacer   DP x CP = N (TP = 1), every valid team size C and placement, the distributed
            optimizer or Megatron-FSDP, recompute as the frontier searches it
==========  =====================================================================================

Not planned, though they run: stock's ``--hierarchical-context-parallel-sizes`` (a2a inside a
node, p2p across: no stand-in), and WallFacer with TP > 1 inside each CP rank (not traced).

The global batch (``--global-batch-tokens``, default 4,194,304): G / s sequences per optimizer
step (one where s > G), split evenly over DP; each replica runs them as micro-batches of b
sequences, gradient accumulation A = G / (s DP b). b is searched over the powers of two that
divide the replica's share, upward from 1 while the configuration fits and its step shrinks.

The step, for every family alike:

* A x t(b): one micro-batch through the device's layers, forward and backward
  (``Frontier.stack_times``: traced at b sequences);
* the distributed optimizer over the DP x CP group of d ranks (every family runs it; its link
  is NVLink when the N GPUs share a node, else the inter-node link): the fp32 gradient
  reduce-scatter (Megatron-LM's default under bf16) in buckets of max(40M, 1M d) parameters,
  overlapped with the last micro-batch's backward (``--overlap-grad-reduce``; backward = 2/3 of
  t(b)), exposed where it outlasts that backward and never less than its last bucket; the bf16
  parameter all-gather overlapped with the next step's first forward (``--overlap-param-gather``;
  t(b) / 3), exposed likewise; under Megatron-FSDP (WallFacer) its per-layer gathers and
  reduce-scatter instead, every micro-batch, exposed (an upper bound, as the frontier charges);
* the Adam step on the rank's 1/d of its parameters: ``ADAM_BYTES`` of HBM traffic per parameter
  at the machine's memory efficiency.

Left out, for every family alike: the LM head's and the embedding's time (their memory is
counted) and pipeline bubbles (LLaMA-70B and GPT-175B are one middle pipeline stage, as in
``measure.frontier``; their N GPUs are that stage's).
"""

from __future__ import annotations

import json
import os
import time
from dataclasses import dataclass, replace
from typing import Dict, List, Optional

from megatron_metp.measure.frontier import (FAMILIES, Frontier, Variant, seq_grid,
                                            settings_record)
from megatron_metp.measure.planner import GIB, PlanSettings, seq_label
from megatron_metp.measure.timeline import ESTIMATE, comm_time

GLOBAL_BATCH_TOKENS = 4 * 1024 * 1024
# Adam on the distributed optimizer's shard, HBM bytes per parameter: the fp32 master weight,
# gradient, first and second moments read (16), the master weight and moments written (12),
# the bf16 model weight written (2), the gradient zeroed (4).
ADAM_BYTES = 34
BACKWARD_SHARE = 2.0 / 3.0   # of a micro-batch's time: what --overlap-grad-reduce hides behind
DDP_BUCKET_MIN = 40_000_000  # Megatron-Core's default bucket: max(40M, 1M x DP) parameters
# The micro-batch search plans a larger size again only for configurations within this factor
# of the fastest at the size before (``Cluster.micro_batch_search``).
FOLLOW = 1.25
# Tokens per micro-batch at most: the micro-batch search's ceiling (b x s).
MAX_MICRO_BATCH_TOKENS = 1024 * 1024


@dataclass(frozen=True)
class Split:
    """How a job of ``gpus`` GPUs runs one configuration: p = gpus / dp GPUs per replica, the
    micro-batch and the accumulation under the global batch."""

    gpus: int
    dp: int
    micro_batch: int
    accumulation: int

    @property
    def p(self) -> int:
        return self.gpus // self.dp

    @property
    def sequences(self) -> int:
        return self.dp * self.micro_batch * self.accumulation


def sequences_per_step(global_batch_tokens: int, s: int) -> int:
    """Sequences of s tokens in one optimizer step: G / s, at least one."""
    return max(1, global_batch_tokens // s)


def micro_batches(share: int, s: int) -> List[int]:
    """The micro-batch sizes a replica with ``share`` sequences per step may run: powers of two
    that divide it, at most ``MAX_MICRO_BATCH_TOKENS`` tokens."""
    out, b = [], 1
    while b <= share and share % b == 0 and (b == 1 or b * s <= MAX_MICRO_BATCH_TOKENS):
        out.append(b)
        b *= 2
    return out


def job_link(m, gpus: int):
    """The link of the DP x CP group in a job of ``gpus`` GPUs on machine ``m``: NVLink when
    the job fits one node, else the inter-node link (with d > 1 and TP fastest in the rank
    order, that group then has members in more than one node)."""
    return m.intra if gpus <= m.gpus_per_node else m.inter


def fsdp_seconds(link, params_per_rank: int, d: int, sharding: str = "optim_grads_params",
                 grad_bytes: float = 4.0) -> float:
    """Megatron-FSDP's per micro-batch communication over d ranks (``Frontier.step_times``'
    charge, exposed): the fp32 gradient reduce-scattered, and under ``optim_grads_params`` the
    bf16 parameters all-gathered for the forward and again for the backward (``optim_grads``
    gathers them once per step: :func:`optimizer_seconds`)."""
    gathers = 0 if sharding == "optim_grads" else 2
    return gathers * comm_time("all_gather", 2 * params_per_rank, d, link) + \
        comm_time("reduce_scatter", grad_bytes * params_per_rank, d, link)


def optimizer_seconds(m, link, params_per_rank: int, d: int, t_micro: float,
                      fsdp: bool, sharding: str = "optim_grads_params",
                      grad_bytes: float = 4.0) -> float:
    """ESTIMATED seconds the optimizer adds to a step on machine ``m`` (module docstring): the
    exposed gradient reduce-scatter and parameter all-gather of the distributed optimizer over
    d ranks on ``link`` (under Megatron-FSDP its reduce-scatters run per micro-batch; ZeRO-2's
    ``optim_grads`` all-gathers the updated parameters once, exposed), and the Adam step on
    1/d of the rank's parameters. ``grad_bytes``: 4 (fp32 gradients, Megatron-LM's default
    under bf16), 2 under ``--grad-reduce-in-bf16``."""
    t = ADAM_BYTES * params_per_rank / d / (m.hbm_bandwidth * m.mem_efficiency)
    if d > 1 and fsdp and sharding == "optim_grads":
        return t + comm_time("all_gather", 2 * params_per_rank, d, link)
    if d <= 1 or fsdp:
        return t
    bucket = min(params_per_rank, max(DDP_BUCKET_MIN, 1_000_000 * d))
    rs = comm_time("reduce_scatter", grad_bytes * params_per_rank, d, link)
    ag = comm_time("all_gather", 2 * params_per_rank, d, link)
    t += max(comm_time("reduce_scatter", grad_bytes * bucket, d, link),
             rs - BACKWARD_SHARE * t_micro)
    t += max(comm_time("all_gather", 2 * bucket, d, link),
             ag - (1 - BACKWARD_SHARE) * t_micro)
    return t


def _divisors(n: int) -> List[int]:
    return [d for d in range(1, n + 1) if n % d == 0]


def metp_cps(p: int, gpus_per_node: int) -> List[int]:
    """METP's CP sizes on p GPUs: TP = p / CP inside a node, and even when CP > 1 (each TP
    rank holds tokens of one of its CP rank's two load-balanced chunks)."""
    return [cp for cp in _divisors(p) if p // cp <= gpus_per_node
            and (cp == 1 or (p // cp) % 2 == 0)]


def job_flags(cfg, v: Variant, split: Split, s: int, bf16_grads: bool = False) -> List[str]:
    """Every Megatron-LM flag the configuration needs beyond the model's own
    (``megatron_lm.config_flags``): the run's length and batch, the parallel sizes, the
    optimizer's sharding and overlap, recompute, and ``--attention-dropout 0`` (METP and
    WallFacer refuse Megatron-LM's default 0.1; stock is given the same so that every family
    trains the same model)."""
    d = split.dp * v.cp
    out = ["--seq-length", str(s), "--max-position-embeddings",
           str(max(s, cfg.max_position_embeddings or 0)),
           "--micro-batch-size", str(split.micro_batch),
           "--global-batch-size", str(split.sequences), "--attention-dropout", "0"]
    out += v.flags(split.p, cfg.layers_per_device)
    if not v.fsdp and "--use-distributed-optimizer" not in out:
        out.append("--use-distributed-optimizer")
    if not v.fsdp and d > 1:
        out += ["--overlap-grad-reduce", "--overlap-param-gather"]
    if bf16_grads:   # the gradient-reduction lever (PlanSettings.grad_reduce_in_bf16)
        out.append("--grad-reduce-in-bf16")
    return out


def job_env(v: Variant, split: Split) -> Dict[str, str]:
    """The environment Megatron-LM's ``validate_args`` asks of the configuration before
    Blackwell: ``CUDA_DEVICE_MAX_CONNECTIONS=1`` with TP or CP > 1, and never 1 under
    Megatron-FSDP (its prefetches run on streams of their own)."""
    if v.fsdp or (split.p // v.cp == 1 and v.cp == 1):
        return {}
    return {"CUDA_DEVICE_MAX_CONNECTIONS": "1"}


class Cluster:
    """Plans configurations on jobs of N GPUs (module docstring) with one ``Frontier``'s
    planner, traces and caches: a trace's per-rank shapes depend on (p, s, micro-batch, the
    configuration), not on N, so a replica planned for one N serves every N."""

    def __init__(self, frontier: Frontier, global_batch_tokens: int = GLOBAL_BATCH_TOKENS):
        self.fr = frontier
        self.global_batch_tokens = global_batch_tokens

    def replica_variants(self, cfg, family: str, p: int) -> List[Variant]:
        """The family's configurations on a replica of p GPUs, TP inside a node."""
        g = self.fr.gpus_per_node
        if family != "stock" and p < 2:  # one GPU has no ring: that is stock's plain DP
            return []
        if family == "metp":  # METP x CP: an even TP inside a node, CP across
            return [replace(v, cp=cp) for cp in metp_cps(p, g)
                    for v in self.fr.base_variants(cfg, family, p // cp)
                    if cp == 1 or v.ring_pass != "a2a"]   # a2a's all-to-alls: TP group only
        out = self.fr.base_variants(cfg, family, p)
        if family == "stock":
            out = [v for v in out if p // v.cp <= g]
        return out

    def flags(self, cfg, v: Variant, split: Split, s: int) -> str:
        """The job's flags (:func:`job_flags`) under this cluster's settings."""
        return " ".join(job_flags(cfg, v, split, s, self.fr.settings.grad_reduce_in_bf16))

    def step(self, cfg, v: Variant, s: int, pt, split: Split) -> Dict[str, float]:
        """ESTIMATED seconds per optimizer step on each GPU (module docstring)."""
        stack = self.fr.stack_times(cfg, v, split.p, s)
        d = split.dp * v.cp   # the DP x CP group the optimizer shards over
        gb = self.fr.settings.grad_bytes
        out = {}
        for g, m in self.fr.machines.items():
            link = job_link(m, split.gpus)
            t_micro = stack[g] + (fsdp_seconds(link, pt.params_per_rank, d, v.sharding, gb)
                                  if v.fsdp and d > 1 else 0.0)
            out[g] = split.accumulation * t_micro + optimizer_seconds(
                m, link, pt.params_per_rank, d, t_micro, bool(v.fsdp), v.sharding, gb)
        return out

    def best(self, cfg, family: str, n: int, s: int, team: Optional[int] = None
             ) -> Dict[str, tuple]:
        """The family's fastest configuration on n GPUs at s, per GPU: {gpu: (variant, split,
        point, seconds)}; {} when none fits. Every DP that divides both n and the step's
        sequences, each with :meth:`micro_batch_search`. ``team``: WallFacer's
        configurations of that team size only."""
        seqs = sequences_per_step(self.global_batch_tokens, s)
        best: Dict[str, tuple] = {}
        for dp in _divisors(n):
            bases = self.replica_variants(cfg, family, n // dp) if seqs % dp == 0 else []
            if team is not None:
                bases = [v for v in bases if v.team == team]
            for g, entry in self.micro_batch_search(cfg, family, n, s, dp, bases).items():
                if g not in best or entry[3] < best[g][3]:
                    best[g] = entry
        return best

    def micro_batch_search(self, cfg, family: str, n: int, s: int, dp: int,
                           bases: List[Variant]) -> Dict[str, tuple]:
        """The fastest of ``bases`` at DP ``dp`` over the micro-batch sizes, per GPU. The
        micro-batch doubles from 1 while the step still shrinks by 1 % somewhere; past the
        first size only the configurations (attention choice, TP x CP split, CP comm, overlap,
        team, optimizer: each a group of ``Frontier.fastest``) whose fastest member came within
        ``FOLLOW`` of the fastest are planned again (a larger micro-batch scales every
        configuration's work alike, and amortises only the weight traffic, which no group
        loses)."""
        seqs = sequences_per_step(self.global_batch_tokens, s)
        best: Dict[str, tuple] = {}
        prev: Dict[str, float] = {}
        for b in micro_batches(seqs // dp, s) if bases else []:
            split = Split(n, dp, b, seqs // dp // b)
            self.fr.progress(f"{cfg.name} N={n} s={seq_label(s)} {family}: planning DP {dp} x "
                             f"{n // dp} GPUs, micro-batch {b}, {len(bases)} configurations")
            times: Dict[Variant, Dict[str, float]] = {}
            with self.fr.using(micro_batch=b, data_parallel=dp, distributed_optimizer=True):

                def cost(v, pt, split=split):
                    times[v] = self.step(cfg, v, s, pt, split)
                    return times[v]

                got = self.fr.fastest(cfg, family, split.p, s, cost=cost, bases=bases)
            here = {g: (v, split, pt, times[v][g]) for g, (v, pt) in got.items()}
            for g, entry in here.items():
                if g not in best or entry[3] < best[g][3]:
                    best[g] = entry
            if not here or all(g in prev and here[g][3] >= 0.99 * prev[g] for g in here):
                break
            prev = {g: e[3] for g, e in here.items()}
            near = {v.group() for v, tv in times.items()
                    if any(tv[g] <= FOLLOW * here[g][3] for g in here)}
            bases = [v for v in bases if v.group() in near]
        return best

    def row(self, cfg, family: str, s: int, entry, gpu: str) -> dict:
        from megatron_metp.measure.timeline_report import _flop_model
        from megatron_metp.models.flops import training_flops

        v, split, pt, t = entry
        L = cfg.layers_per_device
        tokens = split.sequences * s
        flops = training_flops(_flop_model(cfg), split.sequences, s) * L / split.gpus
        m = self.fr.machines[gpu]
        return dict(model=cfg.name, gpus=split.gpus, nodes=-(-split.gpus // m.gpus_per_node),
                    gpu=gpu, seq_length=s, family=family, tp=split.p // v.cp, cp=v.cp,
                    dp=split.dp,
                    micro_batch=split.micro_batch, accumulation=split.accumulation,
                    global_batch_tokens=tokens,
                    team_size=v.team if family == "wallfacer" else None,
                    megatron_fsdp=v.sharding if v.fsdp else "", step_ms=t * 1e3,
                    tokens_per_s_per_gpu=tokens / t / split.gpus,
                    mfu=flops / t / m.peak_flops, memory_gib=pt.needed_bytes / GIB,
                    recompute=" ".join(v.recompute_flags(L)), fastest=False,
                    flags=self.flags(cfg, v, split, s),
                    env=" ".join(f"{k}={x}" for k, x in job_env(v, split).items()))

    def frugal(self, cfg, family: str, n: int) -> List[Variant]:
        """The configurations of n GPUs that need the least memory (``Frontier.frugal``'s, at
        DP = 1, which gives the longest sequence: with TP fixed, the optimizer's state per GPU
        is the same for every CP x DP split of n / TP, while a GPU's tokens fall with CP),
        with TP inside a node; METP also at each CP."""
        g = self.fr.gpus_per_node
        if family == "metp":
            return [replace(v, cp=cp) for cp in metp_cps(n, g)
                    for v in self.fr.frugal(cfg, family, n // cp)]
        out = self.fr.frugal(cfg, family, n)
        return [v for v in out if n // v.cp <= g] if family == "stock" else out

    def longest(self, cfg, family: str, n: int) -> Optional[dict]:
        """The family's longest sequence on n GPUs and its configuration, as a row's fields
        (DP 1, micro-batch 1, one sequence per step where it exceeds the global batch)."""
        with self.fr.using(data_parallel=1, distributed_optimizer=True, micro_batch=1):
            got = self.fr.longest(cfg, family, n, self.frugal(cfg, family, n))
        if not got:
            return None
        v, pt = got
        s = pt.seq_length
        split = Split(n, 1, 1, sequences_per_step(self.global_batch_tokens, s))
        return dict(model=cfg.name, gpus=n, family=family, seq_length=s, tp=n // v.cp,
                    cp=v.cp, team_size=v.team if family == "wallfacer" else None,
                    memory_gib=pt.needed_bytes / GIB, flags=self.flags(cfg, v, split, s))


def team_sizes(n: int) -> List[int]:
    """WallFacer's valid team sizes on n GPUs (C^2 divides the CP size; every CP of a job)."""
    from megatron_metp.wallfacer.scheduler import candidates

    return sorted({c for p in _divisors(n) if p > 1 for c, _ in candidates(p)})


def plan_job(cl: Cluster, cfg, n: int, families, seqs: Optional[List[int]], longest: bool,
             log, t_all: float, each_team: bool = False) -> tuple:
    """One model on n GPUs: each family's longest (when ``longest``, or when no lengths are
    given: then the grid runs from 4k to the longest), and its fastest at every length
    (``each_team``: WallFacer's fastest at every team size C, a row each). Returns ``(rows,
    longest rows)``."""
    def head() -> str:
        return f"[metp plan --frontier {time.time() - t_all:5.0f} s] {cfg.name} N={n}"

    limits, far = {}, []
    if longest or seqs is None:
        for fam in families:
            log(f"{head()}: longest sequence of {fam}")
            got = cl.longest(cfg, fam, n)
            if got:
                far.append(got)
                limits[fam] = got["seq_length"]
    grid = sorted(seqs) if seqs is not None else seq_grid(max(limits.values(), default=0))
    rows = []
    for j, s in enumerate(grid):
        log(f"{head()}: s={seq_label(s)} ({j + 1}/{len(grid)})")
        here = []
        for fam in families:
            if fam in limits and s > limits[fam]:
                continue
            for team in team_sizes(n) if fam == "wallfacer" and each_team else [None]:
                for g, entry in cl.best(cfg, fam, n, s, team).items():
                    here.append(cl.row(cfg, fam, s, entry, g))
        for g in cl.fr.gpus:
            mine = [r for r in here if r["gpu"] == g]
            if mine:
                min(mine, key=lambda r: r["step_ms"])["fastest"] = True
        rows += here
    return rows, far


def run_cluster(cfgs, totals: List[int], gpus, settings: PlanSettings, host_op_s: float,
                gpus_per_node: int, families=FAMILIES, log=None, seqs=None,
                longest: bool = False, global_batch_tokens: int = GLOBAL_BATCH_TOKENS,
                each_team: bool = False, wallfacer_optimizers=None) -> dict:
    """The cluster frontier of every model and job size (module docstring): the JSON
    document. One Frontier plans every job: its traces, whose per-rank shapes depend on the
    replica and not on N, are made once. ``each_team``: WallFacer's fastest at every team size;
    ``wallfacer_optimizers``: WallFacer's optimizer choices by name
    (``frontier.WALLFACER_OPTIMIZERS``; default the distributed optimizer and Megatron-FSDP's
    ``optim_grads_params``)."""
    from megatron_metp.measure.frontier import _stderr, _throttled

    log = log or _stderr
    t_all = time.time()
    fr = Frontier(settings, gpus, host_op_s, gpus_per_node, _throttled(log, t_all),
                  wallfacer_fsdp=True, wallfacer_optimizers=wallfacer_optimizers)
    cl = Cluster(fr, global_batch_tokens)
    rows, far = [], []
    try:
        for cfg in cfgs:
            for n in totals:
                r, lg = plan_job(cl, cfg, n, families, seqs, longest, log, t_all, each_team)
                rows += r
                far += lg
    finally:
        fr.planner.world.teardown()
    return dict(label=ESTIMATE, global_batch_tokens=global_batch_tokens,
                gpus_per_node=gpus_per_node, settings=settings_record(settings, host_op_s),
                cluster=rows, longest=far, seconds=time.time() - t_all)


# ---- reports ---------------------------------------------------------------------------------


def markdown(doc: dict) -> str:
    out = [f"ESTIMATE: step times simulated (megatron_metp/measure/timeline.py), not measured "
           f"on a GPU; memory planned under FakeTensorMode. A step trains "
           f"{doc['global_batch_tokens']:,} tokens (fewer sequences than DP: not run); it "
           f"counts the layers, the distributed optimizer's exposed communication and the "
           f"Adam step; the LM head's time is left out for every family. ★ = the fastest at "
           f"that length. Flags: beyond the model's own.\n",
           "| model | N | nodes | GPU | s | family | TP | CP | DP | micro-batch | C | step s | "
           "tokens/s/GPU | MFU | GiB | flags |",
           "|---|---:|---:|---|---:|---|---:|---:|---:|---:|---:|---:|---:|---:|---:|---|"]
    for r in doc["cluster"]:
        out.append(f"| {r['model']} | {r['gpus']} | {r['nodes']} | {r['gpu']} | "
                   f"{seq_label(r['seq_length'])} | {r['family']}{' ★' if r['fastest'] else ''}"
                   f" | {r['tp']} | {r['cp']} | {r['dp']} | {r['micro_batch']} | "
                   f"{r['team_size'] or '-'} | {r['step_ms'] / 1e3:,.2f} | "
                   f"{r['tokens_per_s_per_gpu']:,.0f} | {r['mfu']:.1%} | "
                   f"{r['memory_gib']:.1f} | `{r['flags']}` |")
    if doc["longest"]:
        out += ["\n### Longest sequence per family\n",
                "| model | N | family | longest | TP | CP | C | GiB | flags |",
                "|---|---:|---|---:|---:|---:|---:|---:|---|"]
        for r in doc["longest"]:
            out.append(f"| {r['model']} | {r['gpus']} | {r['family']} | "
                       f"{seq_label(r['seq_length'])} | {r['tp']} | {r['cp']} | "
                       f"{r['team_size'] or '-'} | {r['memory_gib']:.1f} | `{r['flags']}` |")
    return "\n".join(out)


def _lines(rows: List[dict]) -> List[tuple]:
    """The plot's lines: ``(family, team size or None, label)``, one per family, or one per
    WallFacer team size where the rows hold each (``--each-team-size``)."""
    out = []
    for fam in FAMILIES:
        mine = [r for r in rows if r["family"] == fam]
        teams = sorted({r["team_size"] for r in mine if r["team_size"]})
        per_team = len(mine) > len({r["seq_length"] for r in mine})
        if per_team:
            out += [(fam, c, f"{fam} C={c}") for c in teams]
        elif mine:
            out.append((fam, None, fam))
    return out


def svg(doc: dict, path: str) -> None:
    """Tokens/s per GPU against s (log axes), one line per family (per WallFacer team size
    where the rows hold each) ending at its longest planned length, one panel per (model, N,
    GPU): a dependency-free SVG titled ESTIMATE."""
    from megatron_metp.measure import svg_plot

    rows = doc["cluster"]
    panels = []
    for model, gpus, gpu in sorted({(r["model"], r["gpus"], r["gpu"]) for r in rows}):
        pr = [r for r in rows if (r["model"], r["gpus"], r["gpu"]) == (model, gpus, gpu)]
        lines = [svg_plot.Line(label, svg_plot.COLOURS[fam], sorted(
            (r["seq_length"], r["tokens_per_s_per_gpu"]) for r in pr
            if r["family"] == fam and (team is None or r["team_size"] == team)),
            f"{2 * team},{2 * team}" if team and team > 1 else "")
            for fam, team, label in _lines(pr)]
        panels.append(svg_plot.Panel(f"ESTIMATE {model}, N={gpus}, {gpu}", lines))
    svg_plot.write(path, "ESTIMATE (simulated, not measured): tokens/s per GPU of each "
                   "family's fastest configuration under the global batch", panels,
                   "tokens/s/GPU (log)", cols=3)


def write(doc: dict, directory: str) -> List[str]:
    """cluster.json, cluster.md and one cluster-<model>.svg per model in ``directory``."""
    os.makedirs(directory, exist_ok=True)
    paths = [os.path.join(directory, "cluster.json"), os.path.join(directory, "cluster.md")]
    with open(paths[0], "w") as f:
        json.dump(doc, f, indent=1)
    with open(paths[1], "w") as f:
        f.write(markdown(doc) + "\n")
    for model in sorted({r["model"] for r in doc["cluster"]}):
        one = dict(doc, cluster=[r for r in doc["cluster"] if r["model"] == model])
        paths.append(os.path.join(directory, f"cluster-{model}.svg"))
        svg(one, paths[-1])
    return paths


__all__ = ["Cluster", "Split", "run_cluster", "markdown", "svg", "write", "job_flags",
           "job_env", "optimizer_seconds", "sequences_per_step", "micro_batches", "GLOBAL_BATCH_TOKENS"]
