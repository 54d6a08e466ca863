"""Start-up validation: the whole configuration checked before any group is built or weight allocated.

One entry point, :func:`validate_args`, takes an ``argparse.Namespace`` with Megatron-LM's
argument names (``tensor_model_parallel_size``, ``num_query_groups``, ...) plus the plugin's
(``tensor_parallel_mode``, ``wallfacer_team_size``, ``wallfacer_placement``). It is called by
``metp train``, by the no-patch wrapper ``scripts/pretrain_gpt_metp.py`` and by the patched
``pretrain_gpt.py`` (both through :mod:`megatron_metp.megatron_lm`), always on the namespace
*after* the WallFacer mode remap, so ``context_parallel_size`` is WallFacer's P.

Every failure is a :class:`MetpConfigError` (a ``ValueError``) whose message names the
Megatron-LM flag and says how to fix it. Rules by mode (p = ``--tensor-model-parallel-size``,
P = ``--context-parallel-size``, C = ``--wallfacer-team-size``):

=========  =================================================================================
all        mode known; sizes >= 1; world size a multiple of TP x CP x PP; layers fit PP and
           the virtual pipeline; heads divide hidden; query groups divide heads; global batch
           a multiple of micro batch x DP; LR warm-up shorter than the decay; flash-attn
           importable when ``--use-flash-attn``;
           ``--cp-comm-type wallfacer`` only in wallfacer mode
tp         Megatron-Core's own rules: heads % p, query groups a multiple *or divisor* of p,
           FFN % p, sequence % p under SP; with CP, sequence % 2P (Megatron's load-balanced
           CP layout)
metp       SP on when p > 1; hidden, heads, query groups, FFN and sequence all % p (each
           rank's ring step holds exactly one TP shard, so fewer groups than ranks cannot be
           replicated as Megatron's TP does); attention dropout 0, vanilla softmax, no
           sliding window; with CP > 1: p even, sequence % (p P) and % 2P, no
           ``--cp-comm-type`` but p2p, no hierarchical CP; no MoE, MLA, legacy models, TP
           comm overlap, multi-token prediction, CUDA graphs, FP8 / FP4, deterministic mode
metp_mlp   the METP MLP with TP attention: FFN, hidden and sequence % p, SP on when p > 1,
           TP's attention rules; no CP
wallfacer  C >= 1 and C^2 | P; sequence % 2P (each rank holds chunks r and 2P-1-r); heads need
           not divide P; query groups divide heads and % TP; ``--cp-comm-type`` wallfacer;
           attention dropout 0, vanilla softmax, no sliding window; no hierarchical CP, MoE,
           MLA, legacy models, CUDA graphs, FP8 / FP4, deterministic mode; heads and FFN % TP
           inside each CP rank
=========  =================================================================================

Rules that belong to a module live beside it and are called from here, re-raised as
MetpConfigError: ``megatron_metp.metp.mlp.validate_metp_mlp`` and
``megatron_metp.metp.attention.check_metp_attention_config`` (fed a view of the namespace with
``TransformerConfig``'s field names), ``megatron_metp.wallfacer.config_generator.
validate_wallfacer``.
"""

from __future__ import annotations

import importlib.util
import os
from argparse import Namespace
from types import SimpleNamespace
from typing import Callable, Optional

from megatron_metp.errors import MetpConfigError

MODES = ("tp", "metp", "metp_mlp", "wallfacer")
CLI_MODES = ("tp", "metp", "wallfacer")
# --wallfacer-placement values, and the names megatron_metp.wallfacer.config_generator uses.
PLACEMENTS = ("team-consecutive", "ring-consecutive")
PLACEMENT_ALIASES = {"team-consecutive": "collective_intra", "ring-consecutive": "p2p_intra"}
PLACEMENT_NAMES = PLACEMENTS + tuple(PLACEMENT_ALIASES.values())
WALLFACER_CP_COMM_TYPE = "wallfacer"

