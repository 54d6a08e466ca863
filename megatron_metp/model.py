"""Build Megatron-Core GPT models for every ``--tensor-parallel-mode``, on CPU (gloo) or GPU.

Used by the tests, ``metp train`` and the Megatron-LM integration::

    initialize_parallel(tensor_model_parallel_size=2)            # after init_process_group
    config = make_config(style="llama", num_layers=2, hidden_size=64, num_attention_heads=4)
    model = build_gpt_model(config, "tp", vocab_size=128, max_sequence_length=32,
                            position_embedding_type="rope")

``make_config`` presets
    gpt    LayerNorm, GeLU, biases, learned absolute positions (pass to build_gpt_model)
    llama  RMSNorm, SwiGLU (gated GeLU-free MLP with SiLU), no biases, GQA (2 query groups),
           rotary positions (pass ``position_embedding_type="rope"``)

CPU-safe defaults: ``use_cpu_initialization=True`` (weights are drawn whole on CPU from torch's
default generator and sliced, so they do not depend on the TP size), every CUDA-only fusion off,
``gradient_accumulation_fusion=False``, dropout 0 (tests compare modes; pass
``hidden_dropout``/``attention_dropout`` to train with dropout).
"""

from __future__ import annotations

import datetime
import random
from typing import Any, Optional, Union

import torch
import torch.nn.functional as F
from megatron.core import parallel_state as mpu
from megatron.core.models.gpt import GPTModel
from megatron.core.transformer.transformer_config import TransformerConfig

from megatron_metp import parallel_state as metp_state
from megatron_metp.specs import MODES, check_spec_importable, get_gpt_block_spec

# The process groups that existed when initialize_parallel began (None: no live set-up).
_GROUPS_BEFORE: Optional[frozenset] = None

_PRESETS = {
    "gpt": dict(
        normalization="LayerNorm",
        activation_func=F.gelu,
        gated_linear_unit=False,
        add_bias_linear=True,
    ),
    "llama": dict(
        normalization="RMSNorm",
        activation_func=F.silu,
        gated_linear_unit=True,
        add_bias_linear=False,
        num_query_groups=2,
    ),
}

# Fusions and kernels that need CUDA (or apex/TE); off unless the caller turns them on.
_CPU_SAFE = dict(
    use_cpu_initialization=True,
    perform_initialization=True,
    gradient_accumulation_fusion=False,
    bias_activation_fusion=False,
    bias_dropout_fusion=False,
    masked_softmax_fusion=False,
    apply_rope_fusion=False,
    persist_layer_norm=False,
    cross_entropy_loss_fusion=False,
    hidden_dropout=0.0,
    attention_dropout=0.0,
)


def stock_fusions(*, gated_linear_unit: bool, add_bias_linear: bool) -> dict:
    """The fusions Megatron-LM turns on by default, for the stock ``tp`` baseline.

    ``--bias-gelu-fusion`` / ``--bias-swiglu-fusion`` (Megatron-LM turns the GeLU one off when
    the linears have no bias), ``--apply-rope-fusion``, ``--gradient-accumulation-fusion`` and the
    fused bias-dropout-add. Call after ``cpu_compat.apply()``: on CPU the RoPE and
    gradient-accumulation kernels are ``cpu_compat``'s twins of Transformer Engine's and apex's
    (same math, same saved tensors).
    Note that Megatron's fused bias-GeLU is the tanh approximation of GeLU; METP's MLP follows
    the config, so tp and metp compute the same function.
    """
    from megatron.core.models.common.embeddings import rope_utils
    from megatron.core.tensor_parallel import layers

    # Where a kernel is missing (a GPU without Transformer Engine or apex), the fusion is off,
    # as Megatron-Core itself would refuse it.
    return dict(
        bias_activation_fusion=bool(gated_linear_unit or add_bias_linear),
        apply_rope_fusion=rope_utils.fused_apply_rotary_pos_emb is not None,
        gradient_accumulation_fusion=bool(layers._grad_accum_fusion_available),
        bias_dropout_fusion=True,
    )


