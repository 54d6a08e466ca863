"""Starting the ranks of a distributed ``metp`` subcommand, and parsing its mode lists.

:func:`launch_or_run`: under an existing launcher (``torchrun`` sets RANK/WORLD_SIZE; ``srun``
sets SLURM_PROCID/SLURM_NTASKS) the command runs in place; otherwise it starts
``python -m torch.distributed.run --standalone`` with ``--nproc-per-node`` ranks (default: 4 on
CPU with gloo, every visible GPU with NCCL) running the same ``metp`` command. Used by
``metp train`` and ``metp bench``; it imports nothing of the package, so both can use it.
"""

from __future__ import annotations

import argparse
import os
import subprocess
import sys
from typing import Callable, List, Optional, Tuple




def _slurm_env() -> bool:
    """Under ``srun`` with several tasks and no torchrun: take the ranks from SLURM."""
    if "SLURM_PROCID" not in os.environ or int(os.environ.get("SLURM_NTASKS", "1")) <= 1:
        return False
    if "MASTER_ADDR" not in os.environ or "MASTER_PORT" not in os.environ:
        raise ValueError("running under srun with several tasks: export MASTER_ADDR (the first "
                         "node's host name) and MASTER_PORT before srun, or run one task per "
                         "node that starts torchrun (see scripts/slurm/)")
    os.environ.setdefault("RANK", os.environ["SLURM_PROCID"])
    os.environ.setdefault("WORLD_SIZE", os.environ["SLURM_NTASKS"])
    os.environ.setdefault("LOCAL_RANK", os.environ.get("SLURM_LOCALID", "0"))
    return True


def under_launcher() -> bool:
    if "RANK" in os.environ and "WORLD_SIZE" in os.environ:
        return True
    return _slurm_env()


def default_nproc() -> int:
    import torch

    return torch.cuda.device_count() if torch.cuda.is_available() else 4


# Where rank 0 of a run this launcher started records how far it got when Ctrl-C stopped it
# (a JSON object, written whole by rename), for the launcher's one line.
INTERRUPT_FILE = "METP_INTERRUPT_FILE"
INTERRUPTED = 130   # the shell's code for a run ended by SIGINT


def launch_or_run(argv: List[str], nproc: Optional[int], run: Callable[[], int],
                  preflight: Optional[Callable[[int], None]] = None,
                  interrupted: Optional[Callable[[Optional[dict]], str]] = None) -> int:
    """Run in place under a launcher; otherwise start ``nproc`` ranks of ``metp ARGV``.

    ``preflight(world_size)`` runs first in the launching process: a configuration error then
    fails once, before any rank starts. ``interrupted(progress)`` makes the line printed when
    Ctrl-C stops the run, from what rank 0 wrote to ``$METP_INTERRUPT_FILE`` (None if nothing).
    """
    if under_launcher():
        return run()
    n = default_nproc() if nproc is None else nproc
    if n < 1:
        raise ValueError(f"--nproc-per-node {n}: must be >= 1 (ranks to launch on this node)")
    if preflight is not None:
        preflight(n)
    cmd = [sys.executable, "-m", "torch.distributed.run", "--standalone",
           f"--nproc-per-node={n}", "-m", "megatron_metp.training.cli", *argv]
    env = dict(os.environ)
    # Several CPU ranks share the cores: one intra-op thread each avoids oversubscription.
    env.setdefault("OMP_NUM_THREADS", "1")
    print(f"[metp] launching {n} ranks: {' '.join(cmd[1:])}", flush=True)
    import tempfile

    with tempfile.TemporaryDirectory(prefix="metp-run-") as tmp:
        env[INTERRUPT_FILE] = os.path.join(tmp, "interrupted.json")
        rc = run_process_group(cmd, env)
        if rc == INTERRUPTED:
            print(interrupted(_read_progress(env[INTERRUPT_FILE])) if interrupted else
                  "[metp] interrupted (Ctrl-C)", flush=True)
    return rc


