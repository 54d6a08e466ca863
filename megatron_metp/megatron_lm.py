"""Megatron-LM integration: the plugin's flags, the WallFacer mode remap, and a GPT model builder.

The pieces that :mod:`megatron_metp.megatron_lm_hooks` plugs into Megatron-LM's
``pretrain_gpt.py`` (core_v0.16.1 to core_v0.19.x; that module lists the entry points per
release), used by ``scripts/pretrain_gpt_metp.py`` (no patch) and by
``patches/pretrain_gpt_metp.patch``:

``extra_args_provider(parser)``
    Adds ``--tensor-parallel-mode {tp,metp,wallfacer}``, ``--wallfacer-team-size {C,auto}`` and
    ``--wallfacer-placement {team-consecutive,ring-consecutive}``. :func:`chain_providers`
    composes it with another provider (e.g. ModelOpt's ``add_modelopt_args``).

``remap_and_validate(ns)``
    Megatron's ``extra_args_provider`` can only *add* arguments, so the remap runs on what
    Megatron-LM's ``parse_args`` returns and before Megatron's own ``validate_args`` (or
    ``validate_yaml`` for ``--yaml-cfg``): :func:`apply_mode_remap`, then
    :func:`megatron_metp.validation.validate_args`, before any group or weight exists, so
    Megatron's initialisation builds a context-parallel group of size P for WallFacer.

``make_gpt_builder(fallback)`` / ``layer_spec_provider(args)``
    A builder with ``gpt_builder``'s signature (releases whose ``pretrain_gpt.py`` passes
    ``partial(model_provider, gpt_builder)``), and a layer-spec callable for a
    ``GPTModelConfig.transformer_layer_spec`` (releases that build from ``gpt_config_from_args``).
    Both validate the final arguments, register the plugin's groups after Megatron's and take
    the mode's layer spec from :mod:`megatron_metp.specs`; ``tp`` keeps Megatron-LM's own
    choice (Transformer Engine spec by default).

Placements (``--wallfacer-placement``)
    ``team-consecutive`` puts each team of C ranks on consecutive CP ranks (the paper's Alg. 2:
    the team all-gather / reduce-scatter stays inside a node); ``ring-consecutive`` puts each
    sub-ring on consecutive CP ranks (the ring P2P stays inside a node).
"""

from __future__ import annotations

import argparse
import datetime
import os
import sys
from types import SimpleNamespace
from typing import Callable, Iterable, List, Optional, Sequence

from megatron_metp.validation import (
    CLI_MODES,
    MODES,
    PLACEMENTS,
    WALLFACER_CP_COMM_TYPE,
    MetpConfigError,
    groups_placement,
    team_size,
    validate_args,
)

Provider = Callable[[argparse.ArgumentParser], argparse.ArgumentParser]


# ----------------------------------------------------------------------------- arguments
def _team_size_arg(value: str):
    if value == "auto":
        return value
    try:
        c = int(value)
    except ValueError:
        raise argparse.ArgumentTypeError(f"expected an integer C >= 1 or 'auto', got {value!r}")
    if c < 1:
        raise argparse.ArgumentTypeError(f"the team size C is >= 1, got {c}")
    return c


