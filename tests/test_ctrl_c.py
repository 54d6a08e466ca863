"""Ctrl-C on ``metp train``: one line saying where the run stopped and what it saved, exit
code 130, no traceback from any rank or from torchrun, no process left; a second Ctrl-C stops
at once.

The interrupt is SIGINT to the launcher alone, as a terminal's Ctrl-C reaches it: the launcher
runs torchrun in a session of its own, so the terminal's signal never reaches the ranks
directly."""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest

from megatron_metp.checkpoint_keys import damage
from tests import _procs
from tests.test_reliability_faults import TINY, _json_lines

ROOT = Path(__file__).resolve().parents[1]


def _start(tmp: Path, save: bool):
    """``metp train`` on 2 ranks, running until iteration 7 is logged (a checkpoint at 5 is
    whole). Returns (process, run marker, log file)."""
    log = tmp / "train.jsonl"
    marker = f"ctrl-c-{os.getpid()}-{tmp.name}"
    env = dict(os.environ, OMP_NUM_THREADS="1", **{_procs.MARKER: marker})
    for k in ("RANK", "WORLD_SIZE", "LOCAL_RANK", "SLURM_PROCID", "SLURM_NTASKS"):
        env.pop(k, None)
    argv = [sys.executable, "-m", "megatron_metp.training.cli", "train", "--nproc-per-node", "2",
            *TINY, "--train-iters", "10000", "--log-json", str(log)]
    if save:
        argv += ["--save", str(tmp / "ckpt"), "--save-interval", "5"]
    proc = subprocess.Popen(argv, cwd=ROOT, env=env, stdout=subprocess.PIPE,
                            stderr=subprocess.PIPE, text=True)
    t0 = time.monotonic()
    while not _logged(log, 7):
        if proc.poll() is not None or time.monotonic() - t0 > 300:
            _procs.kill_marked(marker)
            pytest.fail(f"no iteration 7 within 300 s: {proc.communicate()[1][-3000:]}")
        time.sleep(0.05)
    return proc, marker, log


def _logged(log: Path, n: int) -> bool:
    return any(r["iteration"] >= n for r in _json_lines(log))


def _after_signal(proc, marker: str, signals: int, gap_s: float = 0.0):
    """Send ``signals`` SIGINTs to the launcher; return (status, stdout, stderr, seconds until
    every process of the run had gone)."""
    t0 = time.monotonic()
    for i in range(signals):
        if i:
            time.sleep(gap_s)
        proc.send_signal(signal.SIGINT)
    try:
        out, err = proc.communicate(timeout=120)
    finally:
        left = _procs.marked(marker)
        _procs.kill_marked(marker)
    assert not left, f"processes left running after Ctrl-C: {left}"
    return proc.returncode, out, err, time.monotonic() - t0


@pytest.mark.full
def test_ctrl_c_prints_one_line_and_exits_130(tmp_path, report):
    proc, marker, log = _start(tmp_path, save=True)
    rc, out, err, seconds = _after_signal(proc, marker, 1)
    assert rc == 130, (rc, out[-2000:], err[-3000:])
    assert "Traceback" not in err + out and "SignalException" not in err + out, err[-3000:]
    lines = [ln for ln in out.splitlines() if "interrupted" in ln]
    assert len(lines) == 1 and out.rstrip().splitlines()[-1] == lines[0], out[-2000:]
    done = max(r["iteration"] for r in _json_lines(log))
    ckpt = str(tmp_path / "ckpt")
    # The newest whole checkpoint is a multiple of the save interval at or below the last
    # logged iteration, and the line names it.
    saved = sorted(p for p in os.listdir(ckpt) if p.startswith("iter_"))[-1]
    assert damage(os.path.join(ckpt, saved)) is None
    assert lines[0] == (f"[metp] interrupted (Ctrl-C) after iteration {done} of 10000; last "
                        f"checkpoint {os.path.join(ckpt, saved)} (resume with --load {ckpt})"), \
        (lines[0], done, saved)
    report(f"Ctrl-C on metp train (2 ranks, at iteration {done}): exit {rc} after "
           f"{seconds:.1f} s, {len(err.splitlines())} stderr lines, one line: {lines[0]}")


@pytest.mark.full
def test_a_second_ctrl_c_stops_at_once(tmp_path):
    proc, marker, _ = _start(tmp_path, save=False)
    rc, out, err, seconds = _after_signal(proc, marker, 2, gap_s=0.2)
    assert rc == 130 and "Traceback" not in err, (rc, err[-3000:])
    assert seconds < 15, seconds   # SIGKILL to the group: no grace period waited for
    lines = [ln for ln in out.splitlines() if "interrupted" in ln]
    assert len(lines) == 1 and lines[0].endswith("last checkpoint: none (no --save)"), out
