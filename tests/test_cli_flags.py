"""Every bad flag of ``metp train`` (and a few of ``bench`` / ``plan``) is refused at start-up,
through the command-line entry point as a user runs it.

Each case runs ``megatron_metp.training.cli.main(argv)`` (what the ``metp`` console script calls) with
the launcher replaced by a trap: a case passes only if the command returns (or exits with) 2,
prints exactly one line on stderr that names the flag, prints no traceback, and never reaches
the point where torchrun or a rank would start. A few cases also run as a real process, to time
the whole start-up a user waits for.
"""

from __future__ import annotations

import os
import subprocess
import sys
import time
from pathlib import Path

import pytest

from megatron_metp import launch
from megatron_metp.training import cli

ROOT = Path(__file__).resolve().parents[1]


@pytest.fixture
def no_launch(monkeypatch):
    """Fail the test if a command gets as far as starting ranks."""
    def trap(cmd, env, *a, **k):
        raise AssertionError(f"ranks were launched: {cmd}")

    monkeypatch.setattr(launch, "run_process_group", trap)
    for k in ("RANK", "WORLD_SIZE", "SLURM_PROCID", "SLURM_NTASKS"):
        monkeypatch.delenv(k, raising=False)


def _file(tmp_path: Path) -> str:
    f = tmp_path / "a-file"
    f.write_text("x")
    return str(f)


# (id, argv after `metp train`, flag the line names, fragment of the fix). ``{file}`` is an
# existing regular file, ``{dir}`` an existing directory.
TRAIN_BAD = [
    # The audit's list.
    ("mbs-0", ["--micro-batch-size", "0"], "--micro-batch-size", ">= 1"),
    ("gbs-0", ["--global-batch-size", "0"], "--global-batch-size", ">= 1"),
    ("seq-0", ["--seq-length", "0"], "--seq-length", ">= 1"),
    ("lr-negative", ["--lr", "-1"], "--lr", ">= 0"),
    ("hidden-dropout-1.5", ["--hidden-dropout", "1.5"], "--hidden-dropout", "[0, 1)"),
    ("hidden-dropout-1", ["--hidden-dropout", "1"], "--hidden-dropout", "[0, 1)"),
    ("attention-dropout-neg", ["--attention-dropout", "-0.1"], "--attention-dropout", "[0, 1)"),
    ("vocab-divisor-0", ["--make-vocab-size-divisible-by", "0"],
     "--make-vocab-size-divisible-by", ">= 1"),
    ("save-under-file", ["--save", "{file}/ckpt"], "--save", "is a file"),
    ("save-is-file", ["--save", "{file}"], "--save", "not a directory"),
    ("save-unwritable", ["--save", "/proc/metp-ckpt"], "--save", "writable directory"),
    ("train-iters-0", ["--train-iters", "0"], "--train-iters", "nothing to train"),
    ("train-iters-negative", ["--train-iters", "-5"], "--train-iters", ">= 0"),
    ("nproc-0", ["--nproc-per-node", "0"], "--nproc-per-node", ">= 1"),
    ("nproc-negative", ["--nproc-per-node", "-2"], "--nproc-per-node", ">= 1"),
    ("vocab-0", ["--vocab-size", "0"], "--vocab-size", ">= 1"),
    ("save-interval-0", ["--save-interval", "0"], "--save-interval", ">= 1"),
    ("exit-interval-0", ["--exit-interval", "0"], "--exit-interval", ">= 1"),
    ("exit-duration-0", ["--exit-duration-in-mins", "0"], "--exit-duration-in-mins", "above 0"),
    ("decay-not-after-warmup", ["--lr-warmup-iters", "8", "--lr-decay-iters", "8"],
     "--lr-warmup-iters", "--lr-decay-iters"),
    ("decay-style-unknown", ["--lr-decay-style", "step"], "--lr-decay-style", "invalid choice"),
    ("exit-signal-unknown", ["--exit-signal", "SIGKILL"], "--exit-signal", "invalid choice"),
    # The rest of metp train's flags: ranges.
    ("min-lr-negative", ["--min-lr", "-0.1"], "--min-lr", ">= 0"),
    ("min-lr-above-lr", ["--lr", "0.001", "--min-lr", "0.01"], "--min-lr", "<= 0.001"),
    ("warmup-negative", ["--lr-warmup-iters", "-1"], "--lr-warmup-iters", ">= 0"),
    ("weight-decay-negative", ["--weight-decay", "-0.1"], "--weight-decay", ">= 0"),
    ("clip-grad-negative", ["--clip-grad", "-1"], "--clip-grad", ">= 0"),
    ("seed-negative", ["--seed", "-1"], "--seed", ">= 0"),
    ("timeout-0", ["--distributed-timeout-minutes", "0"], "--distributed-timeout-minutes",
     "above 0"),
    ("tp-0", ["--tensor-model-parallel-size", "0"], "--tensor-model-parallel-size", ">= 1"),
    ("cp-0", ["--context-parallel-size", "0"], "--context-parallel-size", ">= 1"),
    ("pp-negative", ["--pipeline-model-parallel-size", "-1"], "--pipeline-model-parallel-size",
     ">= 1"),
    # Types and choices (argparse, on one line).
    ("lr-not-a-number", ["--lr", "fast"], "--lr", "invalid float"),
    ("mbs-not-an-int", ["--micro-batch-size", "2.5"], "--micro-batch-size", "invalid int"),
    ("mode-unknown", ["--tensor-parallel-mode", "ulysses"], "--tensor-parallel-mode",
     "invalid choice"),
    ("compare-unknown", ["--compare", "tp,ulysses"], "--compare", "comma-separated"),
    ("placement-unknown", ["--wallfacer-placement", "node-major"], "--wallfacer-placement",
     "invalid choice"),
    ("cp-comm-type-unknown", ["--cp-comm-type", "ring"], "--cp-comm-type", "invalid choice"),
    ("unknown-flag", ["--hidden-size", "64"], "--hidden-size", "unrecognized"),
    # Paths.
    ("load-is-file", ["--load", "{file}"], "--load", "is a file"),
    ("log-json-is-dir", ["--log-json", "{dir}"], "--log-json", "is a directory"),
    ("log-json-under-file", ["--log-json", "{file}/log.jsonl"], "--log-json", "is a file"),
    ("data-path-missing", ["--data-path", "{dir}/nope"], "--data-path", "PREFIX"),
    ("config-missing", ["--config", "no-such-model"], "--config", "known configs"),
    # Combinations, checked by the full start-up validation (before any rank starts).
    ("world-not-multiple", ["--tensor-model-parallel-size", "3"], "--tensor-model-parallel-size",
     "multiple of 3"),
    ("metp-seq", ["--seq-length", "31"], "--seq-length", "tokens"),
    ("gbs-not-multiple", ["--global-batch-size", "6", "--micro-batch-size", "4"],
     "--global-batch-size", "multiple of 8"),
    ("warmup-too-long", ["--train-iters", "3", "--lr-warmup-iters", "5"], "--lr-warmup-iters",
     "shorten the warm-up"),
    ("seq-beyond-positions", ["--config", "{file_cfg}", "--seq-length", "128"], "--seq-length",
     "--max-position-embeddings"),
    ("vocab-below-corpus", ["--vocab-size", "100"], "--vocab-size", "258"),
    ("team-size-3", ["--tensor-parallel-mode", "wallfacer", "--wallfacer-team-size", "3"],
     "--wallfacer-team-size", "C^2"),
    ("team-size-on-metp", ["--wallfacer-team-size", "2"], "--wallfacer-team-size",
     "applies only"),
    ("bf16-on-cpu", ["--bf16"], "--bf16", "GPU"),
    ("fully-reshardable-alone", ["--dist-ckpt-optim-fully-reshardable"],
     "--dist-ckpt-optim-fully-reshardable", "add --use-distributed-optimizer"),
    ("fsdp-no-shard", ["--use-megatron-fsdp"], "--use-megatron-fsdp", "optim_grads_params"),
    ("fsdp-with-save", ["--use-megatron-fsdp", "--data-parallel-sharding-strategy", "optim",
                        "--save", "{dir}"], "--use-megatron-fsdp", "fsdp_dtensor"),
    ("fsdp-with-pp", ["--use-megatron-fsdp", "--data-parallel-sharding-strategy", "optim",
                      "--tensor-model-parallel-size", "1", "--pipeline-model-parallel-size", "2"],
     "--use-megatron-fsdp", "--pipeline-model-parallel-size 2"),
    ("sharding-without-fsdp", ["--data-parallel-sharding-strategy", "optim_grads_params"],
     "--data-parallel-sharding-strategy", "add --use-megatron-fsdp"),
]


