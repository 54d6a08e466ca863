"""METP's two-level multi-head attention (paper Alg. 5-6) as a Megatron ``SelfAttention``.

``MetpSelfAttention`` has ``SelfAttention``'s constructor, submodules and parameters: rank j of
the METP ring (= Megatron's tensor-model-parallel group) stores exactly TP rank j's shards, so
names, shapes and ``sharded_state_dict`` keys are the ``tp`` model's. Only the forward differs.
This module holds the module; each ring pass is a file of its own (``metp.head_group_pass``: one
pass per head group, below; ``metp.whole_pass``: every head group in one pass), and the options
and plan they share are ``metp.attention_plan``::

    x_shard_s      [s/p, b, h]             this rank's tokens (sequence-parallel layout)
    w_qkv_j        [ng/p * (n/ng + 2) * d, h]   head group j's linear_qkv shard (rank j's),
                                            Megatron's per-group interleaved layout
                                            (q_1..q_{n/ng}, k, v for each query group)
    b_qkv_j        [ng/p * (n/ng + 2) * d]  its bias (if --add-bias-linear / --add-qkv-bias)
    w_proj_j       [h, n/p * d]             head group j's linear_proj shard (rank j's)
    out_shard_s    [s/p, b, h]             sum_j A_ij w_proj_j^T, bias returned apart (as
                                            RowParallelLinear with skip_bias_add does)

Forward on rank i (Alg. 5; its line 1 means W_qkv_i of shape h x 3h/p):

    for j in 0..p-1:
        broadcast (w_qkv_j, b_qkv_j, w_proj_j) from rank j   <- posted one step ahead (prefetch)
        q_ij, k_ij, v_ij = split(x_shard_s w_qkv_j^T + b_qkv_j)  [+ q/k norm, RoPE at the
                                                                   tokens' global positions]
        A_ij, L_ij = ring attention over the METP ring (Alg. 3; K/V of head group j travel)
        out_shard_s += A_ij w_proj_j^T

Long inputs run each head group's ring in slices of whole query groups (``head_chunks``): the
same bytes in more, smaller messages, and a fraction of the ring backward's fp32 accumulators.

Backward (Alg. 6; its lines 9-10 mean W_qkv_j): the weights are broadcast again (prefetched),
Q/K/V recomputed from the saved x, the ring backward (Alg. 4) run, and dW_qkv_j / dW_proj_j
reduced to rank j asynchronously while the next head group computes. Saved between the passes:
x_shard_s (owned by the caller anyway), A_ij for every j (together b s/p h) and the lse: the
paper's 2bsh/p.

Communication per rank (payload, each broadcast or reduce counted once): forward 4h^2 of
weights + 2(p-1)/p bsh of K/V; backward 8h^2 + 4(p-1)/p bsh (MHA, no bias; GQA replaces 3h^2 by
h(h + 2 ng d) and 2bsh by 2bs ng d).

With Megatron's context parallelism (CP > 1; METP on the TP group inside a node, CP across
nodes): the CP split comes first (Megatron's load-balanced layout, CP rank c holds chunks c and
2CP-1-c of 2CP), then the CP rank's tokens are split contiguously over its TP ranks, so with an
even TP size every rank holds one block of s/(TP CP) consecutive tokens. The outer level is
unchanged (weights broadcast and reduced over the TP ranks); the K/V ring runs over METP's K/V
ring (``megatron_metp.parallel_state.metp_kv_ring``: the TP x CP ranks of this sequence, a group
of its own) and decides the causal block rule from each block's place in the sequence. RoPE
frequencies arrive for the CP rank's tokens (Megatron's ``RotaryEmbedding`` takes the CP rank's
chunks); this rank's are its contiguous TP slice of them. Weight gradients are partial over the
CP rank's tokens and summed over DP x CP by Megatron's DDP, as for every other parameter.
``MetpGPTModel`` balances the TP x CP ring on top of that split (``token_layout``: TP rank t of
CP rank c then holds global chunks i and 2P-1-i of 2P, i = c TP + t), and on Megatron-LM's THD
batches per document (``packing.CPBalancedDocLayout``).
"""
from __future__ import annotations

import math
from typing import Optional

