"""Megatron-LM releases core_v0.16.1 to core_v0.19.x: the hook points, --yaml-cfg, Transformer Engine.

megatron-core 0.17+ needs Python 3.12, so the newer releases cannot be imported here. Each
release's entry points are stood in for by stub modules written for these tests, shaped like
that release's (the names, signatures and call order its ``pretrain_gpt.py`` ``__main__``
relies on; see ``megatron_metp/megatron_lm_hooks.py`` for the table). Each stub release runs
end to end twice: through ``scripts/pretrain_gpt_metp.py`` (no patch) and as a stub
``pretrain_gpt.py`` with ``patches/pretrain_gpt_metp.patch`` applied. The real check against
the releases is ``git apply --check`` on each tag plus ``scripts/check_megatron_lm_release.py``
(records in ``patches/README.md``).
"""

from __future__ import annotations

import importlib.util
import subprocess
import sys
import textwrap
import types
from pathlib import Path

import pytest

from megatron_metp import megatron_lm as metp_lm
from megatron_metp import megatron_lm_hooks as hooks
from megatron_metp import te_backend
from megatron_metp.validation import MetpConfigError

ROOT = Path(__file__).resolve().parents[1]

# ----------------------------------------------------------------------------- stub releases
_TRAINING_PKG = '''
events = []
_args = None

def get_args():
    return _args

def set_args(args):
    global _args
    _args = args
'''

_ARGUMENTS = '''
import argparse
import os
from types import SimpleNamespace

from megatron.training import events, set_args

from tests.test_megatron_lm import add_megatron_like_arguments

def add_megatron_arguments(parser):
    parser = add_megatron_like_arguments(parser)
    parser.add_argument("--attention-dropout", type=float, default=0.1)  # Megatron's default
    return parser

def parse_args(extra_args_provider=None, ignore_unknown_args=False):
    parser = add_megatron_arguments(argparse.ArgumentParser(allow_abbrev=False))
    if extra_args_provider is not None:
        parser = extra_args_provider(parser)
    args = parser.parse_known_args()[0] if ignore_unknown_args else parser.parse_args()
    if args.yaml_cfg is not None:
        from megatron.training.yaml_arguments import load_yaml
        args = load_yaml(args.yaml_cfg)
    args.rank = int(os.getenv("RANK", "0"))
    args.world_size = int(os.getenv("WORLD_SIZE", "1"))
    return args

def validate(args, defaults):  # validate_yaml for --yaml-cfg, else validate_args
    if args.yaml_cfg is not None:
        from megatron.training.yaml_arguments import validate_yaml
        return validate_yaml(args, defaults)
    validate_args(args, defaults)
    return args

def validate_args(args, defaults={}):
    events.append(("megatron validates", args.tensor_model_parallel_size,
                   args.context_parallel_size, args.sequence_parallel, args.cp_comm_type))
    args.padded_vocab_size, args.max_position_embeddings = 128, args.seq_length
    return args

def core_transformer_config_from_args(args):
    return SimpleNamespace(source="args")
'''

_PARSE_AND_VALIDATE = '''
def parse_and_validate_args(extra_args_provider=None, ignore_unknown_args=False,
                            args_defaults={}):
    args = validate(parse_args(extra_args_provider, ignore_unknown_args), args_defaults)
    set_args(args)
    return args
'''

_YAML_ARGUMENTS = '''
from types import SimpleNamespace

import yaml

from megatron.training import events

def _namespace(value):
    if isinstance(value, dict):
        return SimpleNamespace(**{k: _namespace(v) for k, v in value.items()})
    return value

def load_yaml(path):
    with open(path) as f:
        ns = _namespace(yaml.safe_load(f))
    ns.yaml_cfg = path
    return ns

def validate_yaml(args, defaults={}):
    mp, lm = args.model_parallel, args.language_model
    events.append(("megatron validates", mp.tensor_model_parallel_size, mp.context_parallel_size,
                   mp.sequence_parallel, getattr(mp, "cp_comm_type", None) or lm.cp_comm_type))
    flat = dict(vars(args))
    flat.update(vars(mp))
    flat.update(vars(lm))
    flat.update(padded_vocab_size=128, max_position_embeddings=flat["seq_length"])
    return SimpleNamespace(**flat)

def core_transformer_config_from_yaml(args, transformer_key="language_model"):
    return SimpleNamespace(source="yaml")
'''

