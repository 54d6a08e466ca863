"""WallFacer's communication topology scheduler (paper Sec. 3.4, Eq. 8).

Grid search over every team size C in [1, sqrt(P)] with C^2 | P and both placements
(``collective_intra``: teams on consecutive ranks, so all-gather / reduce-scatter stay inside a
node; ``p2p_intra``: sub-rings on consecutive ranks, so the ring P2P stays inside a node). Each
candidate's groups are built, a few steps are profiled, the slowest rank's time is taken (the
step waits for it), and the fastest candidate wins; every rank reaches the same choice because
the times are all-reduced (MAX) before comparing. This is what ``--wallfacer-team-size auto``
runs; :func:`initialize_wallfacer` (resolve the team size, build the groups, register them)
is the package's entry point.

    best = auto_select(shape=dict(b=1, s=65536, n=32, n_kv=8, d=128), gpus_per_node=8)
    best.team_size, best.placement, best.table
"""

from __future__ import annotations

import datetime
import time
from dataclasses import dataclass, field
from typing import Callable, Dict, List, Optional, Sequence, Tuple

import torch
import torch.distributed as dist

from megatron_metp import parallel_state as ps
from megatron_metp.wallfacer import config_generator as cg
from megatron_metp.wallfacer.attention import WallFacerAttnFunc
from megatron_metp.wallfacer.groups import WallFacerGroups, build_wallfacer_groups

Candidate = Tuple[int, str]


def candidates(cp_size: int) -> List[Candidate]:
    """Every distinct (C, placement). The placements coincide (same rank map) when C = 1 (ring
    attention) or C = sqrt(P) (rings of length 1), so those get one entry."""
    out = []
    for c in cg.valid_team_sizes(cp_size):
        for pl in cg.PLACEMENTS:
            if pl != cg.PLACEMENTS[0] and (c == 1 or cp_size == c * c):
                continue
            out.append((c, pl))
    return out


