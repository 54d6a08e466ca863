"""Count the communication a region performs, per op type and per rank, from the c10d ops it runs.

``CommCounter`` is a ``TorchDispatchMode``: every ``torch.distributed`` collective and P2P call
(eager ``c10d::*`` ops and the ``_c10d_functional::*`` ones) passes through the dispatcher, inside
autograd backward too (the autograd engine carries dispatch modes to its threads), in real runs
and under ``FakeTensorMode`` with the ``fake`` process-group backend. Nothing is patched.

    with CommCounter() as cc:
        out = layer(x); out.sum().backward()
    cc.stats["send"].elements      # elements this rank sent point-to-point
    cc.sent_elements()             # everything, in the papers' per-rank "volume" convention

Counting convention (``elements`` / ``bytes`` of a record): the *payload*
---------------------------------------------------------------------------
The size of the full logical buffer of one call, as seen by this rank (NCCL-tests' message size):

==================  =========================================================================
op (key)            payload S
==================  =========================================================================
``all_gather``      the gathered **output** (p x this rank's input)
``reduce_scatter``  the **input** (p x this rank's output)
``all_reduce``      the buffer
``broadcast``       the buffer (counted once per call, on every rank, root or not)
``reduce``          the buffer (likewise)
``all_to_all``      the input (= the output)
``gather``          p x this rank's input;  ``scatter``: p x this rank's output
``send``            the tensor sent;  ``recv``: the tensor received (from ``irecv``/``recv``)
``barrier``         0
==================  =========================================================================

P2P: every ``isend``/``irecv``/``send``/``recv`` is one call, including those issued inside
``batch_isend_irecv`` (which on NCCL wraps them in a coalescing group but still dispatches each
op); a batch of k sends counts k ``send`` calls. Coalesced collectives
(``allreduce_coalesced``, ``all_gather_into_tensor_coalesced``, ...) count one call whose payload
is the sum over their tensors. List variants (``all_gather`` into a list, ``reduce_scatter`` from
a list) count the sum over the list, like their single-tensor forms. Completion ops
(``wait_tensor``) are not communication and are ignored.

Converting to the papers' conventions: :func:`sent_elements`
------------------------------------------------------------
METP Sec. 3.2 and Megatron's analysis count the elements *one rank sends* under the
bandwidth-optimal ring algorithms: all-gather and reduce-scatter move (p-1)/p S, all-reduce
2(p-1)/p S, all-to-all (p-1)/p S, a P2P send S (a receive 0: it is the peer's send). Broadcast and
reduce have no single convention: METP Sec. 4.2 counts log2(p) S (a binomial tree);
``broadcast_model="ring"`` gives the per-rank mean of a pipelined chain, (p-1)/p S.
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Any, Dict, Iterable, List, Optional

import torch
from torch.utils._python_dispatch import TorchDispatchMode

__all__ = ["CommCounter", "CommEvent", "OpStats", "sent_elements", "OPS"]

OPS = (
    "all_gather",
    "reduce_scatter",
    "all_reduce",
    "broadcast",
    "reduce",
    "all_to_all",
    "gather",
    "scatter",
    "send",
    "recv",
    "barrier",
)

# op name -> (key, argument holding the payload, how to size it)
#   "sum":      sum of numels of the tensor / tensor list
#   "first":    a list of lists: sum of the first inner list (the per-rank list of one call)
#   "times_p":  sum of numels times the group size (the arg is this rank's share)
_C10D: Dict[str, tuple] = {
    "_allgather_base_": ("all_gather", "output_tensor", "sum"),
    "allgather_": ("all_gather", "output_tensors", "first"),
    "allgather_coalesced_": ("all_gather", "output_lists", "sum"),
    "allgather_into_tensor_coalesced_": ("all_gather", "outputs", "sum"),
    "_reduce_scatter_base_": ("reduce_scatter", "input_tensor", "sum"),
    "reduce_scatter_": ("reduce_scatter", "input_tensors", "first"),
    "reduce_scatter_tensor_coalesced_": ("reduce_scatter", "inputs", "sum"),
    "allreduce_": ("all_reduce", "tensors", "sum"),
    "allreduce_coalesced_": ("all_reduce", "tensors", "sum"),
    "broadcast_": ("broadcast", "tensors", "sum"),
    "reduce_": ("reduce", "tensors", "sum"),
    "alltoall_base_": ("all_to_all", "input", "sum"),
    "alltoall_": ("all_to_all", "input_tensors", "sum"),
    "gather_": ("gather", "input_tensors", "times_p"),
    "scatter_": ("scatter", "output_tensors", "times_p"),
    "send": ("send", "tensors", "sum"),
    "recv_": ("recv", "tensors", "sum"),
    "recv_any_source_": ("recv", "tensors", "sum"),
    "barrier": ("barrier", None, "sum"),
    "monitored_barrier_": ("barrier", None, "sum"),
}
_FUNCTIONAL: Dict[str, tuple] = {
    "all_gather_into_tensor": ("all_gather", "input", "times_p"),
    "all_gather_into_tensor_out": ("all_gather", "input", "times_p"),
    "all_gather_into_tensor_coalesced": ("all_gather", "inputs", "times_p"),
    "reduce_scatter_tensor": ("reduce_scatter", "input", "sum"),
    "reduce_scatter_tensor_out": ("reduce_scatter", "input", "sum"),
    "reduce_scatter_tensor_coalesced": ("reduce_scatter", "inputs", "sum"),
    "all_reduce": ("all_reduce", "input", "sum"),
    "all_reduce_": ("all_reduce", "input", "sum"),
    "all_reduce_coalesced": ("all_reduce", "inputs", "sum"),
    "all_reduce_coalesced_": ("all_reduce", "inputs", "sum"),
    "all_to_all_single": ("all_to_all", "input", "sum"),
    "broadcast": ("broadcast", "input", "sum"),
    "broadcast_": ("broadcast", "input", "sum"),
}


@dataclass
class CommEvent:
    """One communication call: payload S (see the module docstring) and its group size p."""

    op: str
    elements: int
    bytes: int
    group_size: Optional[int]
    aten: str
    peer: Optional[int] = None
    group: str = ""  # the process group's name: one group = one NCCL communicator and stream
    dtype: str = ""  # the first tensor's dtype and the shapes of the call's tensors: what NCCL
    shape: tuple = ()  # needs equal on every member (tests/test_collective_order.py)


@dataclass
class OpStats:
    calls: int = 0
    elements: int = 0
    bytes: int = 0


def _tensors(x: Any) -> List[torch.Tensor]:
    if isinstance(x, torch.Tensor):
        return [x]
    if isinstance(x, (list, tuple)):
        return [t for item in x for t in _tensors(item)]
    return []


def _group_size_of_pg(pg: Any) -> Optional[int]:
    try:
        return torch.distributed.ProcessGroup.unbox(pg).size()
    except Exception:  # noqa: BLE001 - a fake or foreign object: the size is simply unknown
        size = getattr(pg, "size", None)
        try:
            return int(size()) if callable(size) else None
        except Exception:  # noqa: BLE001
            return None


def _group_name_of_pg(pg: Any) -> str:
    try:
        return str(torch.distributed.ProcessGroup.unbox(pg).group_name)
    except Exception:  # noqa: BLE001 - a fake or foreign object: no name
        return ""


def _group_size_of_name(name: str) -> Optional[int]:
    try:
        from torch.distributed.distributed_c10d import _resolve_process_group

        return _resolve_process_group(name).size()
    except Exception:  # noqa: BLE001
        return None


def sent_elements(
    op: str, payload: float, group_size: int, broadcast_model: str = "tree"
) -> float:
    """Elements one rank sends for one call of ``op`` with payload S (the papers' volume).

    all_gather / reduce_scatter / all_to_all / gather / scatter: (p-1)/p S;  all_reduce:
    2(p-1)/p S;  send: S;  recv, barrier: 0;  broadcast / reduce: log2(p) S for
    ``broadcast_model="tree"`` (METP Sec. 4.2), (p-1)/p S for ``"ring"`` (per-rank mean of a
    pipelined chain).
    """
    p = group_size
    if op in ("recv", "barrier") or p <= 1 and op != "send":
        return 0.0
    if op in ("all_gather", "reduce_scatter", "all_to_all", "gather", "scatter"):
        return (p - 1) / p * payload
    if op == "all_reduce":
        return 2 * (p - 1) / p * payload
    if op == "send":
        return float(payload)
    if op in ("broadcast", "reduce"):
        if broadcast_model == "tree":
            return math.log2(p) * payload
        if broadcast_model == "ring":
            return (p - 1) / p * payload
        raise ValueError(f"broadcast_model must be 'tree' or 'ring', got {broadcast_model!r}")
    raise ValueError(f"unknown communication op {op!r}")


class CommCounter(TorchDispatchMode):
    """A dispatch mode that records every c10d collective and P2P op of its region on this rank.

    Attributes
        events  list of :class:`CommEvent`, in issue order
        stats   ``{op: OpStats(calls, elements, bytes)}`` over ``OPS`` (payload convention)

    Usable as a context manager around forward and backward; it may be re-entered and nested
    (each instance counts the ops issued while it is active). Under ``FakeTensorMode`` enter the
    counter *inside* the fake mode so that it sees the ops before the fake mode handles them.
    """

    def __init__(self) -> None:
        super().__init__()
        self.events: List[CommEvent] = []

    # -- recording ---------------------------------------------------------------------------

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        kwargs = kwargs or {}
        ns = func.namespace
        if ns == "c10d" or ns == "_c10d_functional":
            self._record(func, args, kwargs)
        return func(*args, **kwargs)

    def _record(self, func, args, kwargs) -> None:
        name = func._schema.name.split("::", 1)[1]
        table = _C10D if func.namespace == "c10d" else _FUNCTIONAL
        spec = table.get(name)
        if spec is None:
            return  # wait_tensor, _wrap_tensor_autograd and the like: not communication
        op, arg_name, how = spec
        bound = {a.name: v for a, v in zip(func._schema.arguments, args)}
        bound.update(kwargs)
        group = str(bound.get("group_name", ""))
        if func.namespace == "c10d":
            pg = bound.get("process_group")
            group_size = _group_size_of_pg(pg) if pg is not None else None
            group = _group_name_of_pg(pg) if pg is not None else ""
        elif "group_size" in bound:
            group_size = int(bound["group_size"])
        else:
            group_size = _group_size_of_name(bound.get("group_name", ""))
        if arg_name is None:
            tensors: List[torch.Tensor] = []
        elif how == "first":
            outer = bound[arg_name]
            tensors = _tensors(outer[0]) if len(outer) else []
        else:
            tensors = _tensors(bound[arg_name])
        numel = sum(t.numel() for t in tensors)
        nbytes = sum(t.numel() * t.element_size() for t in tensors)
        if how == "times_p":
            factor = group_size if group_size is not None else 1
            numel, nbytes = numel * factor, nbytes * factor
        peer = bound.get("dst", bound.get("src"))
        self.events.append(
            CommEvent(op, int(numel), int(nbytes), group_size, name,
                      int(peer) if peer is not None else None, group,
                      str(tensors[0].dtype) if tensors else "",
                      tuple(tuple(t.shape) for t in tensors))
        )

    # -- results -----------------------------------------------------------------------------

    def reset(self) -> None:
        self.events = []

    @property
    def stats(self) -> Dict[str, OpStats]:
        out = {op: OpStats() for op in OPS}
        for e in self.events:
            s = out[e.op]
            s.calls += 1
            s.elements += e.elements
            s.bytes += e.bytes
        return out

    def calls(self, ops: Optional[Iterable[str]] = None) -> int:
        return sum(1 for e in self._select(ops))

    def payload_elements(self, ops: Optional[Iterable[str]] = None) -> int:
        return sum(e.elements for e in self._select(ops))

    def payload_bytes(self, ops: Optional[Iterable[str]] = None) -> int:
        return sum(e.bytes for e in self._select(ops))

    def sent_elements(
        self, ops: Optional[Iterable[str]] = None, broadcast_model: str = "tree"
    ) -> float:
        """Elements this rank sent, in the papers' convention (see :func:`sent_elements`)."""
        total = 0.0
        for e in self._select(ops):
            if e.group_size is None and e.op not in ("send", "recv", "barrier"):
                raise ValueError(f"group size of a {e.aten} call is unknown; cannot convert")
            total += sent_elements(e.op, e.elements, e.group_size or 1, broadcast_model)
        return total

    def sent_bytes(
        self, ops: Optional[Iterable[str]] = None, broadcast_model: str = "tree"
    ) -> float:
        total = 0.0
        for e in self._select(ops):
            per_elem = e.bytes / e.elements if e.elements else 0
            total += per_elem * sent_elements(e.op, e.elements, e.group_size or 1,
                                              broadcast_model)
        return total

    def table(self) -> str:
        """A Markdown table of calls, payload elements and bytes per op (ops seen only)."""
        rows = ["| op | calls | payload elements | payload bytes |", "|---|---:|---:|---:|"]
        for op, s in self.stats.items():
            if s.calls:
                rows.append(f"| {op} | {s.calls} | {s.elements} | {s.bytes} |")
        return "\n".join(rows)

    def _select(self, ops: Optional[Iterable[str]]):
        if ops is None:
            return list(self.events)
        wanted = {ops} if isinstance(ops, str) else set(ops)
        unknown = wanted - set(OPS)
        if unknown:
            raise ValueError(f"unknown op names {sorted(unknown)}; choose from {OPS}")
        return [e for e in self.events if e.op in wanted]