def extra_args_provider(parser: argparse.ArgumentParser) -> argparse.ArgumentParser:
    """Add the plugin's flags to Megatron-LM's parser (``pretrain(extra_args_provider=...)``);
    a parser that has them already (the provider chained twice) is returned unchanged."""
    if "--tensor-parallel-mode" in parser._option_string_actions:
        return parser
    group = parser.add_argument_group(title="megatron-metp")
    group.add_argument(
        # No argparse choices: a wrong value would print the usage text on every rank;
        # remap_and_validate refuses it once, in one line (rank 0), with the choices.
        "--tensor-parallel-mode", default="tp", metavar="{" + ",".join(CLI_MODES + ("auto",)) + "}",
        help="tp: Megatron's TP+SP (its own spec); metp: METP weight-ring MLP and two-level "
             "attention over the --tensor-model-parallel-size ring; wallfacer: multi-ring "
             "sequence-parallel attention (with --context-parallel-size 1 the requested TP size "
             "becomes the WallFacer/CP size and TP becomes 1); auto: the planner picks, among "
             "what fits this GPU's memory at --seq-length, the fastest by estimate, and prints "
             "the table it decided from")
    group.add_argument(
        "--wallfacer-team-size", type=_team_size_arg, default=None, metavar="{C,auto}",
        help="WallFacer team size C (C^2 must divide the WallFacer size P; default 1 = ring "
             "attention); 'auto' profiles every valid C and placement at start-up")
    group.add_argument(
        "--metp-ring-pass", choices=("auto", "whole", "head-group", "a2a"), default="auto",
        help="METP attention: every head group in one K/V ring pass (whole: fewer, larger "
             "operations, all heads' Q/K/V at once), one per head group (head-group: the "
             "paper's Alg. 5-6, least memory), the whole pass with all-to-alls in place of "
             "its ring (a2a: Megatron's --cp-comm-type a2a exchange; one sequence per micro "
             "batch, no context parallelism), or auto (the planner's choice from memory "
             "headroom: a2a, then whole, wherever the run fits this GPU with it)")
    group.add_argument(
        "--metp-qkv-backward",
        choices=("auto", "recompute", "save", "save+fc1", "save+fc1+weights"), default="auto",
        help="METP's one ring pass: keep Q/K/V for backward (save: one GEMM less per layer, "
             "2(n+2ng)d bytes more per token and layer) or recompute them (the paper's Alg. 6); "
             "save+fc1: keep the MLP's fc1 output too (2F' bytes more per token and layer); "
             "save+fc1+weights: keep the weights the forward gathered too (the backward "
             "gathers none; 2 bytes per layer parameter held from forward to backward); "
             "auto: the first of save+fc1, save, recompute that still fits this GPU's memory "
             "(never save+fc1+weights, a choice for speed at short sequences that "
             "--tensor-parallel-mode auto makes)")
    group.add_argument(
        "--metp-mlp-pass", choices=("auto", "ring", "gathered"), default="auto",
        help="METP MLP: pass its fc1/fc2 shards around the ring one step at a time (ring: the "
             "paper's Alg. 1-2, least memory), all-gather them once (gathered: the same bytes "
             "in a constant number of operations, this rank's whole fc1 output at once), or "
             "auto (gathered while that output is at most 512 MiB: short sequences)")
    group.add_argument(
        "--wallfacer-placement", choices=PLACEMENTS, default=PLACEMENTS[0],
        help="team-consecutive: each team of C on consecutive ranks (team collectives in a "
             "node); ring-consecutive: each sub-ring on consecutive ranks (ring P2P in a node)")
    return parser


def chain_providers(*providers: Optional[Provider]) -> Provider:
    """One provider that applies ``extra_args_provider`` then every non-None provider given."""
    chain = [extra_args_provider] + [p for p in providers if p is not None]

    def provider(parser: argparse.ArgumentParser) -> argparse.ArgumentParser:
        for p in chain:
            out = p(parser)
            parser = parser if out is None else out
        return parser

    return provider


# ----------------------------------------------------------------------------- remap
_LOGGED: set = set()


def _log(msg: str) -> None:
    """Rank 0 prints each message once per process (Megatron-LM may parse its arguments more
    than once)."""
    if int(os.environ.get("RANK", "0")) == 0 and msg not in _LOGGED:
        _LOGGED.add(msg)
        print(f"[megatron-metp] {msg}", flush=True)


def explicit_flags(argv: Iterable[str]) -> set:
    """The long flags present on a command line (``--x v`` and ``--x=v`` forms)."""
    return {a.split("=", 1)[0] for a in argv if a.startswith("--")}


def _types(ns: argparse.Namespace) -> List[str]:
    t = getattr(ns, "cp_comm_type", None)
    return [] if t is None else ([t] if isinstance(t, str) else list(t))


def apply_mode_remap(
    ns: argparse.Namespace,
    *,
    explicit: Optional[set] = None,
    log: Callable[[str], None] = _log,
) -> argparse.Namespace:
    """Map ``--tensor-parallel-mode wallfacer`` onto Megatron's context parallelism, in place.

    With ``--context-parallel-size 1``: CP := the requested ``--tensor-model-parallel-size``
    (the WallFacer group P), TP := 1, sequence parallelism off, ``cp_comm_type := 'wallfacer'``.
    With an explicit CP > 1 the WallFacer group is that CP group and TP stays (TP inside each
    CP rank). ``explicit`` (flags given on the command line) tells a user's ``--cp-comm-type
    p2p`` from Megatron's default ``p2p``; without it only non-default values conflict.
    Idempotent: a second call finds CP = P and changes nothing.
    """
    mode = getattr(ns, "tensor_parallel_mode", None) or "tp"
    if mode != "wallfacer":
        return ns
    types = _types(ns)
    user_types = types if (explicit is None or "--cp-comm-type" in explicit) else []
    allowed = {WALLFACER_CP_COMM_TYPE} if explicit is not None else {WALLFACER_CP_COMM_TYPE, "p2p"}
    bad = [t for t in user_types if t not in allowed]
    if bad:
        raise MetpConfigError(
            f"--cp-comm-type {' '.join(types)} conflicts with --tensor-parallel-mode wallfacer: "
            f"drop --cp-comm-type (the mode sets it to '{WALLFACER_CP_COMM_TYPE}')")
    tp = getattr(ns, "tensor_model_parallel_size", 1) or 1
    cp = getattr(ns, "context_parallel_size", 1) or 1
    if cp == 1:
        ns.context_parallel_size, ns.tensor_model_parallel_size = tp, 1
        ns._metp_wallfacer_from_tp = tp   # what the user typed, for the refusals' lines
        ns.sequence_parallel = False
        log(f"--tensor-parallel-mode wallfacer: WallFacer group P = {tp} as "
            f"--context-parallel-size {tp}; --tensor-model-parallel-size 1, sequence "
            f"parallelism off, --cp-comm-type {WALLFACER_CP_COMM_TYPE}")
    elif getattr(ns, "_metp_remap_logged", False) is False:
        log(f"--tensor-parallel-mode wallfacer: WallFacer group = --context-parallel-size {cp}, "
            f"composed with --tensor-model-parallel-size {tp}")
    ns._metp_remap_logged = True
    has_list = isinstance(getattr(ns, "cp_comm_type", None), (list, tuple))
    ns.cp_comm_type = [WALLFACER_CP_COMM_TYPE] if has_list else WALLFACER_CP_COMM_TYPE
    return ns


