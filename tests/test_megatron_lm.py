"""Megatron-LM integration: flags, mode remap and validation of what Megatron parsed, the builder.

(The hook points per release, the no-patch script and the patch: test_megatron_lm_releases.py.)

Megatron-LM's training package is not installable here and its ``pretrain()`` needs CUDA, so:

* the argument path runs against a parser declaring the flags this integration reads exactly as
  Megatron-LM core_v0.16.1's ``megatron/training/arguments.py`` does (names, types, ``nargs``,
  defaults); with ``MEGATRON_LM_PATH`` set to a checkout at that tag, one more test runs the real
  parser, Megatron-LM's own ``validate_args`` and ``core_transformer_config_from_args`` in a
  subprocess;
* the builder runs against Megatron-Core directly on gloo ranks, and is compared with the
  plugin's ``megatron_metp.model.build_gpt_model`` (same spec, same seed -> same weights).
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

from megatron_metp import megatron_lm as mlm
from megatron_metp.validation import MetpConfigError
from tests._harness import run_ranks

ROOT = Path(__file__).resolve().parents[1]


def add_megatron_like_arguments(p: argparse.ArgumentParser) -> argparse.ArgumentParser:
    """The flags read here, declared as Megatron-LM core_v0.16.1 declares them."""
    p.add_argument("--tensor-model-parallel-size", type=int, default=1)
    p.add_argument("--context-parallel-size", type=int, default=1)
    p.add_argument("--pipeline-model-parallel-size", type=int, default=1)
    p.add_argument("--sequence-parallel", action="store_true")
    p.add_argument("--cp-comm-type", nargs="+", type=str, default=["p2p"])
    p.add_argument("--num-layers", type=int, default=2)
    p.add_argument("--hidden-size", type=int, default=64)
    p.add_argument("--num-attention-heads", type=int, default=8)
    p.add_argument("--group-query-attention", action="store_true")
    p.add_argument("--num-query-groups", type=int, default=1)
    p.add_argument("--ffn-hidden-size", type=int, default=None)
    p.add_argument("--seq-length", type=int, default=64)
    p.add_argument("--data-path", nargs="*", default=None)
    p.add_argument("--spec", type=str, default=None, nargs="*")
    p.add_argument("--yaml-cfg", type=str, default=None)
    p.add_argument("--transformer-impl", default="transformer_engine",
                   choices=["local", "transformer_engine"])
    return p


def _megatron_like_parse(argv, provider):
    p = add_megatron_like_arguments(argparse.ArgumentParser(allow_abbrev=False))
    ns = provider(p).parse_args(argv)
    ns.world_size = int(os.environ.get("WORLD_SIZE", "1"))  # as Megatron-LM's parse_args does
    return ns


# ----------------------------------------------------------------------------- flags
def test_provider_adds_the_flags_and_chains():
    def other(parser):
        parser.add_argument("--other-flag", type=int, default=3)
        return parser

    p = mlm.chain_providers(None, other)(argparse.ArgumentParser(allow_abbrev=False))
    ns = p.parse_args([])
    assert (ns.tensor_parallel_mode, ns.wallfacer_team_size, ns.wallfacer_placement,
            ns.other_flag) == ("tp", None, "team-consecutive", 3)
    ns = p.parse_args(["--tensor-parallel-mode", "wallfacer", "--wallfacer-team-size", "auto",
                       "--wallfacer-placement", "ring-consecutive"])
    assert (ns.wallfacer_team_size, ns.wallfacer_placement) == ("auto", "ring-consecutive")
    assert p.parse_args(["--wallfacer-team-size", "4"]).wallfacer_team_size == 4
    for bad in (["--wallfacer-team-size", "0"], ["--wallfacer-team-size", "x"],
                ["--wallfacer-placement", "nodes"]):
        with pytest.raises(SystemExit):  # argparse refuses before anything starts
            p.parse_args(bad)
    # An unknown mode passes argparse (whose refusal prints the usage text on every rank) and
    # is refused once, in one line, by the plugin's validation.
    ns = p.parse_args(["--tensor-parallel-mode", "ulysses"])
    with pytest.raises(MetpConfigError, match="--tensor-parallel-mode 'ulysses' is unknown"):
        mlm.remap_and_validate(ns, argv=["--tensor-parallel-mode", "ulysses"])


# ----------------------------------------------------------------------------- remap
def _ns(**kw):
    base = dict(tensor_parallel_mode="wallfacer", tensor_model_parallel_size=4,
                context_parallel_size=1, sequence_parallel=True, cp_comm_type=["p2p"])
    base.update(kw)
    return argparse.Namespace(**base)


def test_remap_wallfacer_moves_tp_to_cp():
    logs = []
    ns = mlm.apply_mode_remap(_ns(), explicit=set(), log=logs.append)
    assert (ns.tensor_model_parallel_size, ns.context_parallel_size, ns.sequence_parallel,
            ns.cp_comm_type) == (1, 4, False, ["wallfacer"])
    assert len(logs) == 1 and "--context-parallel-size 4" in logs[0]
    # Idempotent: a second call changes nothing.
    mlm.apply_mode_remap(ns, explicit=set(), log=logs.append)
    assert (ns.tensor_model_parallel_size, ns.context_parallel_size) == (1, 4)


def test_remap_explicit_cp_composes_with_tp():
    ns = mlm.apply_mode_remap(_ns(tensor_model_parallel_size=2, context_parallel_size=4),
                              explicit={"--context-parallel-size"}, log=lambda m: None)
    assert (ns.tensor_model_parallel_size, ns.context_parallel_size, ns.sequence_parallel,
            ns.cp_comm_type) == (2, 4, True, ["wallfacer"])


def test_remap_conflicting_cp_comm_type():
    # An explicit --cp-comm-type p2p is a conflict; Megatron's default p2p is not.
    with pytest.raises(MetpConfigError, match="--cp-comm-type"):
        mlm.apply_mode_remap(_ns(), explicit={"--cp-comm-type"}, log=lambda m: None)
    mlm.apply_mode_remap(_ns(), explicit=set(), log=lambda m: None)
    # Without knowing the command line, only non-default types conflict.
    with pytest.raises(MetpConfigError, match="--cp-comm-type a2a"):
        mlm.apply_mode_remap(_ns(cp_comm_type=["a2a"]), log=lambda m: None)
    mlm.apply_mode_remap(_ns(cp_comm_type="wallfacer"), explicit={"--cp-comm-type"},
                         log=lambda m: None)


def test_remap_leaves_other_modes_alone():
    for mode in ("tp", "metp"):
        ns = mlm.apply_mode_remap(_ns(tensor_parallel_mode=mode), explicit=set())
        assert (ns.tensor_model_parallel_size, ns.context_parallel_size,
                ns.sequence_parallel, ns.cp_comm_type) == (4, 1, True, ["p2p"])


# ----------------------------------------------------------------------------- parse
def test_remap_and_validate_on_what_megatron_parsed(monkeypatch, tmp_path):
    monkeypatch.setenv("WORLD_SIZE", "4")
    a, b = str(tmp_path / "a"), str(tmp_path / "b")
    for name in (a, b):   # Megatron indexed datasets (their files are checked, not read)
        for ext in (".bin", ".idx"):
            Path(name + ext).write_bytes(b"")
    argv = ["--tensor-model-parallel-size", "4", "--sequence-parallel",
            "--tensor-parallel-mode", "wallfacer", "--wallfacer-team-size", "2",
            "--data-path", a, b]
    provider = mlm.chain_providers()
    ns = mlm.remap_and_validate(_megatron_like_parse(argv, provider), argv)
    assert (ns.tensor_model_parallel_size, ns.context_parallel_size, ns.sequence_parallel,
            ns.cp_comm_type, ns.wallfacer_team_size, ns.data_path) == (
        1, 4, False, ["wallfacer"], 2, [a, b])
    # Other modes untouched; the provider chained twice registers the flags once.
    argv = ["--tensor-model-parallel-size", "4", "--sequence-parallel",
            "--tensor-parallel-mode", "metp"]
    ns = mlm.remap_and_validate(_megatron_like_parse(argv, mlm.chain_providers(provider)), argv)
    assert (ns.tensor_model_parallel_size, ns.context_parallel_size, ns.sequence_parallel) == (
        4, 1, True)
    # --metp-ring-pass auto and --metp-qkv-backward auto are planned here, before Megatron
    # builds anything: the small model fits 80 GiB with the all-to-all pass, its Q/K/V and its
    # MLP's fc1 output saved. A named value is kept as given (and the other still planned).
    assert (ns.metp_ring_pass, ns.metp_qkv_backward) == ("a2a", "save+fc1")
    ns = mlm.remap_and_validate(_megatron_like_parse(argv + ["--metp-qkv-backward", "recompute"],
                                                     provider), argv)
    assert (ns.metp_ring_pass, ns.metp_qkv_backward) == ("a2a", "recompute")
    # The kept weights are a named choice (auto never takes them): kept as given.
    ns = mlm.remap_and_validate(_megatron_like_parse(
        argv + ["--metp-qkv-backward", "save+fc1+weights"], provider), argv)
    assert (ns.metp_ring_pass, ns.metp_qkv_backward) == ("a2a", "save+fc1+weights")
    ns = mlm.remap_and_validate(_megatron_like_parse(argv + ["--metp-ring-pass", "head-group"],
                                                     provider), argv)
    assert (ns.metp_ring_pass, ns.metp_qkv_backward) == ("head-group", "recompute")


def test_remap_and_validate_refuses_before_anything_starts(monkeypatch):
    monkeypatch.setenv("WORLD_SIZE", "4")
    provider = mlm.chain_providers()
    cases = [
        (["--tensor-model-parallel-size", "4", "--tensor-parallel-mode", "metp"],
         "--sequence-parallel"),
        (["--tensor-model-parallel-size", "4", "--tensor-parallel-mode", "wallfacer",
          "--cp-comm-type", "p2p"], "--cp-comm-type"),
        (["--tensor-model-parallel-size", "4", "--tensor-parallel-mode", "wallfacer",
          "--wallfacer-team-size", "4"], "--wallfacer-team-size"),
        (["--tensor-model-parallel-size", "4", "--tensor-parallel-mode", "wallfacer",
          "--seq-length", "36"], "--seq-length"),
        (["--tensor-model-parallel-size", "3"], "--tensor-model-parallel-size"),
    ]
    for argv, flag in cases:
        with pytest.raises(MetpConfigError) as info:
            mlm.remap_and_validate(_megatron_like_parse(argv, provider), argv)
        assert flag in str(info.value), (argv, str(info.value))


@pytest.mark.skipif(not os.environ.get("MEGATRON_LM_PATH"),
                    reason="set MEGATRON_LM_PATH to a Megatron-LM core_v0.16.1 checkout whose "
                           "training package imports (six, regex, pydantic, triton installed)")
def test_real_megatron_lm_arguments():
    """Megatron-LM's own parser, validate_args and config conversion see the remapped sizes."""
    code = r"""
import sys
import megatron.training.arguments as A
from megatron_metp import megatron_lm as mlm
from megatron_metp import megatron_lm_hooks as hooks
A.get_device_arch_version = lambda: 9  # validate_args queries the GPU; there is none here
sys.argv = ["pretrain_gpt.py"] + mlm.config_flags("tiny-llama", training=False) + [
            "--seq-length", "64", "--max-position-embeddings", "64",
            "--micro-batch-size", "1", "--tensor-model-parallel-size", "4", "--sequence-parallel",
            "--tensor-parallel-mode", "wallfacer", "--wallfacer-team-size", "2", "--mock-data",
            "--tokenizer-type", "NullTokenizer", "--vocab-size", "128", "--train-iters", "1",
            "--lr", "1e-4", "--transformer-impl", "local", "--attention-dropout", "0",
            "--no-rope-fusion"]  # RoPE fusion needs Transformer Engine
hooks.install(hooks.HookPlan(hooks.release_name(), "builder"))
args = A.parse_args(None)  # the hooked parse: flags, remap, the plugin's validation
A.validate_args(args, {})
cfg = A.core_transformer_config_from_args(args)
print("RESULT", args.tensor_model_parallel_size, args.context_parallel_size,
      args.sequence_parallel, cfg.cp_comm_type, args.wallfacer_team_size, args.data_parallel_size,
      cfg.num_query_groups, cfg.gated_linear_unit, cfg.normalization)
"""
    env = dict(os.environ, WORLD_SIZE="4", RANK="0", CUDA_DEVICE_MAX_CONNECTIONS="1",
               PYTHONPATH=os.pathsep.join([os.environ["MEGATRON_LM_PATH"], str(ROOT),
                                           os.environ.get("PYTHONPATH", "")]))
    r = subprocess.run([sys.executable, "-c", code], env=env, capture_output=True, text=True,
                       timeout=300)
    assert r.returncode == 0, r.stderr[-3000:]
    line = [ln for ln in r.stdout.splitlines() if ln.startswith("RESULT")][-1]
    # tiny-llama: 2 query groups, SwiGLU, RMSNorm, as config_flags passed them.
    assert line.split()[1:] == ["1", "4", "False", "wallfacer", "2", "1", "2", "True", "RMSNorm"]

    # The wrapper end to end, through pretrain(): tests/test_megatron_lm_training.py.


