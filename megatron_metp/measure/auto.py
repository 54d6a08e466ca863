"""``--tensor-parallel-mode auto``: among tp, metp and wallfacer (each team size C and placement)
what fits the GPU memory at this sequence length, the fastest by the planner's **estimate**.

Inputs: the model config, the parallel size p (``--tensor-model-parallel-size``), sequence
length, micro batch, GPU memory and the node layout (GPUs per node). For every candidate:

* memory: :class:`~megatron_metp.measure.planner.Planner` runs one layer (and the head) under
  FakeTensorMode at full scale, as ``metp plan`` does (state + activations, x 1.05 + 4 GiB
  reserve, against the budget). WallFacer is planned at C = 1; a team of C holds C - 1 more
  query/key/value shards at the attention peak (paper Eq. 7 - Eq. 6), added here.
* time (an ESTIMATE, never a measurement): the planner's compute time (Megatron-LM's model FLOPs
  at a stated fraction of the GPU's bf16 peak) and communication from the bytes each rank sends
  over the links it crosses: NVLink inside a node, InfiniBand between nodes
  (:data:`INTER_NODE_GBS`). WallFacer's attention traffic per C is counted exactly
  (``wallfacer.formulas.forward_elements`` / ``backward_elements``): team collectives on one
  link, the sub-ring on another, which the placement decides. tp exposes its communication
  (compute + comm); metp and wallfacer overlap it (max(compute, comm) + comm / p), the
  planner's rule.

The choice is the fastest candidate that fits; ties go to the order tp, metp, wallfacer (the
simpler layout). When nothing fits, :func:`choose` says which mode reaches the longest sequence.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import List, Optional, Tuple

from megatron_metp.measure.planner import (
    ALPHA_S, BUS_EFFICIENCY, GIB, GPUS, PlanSettings, Planner, quiet_megatron, seq_label,
    step_time, team_shard_bytes)

# Per-GPU InfiniBand bandwidth per direction (GB/s): DGX H100 has one 400 Gb/s NDR ConnectX-7
# per GPU, DGX A100 one 200 Gb/s HDR ConnectX-6 per GPU (NVIDIA's DGX data sheets).
INTER_NODE_GBS = {"H100": 50.0, "A100": 25.0}
PLACEMENTS = ("team-consecutive", "ring-consecutive")


@dataclass
class Candidate:
    mode: str
    team_size: int = 1
    placement: Optional[str] = None
    needed_gib: float = 0.0
    fits: bool = False
    compute_s: float = 0.0
    comm_s: float = 0.0
    step_s: float = 0.0            # ESTIMATE

    @property
    def label(self) -> str:
        if self.mode != "wallfacer":
            return self.mode
        return f"wallfacer C={self.team_size}" + (f" {self.placement}" if self.placement else "")


def _link_gbs(gpu: str, inside_node: bool) -> float:
    return (GPUS[gpu]["link_gbs"] if inside_node else INTER_NODE_GBS[gpu]) * BUS_EFFICIENCY


def _wallfacer_attention_bytes(cfg, p: int, s: int, b: int, C: int) -> Tuple[float, float]:
    """(team-collective bytes, sub-ring bytes) one rank sends per layer, forward + backward,
    bf16 (the fp32 accumulators counted at 2 bytes too: an estimate, slightly low)."""
    from megatron_metp.wallfacer.formulas import backward_elements, forward_elements

    args = (b, s, cfg.num_attention_heads, cfg.num_query_groups, cfg.kv_channels, p, C, False)
    f, g = forward_elements(*args), backward_elements(*args)
    coll = sum(x[k] for x in (f, g) for k in ("all_gather", "reduce_scatter"))
    return 2.0 * coll, 2.0 * (f["send"] + g["send"])


def candidates(cfg, p: int, s: int, *, planner: Planner, gpu: str = "H100",
               gpus_per_node: int = 8) -> List[Candidate]:
    """Every mode (and WallFacer C, placement) at (p, s): memory, fit and ESTIMATED step time."""
    from megatron_metp.wallfacer.config_generator import valid_team_sizes

    st, b, L = planner.settings, planner.settings.micro_batch, cfg.layers_per_device
    one_node = p <= gpus_per_node
    out = []
    for mode in ("tp", "metp"):
        pt = planner.plan(cfg, mode, p, s)
        comp = pt.est_time_s[f"{gpu}_compute"]
        comm = pt.sent_bytes / (_link_gbs(gpu, one_node) * 1e9) + pt.comm_calls * ALPHA_S
        out.append(Candidate(mode, needed_gib=pt.needed_bytes / GIB, fits=pt.fits,
                             compute_s=comp, comm_s=comm, step_s=step_time(mode, comp, comm, p)))
    base = planner.plan(cfg, "wallfacer", p, s)          # C = 1, one ring of p
    comp = base.est_time_s[f"{gpu}_compute"]
    ring_coll, ring_p2p = _wallfacer_attention_bytes(cfg, p, s, b, 1)
    other = base.sent_bytes - L * (ring_coll + ring_p2p)  # the weights' gradient collectives
    for C in valid_team_sizes(p):
        G = p // (C * C)                                  # sub-ring length
        coll, p2p = _wallfacer_attention_bytes(cfg, p, s, b, C)
        extra = team_shard_bytes(cfg, p, s, b, C) * (1 + st.fragmentation)
        needed = base.needed_bytes + extra
        for placement in (PLACEMENTS if C > 1 else (None,)):
            # team-consecutive: a team's C ranks are neighbours, its sub-ring strides over the
            # teams; ring-consecutive: the other way round.
            team_span = C if placement != "ring-consecutive" else C * G
            ring_span = p if placement != "ring-consecutive" else G
            comm = (L * coll / (_link_gbs(gpu, team_span <= gpus_per_node) * 1e9)
                    + L * p2p / (_link_gbs(gpu, ring_span <= gpus_per_node) * 1e9)
                    + other / (_link_gbs(gpu, one_node) * 1e9) + base.comm_calls * ALPHA_S)
            out.append(Candidate("wallfacer", C, placement, needed / GIB,
                                 needed <= st.memory_gib * GIB, comp, comm,
                                 step_time("wallfacer", comp, comm, p)))
    return out


def table(cands: List[Candidate], chosen: Optional[Candidate], gpu: str) -> str:
    rows = [f"| candidate | needs GiB | fits | compute ms | comm ms | step ms ({gpu} "
            f"ESTIMATE) |", "|---|---:|:---:|---:|---:|---:|"]
    for c in cands:
        mark = " **chosen**" if c is chosen else ""
        rows.append(f"| {c.label}{mark} | {c.needed_gib:.1f} | {'yes' if c.fits else 'no'} | "
                    f"{1e3 * c.compute_s:.3f} | {1e3 * c.comm_s:.3f} | {1e3 * c.step_s:.3f} |")
    return "\n".join(rows)


def decide(cfg, p: int, s: int, *, micro_batch: int = 1, memory_gib: Optional[float] = None,
           gpu: Optional[str] = None, gpus_per_node: int = 8, distributed_optimizer: bool = False,
           megatron_fsdp: bool = False) -> Tuple[Candidate, str]:
    """What both routes (``metp train``, Megatron-LM's argument hook) run: the GPU's memory and
    kind where there is one (else 80 GiB, H100), p = 1 -> tp, else :func:`choose`. Returns the
    choice and the text to print; nothing fits: a ValueError naming the longest that would.
    ``distributed_optimizer`` / ``megatron_fsdp``: the run's sharding, planned as ``metp plan``
    plans it (it changes WallFacer, whose CP group of p ranks shares the weights)."""
    if p == 1:
        return Candidate("tp", fits=True), "--tensor-model-parallel-size 1 leaves nothing to " \
                                            "choose: tp"
    import torch

    cuda = torch.cuda.is_available()
    if memory_gib is None:
        memory_gib = torch.cuda.get_device_properties(0).total_memory / GIB if cuda else 80.0
    if gpu is None:
        gpu = "A100" if cuda and "A100" in torch.cuda.get_device_name(0) else "H100"
    planner = Planner(PlanSettings(memory_gib=memory_gib, micro_batch=micro_batch,
                                   distributed_optimizer=distributed_optimizer,
                                   megatron_fsdp=megatron_fsdp))
    chosen, tbl, why = choose(cfg, p, s, micro_batch=micro_batch, memory_gib=memory_gib, gpu=gpu,
                              gpus_per_node=gpus_per_node, planner=planner)
    if chosen is None:
        raise ValueError(f"--tensor-parallel-mode auto: {why}")
    sharding = ("Megatron-FSDP, " if megatron_fsdp else
                "distributed optimizer, " if distributed_optimizer else "")
    return chosen, (f"--tensor-parallel-mode auto at p = {p}, --seq-length {s}, micro batch "
                    f"{micro_batch}, {memory_gib:g} GiB, {sharding}{gpus_per_node} ranks per "
                    f"node (times are ESTIMATES for {gpu}, not measurements):\n{tbl}\n"
                    f"auto chose {why}")


def apply(ns, chosen: Candidate, team_size_type=int) -> None:
    """The choice into an argument namespace (Megatron-LM's names)."""
    ns.tensor_parallel_mode = chosen.mode
    if chosen.mode == "wallfacer":
        ns.wallfacer_team_size = team_size_type(chosen.team_size)
        ns.wallfacer_placement = chosen.placement or PLACEMENTS[0]


def choose(cfg, p: int, s: int, *, micro_batch: int = 1, memory_gib: float = 80.0,
           gpu: str = "H100", gpus_per_node: int = 8,
           planner: Optional[Planner] = None) -> Tuple[Optional[Candidate], str, str]:
    """(the chosen candidate or None, the table it was chosen from, a one-line reason)."""
    planner = planner or Planner(PlanSettings(memory_gib=memory_gib, micro_batch=micro_batch))
    try:
        with quiet_megatron():   # Megatron's spec notes would bury the table and the refusal
            return _choose(cfg, p, s, planner, memory_gib, gpu, gpus_per_node)
    finally:
        planner.world.teardown()


def _choose(cfg, p, s, planner, memory_gib, gpu, gpus_per_node):
    cands = candidates(cfg, p, s, planner=planner, gpu=gpu, gpus_per_node=gpus_per_node)
    fitting = [c for c in cands if c.fits]
    chosen = min(fitting, key=lambda c: c.step_s) if fitting else None
    if chosen is not None:
        why = (f"{chosen.label}: the fastest estimate ({1e3 * chosen.step_s:.3f} ms per "
               f"micro-batch step on {gpu}) of {len(fitting)} of {len(cands)} candidates that "
               f"fit {memory_gib:g} GiB at --seq-length {s}")
        return chosen, table(cands, chosen, gpu), why
    best = None
    for mode in ("tp", "metp", "wallfacer"):
        pt = planner.longest_sequence(cfg, mode, p, lo=min(4096, s))
        if pt is not None and (best is None or pt.seq_length > best.seq_length):
            best = pt
    if best is None:
        why = (f"no mode fits {memory_gib:g} GiB even at 4k tokens with p = {p}: use more "
               f"ranks (--tensor-model-parallel-size) or a smaller model")
    else:
        why = (f"no mode fits --seq-length {s} in {memory_gib:g} GiB with p = {p}; the longest "
               f"that fits is {best.mode} at {seq_label(best.seq_length)} (--seq-length "
               f"{best.seq_length})")
    return None, table(cands, None, gpu), why
