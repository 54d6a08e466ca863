"""Megatron-Core GPT layer specs, one per ``--tensor-parallel-mode``.

Module-level ``ModuleSpec`` objects, so Megatron-LM can take them from the command line
(``--spec megatron_metp.specs metp_layer_spec`` imports the object; it does not call it):

=====================  ===========================================  ===========================
name                   MLP                                          self-attention
=====================  ===========================================  ===========================
``tp_layer_spec``       Megatron ``MLP`` (TP+SP)                     Megatron ``SelfAttention``
                                                                     + ``SDPACoreAttention``
``metp_layer_spec``     ``MetpMLP`` (weight ring, Alg. 1-2)          ``MetpSelfAttention``
                                                                     (Alg. 3-6)
``metp_mlp_layer_spec`` ``MetpMLP``                                  as ``tp``
``wallfacer_layer_spec`` as ``tp``                                   ``SelfAttention`` +
                                                                     ``WallFacerCoreAttention``
=====================  ===========================================  ===========================

The ``metp`` layer is ``MetpTransformerLayer`` (``megatron_metp.metp.layer_schedule``):
Megatron's ``TransformerLayer`` whose two sublayers post their weight traffic behind each
other's compute; the other modes use Megatron's ``TransformerLayer``.

The module-level specs use Megatron's local ``ColumnParallelLinear`` / ``RowParallelLinear`` for
the linears, so parameter names, shapes and ``sharded_state_dict`` keys are those of the ``tp``
model and checkpoints move between modes. :func:`get_gpt_block_spec` follows
``config.transformer_impl``: with ``transformer_engine`` (Megatron-LM's default) and Transformer
Engine importable it takes TE's norms (and, outside METP's own MLP and attention, TE's linears);
otherwise the local classes (``megatron_metp.te_backend`` has the table and the reasons). The
norm (``megatron_metp.layers.Norm``) reads ``config.normalization`` when it is built, so one spec serves GPT (LayerNorm, GeLU, learned or
rotary positions) and LLaMA-style (RMSNorm, SwiGLU, RoPE, GQA) configs; the activation, gating,
bias and GQA choices all come from the ``TransformerConfig``.

Final norm: with ``--spec megatron_metp.specs <name>`` Megatron wraps the layer spec in a block
whose final norm is its own ``LayerNormImpl`` (TE's or apex's norm where installed, as on a GPU
cluster; else ``WrappedTorchNorm``, which refuses sequence parallelism). The plugin's builders use
:func:`get_gpt_block_spec`, which pins the SP-aware ``Norm`` there too.

The METP and WallFacer classes are named lazily, ``("module.path", "ClassName")``, so this file
imports without them; they are imported when a model is built.

On CUDA: the ``tp`` spec here is the *local* (pure PyTorch / Megatron-Core) one, which is what
the METP/WallFacer modes are compared against. Megatron-LM's stock GPU choice is the Transformer
Engine spec (``get_gpt_layer_with_transformer_engine_spec``, the default of ``pretrain_gpt.py``;
``--transformer-impl local`` selects Megatron's local spec instead). A user who wants TE kernels
for the ``tp`` mode keeps Megatron's own spec (``--tensor-parallel-mode tp`` falls through to
Megatron's builder in the Megatron-LM integration); ``tp_layer_spec`` is the CPU-capable
reference with identical parameter names. Checkpoint keys are Megatron-LM's (its local spec's
``sharded_state_dict_keys_map``, the names TE's fused ``linear_qkv.layer_norm_weight`` has), so
a checkpoint of ``pretrain_gpt.py``'s stock spec, local or TE, loads under every mode here
(``megatron_metp.checkpoint_keys``).
"""

from __future__ import annotations

import importlib
from typing import Optional, Tuple, Union

from megatron.core.fusions.fused_bias_dropout import get_bias_dropout_add
from megatron.core.transformer.attention import SelfAttention, SelfAttentionSubmodules
from megatron.core.transformer.enums import AttnMaskType
from megatron.core.transformer.identity_op import IdentityOp
from megatron.core.transformer.mlp import MLP, MLPSubmodules
from megatron.core.transformer.spec_utils import ModuleSpec
from megatron.core.transformer.transformer_block import (
    TransformerBlockSubmodules,
    get_num_layers_to_build,
)
from megatron.core.transformer.transformer_layer import (
    TransformerLayer,
    TransformerLayerSubmodules,
)

