"""Find and end the processes a test started, orphans included.

A process that the test suite (or one launched run) starts carries a marker variable in its
environment, and every descendant inherits it: torchrun, its ranks, the ranks' helper processes
(Megatron's checkpoint-writer Manager, multiprocessing's resource tracker), also after they
were re-parented to PID 1 or moved to a session of their own. Scanning ``/proc/*/environ`` for
the marker finds them all, which a walk of the process tree from the launcher cannot.
"""

from __future__ import annotations

import os
import signal
import time
from pathlib import Path
from typing import Dict, List

MARKER = "METP_TEST_MARKER"


def _state(pid: int) -> str:
    try:
        return Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()[0]
    except (OSError, IndexError):
        return "X"


def alive(pid: int) -> bool:
    """Running or sleeping: not exited, and not a zombie waiting for its parent to reap it."""
    return _state(pid) not in ("Z", "X")


def marked(value: str) -> Dict[int, str]:
    """{pid: command line} of the live processes whose environment has MARKER=value."""
    needle = f"{MARKER}={value}".encode()
    me = os.getpid()
    found = {}
    for d in Path("/proc").iterdir():
        if not d.name.isdigit() or int(d.name) == me:
            continue
        try:
            if needle not in (d / "environ").read_bytes().split(b"\0"):
                continue
            cmd = (d / "cmdline").read_bytes().replace(b"\0", b" ").decode(errors="replace")
        except OSError:  # exited meanwhile, or not ours to read
            continue
        if alive(int(d.name)):
            found[int(d.name)] = cmd.strip()[:160]
    return found


def parent(pid: int) -> int:
    try:
        return int(Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()[1])
    except (OSError, IndexError, ValueError):
        return -1


def kill_marked(value: str, timeout_s: float = 10.0) -> List[str]:
    """SIGKILL every live process marked ``value`` (and its process group); return what was
    still running. Waits up to ``timeout_s`` for them to be gone."""
    left = marked(value)
    kill_pids(left, timeout_s)
    return [f"{pid} {cmd}" for pid, cmd in left.items()]


def kill_pids(pids, timeout_s: float = 10.0) -> None:
    """SIGKILL each pid and its process group (never this process's own group)."""
    left = list(pids)
    own_group = os.getpgid(0)
    for pid in left:
        try:
            group = os.getpgid(pid)
            if group != own_group:  # never this test process's own group
                os.killpg(group, signal.SIGKILL)
            os.kill(pid, signal.SIGKILL)
        except (ProcessLookupError, PermissionError):
            pass
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline and any(alive(p) for p in left):
        time.sleep(0.05)