@pytest.mark.parametrize("mode", ["metp", "wallfacer"])
@pytest.mark.parametrize("flags,words", [
    (["--enable-cuda-graph"], "--enable-cuda-graph is not supported"),
    (["--external-cuda-graph"], "--external-cuda-graph is not supported"),
    (["--cuda-graph-impl", "local"], "--cuda-graph-impl local is not supported"),
    (["--fp8-format", "hybrid"], "--fp8-format is not supported"),
    (["--fp4-format", "nvfp4"], "--fp4-format is not supported"),
    (["--deterministic-mode"], "--deterministic-mode is not supported"),
    ([], "--attention-dropout 0.1"),   # Megatron-LM's default, not given
])
def test_launch_check_refuses_what_the_ranks_would(mode, flags, words):
    """The plugin's torchrun and SLURM check (``check_launch``) refuse, in one line naming the
    flag, what every rank's ``validate_args`` would refuse: CUDA graphs, FP8 / FP4 and
    deterministic mode under either plugin mode, and Megatron-LM's default attention dropout
    (0.1) where the flag is left out; stock (tp) takes every one of them."""
    base = ["--num-layers", "2", "--hidden-size", "64", "--num-attention-heads", "4",
            "--seq-length", "64", "--tensor-parallel-mode", mode,
            "--tensor-model-parallel-size", "2", "--sequence-parallel"]
    given = flags if not flags else flags + ["--attention-dropout", "0"]
    with pytest.raises(mlm.MetpConfigError) as e:
        mlm.check_launch(None, 2, base + given)
    assert words in str(e.value) and "\n" not in str(e.value), str(e.value)
    stock = [t for t in base if t not in ("metp", "wallfacer", "--tensor-parallel-mode")]
    mlm.check_launch(None, 2, stock + flags)


