"""Shared fixtures: the rank pools, a report of measured numbers printed after the run, and a
check at the end that the suite left no process running."""

from __future__ import annotations

import os
import time
import uuid

import pytest

from tests import _harness, _procs

_REPORT: list[str] = []
# Every process the suite starts inherits this marker (see tests/_procs.py).
_SESSION = f"suite-{uuid.uuid4().hex[:12]}"
os.environ[_procs.MARKER] = _SESSION
# MKL's sgemm takes another code path on an AVX-512 host than on an AVX2 one, and on an
# AVX-512 host two processes running the same GEMMs did not agree to the last bit (a resumed
# run's first loss 1 ulp from the one the killed run logged: tests/test_reliability_faults.py;
# MKL_CBWR=AUTO,STRICT did not help, AVX2 and COMPATIBLE did). The tests compare runs in
# different processes bit for bit, so every process the suite starts (rank workers, torchrun
# launches) takes MKL's AVX2 branch, the same on every x86 host CI or a developer has.
os.environ.setdefault("MKL_CBWR", "AVX2")
_harness.freeze_env()  # what the rank workers start with (tests/_harness.py)
_LEFT: list[str] = []


@pytest.fixture
def report():
    """``report(line)`` adds a measured figure (error, bytes, memory) to the end-of-run summary."""
    return _REPORT.append


def _leftovers() -> dict:
    """Marked processes still running, less this process's own resource tracker (started by
    the rank pools' multiprocessing context, forkserver; it ends when pytest does)."""
    return {pid: cmd for pid, cmd in _procs.marked(_SESSION).items()
            if not (_procs.parent(pid) == os.getpid() and "resource_tracker" in cmd)}


def pytest_sessionfinish(session, exitstatus):
    _harness.close_pools()
    # Workers, launched runs and their helpers exit on their own once their work is done: give
    # them a moment, then anything still running is a leak. It is ended and fails the run.
    deadline = time.monotonic() + 20
    while _leftovers() and time.monotonic() < deadline:
        time.sleep(0.2)
    left = _leftovers()
    if left:
        _procs.kill_pids(left)
        _LEFT.extend(f"{pid} {cmd}" for pid, cmd in left.items())
    if _LEFT and session.exitstatus == 0:
        session.exitstatus = pytest.ExitCode.TESTS_FAILED


def pytest_terminal_summary(terminalreporter, exitstatus, config):
    lines = list(_REPORT)
    if _harness.PEAK_THREADS[0]:
        n, task, after = _harness.PEAK_THREADS
        lines.append(f"threads: peak in any rank worker at a task's end {n} ({task}; {after} "
                     f"after its groups were ended); most kept by a worker between tasks "
                     f"{_harness.AFTER_RESET[0]}; pytest process at exit "
                     f"{len(os.listdir('/proc/self/task'))}")
    if lines:
        terminalreporter.section("measured figures")
        for line in lines:
            terminalreporter.write_line(line)
    if _LEFT:
        terminalreporter.section("processes left running (killed; the run fails)", red=True)
        for line in _LEFT:
            terminalreporter.write_line(line)