_INITIALIZE_PARSES = '''
from megatron.training import events, set_args
from megatron.training.arguments import parse_args, validate

def initialize_megatron(extra_args_provider=None, args_defaults={}, ignore_unknown_args=False,
                        **kwargs):
    args = validate(parse_args(extra_args_provider, ignore_unknown_args), args_defaults)
    set_args(args)
    events.append("megatron initialized")
'''

_INITIALIZE_PARSED = '''
from megatron.training import events, get_args

def initialize_megatron(**kwargs):
    assert get_args() is not None
    events.append("megatron initialized")
'''

_TRAINING_PRETRAIN_ARGS = '''
from megatron.training import events
from megatron.training.initialize import initialize_megatron

def pretrain(train_valid_test_dataset_provider, model_provider, model_type, forward_step_func,
             process_non_loss_data_func=None, extra_args_provider=None, args_defaults={},
             get_embedding_ranks=None, store=None, **kwargs):
    initialize_megatron(extra_args_provider=extra_args_provider, args_defaults=args_defaults)
    events.append(("model", model_provider(pre_process=True, post_process=True)))
'''

_TRAINING_PRETRAIN_CFG_PROVIDER = '''
from megatron.training import events
from megatron.training.initialize import initialize_megatron

def pretrain(cfg_container, train_valid_test_dataset_provider, model_provider, model_type,
             forward_step_func, store=None, get_embedding_ranks=None, **kwargs):
    initialize_megatron()
    assert cfg_container.model is None
    events.append(("model", model_provider(pre_process=True, post_process=True)))
'''

_TRAINING_PRETRAIN_CFG_MODEL = '''
import inspect

from megatron.training import events
from megatron.training.initialize import initialize_megatron

def pretrain(cfg_container, train_valid_test_dataset_provider, model_type, forward_step_func,
             model_provider=None, store=None, get_embedding_ranks=None, **kwargs):
    initialize_megatron()
    model_config = cfg_container.model
    spec = model_config.transformer_layer_spec  # GPTModelBuilder.build_model's choice
    if spec is None:
        spec = "megatron's default spec"
    elif callable(spec):
        spec = (spec(model_config, vp_stage=None)
                if "vp_stage" in inspect.signature(spec).parameters else spec(model_config))
    events.append(("model", ("GPTModelBuilder", spec)))
'''

_ARGUMENT_UTILS = '''
from types import SimpleNamespace

def pretrain_cfg_container_from_args(args, model_cfg=None):
    return SimpleNamespace(model=model_cfg)
'''

_GPT_CONFIG = '''
from megatron.core.transformer.spec_utils import import_module
from megatron.training.arguments import core_transformer_config_from_args

class GPTModelConfig:
    def __init__(self, transformer, transformer_layer_spec=None):
        self.transformer = transformer
        self.transformer_layer_spec = transformer_layer_spec

def gpt_config_from_args(args, config=None, model_config_cls=GPTModelConfig):
    if config is None:
        if args.yaml_cfg is not None:
            from megatron.training.yaml_arguments import core_transformer_config_from_yaml
            config = core_transformer_config_from_yaml(args, "language_model")
        else:
            config = core_transformer_config_from_args(args)
    spec = import_module(args.spec) if getattr(args, "spec", None) is not None else None
    return model_config_cls(transformer=config, transformer_layer_spec=spec)
'''

_GPT_BUILDERS = '''
def gpt_builder(args, pre_process, post_process, vp_stage=None, config=None, pg_collection=None):
    return "megatron's gpt_builder"
'''