@pytest.mark.skipif(not os.environ.get("MEGATRON_LM_PATH"),
                    reason="set MEGATRON_LM_PATH to a Megatron-LM core_v0.16.1 checkout whose "
                           "defaults check_launch mirrors")
def test_launch_defaults_are_megatron_lms():
    """``MEGATRON_LM_DEFAULTS`` is what Megatron-LM's own parser gives where the flags are not
    given."""
    code = r"""
import json, sys
import megatron.training.arguments as A
from megatron_metp import megatron_lm as mlm
sys.argv = ["pretrain_gpt.py"]
args = A.parse_args(None, ignore_unknown_args=True)
print("RESULT " + json.dumps({k: getattr(args, k) for k in mlm.MEGATRON_LM_DEFAULTS}))
"""
    env = dict(os.environ, PYTHONPATH=os.pathsep.join([os.environ["MEGATRON_LM_PATH"], str(ROOT),
                                                       os.environ.get("PYTHONPATH", "")]))
    r = subprocess.run([sys.executable, "-c", code], env=env, capture_output=True, text=True,
                       timeout=300)
    assert r.returncode == 0, r.stderr[-3000:]
    line = [ln for ln in r.stdout.splitlines() if ln.startswith("RESULT ")][-1]
    assert json.loads(line[len("RESULT "):]) == mlm.MEGATRON_LM_DEFAULTS


