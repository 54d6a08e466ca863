"""``--tensor-parallel-mode auto``: the fastest configuration that fits, chosen from the same
frontier as ``metp plan --frontier`` (:mod:`megatron_metp.measure.frontier`), stock's own
choices included.

At the run's parallel size p (``--tensor-model-parallel-size``), sequence length, micro batch,
GPU memory, GPU kind and node layout, each family's fastest configuration that fits:

* ``stock``: Megatron-Core's own modules with every TP x CP split of p the head counts allow
  (CP > 1: ``--cp-comm-type p2p``, or ``a2a`` where the heads split over CP, and the
  distributed optimizer), each selective recompute and
  full recompute of the fewest layers that fit; ``--tp-comm-overlap`` only where the route can
  run it (Megatron-LM's loop with Transformer Engine on a GPU);
* ``metp``: each METP attention choice, no recompute, the norms' or full recompute of the
  fewest layers that fit;
* ``wallfacer``: CP = p, every valid team size C (``frontier.Frontier.teams``), distributed
  optimizer.

Memory is the planner's (FakeTensorMode, as ``metp plan``); every time is the timeline model's
ESTIMATE (``measure.timeline``), the one estimator ``metp plan`` prints. The choice is the
fastest, except that where stock fits a plugin family must be estimated faster than stock by
more than the model's measured error in its favour (``fitted.AUTO_LEAD_MARGIN``, 1.10: the
H200 calibration found the model 6-16 % optimistic for METP), else stock is kept; ties go to
stock, then metp. Where stock wins, auto says so and keeps ``--tensor-parallel-mode tp`` with
stock's flags. The winner's Megatron-LM flags are printed and
set in the run's arguments (:func:`apply`), replacing the parallel, recompute and METP
attention flags given. When nothing fits, :func:`choose` names each family's longest sequence.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Dict, List, Optional, Tuple

from megatron_metp.measure.fitted import AUTO_LEAD_MARGIN
from megatron_metp.measure.planner import GIB, PlanSettings, quiet_megatron, seq_label

FAMILY_MODE = {"stock": "tp", "metp": "metp", "wallfacer": "wallfacer"}


@dataclass
class Choice:
    family: str                    # stock | metp | wallfacer
    flags: List[str]               # Megatron-LM's flags of the configuration
    variant: object = None         # frontier.Variant
    row: Optional[dict] = None     # frontier.Frontier.row (ESTIMATED step, memory)
    split: object = None           # cluster.Split: the job's DP and micro-batch (choose_job)

    @property
    def mode(self) -> str:
        return FAMILY_MODE[self.family]


def local_world_size(world_size: int) -> int:
    """GPUs per node of the run being started: torchrun's ``LOCAL_WORLD_SIZE``, else SLURM's
    ``SLURM_NTASKS_PER_NODE`` (one task per GPU), else one node of up to 8 GPUs."""
    import os

    for key in ("LOCAL_WORLD_SIZE", "SLURM_NTASKS_PER_NODE"):
        got = os.environ.get(key, "").split("(")[0]   # SLURM may write "8(x4)"
        if got.isdigit() and int(got) > 0:
            return int(got)
    return min(world_size, 8)


def _frontier(settings: PlanSettings, gpu: str, gpus_per_node: int, tp_comm_overlap: bool):
    from megatron_metp.measure.frontier import Frontier

    return Frontier(settings, gpus=(gpu,), gpus_per_node=gpus_per_node,
                    stock_overlap=tp_comm_overlap)


def _table(head: List[str], cells, rows: Dict[str, Optional[dict]],
           chosen: Optional[Choice]) -> str:
    """A markdown table of each family's row: ``head`` the columns after the family's (one of
    them the flags', "fastest ..."), ``cells(row)`` a row's cells; no row: nothing fits."""
    flags = next(i for i, h in enumerate(head) if h.startswith("fastest"))
    out = ["| family | " + " | ".join(head) + " |",   # numbers after the flags, right-aligned
           "|---|" + "|".join("---:" if i > flags else "---" for i in range(len(head))) + "|"]
    for fam, r in rows.items():
        if r is None:
            blank = ["-"] * len(head)
            blank[flags] = "nothing fits"
            out.append(f"| {fam} | " + " | ".join(blank) + " |")
            continue
        mark = " **chosen**" if chosen is not None and chosen.family == fam else ""
        out.append(f"| {fam}{mark} | " + " | ".join(cells(r)) + " |")
    return "\n".join(out)


def table(rows: Dict[str, Optional[dict]], chosen: Optional[Choice], gpu: str) -> str:
    """Each family's fastest configuration of one model-parallel group (frontier rows)."""
    return _table(["fastest configuration that fits (Megatron-LM flags)", "needs GiB",
                   f"step ms ({gpu} ESTIMATE)", "tokens/s"],
                  lambda r: [f"`{r['flags']}`", f"{r['memory_gib']:.1f}",
                             f"{r['step_ms']:,.3f}", f"{r['tokens_per_s']:,.0f}"], rows, chosen)


def job_table(rows: Dict[str, Optional[dict]], chosen: Optional[Choice], gpu: str) -> str:
    """Each family's fastest configuration of a job (cluster rows)."""
    return _table(["TP x CP x DP, micro-batch",
                   "fastest configuration that fits (Megatron-LM flags)", "needs GiB",
                   f"step ms ({gpu} ESTIMATE)", "tokens/s per GPU", "MFU"],
                  lambda r: [f"{r['tp']} x {r['cp']} x {r['dp']}, {r['micro_batch']}",
                             f"`{r['flags']}`", f"{r['memory_gib']:.1f}",
                             f"{r['step_ms']:,.3f}", f"{r['tokens_per_s_per_gpu']:,.0f}",
                             f"{r['mfu']:.1%}"], rows, chosen)


def _rule(choices: Dict[str, Choice], margin: float) -> Tuple[Choice, str, str]:
    """The choice among each family's fastest (module docstring): (the chosen, the words that
    say why, the others' times). ``min`` keeps the first of equals: stock, metp, wallfacer."""
    fastest = min(choices.values(), key=lambda c: c.row["step_ms"])
    stock = choices.get("stock")
    inside = (stock is not None and fastest is not stock
              and fastest.row["step_ms"] * margin > stock.row["step_ms"])
    chosen = stock if inside else fastest
    rest = ", ".join(f"{c.family} {c.row['step_ms']:,.3f} ms" for c in choices.values()
                     if c is not chosen)
    if inside:
        lead = stock.row["step_ms"] / fastest.row["step_ms"]
        keeps = (" (auto keeps --tensor-parallel-mode tp): "
                 f"{fastest.family} is estimated {lead:.3f}x faster, inside the "
                 f"timeline's measured error in its favour (auto asks for "
                 f"{margin:.2f}x; docs/calibration/README.md); stock's estimate")
    else:
        keeps = (" (stock Megatron-Core is fastest here: auto keeps "
                 "--tensor-parallel-mode tp): the fastest estimate"
                 if chosen.family == "stock" else ": the fastest estimate")
    return chosen, keeps, rest


def choose(cfg, p: int, s: int, *, micro_batch: int = 1, memory_gib: float = 80.0,
           gpu: str = "H100", gpus_per_node: int = 8, settings: Optional[PlanSettings] = None,
           tp_comm_overlap: bool = False, frontier=None,
           margin: float = AUTO_LEAD_MARGIN) -> Tuple[Optional[Choice], str, str]:
    """(the chosen configuration or None, the table it was chosen from, a one-line reason).
    ``frontier``: a :class:`~megatron_metp.measure.frontier.Frontier` to plan with (its cache
    kept, its world left up); by default a new one, torn down. ``margin``: how much faster than
    a fitting stock configuration a plugin family must be estimated to be chosen (module
    docstring; 1.0 takes the fastest estimate)."""
    from megatron_metp.measure.frontier import FAMILIES

    settings = frontier.settings if frontier else (
        settings or PlanSettings(memory_gib=memory_gib, micro_batch=micro_batch))
    fr = frontier or _frontier(settings, gpu, gpus_per_node, tp_comm_overlap)
    L = cfg.layers_per_device
    try:
        with quiet_megatron():   # Megatron's spec notes would bury the table and the refusal
            rows, choices = {}, {}
            for fam in FAMILIES:
                got = fr.fastest(cfg, fam, p, s).get(gpu)
                rows[fam] = fr.row(cfg, got[0], p, s, got[1], gpu) if got else None
                if got:
                    choices[fam] = Choice(fam, got[0].flags(p, L), got[0], rows[fam])
            if choices:
                chosen, keeps, rest = _rule(choices, margin)
                why = (f"{chosen.family}{keeps}, {chosen.row['step_ms']:,.3f}"
                       f" ms per micro-batch step on {gpu}{' against ' + rest if rest else ''}, "
                       f"at --seq-length {s} in {settings.memory_gib:g} GiB; its flags: "
                       f"{' '.join(chosen.flags)}")
                return chosen, table(rows, chosen, gpu), why
            best = None
            for fam in FAMILIES:
                got = fr.longest(cfg, fam, p)
                if got and (best is None or got[1].seq_length > best[2].seq_length):
                    best = (fam, got[0], got[1])
    finally:
        if frontier is None:
            fr.planner.world.teardown()
    if best is None:
        why = (f"no configuration fits {settings.memory_gib:g} GiB even at 4k tokens with p = "
               f"{p}: use more ranks (--tensor-model-parallel-size) or a smaller model")
    else:
        fam, v, pt = best
        why = (f"no configuration fits --seq-length {s} in {settings.memory_gib:g} GiB with p = "
               f"{p}; the longest that fits is {fam} at {seq_label(pt.seq_length)} (--seq-length "
               f"{pt.seq_length}) with {' '.join(v.flags(p, L))}")
    return None, table(rows, None, gpu), why


def job_choice_flags(v, split, layers: int) -> List[str]:
    """The flags a job's choice sets (:data:`JOB_DECIDED`): the configuration's, its
    micro-batch and global batch, and the optimizer's sharding as the cluster plans it."""
    out = v.flags(split.p, layers) + ["--micro-batch-size", str(split.micro_batch),
                                      "--global-batch-size", str(split.sequences)]
    if not v.fsdp and "--use-distributed-optimizer" not in out:
        out.append("--use-distributed-optimizer")
    return out


def choose_job(cfg, n: int, s: int, *, global_batch_tokens: int, gpus_per_node: int = 8,
               gpu: str = "H100", settings: Optional[PlanSettings] = None,
               tp_comm_overlap: bool = False, margin: float = AUTO_LEAD_MARGIN
               ) -> Tuple[Optional[Choice], str, str]:
    """:func:`choose` for a whole job of n GPUs under a global batch of
    ``global_batch_tokens``: each family's fastest TP x CP x DP split and micro-batch on the
    cluster frontier (``measure.cluster``), the same rule between them. The choice's
    ``flags`` are its configuration's and its micro-batch; its ``row`` holds the split and
    every flag the job needs."""
    from megatron_metp.measure.cluster import Cluster
    from megatron_metp.measure.frontier import FAMILIES

    settings = settings or PlanSettings()
    cl = Cluster(_frontier(settings, gpu, gpus_per_node, tp_comm_overlap), global_batch_tokens)
    L = cfg.layers_per_device
    try:
        with quiet_megatron():
            rows, choices = {}, {}
            for fam in FAMILIES:
                got = cl.best(cfg, fam, n, s).get(gpu)
                rows[fam] = dict(cl.row(cfg, fam, s, got, gpu), layers=L) if got else None
                if got:
                    v, split = got[0], got[1]
                    choices[fam] = Choice(fam, job_choice_flags(v, split, L), v, rows[fam],
                                          split)
            far = [] if choices else [r for r in (cl.longest(cfg, f, n) for f in FAMILIES) if r]
    finally:
        cl.fr.planner.world.teardown()
    if choices:
        chosen, keeps, rest = _rule(choices, margin)
        r = chosen.row
        why = (f"{chosen.family}{keeps}, {r['step_ms']:,.3f} ms per optimizer step of "
               f"{r['global_batch_tokens']:,} tokens on {n} {gpu}"
               f"{' against ' + rest if rest else ''}, at --seq-length {s} in "
               f"{settings.memory_gib:g} GiB: TP {r['tp']} x CP {r['cp']} x DP {r['dp']}, "
               f"micro-batch {r['micro_batch']}; its flags: {r['flags']}")
        return chosen, job_table(rows, chosen, gpu), why
    if not far:
        why = (f"no configuration fits {settings.memory_gib:g} GiB even at 4k tokens on {n} "
               f"GPUs: use more GPUs or a smaller model")
    else:
        best = max(far, key=lambda r: r["seq_length"])
        why = (f"no configuration fits --seq-length {s} in {settings.memory_gib:g} GiB on {n} "
               f"GPUs; the longest that fits is {best['family']} at "
               f"{seq_label(best['seq_length'])} (--seq-length {best['seq_length']}) with "
               f"{best['flags']}")
    return None, job_table(rows, None, gpu), why


def decide(cfg, p: int, s: int, *, micro_batch: int = 1, memory_gib: Optional[float] = None,
           gpu: Optional[str] = None, gpus_per_node: int = 8, distributed_optimizer: bool = False,
           megatron_fsdp: bool = False, tp_comm_overlap: bool = False,
           world_size: Optional[int] = None, global_batch_size: Optional[int] = None
           ) -> Tuple[Choice, str]:
    """What both routes (``metp train``, Megatron-LM's argument hook) run: the GPU's memory and
    kind where there is one (else 80 GiB, H100), then

    * a world larger than p (``--tensor-model-parallel-size``): :func:`choose_job` on all of
      it, the split, the micro-batch and the accumulation auto's, under the run's global batch
      (``--global-batch-size`` sequences, or one per GPU where it is not given);
    * else p = 1 -> tp, or :func:`choose` within the one model-parallel group of p GPUs at the
      given micro-batch.

    Returns the choice and the text to print; nothing fits: a ValueError naming the longest
    that would. ``distributed_optimizer`` / ``megatron_fsdp``: the run's sharding, planned as
    ``metp plan`` plans it. ``tp_comm_overlap``: whether stock's ``--tp-comm-overlap`` can run
    here."""
    n = world_size or p
    if n == 1:
        return Choice("stock", ["--tensor-model-parallel-size", "1"]), \
            "--tensor-model-parallel-size 1 leaves nothing to choose: tp"
    import torch

    cuda = torch.cuda.is_available()
    if memory_gib is None:
        memory_gib = torch.cuda.get_device_properties(0).total_memory / GIB if cuda else 80.0
    if gpu is None:
        gpu = "A100" if cuda and "A100" in torch.cuda.get_device_name(0) else "H100"
    settings = PlanSettings(memory_gib=memory_gib, micro_batch=micro_batch,
                            distributed_optimizer=distributed_optimizer,
                            megatron_fsdp=megatron_fsdp)
    sharding = ("Megatron-FSDP, " if megatron_fsdp else
                "distributed optimizer, " if distributed_optimizer else "")
    planned = (f"(memory planned under fake tensors; times are ESTIMATES of the timeline model "
               f"for {gpu}, not measurements)")
    if n > p:
        seqs = global_batch_size or n
        chosen, tbl, why = choose_job(cfg, n, s, global_batch_tokens=seqs * s, gpu=gpu,
                                      gpus_per_node=gpus_per_node, settings=settings,
                                      tp_comm_overlap=tp_comm_overlap)
        head = (f"--tensor-parallel-mode auto on {n} GPUs ({gpus_per_node} per node), "
                f"--seq-length {s}, --global-batch-size {seqs}, {memory_gib:g} GiB: each "
                f"family's fastest TP x CP x DP split and micro-batch that fits {planned}")
    else:
        chosen, tbl, why = choose(cfg, p, s, gpu=gpu, gpus_per_node=gpus_per_node,
                                  settings=settings, tp_comm_overlap=tp_comm_overlap)
        head = (f"--tensor-parallel-mode auto at p = {p}, --seq-length {s}, micro batch "
                f"{micro_batch}, {memory_gib:g} GiB, {sharding}{gpus_per_node} ranks per "
                f"node: each family's fastest configuration that fits {planned}")
    if chosen is None:
        raise ValueError(f"--tensor-parallel-mode auto: {why}")
    return chosen, f"{head}:\n{tbl}\nauto chose {why}"


# The flags a choice decides: given ones are replaced by the winner's.
DECIDED = ("--tensor-parallel-mode", "--tensor-model-parallel-size", "--context-parallel-size",
           "--sequence-parallel",
           "--cp-comm-type", "--recompute-granularity", "--recompute-method",
           "--recompute-num-layers", "--recompute-modules", "--metp-ring-pass",
           "--metp-qkv-backward", "--wallfacer-team-size", "--wallfacer-placement")


# ... and a job's choice (choose_job) its micro-batch and global batch, and the optimizer's.
JOB_DECIDED = DECIDED + ("--micro-batch-size", "--global-batch-size",
                         "--use-distributed-optimizer")


def apply(ns, chosen: Choice, team_size_type=int) -> None:
    """The choice into an argument namespace (Megatron-LM's attribute names, which ``metp
    train`` shares): mode, TP x CP, recompute, METP attention, WallFacer's team; a job's
    choice also its micro-batch, global batch and the distributed optimizer, with
    Megatron-LM's overlap of its gradient reduction and parameter gather where DP x CP > 1."""
    v = chosen.variant
    ns.tensor_parallel_mode = chosen.mode
    if v is None:  # p = 1
        return
    split = chosen.split
    if split is not None:
        ns.tensor_model_parallel_size = split.p
        ns.micro_batch_size, ns.global_batch_size = split.micro_batch, split.sequences
        # (--use-distributed-optimizer is among the choice's flags: set below)
        if not v.fsdp and split.dp * v.cp > 1 and hasattr(ns, "overlap_grad_reduce"):
            ns.overlap_grad_reduce = ns.overlap_param_gather = True
    p = ns.tensor_model_parallel_size
    L = chosen.row["layers"] if chosen.row else None
    cp = v.cp if v.mode != "wallfacer" else 1   # WallFacer's remap makes TP its CP
    ns.tensor_model_parallel_size = p // cp
    ns.context_parallel_size = cp
    if cp > 1:
        comm = getattr(v, "cp_comm", "p2p")
        ns.cp_comm_type = [comm] if isinstance(getattr(ns, "cp_comm_type", None), list) \
            else comm
    if chosen.family != "wallfacer":  # WallFacer's remap leaves TP = 1
        ns.sequence_parallel = "--sequence-parallel" in chosen.flags
    if "--use-distributed-optimizer" in chosen.flags:
        ns.use_distributed_optimizer = True
    if v.overlap:
        ns.tp_comm_overlap = True
    ns.recompute_granularity = ns.recompute_method = None
    ns.recompute_num_layers = ns.recompute_modules = None
    if v.block:
        ns.recompute_granularity = "full"
        ns.recompute_method, ns.recompute_num_layers = (
            ("uniform", 1) if L is not None and v.block >= L else ("block", v.block))
    elif v.selective:
        ns.recompute_granularity, ns.recompute_modules = "selective", list(v.selective)
    if v.mode == "metp":
        ns.metp_ring_pass, ns.metp_qkv_backward = v.ring_pass, v.qkv
    if v.mode == "wallfacer":
        ns.wallfacer_team_size = team_size_type(v.team)
        ns.wallfacer_placement = v.placement


def rewrite_argv(argv: List[str], chosen: Choice) -> List[str]:
    """A command line with the decided flags (:data:`DECIDED`) replaced by the winner's (both
    ``--flag value...`` and ``--flag=value`` spellings)."""
    decided = JOB_DECIDED if chosen.split is not None else DECIDED
    out, skip = [], False
    for a in argv:
        name = a.split("=", 1)[0]
        if name in decided:
            skip = "=" not in a
            continue
        if skip and not a.startswith("--"):
            continue
        skip = False
        out.append(a)
    flags = chosen.flags[2:] if chosen.flags[:1] == ["--tensor-parallel-mode"] else chosen.flags
    return out + ["--tensor-parallel-mode", chosen.mode] + flags