# Sections of a --yaml-cfg namespace (Megatron-LM's load_yaml) holding Megatron's flat names.
_YAML_SECTIONS = ("model_parallel", "language_model")
_REMAPPED = ("tensor_model_parallel_size", "context_parallel_size", "sequence_parallel",
             "cp_comm_type")
_PLUGIN_DEFAULTS = (("tensor_parallel_mode", "tp"), ("wallfacer_team_size", None),
                    ("wallfacer_placement", PLACEMENTS[0]), ("metp_ring_pass", "auto"),
                    ("metp_qkv_backward", "auto"), ("metp_mlp_pass", "auto"))


def _yaml_view(ns) -> SimpleNamespace:
    """A flat view of a ``--yaml-cfg`` namespace, named as ``validate_yaml`` flattens it."""
    flat = {k: v for k, v in vars(ns).items() if k not in _YAML_SECTIONS}
    for section in _YAML_SECTIONS:
        flat.update(vars(getattr(ns, section, SimpleNamespace())))
    flat["num_experts"] = flat.get("num_moe_experts")  # validate_yaml's alias
    return SimpleNamespace(**flat)


def _remap_yaml(ns, argv: Sequence[str]) -> None:
    given = sorted(explicit_flags(argv) & {"--tensor-parallel-mode", "--wallfacer-team-size",
                                           "--wallfacer-placement"})
    if given:
        keys = ", ".join(g[2:].replace("-", "_") for g in given)
        raise MetpConfigError(
            f"{' '.join(given)} on the command line is ignored with --yaml-cfg (Megatron-LM reads "
            f"every argument from the YAML file): put {keys} at the top level of {ns.yaml_cfg} "
            f"instead")
    for key, default in _PLUGIN_DEFAULTS:
        if not hasattr(ns, key):
            setattr(ns, key, default)
    view = _yaml_view(ns)
    apply_mode_remap(view)  # a YAML value is always explicit, so only non-default types conflict
    validate_args(view)
    if (ns.tensor_parallel_mode or "tp") != "wallfacer":
        return
    for key in _REMAPPED:  # back into the section that holds it, where validate_yaml reads it
        home = next((getattr(ns, s) for s in _YAML_SECTIONS
                     if hasattr(getattr(ns, s, None), key)), ns.model_parallel)
        setattr(home, key, getattr(view, key))


def _have_apex_norm() -> bool:
    import importlib.util

    return importlib.util.find_spec("apex") is not None


def check_stock_norm(ns, have_apex_norm: Callable[[], bool] = _have_apex_norm) -> None:
    """Stock tp with ``--sequence-parallel`` and ``--transformer-impl local`` builds Megatron's
    local layer spec, whose norm is Apex's ``FusedLayerNorm`` or, without Apex (a CPU machine),
    ``WrappedTorchNorm``, which asserts on sequence parallelism in every rank's model build
    (megatron/core/transformer/torch_norm.py). Refused here, once, before any rank builds."""
    mode = getattr(ns, "tensor_parallel_mode", None) or "tp"
    if (mode == "tp" and getattr(ns, "sequence_parallel", False)
            and (getattr(ns, "tensor_model_parallel_size", 1) or 1) > 1
            and getattr(ns, "transformer_impl", None) == "local"
            and not getattr(ns, "spec", None) and not have_apex_norm()):
        raise MetpConfigError(
            "--sequence-parallel with --tensor-parallel-mode tp and --transformer-impl local "
            "needs Apex's fused norm (Megatron's torch norm refuses sequence parallelism, and "
            "Apex is not installed): install Apex, use --transformer-impl transformer_engine, or "
            "drop --sequence-parallel (on a CPU machine)")


