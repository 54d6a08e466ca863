"""One rank's op trace of one layer's forward + backward: compute, communication and waits, in order.

``OpRecorder`` is a ``TorchDispatchMode`` (a :class:`CommCounter` that also sees compute): every
aten op and every c10d op of its region passes through it, in program order, inside autograd's
backward too. It runs under ``FakeTensorMode`` with the ``fake`` process-group backend, so one
process traces a GPT-175B layer at s = 1M in seconds (fake tensors hold no storage), with the
real plugin and Megatron-Core code. Nothing is written per mode: the trace is whatever the layer
runs. Events (``TraceOp.kind``):

==========  ================================================================================
compute     an aten op: ``flops`` (``torch.utils.flop_counter``'s formulas for mm / addmm / bmm
            / baddbmm; our own for the SDPA flash ops, see :func:`attention_flops`) and
            ``bytes`` (its tensor inputs read + outputs written); ``strided``: an element-wise
            op (no FLOPs counted) on a strided or broadcast operand (:func:`is_strided`);
            views, ``empty`` and the ops that launch no kernel (``_NO_KERNEL``) are not
            compute events
comm        a c10d collective or P2P op as posted: ``bytes`` = payload (CommCounter's
            convention), ``group`` (the process group: one NCCL communicator, one stream),
            ``group_size``, ``comm_id``
wait        ``Work.wait()`` on comm ``comm_id`` (also the implicit wait of a synchronous
            collective): on NCCL it makes the compute stream wait for that communication
==========  ================================================================================

How waits are seen: the recorder hands the caller a ``Work`` of its own (a Python subclass of
``torch.distributed.Work`` wrapping the backend's) whose ``wait`` records the event, then waits
on the real one. The wrappers are kept alive for the recorder's life: pybind keeps the Python
override only while the Python object exists.
"""

from __future__ import annotations

import math
from dataclasses import asdict, dataclass
from typing import Dict, List, Optional, Tuple

import torch
import torch.distributed as dist
from torch.utils.flop_counter import flop_registry

from megatron_metp import cpu_compat
from megatron_metp.measure.comm_counter import CommCounter

__all__ = ["TraceOp", "OpRecorder", "attention_flops", "trace_layer", "group_roles",
           "is_strided"]

# Ops that launch no kernel and move no bytes although their schemas return a fresh tensor
# (no alias annotation) or a written alias: ``_unsafe_view`` is the view ``torch.matmul`` puts
# on its folded GEMM's output (every Megatron linear layer's [s, b, h] input: 17 GB of
# LLaMA-7B's traces at 32k were charged to it, 5.8 ms of stock's 128k layer on the H100
# sheet), ``set_`` / ``resize_`` swap or size a storage (Megatron's checkpointed norms), and
# ``detach`` / ``lift_fresh`` / ``alias`` are metadata.
_NO_KERNEL = frozenset({"_unsafe_view", "set_", "resize_", "detach", "lift_fresh", "alias"})

GEMMS = ("mm", "addmm", "bmm", "baddbmm")

# Not element-wise although their output may have their largest operand's shape: never
# ``TraceOp.strided`` (nor are the plugin's and the stand-ins' fused ops outside ``aten``,
# Transformer Engine's norms and SwiGLU on a GPU).
_JOINS = frozenset({"cat", "stack"})


@dataclass
class TraceOp:
    kind: str                 # "compute" | "comm" | "wait"
    name: str                 # aten op (compute) or CommCounter's op key (comm)
    phase: str = "fwd"        # "fwd" | "bwd"
    flops: float = 0.0
    bytes: float = 0.0        # compute: bytes read + written; comm: payload
    group: str = ""
    group_size: int = 1
    comm_id: int = -1
    strided: bool = False     # compute: an element-wise op on strided / broadcast operands
    # comm: the global ranks it connects (a collective: its group's; a P2P op: this rank and
    # its peer), which say whether it stays inside a node (``timeline.Machine.link_of``);
    # empty: unknown, the group's size decides. Not written to trace files.
    ranks: Tuple[int, ...] = ()

    def to_dict(self) -> dict:
        return {k: v for k, v in asdict(self).items() if k != "ranks" and (
            v not in ("", -1, 0, 0.0) or k in ("kind", "name"))}


def is_attention_kernel(name: str) -> bool:
    """Whether a traced compute op (its aten name) is a fused attention kernel (the SDPA flash,
    memory-efficient and cuDNN ops, forward or backward)."""
    return "attention" in name and any(k in name for k in ("flash", "efficient", "cudnn"))