# (namespace attribute, Megatron-LM flag, why a METP/WallFacer layer cannot honour it)
_UNSUPPORTED = {
    "metp": [
        ("num_experts", "--num-experts", "MoE layers are not METP layers (the expert MLPs keep "
         "Megatron's expert parallelism)"),
        ("multi_latent_attention", "--multi-latent-attention", "MLA has no METP attention"),
        ("use_legacy_models", "--use-legacy-models", "the plugin builds Megatron-Core models"),
        ("tp_comm_overlap", "--tp-comm-overlap", "METP overlaps its own ring communication; "
         "Transformer Engine's userbuffer overlap targets TP all-gathers METP does not issue"),
        ("mtp_num_layers", "--mtp-num-layers", "multi-token prediction layers use the TP spec"),
        ("experimental_attention_variant", "--experimental-attention-variant",
         "the METP spec has its own attention"),
        ("heterogeneous_layers_config_path", "--heterogeneous-layers-config-path",
         "every layer uses the mode's one layer spec"),
        ("hierarchical_context_parallel_sizes", "--hierarchical-context-parallel-sizes",
         "METP's own K/V ring carries context parallelism (a2a+p2p is not used)"),
    ],
    "wallfacer": [
        ("num_experts", "--num-experts", "the WallFacer spec has no MoE layer"),
        ("multi_latent_attention", "--multi-latent-attention", "MLA has no WallFacer attention"),
        ("use_legacy_models", "--use-legacy-models", "the plugin builds Megatron-Core models"),
        ("hierarchical_context_parallel_sizes", "--hierarchical-context-parallel-sizes",
         "WallFacer builds its own teams and sub-rings inside the CP group"),
        ("mtp_num_layers", "--mtp-num-layers", "multi-token prediction layers use the TP spec"),
        ("experimental_attention_variant", "--experimental-attention-variant",
         "WallFacer replaces the core attention of Megatron's standard self-attention"),
        ("heterogeneous_layers_config_path", "--heterogeneous-layers-config-path",
         "every layer uses the mode's one layer spec"),
    ],
}
# What neither plugin mode runs (Megatron-LM's names): CUDA graph capture would freeze the
# Python-side state that links layers (METP's posted weight gathers, the rings' schedules) and
# the host's reads of packed layouts; the plugin's GEMMs and attention run in bf16, so under
# FP8 or FP4 stock's layers would run a precision the plugin's do not; deterministic mode asks
# for deterministic attention backward, which the plugin's kernels do not promise.
_CUDA_GRAPH_WHY = ("CUDA graph capture would freeze the Python-side state that links its "
                   "layers and the host's reads of packed layouts")
_LOW_PRECISION_WHY = ("its GEMMs and attention run in bf16, so stock's layers would run a "
                      "precision the plugin's do not")
for _mode in ("metp", "wallfacer"):
    _UNSUPPORTED[_mode] += [
        ("enable_cuda_graph", "--enable-cuda-graph", _CUDA_GRAPH_WHY),
        ("external_cuda_graph", "--external-cuda-graph", _CUDA_GRAPH_WHY),
        ("fp8", "--fp8-format", _LOW_PRECISION_WHY),
        ("fp4", "--fp4-format", _LOW_PRECISION_WHY),
        ("deterministic_mode", "--deterministic-mode", "its attention kernels (flash-attn with "
         "deterministic=False, the rings' accumulation order) do not promise a deterministic "
         "backward"),
    ]
_UNSUPPORTED["metp_mlp"] = list(_UNSUPPORTED["metp"])  # its attention is Megatron's own
# Megatron-LM's per-document masks: the plugin's attention applies the causal mask alone (as
# Transformer Engine does for a causal mask type), so packed documents would see each other.
for _mode in ("metp", "wallfacer"):
    _UNSUPPORTED[_mode].append(
        ("reset_attention_mask", "--reset-attention-mask", "its attention takes documents as "
         "packed_seq_params (cu_seqlens, as --sft batches carry them), not as a dense per-"
         "document mask, which it would ignore and attend across the documents' boundaries"))


def _fail(msg: str) -> None:
    raise MetpConfigError(msg)


def _int(ns: Namespace, name: str, default: Optional[int] = None) -> Optional[int]:
    v = getattr(ns, name, default)
    return default if v is None else v


def query_groups(ns: Namespace) -> int:
    """Query groups as Megatron-LM resolves them (``--num-query-groups`` needs
    ``--group-query-attention``; a namespace without that switch, e.g. ``metp train``'s, uses
    ``num_query_groups`` when set)."""
    heads = ns.num_attention_heads
    groups = getattr(ns, "num_query_groups", None)
    if hasattr(ns, "group_query_attention") and not ns.group_query_attention:
        return heads
    return heads if groups is None else groups


def ffn_hidden_size(ns: Namespace) -> int:
    """``--ffn-hidden-size``, or Megatron-LM's default (4h; SwiGLU: 8h/3 rounded down to 64)."""
    ffn = getattr(ns, "ffn_hidden_size", None)
    if ffn is not None:
        return ffn
    if getattr(ns, "swiglu", False):
        return int((4 * ns.hidden_size * 2 / 3) / 64) * 64
    return 4 * ns.hidden_size


