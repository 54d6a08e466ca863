"""``metp train``: the README's main job trains (loss falls), the modes agree under --compare,
bad configurations fail before launch, and the launcher / progress output behave."""

from __future__ import annotations

import io
import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

from megatron_metp import launch
from megatron_metp.training import cli
from megatron_metp.training.train_report import Reporter
from tests._harness import run_ranks

ROOT = Path(__file__).resolve().parents[1]


def _args(*argv):
    parser, _ = cli.build_parser()
    full = ["train", *argv]
    return parser.parse_args(full), cli.explicit_flags(full)


def test_default_main_job_loss_falls(tmp_path, report):
    """The README's command (default tiny-gpt config: METP, TP 2 x DP 2, 60 iterations) through
    the real launcher on 4 gloo ranks: mean of the last 10 losses <= 0.8x the first."""
    log = tmp_path / "train.jsonl"
    env = dict(os.environ, OMP_NUM_THREADS="1")
    for k in ("RANK", "WORLD_SIZE", "LOCAL_RANK", "SLURM_PROCID", "SLURM_NTASKS"):
        env.pop(k, None)
    proc = subprocess.run(
        [sys.executable, "-m", "megatron_metp.training.cli", "train", "--no-progress", "--log-json",
         str(log)], cwd=ROOT, env=env, capture_output=True, text=True, timeout=400)
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-6000:]
    recs = [json.loads(line) for line in log.read_text().splitlines()]
    assert [r["iteration"] for r in recs] == list(range(1, 61))
    assert {"loss", "tokens_per_s", "tflops_per_device", "peak_mem_bytes", "mfu"} <= set(recs[0])
    assert all(r["mfu"] is None for r in recs)  # no MFU on CPU
    losses = [r["loss"] for r in recs]
    first, last10 = losses[0], sum(losses[-10:]) / 10
    report(f"metp train (default, 4 CPU ranks): first loss {first:.4f}, last-10 mean "
           f"{last10:.4f}, ratio {last10 / first:.3f}")
    assert last10 <= 0.8 * first
    assert "Summary" in proc.stdout and "| metp |" in proc.stdout.replace("  ", " ").replace(
        "|  ", "| ")
    # --metp-ring-pass auto and --metp-qkv-backward auto, resolved by the planner before the
    # ranks build the model: the tiny model fits 80 GiB with the all-to-all pass, its Q/K/V and
    # its MLP's fc1 output saved.
    assert ("METP attention (--metp-ring-pass a2a --metp-qkv-backward save+fc1): all-to-all "
            "attention over every head group, Q/K/V and the MLP's fc1 output saved: planned") \
        in proc.stdout, proc.stdout[-3000:]


def test_metp_flags_reach_the_model_config():
    """--metp-ring-pass and --metp-qkv-backward travel from the command line to the
    TransformerConfig METP attention reads at construction (the default: auto, auto)."""
    from megatron_metp.models.config import load_config
    from megatron_metp.training import train

    cfg = load_config("tiny-gpt")
    got = {}
    for argv in ([], ["--metp-ring-pass", "head-group", "--metp-qkv-backward", "save"],
                 ["--metp-ring-pass", "a2a", "--metp-qkv-backward", "save+fc1+weights"]):
        args, _ = _args("--tensor-parallel-mode", "metp", *argv)
        ns = train.resolve_namespace(args, cfg, "metp", 4)
        tconf = train._transformer_config(ns, cfg)
        got[" ".join(argv)] = (tconf.metp_ring_pass, tconf.metp_qkv_backward)
    assert got == {"": ("auto", "auto"),
                   "--metp-ring-pass head-group --metp-qkv-backward save": ("head-group", "save"),
                   "--metp-ring-pass a2a --metp-qkv-backward save+fc1+weights": (
                       "a2a", "save+fc1+weights")}


def _compare_task(argv):
    from megatron_metp.training import train

    args, explicit = _args(*argv)
    res = train.run(args, explicit)
    return {m: r["losses"] for m, r in res.items()}