def attention_flops(name: str, q: torch.Tensor, k: torch.Tensor, causal: bool) -> float:
    """FLOPs of one SDPA-style kernel call (q [b, n_q, s_q, d], k [b, n_kv, s_k, d]).

    Forward: QK^T and PV, 2 x 2 b n_q s_q s_k d. Backward: dV = P^T dO, dP = dO V^T, dQ, dK
    (4 GEMMs) plus the recomputed QK^T: 2.5 x forward (FlashAttention-2's count). A causal
    (diagonal, s_q = s_k) block computes half its scores on a GPU flash kernel: x 0.5.
    """
    b, n_q, s_q, d = q.shape
    s_k = k.shape[-2]
    fwd = 4.0 * b * n_q * s_q * s_k * d
    out = 2.5 * fwd if "backward" in name else fwd
    return out * (0.5 if causal else 1.0)


def _tensors(x) -> List[torch.Tensor]:
    if isinstance(x, torch.Tensor):
        return [x]
    if isinstance(x, (list, tuple)):
        return [t for item in x for t in _tensors(item)]
    return []


def _nbytes(ts) -> int:
    return sum(t.numel() * t.element_size() for t in ts)


def is_strided(inputs: List[torch.Tensor], outputs: List[torch.Tensor]) -> bool:
    """An element-wise op (its output has the shape of its largest operand) that reads or writes
    a non-contiguous operand or broadcasts a smaller one: on a GPU PyTorch's TensorIterator then
    runs its unvectorised, index-computing kernel, measured at ~0.6 of HBM where dense ops reach
    ~0.8 (``measure.fitted.STRIDED_MEM_EFFICIENCY``). A copy between layouts is one (a
    transposing copy); a reduction and single values are not (nor, by the caller, a cat)."""
    ins = [t for t in inputs if t.numel() > 1]
    outs = [t for t in outputs if t.numel() > 1]
    if not ins or not outs:
        return False
    shape = max(ins + outs, key=lambda t: t.numel()).shape
    if outs[0].shape != shape:
        return False
    return (any(not t.is_contiguous() for t in ins + outs)
            or any(t.shape != shape for t in ins))


def _ranks_of(e) -> Tuple[int, ...]:
    """The global ranks a recorded comm event connects (:attr:`TraceOp.ranks`); () when its
    group is not a registered process group."""
    c10d = dist.distributed_c10d
    pg = next((g for g, name in c10d._world.pg_names.items() if name == e.group), None)
    if pg is None:
        return ()
    ranks = tuple(dist.get_process_group_ranks(pg))
    if e.op in ("send", "recv") and e.peer is not None and 0 <= e.peer < len(ranks):
        return (dist.get_rank(), ranks[e.peer])
    return ranks


class _RecordedWork(dist.Work):
    """The caller's handle: records ``wait`` in the trace, then waits on the backend's work."""

    def __init__(self, inner, recorder: "OpRecorder", comm_id: int):
        super().__init__()
        self._inner, self._rec, self._id = inner, recorder, comm_id

    def wait(self, timeout=None) -> bool:
        self._rec._wait(self._id)
        work = dist.distributed_c10d.Work.unbox(self._inner)
        return work.wait() if timeout is None else work.wait(timeout)

    def is_completed(self) -> bool:
        return dist.distributed_c10d.Work.unbox(self._inner).is_completed()


