"""``metp plan --frontier``: the fastest configuration that fits, per family, at every sequence
length: throughput against sequence length for stock Megatron-Core at its best, METP and
WallFacer (ESTIMATES: every time comes from the timeline model, ``measure.timeline``).

Families and the configurations searched (each a set of Megatron-LM flags; p GPUs, DP = 1):

==========  =====================================================================================
stock       Megatron-Core's own modules and Megatron-LM's defaults, TP x CP = p with every split
            the head counts allow (CP > 1: ``--cp-comm-type p2p``, and ``a2a`` where the heads
            per TP rank split over CP; the distributed optimizer sharding the state over CP;
            Transformer Engine's CP attention stood in for by the plugin's ring,
            ``planner.CP_STAND_IN``, or its all-to-all, ``planner.CP_A2A_STAND_IN``), with and
            without ``--tp-comm-overlap``, and
            each recompute: none, selective (``layernorm``, ``layernorm mlp``, ``layernorm
            core_attn``, ``layernorm core_attn mlp``), and full (``--recompute-method block
            --recompute-num-layers k``, the fewest layers k that fit; k = every layer is written
            ``uniform 1``)
metp        ``--tensor-parallel-mode metp`` (TP = p), each attention choice
            (``planner.Planner.metp_choices``: ring pass, Q/K/V saved or recomputed) with no
            recompute, ``layernorm`` or full recompute of the fewest layers k that fit
wallfacer   ``--tensor-parallel-mode wallfacer`` (CP = p), every valid team size C in the
            placements the topology scheduler tells apart (``Frontier.teams``), with the
            distributed optimizer or Megatron-FSDP (weights sharded too; its per-layer
            gathers charged exposed), no recompute, ``layernorm`` or full recompute of the
            fewest layers k that fit
==========  =====================================================================================

Memory: the planner (``measure.planner``: Megatron's and the plugin's layers under
FakeTensorMode, the device's layers stacked from a plain and a checkpointed probe, the LM head,
model state, reserve and fragmentation). Time: one layer's op trace (``op_trace``) replayed on
the GPU model (``timeline.simulate``), once plain and once inside Megatron's CheckpointFunction,
each alone and as the second layer of a stack (``timeline.layer_in_stack``); a device of L
layers with k checkpointed (the first k) takes k t_ckpt + (L - k) t_plain in the stack, plus
what its first layer alone adds (the host issuing its first ops, nothing before it to
overlap). Under CP > 1 the distributed optimizer's gradient reduce-scatter and parameter all-gather over the CP group are
added, exposed (Megatron-LM's default, no ``--overlap-grad-reduce``). Left out, for every family
alike: the LM head's and the embedding's time (their memory is counted), the optimizer step,
and pipeline bubbles (LLaMA-70B and GPT-175B are planned as one middle pipeline stage of 5 and
1 layers, as METP's Table 3 measures them). Every family is traced on rank 0; METP's balanced layout
gives every rank the same work (``metp plan --timeline`` measures max / mean 1.001 over 8).

MFU counts model FLOPs only (Megatron-LM's formula, ``models.flops``): recompute is not model
FLOPs, and a causal model counts the causal half of the attention scores, as Megatron-LM does.
"""

from __future__ import annotations

import json
import os
import sys
import time
from contextlib import contextmanager
from dataclasses import dataclass, replace
from typing import Dict, List, Optional, Tuple

from megatron_metp.measure.planner import (GIB, SEQ_GRANULE, Planner, PlanSettings, a2a_heads_split,
                                          seq_label)
from megatron_metp.measure.timeline import (ESTIMATE, GPUS, HOST_OP_US, comm_time,
                                            layer_in_stack, tp_comm_overlap)

FAMILIES = ("stock", "metp", "wallfacer")
SELECTIVE = ((), ("layernorm",), ("layernorm", "mlp"), ("layernorm", "core_attn"),
             ("layernorm", "core_attn", "mlp"))
NORMS_ONLY = ((), ("layernorm",))   # "without recompute": nothing beyond the norms
# Megatron-Core 0.16.1's selective ``mlp`` recompute of an MLP with linear biases (BERT-Large,
# GPT-175B; the local spec) never ends its backward: the MLP hands its fc2 bias, a parameter,
# out through CheckpointFunction, and each backward's recompute enters another
# CheckpointFunction backward (seen under FakeTensorMode on CPU). Such models are searched
# without it (their other recompute choices remain); LLaMA's bias-free MLP keeps it.
MLP_RECOMPUTE_WITH_BIAS = "skipped"


# WallFacer's optimizer choices by name: (Megatron-FSDP?, its sharding strategy).
# "distributed": Megatron's distributed optimizer (ZeRO-1: the 12 B of fp32 state sharded);
# "optim_grads": Megatron-FSDP's ZeRO-2 (gradients sharded too, parameters whole: the WallFacer
# paper's sharding); "optim_grads_params": its ZeRO-3 (parameters gathered per layer).
WALLFACER_OPTIMIZERS = {"distributed": (False, "optim_grads_params"),
                        "optim_grads": (True, "optim_grads"),
                        "optim_grads_params": (True, "optim_grads_params")}


def mlp_recompute_hangs(cfg, modules) -> bool:
    """Whether selective ``modules`` include ``mlp`` for an MLP with linear biases (above)."""
    return "mlp" in (modules or ()) and cfg.add_bias_linear