def team_size(ns: Namespace) -> Optional[int]:
    """``--wallfacer-team-size`` as an int (default 1 = ring attention); None for 'auto'."""
    c = getattr(ns, "wallfacer_team_size", None)
    if c is None:
        return 1
    if isinstance(c, str):
        if c == "auto":
            return None
        try:
            return int(c)
        except ValueError:
            _fail(f"--wallfacer-team-size {c!r}: give an integer C with C^2 dividing "
                  f"--context-parallel-size, or 'auto' to let the topology scheduler pick")
    return c


def _cp_comm_types(ns: Namespace) -> list:
    t = getattr(ns, "cp_comm_type", None)
    if t is None:
        return []
    return [t] if isinstance(t, str) else list(t)


# ------------------------------------------------------------------------------------------
# Flag values: ranges, types and paths, checked before anything else (no import beyond the
# standard library, so a bad value fails in a fraction of a second, before any rank starts).
# A rule applies only where the namespace has the attribute and it is set (not None), so the
# same table serves metp train's flags and Megatron-LM's.

def _at_least(lo):
    return (lambda v: v >= lo), f">= {lo}"


_AT_LEAST_1 = _at_least(1)
_AT_LEAST_0 = _at_least(0)
_DROPOUT = (lambda v: 0 <= v < 1), "in [0, 1)"

# (attribute, flag, (test, what it must be), what the value means / how to fix)
_VALUE_RULES = [
    ("tensor_model_parallel_size", "--tensor-model-parallel-size", _AT_LEAST_1, "ranks per TP group"),
    ("context_parallel_size", "--context-parallel-size", _AT_LEAST_1, "ranks per CP group"),
    ("pipeline_model_parallel_size", "--pipeline-model-parallel-size", _AT_LEAST_1,
     "pipeline stages"),
    ("nproc_per_node", "--nproc-per-node", _AT_LEAST_1, "ranks to launch on this node"),
    ("seq_length", "--seq-length", _AT_LEAST_1, "tokens per sequence"),
    ("micro_batch_size", "--micro-batch-size", _AT_LEAST_1, "sequences per micro-batch"),
    ("global_batch_size", "--global-batch-size", _AT_LEAST_1, "sequences per iteration"),
    ("train_iters", "--train-iters", _AT_LEAST_0, "iterations to train"),
    ("lr", "--lr", _AT_LEAST_0, "the peak learning rate"),
    ("min_lr", "--min-lr", _AT_LEAST_0, "the learning rate at the end of the decay"),
    ("lr_warmup_iters", "--lr-warmup-iters", _AT_LEAST_0, "warm-up iterations"),
    ("lr_decay_iters", "--lr-decay-iters", _AT_LEAST_1, "decay iterations"),
    ("weight_decay", "--weight-decay", _AT_LEAST_0, "the L2 coefficient"),
    ("clip_grad", "--clip-grad", _AT_LEAST_0, "the gradient-norm limit (0 = off)"),
    ("hidden_dropout", "--hidden-dropout", _DROPOUT, "a dropout probability"),
    ("attention_dropout", "--attention-dropout", _DROPOUT, "a dropout probability"),
    ("seed", "--seed", _AT_LEAST_0, "the random seed"),
    ("vocab_size", "--vocab-size", _AT_LEAST_1, "the tokenizer's vocabulary"),
    ("make_vocab_size_divisible_by", "--make-vocab-size-divisible-by", _AT_LEAST_1,
     "the vocabulary padding multiple"),
    ("save_interval", "--save-interval", _AT_LEAST_1, "iterations between checkpoints"),
    ("exit_interval", "--exit-interval", _AT_LEAST_1, "iterations after which to save and exit"),
    ("exit_duration_in_mins", "--exit-duration-in-mins", ((lambda v: v > 0), "above 0"),
     "minutes after which to save and exit"),
    ("distributed_timeout_minutes", "--distributed-timeout-minutes", ((lambda v: v > 0), "above 0"),
     "minutes a collective may wait for a peer"),
    ("num_layers", "--num-layers", _AT_LEAST_1, "transformer layers"),
    ("hidden_size", "--hidden-size", _AT_LEAST_1, "the model width"),
    ("num_attention_heads", "--num-attention-heads", _AT_LEAST_1, "attention heads"),
    ("max_position_embeddings", "--max-position-embeddings", _AT_LEAST_1,
     "positions of the embedding table"),
]


