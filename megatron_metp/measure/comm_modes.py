"""Run the same code with its communication serialised or stubbed out, and measure the machine.

``metp bench`` times one training step three ways (the METP paper's Fig. 7):

=====================  ==========================================================================
overlapped             the normal code: ring transfers and async collectives run while the
                       layer computes (double buffering)
``serialised_comm()``  every communication completes before the next computation starts (a
                       dispatch mode over the ``c10d`` ops, ``_Serialise``): collectives are
                       waited for at launch, a ring step's P2P batch before the next kernel;
                       the communication code itself has no switch for it
``stubbed_comm()``     the same computation with no communication at all: every ``c10d`` op
                       returns an already completed ``Work`` without moving data (receive
                       buffers keep whatever they held), so the numbers computed are wrong but
                       the work is the same
=====================  ==========================================================================

communication time = serialised - stubbed (the paper's "Comm" share), computation = stubbed.

Microbenchmarks for Eq. 5's threshold, run on every rank at once (the ranks share the machine as
they do in the benchmark): :func:`matmul_flops` (FLOP/s of a square matmul) and
:func:`ring_bandwidth` (bytes one rank sends per second while every rank sends to its ring
successor and receives from its predecessor, as METP's weight ring does).
"""

from __future__ import annotations

import contextlib
import time
from typing import Dict, Iterator

import torch
import torch.distributed as dist
from torch._C._distributed_c10d import _create_work_from_future
from torch.utils._python_dispatch import TorchDispatchMode

from megatron_metp.comm import RingComm

__all__ = ["serialised_comm", "stubbed_comm", "matmul_flops", "ring_bandwidth", "sync"]

_P2P = ("c10d::send", "c10d::recv_", "c10d::recv_any_source_")
# Set-up ops (group creation, object exchange) are never stubbed: they only run outside the
# timed region, and stubbing them would break the caller's bookkeeping.
_NOT_STUBBED = ("c10d::barrier", "c10d::monitored_barrier_")


def _work_of(out):
    return out[-1] if isinstance(out, tuple) else out


class _Serialise(TorchDispatchMode):
    """Completes every communication before the next operation that is not a P2P launch.

    Collectives are waited for right after their launch. Every rank issues its collectives in
    the same order (SPMD), so completing each one before issuing the next cannot deadlock; the
    later ``handle.wait()`` is then a no-op.

    P2P sends and receives are waited for at the next other operation (a kernel, a copy, a
    collective), not at their own launch: ``batch_isend_irecv`` launches a ring step's sends and
    receives back to back, and waiting for a send before its step's receives are posted would
    deadlock the ring. So a ring's block is in its receive buffer before anything computes on
    the next line after ``commit()``: the METP paper's Fig. 7 "synchronous" setting.
    """

    def __init__(self):
        super().__init__()
        self._p2p: list = []

    def _drain(self) -> None:
        pending, self._p2p = self._p2p, []
        for work in pending:
            work.wait()

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        p2p = func.namespace == "c10d" and func._schema.name in _P2P
        if not p2p:
            self._drain()
        out = func(*args, **(kwargs or {}))
        if func.namespace == "c10d":
            work = _work_of(out)
            if work is not None:
                if p2p:
                    # The caller gets a completed stand-in: a gloo send or receive must be
                    # waited for exactly once (a second wait blocks for another message).
                    self._p2p.append(dist.distributed_c10d.Work.unbox(work))
                    return _done_work()
                dist.distributed_c10d.Work.unbox(work).wait()
        return out

    def __exit__(self, *exc):
        self._drain()
        return super().__exit__(*exc)


def _done_work():
    """A boxed ``Work`` that has already completed."""
    fut = torch.futures.Future()
    fut.set_result([])
    return _create_work_from_future(fut).boxed()


class _Stub(TorchDispatchMode):
    """Replaces every c10d op by a completed ``Work``; the op's tensors are returned untouched."""

    def __init__(self):
        super().__init__()
        self.stubbed_calls = 0

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        kwargs = kwargs or {}
        if func.namespace != "c10d" or func._schema.name in _NOT_STUBBED:
            return func(*args, **kwargs)
        self.stubbed_calls += 1
        work = _done_work()
        if len(func._schema.returns) == 1:
            return work  # send, recv_, alltoall_base_, ...: Work only
        # (tensors, Work): the first argument is always the op's output tensor(s).
        first = func._schema.arguments[0].name
        bound = {a.name: v for a, v in zip(func._schema.arguments, args)}
        bound.update(kwargs)
        return bound[first], work


@contextlib.contextmanager
def serialised_comm() -> Iterator[None]:
    """No overlap: each communication finishes before the computation after it starts."""
    with _Serialise():
        yield


@contextlib.contextmanager
def stubbed_comm() -> Iterator[_Stub]:
    """Computation only: communication ops complete at once and move nothing (see module doc).

    Flush-to-zero is on inside: stale receive buffers may hold denormals, which would make CPU
    arithmetic slower than on real data.
    """
    flush = torch.set_flush_denormal(True)
    stub = _Stub()
    try:
        with stub:
            yield stub
    finally:
        if flush:
            torch.set_flush_denormal(False)


def sync(device: torch.device) -> None:
    """Wait for queued device work before reading a clock (GPU only; CPU work is synchronous)."""
    if device.type == "cuda":
        torch.cuda.synchronize(device)


def matmul_flops(n: int = 512, iters: int = 10, dtype=torch.float32,
                 device: torch.device = torch.device("cpu")) -> float:
    """FLOP/s of ``[n, n] @ [n, n]`` on this rank, best of ``iters`` (2 n^3 FLOPs per product)."""
    a = torch.randn(n, n, dtype=dtype, device=device)
    b = torch.randn(n, n, dtype=dtype, device=device)
    a @ b  # warm-up (thread pool, kernel selection)
    times = []
    for _ in range(iters):
        sync(device)
        t0 = time.perf_counter()
        a @ b
        sync(device)
        times.append(time.perf_counter() - t0)
    return 2 * n**3 / min(times)


def ring_bandwidth(group=None, sizes_bytes=(1 << 12, 1 << 22), iters: int = 8,
                   device: torch.device = torch.device("cpu")) -> Dict[str, float]:
    """One ring step (send to rank + 1, receive from rank - 1, all ranks at once), timed.

    Returns ``bandwidth``: bytes one rank sends per second in a step of the largest size, its
    latency included (an effective bandwidth, as the METP paper quotes NCCL's at 1 MB);
    ``latency``: seconds of a step of the smallest size; and ``step_s_<bytes>`` per size. Each
    step counts on the slowest rank (it ends when every rank has its block); the best of
    ``iters`` steps is kept, since on a shared machine other jobs only add time.
    """
    comm = RingComm(group)
    out: Dict[str, float] = {}
    for size in sizes_bytes:
        send = torch.ones(size // 4, dtype=torch.float32, device=device)
        recv = torch.empty_like(send)
        times = []
        for i in range(iters + 1):
            dist.barrier(group)
            sync(device)
            t0 = time.perf_counter()
            comm.send_recv(send, recv)
            comm.commit()
            comm.wait()
            sync(device)
            t = torch.tensor([time.perf_counter() - t0], dtype=torch.float64, device=device)
            dist.all_reduce(t, op=dist.ReduceOp.MAX, group=group)
            if i:  # the first step sets up the connection
                times.append(float(t))
        out[f"step_s_{size}"] = min(times)
    small, large = min(sizes_bytes), max(sizes_bytes)
    out["latency"] = out[f"step_s_{small}"]
    out["bandwidth"] = large / out[f"step_s_{large}"]
    return out
