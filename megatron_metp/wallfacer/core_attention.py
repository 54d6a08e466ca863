"""``WallFacerCoreAttention``: WallFacer as Megatron-Core's ``core_attention`` submodule."""

from __future__ import annotations

import inspect
import math
from typing import Optional

import torch
from megatron.core.transformer.attention import SelfAttention
from megatron.core.transformer.enums import AttnMaskType
from megatron.core.transformer.module import MegatronModule
from megatron.core.transformer.transformer_config import TransformerConfig

from megatron_metp.packing import (_SEQLEN_FIELDS, CPDocumentLayout, PackedLayout, check_tokens,
                                   host_max_seqlen)
from megatron_metp.packing import _values as packed_values
from megatron_metp.wallfacer.attention import wallfacer_attention
from megatron_metp.wallfacer.groups import WallFacerGroups


class WallFacerCoreAttention(MegatronModule):
    """Megatron core attention over the context-parallel group with WallFacer's multi-ring.

    Same constructor and ``forward`` as Megatron's ``DotProductAttention``; used as
    ``core_attention`` inside ``SelfAttention`` (``wallfacer_layer_spec``), so ``linear_qkv``,
    ``linear_proj`` and every parameter name and shape are those of the ``tp`` model::

        query        [s/P, b, np, hn]    this rank's zigzag tokens (np = heads per TP rank)
        key, value   [s/P, b, ng, hn]    GQA: ng query groups (K/V travel with ng heads)
        returns      [s/P, b, np * hn]

    The groups are a constructor argument, ``wallfacer_groups`` (the layer spec passes those
    ``initialize_wallfacer`` built, ``megatron_metp.specs``), handed on to the autograd
    Function; nothing here reads global state. Tensor parallelism composes: each TP
    rank runs WallFacer on its own heads over its own CP group (tested: TP = 2 + SP x CP = 4).
    ``causal`` uses the chunk-pair causal mask (an explicit ``attention_mask`` is ignored, as
    Transformer Engine's CP path does); ``no_mask`` is full attention (DiT-style); other mask
    types are refused.
    """

    def __init__(self, config: TransformerConfig, layer_number: int,
                 attn_mask_type: AttnMaskType, attention_type: str,
                 attention_dropout: Optional[float] = None,
                 softmax_scale: Optional[float] = None, cp_comm_type: Optional[str] = None,
                 pg_collection=None, wallfacer_groups: Optional[WallFacerGroups] = None):
        super().__init__(config=config)
        if wallfacer_groups is None:
            raise ValueError(
                "WallFacerCoreAttention needs its wallfacer_groups: call initialize_wallfacer "
                "(megatron_metp.wallfacer.scheduler) before building the layer spec "
                "(megatron_metp.specs.get_gpt_layer_spec('wallfacer'))")
        self.plan: WallFacerGroups = wallfacer_groups
        if config.context_parallel_size != self.plan.cp_size:
            raise ValueError(
                f"--context-parallel-size {config.context_parallel_size} differs from the "
                f"WallFacer groups' P = {self.plan.cp_size}: call initialize_wallfacer after "
                f"initialize_model_parallel with the same context-parallel size"
            )
        if cp_comm_type not in (None, "wallfacer") and config.context_parallel_size > 1:
            raise ValueError(
                f"--cp-comm-type {cp_comm_type!r} conflicts with the WallFacer core attention: "
                f"use --cp-comm-type wallfacer (or --tensor-parallel-mode wallfacer)")
        dropout = config.attention_dropout if attention_dropout is None else attention_dropout
        if dropout > 0:
            raise ValueError(
                f"--attention-dropout {dropout}: WallFacer attention has no attention dropout; "
                f"set --attention-dropout 0")
        if config.softmax_type != "vanilla" or config.window_size is not None:
            raise ValueError("WallFacer attention supports --softmax-type vanilla and no "
                             "--window-size")
        self.layer_number = max(1, layer_number)
        self.attn_mask_type = attn_mask_type
        self.attention_type = attention_type
        # apply_query_key_layer_scaling divides scores by layer_number and the softmax
        # multiplies back: the effective scale is 1/sqrt(kv_channels) unless given.
        self.softmax_scale = (softmax_scale if softmax_scale is not None
                              else 1.0 / math.sqrt(config.kv_channels))

    def forward(self, query, key, value, attention_mask, attn_mask_type=None,
                attention_bias=None, packed_seq_params=None):
        if attention_bias is not None:
            raise ValueError("WallFacer attention does not support an attention bias")
        mask_type = attn_mask_type if attn_mask_type is not None else self.attn_mask_type
        if mask_type not in (AttnMaskType.causal, AttnMaskType.no_mask):
            raise ValueError(f"WallFacer attention supports the causal and no_mask attention "
                             f"mask types, not {mask_type}")
        causal = mask_type == AttnMaskType.causal
        if not causal and attention_mask is not None:
            raise ValueError("WallFacer attention cannot apply an arbitrary attention_mask; use "
                             "a causal or no_mask attention mask type")
        layout = order = None
        if packed_seq_params is not None:
            query, key, value = self._packed_inputs(packed_seq_params, query, key, value)
            if packed_seq_params.qkv_format == "thd" and self.plan.cp_size > 1:
                layout = CPDocumentLayout.from_packed_seq_params(packed_seq_params,
                                                                 self.plan.cp_size)
                check_tokens(layout, query.shape[0], "this context-parallel rank")
                # Megatron-LM's THD split, document by document -> WallFacer's two chunks.
                order = layout.chunk_major_index(query.device)
                query, key, value = (t.index_select(0, order) for t in (query, key, value))
            else:
                layout = PackedLayout.from_packed_seq_params(
                    packed_seq_params, total=query.shape[0] * self.plan.cp_size)
        sq, b, np_, hn = query.shape
        out = wallfacer_attention(query, key, value, self.plan, causal=causal,
                                  softmax_scale=self.softmax_scale, layout=layout)
        if order is not None:
            out = torch.empty_like(out).index_copy_(0, order, out)   # back to the THD order
        if packed_seq_params is not None and packed_seq_params.qkv_format == "thd":
            return out.reshape(sq, np_ * hn)   # Megatron's THD output [t, h]
        return out.reshape(sq, b, np_ * hn)

    def check_packed(self, params, tokens: int) -> None:
        """Refuse a packed batch whose offsets do not fit this rank's ``tokens`` (before any
        communication; the layout is cached on ``params`` for :meth:`forward`). For THD, also
        a ``max_seqlen_q`` shorter than a document: Megatron sizes the rotary table from it, so
        the ranks would apply a table too short (raw size errors on some ranks, a one-row table
        on others, and collectives that pair up wrong). The check reads only
        values every rank shares, so every rank refuses alike."""
        if params.qkv_format == "thd" and getattr(params, "max_seqlen_q", None) is not None:
            field = ("cu_seqlens_q_padded" if getattr(params, "cu_seqlens_q_padded", None)
                     is not None else "cu_seqlens_q")
            cu = packed_values(params)[_SEQLEN_FIELDS.index(field)]
            longest = max((b - a for a, b in zip(cu, cu[1:])), default=0)
            max_seqlen = host_max_seqlen(params)
            if max_seqlen < longest:
                raise ValueError(
                    f"PackedSeqParams.max_seqlen_q {max_seqlen} is shorter than "
                    f"the longest document ({longest} tokens, from {field}): Megatron sizes the "
                    f"rotary table from it; set max_seqlen_q to at least {longest}")
        if params.qkv_format == "thd" and self.plan.cp_size > 1:
            layout = CPDocumentLayout.from_packed_seq_params(params, self.plan.cp_size)
            check_tokens(layout, tokens, "this context-parallel rank")
        else:
            PackedLayout.from_packed_seq_params(params, total=tokens * self.plan.cp_size)

    def _packed_inputs(self, params, query, key, value):
        """Packed documents (Megatron's ``PackedSeqParams``, b = 1), in one of two layouts:

        * ``thd`` (Megatron-LM's ``--sft`` batches): each document split over the CP ranks by
          ``get_thd_batch_on_this_cp_rank`` (Transformer Engine's partitioning: chunks r and
          2 CP - 1 - r of every document), the split Megatron's THD RoPE assumes too
          (``packing.CPDocumentLayout``); inputs arrive as ``[t, n, d]`` (Megatron's attention
          squeezes b);
        * ``sbhd``: the packed sequence split like any sequence, zigzag over the CP ranks, and
          ``cu_seqlens`` positions in it (``packing.PackedLayout``); RoPE then runs along the
          whole sequence, which changes no score inside a document (rotary scores depend
          only on the distance between tokens). Megatron sizes the rotary table from
          ``max_seqlen_q`` when packed parameters are given: set it to the sequence length."""
        if params.qkv_format == "thd":
            if self.plan.cp_size > 1 and self.plan.layout != "zigzag":
                raise ValueError(
                    f"WallFacer attention: THD batches under CP come in Megatron-LM's split "
                    f"(chunks r and 2CP-1-r of each document), which needs the zigzag token "
                    f"layout, not {self.plan.layout!r}")
            query, key, value = (t.unsqueeze(1) if t.dim() == 3 else t
                                 for t in (query, key, value))
        elif params.qkv_format != "sbhd":
            raise ValueError(f"WallFacer attention: packed qkv_format {params.qkv_format!r}; "
                             f"use 'thd' or 'sbhd'")
        if query.shape[1] != 1:
            raise ValueError("WallFacer attention: packed sequences take one packed sequence "
                             f"per micro batch (b = 1), got b = {query.shape[1]}")
        return query, key, value


class WallFacerSelfAttention(SelfAttention):
    """Megatron's ``SelfAttention`` (same constructor, parameters and checkpoint keys) that
    checks a packed batch before anything runs: Megatron applies its THD RoPE to the
    ``cu_seqlens`` splits before the core attention is reached, so offsets that decrease or
    cover another number of tokens must be refused here, with one line, before RoPE and before
    any communication (:meth:`WallFacerCoreAttention.check_packed`)."""

    def forward(self, hidden_states, *args, **kwargs):
        params = kwargs.get("packed_seq_params")
        if params is None and args:
            bound = inspect.signature(SelfAttention.forward).bind_partial(
                self, hidden_states, *args, **kwargs)
            params = bound.arguments.get("packed_seq_params")
        if params is not None and isinstance(self.core_attention, WallFacerCoreAttention):
            # The core attention sees this rank's tokens after linear_qkv's sequence-parallel
            # all-gather (TP > 1 inside each CP rank): count those.
            sp = self.config.tensor_model_parallel_size if self.config.sequence_parallel else 1
            self.core_attention.check_packed(params, hidden_states.shape[0] * sp)
        return super().forward(hidden_states, *args, **kwargs)