from megatron_metp.checkpoint_keys import NORM_KEYS_MAP
from megatron_metp.metp.layer_schedule import MetpTransformerLayer
from megatron_metp.layers import SDPACoreAttention
from megatron_metp.te_backend import LOCAL, Backend, backend_for

MODES = ("tp", "metp", "metp_mlp", "wallfacer")

# Classes owned by other parts of the plugin, imported when a model is built.
METP_MLP = ("megatron_metp.metp.mlp", "MetpMLP")
METP_SELF_ATTENTION = ("megatron_metp.metp.attention", "MetpSelfAttention")
# Megatron's TransformerLayer whose METP attention and gathered MLP schedule their weight
# traffic together; same parameters and keys. A class, not a lazy name: Megatron's block
# builder calls issubclass() on a layer spec's module (it needs only torch and Megatron).
METP_TRANSFORMER_LAYER = MetpTransformerLayer
WALLFACER_CORE_ATTENTION = ("megatron_metp.wallfacer.core_attention", "WallFacerCoreAttention")
# Megatron's SelfAttention with a packed-batch check before its THD RoPE (same parameters).
WALLFACER_SELF_ATTENTION = ("megatron_metp.wallfacer.core_attention", "WallFacerSelfAttention")
# Stock TP x CP with --cp-comm-type a2a, as the planner runs it on CPU (megatron_metp.ulysses).
ULYSSES_CORE_ATTENTION = ("megatron_metp.ulysses.core_attention", "UlyssesCoreAttention")

_Module = Union[type, Tuple[str, str]]


def _mlp(module: _Module, backend: Backend) -> ModuleSpec:
    # fc1 by columns (the SwiGLU halves interleaved per shard, as Megatron's MLP does), fc2 by rows.
    return ModuleSpec(
        module=module,
        submodules=MLPSubmodules(linear_fc1=backend.column_linear,
                                 linear_fc2=backend.row_linear),
    )


def _self_attention(module: _Module, core_attention: _Module, qk_layernorm: bool,
                    backend: Backend, core_params: Optional[dict] = None) -> ModuleSpec:
    qk_norm = backend.qk_norm if qk_layernorm else IdentityOp
    core = (core_attention if isinstance(core_attention, type)
            else ModuleSpec(module=core_attention, params=core_params or {}))
    return ModuleSpec(
        module=module,
        params={"attn_mask_type": AttnMaskType.causal},
        submodules=SelfAttentionSubmodules(
            linear_qkv=backend.column_linear,
            core_attention=core,
            linear_proj=backend.row_linear,
            q_layernorm=qk_norm,
            k_layernorm=qk_norm,
        ),
    )


def _layer(mlp: ModuleSpec, self_attention: ModuleSpec, backend: Backend,
           layer: _Module = TransformerLayer) -> ModuleSpec:
    return ModuleSpec(
        module=layer,
        submodules=TransformerLayerSubmodules(
            input_layernorm=backend.norm,
            self_attention=self_attention,
            self_attn_bda=get_bias_dropout_add,
            pre_mlp_layernorm=backend.norm,
            mlp=mlp,
            mlp_bda=get_bias_dropout_add,
            # Checkpoint keys as Megatron-LM's local and TE GPT specs write them
            # (megatron_metp.checkpoint_keys): checkpoints move between pretrain_gpt.py's
            # stock spec and every mode here.
            sharded_state_dict_keys_map=dict(NORM_KEYS_MAP),
        ),
    )