def remap_and_validate(ns, argv: Optional[Sequence[str]] = None):
    """The WallFacer remap and the plugin's validation on what Megatron-LM's ``parse_args``
    returned, in place, before Megatron validates it: an argparse namespace, or the nested
    namespace of ``--yaml-cfg`` (then the plugin's keys are top-level YAML keys, and the remapped
    sizes go back into its ``model_parallel`` section). ``argv`` is the parsed command line
    (default ``sys.argv[1:]``)."""
    argv = list(sys.argv[1:] if argv is None else argv)
    if getattr(ns, "yaml_cfg", None) is not None and hasattr(ns, "model_parallel"):
        if getattr(ns, "tensor_parallel_mode", None) == "auto":
            raise MetpConfigError("tensor_parallel_mode auto is not resolved with --yaml-cfg: "
                                  "name tp, metp or wallfacer in the YAML file")
        _remap_yaml(ns, argv)
        return ns
    if getattr(ns, "tensor_parallel_mode", None) == "auto":
        resolve_auto(ns)
    apply_mode_remap(ns, explicit=explicit_flags(argv))
    validate_args(ns)
    check_stock_norm(ns)
    check_load_keys(ns)
    resolve_metp_attention(ns)
    return ns


def check_load_keys(ns) -> None:
    """Refused before anything starts, in one line: with ``--exit-on-missing-checkpoint``, a
    ``--load`` holding no checkpoint; a damaged newest checkpoint (``checkpoint_keys.damage``:
    a missing or truncated file); one written by megatron-metp 0.1, whose plain layer-norm
    names Megatron-LM's loader cannot match with its (and the plugin's) fused names (naming
    the conversion, ``megatron_metp.checkpoint_keys``)."""
    from megatron_metp.checkpoint_keys import (
        check_intact, latest_checkpoint_dir, uses_legacy_norm_keys)

    root = getattr(ns, "load", None)
    tracker = os.path.join(root, "latest_checkpointed_iteration.txt") if root else None
    if root and getattr(ns, "exit_on_missing_checkpoint", False) and \
            not os.path.isfile(tracker):
        raise MetpConfigError(f"--load {root}: no checkpoint there (no "
                              f"latest_checkpointed_iteration.txt) and "
                              f"--exit-on-missing-checkpoint is set: pass the directory given to "
                              f"--save, or drop the flag to train from scratch")
    if root and os.path.isdir(root):
        try:
            check_intact("--load", root)
        except ValueError as e:
            raise MetpConfigError(str(e)) from None
    path = latest_checkpoint_dir(root) if root and os.path.isdir(root) else None
    if path and uses_legacy_norm_keys(path):
        raise MetpConfigError(
            f"--load {root}: written by megatron-metp 0.1 with plain layer-norm keys "
            f"(decoder.layers.input_layernorm.weight); convert it once with `python -m "
            f"megatron_metp.checkpoint_keys {root} {root.rstrip('/')}-megatron` and load that")


def resolve_metp_attention(ns) -> None:
    """``--metp-ring-pass auto`` and ``--metp-qkv-backward auto`` under
    ``--tensor-parallel-mode metp``: plan this run (``measure.planner.resolve_metp_attention``,
    this GPU's memory, else 80 GiB) and take the fastest METP attention that still fits (one
    ring pass over every head group with its Q/K/V and the MLP's fc1 output saved, then Q/K/V
    alone saved, then recomputed, then one pass per
    head group); context- or pipeline-parallel runs, which the planner does not plan, keep the
    model's own ring-pass rule and recompute."""
    ring = getattr(ns, "metp_ring_pass", "auto") or "auto"
    qkv = getattr(ns, "metp_qkv_backward", "auto") or "auto"
    if getattr(ns, "tensor_parallel_mode", "tp") != "metp" or "auto" not in (ring, qkv):
        return
    from megatron_metp.measure.planner import recompute_settings
    from megatron_metp.measure.planner import resolve_metp_attention as plan_attention
    from megatron_metp.models.config import ConfigError, config_from_megatron_args

    if (getattr(ns, "context_parallel_size", 1) or 1) > 1 or \
            (getattr(ns, "pipeline_model_parallel_size", 1) or 1) > 1:
        ns.metp_qkv_backward = "recompute" if qkv == "auto" else qkv
        return
    try:
        cfg = config_from_megatron_args(ns)
        ring, qkv, why = plan_attention(
            cfg, ns.tensor_model_parallel_size, ns.seq_length,
            micro_batch=getattr(ns, "micro_batch_size", None) or 1,
            distributed_optimizer=bool(getattr(ns, "use_distributed_optimizer", False)),
            megatron_fsdp=bool(getattr(ns, "use_megatron_fsdp", False)),
            ring_pass=ring, qkv_backward=qkv, recompute=recompute_settings(ns))
    except (ConfigError, ValueError) as e:
        raise MetpConfigError(f"--metp-ring-pass / --metp-qkv-backward auto: {e}; name them "
                              f"(--metp-ring-pass whole|head-group, --metp-qkv-backward "
                              f"recompute|save|save+fc1|save+fc1+weights)")
    _log(f"METP attention (--metp-ring-pass {ring} --metp-qkv-backward {qkv}): {why}")
    ns.metp_ring_pass, ns.metp_qkv_backward = ring, qkv


