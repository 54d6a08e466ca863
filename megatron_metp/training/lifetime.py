"""Helper processes that end with the process that started them.

Megatron-Core's dist-checkpoint writer (``strategies.filesystem_async``) keeps, per saving rank,
a ``multiprocessing`` Manager (a spawned server process, ~270 MB) for its results queue, created
on the first save and never shut down. A rank that is SIGKILLed (an OOM kill, a lost peer's
torchrun sending SIGTERM to the survivors) runs no exit handler, so that Manager and
multiprocessing's resource tracker lived on with PPID 1. :func:`own_checkpoint_helpers` creates
the queue first, served by a Manager that the kernel kills when its parent dies
(``PR_SET_PDEATHSIG``) and that ignores the stop signals its rank handles; the resource tracker
then sees its last client gone and exits by itself.

Linux only (prctl); elsewhere the Manager is created as Megatron would create it.
"""

from __future__ import annotations

import os
import signal
import sys

_MANAGERS: list = []  # keeps the Manager alive as long as this process


def die_with_parent() -> None:
    """In a child process: ask the kernel to SIGKILL it when its parent thread exits."""
    if not sys.platform.startswith("linux"):
        return
    import ctypes

    pr_set_pdeathsig = 1  # <linux/prctl.h>
    parent = os.getppid()
    libc = ctypes.CDLL(None, use_errno=True)
    if libc.prctl(pr_set_pdeathsig, int(signal.SIGKILL), 0, 0, 0) != 0:
        return
    if os.getppid() != parent:  # the parent died before prctl took effect
        os._exit(1)


def _checkpoint_helper_init() -> None:
    """The Manager's start: die with the rank, and leave SIGTERM / SIGINT to the rank. A
    scheduler stopping a job signals every process of the step; the rank then finishes its
    iteration and saves (``--exit-signal-handler``), which needs this helper alive."""
    die_with_parent()
    signal.signal(signal.SIGTERM, signal.SIG_IGN)
    signal.signal(signal.SIGINT, signal.SIG_IGN)


def own_checkpoint_helpers() -> bool:
    """Give Megatron's dist-checkpoint writer its results queue, served by a Manager that dies
    with this process. Call before the first ``dist_checkpointing.save``; returns whether the
    queue was installed (False: Megatron already has one, or this megatron-core has no such
    queue, and then it behaves as before)."""
    try:
        from megatron.core.dist_checkpointing.strategies import filesystem_async as fsa
    except ImportError:  # pragma: no cover - megatron-core without the async writer
        return False
    if getattr(fsa, "_results_queue", False) is not None:
        return False
    import multiprocessing as mp
    from multiprocessing.managers import SyncManager

    # Megatron creates it from the spawn context (a fork would copy CUDA state); so does this.
    manager = SyncManager(ctx=mp.get_context("spawn"))
    manager.start(_checkpoint_helper_init)
    _MANAGERS.append(manager)
    fsa._results_queue = manager.Queue()
    return True