def get_gpt_layer_spec(mode: str, *, qk_layernorm: bool = False,
                       backend: Backend = LOCAL, wallfacer_groups=None,
                       cp_a2a_group=None) -> ModuleSpec:
    """A fresh ``TransformerLayer`` spec for ``mode`` in ``MODES`` (see the module docstring).

    ``qk_layernorm`` adds Megatron's per-head query/key norm (``--qk-layernorm``), of the type
    ``config.normalization`` names. ``backend`` (``megatron_metp.te_backend``) supplies the norm
    and linear classes: the local ones by default, Transformer Engine's where a config asks.
    ``wallfacer_groups`` (``wallfacer`` mode) go to ``WallFacerCoreAttention``'s constructor;
    by default the ones ``initialize_wallfacer`` registered, if it has run. ``cp_a2a_group``
    (``tp`` mode): Megatron's context-parallel group, for stock TP x CP with ``--cp-comm-type
    a2a`` whose core attention is the CPU stand-in ``UlyssesCoreAttention``.
    """
    if mode not in MODES:
        raise ValueError(
            f"unknown --tensor-parallel-mode {mode!r}: choose one of {', '.join(MODES)}"
        )
    mlp_module = METP_MLP if mode in ("metp", "metp_mlp") else MLP
    attn_module = (METP_SELF_ATTENTION if mode == "metp" else
                   WALLFACER_SELF_ATTENTION if mode == "wallfacer" else SelfAttention)
    core = WALLFACER_CORE_ATTENTION if mode == "wallfacer" else SDPACoreAttention
    core_params = None
    if cp_a2a_group is not None and mode != "tp":
        raise ValueError(f"cp_a2a_group is stock tp's a2a context parallelism, not {mode}'s")
    if mode == "wallfacer":
        from megatron_metp import parallel_state as ps

        if wallfacer_groups is None and ps.wallfacer_is_initialized():
            wallfacer_groups = ps.get_wallfacer_groups()
        core_params = {"wallfacer_groups": wallfacer_groups}
    elif cp_a2a_group is not None:
        core, core_params = ULYSSES_CORE_ATTENTION, {"cp_group": cp_a2a_group}
    return _layer(_mlp(mlp_module, backend),
                  _self_attention(attn_module, core, qk_layernorm, backend, core_params), backend,
                  METP_TRANSFORMER_LAYER if mode == "metp" else TransformerLayer)


def get_gpt_block_spec(config, mode: str, *, vp_stage=None) -> TransformerBlockSubmodules:
    """The decoder-block spec: this stage's layers of ``mode`` plus a final norm.

    Passing a bare layer spec to ``GPTModel`` makes Megatron pick the final norm itself
    (``LayerNormImpl``: TE's or apex's norm when installed, else ``WrappedTorchNorm``, which
    refuses sequence parallelism); the block spec pins the backend's SP-aware norm instead.
    The backend follows ``config.transformer_impl`` (``megatron_metp.te_backend.backend_for``).
    """
    backend = backend_for(config, mode)
    layer = get_gpt_layer_spec(mode, qk_layernorm=bool(config.qk_layernorm), backend=backend)
    num_layers = get_num_layers_to_build(config, vp_stage=vp_stage)
    return TransformerBlockSubmodules(layer_specs=[layer] * num_layers, layer_norm=backend.norm)


def check_spec_importable(spec: ModuleSpec) -> None:
    """Import every lazily named class in a layer spec; fail with a clear message if one is missing.

    Megatron's ``import_module`` logs an ImportError and returns None, which surfaces later as
    "'NoneType' object is not callable"; call this before building a model to fail early.
    """
    pending = [spec]
    while pending:
        s = pending.pop()
        if isinstance(s, ModuleSpec):
            if isinstance(s.module, tuple):
                path, name = s.module
                try:
                    getattr(importlib.import_module(path), name)
                except (ImportError, AttributeError) as e:
                    raise ImportError(
                        f"layer spec names {path}.{name}, which cannot be imported ({e}); this "
                        f"--tensor-parallel-mode is not available in this installation"
                    ) from e
            pending.append(s.submodules)
        elif isinstance(s, list):
            pending.extend({id(x): x for x in s}.values())
        elif s is not None and hasattr(s, "__dataclass_fields__"):
            pending.extend(getattr(s, f) for f in s.__dataclass_fields__)


tp_layer_spec = get_gpt_layer_spec("tp")
metp_layer_spec = get_gpt_layer_spec("metp")
metp_mlp_layer_spec = get_gpt_layer_spec("metp_mlp")
wallfacer_layer_spec = get_gpt_layer_spec("wallfacer")