def resolve_auto(ns) -> None:
    """``--tensor-parallel-mode auto`` through Megatron-LM: plan this run's model at its
    ``--seq-length`` on its world (``measure.auto.decide``: the whole job's split and
    micro-batch under its ``--global-batch-size`` where the world is larger than
    ``--tensor-model-parallel-size``), print the table on rank 0, and set the choice in
    ``ns``."""
    from megatron_metp.measure import auto
    from megatron_metp.models.config import ConfigError, config_from_megatron_args

    p = getattr(ns, "tensor_model_parallel_size", 1) or 1
    if (getattr(ns, "context_parallel_size", 1) or 1) > 1:
        raise MetpConfigError("--tensor-parallel-mode auto chooses for --context-parallel-size "
                              "1: name the mode to compose it with context parallelism")
    world = int(getattr(ns, "world_size", None) or os.environ.get("WORLD_SIZE", p))
    try:
        cfg = config_from_megatron_args(ns)
        chosen, text = auto.decide(
            cfg, p, ns.seq_length, micro_batch=getattr(ns, "micro_batch_size", None) or 1,
            gpus_per_node=auto.local_world_size(world),
            distributed_optimizer=bool(getattr(ns, "use_distributed_optimizer", False)),
            megatron_fsdp=bool(getattr(ns, "use_megatron_fsdp", False)),
            tp_comm_overlap=_can_overlap_tp_comm(ns), world_size=world,
            global_batch_size=getattr(ns, "global_batch_size", None))
    except (ConfigError, ValueError) as e:
        raise MetpConfigError(str(e) if "--tensor-parallel-mode auto" in str(e)
                              else f"--tensor-parallel-mode auto: {e}")
    _log(text)
    ns.tensor_model_parallel_size = p
    auto.apply(ns, chosen)


def _can_overlap_tp_comm(ns) -> bool:
    """Stock's ``--tp-comm-overlap`` is among auto's choices only where it can run: Transformer
    Engine's userbuffers on a GPU."""
    import importlib.util

    import torch

    return (getattr(ns, "transformer_impl", None) == "transformer_engine"
            and torch.cuda.is_available()
            and importlib.util.find_spec("transformer_engine") is not None)


