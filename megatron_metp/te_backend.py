"""Which norm and linear classes a mode's layer spec takes: Transformer Engine's or the local ones.

``--transformer-impl transformer_engine`` (Megatron-LM's default) asks for TE's kernels. Where
TE is importable the specs take what of TE keeps each mode's semantics; where it is not, they
fall back to the local classes and :attr:`Backend.reason` says why (the Megatron-LM integration
logs it), so the default flag is never refused.

=============================  ====================  ===================  =====================
spec slot                      metp                  wallfacer, tp        why
=============================  ====================  ===================  =====================
input / pre-MLP / final norm   ``TENorm``            ``TENorm``           per-token, replicated
                                                                          weights tagged for SP,
                                                                          as the local ``Norm``
q / k layernorm                local ``Norm``        ``TENorm``           METP calls it inside its
                                                                          own autograd Function
linears (qkv, proj, fc1, fc2)  local                 ``TEColumn/Row-``    METP reads the weights
                                                     ``ParallelLinear``   and runs its own ring;
                                                                          WallFacer only replaces
                                                                          the core attention
=============================  ====================  ===================  =====================

TE's fused norm+linear (``TELayerNormColumnParallelLinear``) is not used: it renames the norm's
parameters (``linear_qkv.layer_norm_weight``); the specs keep ``input_layernorm`` as a module, with the
fused names only as checkpoint keys (``megatron_metp.checkpoint_keys``), which keeps the
modes' checkpoints interchangeable. The core attention stays the mode's own (METP's ring,
WallFacer's teams); TE's ``TEDotProductAttention`` would replace exactly what the mode is.
"""

from __future__ import annotations

import importlib
from dataclasses import dataclass
from typing import Optional, Tuple

from megatron.core.tensor_parallel.layers import ColumnParallelLinear, RowParallelLinear

from megatron_metp.layers import Norm

TE_IMPL = "transformer_engine"
# Megatron-Core's TE wrappers, with the local spec's constructor signatures.
_TE_EXTENSION = "megatron.core.extensions.transformer_engine"


@dataclass(frozen=True)
class Backend:
    """The classes a layer spec takes for one mode (see the module docstring)."""

    name: str                # "transformer_engine" or "local"
    norm: type               # input_layernorm, pre_mlp_layernorm, the block's final norm
    qk_norm: type            # q_layernorm / k_layernorm when --qk-layernorm
    column_linear: type      # linear_qkv, linear_fc1 of Megatron's own SelfAttention / MLP
    row_linear: type         # linear_proj, linear_fc2 of the same
    reason: str = ""         # why "local" when TE was asked for; empty otherwise


LOCAL = Backend("local", Norm, Norm, ColumnParallelLinear, RowParallelLinear)


def transformer_engine_classes() -> Tuple[Optional[object], str]:
    """``(Megatron-Core's TE extension module, "")`` when Transformer Engine is importable, else
    ``(None, why)``. Megatron-Core's extension imports even without TE (``HAVE_TE = False``),
    so both are checked."""
    try:
        importlib.import_module("transformer_engine")
    except ImportError as e:
        return None, f"Transformer Engine is not importable ({e})"
    try:
        ext = importlib.import_module(_TE_EXTENSION)
    except ImportError as e:
        return None, f"{_TE_EXTENSION} does not import ({e})"
    if not getattr(ext, "HAVE_TE", False):
        return None, f"{_TE_EXTENSION} found no usable Transformer Engine (HAVE_TE is False)"
    return ext, ""


def backend_for(config, mode: str) -> Backend:
    """The backend for ``mode`` under ``config.transformer_impl`` (TE where asked and importable)."""
    impl = getattr(config, "transformer_impl", "local")
    if impl != TE_IMPL:
        return LOCAL
    ext, why = transformer_engine_classes()
    if ext is None:
        return Backend("local", Norm, Norm, ColumnParallelLinear, RowParallelLinear,
                       reason=f"--transformer-impl {TE_IMPL}: {why}; the {mode} spec uses the "
                              f"plugin's local norm and Megatron's local linears instead")
    if mode in ("metp", "metp_mlp"):
        return Backend(TE_IMPL, ext.TENorm, Norm, ColumnParallelLinear, RowParallelLinear)
    return Backend(TE_IMPL, ext.TENorm, ext.TENorm, ext.TEColumnParallelLinear,
                   ext.TERowParallelLinear)