import torch
import torch.distributed as dist
from megatron.core.transformer.attention import SelfAttention, SelfAttentionSubmodules
from megatron.core.transformer.enums import AttnMaskType
from megatron.core.transformer.identity_op import IdentityOp
from megatron.core.transformer.transformer_config import TransformerConfig

# The options and the plan (their public home stays this module: ``metp.attention.RING_PASSES``
# etc.), and the two ring passes, one file each.
from megatron_metp.metp.attention_plan import (
    ATTN_MIN_TOKENS, KEEPS_FC1, KEEPS_WEIGHTS, QKV_BACKWARD, RING_PASSES,
    WHOLE_MAX_TOKENS, _Plan, check_metp_attention_config, check_qkv_backward, check_ring_pass,
    head_chunks, whole_pass)
from megatron_metp.metp.head_group_pass import _MetpMHAFunction
from megatron_metp.metp.weight_hooks import run_pre_hooks
from megatron_metp.metp.whole_pass import _MetpWholeFunction
from megatron_metp.packing import (CPBlockLayout, PackedLayout, balanced_packed_layout,
                                   cp_balanced_packed_layout,
                                   check_tokens, longest_document)
from megatron_metp.token_layout import can_balance

__all__ = ["ATTN_MIN_TOKENS", "QKV_BACKWARD", "RING_PASSES", "WHOLE_MAX_TOKENS",
           "MetpSelfAttention", "check_metp_attention_config", "check_qkv_backward",
           "check_ring_pass", "head_chunks", "packed_ring_layout", "set_balanced_layout",
           "set_qkv_backward", "set_ring_pass", "whole_pass"]


def packed_ring_layout(params, tp: int, cp: int, s_shard: int, balanced: bool = False):
    """The ring's document layout of a packed batch whose ``s_shard`` tokens per rank are laid
    out over ``tp`` x ``cp`` ranks (cached on ``params``): one rule for ``MetpGPTModel``, which
    checks it at entry, and ``MetpSelfAttention``, which runs it. Under CP: Megatron-LM's THD
    split (each document's chunks c and 2CP-1-c on CP rank c), then METP's contiguous TP
    blocks of that rank's tokens, or with ``balanced`` (the model chose it) every document's
    global chunks i and 2P-1-i of 2P (``packing.CPBalancedDocLayout``); without CP: the balanced
    per-document split when the model chose it, else contiguous shards of the packed
    sequence."""
    if cp > 1:
        if getattr(params, "qkv_format", "thd") != "thd":
            raise ValueError("MetpSelfAttention: packed sequences under context "
                             "parallelism come as Megatron-LM's THD batches "
                             "(qkv_format 'thd', get_thd_batch_on_this_cp_rank)")
        layout = (cp_balanced_packed_layout(params, tp, cp, s_shard * tp) if balanced else None) \
            or CPBlockLayout.from_packed_seq_params(params, tp, cp)
        check_tokens(layout, s_shard, "a METP rank's block")
        return layout
    if balanced:
        return balanced_packed_layout(params, tp, s_shard * tp)
    return PackedLayout.from_packed_seq_params(params, total=s_shard * tp)


def set_ring_pass(module: torch.nn.Module, ring_pass: str) -> None:
    """Set how many head groups one ring pass takes (``RING_PASSES``) on every
    ``MetpSelfAttention`` in ``module``."""
    check_ring_pass(ring_pass)
    for m in module.modules():
        if isinstance(m, MetpSelfAttention):
            m.ring_pass = ring_pass


def set_qkv_backward(module: torch.nn.Module, value: str) -> None:
    """Set what the one-pass backward does for Q/K/V (``QKV_BACKWARD``) on every
    ``MetpSelfAttention`` in ``module``, and whether every ``MetpMLP`` keeps its fc1 output
    ("save+fc1") and its gathered weights ("save+fc1+weights")."""
    from megatron_metp.metp.mlp import MetpMLP

    check_qkv_backward(value)
    for m in module.modules():
        if isinstance(m, MetpSelfAttention):
            m.qkv_backward = value
        elif isinstance(m, MetpMLP):
            m.keep_fc1 = value in KEEPS_FC1
            m.keep_weights = value == KEEPS_WEIGHTS