# ----------------------------------------------------------------------------- builder
def _builder_args(mode, tp=1, cp=1, **kw):
    ns = argparse.Namespace(
        tensor_parallel_mode=mode, tensor_model_parallel_size=tp, context_parallel_size=cp,
        pipeline_model_parallel_size=1, sequence_parallel=tp > 1, seq_length=16,
        hidden_size=32, num_attention_heads=4, num_layers=2, ffn_hidden_size=128,
        cp_comm_type=["wallfacer"] if mode == "wallfacer" else ["p2p"],
        wallfacer_team_size=None, wallfacer_placement="team-consecutive",
        padded_vocab_size=64, max_position_embeddings=16,
        untie_embeddings_and_output_weights=True, position_embedding_type="learned_absolute")
    for k, v in kw.items():
        setattr(ns, k, v)
    return ns


def test_builder_tp_falls_through_and_validates_first():
    seen = []

    def fallback(args, pre, post, vp, config=None, pg_collection=None):
        seen.append((args, pre, post, vp, config, pg_collection))
        return "model"

    args = _builder_args("tp", world_size=1)
    assert mlm.make_gpt_builder(fallback)(args, True, False, None, config="cfg") == "model"
    assert seen == [(args, True, False, None, "cfg", None)]
    with pytest.raises(MetpConfigError, match="--num-attention-heads"):
        mlm.gpt_builder(_builder_args("tp", tp=3, world_size=3), fallback=fallback)
    assert len(seen) == 1