def check_values(ns: Namespace, *, trainer: bool = False) -> None:
    """Each set flag within its range (table above), and the ranges that combine two flags.
    ``trainer``: ``metp train``'s own rules too (Megatron-LM's ``--train-iters 0`` serves
    evaluation-only runs, so only metp train refuses it)."""
    for attr, flag, (ok, must), meaning in _VALUE_RULES:
        v = getattr(ns, attr, None)
        if v is None or isinstance(v, bool):
            continue
        if not isinstance(v, (int, float)) or not ok(v):
            _fail(f"{flag} {_shown(v)}: must be {must} ({meaning}); pass a value {must}")
    if trainer and getattr(ns, "train_iters", None) == 0 and not getattr(ns, "save", None):
        _fail("--train-iters 0: nothing to train; pass --train-iters >= 1 (or --save DIR to "
              "write the initial weights only)")
    lr, min_lr = getattr(ns, "lr", None), getattr(ns, "min_lr", None)
    if lr is not None and min_lr is not None and min_lr > lr:
        _fail(f"--min-lr {_shown(min_lr)} is above --lr {_shown(lr)}: the schedule decays from "
              f"--lr to --min-lr; pass --min-lr <= {_shown(lr)}")
    gran = getattr(ns, "recompute_granularity", None)
    modules = getattr(ns, "recompute_modules", None)
    if modules and gran != "selective":
        modules = [modules] if isinstance(modules, str) else modules
        _fail(f"--recompute-modules {' '.join(modules)} needs --recompute-granularity selective")
    for attr, flag in (("recompute_method", "--recompute-method"),
                       ("recompute_num_layers", "--recompute-num-layers")):
        v = getattr(ns, attr, None)
        if v is not None and gran != "full":
            _fail(f"{flag} {v} needs --recompute-granularity full (it says which layers a full "
                  f"recompute checkpoints); add it or drop {flag}")
    k, layers = getattr(ns, "recompute_num_layers", None), getattr(ns, "num_layers", None)
    if gran == "full" and k is not None and (k < 1 or (layers and k > layers)):
        _fail(f"--recompute-num-layers {k}: must be between 1 and --num-layers {layers} (layers "
              f"per chunk, or checkpointed layers with --recompute-method block)")
    s, pos = getattr(ns, "seq_length", None), getattr(ns, "max_position_embeddings", None)
    if (s is not None and pos is not None and s > pos and getattr(
            ns, "position_embedding_type", "learned_absolute") == "learned_absolute"):
        _fail(f"--seq-length {s} is longer than --max-position-embeddings {pos} of the learned "
              f"position table: raise --max-position-embeddings to >= {s} or shorten "
              f"--seq-length")


def _shown(v):
    """A number as a refusal shows it: a float flag's -1.0 as -1, as it was typed (the launcher
    parses ``-1`` as an int, Megatron-LM's parser as a float: the lines must read the same)."""
    return f"{v:g}" if isinstance(v, float) else v


def _writable_dir(flag: str, path: str, what: str) -> None:
    """``path`` is a directory this process can write in, or can be created as one: the nearest
    existing ancestor takes a probe file (which is removed). Nothing else is created."""
    import tempfile

    p = os.path.abspath(path)
    if os.path.exists(p) and not os.path.isdir(p):
        _fail(f"{flag} {path}: is a file, not a directory; pass a directory for {what}")
    probe = p
    while not os.path.exists(probe):
        probe = os.path.dirname(probe)
    if not os.path.isdir(probe):
        _fail(f"{flag} {path}: {probe} is a file, so no directory can be made there; pass a "
              f"directory for {what}")
    try:
        fd, name = tempfile.mkstemp(prefix=".metp-write-probe-", dir=probe)
        os.close(fd)
        os.unlink(name)
    except OSError as e:
        _fail(f"{flag} {path}: cannot write in {probe} ({e.strerror}); pass a writable "
              f"directory for {what}")


def check_output_file(flag: str, path: str) -> None:
    """``path`` names a file (not a directory) in a directory that can be written or made; the
    directory is made now, so that a report computed for minutes is not lost at its end."""
    if os.path.isdir(path):
        _fail(f"{flag} {path}: is a directory; pass a file path inside it")
    parent = os.path.dirname(os.path.abspath(path))
    _writable_dir(flag, parent, f"the {flag} file")
    os.makedirs(parent, exist_ok=True)


def check_paths(ns: Namespace) -> None:
    """``--save`` (and ``--log-json``'s directory) writable; ``--load``, if it exists, a
    directory; ``--data-path`` names an existing PREFIX.bin / PREFIX.idx pair."""
    save = getattr(ns, "save", None)
    if save:
        _writable_dir("--save", save, "checkpoints")
    load = getattr(ns, "load", None)
    if load and os.path.exists(load) and not os.path.isdir(load):
        _fail(f"--load {load}: is a file; pass the checkpoint directory given to --save")
    log = getattr(ns, "log_json", None)
    if log:
        check_output_file("--log-json", log)
    data = getattr(ns, "data_path", None)
    # One PREFIX (metp train), or Megatron-LM's list: PREFIX... or WEIGHT PREFIX WEIGHT PREFIX.
    prefixes = [data] if isinstance(data, str) else [d for d in data or []
                                                     if not _not_a_local_prefix(d)]
    for prefix in prefixes:
        missing = [f"{prefix}{ext}" for ext in (".bin", ".idx")
                   if not os.path.isfile(prefix + ext)]
        if missing:
            _fail(f"--data-path {prefix}: no {' or '.join(missing)}; pass the PREFIX of a "
                  f"Megatron indexed dataset (PREFIX.bin + PREFIX.idx)")