_MODEL_PROVIDER = '''
from megatron.training import get_args

def model_provider(model_builder, pre_process=True, post_process=True, vp_stage=None,
                   config=None, pg_collection=None):
    return model_builder(get_args(), pre_process, post_process, vp_stage, config=config,
                         pg_collection=pg_collection)
'''

_MAIN_HEAD = '''
import time

_PROGRAM_START_TIME = time.time()

from functools import partial

from gpt_builders import gpt_builder
{imports}
from model_provider import model_provider

try:
    from megatron.post_training.arguments import add_modelopt_args
    has_nvidia_modelopt = True
except ImportError:
    has_nvidia_modelopt = False


def train_valid_test_datasets_provider(train_val_test_num_samples):
    return None, None, None


def forward_step(data_iterator, model):
    return None


if __name__ == "__main__":
    # Timestamp right after entering __main__ block (after all imports/library setup)
    _MAIN_ENTRY_TIME = time.time()

{main}
'''

_MAIN_PRETRAIN_PARSES = '''
    pretrain(
        train_valid_test_datasets_provider,
        partial(model_provider, gpt_builder),
        "encoder_or_decoder",
        forward_step,
        args_defaults={'tokenizer_type': 'GPT2BPETokenizer'},
        extra_args_provider=add_modelopt_args if has_nvidia_modelopt else None,
    )
'''

_MAIN_PARSE_THEN_BUILDER = '''
    args = parse_and_validate_args(
        extra_args_provider=add_modelopt_args if has_nvidia_modelopt else None,
        args_defaults={'tokenizer_type': 'GPT2BPETokenizer'},
    )
    full_config = pretrain_cfg_container_from_args(args)
    pretrain(full_config, train_valid_test_datasets_provider,
             partial(model_provider, gpt_builder), "encoder_or_decoder", forward_step)
'''

_MAIN_PARSE_THEN_CONFIG = '''
    args = parse_and_validate_args(
        extra_args_provider=add_modelopt_args if has_nvidia_modelopt else None,
        args_defaults={'tokenizer_type': 'GPT2BPETokenizer'},
    )
    model_cfg = gpt_config_from_args(args)
    full_config = pretrain_cfg_container_from_args(args, model_cfg)
    pretrain(full_config, train_valid_test_datasets_provider, "encoder_or_decoder", forward_step)
'''

_PRETRAIN_IMPORT = "from megatron.training import pretrain"
_PARSE_IMPORTS = (_PRETRAIN_IMPORT + "\nfrom megatron.training.argument_utils import "
                  "pretrain_cfg_container_from_args\nfrom megatron.training.arguments import "
                  "parse_and_validate_args")

# release -> (modules as source, pretrain_gpt.py's imports, its __main__ body)
RELEASES = {
    "core_v0.16.1": dict(arguments=_ARGUMENTS, initialize=_INITIALIZE_PARSES,
                         training=_TRAINING_PRETRAIN_ARGS, argument_utils=None,
                         imports=_PRETRAIN_IMPORT, main=_MAIN_PRETRAIN_PARSES),
    "core_v0.18.2": dict(arguments=_ARGUMENTS + _PARSE_AND_VALIDATE, initialize=_INITIALIZE_PARSED,
                         training=_TRAINING_PRETRAIN_CFG_PROVIDER, argument_utils=_ARGUMENT_UTILS,
                         imports=_PARSE_IMPORTS, main=_MAIN_PARSE_THEN_BUILDER),
    "core_v0.19.0": dict(arguments=_ARGUMENTS + _PARSE_AND_VALIDATE, initialize=_INITIALIZE_PARSED,
                         training=_TRAINING_PRETRAIN_CFG_MODEL,
                         argument_utils=_ARGUMENT_UTILS + _GPT_CONFIG,
                         imports=_PARSE_IMPORTS.replace(
                             "import pretrain_cfg_container_from_args",
                             "import gpt_config_from_args, pretrain_cfg_container_from_args"),
                         main=_MAIN_PARSE_THEN_CONFIG),
}
RELEASES["core_v0.17.1"] = RELEASES["core_v0.16.1"]  # the same entry points as 0.16.1


