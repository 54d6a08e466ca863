"""Run test bodies on N gloo ranks, in a pool of processes that is reused across tests.

Starting ranks costs several seconds each (importing torch and megatron.core) and CI has two
cores, so the workers fork from a server that imported them once, and each world size gets one
pool of worker processes per pytest session. A test sends a
module-level function (pickled by reference); every rank runs it and returns a picklable
result. After each task the workers reset Megatron's and the plugin's parallel state.

Failure handling: if any rank raises, or the task does not finish within ``timeout`` seconds,
the pool is killed (so a rank stuck in a collective cannot hang the suite) and the test fails
with every rank's traceback, the first one reported named. A failed rank reports at once and
then waits, its groups open, until the pool ends it. A rank that has not reported when the
pool gives up is first asked for each of its threads' Python stacks (faulthandler, on a
real-time signal), and the failure shows where it was: a rank that fails often leaves its peer
waiting in a collective. The next test starts a fresh pool.
"""

from __future__ import annotations

import datetime
import os
import queue
import shutil
import signal
import socket
import tempfile
import time
import traceback
from typing import Any, Callable, Dict, List

import torch.multiprocessing as mp

# Workers fork from a server process that has imported torch and Megatron-Core once (~5 s of
# CPU a rank under "spawn", which re-imports them in every worker: an 8-rank pool started in 23 s
# on 2 cores, in 7 s this way, the server's own imports included, and a later pool in ~1 s).
# Each worker is still a new process with its own state; only the imports are shared, and with
# them the interpreter's hash salt: ranks here order sets of strings alike, where torchrun's
# ranks (separate interpreters) may not. The launched runs (metp train, pretrain_gpt.py, SLURM,
# the docs tier) keep covering that.
_CTX = mp.get_context("forkserver")
_PRELOAD = ["torch", "torch.distributed", "megatron.core", "megatron.core.models.gpt",
            "megatron.core.optimizer", "megatron.core.distributed", "tests._harness"]
_SERVER_STARTED = [False]
# The environment the server (and so every worker) starts with: the session's, as conftest
# leaves it at start-up (freeze_env), not that of whichever test first needs a pool (a test's
# monkeypatched variables would otherwise reach every later worker).
_ENV: Dict[str, str] = {}


def freeze_env() -> None:
    _ENV.clear()
    _ENV.update(os.environ)


def _start_server() -> None:
    """Start the fork server once, importing :data:`_PRELOAD`, in the session's environment with
    CUDA hidden: a worker decides CPU or GPU from ``torch.cuda.is_available()``, which must not
    see a GPU on a GPU machine (the CPU tier; tests/test_gpu.py starts its own processes), and a
    process that has touched CUDA must not fork."""
    if _SERVER_STARTED[0]:
        return
    from multiprocessing import forkserver

    _CTX.set_forkserver_preload(_PRELOAD)
    saved = dict(os.environ)
    os.environ.clear()
    os.environ.update(_ENV or saved, CUDA_VISIBLE_DEVICES="")
    try:
        forkserver.ensure_running()
    finally:
        os.environ.clear()
        os.environ.update(saved)
    _SERVER_STARTED[0] = True


def _free_port() -> int:
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _reset_state(baseline) -> None:
    """Undo what a task set up: ``destroy_parallel`` (Megatron's and the plugin's groups and
    state), then end any other group the task created itself (``new_group`` in a test body), so
    that no task leaves gloo threads or sockets to the next. ``baseline``: the groups that
    existed before the first task (none but the world group)."""
    import gc

    from megatron_metp import parallel_state as ps
    from megatron_metp.model import destroy_parallel

    destroy_parallel()
    ps.destroy_groups(ps.live_groups() - baseline)
    gc.collect()  # modules of the finished task may still hold group handles


def _read(path: str) -> str:
    """A file's text; empty if it is not there (a rank that has not started yet)."""
    try:
        with open(path) as f:
            return f.read()
    except OSError:
        return ""


_STACK_FILE: list = []  # a worker's file for faulthandler's stacks, open for its lifetime
# The signal that asks a rank for its stacks: one no rank handles otherwise (metp train's
# --exit-signal takes SIGTERM, SIGINT, SIGUSR1 or SIGUSR2).
STACK_SIGNAL = signal.SIGRTMIN + 2


