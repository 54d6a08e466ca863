"""No hangs when a rank dies, and bad data refused before training (item 6).

A real ``metp train`` run (the console command's own launcher: ``python -m megatron_metp.training.cli
train`` starts ``torchrun`` with 4 gloo ranks, METP TP 2 x DP 2, ``--distributed-timeout-minutes
0.5``) saves every 5 iterations; once iteration 7 is logged, rank 1 is killed (SIGKILL: no
exception handler, no atexit, as an OOM kill or a lost node). Asserted:

- every process of the run has exited within 120 s of the kill: the launcher, torchrun, the 4
  ranks and what the ranks started (Megatron's checkpoint-writer Manager, multiprocessing's
  resource tracker), found by a marker in their environment, so orphans re-parented to PID 1
  count too; the command's exit status is non-zero, and torchrun names the failed rank;
- the newest checkpoint the tracker names is complete: ``metp train --load`` resumes from it.

Who ends the survivors: torchrun's agent watches its workers; when one exits abnormally it
sends SIGTERM (then SIGKILL) to the rest, so this does not depend on a collective timing out.
``test_hung_rank_times_out`` (slow) covers the other case, a rank that stops without dying
(SIGSTOP), which only the process groups' timeouts can end.
"""

from __future__ import annotations

import json
import os
import re
import signal
import subprocess
import sys
import time
from pathlib import Path
from typing import Dict, List

import numpy as np
import pytest

from tests import _procs
from tests._harness import run_ranks
from tests.test_reliability_checkpoint import train_args

ROOT = Path(__file__).resolve().parents[1]
DEADLINE_S = 120.0
TINY = ["--tensor-parallel-mode", "metp", "--tensor-model-parallel-size", "2",
        "--seq-length", "16", "--micro-batch-size", "2", "--global-batch-size", "4",
        "--hidden-dropout", "0", "--no-progress", "--distributed-timeout-minutes", "0.5"]


def _children(pid: int) -> List[int]:
    out = []
    for task in Path(f"/proc/{pid}/task").glob("*"):
        try:
            out += [int(c) for c in (task / "children").read_text().split()]
        except OSError:
            pass
    return out


def _descendants(pid: int) -> List[int]:
    todo, seen = [pid], []
    while todo:
        kids = _children(todo.pop())
        seen += kids
        todo += kids
    return seen


def _rank_pids(pid: int) -> Dict[int, int]:
    """{RANK: pid} of the training ranks under the launcher ``pid``: torchrun's direct children
    (their own children, e.g. dist_checkpointing's forked writers, inherit RANK too)."""
    ranks = {}
    for agent in [pid, *_descendants(pid)]:
        try:
            if b"torch.distributed.run" not in Path(f"/proc/{agent}/cmdline").read_bytes():
                continue
        except OSError:
            continue
        for p in _children(agent):
            try:
                env = Path(f"/proc/{p}/environ").read_bytes().split(b"\0")
            except OSError:
                continue
            for kv in env:
                if kv.startswith(b"RANK="):
                    ranks[int(kv[5:])] = p
    return ranks


def _json_lines(path: Path) -> List[dict]:
    if not path.exists():
        return []
    recs = []
    for line in path.read_text().splitlines():
        try:
            recs.append(json.loads(line))
        except json.JSONDecodeError:  # the line being written
            pass
    return recs


def _start(tmp: Path, sig: int, iters: int):
    """Start metp train; once iteration 7 is logged (a checkpoint at 5 is complete), send
    ``sig`` to rank 1. Returns (proc, rank pids, kill time, output file)."""
    log, out = tmp / "train.jsonl", tmp / "out.txt"
    env = dict(os.environ, OMP_NUM_THREADS="1")
    env[_procs.MARKER] = _run_marker(tmp)
    for k in ("RANK", "WORLD_SIZE", "LOCAL_RANK", "SLURM_PROCID", "SLURM_NTASKS"):
        env.pop(k, None)
    argv = [sys.executable, "-m", "megatron_metp.training.cli", "train", "--nproc-per-node", "4", *TINY,
            "--train-iters", str(iters), "--save", str(tmp / "ckpt"), "--save-interval", "5",
            "--log-json", str(log)]
    fh = open(out, "w")
    proc = subprocess.Popen(argv, cwd=ROOT, env=env, stdout=fh, stderr=subprocess.STDOUT,
                            start_new_session=True)
    try:
        t_start = time.monotonic()
        while not any(r["iteration"] >= 7 for r in _json_lines(log)):
            assert proc.poll() is None, out.read_text()[-4000:]
            assert time.monotonic() - t_start < 300, "no iteration 7 within 300 s"
            time.sleep(0.05)
        ranks = _rank_pids(proc.pid)
        assert sorted(ranks) == [0, 1, 2, 3], ranks
        running = _procs.marked(_run_marker(tmp))
        os.kill(ranks[1], sig)
        return proc, ranks, running, out
    except BaseException:
        _kill_tree(proc, tmp)
        raise


def _run_marker(tmp: Path) -> str:
    return f"fault-{os.getpid()}-{tmp.name}"


def _kill_tree(proc, tmp: Path) -> None:
    """SIGKILL every process this run started, orphans and new sessions included."""
    _procs.kill_marked(_run_marker(tmp))
    proc.wait(timeout=30)


def _wait_all_gone(proc, tmp: Path, deadline_s: float) -> float:
    """Seconds after the signal until every process of the run has exited (or inf)."""
    t0 = time.monotonic()
    while time.monotonic() - t0 < deadline_s:
        if proc.poll() is not None and not _procs.marked(_run_marker(tmp)):
            return time.monotonic() - t0
        time.sleep(0.05)
    return float("inf")