def mlp_recompute_refusal(cfg, modules, flag: str = "--recompute-modules"):
    """The one-line refusal for selective ``mlp`` recompute of ``cfg`` where it never ends
    (:func:`mlp_recompute_hangs`), else None. For the commands that take the modules from the
    user (``metp plan``, ``metp bench --calibrate``), before anything runs."""
    if mlp_recompute_hangs(cfg, modules):
        return (f"{flag} mlp: Megatron-Core's selective mlp recompute of {cfg.name}'s MLP, which "
                f"has linear biases, never finishes its backward here (the fc2 bias leaves "
                f"through CheckpointFunction; megatron_metp/measure/frontier.py); drop mlp for "
                f"this model, as the frontier does")
    return None


@dataclass(frozen=True)
class Variant:
    """One configuration of a family (module docstring)."""

    family: str
    mode: str                       # the planner's mode: tp | metp | wallfacer
    cp: int = 1                     # context-parallel size (tp: its split; wallfacer: p)
    selective: Tuple[str, ...] = ()  # --recompute-modules (selective)
    block: int = 0                  # full recompute of the first k layers (0: none)
    ring_pass: str = ""             # METP attention
    qkv: str = ""
    overlap: bool = False           # --tp-comm-overlap
    cp_comm: str = "p2p"            # stock CP > 1: --cp-comm-type p2p | a2a
    team: int = 1                   # wallfacer: --wallfacer-team-size C
    placement: str = "collective_intra"   # wallfacer: --wallfacer-placement (C > 1)
    # wallfacer: Megatron-FSDP instead of the distributed optimizer (None: as the settings say)
    fsdp: Optional[bool] = None
    # Megatron-FSDP's --data-parallel-sharding-strategy: optim_grads_params | optim_grads
    sharding: str = "optim_grads_params"

    def group(self) -> tuple:
        """Everything but the recompute: the configurations :meth:`Frontier.fastest` weighs
        recompute choices within."""
        return (self.cp, self.cp_comm, self.ring_pass, self.qkv, self.overlap, self.team,
                self.placement, self.fsdp, self.sharding)

    def recompute_flags(self, layers: int) -> List[str]:
        if self.block >= layers:
            return ["--recompute-granularity", "full", "--recompute-method", "uniform",
                    "--recompute-num-layers", "1"]
        if self.block:
            return ["--recompute-granularity", "full", "--recompute-method", "block",
                    "--recompute-num-layers", str(self.block)]
        if self.selective:
            return ["--recompute-granularity", "selective", "--recompute-modules",
                    *self.selective]
        return []

    def flags(self, p: int, layers: int) -> List[str]:
        """Megatron-LM's flags of this configuration (beyond the model's own)."""
        tp = p // self.cp
        if self.family == "wallfacer":
            out = ["--tensor-parallel-mode", "wallfacer", "--tensor-model-parallel-size", str(p),
                   "--wallfacer-team-size", str(self.team)]
            if self.team > 1:
                from megatron_metp.validation import PLACEMENT_ALIASES

                user = {v: k for k, v in PLACEMENT_ALIASES.items()}   # the flag's own names
                out += ["--wallfacer-placement", user.get(self.placement, self.placement)]
            # Megatron-FSDP saves only its own checkpoint format (validate_args asserts it).
            out += (["--use-megatron-fsdp", "--data-parallel-sharding-strategy",
                     self.sharding, "--no-gradient-accumulation-fusion",
                     "--ckpt-format", "fsdp_dtensor"] if self.fsdp
                    else ["--use-distributed-optimizer"])
        elif self.family == "metp":
            out = ["--tensor-parallel-mode", "metp", "--tensor-model-parallel-size", str(tp),
                   "--sequence-parallel", "--metp-ring-pass", self.ring_pass,
                   "--metp-qkv-backward", self.qkv]
            if self.cp > 1:  # METP x CP: its K/V ring over the TP x CP ranks
                out += ["--context-parallel-size", str(self.cp), "--cp-comm-type", "p2p"]
        else:
            out = ["--tensor-model-parallel-size", str(tp)]
            if tp > 1:
                out.append("--sequence-parallel")
            if self.cp > 1:
                out += ["--context-parallel-size", str(self.cp), "--cp-comm-type", self.cp_comm,
                        "--use-distributed-optimizer"]
            if self.overlap:
                out.append("--tp-comm-overlap")
        return out + self.recompute_flags(layers)

    def settings(self, layers: int) -> dict:
        """PlanSettings fields of this configuration (``Planner.plan`` overrides)."""
        kw = dict(context_parallel=self.cp if self.mode != "wallfacer" else 1,
                  cp_comm_type=self.cp_comm,
                  recompute_granularity=None, recompute_modules=None,
                  recompute_method="block", recompute_num_layers=1)
        if self.block:
            kw.update(recompute_granularity="full", recompute_num_layers=min(self.block, layers))
        elif self.selective:
            kw.update(recompute_granularity="selective", recompute_modules=list(self.selective))
        if self.mode == "metp":
            kw.update(metp_ring_pass=self.ring_pass, metp_qkv_backward=self.qkv)
        if self.mode == "wallfacer":
            kw.update(wallfacer_team=self.team, wallfacer_placement=self.placement)
            if self.fsdp is not None:
                kw.update(megatron_fsdp=self.fsdp, fsdp_sharding=self.sharding)
        return kw