def set_balanced_layout(module: torch.nn.Module, on: bool = True) -> bool:
    """Tell every causal ``MetpSelfAttention`` in ``module`` that the model lays its tokens out
    balanced (``megatron_metp.token_layout``); returns whether it is on (only when every METP
    attention in ``module`` is causal: a non-causal ring reads contiguous blocks)."""
    attns = [m for m in module.modules() if isinstance(m, MetpSelfAttention)]
    on = bool(on and attns and all(m.attn_mask_type == AttnMaskType.causal for m in attns))
    for m in attns:
        m.balanced_layout = on
    return on


class MetpSelfAttention(SelfAttention):
    """Self-attention computed by METP's two-level loop; parameters as Megatron's TP shards.

    Input ``hidden_states [s/p, b, h]`` (sequence-parallel), output ``(out [s/p, b, h], bias)``.
    Causal (``attn_mask_type=causal``) or full attention; with a causal mask type the explicit
    ``attention_mask`` is not read (Transformer Engine's attention does the same), since a
    contiguous-shard ring applies the causal structure blockwise.
    """

    def __init__(
        self,
        config: TransformerConfig,
        submodules: SelfAttentionSubmodules,
        layer_number: int,
        attn_mask_type: AttnMaskType = AttnMaskType.padding,
        cp_comm_type: Optional[str] = None,
        pg_collection=None,
        kernel_backend: Optional[str] = None,
        **kwargs,
    ):
        # Megatron-Core >= 0.19 also passes ``name`` (and ``pp_layer_offset``): forwarded to
        # SelfAttention, which takes them there (0.16.1's SelfAttention never receives them).
        if pg_collection is None:
            from megatron.core.process_groups_config import ProcessGroupCollection

            pg_collection = ProcessGroupCollection.use_mpu_process_groups(required_pgs=["tp", "cp"])
        p = pg_collection.tp.size()
        check_metp_attention_config(config, p)
        if config.context_parallel_size != 1:
            # The core attention module is never called (the ring is METP's core attention);
            # the local one refuses CP, so none is built under CP.
            import dataclasses

            submodules = dataclasses.replace(submodules, core_attention=IdentityOp)
        super().__init__(config, submodules, layer_number, attn_mask_type=attn_mask_type,
                         cp_comm_type=cp_comm_type, pg_collection=pg_collection, **kwargs)
        # The attention kernel (megatron_metp.kernels.BACKENDS); None chooses per block.
        self.kernel_backend = kernel_backend
        if isinstance(self.q_layernorm, IdentityOp):
            self.q_layernorm = None
        if isinstance(self.k_layernorm, IdentityOp):
            self.k_layernorm = None
        self._global_ranks = (
            [dist.get_global_rank(self.tp_group, r) for r in range(p)] if p > 1 else [0]
        )
        # Its own communicator, so that a prefetched broadcast overlaps the K/V ring on NCCL
        # (megatron_metp.parallel_state); read once here, handed to the Function via _Plan.
        from megatron_metp.parallel_state import metp_weight_group

        self.weight_group = metp_weight_group(self.tp_group)
        # Set by MetpTransformerLayer for one forward (metp.layer_schedule.SublayerLink), and
        # the views of this module's weights the layer before made (defer_next_attention).
        self.link = None
        self.later = None
        # The K/V ring: the TP group, or under CP the TP x CP ranks of this sequence with each
        # one's block index (megatron_metp.parallel_state.metp_kv_ring); read once here.
        from megatron_metp.parallel_state import metp_kv_balanced_blocks, metp_kv_ring

        self.kv_group, self.kv_blocks = metp_kv_ring(self.tp_group, pg_collection.cp)
        self.kv_blocks_balanced = metp_kv_balanced_blocks(pg_collection.cp)
        # Set by the model that lays out the tokens (MetpGPTModel): rank r then holds chunks r
        # and 2p-1-r of the sequence (megatron_metp.token_layout) whenever
        # :meth:`uses_balanced_layout` says so. A stock GPTModel (the spec-only route) scatters
        # the sequence contiguously, hence the default.
        self.balanced_layout = False
        # "auto" (whole_pass), "whole" or "head-group": how many head groups one ring pass
        # takes (--metp-ring-pass, carried on the config; read once here).
        self.ring_pass = check_ring_pass(getattr(config, "metp_ring_pass", "auto"))
        # "auto", "recompute", "save", "save+fc1" or "save+fc1+weights": the one pass's Q/K/V
        # in backward (QKV_BACKWARD, --metp-qkv-backward on the config; read once here).
        self.qkv_backward = check_qkv_backward(getattr(config, "metp_qkv_backward", "auto"))
        self._softmax_scale = (config.softmax_scale if config.softmax_scale is not None
                               else 1.0 / math.sqrt(self.hidden_size_per_attention_head))

    def forward(
        self,
        hidden_states,
        attention_mask=None,
        key_value_states=None,
        inference_context=None,
        rotary_pos_emb=None,
        rotary_pos_cos=None,
        rotary_pos_sin=None,
        rotary_pos_cos_sin=None,
        attention_bias=None,
        packed_seq_params=None,
        sequence_len_offset=None,
        *,
        inference_params=None,
    ):
        if any(a is not None for a in (key_value_states, inference_context, inference_params)):
            raise ValueError(
                "MetpSelfAttention: no cross attention or inference (KV cache); run inference "
                "with --tensor-parallel-mode tp (checkpoints load across modes)"
            )
        if attention_bias is not None:
            raise ValueError("MetpSelfAttention: no attention bias; use --tensor-parallel-mode tp")
        if rotary_pos_cos is not None or rotary_pos_sin is not None:
            raise ValueError("MetpSelfAttention: rotary cos/sin tables (Megatron's inference "
                             "paths) are not supported; training passes rotary_pos_emb")
        # Megatron DDP's --overlap-param-gather finishes these weights' all-gather in their
        # linears' forward pre-hooks, which METP does not call (metp.weight_hooks).
        run_pre_hooks(self.linear_proj, self.linear_qkv)
        causal = self.attn_mask_type == AttnMaskType.causal
        if not causal and attention_mask is not None:
            raise ValueError(
                "MetpSelfAttention: explicit (padding) attention masks are not supported; use a "
                "causal mask type or no mask (--no-create-attention-mask-in-dataloader)"
            )
        if self.config.no_rope_freq and self.config.no_rope_freq[self.layer_number - 1]:
            rotary_pos_emb = None
        s_shard = hidden_states.shape[0]
        rank = dist.get_rank(self.tp_group) if self.world_size > 1 else 0
        layout = None
        balanced = self.uses_balanced_layout(s_shard, causal, packed_seq_params)
        if packed_seq_params is not None:
            layout = self._packed_layout(packed_seq_params, hidden_states, causal, balanced)
        freqs = None
        pair = (rotary_pos_emb if isinstance(rotary_pos_emb, tuple) or rotary_pos_emb is None
                else (rotary_pos_emb,) * 2)
        if pair is not None and layout is not None:
            # Megatron's THD RoPE: each token at its position inside its document (the table
            # covers max_seqlen positions for THD, the whole sequence otherwise).
            ring_rank = dist.get_rank(self.kv_group) if self.kv_group is not None else 0
            blocks = self.kv_blocks_balanced if balanced else self.kv_blocks
            block = blocks[ring_rank] if blocks is not None else rank
            # Every rank checks against the longest document (host values: no GPU read), so
            # all refuse alike; the device copy of the positions is made once per micro batch.
            need = longest_document(packed_seq_params) if s_shard else 0
            for f in pair:
                if f.shape[0] < need:
                    raise ValueError(f"rotary_pos_emb covers {f.shape[0]} positions; a packed "
                                     f"document needs {need} (max_seqlen_q)")
            pos = layout.block_positions(block, s_shard, device=pair[0].device)
            freqs = tuple(f.index_select(0, pos) for f in pair)
        elif pair is not None:
            # The embedding covers the full sequence (under CP: the CP rank's tokens, in the
            # order get_batch_on_this_cp_rank lays them out, as Megatron's RotaryEmbedding
            # returns them), in the order the model laid the tokens out: sequence order, or
            # the balanced one (MetpGPTModel permutes the table with the tokens, once per step).
            # This rank's tokens are the contiguous chunk [rank * s/p, (rank + 1) * s/p) of it:
            # a view of their positions.
            lo = rank * s_shard
            self._check_rotary_length(pair, s_shard)
            freqs = tuple(f[lo : lo + s_shard] for f in pair)
        # A packed batch's balanced layout carries its own block rule; under CP its ring blocks
        # are numbered as the balanced ones (token_layout.balanced_block).
        plan = _Plan(self, freqs, causal, s_shard * hidden_states.shape[1], layout,
                     balanced and layout is None, balanced_blocks=balanced, s_shard=s_shard)
        norm_params = [prm for m in (self.q_layernorm, self.k_layernorm) if m is not None
                       for prm in m.parameters()]
        fn = _MetpWholeFunction if plan.whole else _MetpMHAFunction
        w_qkv, b_qkv, w_proj = self.linear_qkv.weight, self.linear_qkv.bias, self.linear_proj.weight
        if plan.later_box is not None:
            # Views through the layer before's _GradsLater node, which waits for their
            # gradients' reduce-scatters (metp.layer_schedule).
            w_qkv, b_view, w_proj = self.later[1]
            b_qkv = b_qkv if b_view is None else b_view
        out = fn.apply(plan, hidden_states, w_qkv, b_qkv, w_proj, *norm_params)
        if plan.keep_weights and plan.link is not None:
            # Where the next layer keeps its weights too, the node that waits for its
            # attention's gradients, made here: after this attention, before this MLP.
            plan.link.defer_next_attention()
        # RowParallelLinear(skip_bias_add=True), as Attention builds it, returns its bias apart
        # for the fused bias-dropout-add; the bias is replicated, so it never travels.
        if self.linear_proj.skip_bias_add:
            return out, self.linear_proj.bias
        if self.linear_proj.bias is not None:
            out = out + self.linear_proj.bias
        return out, None

    def uses_balanced_layout(self, s_shard: int, causal: bool, packed_seq_params=None) -> bool:
        """Whether this call's tokens are in the balanced layout. The model that laid them out
        decides with the same rule (``MetpGPTModel``): a causal sequence whose ``s_shard * p``
        tokens split into ``2p`` equal chunks; packed (THD, no CP), every document's padded
        length split so (``packing.balanced_packed_layout``)."""
        if not (self.balanced_layout and causal):
            return False
        p = self.world_size
        if packed_seq_params is None:
            return can_balance(s_shard * p, p)
        if self.kv_blocks is not None:   # under CP: Megatron-LM's THD split, then balanced
            return cp_balanced_packed_layout(packed_seq_params, p, len(self.kv_blocks) // p,
                                             s_shard * p) is not None
        return balanced_packed_layout(packed_seq_params, p, s_shard * p) is not None

    def _check_rotary_length(self, pair, s_shard: int) -> None:
        for f in pair:
            if f.shape[0] != s_shard * self.world_size:
                raise ValueError(
                    f"rotary_pos_emb covers {f.shape[0]} positions; expected the "
                    f"{s_shard * self.world_size} of this context-parallel rank "
                    f"(--seq-length / --context-parallel-size)"
                )

    def _packed_layout(self, params, hidden_states, causal: bool, balanced: bool = False):
        """Megatron's ``PackedSeqParams`` (THD, or the same documents in SBHD with b = 1) as
        the ring's document layout; the sequence is this rank's tokens times the TP ranks.
        ``balanced``: the model put each document's chunks r and 2p-1-r on rank r."""
        if params.qkv_format not in ("thd", "sbhd"):
            raise ValueError(f"MetpSelfAttention: packed qkv_format {params.qkv_format!r}; "
                             f"use 'thd' (or 'sbhd' with micro batch 1)")
        if hidden_states.shape[1] != 1:
            raise ValueError("MetpSelfAttention: packed sequences take one packed sequence per "
                             f"micro batch (b = 1), got b = {hidden_states.shape[1]}")
        if not causal:
            raise ValueError("MetpSelfAttention: packed sequences need the causal mask type")
        cp = len(self.kv_blocks) // self.world_size if self.kv_blocks is not None else 1
        return packed_ring_layout(params, self.world_size, cp, hidden_states.shape[0], balanced)