def _module(monkeypatch, name: str, source: str) -> types.ModuleType:
    mod = types.ModuleType(name)
    monkeypatch.setitem(sys.modules, name, mod)
    exec(compile(textwrap.dedent(source), f"<stub {name}>", "exec"), mod.__dict__)
    return mod


def _stub_release(monkeypatch, tmp_path: Path, release: str, *, main: str = None) -> dict:
    """A stub Megatron-LM checkout for ``release`` under ``tmp_path`` (pretrain_gpt.py,
    gpt_builders.py, model_provider.py) and stub ``megatron.training`` modules; the plugin's
    spec, groups and GPTModel replaced by recorders. Returns the shared event list."""
    shape = RELEASES[release]
    pkg = _module(monkeypatch, "megatron.training", _TRAINING_PKG)
    _module(monkeypatch, "megatron.training.arguments", shape["arguments"])
    _module(monkeypatch, "megatron.training.yaml_arguments", _YAML_ARGUMENTS)
    _module(monkeypatch, "megatron.training.initialize", shape["initialize"])
    training = _module(monkeypatch, "megatron.training.training", shape["training"])
    pkg.pretrain = training.pretrain  # megatron/training/__init__.py re-exports it
    if shape["argument_utils"]:
        _module(monkeypatch, "megatron.training.argument_utils", shape["argument_utils"])
    else:
        monkeypatch.delitem(sys.modules, "megatron.training.argument_utils", raising=False)
    for name in ("gpt_builders", "model_provider", "pretrain_gpt"):
        monkeypatch.setitem(sys.modules, name, None)  # removed again at teardown
        del sys.modules[name]  # imported afresh from tmp_path
    (tmp_path / "gpt_builders.py").write_text(_GPT_BUILDERS)
    (tmp_path / "model_provider.py").write_text(_MODEL_PROVIDER)
    (tmp_path / "pretrain_gpt.py").write_text(textwrap.dedent(_MAIN_HEAD).format(
        imports=shape["imports"], main=main if main is not None else shape["main"]))
    monkeypatch.setattr(sys, "path", [str(tmp_path)] + sys.path)
    monkeypatch.setenv("MEGATRON_LM_PATH", str(tmp_path))
    monkeypatch.setattr(hooks, "release_name", lambda: release)

    events = pkg.events
    import megatron.core.models.gpt as gpt
    import megatron.core.parallel_state as mpu

    monkeypatch.setattr(mpu, "model_parallel_is_initialized",
                        lambda: "megatron initialized" in events)
    monkeypatch.setattr(metp_lm, "layer_spec_for", lambda args, config, vp_stage=None: (
        "plugin spec", args.tensor_parallel_mode, getattr(config, "source", config)))
    monkeypatch.setattr(metp_lm, "initialize_plugin_groups", lambda args: events.append(
        ("plugin groups", args.tensor_parallel_mode)))
    monkeypatch.setattr(gpt, "GPTModel", lambda **kw: _StubGPT(
        ("GPTModel", kw["transformer_layer_spec"])))
    return events


class _StubGPT(tuple):
    """GPTModel's recorder: equal to ``("GPTModel", spec)``, with GPTModel's forward signature
    and a record of the forward pre-hooks the plugin registers on it."""

    def forward(self, input_ids, position_ids, attention_mask, decoder_input=None, labels=None,
                inference_context=None, packed_seq_params=None):
        raise AssertionError("the stub model is never run")

    def register_forward_pre_hook(self, hook, *, with_kwargs=False):
        self.__dict__.setdefault("pre_hooks", []).append((hook, with_kwargs))