def _divisors(p: int) -> List[int]:
    return [d for d in range(1, p + 1) if p % d == 0]


class Frontier:
    """Plans and times configurations (memory and time cached per probe)."""

    def __init__(self, settings: Optional[PlanSettings] = None, gpus=("H100",),
                 host_op_s: float = HOST_OP_US * 1e-6, gpus_per_node: int = 8, progress=None,
                 stock_overlap: bool = True, wallfacer_fsdp: bool = False,
                 wallfacer_optimizers: Optional[Tuple[str, ...]] = None):
        self.settings = settings or PlanSettings()
        self.planner = Planner(self.settings)
        self.gpus = tuple(gpus)
        self.machines = {g: replace(GPUS[g], efficiency=self.settings.efficiency,
                                    attention_efficiency=self.settings.attention_efficiency,
                                    gpus_per_node=gpus_per_node, host_op_s=host_op_s).per_gpu()
                         for g in self.gpus}
        self._times: Dict[tuple, Dict[str, Dict[str, float]]] = {}
        self.progress = progress or (lambda msg: None)
        self.probes = 0
        self.stock_overlap = stock_overlap  # stock's --tp-comm-overlap among its choices
        self.gpus_per_node = gpus_per_node
        self.wallfacer_fsdp = wallfacer_fsdp  # WallFacer under Megatron-FSDP among its choices
        # WallFacer's optimizers, by name (WALLFACER_OPTIMIZERS); None: by wallfacer_fsdp
        self.wallfacer_optimizers = wallfacer_optimizers

    # ---- the configurations -------------------------------------------------------------

    def base_variants(self, cfg, family: str, p: int) -> List[Variant]:
        """The family's configurations without full recompute (module docstring)."""
        if family == "stock":
            out = []
            for cp in _divisors(p):
                tp = p // cp
                if cfg.num_attention_heads % tp or cfg.num_query_groups % tp:
                    continue
                comms = ["p2p", "a2a"] if a2a_heads_split(cfg, tp, cp) else ["p2p"]
                for comm in comms:
                    for sel in SELECTIVE:
                        if mlp_recompute_hangs(cfg, sel):
                            continue  # MLP_RECOMPUTE_WITH_BIAS
                        out.append(Variant("stock", "tp", cp, sel, cp_comm=comm))
                        if tp > 1 and self.stock_overlap:
                            out.append(Variant("stock", "tp", cp, sel, overlap=True,
                                               cp_comm=comm))
            return out
        if family == "metp":
            if cfg.num_query_groups % p:  # each ring rank owns whole query groups
                return []
            choices = self.planner.metp_choices(cfg, "metp", p, 0, kept_weights=True)
            return [Variant("metp", "metp", 1, sel, ring_pass=r, qkv=q)
                    for r, q in choices for sel in NORMS_ONLY]
        return [Variant("wallfacer", "wallfacer", p, sel, team=c, placement=pl, fsdp=f,
                        sharding=sh)
                for c, pl in self.teams(p) for f, sh in self._fsdp_choices()
                for sel in NORMS_ONLY]

    def teams(self, p: int) -> List[Tuple[int, str]]:
        """WallFacer's (team size, placement) choices at p: every valid C, each in the
        placements the topology scheduler tells apart (``wallfacer.scheduler.candidates``);
        where both placements keep the teams and the sub-rings on the same side of the node
        boundary (``scheduler.locality``) they time alike and the first stands for both."""
        from megatron_metp.wallfacer.scheduler import candidates, locality

        out, seen = [], set()
        for c, pl in candidates(p):
            where = (c, tuple(sorted(locality(p, c, pl, self.gpus_per_node).items())))
            if where not in seen:
                seen.add(where)
                out.append((c, pl))
        return out

    def _fsdp_choices(self) -> List[Tuple[Optional[bool], str]]:
        """WallFacer's (Megatron-FSDP?, its sharding strategy) choices."""
        if self.wallfacer_optimizers is not None:
            return [WALLFACER_OPTIMIZERS[name] for name in self.wallfacer_optimizers]
        names = ("distributed", "optim_grads_params") if self.wallfacer_fsdp else (None,)
        return [WALLFACER_OPTIMIZERS.get(n, (None, "optim_grads_params")) for n in names]

    def frugal(self, cfg, family: str, p: int) -> List[Variant]:
        """The configurations that need the least memory: full recompute of every layer, and
        the norms' recompute alone (a device of one layer, GPT-175B's stage, gains nothing
        from full recompute: its recompute's working set can exceed what it saves), for METP
        with its most frugal attention, for stock at every TP x CP split and CP comm type."""
        L = cfg.layers_per_device
        norms = NORMS_ONLY[1]
        if family == "stock":
            splits = [(v.cp, v.cp_comm) for v in self.base_variants(cfg, family, p)
                      if not v.selective and not v.overlap]
            return [Variant("stock", "tp", cp, block=L, cp_comm=c) for cp, c in splits] + \
                [Variant("stock", "tp", cp, norms, cp_comm=c) for cp, c in splits]
        if family == "metp":
            if cfg.num_query_groups % p:
                return []
            r, q = self.planner.metp_choices(cfg, "metp", p, 0)[-1]
            return [Variant("metp", "metp", 1, block=L, ring_pass=r, qkv=q),
                    Variant("metp", "metp", 1, norms, ring_pass=r, qkv=q)]
        # C = 1 only: a team of C holds C - 1 more query/key/value shards and partial outputs
        # than ring attention at the same length, so it is never the longer.
        return [Variant("wallfacer", "wallfacer", p, sel, block=k, fsdp=f, sharding=sh)
                for f, sh in self._fsdp_choices() for sel, k in (((), L), (norms, 0))]

    # ---- memory and time ------------------------------------------------------------------

    def plan(self, cfg, v: Variant, p: int, s: int):
        self.probes += 1
        return self.planner.plan(cfg, v.mode, p, s, **v.settings(cfg.layers_per_device))

    def layer_times(self, cfg, v: Variant, p: int, s: int, full: bool) -> Dict[str, tuple]:
        """ESTIMATED seconds of one layer per GPU, ``(first, steady)`` (``timeline.
        layer_in_stack``: alone, and in a stack): plain (with ``v``'s selective recompute) or
        inside Megatron's CheckpointFunction (``full``)."""
        from megatron_metp.measure.op_trace import trace_layer
        from megatron_metp.measure.planner import chains_layers

        sel = () if full else v.selective
        b = self.settings.micro_batch
        key = (cfg.name, v.mode, p, s, v.cp, sel, full, v.ring_pass, v.qkv, v.cp_comm, v.team,
               v.placement, b, self.settings.grad_reduce_in_bf16)
        if key not in self._times:
            # On the planner's own fake world (rank 0): every rank runs the same work in these
            # layouts (module docstring), and one world set up at a time. One trace serves with
            # and without --tp-comm-overlap (a rewrite of the same ops).
            kw = dict(world=self.planner.world, micro_batch=b,
                      recompute_modules=list(sel) or None,
                      ring_pass=v.ring_pass or "auto", qkv_backward=v.qkv or "recompute",
                      cp=v.cp if v.mode != "wallfacer" else 1, full_recompute=full,
                      cp_comm_type=v.cp_comm, team_size=v.team, placement=v.placement)
            with self.settings.main_grads():   # --grad-reduce-in-bf16: bf16 reductions
                ops = trace_layer(cfg, v.mode, p, s, **kw)
                # Layers that hand work to the next are traced as a stack of two as well.
                two = trace_layer(cfg, v.mode, p, s, layers=2, **kw) if chains_layers(
                    cfg, v.mode, p, s, self.settings.micro_batch, full) else None
            over = tp_comm_overlap(ops) if v.mode == "tp" and p // v.cp > 1 else ops
            self._times[key] = {
                False: {g: layer_in_stack(ops, m, two) for g, m in self.machines.items()},
                True: {g: layer_in_stack(over, m, two if over is ops else None)
                       for g, m in self.machines.items()}}
        return self._times[key][v.overlap]

    @contextmanager
    def using(self, **fields):
        """Plan and time with these PlanSettings ``fields`` inside the block (``micro_batch``,
        ``data_parallel``, ...; memory and traces are cached per micro-batch size)."""
        saved = self.settings
        self.settings = self.planner.settings = replace(saved, **fields)
        try:
            yield self
        finally:
            self.settings = self.planner.settings = saved

    def stack_times(self, cfg, v: Variant, p: int, s: int) -> Dict[str, float]:
        """ESTIMATED seconds per GPU of one micro-batch through the device's layers, forward
        and backward, without the optimizer's communication (module docstring)."""
        L = cfg.layers_per_device
        k = min(v.block, L)
        plain = self.layer_times(cfg, v, p, s, False) if k < L else None
        ckpt = self.layer_times(cfg, v, p, s, True) if k else None
        out = {}
        for g in self.machines:
            # The stack's first layer is a checkpointed one where any is (the block method
            # checkpoints the first k): it pays what one layer alone adds to a steady one.
            first, steady = (ckpt if k else plain)[g]
            out[g] = first - steady + (L - k) * (plain[g][1] if plain else 0.0) + \
                k * (ckpt[g][1] if ckpt else 0.0)
        return out

    def step_times(self, cfg, v: Variant, p: int, s: int, params_per_rank: int
                   ) -> Dict[str, float]:
        """ESTIMATED step seconds per GPU of the device's layers (module docstring)."""
        stack = self.stack_times(cfg, v, p, s)
        out = {}
        cp = v.cp
        gb = self.settings.grad_bytes   # fp32 gradients, bf16 under --grad-reduce-in-bf16
        for g, m in self.machines.items():
            t = stack[g]
            if cp > 1 and v.fsdp:
                # Megatron-FSDP: per layer, the bf16 parameters all-gathered for the forward
                # and again for the backward (optim_grads_params; optim_grads gathers them once,
                # after the optimizer step), the fp32 gradient reduce-scattered; charged
                # exposed (Megatron-FSDP prefetches them behind compute: an upper bound).
                link = m.link(cp)
                gathers = 1 if v.sharding == "optim_grads" else 2
                t += gathers * comm_time("all_gather", 2 * params_per_rank, cp, link)
                t += comm_time("reduce_scatter", gb * params_per_rank, cp, link)
            elif cp > 1:  # distributed optimizer over CP: fp32 gradient RS + bf16 parameter AG
                link = m.link(cp)
                t += comm_time("reduce_scatter", gb * params_per_rank, cp, link)
                t += comm_time("all_gather", 2 * params_per_rank, cp, link)
            out[g] = t
        return out

    def fewest_blocks(self, cfg, v: Variant, p: int, s: int):
        """Full recompute of the fewest first layers k (``--recompute-method block``) for which
        ``v`` fits at s: (k, point), or None when even every layer does not."""
        L = cfg.layers_per_device
        lo, hi = 1, L
        top = self.plan(cfg, replace(v, block=L), p, s)
        if not top.fits:
            return None
        best = (L, top)
        while lo < hi:  # need falls as k grows: the fewest k that fits
            mid = (lo + hi) // 2
            pt = self.plan(cfg, replace(v, block=mid), p, s)
            if pt.fits:
                best, hi = (mid, pt), mid
            else:
                lo = mid + 1
        return best

    def row(self, cfg, v: Variant, p: int, s: int, point, gpu: str) -> dict:
        from megatron_metp.measure.timeline_report import _flop_model
        from megatron_metp.models.flops import training_flops

        L = cfg.layers_per_device
        step = self.step_times(cfg, v, p, s, point.params_per_rank)[gpu] if point.fits else None
        model_flops = training_flops(_flop_model(cfg), self.settings.micro_batch, s) * L / p
        m = self.machines[gpu]
        return dict(model=cfg.name, p=p, gpu=gpu, seq_length=s, family=v.family,
                    flags=" ".join(v.flags(p, L) + (["--grad-reduce-in-bf16"] if
                                                    self.settings.grad_reduce_in_bf16 else [])),
                    fits=bool(point.fits),
                    step_ms=step * 1e3 if step else None,
                    tokens_per_s=s * self.settings.micro_batch / step if step else None,
                    mfu=model_flops / step / m.peak_flops if step else None,
                    memory_gib=point.needed_bytes / GIB, fastest=False,
                    layers=L, context_parallel=v.cp, recompute=" ".join(v.recompute_flags(L)),
                    tp_comm_overlap=v.overlap, metp_attention=(
                        f"{v.ring_pass}/{v.qkv}" if v.family == "metp" else ""),
                    team_size=v.team if v.family == "wallfacer" else None,
                    megatron_fsdp=bool(v.fsdp))

    # ---- the search -------------------------------------------------------------------------

    def fastest(self, cfg, family: str, p: int, s: int, cost=None, bases=None
                ) -> Dict[str, tuple]:
        """The family's fastest configuration that fits at s on each GPU: {gpu: (variant,
        point)}; {} when none fits. ``cost(variant, point)``: seconds per GPU to rank them by
        (default :meth:`step_times`); ``bases``: the configurations to search instead of
        :meth:`base_variants`."""
        fitting = []  # (time, variant, point)
        cost = cost or (lambda v, pt: self.step_times(cfg, v, p, s, pt.params_per_rank))
        bases = self.base_variants(cfg, family, p) if bases is None else bases
        groups: Dict[tuple, List[Variant]] = {}
        for v in bases:  # one group per attention / TP x CP / CP comm / overlap choice
            groups.setdefault(v.group(), []).append(v)
        for members in groups.values():
            fit_sets: List[set] = []
            for v in members:  # SELECTIVE order: less recompute first
                # Recomputing a superset of what already fits only adds time: skip it.
                if any(set(v.selective) >= f for f in fit_sets):
                    continue
                pt = self.plan(cfg, v, p, s)
                if pt.fits:
                    fit_sets.append(set(v.selective))
                    fitting.append((cost(v, pt), v, pt))
            # Full recompute of the fewest layers that fit, unless the norms alone already fit
            # (one more forward of k layers costs more than the norms' recompute).
            if any(f <= set(NORMS_ONLY[1]) for f in fit_sets):
                continue
            got = self.fewest_blocks(cfg, replace(members[0], selective=()), p, s)
            if got:
                k, pt = got
                w = replace(members[0], selective=(), block=k)
                fitting.append((cost(w, pt), w, pt))
        out = {}
        for g in self.gpus:
            if fitting:
                _, v, pt = min(fitting, key=lambda f: f[0][g])
                out[g] = (v, pt)
        return out

    def longest(self, cfg, family: str, p: int, variants=None):
        """The family's longest sequence (multiple of 1024 tokens) and its configuration:
        the most frugal configurations' longest (``Planner.longest_sequence``); ``variants``:
        those to search instead of :meth:`frugal`'s."""
        best = None

        def tick(s, pt):
            self._tick(cfg, family, p, s, "longest: probing whether it fits at")

        for v in self.frugal(cfg, family, p) if variants is None else variants:
            # Only a longer sequence can replace the best so far, and a need grows with s: the
            # search starts one granule beyond it, where a configuration that does not fit is
            # done in one probe (longest_sequence returns None).
            lo = 4096 if best is None else best[1].seq_length + SEQ_GRANULE
            pt = self.planner.longest_sequence(cfg, v.mode, p, lo=lo, progress=tick,
                                               **v.settings(cfg.layers_per_device))
            if pt is not None and (best is None or pt.seq_length > best[1].seq_length):
                best = (v, pt)
        return best

    def _tick(self, cfg, family, p, s, what) -> None:
        self.probes += 1
        self.progress(f"{cfg.name} p={p} {family}: {what} s={seq_label(s)}")