def test_compare_modes_agree(report):
    """tp, metp and wallfacer from the same seed and data, fp32, dropout 0, 20 iterations.

    Tolerance 1e-4 absolute on losses of 3-6.3 (2e-5 relative, ~150 fp32 ulps): the modes do
    the same arithmetic in different orders (ring-accumulated partial products and online-softmax
    merges instead of all-reduces), so each step differs by a few ulps and 20 Adam steps carry
    that forward; measured differences are ~5e-7. A wrong shard, a lost gradient or a missing
    reduction moves the loss by >1e-2 within a few steps.
    """
    out = run_ranks(4, _compare_task, ["--compare", "tp,metp,wallfacer", "--train-iters", "20",
                                       "--no-progress"], timeout=400)
    losses = out[0]
    assert all(o == losses for o in out)  # every rank reports the same curves
    ref = losses["tp"]
    assert len(ref) == 20 and ref[-1] < ref[0] - 1.0
    worst = {m: max(abs(a - b) for a, b in zip(losses[m], ref)) for m in ("metp", "wallfacer")}
    report(f"metp train --compare (20 it, fp32): max |loss - tp| metp {worst['metp']:.2e}, "
           f"wallfacer {worst['wallfacer']:.2e}")
    for m, w in worst.items():
        assert w <= 1e-4, (m, w)


@pytest.mark.parametrize("argv,match", [
    (["--config", "dit-1b"], "trains causal GPT models only"),
    (["--tensor-model-parallel-size", "3"], "--tensor-model-parallel-size"),
    (["--tensor-parallel-mode", "metp", "--no-sequence-parallel"], "--sequence-parallel"),
    (["--bf16"], "--bf16 needs a GPU"),
    (["--dist-ckpt-optim-fully-reshardable"], "add --use-distributed-optimizer"),
    (["--config", "no-such-model"], "known configs"),
    (["--global-batch-size", "6"], "--global-batch-size"),
])
def test_bad_configuration_fails_before_launch(argv, match, capsys, monkeypatch):
    for k in ("RANK", "WORLD_SIZE", "SLURM_PROCID", "SLURM_NTASKS"):
        monkeypatch.delenv(k, raising=False)
    if "GPU" in match:
        import torch
        if torch.cuda.is_available():
            pytest.skip("allowed on GPU")
    launched = []
    monkeypatch.setattr(launch, "run_process_group", lambda cmd, env: launched.append(cmd) or 0)
    assert cli.main(["train", "--nproc-per-node", "4", *argv]) == 2
    assert launched == []
    assert match in capsys.readouterr().err


def test_launcher_detection(monkeypatch):
    for k in ("RANK", "WORLD_SIZE", "LOCAL_RANK", "SLURM_PROCID", "SLURM_NTASKS",
              "SLURM_LOCALID", "MASTER_ADDR", "MASTER_PORT"):
        monkeypatch.setenv(k, "")  # recorded, so that whatever the launcher sets is undone
        monkeypatch.delenv(k)
    assert not launch.under_launcher()
    monkeypatch.setenv("SLURM_PROCID", "0")
    monkeypatch.setenv("SLURM_NTASKS", "1")  # one task per node: it starts torchrun itself
    assert not launch.under_launcher()
    monkeypatch.setenv("SLURM_NTASKS", "4")
    with pytest.raises(ValueError, match="MASTER_ADDR"):
        launch.under_launcher()
    monkeypatch.setenv("MASTER_ADDR", "node1")
    monkeypatch.setenv("MASTER_PORT", "29500")
    monkeypatch.setenv("SLURM_PROCID", "3")
    monkeypatch.setenv("SLURM_LOCALID", "1")
    assert launch.under_launcher()
    env = os.environ
    assert (env["RANK"], env["WORLD_SIZE"], env["LOCAL_RANK"]) == ("3", "4", "1")
    # torchrun is started with this interpreter and the same subcommand
    monkeypatch.delenv("RANK")
    monkeypatch.delenv("SLURM_PROCID")
    calls = []
    monkeypatch.setattr(launch, "run_process_group", lambda cmd, env: calls.append(cmd) or 0)
    assert launch.launch_or_run(["train", "--lr", "1"], 2, lambda: 1) == 0
    assert calls[0][:4] == [sys.executable, "-m", "torch.distributed.run", "--standalone"]
    assert calls[0][-5:] == ["-m", "megatron_metp.training.cli", "train", "--lr", "1"]


def test_progress_bar_and_tables():
    out = io.StringIO()
    rep = Reporter(rank=0, interactive=True, out=out)
    from argparse import Namespace

    ns = Namespace(num_layers=2, hidden_size=64, num_attention_heads=4, seq_length=8,
                   micro_batch_size=1, global_batch_size=2)
    rep.start_mode("tp", ns, total=2, start=0, layout=dict(dp=1, tp=2, cp=1, pp=1))
    for i, loss in enumerate((2.0, 1.0)):
        rep.iteration(dict(mode="tp", iteration=i + 1, loss=loss, lr=1e-3, grad_norm=1.0,
                           iter_time_s=0.1, tokens_per_s=160.0, tflops_per_device=0.001,
                           mfu=None, peak_mem_bytes=1 << 20))
    res = rep.end_mode()
    rep.final({"tp": res, "metp": res}, compare=True)
    text = out.getvalue()
    assert "\r" in text and "[####" in text and "2/2" in text
    assert "largest difference between modes: 0.000e+00" in text
    assert res["summary"]["last10_mean"] == 1.5