def _run_script(argv):
    spec = importlib.util.spec_from_file_location("pretrain_gpt_metp",
                                                  ROOT / "scripts" / "pretrain_gpt_metp.py")
    mod = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(mod)
    sys.argv = ["pretrain_gpt_metp.py"] + argv
    mod.main()


def _run_patched(tmp_path: Path, argv):
    r = subprocess.run(["git", "apply", "--check", "-v", str(ROOT / "patches" /
                                                          "pretrain_gpt_metp.patch")],
                       cwd=tmp_path, capture_output=True, text=True)
    assert r.returncode == 0, r.stderr
    subprocess.run(["git", "apply", str(ROOT / "patches" / "pretrain_gpt_metp.patch")],
                   cwd=tmp_path, check=True)
    import runpy

    sys.argv = [str(tmp_path / "pretrain_gpt.py")] + argv
    runpy.run_path(str(tmp_path / "pretrain_gpt.py"), run_name="__main__")


WALLFACER = ["--tensor-model-parallel-size", "4", "--sequence-parallel",
             "--tensor-parallel-mode", "wallfacer", "--attention-dropout", "0"]


def _expected_model(release: str, mode: str, source: str = "args"):
    config_route = hooks.main_names(textwrap.dedent(_MAIN_HEAD).format(
        imports="", main=RELEASES[release]["main"])) >= {"gpt_config_from_args"}
    if mode == "tp":
        return ("GPTModelBuilder", "megatron's default spec") if config_route \
            else "megatron's gpt_builder"
    spec = ("plugin spec", mode, source)
    return ("GPTModelBuilder", spec) if config_route else ("GPTModel", spec)


@pytest.mark.parametrize("route", ["script", "patch"])
@pytest.mark.parametrize("release", sorted(RELEASES))
def test_release_runs_wallfacer_through_the_hooks(monkeypatch, tmp_path, release, route):
    """Flags registered, the remap before Megatron validates, the plugin's groups right after
    Megatron initialises, the model from the plugin's spec."""
    monkeypatch.setenv("WORLD_SIZE", "4")
    monkeypatch.setattr(sys, "argv", list(sys.argv))
    events = _stub_release(monkeypatch, tmp_path, release)
    (_run_script if route == "script" else lambda a: _run_patched(tmp_path, a))(WALLFACER)
    validated = [e for e in events if e[0] == "megatron validates"]
    assert validated == [("megatron validates", 1, 4, False, ["wallfacer"])]
    i = events.index("megatron initialized")
    assert events[i + 1] == ("plugin groups", "wallfacer")
    assert events[-1] == ("model", _expected_model(release, "wallfacer"))
    assert events.index(validated[0]) < i
    if events[-1][1][0] == "GPTModel":  # the plugin built it: cu_seqlens read once per forward
        assert [kw for _, kw in events[-1][1].pre_hooks] == [True]


@pytest.mark.parametrize("release", sorted(RELEASES))
def test_release_tp_keeps_megatron_s_own_model(monkeypatch, tmp_path, release):
    monkeypatch.setenv("WORLD_SIZE", "1")
    monkeypatch.setattr(sys, "argv", list(sys.argv))
    events = _stub_release(monkeypatch, tmp_path, release)
    _run_script([])
    assert ("megatron validates", 1, 1, False, ["p2p"]) in events
    assert events[-1] == ("model", _expected_model(release, "tp"))


@pytest.mark.parametrize("release", sorted(RELEASES))
def test_release_refuses_bad_flags_before_megatron_validates(monkeypatch, tmp_path, release):
    monkeypatch.setenv("WORLD_SIZE", "4")
    monkeypatch.setattr(sys, "argv", list(sys.argv))
    events = _stub_release(monkeypatch, tmp_path, release)
    with pytest.raises(SystemExit, match="megatron-metp: .*--sequence-parallel"):
        _run_script(["--tensor-model-parallel-size", "4", "--tensor-parallel-mode", "metp",
                     "--attention-dropout", "0"])
    assert events == []