def _not_a_local_prefix(entry) -> bool:
    """Whether a ``--data-path`` entry is a blend weight (a number) or an object-store URL
    (Megatron's multi-storage client), not a local PREFIX."""
    if isinstance(entry, str) and "://" in entry:
        return True
    try:
        float(entry)
        return True
    except (TypeError, ValueError):
        return False


def validate_args(
    ns: Namespace,
    *,
    flash_attn_available: Optional[Callable[[], bool]] = None,
) -> Namespace:
    """Check every rule of the module docstring; return ``ns`` unchanged or raise MetpConfigError.

    ``flash_attn_available`` overrides the import probe for ``--use-flash-attn`` (tests).
    """
    try:
        return _validate(ns, flash_attn_available)
    except MetpConfigError as e:
        raise MetpConfigError(str(e) + _remap_note(ns, str(e))) from e.__cause__


def _remap_note(ns: Namespace, message: str) -> str:
    """Where ``--tensor-parallel-mode wallfacer`` ran the user's ``--tensor-model-parallel-size
    P`` as ``--context-parallel-size P`` (``megatron_lm.apply_mode_remap``), a refusal naming
    the sizes says so: the user typed the TP flag, not the CP one the rule names."""
    p = getattr(ns, "_metp_wallfacer_from_tp", None)
    if p is None or not ("--context-parallel-size" in message
                         or "--tensor-model-parallel-size" in message):
        return ""
    return (f" (--tensor-parallel-mode wallfacer runs --tensor-model-parallel-size {p} as "
            f"--context-parallel-size {p} with --tensor-model-parallel-size 1)")


def _validate(ns: Namespace, flash_attn_available: Optional[Callable[[], bool]]) -> Namespace:
    check_values(ns)
    check_paths(ns)
    mode = getattr(ns, "tensor_parallel_mode", None) or "tp"
    if mode not in MODES:
        _fail(f"--tensor-parallel-mode {mode!r} is unknown: choose one of {', '.join(CLI_MODES)}")
    tp = _int(ns, "tensor_model_parallel_size", 1)
    cp = _int(ns, "context_parallel_size", 1)
    pp = _int(ns, "pipeline_model_parallel_size", 1)
    for flag, v in (("--tensor-model-parallel-size", tp), ("--context-parallel-size", cp),
                    ("--pipeline-model-parallel-size", pp)):
        if not isinstance(v, int) or v < 1:
            _fail(f"{flag} {v!r}: parallel sizes are integers >= 1")

    dp = _check_world(ns, tp, cp, pp)
    _check_pipeline(ns, pp)
    _check_model_shape(ns)
    _check_batch(ns, dp)
    _check_schedule(ns)
    _check_features(ns, mode)
    _check_flash_attn(ns, flash_attn_available)

    if mode == "tp":
        _check_tp_sharding(ns, tp, cp, mode)
    elif mode in ("metp", "metp_mlp"):
        _check_metp(ns, tp, cp, mode)
    else:
        _check_wallfacer(ns, tp, cp)
    return ns


def _check_world(ns: Namespace, tp: int, cp: int, pp: int) -> Optional[int]:
    world = getattr(ns, "world_size", None)
    if world is None and os.environ.get("WORLD_SIZE"):
        world = int(os.environ["WORLD_SIZE"])
    if world is None:
        return None
    model = tp * cp * pp
    if world % model:
        _fail(f"world size {world} is not a multiple of --tensor-model-parallel-size {tp} x "
              f"--context-parallel-size {cp} x --pipeline-model-parallel-size {pp} = {model}: "
              f"launch a multiple of {model} ranks (nodes x --nproc-per-node) or change the sizes")
    return world // model