def make_config(style: str = "gpt", **overrides: Any) -> TransformerConfig:
    """A ``TransformerConfig`` with CPU-safe defaults and a GPT or LLaMA-style preset.

    Defaults (overridable): 2 layers, hidden 64, 4 heads, fp32, every fusion off (the tests'
    fp64 references are unfused). ``stock=True`` turns on Megatron-LM's default fusions
    (:func:`stock_fusions`): the baseline of ``metp train``, ``metp bench`` and ``metp plan``.
    ``tensor_model_parallel_size``, ``pipeline_model_parallel_size`` and
    ``context_parallel_size`` default to Megatron's
    initialised parallel state (1 when it is not initialised); ``sequence_parallel`` defaults to
    ``tensor_model_parallel_size > 1``.
    """
    if style not in _PRESETS:
        raise ValueError(f"make_config: style must be 'gpt' or 'llama', got {style!r}")
    stock = overrides.pop("stock", False)
    # The plugin's own setting, carried on the config for METP attention to read once at
    # construction (metp.attention.RING_PASSES): not a TransformerConfig field.
    ring_pass = overrides.pop("metp_ring_pass", "auto")
    qkv_backward = overrides.pop("metp_qkv_backward", "auto")
    mlp_pass = overrides.pop("metp_mlp_pass", "auto")
    kw: dict = dict(num_layers=2, hidden_size=64, num_attention_heads=4)
    kw.update(_CPU_SAFE)
    kw.update(_PRESETS[style])
    if stock:
        gated = overrides.get("gated_linear_unit", kw.get("gated_linear_unit", False))
        bias = overrides.get("add_bias_linear", kw.get("add_bias_linear", True))
        kw.update(stock_fusions(gated_linear_unit=gated, add_bias_linear=bias))
    if mpu.model_parallel_is_initialized():
        kw.update(
            tensor_model_parallel_size=mpu.get_tensor_model_parallel_world_size(),
            pipeline_model_parallel_size=mpu.get_pipeline_model_parallel_world_size(),
            context_parallel_size=mpu.get_context_parallel_world_size(),
        )
    kw.update(overrides)
    kw.setdefault("sequence_parallel", kw.get("tensor_model_parallel_size", 1) > 1)
    if kw.get("pipeline_model_parallel_size", 1) > 1:
        kw.setdefault("pipeline_dtype", kw.get("params_dtype", torch.float32))
    if kw.get("bf16"):
        kw.setdefault("params_dtype", torch.bfloat16)
    config = TransformerConfig(**kw)
    config.metp_ring_pass = ring_pass
    config.metp_qkv_backward = qkv_backward
    config.metp_mlp_pass = mlp_pass
    return config


def build_gpt_model(
    config: TransformerConfig,
    mode: str = "tp",
    *,
    vocab_size: int,
    max_sequence_length: int,
    position_embedding_type: str = "learned_absolute",
    pre_process: Optional[bool] = None,
    post_process: Optional[bool] = None,
    parallel_output: bool = True,
    share_embeddings_and_output_weights: bool = False,
    vp_stage: Optional[int] = None,
    seq_length: Optional[int] = None,
) -> GPTModel:
    """A Megatron-Core ``GPTModel`` whose layers use the plugin's spec for ``mode``.

    ``vocab_size`` must be divisible by the TP size (Megatron-LM pads it with
    ``--make-vocab-size-divisible-by``; do the same before calling). ``pre_process`` /
    ``post_process`` (embedding / output layer on this rank) default to whether this rank is the
    first / last pipeline stage (both True without pipeline parallelism).

    Under ``metp`` a learned position table is sharded along positions over the ring
    (``metp.embedding``) when the training sequence fills it: ``seq_length`` (the tokens per
    sequence the model will see) equal to ``max_sequence_length``, or ``seq_length`` not given.
    Otherwise Megatron's replicated table is kept.
    """
    if pre_process is None:
        pre_process = mpu.is_pipeline_first_stage(ignore_virtual=False, vp_stage=vp_stage)
    if post_process is None:
        post_process = mpu.is_pipeline_last_stage(ignore_virtual=False, vp_stage=vp_stage)
    if position_embedding_type not in ("learned_absolute", "rope"):
        raise ValueError(
            "--position-embedding-type must be learned_absolute or rope, got "
            f"{position_embedding_type!r}"
        )
    tp = config.tensor_model_parallel_size
    if vocab_size % tp:
        raise ValueError(
            f"vocab size {vocab_size} is not divisible by --tensor-model-parallel-size {tp}: pad it "
            "(Megatron-LM: --make-vocab-size-divisible-by)"
        )
    spec = get_gpt_block_spec(config, mode, vp_stage=vp_stage)
    check_spec_importable(spec)
    model_cls, extra = GPTModel, {}
    if mode == "metp":  # the LM-head loss on the METP ring (no [s, V/p] logits)
        from megatron_metp.metp.gpt_model import MetpGPTModel as model_cls

        extra["shard_position_table"] = (position_embedding_type == "learned_absolute" and
                                         seq_length in (None, max_sequence_length))
    model = model_cls(
        config=config,
        transformer_layer_spec=spec,
        vocab_size=vocab_size,
        max_sequence_length=max_sequence_length,
        pre_process=pre_process,
        post_process=post_process,
        parallel_output=parallel_output,
        share_embeddings_and_output_weights=share_embeddings_and_output_weights,
        position_embedding_type=position_embedding_type,
        vp_stage=vp_stage,
        **extra,
    )
    if mode == "wallfacer":   # packed batches: cu_seqlens read once per forward, not per layer
        from megatron_metp.packing import read_at_each_forward

        read_at_each_forward(model)
    return model