def _build_and_compare(mode: str, tp: int, cp: int, **kw):
    """On every rank: Megatron's groups only, then the builder registers the plugin's groups and
    builds the mode's model; compared with megatron_metp.model.build_gpt_model from the same seed."""
    import torch
    from megatron.core import parallel_state as mpu
    from megatron.core.tensor_parallel import model_parallel_cuda_manual_seed

    from megatron_metp import parallel_state as ps
    from megatron_metp.model import build_gpt_model, make_config

    mpu.initialize_model_parallel(tensor_model_parallel_size=tp, context_parallel_size=cp,
                                  create_gloo_process_groups=False)
    model_parallel_cuda_manual_seed(1234)
    assert not ps.metp_is_initialized() and not ps.wallfacer_is_initialized()
    args = _builder_args(mode, tp=tp, cp=cp, world_size=tp * cp, **kw)
    config = make_config(num_layers=2, hidden_size=32, num_attention_heads=4,
                         ffn_hidden_size=128, cp_comm_type=args.cp_comm_type[0])
    torch.manual_seed(7)
    model = mlm.gpt_builder(args, True, True, None, config=config)
    registered = (ps.metp_is_initialized(), ps.wallfacer_is_initialized())
    torch.manual_seed(7)
    ref = build_gpt_model(config, mode, vocab_size=64, max_sequence_length=16)
    same = {n: torch.equal(p, dict(ref.named_parameters())[n])
            for n, p in model.named_parameters()}
    layer = model.decoder.layers[0]
    return dict(registered=registered,
                names=[n for n, _ in model.named_parameters()],
                ref_names=[n for n, _ in ref.named_parameters()], same=same,
                mlp=type(layer.mlp).__name__,
                core=type(layer.self_attention.core_attention).__name__,
                attn=type(layer.self_attention).__name__,
                team_size=ps.get_wallfacer_groups().team_size if registered[1] else None)


