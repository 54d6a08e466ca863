"""METP with Megatron's context parallelism: METP on the TP group, CP across
it. Training losses of ``metp train`` at TP x CP against stock ``tp`` at the same TP size
without CP (stock Megatron CP needs Transformer Engine's attention, not installable here), same
seed, data and global batch, dropout 0, fp32:

    tiny GPT    metp TP 4 x CP 2 (8 ranks, DP 1)   vs  tp TP 4 (DP 2)
    tiny LLaMA  metp TP 2 x CP 2 (4 ranks, DP 1)   vs  tp TP 2 (DP 2)   (RoPE, GQA, SwiGLU)

The reference's DP 2 and CP 2 see the same tokens per iteration: DP splits the global batch by
sequences (one micro-batch each), CP by positions (every micro-batch, two of them); the loss is
the mean over the same tokens either way. The attention-level comparison against the fp64
reference is in ``tests/test_metp_attention.py``, the refusals in ``tests/test_validation.py``.
"""

from __future__ import annotations

from pathlib import Path

import pytest

from megatron_metp import launch
from megatron_metp.training import cli
from tests._harness import run_ranks

ITERS = 2  # step 1 checks the forward, step 2 the gradients and the optimizer step
# Small enough for 8 ranks on 2 cores: 2 sequences of 32 tokens per iteration.
COMMON = ["--seq-length", "32", "--micro-batch-size", "1", "--global-batch-size", "2",
          "--train-iters", str(ITERS), "--lr-warmup-iters", "0", "--hidden-dropout", "0",
          "--attention-dropout", "0", "--no-progress"]


def _train(argv_by_name):
    from megatron_metp.training import train

    out = {}
    for name, argv in argv_by_name.items():
        parser, _ = cli.build_parser()
        full = ["train", *argv, *COMMON]
        res = train.run(parser.parse_args(full), cli.explicit_flags(full))
        (mode_res,) = res.values()
        out[name] = mode_res["losses"]
    return out


def _one_layer(config, tmp_path):
    """The shipped preset with one layer (8 ranks share 2 cores; a second layer would add
    nothing CP-specific), as a --config path."""
    import yaml

    from megatron_metp.models.config import resolve_config_path

    data = yaml.safe_load(resolve_config_path(config).read_text())
    data.update(name=f"{config}-1-layer", num_layers=1)
    path = tmp_path / f"{config}-1-layer.yaml"
    path.write_text(yaml.safe_dump(data))
    return str(path)


def _check(world, config, tp, report, tmp_path):
    config = _one_layer(config, tmp_path)
    argv = {
        "metp x cp": ["--config", config, "--tensor-parallel-mode", "metp",
                      "--tensor-model-parallel-size", str(tp), "--context-parallel-size", "2"],
        "tp": ["--config", config, "--tensor-parallel-mode", "tp",
               "--tensor-model-parallel-size", str(tp)],
    }
    out = run_ranks(world, _train, argv, timeout=400)
    losses = out[0]
    assert all(o == losses for o in out)  # every rank reports the same curves
    got, ref = losses["metp x cp"], losses["tp"]
    assert len(got) == len(ref) == ITERS
    assert ref[-1] < ref[0]  # it trains
    worst = max(abs(a - b) for a, b in zip(got, ref))
    report(f"metp train {Path(config).stem} TP {tp} x CP 2 vs tp TP {tp} ({ITERS} it, fp32): max |dloss| "
           f"{worst:.1e} (losses {ref[0]:.4f} -> {ref[-1]:.4f})")
    # Tolerance 1e-4 absolute on losses of ~5.5-6.3 (2e-5 relative), as test_train's --compare
    # between modes: the two runs do the same arithmetic in different orders (ring-merged
    # softmax blocks over 2 or 4 ranks in sequence-scrambled order, CP-summed instead of
    # DP-summed gradients, micro-batch accumulation instead of a DP all-reduce), a few fp32 ulps
    # per step carried by Adam for 1 step. A wrong causal block, RoPE position, position row,
    # label slice or a missing CP reduction moves the loss by >1e-2 at the first step.
    assert worst <= 1e-4, (got, ref)


def test_metp_tp2_cp2_gpt_losses_equal_tp(report, tmp_path):
    _check(4, "tiny-gpt", 2, report, tmp_path)


# 8 ranks on 2 cores (~26 s): in the full tier; TP 2 x CP 2 above covers the GPT style (learned
# positions, tied embeddings) in the default one, and the module tests cover TP 4 rings.
@pytest.mark.full
def test_metp_tp4_cp2_gpt_losses_equal_tp(report, tmp_path):
    _check(8, "tiny-gpt", 4, report, tmp_path)


def test_metp_tp2_cp2_llama_losses_equal_tp(report, tmp_path):
    _check(4, "tiny-llama", 2, report, tmp_path)


CP_FLAGS = ["--tensor-parallel-mode", "metp", "--tensor-model-parallel-size", "4",
            "--context-parallel-size", "2", "--nproc-per-node", "8"]


def _main(argv, monkeypatch):
    for k in ("RANK", "WORLD_SIZE", "SLURM_PROCID", "SLURM_NTASKS"):
        monkeypatch.delenv(k, raising=False)
    launched = []
    monkeypatch.setattr(launch, "run_process_group", lambda cmd, env: launched.append(cmd) or 0)
    return cli.main(["train", *argv]), launched


def test_cli_metp_tp4_cp2_passes_preflight_and_launches(monkeypatch, capsys):
    """``metp train`` at TP 4 x CP 2 on 8 ranks: the launching process's checks pass and the 8
    ranks are started with the flags (the ranks then run train.run, as the tests above do)."""
    rc, launched = _main(CP_FLAGS, monkeypatch)
    assert rc == 0, capsys.readouterr().err
    assert len(launched) == 1 and "--context-parallel-size" in launched[0]
    assert "--nproc-per-node=8" in " ".join(launched[0])


@pytest.mark.parametrize("argv,flag", [
    # odd TP with CP: a TP rank would straddle the CP rank's two chunks
    (["--tensor-parallel-mode", "metp", "--tensor-model-parallel-size", "1",
      "--context-parallel-size", "2", "--nproc-per-node", "2"], "--tensor-model-parallel-size"),
    # 36 tokens: 18 per CP rank, not 4 TP blocks of whole tokens
    (CP_FLAGS + ["--seq-length", "36"], "--seq-length"),
    (CP_FLAGS + ["--cp-comm-type", "a2a"], "--cp-comm-type"),
    # METP's all-to-all attention runs over the TP group; under CP the K/V ride the TP x CP ring
    (CP_FLAGS + ["--metp-ring-pass", "a2a"], "--metp-ring-pass a2a"),
])
def test_cli_refuses_metp_cp_by_name(argv, flag, monkeypatch, capsys):
    rc, launched = _main(argv, monkeypatch)
    err = capsys.readouterr().err
    assert rc == 2 and launched == []
    lines = err.strip().splitlines()
    assert len(lines) == 1 and flag in lines[0], err