def initialize_parallel(
    tensor_model_parallel_size: int = 1,
    pipeline_model_parallel_size: int = 1,
    context_parallel_size: int = 1,
    seed: int = 1234,
    *,
    mode: str = "tp",
    order: str = "tp-cp-ep-dp-pp",
    distributed_timeout_minutes: float = 30,
    wallfacer_team_size: Union[int, str] = 1,
    wallfacer_placement: Optional[str] = None,
    wallfacer_shape: Optional[dict] = None,
    gpus_per_node: Optional[int] = None,
) -> None:
    """Megatron's model-parallel groups, its RNG streams, and the plugin's groups.

    Requires ``torch.distributed`` to be initialised. Seeds as Megatron-LM's ``_set_random_seed``
    does: Python/torch generators with ``seed + 100 * pipeline_rank``, then Megatron's tracked
    streams (``model_parallel_cuda_manual_seed``; on CPU the tracker keeps CPU generator states,
    see ``cpu_compat``), then registers the METP ring (= the TP group) for every mode.

    ``mode`` is validated here. For ``wallfacer``, the teams and sub-rings are then carved from
    Megatron's context-parallel group (``megatron_metp.wallfacer.scheduler.initialize_wallfacer``)
    with ``wallfacer_team_size`` (C, or ``"auto"`` to profile ``wallfacer_shape`` =
    dict(b, s, n, n_kv, d) with the topology scheduler) and ``wallfacer_placement``.
    """
    if mode not in MODES:
        raise ValueError(f"unknown --tensor-parallel-mode {mode!r}: choose one of {', '.join(MODES)}")
    global _GROUPS_BEFORE
    world = torch.distributed.get_world_size()
    model_parallel = tensor_model_parallel_size * pipeline_model_parallel_size * context_parallel_size
    if world % model_parallel:
        raise ValueError(
            f"world size {world} is not a multiple of --tensor-model-parallel-size "
            f"{tensor_model_parallel_size} x --pipeline-model-parallel-size "
            f"{pipeline_model_parallel_size} x --context-parallel-size {context_parallel_size}"
        )
    if _GROUPS_BEFORE is None:  # a set-up over a live one: destroy_parallel ends both
        _GROUPS_BEFORE = metp_state.live_groups()
    try:
        _initialize(tensor_model_parallel_size, pipeline_model_parallel_size,
                    context_parallel_size, seed, mode, order, distributed_timeout_minutes,
                    wallfacer_team_size, wallfacer_placement, wallfacer_shape, gpus_per_node)
    except BaseException:
        destroy_parallel()  # a half-built set-up leaves no group behind
        raise