def test_builder_metp_on_two_ranks():
    for r in run_ranks(2, _build_and_compare, "metp", 2, 1):
        assert r["registered"] == (True, False)
        assert r["names"] == r["ref_names"] and all(r["same"].values())
        assert (r["mlp"], r["attn"]) == ("MetpMLP", "MetpSelfAttention")


def test_builder_wallfacer_on_two_ranks():
    for r in run_ranks(2, _build_and_compare, "wallfacer", 1, 2):
        assert r["registered"] == (False, True)
        assert r["names"] == r["ref_names"] and all(r["same"].values())
        assert r["core"] == "WallFacerCoreAttention"


def test_builder_wallfacer_team_size_auto():
    # 'auto' runs the topology scheduler on this run's attention shape; at P = 2 only C = 1
    # (ring attention) is valid, so the scheduler must pick it.
    out = run_ranks(2, _build_and_compare, "wallfacer", 1, 2, wallfacer_team_size="auto",
                    wallfacer_placement=None, micro_batch_size=1)
    for r in out:
        assert r["registered"] == (False, True) and r["team_size"] == 1
        assert r["names"] == r["ref_names"] and all(r["same"].values())


def test_data_iterators_leave_the_cpu_generator_as_they_found_it():
    """megatron_lm_cpu item 11: Megatron-LM builds its data iterators after load_checkpoint has
    restored the RNG state, and each ``iter(DataLoader)`` draws a seed from the default CPU
    generator, the one dropout draws from on CPU. The stand-in forks the generator around the
    build, so the dropout stream after it is the one the checkpoint (or the seed) left."""
    import torch

    from megatron_metp.megatron_lm_cpu import _cpu_rng_neutral

    def build(n):
        """Draws as a DataLoader's iterator does (its base seed), then returns."""
        list(torch.utils.data.DataLoader(range(n), batch_size=2))
        return torch.empty((), dtype=torch.int64).random_().item()

    torch.manual_seed(7)
    expected = torch.rand(4)
    torch.manual_seed(7)
    wrapped = _cpu_rng_neutral(build)
    assert wrapped.__name__ == "build"
    wrapped(4)
    assert torch.equal(torch.rand(4), expected)   # the draws inside left no trace
    torch.manual_seed(7)
    build(4)
    assert not torch.equal(torch.rand(4), expected)   # unwrapped, they do


def test_stock_tp_sequence_parallel_needs_a_norm_that_allows_it():
    # Megatron's local spec builds WrappedTorchNorm without Apex, which asserts on SP in every
    # rank: refused once, naming the flag and the fixes.
    ns = argparse.Namespace(tensor_parallel_mode="tp", tensor_model_parallel_size=2,
                            sequence_parallel=True, transformer_impl="local", spec=None)
    with pytest.raises(MetpConfigError, match="--sequence-parallel .* install Apex"):
        mlm.check_stock_norm(ns, have_apex_norm=lambda: False)
    mlm.check_stock_norm(ns, have_apex_norm=lambda: True)          # Apex's FusedLayerNorm
    for change in (dict(transformer_impl="transformer_engine"), dict(sequence_parallel=False),
                   dict(tensor_model_parallel_size=1), dict(tensor_parallel_mode="metp")):
        mlm.check_stock_norm(argparse.Namespace(**{**vars(ns), **change}),
                             have_apex_norm=lambda: False)