def seq_grid(limit: int, lo: int = 4096) -> List[int]:
    """Powers of two from ``lo`` up to ``limit``."""
    out, s = [], lo
    while s <= limit:
        out.append(s)
        s *= 2
    return out


def plan_model(fr: "Frontier", cfg, p: int, families, seqs: Optional[List[int]], log,
               t_all: float, index: int, count: int, search_longest: bool = True
               ) -> Tuple[List[dict], List[dict]]:
    """One model at one p: each family's longest sequence (unless ``search_longest`` is false
    and ``seqs`` are given), then the fastest configuration of each family at every length of
    the grid. Returns ``(rows, longest)``, the frontier's entries for this model and p
    (``run_frontier`` joins them in model, then p, order). ``log`` takes the per-model lines,
    ``fr.progress`` the others."""
    t0 = time.time()
    search_longest = search_longest or seqs is None
    log(f"[metp plan --frontier {time.time() - t_all:5.0f} s] model {index + 1}/{count} "
        f"{cfg.name} p={p}: " + ("longest sequence per family" if search_longest
                                 else f"{len(seqs)} lengths"))
    limits, longest, rows = {}, [], []
    for fam in families if search_longest else ():
        got = fr.longest(cfg, fam, p)
        if got:
            v, pt = got
            limits[fam] = pt.seq_length
            longest.append(dict(model=cfg.name, p=p, family=fam, seq_length=pt.seq_length,
                                flags=" ".join(v.flags(p, cfg.layers_per_device))))
    top = max(limits.values(), default=0)
    grid = (sorted(set(seq_grid(top)) | set(limits.values())) if seqs is None
            else sorted(seqs))
    if search_longest:
        log(f"[metp plan --frontier {time.time() - t_all:5.0f} s] {cfg.name} p={p}: longest "
            + ", ".join(f"{f} {seq_label(s)}" for f, s in limits.items())
            + f"; {len(grid)} lengths to plan")
    for j, s in enumerate(grid):
        here = []
        for fam in families:
            if search_longest and s > limits.get(fam, 0):
                continue
            fr.progress(f"{cfg.name} p={p} s={seq_label(s)} ({j + 1}/{len(grid)}) {fam}")
            for g, (v, pt) in fr.fastest(cfg, fam, p, s).items():
                here.append(fr.row(cfg, v, p, s, pt, g))
        for g in fr.gpus:
            mine = [r for r in here if r["gpu"] == g and r["fits"]]
            if mine:
                min(mine, key=lambda r: r["step_ms"])["fastest"] = True
        rows += here
    log(f"[metp plan --frontier {time.time() - t_all:5.0f} s] {cfg.name} p={p} done in "
        f"{time.time() - t0:.0f} s ({fr.probes} probes so far)")
    return rows, longest