def release_ddp_hooks() -> int:
    """Break the reference cycle every Megatron-Core ``DistributedDataParallel`` forms through
    autograd, so that it, its model, buffers and optimizer (and the process groups they hold)
    are freed once the caller drops them. Returns how many DDP wrappers were released.

    DDP registers its gradient hook on each parameter's ``AccumulateGrad`` node and keeps the
    nodes in ``grad_accs``; the hook is a closure over the DDP object. The node is a C++ object
    that Python's garbage collector cannot traverse, so DDP -> grad_accs -> node -> hook -> DDP
    is never collected: every wrapper, its model, its buffers, the DistributedOptimizer built
    on it and every process group they reference stayed alive, and with them each gloo group's
    threads and sockets (about 48 threads and 22 sockets per run with the distributed
    optimizer). Dropping ``grad_accs`` frees the nodes (a parameter keeps only a weak
    reference to its node), so the rest is ordinary garbage. Called by
    :func:`destroy_parallel`, after which no wrapper can reduce gradients anyway (its groups
    are ended); it finds the wrappers among the garbage collector's objects (~0.1 s).
    """
    import gc
    import sys

    ddp_module = sys.modules.get("megatron.core.distributed.distributed_data_parallel")
    if ddp_module is None:   # never imported: no wrapper exists
        return 0
    cls = ddp_module.DistributedDataParallel
    released = 0
    for obj in gc.get_objects():
        # type() rather than isinstance(): a dead weakref proxy among the objects raises on
        # any attribute look-up, isinstance's __class__ included.
        if issubclass(type(obj), cls) and getattr(obj, "grad_accs", None):
            for node in obj.grad_accs:
                _clear_node_hooks(node)
            obj.grad_accs.clear()
            released += 1
    return released


def _clear_node_hooks(node) -> None:
    """Drop every Python hook of an autograd node. The node keeps them in a dict that only a
    hook handle reaches (``RemovableHandle.hooks_dict_ref``), so a no-op hook is registered to
    obtain the handle, and the dict is emptied."""
    handle = node.register_hook(_no_hook)
    hooks = handle.hooks_dict_ref()
    if hooks is not None:
        hooks.clear()


def _no_hook(*_args):
    return None


def destroy_parallel() -> int:
    """Undo :func:`initialize_parallel`: end every process group created since it began, then
    reset Megatron-Core's parallel state and the plugin's. Returns how many groups were ended.

    Megatron-Core's ``destroy_model_parallel`` only drops its references and the plugin's
    ``parallel_state.destroy`` only forgets its groups; neither ends a group, so each set-up
    would leave its gloo threads and sockets (or NCCL communicators and their GPU memory)
    behind. Here every group that Megatron, the plugin or WallFacer's scheduler created after
    ``initialize_parallel`` started is passed to ``torch.distributed.destroy_process_group``;
    groups that existed before (the world group, a caller's own) are left alone. The call is
    local to each rank and safe to repeat; without a live set-up it only resets the state.
    First it releases every Megatron DDP wrapper's autograd hooks (:func:`release_ddp_hooks`),
    without which the wrappers, their optimizers and the groups they hold never die.
    """
    global _GROUPS_BEFORE
    ended = 0
    release_ddp_hooks()
    if _GROUPS_BEFORE is not None:
        ended = metp_state.destroy_groups(metp_state.live_groups() - _GROUPS_BEFORE)
        _GROUPS_BEFORE = None
    mpu.destroy_model_parallel()
    metp_state.destroy()
    _drop_megatron_group_references()
    return ended