def _train_task(*argv):
    from megatron_metp.training import train
    from tests._models import child_processes_allowed

    # Warm-up 1 (the config's is 5): the decay, and so --lr-decay-iters, shapes iterations 2-6.
    args, explicit = _args(*argv, "--lr-warmup-iters", "1", "--no-progress")
    with child_processes_allowed():  # dist_checkpointing's writer starts processes
        return train.run(args, explicit)["metp"]["losses"]


# In the full tier for the default tier's time (10 minutes on 2 cores).
@pytest.mark.full
def test_cut_short_runs_resume_to_the_uninterrupted_losses(tmp_path, report):
    """A 6-iteration run, and the same run in three pieces that stop themselves:
    ``--exit-interval 2`` (saves, exits at 2); ``--train-iters 4 --lr-decay-iters 6
    --exit-duration-in-mins 1e-9`` (resumes, does one iteration, the time is up: saves, exits at
    3; the decay length keeps the 6-iteration schedule); then ``--load`` to the end. The pieces'
    losses equal the uninterrupted run's bit for bit: model, Adam moments, LR schedule and the
    dropout streams (the default config trains with hidden dropout 0.1) are all restored."""
    import json

    ckpt = str(tmp_path / "ckpt")
    full = run_ranks(4, _train_task, "--train-iters", "6", timeout=300)[0]
    progress = lambda: json.loads((tmp_path / "ckpt" / "metp_progress.json").read_text())  # noqa
    a = run_ranks(4, _train_task, "--train-iters", "6", "--exit-interval", "2", "--save", ckpt,
                  timeout=300)[0]
    assert progress() == dict(iteration=2, train_iters=6, finished=False, exit="interval")
    b = run_ranks(4, _train_task, "--train-iters", "4", "--lr-decay-iters", "6",
                  "--exit-duration-in-mins", "1e-9", "--load", ckpt, "--save", ckpt,
                  timeout=300)[0]
    assert progress() == dict(iteration=3, train_iters=4, finished=False, exit="duration")
    c = run_ranks(4, _train_task, "--train-iters", "6", "--load", ckpt, "--save", ckpt,
                  timeout=300)[0]
    assert progress() == dict(iteration=6, train_iters=6, finished=True, exit=None)
    assert sorted(os.listdir(ckpt))[:3] == ["iter_0000002", "iter_0000003", "iter_0000006"]
    assert (len(a), len(b), len(c)) == (2, 1, 3)
    report(f"metp train cut short at 2 (--exit-interval) and 3 (--exit-duration-in-mins), "
           f"resumed: losses {a + b + c} vs uninterrupted {full}")
    assert a + b + c == full


def _losses_task(argv, init_ckpt=None):
    """Train; with ``init_ckpt``, first save the initial weights there (--train-iters 0) and
    start the measured run from them, so that layouts that draw different initial weights
    (Megatron seeds each pipeline stage with seed + 100 * stage) start from the same model."""
    from megatron_metp.training import train
    from tests._models import child_processes_allowed

    with child_processes_allowed():  # dist_checkpointing's writer starts processes
        if init_ckpt is not None and not os.path.exists(init_ckpt):
            args, explicit = _args(*argv, "--train-iters", "0", "--save", init_ckpt)
            train.run(args, explicit)
        extra = ["--load", init_ckpt] if init_ckpt is not None else []
        args, explicit = _args(*argv, *extra)
        return train.run(args, explicit)


COMPOSE = ["--train-iters", "6", "--hidden-dropout", "0", "--no-progress"]