class OpRecorder(CommCounter):
    """Records :class:`TraceOp` s in ``ops`` (see the module docstring). Set ``phase`` to
    ``"bwd"`` before the backward. Enter inside ``FakeTensorMode`` (as CommCounter)."""

    def __init__(self) -> None:
        super().__init__()
        self.ops: List[TraceOp] = []
        self.phase = "fwd"
        self._works: List[_RecordedWork] = []
        self._waited: set = set()
        self._functional: Dict[int, int] = {}   # storage of a functional collective -> comm id

    def _wait(self, comm_id: int) -> None:
        if comm_id not in self._waited:  # a second wait on a completed Work orders nothing new
            self._waited.add(comm_id)
            self.ops.append(TraceOp("wait", "wait", self.phase, comm_id=comm_id))

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        kwargs = kwargs or {}
        ns = func.namespace
        if ns in ("c10d", "_c10d_functional"):
            if func._schema.name.endswith("wait_tensor"):
                cid = self._functional.get(args[0].untyped_storage()._cdata)
                if cid is not None:
                    self._wait(cid)
                return func(*args, **kwargs)
            n = len(self.events)
            self._record(func, args, kwargs)
            out = func(*args, **kwargs)
            if len(self.events) == n:
                return out  # not communication (wrappers, barriers' bookkeeping)
            e = self.events[-1]
            cid = n
            self.ops.append(TraceOp("comm", e.op, self.phase, bytes=float(e.bytes),
                                    group=e.group, group_size=e.group_size or 1, comm_id=cid,
                                    ranks=_ranks_of(e)))
            if ns == "_c10d_functional":
                for t in _tensors(out):
                    self._functional[t.untyped_storage()._cdata] = cid
                return out
            work = out[-1] if isinstance(out, tuple) else out
            mine = _RecordedWork(work, self, cid)
            self._works.append(mine)
            return (*out[:-1], mine.boxed()) if isinstance(out, tuple) else mine.boxed()
        out = func(*args, **kwargs)
        self._compute(func, args, kwargs, out)
        return out

    def _compute(self, func, args, kwargs, out) -> None:
        name = func.overloadpacket.__name__
        schema = func._schema
        view = any(r.alias_info is not None and not r.alias_info.is_write
                   for r in schema.returns)
        if view or name.startswith(("empty", "new_empty")) or name in _NO_KERNEL:
            return
        flops = 0.0
        if is_attention_kernel(name):
            bound = {a.name: v for a, v in zip(schema.arguments, args)}
            bound.update(kwargs)
            q = bound.get("query")
            k = bound.get("key")
            if q is not None and k is not None:
                flops = attention_flops(name, q, k, bool(bound.get("is_causal", False)))
        else:
            # In-place variants (addmm_, baddbmm_) count as their out-of-place op.
            packet = getattr(torch.ops.aten, name.rstrip("_"), None) if name.endswith("_") \
                else func.overloadpacket
            if packet in flop_registry:
                # The widening overloads (mm / addmm ``.dtype``, ``.dtype_out``) take their
                # ``out_dtype`` positionally, which the FLOP formulas do not expect.
                fargs = [a for a, arg in zip(args, schema.arguments) if arg.name != "out_dtype"]
                fkw = {k: v for k, v in kwargs.items() if k != "out_dtype"}
                flops = float(flop_registry[packet](*fargs, **fkw, out_val=out))
        outs = _tensors(out)
        if not outs and func.namespace == "megatron_metp":
            # The plugin's fused in-place ops (kernels.merge_ring_) return nothing: what they
            # write is their mutated arguments.
            outs = [a for a, arg in zip(args, schema.arguments)
                    if arg.alias_info is not None and arg.alias_info.is_write]
        if not outs:
            return  # metadata queries (aten.device, sym sizes): no kernel
        # An ``out=`` tensor is written, not read.
        ins = _tensors(list(args) + [v for k, v in kwargs.items() if k != "out"])
        moved = _nbytes(ins) + _nbytes(outs)
        if flops or moved:
            self.ops.append(TraceOp("compute", name, self.phase, flops=flops, bytes=float(moved),
                                    strided=(not flops and func.namespace == "aten"
                                             and name not in _JOINS
                                             and is_strided(ins, outs))))


def group_roles() -> Dict[str, str]:
    """Process-group name -> role ("tp", "cp", "metp_weight", "wf_team") for the groups that
    Megatron and the plugin hold now; a trace's groups not listed keep their c10d name."""
    from megatron.core import parallel_state as mpu

    from megatron_metp import parallel_state as ps

    roles: Dict[str, str] = {}

    def add(pg, role):
        if pg is not None and not isinstance(pg, int):
            roles.setdefault(str(pg.group_name), role)

    if mpu.model_parallel_is_initialized():
        add(mpu.get_tensor_model_parallel_group(), "tp")
        add(mpu.get_context_parallel_group(), "cp")
        add(mpu.get_data_parallel_group(), "dp")
    add(ps._METP_WEIGHT_GROUP, "metp_weight")
    if ps.wallfacer_is_initialized():
        add(ps.get_wallfacer_groups().team_group_pg, "wf_team")
    return roles