def _stderr(msg: str) -> None:
    print(msg, file=sys.stderr, flush=True)


def _throttled(log, t_all: float):
    """A progress line at most once a second (the per-model lines go through ``log``)."""
    last = [0.0]

    def progress(msg):
        if time.time() - last[0] >= 1.0:
            last[0] = time.time()
            log(f"[metp plan --frontier {time.time() - t_all:5.0f} s] {msg}")
    return progress


def _plan_model_in_worker(task) -> Tuple[List[dict], List[dict]]:
    """``run_frontier(jobs > 1)``: one (model, p) in a worker process of its own, with its own
    Frontier and fake process group (torn down before it returns)."""
    import warnings

    from megatron_metp.measure.planner import quiet_megatron

    (cfg, p, gpus, settings, host_op_s, gpus_per_node, families, seqs, t_all, index,
     count, search_longest) = task
    warnings.filterwarnings("ignore")
    fr = Frontier(settings, gpus, host_op_s, gpus_per_node, _throttled(_stderr, t_all),
                  wallfacer_fsdp=True)
    try:
        with quiet_megatron():
            rows, longest = plan_model(fr, cfg, p, families, seqs, _stderr, t_all, index,
                                       count, search_longest)
    finally:
        fr.planner.world.teardown()
    return rows, longest