def _drop_megatron_group_references() -> None:
    """Drop the references to ended groups that Megatron-Core keeps past
    ``destroy_model_parallel``. A gloo group's threads and sockets (an NCCL communicator's
    memory) live until its last reference goes, not when ``destroy_process_group`` unregisters
    it, so each of these kept one group alive per set-up (3 threads a set-up in a long-lived
    process, or in ``metp train --compare``), and freed it whenever the reference happened to go:

    - ``RotaryEmbedding.forward`` (and YaRN's) is an ``lru_cache`` keyed by the module: its 32
      entries keep old models' rotary modules, and with them their ``cp_group``. Cleared: it
      holds only cos/sin tables, recomputed on the next call.
    - megatron-core 0.16.1's ``destroy_model_parallel`` leaves
      ``_INTRA_PARTIAL_DATA_PARALLEL_GROUP_WITH_CP`` and its ``_GLOO`` twin set (0.19 resets
      them). Each module-level name of ``megatron.core.parallel_state`` bound to a group, or
      to a list of groups, that is no longer registered is reset to None, as
      ``destroy_model_parallel`` resets the others.
    """
    import sys

    for module, cls in (("rotary_pos_embedding", "RotaryEmbedding"),
                        ("yarn_rotary_pos_embedding", "YarnRotaryEmbedding")):
        # A module never imported has no cache to clear.
        mod = sys.modules.get(f"megatron.core.models.common.embeddings.{module}")
        forward = getattr(getattr(mod, cls, None), "forward", None)
        if hasattr(forward, "cache_clear"):
            forward.cache_clear()
    if not torch.distributed.is_available():
        return
    from torch.distributed import distributed_c10d as c10d

    registered = set(c10d._world.pg_map)

    def ended(value) -> bool:
        return isinstance(value, torch.distributed.ProcessGroup) and value not in registered

    for name, value in list(vars(mpu).items()):
        if ended(value) or (isinstance(value, list) and value and all(map(ended, value))):
            setattr(mpu, name, None)


def _initialize(tensor_model_parallel_size, pipeline_model_parallel_size, context_parallel_size,
                seed, mode, order, distributed_timeout_minutes, wallfacer_team_size,
                wallfacer_placement, wallfacer_shape, gpus_per_node) -> None:
    mpu.initialize_model_parallel(
        tensor_model_parallel_size=tensor_model_parallel_size,
        pipeline_model_parallel_size=pipeline_model_parallel_size,
        context_parallel_size=context_parallel_size,
        order=order,
        create_gloo_process_groups=False,
        # Subgroups take their own timeout (new_group does not inherit the world group's), so
        # without this a dead rank would leave the others waiting 30 minutes in a TP/CP collective.
        distributed_timeout_minutes=distributed_timeout_minutes,
    )
    from megatron.core.tensor_parallel import model_parallel_cuda_manual_seed

    stage_seed = seed + 100 * mpu.get_pipeline_model_parallel_rank()
    random.seed(stage_seed)
    torch.manual_seed(stage_seed)
    model_parallel_cuda_manual_seed(stage_seed)
    from megatron.core.parallel_state import RankGenerator

    # Every TP group's ranks, as Megatron laid them out (no gather: the fake backend of the
    # planner has nothing to gather), for the METP weight groups.
    world = torch.distributed.get_world_size()
    tp, pp, cp = tensor_model_parallel_size, pipeline_model_parallel_size, context_parallel_size
    gen = RankGenerator(tp=tp, ep=1, dp=world // (tp * pp * cp), pp=pp, cp=cp, order=order)
    tp_lists = gen.get_ranks("tp")
    # Under CP, METP's K/V ring needs each rank's TP and CP rank (group ranks count in sorted
    # global order, as Megatron's own groups do) and its tensor-and-context ranks.
    layout = {}
    if cp > 1 and mode == "metp":
        for tcp in gen.get_ranks("tp-cp"):
            for g in tcp:
                layout[g] = [None, None, tuple(sorted(tcp))]
        for name, i in (("tp", 0), ("cp", 1)):
            for ranks in gen.get_ranks(name):
                for pos, g in enumerate(sorted(ranks)):
                    layout[g][i] = pos
    metp_state.initialize_metp(
        tp_rank_lists=tp_lists,
        timeout=datetime.timedelta(minutes=distributed_timeout_minutes),
        kv_ring=(mode == "metp"), rank_layout={g: tuple(v) for g, v in layout.items()} or None)
    if mode == "wallfacer":
        from megatron_metp.wallfacer.scheduler import initialize_wallfacer

        initialize_wallfacer(wallfacer_team_size, wallfacer_placement,
                             shape=wallfacer_shape, gpus_per_node=gpus_per_node,
                             timeout_minutes=distributed_timeout_minutes)