def _argv(tmp_path: Path, args):
    cfg = tmp_path / "short-positions.yaml"
    cfg.write_text("num_layers: 2\nhidden_size: 64\nnum_attention_heads: 4\n"
                   "max_position_embeddings: 64\ntensor_parallel_mode: metp\n"
                   "tensor_model_parallel_size: 2\nattention_dropout: 0.0\n")
    subs = {"{file}": _file(tmp_path), "{dir}": str(tmp_path), "{file_cfg}": str(cfg)}
    out = []
    for a in args:
        for k, v in subs.items():
            a = a.replace(k, v)
        out.append(a)
    return out


def _run_main(argv):
    try:
        return cli.main(argv)
    except SystemExit as e:  # argparse's own errors
        return e.code


@pytest.mark.parametrize("case,args,flag,fragment", TRAIN_BAD, ids=[c[0] for c in TRAIN_BAD])
def test_metp_train_refuses_bad_flag(case, args, flag, fragment, tmp_path, capsys, no_launch):
    if case in ("bf16-on-cpu", "dist-opt-on-cpu"):
        import torch

        if torch.cuda.is_available():
            pytest.skip("refused only without a GPU")
    before = set(os.listdir(tmp_path))
    t0 = time.perf_counter()
    rc = _run_main(["train", *_argv(tmp_path, args)])
    elapsed = time.perf_counter() - t0
    err = capsys.readouterr().err
    lines = [ln for ln in err.splitlines() if ln.strip()]
    assert rc == 2, (rc, err)
    assert len(lines) == 1, err
    assert "Traceback" not in err
    assert lines[0].startswith("metp train: error:"), lines
    assert flag in lines[0] and fragment in lines[0], lines[0]
    # No checkpoint directory or log was created by a refused command (the probe file that
    # tests writability is removed again).
    assert set(os.listdir(tmp_path)) - before <= {"a-file", "short-positions.yaml"}
    assert elapsed < 10.0, elapsed  # in-process; the real start-up is timed below