def test_plugin_torchrun_refuses_before_any_rank_and_otherwise_is_torchrun(tmp_path):
    """``python -m megatron_metp.megatron_lm torchrun``: a bad configuration stops in one line
    with exit code 2 and no rank started (torchrun alone ends it with ChildFailedError and 1);
    good flags run torchrun with the same arguments."""
    # Each rank leaves a file: two ranks printing to one pipe can interleave mid-line
    # (CI saw "rankrank 0 of 2 started" once), so stdout is not the witness.
    started = tmp_path / "started"
    started.mkdir()
    script = tmp_path / "script.py"
    script.write_text("import os, pathlib\n"
                      f"pathlib.Path({str(started)!r}, os.environ['RANK']).write_text("
                      "os.environ['WORLD_SIZE'])\n")
    env = {k: v for k, v in os.environ.items()
           if k not in ("RANK", "WORLD_SIZE", "LOCAL_RANK", "MASTER_ADDR", "MASTER_PORT")}
    root = Path(__file__).resolve().parents[1]
    base = [sys.executable, "-m", "megatron_metp.megatron_lm", "torchrun", "--nproc-per-node",
            "2", "--standalone", str(script), "--num-layers", "2", "--hidden-size", "64",
            "--seq-length", "64", "--tensor-parallel-mode", "metp",
            "--tensor-model-parallel-size", "2", "--sequence-parallel"]
    # Megatron-LM's default --attention-dropout 0.1, which every METP rank would refuse, is
    # refused here, before any rank starts.
    dropout = subprocess.run(base + ["--num-attention-heads", "4"], cwd=root, env=env,
                             capture_output=True, text=True, timeout=120)
    assert dropout.returncode == 2 and not list(started.iterdir()), dropout.stderr
    assert len(dropout.stderr.strip().splitlines()) == 1 and \
        "--attention-dropout 0.1" in dropout.stderr, dropout.stderr
    base += ["--attention-dropout", "0"]
    bad = subprocess.run(base + ["--num-attention-heads", "6"], cwd=root, env=env,
                         capture_output=True, text=True, timeout=120)
    assert bad.returncode == 2 and not list(started.iterdir()), (bad.stdout, bad.stderr)
    assert bad.stderr.strip().splitlines() == [
        "megatron-metp: error: --hidden-size 64 is not divisible by --num-attention-heads 6 "
        "(and --kv-channels is not set): choose heads dividing the hidden size"], bad.stderr
    # The world size is the launch's: 2 ranks cannot hold TP 4.
    small = subprocess.run(base + ["--num-attention-heads", "4", "--tensor-model-parallel-size",
                                   "4"], cwd=root, env=env, capture_output=True, text=True,
                           timeout=120)
    assert (small.returncode == 2 and not list(started.iterdir())
            and "--tensor-model-parallel-size" in small.stderr), small.stderr
    good = subprocess.run(base + ["--num-attention-heads", "4"], cwd=root, env=env,
                          capture_output=True, text=True, timeout=120)
    assert good.returncode == 0, good.stderr[-2000:]
    assert sorted((f.name, f.read_text()) for f in started.iterdir()) == [("0", "2"), ("1", "2")]


def test_groups_end_after_a_normal_return_only(monkeypatch):
    """``megatron_lm_hooks.end_process_groups`` (both routes run it after ``pretrain()``: the
    no-patch script explicitly, the patch at exit): it ends a live group, and after an uncaught
    exception (``sys.last_value`` set) it leaves the groups alone."""
    import datetime

    import torch.distributed as dist

    from megatron_metp import megatron_lm_hooks as hooks

    monkeypatch.delattr(sys, "last_value", raising=False)
    for failed in (True, False):
        dist.init_process_group("gloo", store=dist.HashStore(), rank=0, world_size=1,
                                timeout=datetime.timedelta(seconds=30))
        try:
            if failed:
                monkeypatch.setattr(sys, "last_value", RuntimeError("a rank failed"),
                                    raising=False)
            hooks.end_process_groups()
            assert dist.is_initialized() == failed
        finally:
            monkeypatch.delattr(sys, "last_value", raising=False)
            if dist.is_initialized():
                dist.destroy_process_group()