def test_missing_hook_points_name_the_release(monkeypatch, tmp_path):
    monkeypatch.setattr(sys, "argv", list(sys.argv))
    # A __main__ that builds the model some other way.
    _stub_release(monkeypatch, tmp_path, "core_v0.19.0",
                  main="    pretrain(None, None, 'encoder_or_decoder', forward_step)\n")
    with pytest.raises(SystemExit, match="Megatron-LM core_v0.19.0: pretrain_gpt.py's __main__ "
                                         "builds the model through neither gpt_builder nor "
                                         "gpt_config_from_args"):
        _run_script([])
    # An entry point the route needs is gone from its module.
    _stub_release(monkeypatch, tmp_path, "core_v0.19.0")
    monkeypatch.delattr(sys.modules["megatron.training.argument_utils"], "gpt_config_from_args")
    with pytest.raises(SystemExit, match="core_v0.19.0: megatron.training.argument_utils."
                                         "gpt_config_from_args is missing"):
        _run_script([])
    _stub_release(monkeypatch, tmp_path, "core_v0.16.1")
    monkeypatch.setitem(sys.modules, "megatron.training.training", None)  # import fails
    with pytest.raises(SystemExit, match="core_v0.16.1: cannot import megatron.training.training"):
        _run_script([])


def test_plan_and_install_are_idempotent(monkeypatch, tmp_path):
    """The no-patch script on a patched checkout installs once; uninstall restores."""
    _stub_release(monkeypatch, tmp_path, "core_v0.16.1")
    args_mod = sys.modules["megatron.training.arguments"]
    original = args_mod.parse_args
    plan = hooks.plan_hooks(frozenset({"gpt_builder"}), "core_v0.16.1")
    assert plan.points == [hooks.ARGS, hooks.BUILDER, hooks.INIT]
    first = hooks.install(plan)
    assert sys.modules["megatron.training.initialize"].parse_args is args_mod.parse_args
    assert hooks.install(plan) == []
    hooks.uninstall(first)
    assert args_mod.parse_args is original
    assert sys.modules["megatron.training.initialize"].parse_args is original


# ----------------------------------------------------------------------------- --yaml-cfg
_YAML = """\
tensor_parallel_mode: {mode}
seq_length: 64
model_parallel:
  tensor_model_parallel_size: 4
  context_parallel_size: 1
  pipeline_model_parallel_size: 1
  sequence_parallel: {sp}
  cp_comm_type: p2p
language_model:
  num_layers: 2
  hidden_size: 64
  num_attention_heads: 8
  attention_dropout: 0.0
"""


@pytest.mark.parametrize("release", ["core_v0.16.1", "core_v0.19.0"])
def test_yaml_cfg_goes_through_the_remap_and_validation(monkeypatch, tmp_path, release):
    monkeypatch.setenv("WORLD_SIZE", "4")
    monkeypatch.setattr(sys, "argv", list(sys.argv))
    events = _stub_release(monkeypatch, tmp_path, release)
    cfg = tmp_path / "gpt.yaml"
    cfg.write_text(_YAML.format(mode="wallfacer", sp="true"))
    _run_script(["--yaml-cfg", str(cfg)])
    assert [e for e in events if e[0] == "megatron validates"] == [
        ("megatron validates", 1, 4, False, "wallfacer")]
    assert events[-1] == ("model", _expected_model(release, "wallfacer", source="yaml"))

    events.clear()
    cfg.write_text(_YAML.format(mode="metp", sp="false"))
    with pytest.raises(SystemExit, match="megatron-metp: .*--sequence-parallel"):
        _run_script(["--yaml-cfg", str(cfg)])
    assert events == []
    # The plugin's flags on the command line would be dropped by load_yaml: refused, with the fix.
    cfg.write_text(_YAML.format(mode="tp", sp="true"))
    with pytest.raises(SystemExit, match="put tensor_parallel_mode at the top level"):
        _run_script(["--yaml-cfg", str(cfg), "--tensor-parallel-mode", "metp"])