def _read_progress(path: str) -> Optional[dict]:
    import json

    try:
        with open(path) as f:
            return json.load(f)
    except (OSError, ValueError):
        return None


def run_process_group(cmd: List[str], env: dict, grace_s: float = 30.0) -> int:
    """Run ``cmd`` in a process group of its own and return its exit status; when it ends, for
    whatever reason, end every process left in that group.

    torchrun stops its ranks when one fails, but not what the ranks started: helper processes
    of a SIGKILLed or SIGTERMed rank (Megatron's checkpoint-writer Manager, multiprocessing's
    resource tracker) would live on with PPID 1. They stay in torchrun's process group, so a
    SIGKILL to the group takes them. SIGINT / SIGTERM / SIGHUP / SIGUSR1 sent to this launcher
    (Ctrl-C, ``scancel``, SLURM's ``--signal``) are passed to the whole group first, and the
    group has ``grace_s`` seconds to exit on its own.

    Ctrl-C (SIGINT) ends the run quietly: from then on the group's stderr (the ranks' and
    torchrun's tracebacks) is dropped, and the status is :data:`INTERRUPTED` (130) whatever
    torchrun returns; a second Ctrl-C kills the group at once. The group's stderr passes through
    this process for that; its stdout goes straight to the terminal (a progress bar stays one).
    """
    import signal
    import threading
    import time

    proc = subprocess.Popen(cmd, env=env, start_new_session=True, stderr=subprocess.PIPE)
    forwarded = (signal.SIGINT, signal.SIGTERM, signal.SIGHUP, signal.SIGUSR1)
    interrupts = []
    pump = threading.Thread(target=_pass_stderr, args=(proc.stderr, interrupts), daemon=True)
    pump.start()

    def forward(signum, _frame):
        if signum == signal.SIGINT:
            interrupts.append(signum)
            signum = signal.SIGINT if len(interrupts) == 1 else signal.SIGKILL
        try:
            os.killpg(proc.pid, signum)
        except ProcessLookupError:
            pass

    old = {sig: signal.signal(sig, forward) for sig in forwarded}
    try:
        while True:
            try:
                rc = proc.wait()
                pump.join(timeout=5)
                return INTERRUPTED if interrupts else rc
            except KeyboardInterrupt:  # pragma: no cover - SIGINT is forwarded above
                forward(signal.SIGINT, None)
    finally:
        for sig, handler in old.items():
            signal.signal(sig, handler)
        if proc.poll() is None:  # this launcher is leaving first (an exception): stop torchrun
            forward(signal.SIGTERM, None)
            deadline = time.monotonic() + grace_s
            while proc.poll() is None and time.monotonic() < deadline:
                time.sleep(0.1)
        try:
            os.killpg(proc.pid, signal.SIGKILL)  # whatever the run left behind
        except ProcessLookupError:
            pass
        if proc.poll() is None:
            proc.wait()


def _pass_stderr(stream, interrupts: list) -> None:
    """Copy the group's stderr to this process's, line by line, until the first Ctrl-C; after
    it, drop what follows (the interrupted ranks' and torchrun's tracebacks)."""
    out = getattr(sys.stderr, "buffer", None)
    for line in iter(stream.readline, b""):
        if interrupts:
            continue
        if out is not None:
            out.write(line)
            out.flush()
        else:
            sys.stderr.write(line.decode(errors="replace"))
    stream.close()


def mode_list(flag: str, allowed: Tuple[str, ...]) -> Callable[[str], List[str]]:
    """An argparse ``type`` for a comma-separated list of modes, naming ``flag`` on error."""

    def parse(value: str) -> List[str]:
        modes = [m.strip() for m in value.split(",") if m.strip()]
        if not modes or any(m not in allowed for m in modes):
            raise argparse.ArgumentTypeError(
                f"{flag} {value!r}: give a comma-separated list of {', '.join(allowed)}")
        return modes

    return parse