def _exit_with_parent(parent: int, poll_s: float = 0.5) -> None:
    """End this process as soon as its parent ``parent`` (the pid it was started by, passed
    in: a parent that died while this one was still importing has already handed it to
    another) is gone, killed outright too (SIGTERM runs none of the parent's clean-up): a
    worker never outlives its ``metp plan``."""
    import threading

    def watch():
        while os.getppid() == parent:
            time.sleep(poll_s)
        os._exit(1)

    threading.Thread(target=watch, daemon=True).start()


def _worker(conn, task, parent: int) -> None:
    """A worker process: plans ``task`` and sends ``("ok", (rows, longest))`` or
    ``("error", text)`` back. Ctrl-C is the parent's to handle: it stops the workers; a parent
    that dies without stopping them ends them too (:func:`_exit_with_parent`)."""
    import signal
    import traceback

    signal.signal(signal.SIGINT, signal.SIG_IGN)
    _exit_with_parent(parent)
    try:
        conn.send(("ok", _plan_model_in_worker(task)))
    except BaseException as e:  # reported to the parent, which raises it
        conn.send(("error", f"{type(e).__name__}: {e}\n{traceback.format_exc()}"))
    finally:
        conn.close()


def _in_workers(tasks, jobs: int) -> List[Tuple[List[dict], List[dict]]]:
    """Each task in a spawned process of its own, at most ``jobs`` at once; the results in
    the tasks' order. A worker that fails, or exits without a result (killed, out of memory),
    stops the others and raises here, naming its model and p; so does Ctrl-C. No process
    outlives the call."""
    import multiprocessing

    ctx = multiprocessing.get_context("spawn")
    results: List = [None] * len(tasks)
    todo, running = list(range(len(tasks))), {}

    def name(k):
        return f"model {tasks[k][0].name} p={tasks[k][1]}"

    try:
        while todo or running:
            while todo and len(running) < jobs:
                k = todo.pop(0)
                recv, send = ctx.Pipe(duplex=False)
                proc = ctx.Process(target=_worker, args=(send, tasks[k], os.getpid()),
                                   daemon=True)
                proc.start()
                send.close()
                running[k] = (proc, recv)
            for k, (proc, recv) in list(running.items()):
                alive = proc.is_alive()  # before poll: a result sent before exiting is seen
                if not recv.poll():
                    if alive:
                        continue
                    status = None
                else:
                    try:
                        status, got = recv.recv()
                    except EOFError:  # closed without a result
                        status = None
                if status is None:
                    proc.join(5)
                    got = f"exited with code {proc.exitcode} and no result"
                if status != "ok":
                    raise RuntimeError(f"metp plan --frontier worker ({name(k)}): {got}")
                results[k] = got
                proc.join()
                recv.close()
                del running[k]
            time.sleep(0.1)
    finally:
        for proc, recv in running.values():
            proc.terminate()
        for proc, recv in running.values():
            proc.join()
            recv.close()
    return results