def test_yaml_remap_unit():
    from types import SimpleNamespace as NS

    ns = NS(yaml_cfg="x.yaml", tensor_parallel_mode="wallfacer", world_size=8, seq_length=64,
            model_parallel=NS(tensor_model_parallel_size=4, context_parallel_size=2,
                              pipeline_model_parallel_size=1, sequence_parallel=True),
            language_model=NS(num_layers=2, hidden_size=64, num_attention_heads=8,
                              attention_dropout=0.0, cp_comm_type=["p2p"]))
    metp_lm.remap_and_validate(ns, argv=["--yaml-cfg", "x.yaml"])
    # An explicit CP > 1 composes with TP; the comm type stays where the YAML put it.
    assert (ns.model_parallel.tensor_model_parallel_size, ns.model_parallel.context_parallel_size,
            ns.language_model.cp_comm_type) == (4, 2, ["wallfacer"])
    assert not hasattr(ns.model_parallel, "cp_comm_type")
    ns.language_model.cp_comm_type = ["a2a"]
    with pytest.raises(MetpConfigError, match="--cp-comm-type a2a"):
        metp_lm.remap_and_validate(ns, argv=[])


# ----------------------------------------------------------------------------- Transformer Engine
class _FakeTENorm:
    """Megatron-Core's TENorm is a factory: ``TENorm(config, hidden_size, eps)`` returns TE's
    LayerNorm or RMSNorm module. This one returns the plugin's Norm, tagged."""

    def __new__(cls, config, hidden_size, eps=1e-5, **kw):
        from megatron_metp.layers import Norm

        norm = Norm(config, hidden_size, eps)
        norm.made_by_fake_te = True
        return norm


def _fake_transformer_engine(monkeypatch):
    import megatron.core.models.gpt  # noqa: F401  (imports the real extension module first)
    import megatron_metp.model  # noqa: F401
    from megatron.core.tensor_parallel.layers import ColumnParallelLinear, RowParallelLinear

    monkeypatch.setitem(sys.modules, "transformer_engine", types.ModuleType("transformer_engine"))
    real = importlib.import_module(te_backend._TE_EXTENSION)  # HAVE_TE False here
    ext = types.ModuleType(te_backend._TE_EXTENSION)
    ext.__getattr__ = lambda name: getattr(real, name)  # every other name as Megatron has it
    ext.HAVE_TE = True
    ext.TENorm = _FakeTENorm
    ext.TEColumnParallelLinear = type("TEColumnParallelLinear", (ColumnParallelLinear,), {})
    ext.TERowParallelLinear = type("TERowParallelLinear", (RowParallelLinear,), {})
    monkeypatch.setitem(sys.modules, te_backend._TE_EXTENSION, ext)
    return ext


def _config(**kw):
    from megatron_metp.model import make_config

    return make_config(num_layers=2, hidden_size=32, num_attention_heads=4, **kw)


def _all_layers(config, vp_stage=None):
    return config.num_layers