def _resume_task(ckpt: str, iters: int):
    from megatron_metp.training import train
    from megatron_metp.training.train_checkpoint import latest_iteration

    start = latest_iteration(ckpt)
    argv = [*TINY[:-2], "--train-iters", str(start + 1), "--load", ckpt]
    losses = train.run(*train_args(*argv))["metp"]["losses"]
    return start, losses


def _check_fault(tmp_path, sig: int, report, what: str) -> None:
    proc, ranks, running, out = _start(tmp_path, sig, iters=10_000)
    # The launcher, torchrun and 4 ranks, plus the helpers the ranks' first save started.
    helpers = len(running) - 2 - len(ranks)
    assert helpers >= 4, running
    try:
        waited = _wait_all_gone(proc, tmp_path, DEADLINE_S)
        text = out.read_text()
        assert waited <= DEADLINE_S, (f"{what}: still alive {DEADLINE_S:.0f} s after the signal: "
                                      f"{_procs.marked(_run_marker(tmp_path))}")
    finally:
        _kill_tree(proc, tmp_path)
    assert proc.returncode != 0, text[-3000:]
    assert "Traceback" in text or "ChildFailedError" in text or "FAILED" in text, text[-3000:]
    recs = {r["iteration"]: r["loss"] for r in _json_lines(tmp_path / "train.jsonl")}
    logged = max(recs)
    # The last complete checkpoint loads and training goes on from it: the first resumed
    # iteration's loss (a forward pass on the checkpoint's weights, before any update) is the
    # one the killed run logged for that iteration, bit for bit.
    start, losses = run_ranks(4, _resume_task, str(tmp_path / "ckpt"), 10_000, timeout=200)[0]
    assert start % 5 == 0 and 5 <= start < logged, (start, logged)
    assert len(losses) == 1 and np.isfinite(losses[0])
    assert losses[0] == recs[start + 1], (losses, recs)
    report(f"fault test ({what} rank 1 of 4, metp train, --distributed-timeout-minutes 0.5): all "
           f"{len(running)} processes of the run ({helpers} of them the ranks' helpers) gone "
           f"{waited:.1f} s after the signal, exit status {proc.returncode}; last "
           f"logged iteration {logged}, resumed from checkpoint {start}, loss {losses[0]:.4f}")


# In the full tier for time (the default tier is <= 10 minutes on 2 cores): ~27 s of a
# four-rank run killed mid-step.
@pytest.mark.full
def test_killed_rank_ends_the_run_and_checkpoint_loads(tmp_path, report):
    _check_fault(tmp_path, signal.SIGKILL, report, "SIGKILL of")


@pytest.mark.full
def test_hung_rank_times_out(tmp_path, report):
    """A rank that stops (SIGSTOP: alive to torchrun, silent to its peers) must be ended by the
    gloo timeout of --distributed-timeout-minutes 0.5: a survivor's collective raises after 30 s,
    it exits non-zero, and torchrun then stops the rest (SIGTERM, then SIGKILL after its 30 s
    grace, which a stopped process needs). The timeout must reach every process group the
    ranks wait on: the world group, Megatron's TP/DP/CP groups and the plugin's own groups.
    (torchrun's ``--shutdown-timeout`` would not shorten the grace: torch 2.13's agent stops a
    failed group with its 30 s default whatever the flag says.)"""
    _check_fault(tmp_path, signal.SIGSTOP, report, "SIGSTOP of")


# ------------------------------------------------------------------------------------------
# Bad data (item 6): tests/test_data.py covers the reader and the writer one by one; here the
# trainer refuses each bad dataset before its first iteration, with the error naming the file.


def _bad_data_task(cases):
    from megatron_metp.training import train
    from megatron_metp.training.data.indexed import IndexedDataError

    msgs = {}
    for name, (prefix, vocab, _) in cases.items():
        args, explicit = train_args(*TINY[:-2], "--train-iters", "1", "--data-path", prefix,
                                    "--vocab-size", str(vocab))
        try:
            train.run(args, explicit)
            msgs[name] = None
        except IndexedDataError as e:
            msgs[name] = str(e)
    return msgs


def test_trainer_refuses_bad_data(tmp_path):
    import struct

    from megatron_metp.training.data.indexed import write_indexed_dataset

    docs = [list(range(1, 40)), list(range(40, 90)), list(range(90, 120))]
    cases = {}
    p = str(tmp_path / "vocab")
    write_indexed_dataset(p, docs + [[250]], dtype=np.uint16)
    cases["vocab"] = (p, 200, r"token id 250 is outside the vocabulary.*--vocab-size")
    p = str(tmp_path / "past")
    write_indexed_dataset(p, docs, dtype=np.uint16)
    raw = bytearray(open(p + ".idx", "rb").read())
    struct.pack_into("<q", raw, 34 + 4 * len(docs) + 8 * 2, 1 << 20)  # sequence 2's pointer
    open(p + ".idx", "wb").write(bytes(raw))
    cases["past"] = (p, 258, "sequence 2 spans bytes")
    p = str(tmp_path / "empty")
    write_indexed_dataset(p, docs, dtype=np.uint16)
    open(p + ".bin", "wb").close()
    cases["empty"] = (p, 258, "is empty")
    before = sorted(os.listdir(tmp_path))
    for msgs in run_ranks(4, _bad_data_task, cases, timeout=200):
        for name, (prefix, _, match) in cases.items():
            m = msgs[name]
            assert m is not None and prefix in m, (name, m)
            assert re.search(match, m), (name, m)
    assert sorted(os.listdir(tmp_path)) == before  # nothing written beside the data