def run_frontier(cfgs, ps, gpus, settings: PlanSettings, host_op_s: float, gpus_per_node: int,
                 families=FAMILIES, log=None, seqs: Optional[List[int]] = None,
                 jobs: int = 1, longest: bool = True) -> dict:
    """The frontier of every model and p (module docstring): the JSON document. ``seqs``:
    the lengths to plan instead of the powers of two up to the longest (each family's longest
    is still searched where ``longest``, and a family is then planned only at lengths it
    fits; without it a length where none of a family's configurations fits has no row). ``jobs`` > 1: the
    (model, p) pairs are planned in that many worker processes (spawned; each plans a pair
    with a Frontier of its own, as a separate ``metp plan --frontier`` would), and their
    entries joined in the same order: the same document as one process gives, but for
    ``seconds``. A failing worker stops the others. ``log``: where one process writes its
    progress (stderr by default); workers write theirs to stderr."""
    log = log or _stderr
    t_all = time.time()
    units = [(i, cfg, p) for i, cfg in enumerate(cfgs) for p in ps]
    rows, longest = [], []
    if jobs <= 1 or len(units) <= 1:
        fr = Frontier(settings, gpus, host_op_s, gpus_per_node, _throttled(log, t_all),
                      wallfacer_fsdp=True)
        try:
            for i, cfg, p in units:
                r, lg = plan_model(fr, cfg, p, families, seqs, log, t_all, i, len(cfgs),
                                   longest)
                rows += r
                longest += lg
        finally:
            fr.planner.world.teardown()
    else:
        tasks = [(cfg, p, tuple(gpus), settings, host_op_s, gpus_per_node, tuple(families), seqs,
                  t_all, i, len(cfgs), longest) for i, cfg, p in units]
        for r, lg in _in_workers(tasks, jobs):  # in (model, p) order
            rows += r
            longest += lg
    return dict(label=ESTIMATE, settings=settings_record(settings, host_op_s),
                frontier=rows, longest=longest, seconds=time.time() - t_all)


def settings_record(settings: PlanSettings, host_op_s: float) -> dict:
    """The planning settings a frontier document records beside its rows."""
    return dict(memory_gib=settings.memory_gib, reserve_gib=settings.reserve_gib,
                fragmentation=settings.fragmentation, efficiency=settings.efficiency,
                attention_efficiency=settings.attention_efficiency,
                host_op_us=host_op_s * 1e6,
                **({"grad_reduce_in_bf16": True} if settings.grad_reduce_in_bf16 else {}),
                **({"communicator_gib": settings.communicator_gib}
                   if settings.communicator_gib else {}))


# ---- reports ---------------------------------------------------------------------------------


def markdown(doc: dict) -> str:
    rows = doc["frontier"]
    out = ["ESTIMATE: step times simulated (megatron_metp/measure/timeline.py), not measured on "
           "a GPU; memory planned under FakeTensorMode (megatron_metp/measure/planner.py). "
           "Step = the device's layers, LM head and optimizer left out for every family; MFU = "
           "model FLOPs (causal half, no recompute) / (step x peak). ★ = the fastest that fits "
           "at that length.\n",
           "| model | p | GPU | s | family | step ms | tokens/s | MFU | GiB | flags |",
           "|---|---:|---|---:|---|---:|---:|---:|---:|---|"]
    for r in rows:
        out.append(f"| {r['model']} | {r['p']} | {r['gpu']} | {seq_label(r['seq_length'])} | "
                   f"{r['family']}{' ★' if r['fastest'] else ''} | {r['step_ms']:,.1f} | "
                   f"{r['tokens_per_s']:,.0f} | {r['mfu']:.1%} | {r['memory_gib']:.1f} | "
                   f"`{r['flags']}` |")
    out.append("\n### METP against stock's best that fits (speed-up > 1: METP faster)\n")
    out.append(lead_markdown(doc))
    out.append("\n### Longest sequence per family\n")
    out.append("| model | p | family | longest | flags |")
    out.append("|---|---:|---|---:|---|")
    for r in doc["longest"]:
        out.append(f"| {r['model']} | {r['p']} | {r['family']} | {seq_label(r['seq_length'])} | "
                   f"`{r['flags']}` |")
    return "\n".join(out)