def _worker(rank: int, world_size: int, port: int, tasks, results, stack_path: str) -> None:
    os.environ["MASTER_ADDR"] = "127.0.0.1"
    os.environ["MASTER_PORT"] = str(port)
    os.environ["RANK"] = str(rank)
    os.environ["WORLD_SIZE"] = str(world_size)
    os.environ["LOCAL_RANK"] = str(rank)
    # The CPU tier stays on the CPU on a GPU machine too: cpu_compat (and so Megatron's device
    # choices) follow torch.cuda.is_available(), and gloo ranks must not all open GPU 0.
    os.environ["CUDA_VISIBLE_DEVICES"] = ""
    import faulthandler

    # A rank that dies in native code (a signal) prints every thread's Python stack to its
    # stderr, which pytest shows with the failure.
    faulthandler.enable(all_threads=True)
    # On STACK_SIGNAL, every thread's Python stack goes to a file the pool reads when this rank
    # has not reported in time (RankPool.run); the rank carries on after writing it.
    _STACK_FILE.append(open(stack_path, "w"))
    faulthandler.register(STACK_SIGNAL, file=_STACK_FILE[0], all_threads=True)
    import torch
    import torch.distributed as dist

    # Two CI cores shared by up to 8 ranks: more intra-op threads only add contention.
    torch.set_num_threads(1)
    # A worker serves many tests, and Megatron's fused functions (bias-dropout-add, bias-GeLU,
    # SwiGLU) are torch.compile'd: each new shape, dtype or requires_grad compiles another
    # variant. Past dynamo's limit of 8 a new variant runs eagerly instead, and eager dropout
    # draws other masks than the compiled one. A full-recompute run then differed from the
    # same run without recompute from iteration 1 on (its no-grad forward ran eagerly, its
    # recomputation compiled), though only in workers that had served earlier tests; in a fresh
    # process every variant compiles (NVIDIA/Megatron-LM#1888 is the same limit in training).
    # A limit no session reaches keeps every task's results those of a fresh process without
    # compiling again for each task (torch._dynamo.reset() per task: 124 -> 135 s on four model
    # and training test files).
    import torch._dynamo

    torch._dynamo.config.recompile_limit = 4096
    torch._dynamo.config.accumulated_recompile_limit = 1 << 16
    dist.init_process_group(
        "gloo", rank=rank, world_size=world_size, timeout=datetime.timedelta(seconds=90)
    )
    from megatron_metp import cpu_compat

    cpu_compat.apply()
    from megatron_metp import parallel_state as ps

    baseline = ps.live_groups()
    while True:
        task = tasks.get()
        if task is None:
            break
        fn, args, kwargs = task
        try:
            out = fn(*args, **kwargs)
            ok = True
        except BaseException:  # noqa: BLE001 - report everything to the parent
            out, ok = traceback.format_exc(), False
        # Threads at the task's end (before its groups are ended: the worker's peak).
        threads = len(os.listdir("/proc/self/task"))
        if ok:
            try:
                _reset_state(baseline)
            except BaseException:  # noqa: BLE001 - a failed tear-down fails the task
                out, ok = traceback.format_exc(), False
        if not ok:
            # Reported at once, with no tear-down, which can block (in a collective with a
            # peer that has gone on) or crawl on a loaded machine past the pool's grace.
            # Then the rank waits, its groups open, until the pool ends it: a peer blocked in a
            # collective with it stays there, and the pool shows where, instead of the peer
            # failing with gloo's "Connection closed by peer".
            results.put((rank, ok, out, (threads, threads)))
            while tasks.get() is not None:
                pass
            break
        results.put((rank, ok, out, (threads, len(os.listdir("/proc/self/task")))))
    dist.destroy_process_group()