def _check_pipeline(ns: Namespace, pp: int) -> None:
    layers = getattr(ns, "num_layers", None)
    if layers is None:
        return
    uneven = (getattr(ns, "decoder_first_pipeline_num_layers", None) is not None
              or getattr(ns, "decoder_last_pipeline_num_layers", None) is not None
              or getattr(ns, "pipeline_model_parallel_layout", None) is not None)
    if not uneven and layers % pp:
        _fail(f"--num-layers {layers} is not divisible by --pipeline-model-parallel-size {pp}: "
              f"every stage holds the same number of layers; pick a divisor of {layers}")
    per_stage = layers // pp
    lpv = getattr(ns, "num_layers_per_virtual_pipeline_stage", None)
    vpp = getattr(ns, "virtual_pipeline_model_parallel_size", None)
    if vpp is None:
        vpp = getattr(ns, "num_virtual_stages_per_pipeline_rank", None)
    if lpv is not None:
        if lpv < 1 or per_stage % lpv:
            _fail(f"--num-layers-per-virtual-pipeline-stage {lpv} does not divide the "
                  f"{per_stage} layers of each of --pipeline-model-parallel-size {pp} stages")
        vpp = per_stage // lpv
    if vpp is None or vpp == 1:
        return
    if vpp < 1 or (not uneven and per_stage % vpp):
        _fail(f"--num-virtual-stages-per-pipeline-rank {vpp} does not divide the {per_stage} "
              f"layers of each pipeline stage (--num-layers {layers} / "
              f"--pipeline-model-parallel-size {pp})")
    # Megatron's interleaved schedule needs more than one stage; without P2P overlap it needs
    # three, so that no two ranks exchange more than one send/recv pair per batch.
    need = 2 if getattr(ns, "overlap_p2p_comm", False) else 3
    if pp < need:
        _fail(f"a virtual pipeline ({vpp} virtual stages) needs --pipeline-model-parallel-size "
              f">= {need} (is {pp}); drop --num-virtual-stages-per-pipeline-rank / "
              f"--num-layers-per-virtual-pipeline-stage or raise the pipeline size")


def _check_model_shape(ns: Namespace) -> None:
    h, heads = ns.hidden_size, ns.num_attention_heads
    if getattr(ns, "kv_channels", None) is None and h % heads:
        _fail(f"--hidden-size {h} is not divisible by --num-attention-heads {heads} (and "
              f"--kv-channels is not set): choose heads dividing the hidden size")
    groups = query_groups(ns)
    if groups < 1 or heads % groups:
        _fail(f"--num-query-groups {groups} must divide --num-attention-heads {heads}")


def _check_schedule(ns: Namespace) -> None:
    # Megatron-Core's OptimizerParamScheduler asserts warm-up < decay steps, mid-initialisation.
    warmup = getattr(ns, "lr_warmup_iters", None)
    decay = getattr(ns, "lr_decay_iters", None) or getattr(ns, "train_iters", None)
    if warmup and decay and warmup >= decay:
        _fail(f"--lr-warmup-iters {warmup} is not below the {decay} decay iterations "
              f"(--lr-decay-iters, else --train-iters): shorten the warm-up or train longer")


def _check_batch(ns: Namespace, dp: Optional[int]) -> None:
    mbs, gbs = getattr(ns, "micro_batch_size", None), getattr(ns, "global_batch_size", None)
    if dp is None or mbs is None or gbs is None:
        return
    if gbs % (mbs * dp):
        _fail(f"--global-batch-size {gbs} is not a multiple of --micro-batch-size {mbs} x "
              f"data-parallel size {dp}: use a multiple of {mbs * dp}")


def _check_features(ns: Namespace, mode: str) -> None:
    for attr, flag, why in _UNSUPPORTED.get(mode, []):
        if getattr(ns, attr, None):
            _fail(f"{flag} is not supported with --tensor-parallel-mode {mode}: {why}; "
                  f"drop {flag} or use --tensor-parallel-mode tp")
    graphs = getattr(ns, "cuda_graph_impl", None) or "none"
    if mode != "tp" and graphs != "none":
        _fail(f"--cuda-graph-impl {graphs} is not supported with --tensor-parallel-mode {mode}: "
              f"{_CUDA_GRAPH_WHY}; drop --cuda-graph-impl or use --tensor-parallel-mode tp")
    c = getattr(ns, "wallfacer_team_size", None)
    if mode != "wallfacer" and c not in (None, 1, "1"):
        _fail(f"--wallfacer-team-size {c} applies only to --tensor-parallel-mode wallfacer")
    spec = getattr(ns, "spec", None)
    if mode != "tp" and spec and spec[0] != "megatron_metp.specs":
        _fail(f"--spec {' '.join(spec)} conflicts with --tensor-parallel-mode {mode}, which "
              f"picks megatron_metp.specs' {mode}_layer_spec: drop --spec")
    types = _cp_comm_types(ns)
    if mode != "wallfacer" and WALLFACER_CP_COMM_TYPE in types:
        _fail(f"--cp-comm-type {WALLFACER_CP_COMM_TYPE} needs --tensor-parallel-mode wallfacer "
              f"(it selects the plugin's core attention)")


