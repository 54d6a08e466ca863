"""``UlyssesCoreAttention``: a2a context parallelism as Megatron-Core's ``core_attention``."""

from __future__ import annotations

import math
from typing import Optional

from megatron.core.transformer.enums import AttnMaskType
from megatron.core.transformer.module import MegatronModule
from megatron.core.transformer.transformer_config import TransformerConfig

from megatron_metp.ulysses.attention import check_heads, ulysses_attention


class UlyssesCoreAttention(MegatronModule):
    """Megatron core attention over the context-parallel group with ``--cp-comm-type a2a``
    (``ulysses.attention``): the planner's stand-in for Transformer Engine's a2a CP attention.

    Same constructor and ``forward`` as Megatron's ``DotProductAttention``; used as
    ``core_attention`` inside Megatron's own ``SelfAttention``, so the linears, norms and
    sequence parallelism around it are stock's::

        query        [s/cp, b, np, hn]   this CP rank's tokens (Megatron's CP order)
        key, value   [s/cp, b, ng, hn]
        returns      [s/cp, b, np * hn]

    The CP group is a constructor argument, ``cp_group``; nothing here reads global state.
    Causal and no_mask only, no packed batches, no dropout: what the planner needs.
    """

    def __init__(self, config: TransformerConfig, layer_number: int,
                 attn_mask_type: AttnMaskType, attention_type: str,
                 attention_dropout: Optional[float] = None,
                 softmax_scale: Optional[float] = None, cp_comm_type: Optional[str] = None,
                 pg_collection=None, cp_group=None):
        super().__init__(config=config)
        if cp_group is None:
            raise ValueError("UlyssesCoreAttention needs its cp_group (Megatron's "
                             "context-parallel group)")
        if cp_comm_type not in (None, "a2a"):
            raise ValueError(f"--cp-comm-type {cp_comm_type!r}: UlyssesCoreAttention is a2a")
        dropout = config.attention_dropout if attention_dropout is None else attention_dropout
        if dropout > 0:
            raise ValueError(f"--attention-dropout {dropout}: the a2a stand-in has no attention "
                             f"dropout; set --attention-dropout 0")
        tp = config.tensor_model_parallel_size
        check_heads(config.num_attention_heads // tp,
                    (config.num_query_groups or config.num_attention_heads) // tp,
                    config.context_parallel_size)
        self.cp_group = cp_group
        self.attn_mask_type = attn_mask_type
        self.softmax_scale = (softmax_scale if softmax_scale is not None
                              else 1.0 / math.sqrt(config.kv_channels))

    def forward(self, query, key, value, attention_mask, attn_mask_type=None,
                attention_bias=None, packed_seq_params=None):
        mask_type = attn_mask_type if attn_mask_type is not None else self.attn_mask_type
        if attention_bias is not None or packed_seq_params is not None:
            raise ValueError("the a2a stand-in takes no attention bias and no packed batch")
        if mask_type not in (AttnMaskType.causal, AttnMaskType.no_mask):
            raise ValueError(f"the a2a stand-in supports causal and no_mask, not {mask_type}")
        sq, b, np_, hn = query.shape
        # Megatron hands [s, b, heads, d]; the kernels take [b, heads, s, d] (done inside).
        out = ulysses_attention(query, key, value, self.cp_group,
                                causal=mask_type == AttnMaskType.causal,
                                softmax_scale=self.softmax_scale)
        return out.reshape(sq, b, np_ * hn)