# ----------------------------------------------------------------------------- builder
def initialize_plugin_groups(args: argparse.Namespace) -> None:
    """Register the plugin's groups; call after Megatron-Core's ``initialize_model_parallel``."""
    from megatron_metp import parallel_state as ps

    mode = getattr(args, "tensor_parallel_mode", None) or "tp"
    if mode in ("metp", "metp_mlp") and not ps.metp_is_initialized():
        minutes = getattr(args, "distributed_timeout_minutes", None)
        # The weight groups take the run's timeout, as Megatron's own groups do.
        ps.initialize_metp(timeout=datetime.timedelta(minutes=minutes) if minutes else None)
    if mode == "wallfacer" and not ps.wallfacer_is_initialized():
        from megatron_metp.wallfacer import scheduler as wf_scheduler

        c = team_size(args)
        placement = getattr(args, "wallfacer_placement", None)
        if c is None:  # 'auto': the topology scheduler profiles this run's attention shape
            tp = getattr(args, "tensor_model_parallel_size", 1) or 1
            heads = args.num_attention_heads
            groups = getattr(args, "num_query_groups", None) or heads
            local = os.environ.get("LOCAL_WORLD_SIZE")
            wf_scheduler.initialize_wallfacer(
                "auto", groups_placement(placement) if placement else None,
                shape=dict(b=args.micro_batch_size, s=args.seq_length, n=heads // tp,
                           n_kv=max(groups // tp, 1),
                           d=getattr(args, "kv_channels", None) or args.hidden_size // heads),
                gpus_per_node=int(local) if local else None,
                timeout_minutes=getattr(args, "distributed_timeout_minutes", None))
            _log(f"--wallfacer-team-size auto picked C = "
                 f"{ps.get_wallfacer_groups().team_size}")
            return
        wf_scheduler.initialize_wallfacer(
            team_size=c, placement=groups_placement(placement or PLACEMENTS[0]),
            timeout_minutes=getattr(args, "distributed_timeout_minutes", None))


def layer_spec_for(args: argparse.Namespace, config, vp_stage: Optional[int] = None):
    """The mode's decoder-block spec (this stage's layers plus the SP-aware final norm), every
    lazily named class checked importable so a missing mode fails here, not mid-build."""
    from megatron_metp import specs

    from megatron_metp.te_backend import backend_for

    mode = getattr(args, "tensor_parallel_mode", None) or "tp"
    reason = backend_for(config, mode).reason
    if reason and reason not in _said:  # a fallback from the user's (default) flag, said once
        _said.add(reason)
        _log(reason)
    spec = specs.get_gpt_block_spec(config, mode, vp_stage=vp_stage)
    specs.check_spec_importable(spec)
    return spec


_said: set = set()


def layer_spec_provider(args: argparse.Namespace) -> Callable:
    """A ``transformer_layer_spec`` callable for Megatron-LM's ``GPTModelConfig`` (core_v0.19+),
    whose ``GPTModelBuilder.build_model`` calls it as ``spec(model_config, vp_stage=...)`` after
    Megatron initialises: it validates ``args``, registers the plugin's groups and returns the
    mode's block spec for the ``TransformerConfig`` inside ``model_config``."""

    def transformer_layer_spec(model_config, vp_stage: Optional[int] = None):
        validate_args(args)
        config = getattr(model_config, "transformer", model_config)
        initialize_plugin_groups(args)  # first: the wallfacer spec carries the groups
        return layer_spec_for(args, config, vp_stage)

    return transformer_layer_spec


def _config_from_args(args: argparse.Namespace):
    from megatron.training.arguments import core_transformer_config_from_args

    if getattr(args, "yaml_cfg", None) is not None:
        from megatron.training.yaml_arguments import core_transformer_config_from_yaml

        return core_transformer_config_from_yaml(args, "language_model")
    return core_transformer_config_from_args(args)


def gpt_builder(args, pre_process=True, post_process=True, vp_stage=None, config=None,
                pg_collection=None, *, fallback: Optional[Callable] = None):
    """Megatron-LM ``gpt_builder`` signature; see the module docstring."""
    validate_args(args)
    mode = getattr(args, "tensor_parallel_mode", None) or "tp"
    if mode == "tp":
        if fallback is None:
            from gpt_builders import gpt_builder as fallback  # Megatron-LM's, on sys.path there
        return fallback(args, pre_process, post_process, vp_stage, config=config,
                        pg_collection=pg_collection)
    from megatron.core.models.gpt import GPTModel

    if config is None:
        config = _config_from_args(args)
    # Read once by METP attention at construction (not a TransformerConfig field).
    config.metp_ring_pass = getattr(args, "metp_ring_pass", "auto")
    config.metp_qkv_backward = getattr(args, "metp_qkv_backward", "auto")
    config.metp_mlp_pass = getattr(args, "metp_mlp_pass", "auto")
    initialize_plugin_groups(args)  # first: the wallfacer spec carries the groups
    spec = layer_spec_for(args, config, vp_stage)  # a mode missing from this install fails here
    model_cls, extra = GPTModel, {}
    if mode == "metp":  # METP's ring LM-head loss; its position table sharded along positions
        from megatron_metp.metp.gpt_model import MetpGPTModel as model_cls

        extra["shard_position_table"] = (
            getattr(args, "seq_length", None) == args.max_position_embeddings
            and not getattr(args, "reset_position_ids", False))
    model = model_cls(
        config=config,
        transformer_layer_spec=spec,
        vocab_size=args.padded_vocab_size,
        max_sequence_length=args.max_position_embeddings,
        pre_process=pre_process,
        post_process=post_process,
        fp16_lm_cross_entropy=getattr(args, "fp16_lm_cross_entropy", False),
        parallel_output=True,
        share_embeddings_and_output_weights=not getattr(
            args, "untie_embeddings_and_output_weights", False),
        position_embedding_type=getattr(args, "position_embedding_type", "learned_absolute"),
        rotary_percent=getattr(args, "rotary_percent", 1.0),
        rotary_base=getattr(args, "rotary_base", 10000),
        rope_scaling=getattr(args, "use_rope_scaling", False),
        vp_stage=vp_stage,
        pg_collection=pg_collection,
        **extra,
    )
    if mode == "wallfacer":   # packed batches: cu_seqlens read once per forward, not per layer
        from megatron_metp.packing import read_at_each_forward

        read_at_each_forward(model)
    return model


def make_gpt_builder(fallback: Optional[Callable] = None) -> Callable:
    """``gpt_builder`` bound to Megatron-LM's own builder for ``tp``."""

    def builder(args, pre_process=True, post_process=True, vp_stage=None, config=None,
                pg_collection=None):
        return gpt_builder(args, pre_process, post_process, vp_stage, config=config,
                           pg_collection=pg_collection, fallback=fallback)

    return builder


# ----------------------------------------------------------------------------- configs
def config_flags(name_or_path: str, *, training: bool = True) -> List[str]:
    """Megatron-LM flags for a ``configs/<model>.yaml`` (the model, then its training defaults),
    for ``pretrain_gpt.py``; flags given later on the command line override these."""
    from megatron_metp.models.config import load_config

    cfg = load_config(name_or_path)
    out = ["--num-layers", str(cfg.num_layers), "--hidden-size", str(cfg.hidden_size),
           "--num-attention-heads", str(cfg.num_attention_heads),
           "--ffn-hidden-size", str(cfg.ffn_hidden_size),
           "--position-embedding-type", cfg.position_embedding_type,
           "--normalization", cfg.normalization, "--norm-epsilon", repr(cfg.norm_epsilon)]
    if cfg.num_query_groups != cfg.num_attention_heads:
        out += ["--group-query-attention", "--num-query-groups", str(cfg.num_query_groups)]
    if cfg.kv_channels != cfg.hidden_size // cfg.num_attention_heads:
        out += ["--kv-channels", str(cfg.kv_channels)]
    if cfg.max_position_embeddings is not None:
        out += ["--max-position-embeddings", str(cfg.max_position_embeddings)]
    if cfg.position_embedding_type == "rope":
        out += ["--rotary-base", str(cfg.rotary_base)]
    out += ["--swiglu"] * cfg.swiglu + ["--disable-bias-linear"] * (not cfg.add_bias_linear)
    out += ["--untie-embeddings-and-output-weights"] * cfg.untie_embeddings_and_output_weights
    if training:
        for key, value in cfg.train.items():
            out += ["--" + key.replace("_", "-"), str(value)]
    return out


def _flag_groups(tokens: Sequence[str]) -> List[tuple]:
    """``[(flag, [values])]`` with each flag once, where a later ``--flag`` replaces an earlier
    one (argparse's rule); a token after ``--flag`` is its value unless it starts with ``--``."""
    groups: dict = {}
    i = 0
    while i < len(tokens):
        flag = tokens[i]
        if not flag.startswith("--"):
            raise ValueError(f"merge: {flag!r} follows no --flag")
        vals = []
        while i + 1 < len(tokens) and not tokens[i + 1].startswith("--"):
            vals.append(tokens[i + 1])
            i += 1
        groups.pop(flag, None)   # re-inserted last: the later position wins
        groups[flag] = vals
        i += 1
    return list(groups.items())


def merge_flags(tokens: Sequence[str]) -> List[str]:
    """A flag list naming each flag once, the later value winning (argparse's rule, made
    explicit so that a printed command names each flag once)."""
    return [t for flag, vals in _flag_groups(tokens) for t in (flag, *vals)]


def _number(v: str):
    for kind in (int, float):
        try:
            return kind(v)
        except ValueError:
            pass
    return v


# Megatron-LM's defaults (``megatron.training.arguments``) of the flags the plugin's start-up
# checks read: the ranks see these where a flag is not given, so :func:`check_launch` starts
# from them too (tests/test_megatron_lm.py compares them with core_v0.16.1's parser).
MEGATRON_LM_DEFAULTS = dict(attention_dropout=0.1, hidden_dropout=0.1, softmax_type="vanilla",
                            window_size=None, enable_cuda_graph=False,
                            external_cuda_graph=False, cuda_graph_impl="none", fp8=None,
                            fp4=None, deterministic_mode=False, tp_comm_overlap=False,
                            reset_attention_mask=False, multi_latent_attention=False,
                            overlap_p2p_comm=True)


# Megatron-LM flags whose attribute is not the flag's name.
_DESTS = {"--fp8-format": "fp8", "--fp4-format": "fp4"}


def check_launch(config: Optional[str], world_size: int, tokens: Sequence[str]) -> None:
    """The checks ``metp train`` and the Megatron-LM route run at start-up, on a launch script's
    flags (``tokens``, Megatron-LM names) with the model shape of ``config`` (None: the flags
    carry it), for ``world_size`` ranks: the same one-line MetpConfigError messages, before
    anything is submitted or started."""
    ns = argparse.Namespace(
        **MEGATRON_LM_DEFAULTS,
        tensor_parallel_mode="tp", tensor_model_parallel_size=1, context_parallel_size=1,
        pipeline_model_parallel_size=1, sequence_parallel=False, wallfacer_team_size=None,
        wallfacer_placement=None, cp_comm_type=["p2p"], world_size=world_size)
    shape = list(config_flags(config, training=True)) if config else []
    for flag, vals in _flag_groups(shape + list(tokens)):
        key = _DESTS.get(flag, flag[2:].replace("-", "_"))
        if not vals:
            setattr(ns, key, True)
        else:
            setattr(ns, key, _number(vals[0]) if len(vals) == 1 else vals)
    if ns.wallfacer_team_size is not None and not isinstance(ns.wallfacer_team_size, int) \
            and ns.wallfacer_team_size != "auto":
        raise MetpConfigError(f"--wallfacer-team-size {ns.wallfacer_team_size!r}: an integer "
                              f"C >= 1 or auto (TEAM_SIZE=)")
    apply_mode_remap(ns, explicit={f for f in tokens if f.startswith("--")})
    validate_args(ns)
    check_stock_norm(ns)
    check_load_keys(ns)


def torchrun(argv: Sequence[str]) -> int:
    """``python -m megatron_metp.megatron_lm torchrun [torchrun options] SCRIPT FLAGS...``:
    torchrun, after the plugin's start-up checks (:func:`check_launch`) on the script's flags
    for the launch's world size. torchrun itself ends a run whose workers exit 2 with its own
    ``ChildFailedError`` traceback and exit code 1; here a bad configuration stops before any
    rank starts, in one line, with exit code 2. Otherwise this process becomes torchrun."""
    from torch.distributed.run import get_args_parser

    a = get_args_parser().parse_args(list(argv))
    nodes = str(a.nnodes).split(":")[-1]
    per_node = str(a.nproc_per_node)
    world = (int(nodes) if nodes.isdigit() else 1) * (int(per_node) if per_node.isdigit() else 1)
    import warnings

    try:
        with warnings.catch_warnings():   # Megatron-Core's import notes would bury the line
            warnings.simplefilter("ignore")
            check_launch(None, world, a.training_script_args)
    except ValueError as e:   # MetpConfigError
        print(f"megatron-metp: error: {e}", file=sys.stderr, flush=True)
        return 2
    sys.stdout.flush()
    os.execv(sys.executable, [sys.executable, "-m", "torch.distributed.run", *argv])
    return 0  # not reached


def main(argv: Optional[List[str]] = None) -> int:
    """``python -m megatron_metp.megatron_lm flags CONFIG`` prints pretrain_gpt.py flags for a
    config; ``vocab-size CONFIG`` prints its vocabulary size (for ``--vocab-size``); ``merge
    FLAGS...`` prints the flags with each named once (later wins); ``check CONFIG
    --world-size N -- FLAGS...`` runs the plugin's start-up checks on a launch script's flags
    (exit 2 and one line on a bad configuration); ``torchrun ARGS...`` is torchrun after those
    checks (:func:`torchrun`)."""
    import shlex

    from megatron_metp.models.config import load_config

    argv = list(sys.argv[1:] if argv is None else argv)
    if argv[:1] == ["torchrun"]:
        return torchrun(argv[1:])
    if argv[:1] == ["merge"]:
        print(shlex.join(merge_flags(argv[1:])))
        return 0
    if argv[:1] == ["check"]:
        rest = argv.index("--") if "--" in argv else len(argv)
        p = argparse.ArgumentParser(prog="python -m megatron_metp.megatron_lm check")
        p.add_argument("config")
        p.add_argument("--world-size", type=int, required=True)
        a = p.parse_args(argv[1:rest])
        try:
            check_launch(a.config, a.world_size, argv[rest + 1:])
        except ValueError as e:   # MetpConfigError and the config loader's errors
            print(f"megatron-metp: error: {e}", file=sys.stderr)
            return 2
        return 0
    p = argparse.ArgumentParser(prog="python -m megatron_metp.megatron_lm")
    p.add_argument("command", choices=("flags", "vocab-size", "merge", "check"))
    p.add_argument("config", help="configs/<model>.yaml or a model name")
    p.add_argument("--model-only", action="store_true", help="flags: leave out training defaults")
    a = p.parse_args(argv)
    if a.command == "flags":
        print(shlex.join(config_flags(a.config, training=not a.model_only)))
    else:
        print(load_config(a.config).vocab_size)
    return 0


__all__ = [
    "MODES", "MetpConfigError", "extra_args_provider", "chain_providers", "apply_mode_remap",
    "explicit_flags", "remap_and_validate", "initialize_plugin_groups", "layer_spec_for",
    "layer_spec_provider", "gpt_builder", "make_gpt_builder", "config_flags",
]


if __name__ == "__main__":
    sys.exit(main())