def _check_flash_attn(ns: Namespace, available: Optional[Callable[[], bool]]) -> None:
    if not getattr(ns, "use_flash_attn", False):
        return
    ok = available() if available is not None else importlib.util.find_spec("flash_attn") is not None
    if not ok:
        _fail("--use-flash-attn was given but the flash_attn package is not importable: install "
              "it (pip install 'megatron-metp[gpu]' on a CUDA machine) or drop --use-flash-attn "
              "to use PyTorch's fused attention")


def _check_tp_sharding(ns: Namespace, tp: int, cp: int, mode: str) -> None:
    """Megatron-Core's own TP/SP/CP divisibility (TransformerConfig, Attention, ColumnParallel)."""
    heads, groups, ffn = ns.num_attention_heads, query_groups(ns), ffn_hidden_size(ns)
    if heads % tp:
        _fail(f"--num-attention-heads {heads} is not divisible by --tensor-model-parallel-size "
              f"{tp} (mode {mode}): each TP rank holds heads/p whole heads")
    if groups % tp and tp % groups:
        _fail(f"--num-query-groups {groups} must be a multiple or a divisor of "
              f"--tensor-model-parallel-size {tp} (mode {mode}; Megatron replicates groups when "
              f"there are fewer than TP ranks)")
    if mode == "tp" and ffn % tp:
        _fail(f"--ffn-hidden-size {ffn} is not divisible by --tensor-model-parallel-size {tp}: "
              f"fc1 is split by columns; pick a multiple of {tp}")
    _check_seq(ns, tp, cp, mode)


def _check_seq(ns: Namespace, tp: int, cp: int, mode: str) -> None:
    s = getattr(ns, "seq_length", None)
    if s is None:
        return
    if cp > 1 and s % (2 * cp):
        layout = ("WallFacer's zigzag layout: rank r holds chunks r and 2P-1-r of 2P"
                  if mode == "wallfacer" else "Megatron's load-balanced CP layout")
        _fail(f"--seq-length {s} is not divisible by 2 x --context-parallel-size {cp} = "
              f"{2 * cp} ({layout}); pick a multiple of {2 * cp}")
    local = s // cp
    if getattr(ns, "sequence_parallel", False) and tp > 1 and local % tp:
        _fail(f"--seq-length {s} gives {local} tokens per context rank, not divisible by "
              f"--tensor-model-parallel-size {tp} under --sequence-parallel; pick a multiple of "
              f"{cp * tp * (2 if cp > 1 else 1)}")


def _config_view(ns: Namespace, tp: int, cp: int) -> SimpleNamespace:
    """The ``TransformerConfig`` fields the modules' own checks read, taken from the namespace,
    so those checks run here, before any config, group or weight exists."""
    return SimpleNamespace(
        tensor_model_parallel_size=tp, context_parallel_size=cp,
        sequence_parallel=bool(getattr(ns, "sequence_parallel", False)),
        hidden_size=ns.hidden_size, num_attention_heads=ns.num_attention_heads,
        num_query_groups=query_groups(ns), ffn_hidden_size=ffn_hidden_size(ns),
        attention_dropout=getattr(ns, "attention_dropout", 0.0) or 0.0,
        multi_latent_attention=bool(getattr(ns, "multi_latent_attention", False)),
        attention_output_gate=bool(getattr(ns, "attention_output_gate", False)),
        softmax_type=getattr(ns, "softmax_type", None) or "vanilla",
        window_size=getattr(ns, "window_size", None))


def _as_config_error(check: Callable, *args, **kwargs) -> None:
    try:
        check(*args, **kwargs)
    except MetpConfigError:
        raise
    except ValueError as e:  # the module's rule, re-raised as the one start-up error type
        raise MetpConfigError(str(e)) from e