# metp bench / metp plan: their own flags.
OTHER_BAD = [
    ("bench-seq-0", ["bench", "--seq-lengths", "0"], "--seq-lengths"),
    ("bench-mbs-0", ["bench", "--micro-batch-size", "0"], "--micro-batch-size"),
    ("bench-json-dir", ["bench", "--json", "{dir}"], "--json"),
    ("bench-nproc-0", ["bench", "--nproc-per-node", "0"], "--nproc-per-node"),
    ("bench-iters-0", ["bench", "--iters", "0"], "--iters"),
    ("plan-efficiency-0", ["plan", "--efficiency", "0"], "--efficiency"),
    ("plan-seq-0", ["plan", "--seq-lengths", "0"], "--seq-lengths"),
    ("plan-fragmentation", ["plan", "--fragmentation", "-1"], "--fragmentation"),
    ("plan-reserve", ["plan", "--memory-gb", "4", "--reserve-gb", "8"], "--reserve-gb"),
    ("plan-communicator", ["plan", "--communicator-gb", "-1"], "--communicator-gb"),
    ("plan-json-under-file", ["plan", "--json", "{file}/plan.json"], "--json"),
    ("plan-team-size", ["plan", "--modes", "wallfacer", "--p", "8", "--wallfacer-team-size", "3"],
     "--wallfacer-team-size"),
]


@pytest.mark.parametrize("case,argv,flag", OTHER_BAD, ids=[c[0] for c in OTHER_BAD])
def test_bench_and_plan_refuse_bad_flag(case, argv, flag, tmp_path, capsys, no_launch):
    rc = _run_main(_argv(tmp_path, argv))
    err = capsys.readouterr().err
    lines = [ln for ln in err.splitlines() if ln.strip()]
    assert rc == 2 and len(lines) == 1 and flag in lines[0], (rc, err)
    assert "Traceback" not in err


@pytest.mark.parametrize("args", [["--micro-batch-size", "0"], ["--nproc-per-node", "0"],
                                  ["--save", "/proc/metp-ckpt"], ["--lr", "-1"]])
def test_bad_flag_fails_fast_as_a_process(args, report):
    """As a user runs it: a new process, exit 2 within two seconds, nothing started."""
    env = {k: v for k, v in os.environ.items()
           if k not in ("RANK", "WORLD_SIZE", "SLURM_PROCID", "SLURM_NTASKS")}
    t0 = time.perf_counter()
    r = subprocess.run([sys.executable, "-m", "megatron_metp.training.cli", "train", *args], cwd=ROOT,
                       env=env, capture_output=True, text=True, timeout=60)
    elapsed = time.perf_counter() - t0
    assert r.returncode == 2, r.stderr
    assert len(r.stderr.strip().splitlines()) == 1 and args[0] in r.stderr, r.stderr
    assert "launching" not in r.stdout  # the launcher never printed its command
    assert elapsed < 2.0, elapsed
    report(f"bad flag {' '.join(args)}: exit 2 after {elapsed:.2f} s (a new Python process)")


def test_bench_plot_without_matplotlib_is_refused(tmp_path, capsys, monkeypatch, no_launch):
    # It once exited 0 and wrote no plot.
    import importlib.util

    real = importlib.util.find_spec
    monkeypatch.setattr(importlib.util, "find_spec",
                        lambda name, *a: None if name == "matplotlib" else real(name, *a))
    rc = _run_main(["bench", "--plot", str(tmp_path / "b.png")])
    err = [ln for ln in capsys.readouterr().err.splitlines() if ln.strip()]
    assert rc == 2 and len(err) == 1 and "--plot" in err[0] and "[plot]" in err[0], (rc, err)


def test_the_configs_warm_up_does_not_stop_a_short_run():
    """tiny-gpt's config warms up for 5 iterations: `metp train --train-iters 2` (the quickest
    smoke test) warms up for 1 instead of being refused; a --lr-warmup-iters given is kept
    (and refused above when too long)."""
    from megatron_metp.models.config import load_config
    from megatron_metp.training import cli, train

    parser, _ = cli.build_parser()
    cfg = load_config("tiny-gpt")
    assert cfg.train["lr_warmup_iters"] == 5
    for argv, want in ((["--train-iters", "2"], 1), (["--train-iters", "20"], 5),
                       (["--train-iters", "20", "--lr-decay-iters", "4"], 3),
                       (["--train-iters", "2", "--lr-warmup-iters", "7"], 7)):
        args = parser.parse_args(["train", *argv])
        assert train.resolve_namespace(args, cfg, "tp", 4).lr_warmup_iters == want, argv