def test_composition_matches_the_smaller_layout(tmp_path, report):
    """On 4 CPU ranks, metp 2 x data-parallel 2, pipeline 2 x metp 2, and wallfacer (C = 1,
    P = 2) x data-parallel 2 give the losses of the same model on 2 ranks without the extra
    dimension. The global batch (8) is the same, split into micro-batches differently.
    Tolerance 1e-4 as in the --compare test: only the order of the gradient sums changes.

    Models: LLaMA-style (RMSNorm, SwiGLU, RoPE, GQA, untied embeddings) for the metp cases;
    GPT-style for wallfacer, because Megatron's RoPE under context parallelism
    (``get_pos_emb_on_this_cp_rank``) pins memory, which a CPU build refuses.
    """
    cases = {
        "metp2 x dp2": ("tiny-llama", ["--tensor-parallel-mode", "metp"]),
        "pp2 x metp2": ("tiny-llama", ["--tensor-parallel-mode", "metp",
                                       "--pipeline-model-parallel-size", "2"]),
        "wallfacer2 x dp2": ("tiny-gpt", ["--tensor-parallel-mode", "wallfacer"]),
    }
    base = {}
    worst = {}
    for name, (config, extra) in cases.items():
        # The pipeline case starts from the 2-rank model's initial weights, saved with
        # dist_checkpointing and resharded on load (TP 2 x PP 1 -> TP 2 x PP 2).
        init = str(tmp_path / f"{config}-init") if config == "tiny-llama" else None
        if config not in base:  # the same model on 2 ranks: metp 2, nothing else
            res = run_ranks(2, _losses_task, COMPOSE + ["--config", config,
                                                        "--tensor-parallel-mode", "metp"],
                            init, timeout=300)[0]
            base[config] = res["metp"]["losses"]
            assert base[config][-1] < base[config][0]
        res = run_ranks(4, _losses_task, COMPOSE + ["--config", config] + extra, init,
                        timeout=300)[0]
        (summary,) = [r["summary"] for r in res.values()]
        (losses,) = [r["losses"] for r in res.values()]
        lay = summary["layout"]
        assert lay["dp"] * lay["tp"] * lay["cp"] * lay["pp"] == 4, lay
        worst[name] = max(abs(a - b) for a, b in zip(losses, base[config]))
    report("metp train composition, max |loss - metp 2 on 2 ranks|: "
           + ", ".join(f"{k} {v:.2e}" for k, v in worst.items()))
    for name, w in worst.items():
        assert w <= 1e-4, (name, w)


def _three_recompute_runs():
    return {name: _train_task("--train-iters", "4", *extra) for name, extra in (
        ("none", []),
        ("uniform-1", ["--recompute-granularity", "full"]),
        ("block-1", ["--recompute-granularity", "full", "--recompute-method", "block",
                     "--recompute-num-layers", "1"]))}


# In the full tier for time (the default tier is <= 10 minutes on 2 cores; ~20 s of three
# 4-rank runs): tests/test_metp_model.py::test_metp_full_recompute_is_bit_identical
# keeps METP's full recompute, bit for bit, in the default tier.
@pytest.mark.full
def test_full_recompute_trains_the_same_losses(report):
    """``metp train --recompute-granularity full``: the default job (METP,
    TP 2 x DP 2, hidden dropout 0.1) for 4 iterations without recompute, with every layer
    checkpointed (uniform 1) and with only the first (block 1). Megatron's CheckpointFunction
    restores the RNG streams before it runs the forward again, so the dropout masks, the rings'
    order and every kernel repeat exactly: the losses must be equal bit for bit."""
    runs = run_ranks(4, _three_recompute_runs, timeout=300)[0]
    report(f"metp train full recompute (TP 2 x DP 2, dropout 0.1): losses {runs}")
    assert len(runs["none"]) == 4
    assert runs["uniform-1"] == runs["none"] and runs["block-1"] == runs["none"]


@pytest.mark.full
def test_overlapped_grad_reduce_and_param_gather_train_alike(tmp_path):
    """metp 2 x data-parallel 2 on 4 CPU ranks with the distributed optimizer: with
    --overlap-grad-reduce --overlap-param-gather (the reduce issued bucket by bucket during the
    backward, the updated parameters gathered under the next forward, waited for by DDP's
    pre-hooks, the METP layers' weight pre-hooks and the ring loss's) the losses are those of
    the run without overlap, and a checkpoint saved mid-run holds the gathered parameters
    (the resumed run goes on with the same losses). Tolerance 0: both runs sum the same
    buckets in the same order; only when the sums are issued changes."""
    base = ["--config", "tiny-llama", "--tensor-parallel-mode", "metp", "--train-iters", "6",
            "--hidden-dropout", "0", "--no-progress", "--use-distributed-optimizer",
            "--lr-decay-iters", "6"]   # the schedule of 6 iterations, also in the 3-iteration run
    plain = run_ranks(4, _losses_task, base, timeout=300)[0]["metp"]["losses"]
    ckpt = str(tmp_path / "ckpt")
    overlap = base + ["--overlap-grad-reduce", "--overlap-param-gather"]
    first = run_ranks(4, _losses_task, overlap + ["--train-iters", "3", "--save", ckpt],
                      timeout=300)[0]["metp"]["losses"]
    assert first == plain[:3], (first, plain)
    resumed = run_ranks(4, _losses_task, overlap + ["--load", ckpt],
                        timeout=300)[0]["metp"]["losses"]
    assert resumed == plain[3:], (resumed, plain)