def locality(cp_size: int, team_size: int, placement: str,
             gpus_per_node: Optional[int]) -> Dict[str, bool]:
    """Whether teams and sub-rings fit inside one node, assuming CP ranks fill nodes in order."""
    if not gpus_per_node:
        return {"team_intra_node": True, "ring_intra_node": True}
    node = lambda i: i // gpus_per_node  # noqa: E731
    G = cp_size // (team_size * team_size)
    teams_ok = all(len({node(i) for i in cg.team_members(t, cp_size, team_size, placement)}) == 1
                   for t in range(cp_size // team_size))
    rings_ok = all(len({node(i) for i in cg.sub_ring(g, m, cp_size, team_size, placement)}) == 1
                   for g in range(team_size) for m in range(team_size)) if G > 1 else True
    return {"team_intra_node": teams_ok, "ring_intra_node": rings_ok}


@dataclass
class Schedule:
    team_size: int
    placement: str
    times: Dict[Candidate, float]
    table: str = ""
    rows: List[dict] = field(default_factory=list)


def pick_fastest(times: Dict[Candidate, float]) -> Candidate:
    """Smallest time; ties go to the smaller C, then to ``collective_intra`` (fewer P2P hops)."""
    return min(times, key=lambda c: (times[c], c[0], cg.PLACEMENTS.index(c[1])))


def format_table(cp_size: int, times: Dict[Candidate, float], best: Candidate,
                 gpus_per_node: Optional[int] = None) -> Tuple[str, List[dict]]:
    rows, lines = [], [
        f"WallFacer topology scheduler: P = {cp_size}, GPUs per node = {gpus_per_node or '-'}",
        "| C | placement | ring length P/C^2 | team intra-node | ring intra-node | step ms | |",
        "|---:|---|---:|---|---|---:|---|",
    ]
    for (c, pl), t in sorted(times.items()):
        loc = locality(cp_size, c, pl, gpus_per_node)
        row = dict(team_size=c, placement=pl, ring_length=cp_size // (c * c),
                   step_ms=t * 1e3, **loc, best=(c, pl) == best)
        rows.append(row)
        mark = "<- best" if row["best"] else ""
        lines.append(f"| {c} | {pl} | {row['ring_length']} | {loc['team_intra_node']} | "
                     f"{loc['ring_intra_node']} | {t * 1e3:.2f} | {mark} |")
    return "\n".join(lines), rows


def _comm_device() -> torch.device:
    """Where this run's collectives operate: the current GPU under NCCL, else the CPU."""
    if dist.get_backend() == "nccl":
        return torch.device("cuda", torch.cuda.current_device())
    return torch.device("cpu")


def _sync(device: torch.device) -> None:
    """Wait for queued GPU work so wall-clock times measure kernels, not their launches."""
    if device.type == "cuda":
        torch.cuda.synchronize(device)


def attention_step_factory(shape: dict, causal: bool = True, dtype=None,
                           device=None) -> Callable:
    """A profiling step: WallFacer attention forward + backward on random data of ``shape``.

    ``shape``: b, s (whole sequence), n, n_kv, d. Returns ``factory(plan) -> step()``.
    The data lives where the collectives run (the GPU under NCCL); the dtype defaults to bf16 on
    a GPU (the flash kernels a run uses; fp32 there would profile the math path) and fp32 on CPU.
    """
    device = _comm_device() if device is None else device
    if dtype is None:
        dtype = torch.bfloat16 if device.type == "cuda" else torch.float32
    def factory(plan):
        s_local = shape["s"] // plan.cp_size
        g = torch.Generator().manual_seed(0)
        q, k, v = (torch.randn(shape["b"], h, s_local, shape["d"], generator=g).to(
                       device=device, dtype=dtype)
                   for h in (shape["n"], shape["n_kv"], shape["n_kv"]))
        q, k, v = (t.requires_grad_() for t in (q, k, v))

        def step():
            out = WallFacerAttnFunc.apply(q, k, v, plan, causal, None)
            out.backward(torch.ones_like(out))
        return step
    return factory


def auto_select(step_factory: Optional[Callable] = None, *, shape: Optional[dict] = None,
                gpus_per_node: Optional[int] = None, warmup: int = 1, iters: int = 3,
                all_cp_groups: Optional[Sequence[Sequence[int]]] = None,
                my_cp_ranks: Optional[Sequence[int]] = None, cp_group=None,
                verbose: bool = True) -> Schedule:
    """Profile every candidate and return the fastest (identical on every rank).

    ``step_factory(plan) -> step()`` builds one profiling step for a candidate's groups
    (default: :func:`attention_step_factory` of ``shape``). The CP groups default to
    Megatron's (as ``initialize_wallfacer`` finds them); all ranks of the world must call this.
    """
    if step_factory is None:
        if shape is None:
            raise ValueError("auto_select: give step_factory or shape")
        step_factory = attention_step_factory(shape)
    if my_cp_ranks is None:
        from megatron.core import parallel_state as mpu

        my_cp_ranks = list(mpu.get_context_parallel_global_ranks())
        cp_group = mpu.get_context_parallel_group()
        gathered: list = [None] * dist.get_world_size()
        dist.all_gather_object(gathered, sorted(my_cp_ranks))
        all_cp_groups = sorted({tuple(x) for x in gathered})
    cp_size = len(my_cp_ranks)
    device = _comm_device()
    times: Dict[Candidate, float] = {}
    for c, pl in candidates(cp_size):
        before = ps.live_groups()
        try:
            plan = build_wallfacer_groups(all_cp_groups, my_cp_ranks, cp_group, c, pl)
            step = step_factory(plan)
            for _ in range(warmup):
                step()
            _sync(device)
            dist.barrier()
            t0 = time.perf_counter()
            for _ in range(iters):
                step()
            _sync(device)
            # The step's time is its slowest rank's; every rank compares the same numbers.
            elapsed = torch.tensor([(time.perf_counter() - t0) / iters], dtype=torch.float64,
                                   device=device)
            dist.all_reduce(elapsed, op=dist.ReduceOp.MAX)
            times[(c, pl)] = elapsed.item()
        finally:
            # The candidate's team groups end before the next candidate builds its own: every
            # rank has passed the all-reduce above, so no team collective is still in flight.
            step = plan = None
            ps.destroy_groups(ps.live_groups() - before)
    best = pick_fastest(times)
    table, rows = format_table(cp_size, times, best, gpus_per_node)
    if verbose and dist.get_rank() == 0:
        print(table, flush=True)
    return Schedule(best[0], best[1], times, table, rows)


def resolve_team_size(team_size, placement: Optional[str], shape: dict,
                      gpus_per_node: Optional[int] = None) -> Tuple[int, str]:
    """``--wallfacer-team-size auto`` -> the scheduler's (C, placement); an int passes through."""
    if team_size != "auto":
        return int(team_size), placement or cg.PLACEMENTS[0]
    sched = auto_select(shape=shape, gpus_per_node=gpus_per_node)
    if placement is not None and placement != sched.placement:
        c_times = {k: v for k, v in sched.times.items() if k[1] == placement or k[0] == 1}
        c, pl = pick_fastest(c_times)
        return c, placement
    return sched.team_size, sched.placement


def initialize_wallfacer(team_size=1, placement: Optional[str] = "collective_intra",
                         layout: str = "zigzag", *, shape: Optional[dict] = None,
                         gpus_per_node: Optional[int] = None,
                         timeout_minutes: Optional[float] = None) -> WallFacerGroups:
    """Build the WallFacer groups from Megatron's context-parallel group and register them.

    Call on every rank after ``megatron.core.parallel_state.initialize_model_parallel(
    context_parallel_size=P, ...)``. Returns this rank's :class:`WallFacerGroups`.
    ``team_size="auto"`` (``--wallfacer-team-size auto``) runs the topology scheduler on an
    attention step of ``shape`` (b, s, n, n_kv, d) first; ``placement=None`` lets it choose.
    """
    if team_size == "auto":
        if shape is None:
            raise ValueError("--wallfacer-team-size auto needs the attention shape to profile "
                             "(initialize_wallfacer(..., shape=dict(b=, s=, n=, n_kv=, d=)))")
        team_size, placement = resolve_team_size("auto", placement, shape, gpus_per_node)
    placement = placement or "collective_intra"
    from megatron.core import parallel_state as mpu

    if not mpu.model_parallel_is_initialized():
        raise RuntimeError(
            "initialize_wallfacer: call megatron.core.parallel_state.initialize_model_parallel("
            "context_parallel_size=P, ...) first"
        )
    my_cp = list(mpu.get_context_parallel_global_ranks())
    gathered: List[List[int]] = [None] * dist.get_world_size()  # type: ignore[list-item]
    dist.all_gather_object(gathered, sorted(my_cp))
    unique = sorted({tuple(g) for g in gathered})
    plan = build_wallfacer_groups([list(g) for g in unique], my_cp,
                                  mpu.get_context_parallel_group(), team_size, placement, layout,
                                  timeout=datetime.timedelta(minutes=timeout_minutes)
                                  if timeout_minutes else None)
    if plan.idx != mpu.get_context_parallel_rank():
        raise RuntimeError("WallFacer CP index differs from Megatron's context-parallel rank")
    ps.set_wallfacer_groups(plan)
    return plan