class RankPool:
    """``world_size`` gloo ranks waiting for tasks."""

    def __init__(self, world_size: int, keeps_workers: bool = True):
        self.world_size = world_size
        self.keeps_workers = keeps_workers  # False: the workers end with the task
        # After one rank fails, how long the others have to report their own error before the
        # pool is killed (they may wait forever in a collective with the failed one).
        self.grace = 15.0
        _start_server()
        port = _free_port()
        self._tasks = [_CTX.Queue() for _ in range(world_size)]
        self._results = _CTX.Queue()
        self._stack_dir = tempfile.mkdtemp(prefix="metp-rank-stacks-")
        self._procs = [
            _CTX.Process(
                target=_worker,
                args=(r, world_size, port, self._tasks[r], self._results, self._stack_path(r)),
                daemon=True,
            )
            for r in range(world_size)
        ]
        for p in self._procs:
            p.start()

    def alive(self) -> bool:
        return all(p.is_alive() for p in self._procs)

    def _stack_path(self, rank: int) -> str:
        return os.path.join(self._stack_dir, f"rank{rank}.txt")

    def _silent_ranks(self, reported) -> str:
        """The Python stacks of the live ranks not in ``reported``, each asked by
        :data:`STACK_SIGNAL`, as text for a failure message (empty if every rank reported)."""
        asked = [r for r, p in enumerate(self._procs) if r not in reported and p.is_alive()]
        for r in asked:
            try:
                os.kill(self._procs[r].pid, STACK_SIGNAL)
            except ProcessLookupError:
                pass
        # faulthandler writes from a C signal handler, so a rank blocked in a collective
        # writes too; wait until every file has stopped growing (at most ~5 s in all).
        stacks: Dict[int, str] = {}
        for _ in range(50):
            time.sleep(0.1)
            before, stacks = stacks, {r: _read(self._stack_path(r)) for r in asked}
            if all(stacks.values()) and stacks == before:
                break
        return "".join(f"\n--- rank {r} did not report; its threads' Python stacks ---\n"
                       + (stacks.get(r) or "(nothing written within 5 s)\n") for r in asked)

    def _give_up(self, reported) -> str:
        """The silent ranks' stacks (:meth:`_silent_ranks`), then the pool killed, whatever
        happens while asking."""
        try:
            return self._silent_ranks(reported)
        finally:
            self.close(kill=True)

    def run(self, fn: Callable, *args, timeout: float = 300.0, **kwargs) -> List[Any]:
        for q in self._tasks:
            q.put((fn, args, kwargs))
        outs: Dict[int, Any] = {}
        errors: Dict[int, str] = {}
        deadline = datetime.datetime.now() + datetime.timedelta(seconds=timeout)
        while len(outs) + len(errors) < self.world_size:
            left = (deadline - datetime.datetime.now()).total_seconds()
            try:
                rank, ok, val, threads = self._results.get(timeout=max(left, 0.1))
            except queue.Empty:
                if errors:
                    break
                missing = sorted(set(range(self.world_size)) - set(outs) - set(errors))
                silent = self._give_up(set(outs))
                raise TimeoutError(
                    f"{fn.__name__}: ranks {missing} did not finish within {timeout:.0f} s"
                    + silent
                )
            PEAK_THREADS[:] = max(PEAK_THREADS, [threads[0], fn.__name__, threads[1]])
            if self.keeps_workers and ok:  # what a later task would inherit
                AFTER_RESET[0] = max(AFTER_RESET[0], threads[1])
            if ok:
                outs[rank] = val
            else:
                errors[rank] = val
                # The other ranks may now wait forever in a collective with the failed one:
                # give them a short grace period to report their own error, then kill.
                deadline = min(deadline,
                               datetime.datetime.now() + datetime.timedelta(seconds=self.grace))
        if errors:
            # Ranks that died without reporting (a native crash, a signal): name them.
            dead = [f"rank {r} exit code {p.exitcode}" for r, p in enumerate(self._procs)
                    if not p.is_alive() and r not in errors]
            silent = self._give_up(set(outs) | set(errors))
            raise AssertionError(
                f"{fn.__name__} failed on ranks {sorted(errors)} (first reported: rank "
                f"{next(iter(errors))})"
                + (f" ({'; '.join(dead)})" if dead else "")
                + "".join(f"\n--- rank {r} ---\n{e}" for r, e in sorted(errors.items()))
                + silent
            )
        return [outs[r] for r in range(self.world_size)]

    def close(self, kill: bool = False) -> None:
        if kill:
            for p in self._procs:
                if p.is_alive():
                    p.kill()
        else:
            for q in self._tasks:
                q.put(None)
        for p in self._procs:
            p.join(timeout=10)
            if p.is_alive():
                p.kill()
        self._procs = []
        shutil.rmtree(self._stack_dir, ignore_errors=True)


_POOLS: Dict[int, RankPool] = {}
# Most threads any rank worker held at the end of a task: [count, task, count after reset];
# and the most any worker kept after its reset (what a later task inherits).
PEAK_THREADS: list = [0, "", 0]
AFTER_RESET = [0]


def run_ranks(world_size: int, fn: Callable, *args, timeout: float = 300.0, **kwargs) -> List[Any]:
    """Run ``fn(*args, **kwargs)`` on ``world_size`` gloo ranks; return the per-rank results."""
    pool = _POOLS.get(world_size)
    if pool is None or not pool._procs or not pool.alive():
        if pool is not None:
            pool.close(kill=True)  # a rank of it died between tasks: end the others
        pool = _POOLS[world_size] = RankPool(world_size)
    try:
        return pool.run(fn, *args, timeout=timeout, **kwargs)
    finally:
        if not pool._procs:
            _POOLS.pop(world_size, None)


def run_in_own_workers(world_size: int, fn: Callable, *args, timeout: float = 300.0,
                       **kwargs) -> List[Any]:
    """:func:`run_ranks` in workers that end with the task, for tasks that may leave threads
    behind: Megatron-FSDP's runs (tests/test_megatron_fsdp.py). Megatron's DDP and
    DistributedOptimizer no longer need it: ``destroy_parallel`` breaks the autograd-hook cycle
    that kept their gloo groups alive (``megatron_metp.model.release_ddp_hooks``)."""
    pool = RankPool(world_size, keeps_workers=False)
    try:
        return pool.run(fn, *args, timeout=timeout, **kwargs)
    finally:
        pool.close()


def close_pools() -> None:
    """End every pool, then the fork server (it would outlive the suite otherwise, and the
    suite's end checks that nothing it started is left running)."""
    for pool in _POOLS.values():
        if pool._procs:
            pool.close()
    _POOLS.clear()
    if _SERVER_STARTED[0]:
        from multiprocessing import forkserver

        forkserver._forkserver._stop()  # closes its pipe and waits for it to exit
        _SERVER_STARTED[0] = False