def _norms_only(recompute: str) -> bool:
    """No recompute beyond the norms (the frontier's "without recompute")."""
    return recompute in ("", "--recompute-granularity selective --recompute-modules layernorm")


def lead(doc: dict) -> List[dict]:
    """METP against stock's best at every planned length, per (model, p, GPU): the speed-up
    (stock's fastest fitting step / METP's), the band (stock fits without recompute, stock
    must recompute, only METP fits) and the longest sequences' ratio."""
    out = []
    rows = doc["frontier"]
    longest = {(r["model"], r["p"], r["family"]): r["seq_length"] for r in doc["longest"]}
    for key in sorted({(r["model"], r["p"], r["gpu"]) for r in rows}):
        mine = [r for r in rows if (r["model"], r["p"], r["gpu"]) == key]
        by = {(r["family"], r["seq_length"]): r for r in mine}
        for s in sorted({r["seq_length"] for r in mine}):
            stock, metp = by.get(("stock", s)), by.get(("metp", s))
            if metp is None:
                continue
            band = ("only METP fits" if stock is None else
                    "stock fits without recompute" if _norms_only(stock["recompute"]) else
                    "stock must recompute")
            out.append(dict(model=key[0], p=key[1], gpu=key[2], seq_length=s, band=band,
                            stock_flags=stock["flags"] if stock else None,
                            stock_ms=stock["step_ms"] if stock else None,
                            metp_ms=metp["step_ms"], metp_flags=metp["flags"],
                            speedup=stock["step_ms"] / metp["step_ms"] if stock else None,
                            longest_ratio=longest.get((key[0], key[1], "metp"), 0)
                            / max(longest.get((key[0], key[1], "stock"), 1), 1)))
    return out


def lead_markdown(doc: dict) -> str:
    out = ["| model | GPU | s | band | stock's best (flags) | stock ms | METP ms | METP "
           "speed-up |", "|---|---|---:|---|---|---:|---:|---:|"]
    for r in lead(doc):
        sp = f"{r['speedup']:.2f}x" if r["speedup"] else "-"
        st = f"{r['stock_ms']:,.1f}" if r["stock_ms"] else "does not fit"
        flags = r["stock_flags"] or ""
        short = (flags.replace("--tensor-model-parallel-size ", "TP ")
                 .replace(" --sequence-parallel", "").replace("--context-parallel-size ", "CP ")
                 .replace(" --cp-comm-type p2p --use-distributed-optimizer", " p2p")
                 .replace(" --cp-comm-type a2a --use-distributed-optimizer", " a2a")
                 .replace("--recompute-granularity ", "").replace("--recompute-modules ", "")
                 .replace("--recompute-method ", "").replace("--recompute-num-layers ", "")
                 .replace("--tp-comm-overlap", "overlap"))
        out.append(f"| {r['model']} | {r['gpu']} | {seq_label(r['seq_length'])} | {r['band']} "
                   f"| {short} | {st} | {r['metp_ms']:,.1f} | {sp} |")
    return "\n".join(out)


def svg(doc: dict, path: str) -> None:
    """Tokens/s against s (log axes), one line per family ending at its longest sequence, one
    panel per (model, p, GPU): a dependency-free SVG titled ESTIMATE."""
    from megatron_metp.measure import svg_plot

    rows = doc["frontier"]
    panels = []
    for model, p, gpu in sorted({(r["model"], r["p"], r["gpu"]) for r in rows}):
        pr = [r for r in rows if (r["model"], r["p"], r["gpu"]) == (model, p, gpu)]
        lines = [svg_plot.Line(fam, svg_plot.COLOURS[fam], sorted(
            (r["seq_length"], r["tokens_per_s"]) for r in pr
            if r["family"] == fam and r["tokens_per_s"])) for fam in FAMILIES]
        panels.append(svg_plot.Panel(f"ESTIMATE {model}, p={p}, {gpu}", lines))
    svg_plot.write(path, "ESTIMATE (simulated, not measured): tokens/s of the fastest "
                   "configuration that fits, per family", panels, "tokens/s (log)")


def write(doc: dict, json_path: Optional[str], svg_path: Optional[str]) -> None:
    if json_path:
        os.makedirs(os.path.dirname(os.path.abspath(json_path)), exist_ok=True)
        with open(json_path, "w") as f:
            json.dump(doc, f, indent=1)
    if svg_path:
        os.makedirs(os.path.dirname(os.path.abspath(svg_path)), exist_ok=True)
        svg(doc, svg_path)


__all__ = ["FAMILIES", "Variant", "Frontier", "run_frontier", "markdown", "svg", "write", "lead",
           "lead_markdown", "seq_grid"]