def test_te_specs_when_transformer_engine_is_importable(monkeypatch):
    from megatron.core.tensor_parallel.layers import ColumnParallelLinear, RowParallelLinear

    from megatron_metp import specs
    from megatron_metp.layers import Norm

    ext = _fake_transformer_engine(monkeypatch)
    monkeypatch.setattr(specs, "get_num_layers_to_build", _all_layers)  # no pipeline groups here
    cfg = _config(transformer_impl="transformer_engine", qk_layernorm=True)
    for mode in ("metp", "wallfacer"):
        block = specs.get_gpt_block_spec(cfg, mode)
        layer = block.layer_specs[0].submodules
        attn, mlp = layer.self_attention.submodules, layer.mlp.submodules
        assert block.layer_norm is ext.TENorm
        assert layer.input_layernorm is ext.TENorm and layer.pre_mlp_layernorm is ext.TENorm
        if mode == "metp":  # METP's ring owns its linears and calls its q/k norms itself
            assert (attn.linear_qkv, attn.linear_proj, mlp.linear_fc1, mlp.linear_fc2) == (
                ColumnParallelLinear, RowParallelLinear, ColumnParallelLinear, RowParallelLinear)
            assert attn.q_layernorm is Norm and attn.k_layernorm is Norm
        else:
            assert (attn.linear_qkv, attn.linear_proj, mlp.linear_fc1, mlp.linear_fc2) == (
                ext.TEColumnParallelLinear, ext.TERowParallelLinear,
                ext.TEColumnParallelLinear, ext.TERowParallelLinear)
            assert attn.q_layernorm is ext.TENorm
    # --transformer-impl local keeps the local classes even with TE importable.
    local = specs.get_gpt_block_spec(_config(transformer_impl="local"), "wallfacer")
    assert local.layer_norm is Norm
    assert local.layer_specs[0].submodules.mlp.submodules.linear_fc1 is ColumnParallelLinear


def test_te_fallback_says_why_once(monkeypatch, capsys):
    from argparse import Namespace

    from megatron_metp import specs
    from megatron_metp.layers import Norm

    monkeypatch.setitem(sys.modules, "transformer_engine", None)  # import fails
    monkeypatch.setattr(metp_lm, "_said", set())
    monkeypatch.setattr(specs, "get_num_layers_to_build", _all_layers)
    cfg = _config(transformer_impl="transformer_engine")
    backend = te_backend.backend_for(cfg, "metp")
    assert backend.name == "local" and "Transformer Engine is not importable" in backend.reason
    assert specs.get_gpt_block_spec(cfg, "metp").layer_norm is Norm
    args = Namespace(tensor_parallel_mode="metp")
    metp_lm.layer_spec_for(args, cfg)
    metp_lm.layer_spec_for(args, cfg)
    out = capsys.readouterr().out
    assert out.count("--transformer-impl transformer_engine: Transformer Engine is not "
                     "importable") == 1, out
    assert "local norm" in out


def _build_with_fake_te(mode):
    """On each rank: the fake TE installed, Megatron's groups, the builder's model, one forward."""
    import torch
    from megatron.core import parallel_state as mpu
    from megatron.core.tensor_parallel import model_parallel_cuda_manual_seed

    saved = {k: sys.modules.get(k) for k in ("transformer_engine", te_backend._TE_EXTENSION)}

    class _MP:  # pytest's monkeypatch is not available inside a rank
        def setitem(self, d, k, v):
            d[k] = v

    try:
        _fake_transformer_engine(_MP())
        tp = 2
        mpu.initialize_model_parallel(tensor_model_parallel_size=tp,
                                      create_gloo_process_groups=False)
        model_parallel_cuda_manual_seed(1234)
        from tests.test_megatron_lm import _builder_args

        args = _builder_args(mode, tp=tp, world_size=tp)
        cfg = _config(tensor_model_parallel_size=tp, ffn_hidden_size=128,
                      transformer_impl="transformer_engine")
        model = metp_lm.gpt_builder(args, True, True, None, config=cfg)
        tokens = torch.randint(0, 64, (1, 16))
        pos = torch.arange(16).unsqueeze(0)
        out = model(tokens, pos, None, labels=tokens)
        layer = model.decoder.layers[0]
        return (bool(getattr(layer.input_layernorm, "made_by_fake_te", False)),
                bool(getattr(model.decoder.final_layernorm, "made_by_fake_te", False)),
                type(layer.mlp).__name__, tuple(out.shape), bool(torch.isfinite(out).all()))
    finally:
        for k, v in saved.items():
            if v is None:
                sys.modules.pop(k, None)
            else:
                sys.modules[k] = v


def test_metp_model_builds_and_runs_with_te_norms():
    from tests._harness import run_ranks

    for r in run_ranks(2, _build_with_fake_te, "metp"):
        assert r == (True, True, "MetpMLP", (1, 16), True)