def _check_metp(ns: Namespace, tp: int, cp: int, mode: str) -> None:
    """METP's rules live beside its modules (``validate_metp_mlp``, ``check_metp_attention_config``);
    this adds the start-up-only ones (context parallelism, the sequence length).

    ``metp`` composes with Megatron's context parallelism (METP on the TP group, CP across it)
    when the TP size is even (checked by ``check_metp_attention_config``), the sequence splits
    into 2 CP chunks and then into TP blocks per CP rank (``_check_seq``: ``--seq-length`` a
    multiple of TP x CP), and the CP communication is left to METP's own K/V ring (no
    ``--cp-comm-type`` other than the default p2p). ``metp_mlp`` keeps Megatron's attention,
    whose local core attention has no CP: refused."""
    if cp > 1 and mode == "metp_mlp":
        _fail(f"--tensor-parallel-mode metp_mlp does not compose with --context-parallel-size "
              f"{cp} (its attention is Megatron's local core attention, which has no context "
              f"parallelism): use --tensor-parallel-mode metp, or --context-parallel-size 1")
    if cp > 1 and getattr(ns, "metp_ring_pass", None) == "a2a":
        _fail(f"--metp-ring-pass a2a conflicts with --context-parallel-size {cp}: its "
              f"all-to-alls run over the TP group only, and under CP the K/V travel METP's "
              f"TP x CP ring; use --metp-ring-pass whole (or auto), or --context-parallel-size 1")
    if cp > 1:
        other = [t for t in _cp_comm_types(ns) if t != "p2p"]
        if other:
            _fail(f"--cp-comm-type {' '.join(other)} conflicts with --tensor-parallel-mode metp "
                  f"at --context-parallel-size {cp}: METP's own K/V ring carries context "
                  f"parallelism; drop --cp-comm-type (or pass p2p)")
    from megatron_metp.metp.mlp import validate_metp_mlp

    view = _config_view(ns, tp, cp)
    _as_config_error(validate_metp_mlp, view, getattr(ns, "seq_length", None), tp,
                     view.ffn_hidden_size)
    if mode == "metp_mlp":
        _check_tp_sharding(ns, tp, cp, mode)
        return
    from megatron_metp.metp.attention import check_metp_attention_config

    _as_config_error(check_metp_attention_config, view, tp)
    if cp > 1:  # each CP rank's tokens (2 load-balanced chunks) split into TP blocks
        _check_seq(ns, tp, cp, mode)


def _check_wallfacer(ns: Namespace, tp: int, cp: int) -> None:
    """WallFacer's rules live beside its configuration generator (``validate_wallfacer``: C^2 | P,
    placement, sequence % 2P, query groups, ``--cp-comm-type``); this adds the flag spellings,
    the attention features WallFacerCoreAttention refuses, and the TP rules inside each CP rank."""
    types = _cp_comm_types(ns)
    if len(types) > 1 and any(t != WALLFACER_CP_COMM_TYPE for t in types):
        _fail(f"--cp-comm-type {' '.join(types)} conflicts with --tensor-parallel-mode "
              f"wallfacer: drop --cp-comm-type (the mode sets it to '{WALLFACER_CP_COMM_TYPE}')")
    placement = getattr(ns, "wallfacer_placement", None) or PLACEMENTS[0]
    if placement not in PLACEMENT_NAMES:
        _fail(f"--wallfacer-placement {placement!r} is unknown: choose one of "
              f"{', '.join(PLACEMENTS)}")
    dropout = getattr(ns, "attention_dropout", 0.0) or 0.0
    if dropout > 0:
        _fail(f"--attention-dropout {dropout} (Megatron-LM's default 0.1 where not given): "
              f"WallFacer attention has no attention dropout "
              f"(its blocks' backward recomputes the probabilities with no per-block dropout "
              f"RNG state); set --attention-dropout 0")
    if (getattr(ns, "softmax_type", None) or "vanilla") != "vanilla" or getattr(
            ns, "window_size", None) is not None:
        _fail("--softmax-type / --window-size: WallFacer attention supports --softmax-type "
              "vanilla and no --window-size")
    # Heads need not divide P (every CP rank keeps all heads of its tokens); TP inside each CP
    # rank shards heads as Megatron does, checked first so the message names the heads flag.
    heads = ns.num_attention_heads
    if heads % tp:
        _fail(f"--num-attention-heads {heads} is not divisible by --tensor-model-parallel-size "
              f"{tp} (TP inside each WallFacer rank holds heads/p whole heads)")
    ffn = ffn_hidden_size(ns)
    if ffn % tp:
        _fail(f"--ffn-hidden-size {ffn} is not divisible by --tensor-model-parallel-size {tp}")
    from megatron_metp.wallfacer.config_generator import validate_wallfacer

    c = team_size(ns)
    seq = getattr(ns, "seq_length", None)
    _as_config_error(
        validate_wallfacer, cp, "auto" if c is None else c,
        2 * cp if seq is None else seq,  # no sequence length known yet: no sequence rule
        num_attention_heads=heads, num_query_groups=query_groups(ns),
        tensor_model_parallel_size=tp, placement=groups_placement(placement),
        cp_comm_type=types[0] if types else None)
    _check_seq(ns, tp, cp, "wallfacer")  # tokens per CP rank under TP + SP


def groups_placement(name: str) -> str:
    """The placement name of ``megatron_metp.wallfacer.config_generator`` for a flag value."""
    return PLACEMENT_ALIASES.get(name, name)