def trace_layer(cfg, mode: str, p: int, s: int, world=None, micro_batch: int = 1,
                recompute_modules: Optional[List[str]] = None, tcfg=None,
                ring_pass: str = "auto", qkv_backward: str = "recompute", cp: int = 1,
                full_recompute: bool = False, cp_comm_type: str = "p2p", layers: int = 1,
                team_size: int = 1, placement: str = "collective_intra") -> List[TraceOp]:
    """One layer of ``cfg`` (a ``config.ModelConfig``) in ``mode`` at (p, s), fwd + bwd on rank 0,
    traced under FakeTensorMode on the fake process group (``world``: a ``planner.FakeWorld``,
    kept set up for the caller). Group names are replaced by their roles (:func:`group_roles`).
    ``tcfg``: a ready ``TransformerConfig`` instead of ``cfg``'s (e.g. ``metp bench``'s).
    ``cp``: stock tp's context-parallel size and ``cp_comm_type`` its --cp-comm-type
    (``planner.probe_mode``); ``full_recompute``: the layer inside Megatron's
    CheckpointFunction, its recomputed forward traced in backward. ``layers``: a stack of that
    many such layers, each fed the one before's output (``timeline.stack_of_two``'s check).
    ``team_size`` / ``placement``: WallFacer's teams (its team group and sub-rings traced)."""
    with cpu_compat.planning():
        return _trace_layer(cfg, mode, p, s, world, micro_batch, recompute_modules, tcfg,
                            ring_pass, qkv_backward, cp, full_recompute, cp_comm_type, layers,
                            team_size, placement)


def _clear_sp_scratch() -> None:
    """Empty Megatron's ``GlobalMemoryBuffer`` (the SP all-gather scratch), if it exists."""
    from megatron_metp.measure import layer_probe

    gbuf = layer_probe._global_buffer()
    if gbuf is not None:
        gbuf.buffer.clear()


def _trace_layer(cfg, mode, p, s, world, micro_batch, recompute_modules, tcfg, ring_pass,
                 qkv_backward, cp, full_recompute, cp_comm_type, layers=1, team_size=1,
                 placement="collective_intra") -> List[TraceOp]:
    from torch._subclasses.fake_tensor import FakeTensorMode

    from megatron_metp.measure import layer_probe
    from megatron_metp.measure.planner import FakeWorld, probe_mode, transformer_config

    mode = probe_mode(mode, cp, cp_comm_type)
    world = world or FakeWorld()
    world.setup(mode, p, cp, team_size, placement)
    if tcfg is None:
        tcfg = transformer_config(cfg, p, mode, recompute_modules, ring_pass, qkv_backward,
                                  cp=cp, full_recompute=full_recompute)
    causal = getattr(cfg, "causal", True) if cfg is not None else True
    rope = cfg is not None and cfg.position_embedding_type == "rope"
    _clear_sp_scratch()  # may hold tensors of an earlier FakeTensorMode
    try:
        with FakeTensorMode():
            stack = [layer_probe._layer_step(tcfg, mode, s, micro_batch, causal, rope,
                                             getattr(cfg, "rotary_base", 10000), None, None)
                     for _ in range(layers)]
            x = stack[0][1]
            hooks = []
            for layer, *_ in stack:
                layer_probe.give_main_grads(layer)
                hooks += layer_probe.ddp_grad_hooks(layer)
            if mode == "metp":
                # As a block runs them: each posts the next one's first gathers.
                from megatron_metp.metp.layer_schedule import chain

                chain([layer for layer, *_ in stack])
            grad = torch.empty_like(x)
            with OpRecorder() as rec:
                out = x
                for _layer, _x, _extra, fwd in stack:
                    out = fwd(out)
                rec.phase = "bwd"
                out.backward(grad)
            for hook in hooks:
                hook.remove()
    finally:
        # Megatron's SP all-gather scratch now holds this trace's fake tensors: a real run on the
        # same groups afterwards (metp bench --calibrate's tp) would gather into one of them.
        _clear_sp_scratch()
    roles = group_roles()
    for op in rec.ops:
        if op.kind == "comm":
            op.group = roles.get(op.group, op.group or "world")
    return rec.ops


def summary(ops: List[TraceOp]) -> Dict[str, float]:
    """Totals of a trace: FLOPs, compute bytes, comm payload per group, calls, waits."""
    out: Dict[str, float] = {"flops": 0.0, "compute_bytes": 0.0, "compute_ops": 0,
                             "comm_ops": 0, "waits": 0}
    for op in ops:
        if op.kind == "compute":
            out["flops"] += op.flops
            out["compute_bytes"] += op.bytes
            out["compute_ops"] += 1
        elif op.kind == "comm":
            out["comm_ops"] += 1
            key = f"comm_bytes[{op.group}]"
            out[key] = out.get(key, 0.0) + op.bytes
        else:
            out["waits"] += 1
    return out


def finite(x: float) -> bool:
    return not (math.isnan(x) or math.isinf(x))
