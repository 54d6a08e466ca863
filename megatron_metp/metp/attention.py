"""METP's two-level multi-head attention (paper Alg. 5-6) as a Megatron ``SelfAttention``.

``MetpSelfAttention`` has ``SelfAttention``'s constructor, submodules and parameters: rank j of
the METP ring (= Megatron's tensor-model-parallel group) stores exactly TP rank j's shards, so
names, shapes and ``sharded_state_dict`` keys are the ``tp`` model's. Only the forward differs::

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
from typing import List, Optional

import torch
import torch.distributed as dist
import torch.nn.functional as F
from megatron.core.models.common.embeddings.rope_utils import apply_rotary_pos_emb
from megatron.core.models.common.embeddings.yarn_rotary_pos_embedding import (
    _yarn_get_concentration_factor_from_config,
)
from megatron.core.transformer.attention import SelfAttention, SelfAttentionSubmodules
from megatron.core.transformer.enums import AttnMaskType
from megatron.core.transformer.identity_op import IdentityOp
from megatron.core.transformer.transformer_config import TransformerConfig

from megatron_metp.metp.ring_attention import (ring_attention_backward, ring_attention_forward,
                                               stack_kv)
from megatron_metp.packing import (CPBlockLayout, PackedLayout, balanced_packed_layout,
                                   cp_balanced_packed_layout,
                                   check_tokens)
from megatron_metp.token_layout import BALANCED, can_balance


def check_metp_attention_config(config: TransformerConfig, p: int) -> None:
    """Refuse configurations METP attention does not implement (flag named in each message)."""
    if config.num_attention_heads % p != 0:
        raise ValueError(
            f"--tensor-parallel-mode metp: --num-attention-heads ({config.num_attention_heads}) "
            f"must be divisible by --tensor-model-parallel-size ({p}), the METP ring length"
        )
    groups = config.num_query_groups or config.num_attention_heads
    if groups % p != 0:
        raise ValueError(
            f"--tensor-parallel-mode metp: --num-query-groups ({groups}) must be divisible by "
            f"--tensor-model-parallel-size ({p}); each ring rank owns whole query groups "
            f"(tp mode allows fewer groups than ranks, metp does not)"
        )
    if p > 1 and not config.sequence_parallel:
        raise ValueError(
            "--tensor-parallel-mode metp needs --sequence-parallel when "
            "--tensor-model-parallel-size > 1 (METP keeps hidden states sequence-sharded)"
        )
    cp = config.context_parallel_size
    if cp != 1 and p % 2:
        raise ValueError(
            f"--tensor-parallel-mode metp with --context-parallel-size {cp} needs an even "
            f"--tensor-model-parallel-size (got {p}): each TP rank must hold tokens of one of the "
            f"CP rank's two load-balanced chunks; use an even TP size, or --context-parallel-size 1"
        )
    if config.attention_dropout and config.attention_dropout > 0:
        raise ValueError(
            f"--tensor-parallel-mode metp: attention dropout is not implemented by the ring "
            f"kernels; set --attention-dropout 0 (got {config.attention_dropout})"
        )
    if getattr(config, "attention_output_gate", False):
        raise ValueError("--tensor-parallel-mode metp does not support --attention-output-gate")
    if getattr(config, "multi_latent_attention", False):
        raise ValueError("--tensor-parallel-mode metp does not support --multi-latent-attention")
    if getattr(config, "softmax_type", "vanilla") != "vanilla":
        raise ValueError("--tensor-parallel-mode metp supports --softmax-type vanilla only")
    if getattr(config, "window_size", None) is not None:
        raise ValueError("--tensor-parallel-mode metp does not support --window-size")


# Head chunks run only when a rank has at least this many tokens: shorter inputs keep the whole
# head group in one ring pass. Their fp32 accumulators are small, and slicing costs time there:
# k times the kernels and messages, each 1/k the size (the ESTIMATED H100 timeline of LLaMA-7B
# at p = 8 put it at +14 % of the step at 4k tokens per rank, +6 % at 16k, 1-2 % from 64k).
ATTN_MIN_TOKENS = 8192

# Up to this many tokens per rank (s/p x b) every head group runs in one K/V ring pass
# (_MetpWholeFunction: weights all-gathered once, a few large GEMMs and kernels, one message
# per hop) instead of one pass per head group (_MetpMHAFunction). The whole pass holds all
# heads' Q/K/V (and their fp32 ring-backward accumulators) at once, ~(n + 2 ng) d values per
# token: at 32k tokens per rank that is ~1.5 GiB for LLaMA-7B and ~4.5 GiB for GPT-175B (bf16
# Q/K/V, fp32 backward state), which the memory plan shows fits beside the layers' saved
# activations at those lengths on 80 GiB. Near the longest trainable sequence (for the paper's
# models at p = 8: 72k-415k tokens per rank, `metp plan --longest-p 8`) the per-head-group loop
# and its slices (head_chunks) keep the peak at METP's. That token rule is the fallback of a
# model built without a launcher: `metp train`, Megatron-LM's argument hook and `metp plan`
# resolve "auto" from memory headroom instead (measure.planner.resolve_metp_attention: the
# whole pass wherever the run fits with it, the per-head-group loop only where nothing coarser
# does). `MetpSelfAttention.ring_pass` overrides.
WHOLE_MAX_TOKENS = 32768
RING_PASSES = ("auto", "whole", "head-group")

# What the one-pass backward does for Q/K/V (--metp-qkv-backward; the per-head-group loop always
# recomputes). "recompute" (Alg. 6 line 6): one more Q/K/V GEMM per layer in backward, nothing
# kept. "save": the forward's Q/K/V projection (before q/k norm and RoPE, (n + 2 ng) d values
# per token) is kept for backward, which then skips that GEMM and the bias gather: 2 (n + 2 ng)
# d bytes more per token and layer (bf16; 3 bsh/p x 2 bytes for MHA). "auto": the launchers
# (`metp train`, Megatron-LM's argument hook) and `metp plan` ask the planner
# (measure.planner.resolve_metp_attention) and save when the run still fits the GPU's memory
# with the saved Q/K/V; a model built without a launcher keeps "auto", which recomputes.
# "save+fc1": as "save", and the MLP's weight ring keeps every step's fc1 output for its backward
# too (metp.mlp.MetpMLP, weight_ring.metp_mlp_forward(keep_fc1=True)): F' more values per token
# and layer, the size of what Megatron's MLP keeps of fc1, and no fc1 GEMM in backward. "auto"
# tries it first.
QKV_BACKWARD = ("auto", "recompute", "save", "save+fc1")


def check_ring_pass(ring_pass: str) -> str:
    if ring_pass not in RING_PASSES:
        raise ValueError(f"--metp-ring-pass {ring_pass!r}: choose one of {', '.join(RING_PASSES)}")
    return ring_pass


def check_qkv_backward(value: str) -> str:
    if value not in QKV_BACKWARD:
        raise ValueError(f"--metp-qkv-backward {value!r}: choose one of {', '.join(QKV_BACKWARD)}")
    return value


def whole_pass(ring_pass: str, tokens: int, p: int) -> bool:
    """Whether one ring pass takes every head group (``RING_PASSES``; ``tokens`` per rank)."""
    if check_ring_pass(ring_pass) == "auto":
        return p > 1 and tokens <= WHOLE_MAX_TOKENS
    return ring_pass == "whole"


def head_chunks(groups_p: int, heads_p: int, d: int, h: int, p: int, n: int) -> List[slice]:
    """Query-group slices of one head group, each run through the K/V ring on its own.

    The ring's backward holds fp32 state the size of about seven of its query blocks (dQ, the
    owner's dK/dV and two travelling dK/dV pairs for MHA): ``14 w / h`` ``bsh/p`` for a query
    width ``w``, i.e. 1.75 ``bsh/p`` for a whole head group (``w = h/p``) at p = 8. Running the
    head group in ``k`` slices of whole query groups (a slice's K/V heads with their query heads,
    so no K/V block travels twice) divides that by ``k``; ``k`` is the smallest divisor of the
    group count with slices no wider than ``h / (4p)``, from ``ATTN_MIN_TOKENS`` tokens per rank. The ring then sends ``k`` times as many
    messages of ``1/k`` the size (the same bytes); every row's softmax is the same computation.
    GPT-175B at p = 8: 4 slices of 3 heads; LLaMA-7B: 4 of 1; LLaMA-70B (one query group per
    rank): 1.
    """
    if n < ATTN_MIN_TOKENS or groups_p == 1:
        return [slice(0, groups_p)]
    want = -(-4 * p * heads_p * d // max(1, h))
    k = next((c for c in range(1, groups_p + 1) if groups_p % c == 0 and c >= want), groups_p)
    step = groups_p // k
    return [slice(i, i + step) for i in range(0, groups_p, step)]


class _Plan:
    """Static description of one layer's METP attention, handed to the autograd Function.

    Holds the ring group, its global ranks, the layout and the RoPE/norm callables: everything
    the two passes need, so nothing reads global state inside the Function.
    """

    def __init__(self, module: "MetpSelfAttention", freqs_shard_s, causal: bool, tokens: int,
                 layout=None, balanced: bool = False, balanced_blocks: bool = False):
        # Packed documents (megatron_metp.packing), the balanced layout's block rule
        # (megatron_metp.token_layout), or None (contiguous blocks).
        self.layout = BALANCED if balanced else layout
        self.group = module.kv_group  # the K/V ring (P2P): the TP group, or TP x CP under CP
        # Each K/V ring rank's block in the sequence (None: ring order); balanced numbering for
        # the balanced layout, packed or not.
        self.blocks = (module.kv_blocks_balanced if balanced or balanced_blocks
                       else module.kv_blocks)
        self.weight_group = module.weight_group  # weight broadcasts and gradient reduces
        self.p = module.world_size  # the outer level: TP ranks (head groups)
        self.rank = dist.get_rank(module.tp_group) if self.p > 1 else 0
        self.global_ranks = module._global_ranks
        self.groups_p = module.num_query_groups_per_partition
        self.heads_p = module.num_attention_heads_per_partition
        self.d = module.hidden_size_per_attention_head
        self.q_norm = module.q_layernorm
        self.k_norm = module.k_layernorm
        self.freqs = freqs_shard_s  # (q_freqs, k_freqs) for this rank's tokens, or None
        self.config = module.config
        self.cp_group = module.pg_collection.cp
        self.mscale = _yarn_get_concentration_factor_from_config(module.config)
        self.causal = causal
        self.scale = module._softmax_scale
        self.backend = module.kernel_backend
        self.chunks = head_chunks(self.groups_p, self.heads_p, self.d, module.config.hidden_size,
                                  self.p, tokens)
        self.whole = whole_pass(module.ring_pass, tokens, self.p)
        # The one pass keeps its Q/K/V projection for backward (QKV_BACKWARD; only "save":
        # "auto" is resolved to "recompute" or "save" by the launcher, before the model exists).
        self.save_qkv = self.whole and module.qkv_backward in ("save", "save+fc1")

    def row_blocks(self, w_qkv, b_qkv, gs: slice):
        """The q / k / v row blocks of query groups ``gs`` of head group j's ``w_qkv`` (and its
        bias), as ``[(gs, rows, heads, w_part [heads*d, h], b_part [heads*d] | None)]``.

        Megatron's per-query-group layout: for each of the ng/p groups, n/ng query heads, then
        one key head, then one value head (the split ``get_query_key_value_tensors`` does).
        """
        rep, g, d = self.heads_p // self.groups_p, gs.stop - gs.start, self.d
        w4 = w_qkv.view(self.groups_p, rep + 2, d, -1)[gs]
        b3 = b_qkv.view(self.groups_p, rep + 2, d)[gs] if b_qkv is not None else None
        out = []
        for rows, heads in ((slice(0, rep), g * rep), (slice(rep, rep + 1), g),
                            (slice(rep + 1, rep + 2), g)):
            out.append((gs, rows, heads, w4[:, rows].reshape(heads * d, -1),
                        b3[:, rows].reshape(heads * d) if b3 is not None else None))
        return out

    def q_cols(self, gs: slice) -> slice:
        """The columns of ``w_proj_j`` (the query heads) of query groups ``gs``."""
        width = self.heads_p // self.groups_p * self.d
        return slice(gs.start * width, gs.stop * width)

    def linear(self, x, blocks):
        """``x [s/p, b, h]`` -> q, k, v as contiguous ``[s/p, b, heads, d]`` tensors.

        One matmul per row block rather than one on the whole shard: each result is then a
        contiguous block that the K/V ring sends without a copy, and no [s/p, b, 3h/p]
        intermediate outlives the split.
        """
        s, b = x.shape[0], x.shape[1]
        return [F.linear(x, w, bias).view(s, b, heads, self.d)
                for _, _, heads, w, bias in blocks]

    @property
    def has_post(self) -> bool:
        return self.q_norm is not None or self.k_norm is not None or self.freqs is not None

    def post(self, q, k):
        """q/k layernorm (Megatron's --qk-layernorm) and RoPE at the tokens' global positions."""
        if self.q_norm is not None:
            q = self.q_norm(q)
        if self.k_norm is not None:
            k = self.k_norm(k)
        if self.freqs is not None:
            q = apply_rotary_pos_emb(q, self.freqs[0], config=self.config, mscale=self.mscale,
                                     cp_group=self.cp_group)
            k = apply_rotary_pos_emb(k, self.freqs[1], config=self.config, mscale=self.mscale,
                                     cp_group=self.cp_group)
        return q, k


def _bnsd(t: torch.Tensor) -> torch.Tensor:
    """[s, b, heads, d] -> the kernels' [b, heads, s, d] (a view)."""
    return t.permute(1, 2, 0, 3)


def _sbnd(t: torch.Tensor) -> torch.Tensor:
    """[b, heads, s, d] -> [s, b, heads, d] (a view)."""
    return t.permute(2, 0, 1, 3)


class _WeightPrefetch:
    """Broadcasts of (w_qkv_j, b_qkv_j, w_proj_j) from rank j, one step ahead, double-buffered.

    Step j reads buffer set j % 2 while the broadcast for j + 1 fills set (j + 1) % 2, which
    step j - 1 last read. On CPU step j - 1 has finished; on NCCL the broadcast is ordered after
    the kernels already queued on the compute stream, so it cannot overwrite what they read.
    Rank j's own step reads its parameters directly (it is the broadcast's source): nothing
    writes them between the forward and the optimizer step, so sending from them is safe.
    Every rank posts the same broadcasts in the same order on the weight group, and the ring's
    P2P batches in the same order on the ring group, so each group's operations match on gloo
    and NCCL alike; being on two communicators (two NCCL streams), a broadcast is not queued
    behind the ring's transfers of the step it overlaps.
    """

    def __init__(self, plan: _Plan, own: List[Optional[torch.Tensor]]):
        self.plan = plan
        self.own = [t.detach() if t is not None else None for t in own]
        self.sets = [[torch.empty_like(t) if t is not None else None for t in self.own]
                     for _ in range(2 if plan.p > 2 else plan.p - 1)] if plan.p > 1 else []
        self.handles: List = []

    def post(self, j: int) -> None:
        plan = self.plan
        if j >= plan.p or plan.p == 1:
            return
        bufs = self.own if j == plan.rank else self.sets[j % len(self.sets)]
        self.handles = [
            dist.broadcast(t, src=plan.global_ranks[j], group=plan.weight_group, async_op=True)
            for t in bufs if t is not None
        ]

    def get(self, j: int) -> List[Optional[torch.Tensor]]:
        for h in self.handles:
            h.wait()
        self.handles = []
        if j == self.plan.rank or self.plan.p == 1:
            return self.own
        return self.sets[j % len(self.sets)]


def _flat(t: torch.Tensor) -> torch.Tensor:
    """[b, heads, s, d] -> [s * b, heads * d] (the layout linear_proj multiplies)."""
    b, n, s, d = t.shape
    return t.permute(2, 0, 1, 3).reshape(s * b, n * d)


class _MetpMHAFunction(torch.autograd.Function):
    @staticmethod
    def forward(ctx, plan: _Plan, x, w_qkv, b_qkv, w_proj, *norm_params):
        s, b, h = x.shape
        weights = _WeightPrefetch(plan, [w_qkv, b_qkv, w_proj])
        weights.post(0)
        out = torch.zeros(s * b, h, dtype=x.dtype, device=x.device)
        attn, lses = [], []  # one entry per (head group j, head chunk)
        for j in range(plan.p):
            w_qkv_j, b_qkv_j, w_proj_j = weights.get(j)
            weights.post(j + 1)  # prefetch: travels while head group j computes
            for gs in plan.chunks:
                q, k, v = plan.linear(x, plan.row_blocks(w_qkv_j, b_qkv_j, gs))
                if plan.has_post:
                    q, k = plan.post(q, k)
                # K and V into the one buffer the ring sends; their own tensors go.
                k, v = stack_kv(_bnsd(k), _bnsd(v)) if plan.p > 1 else (_bnsd(k), _bnsd(v))
                a_c, lse_c = ring_attention_forward(
                    plan.group, _bnsd(q), k, v, plan.causal, plan.scale,
                    plan.backend, plan.blocks, plan.layout,
                )
                del q, k, v
                # O_i += A_ij W_proj_j (this chunk's columns), no [s/p, b, h] temporary
                out.addmm_(_flat(a_c), w_proj_j[:, plan.q_cols(gs)].t())
                attn.append(a_c)
                lses.append(lse_c)
        ctx.plan = plan
        ctx.has_bias = b_qkv is not None
        ctx.save_for_backward(x, w_qkv, b_qkv, w_proj, *attn, *lses)
        return out.view(s, b, h)

    @staticmethod
    def backward(ctx, dout):
        plan: _Plan = ctx.plan
        x, w_qkv, b_qkv, w_proj, *rest = ctx.saved_tensors
        n_saved = plan.p * len(plan.chunks)
        attn, lses = rest[:n_saved], rest[n_saved:]
        norm_params = [prm for m in (plan.q_norm, plan.k_norm) if m is not None
                       for prm in m.parameters()]
        n_q = len(list(plan.q_norm.parameters())) if plan.q_norm is not None else 0
        s, b, h = x.shape
        dout2d = dout.reshape(s * b, h)
        weights = _WeightPrefetch(plan, [w_qkv, b_qkv, w_proj])
        weights.post(0)
        x2d = x.reshape(s * b, h)
        dx2d = torch.zeros(s * b, h, dtype=x.dtype, device=x.device)
        dnorm = [torch.zeros_like(prm) for prm in norm_params]
        own_grads = [None, None, None]
        pending = []  # (handles, grads, j) of reduces in flight
        for j in range(plan.p):
            w_qkv_j, b_qkv_j, w_proj_j = weights.get(j)
            weights.post(j + 1)
            # Weight gradients are reduced over p ranks: keep them (and the reduce) in fp32 for
            # bf16/fp16 weights, so the sum adds no rounding TP's single matmul does not have.
            gacc = torch.promote_types(w_proj_j.dtype, torch.float32)
            dw_proj_j = torch.empty(w_proj_j.shape, dtype=gacc, device=w_proj_j.device)
            proj = _ProjectionBackward(plan, x2d, dx2d, gacc, w_qkv_j, b_qkv_j)
            for c, gs in enumerate(plan.chunks):
                a_c, lse_c = attn[j * len(plan.chunks) + c], lses[j * len(plan.chunks) + c]
                heads, cols = a_c.shape[1], plan.q_cols(gs)
                # dW_proj_j = A_ij^T dO_i (this rank's tokens; summed over ranks by the reduce)
                dw_proj_j[:, cols] = dout2d.t().mm(_flat(a_c))
                # dA_ij = dO_i W_proj_j, viewed in the kernels' layout.
                da_c = dout2d.mm(w_proj_j[:, cols]).view(s, b, heads, plan.d).permute(1, 2, 0, 3)
                # Recompute Q/K/V (Alg. 6 line 6); only the q/k norm and RoPE go through
                # autograd, the projection's backward is written out so that dX accumulates in
                # place (an autograd.grad for x would materialise a [s/p, b, h] gradient per
                # head group).
                blocks = plan.row_blocks(w_qkv_j, b_qkv_j, gs)
                q_lin, k_lin, v = plan.linear(x, blocks)
                with torch.enable_grad():
                    if plan.has_post:
                        q_lin.requires_grad_(True)
                        k_lin.requires_grad_(True)
                    q, k = plan.post(q_lin, k_lin) if plan.has_post else (q_lin, k_lin)
                # Alg. 6 lines 9-10 (with W_qkv_j): dX += [dQ dK dV] W_qkv_j,
                # dW_qkv_j = X^T [dQ dK dV], block by block into Megatron's interleaved row
                # layout. The q block runs inside the ring's backward, while its last dK/dV hop
                # is in flight (it needs no dK/dV).

                def q_side(dq, q=q, q_lin=q_lin, blk=blocks[0]):
                    dq = _sbnd(dq)
                    if plan.has_post:
                        dq = _post_grad(q, q_lin, norm_params[:n_q], dq, dnorm[:n_q])
                    proj.add(blk, dq)

                # K and V into the ring's buffer; V's own tensor, and K's when no q/k norm or
                # RoPE needs it for its gradient, go before the ring runs.
                k_ring, v_ring = (stack_kv(_bnsd(k.detach()), _bnsd(v)) if plan.p > 1
                                  else (_bnsd(k.detach()), _bnsd(v)))
                del v
                if not plan.has_post:
                    del k, k_lin
                _, dk, dv = ring_attention_backward(
                    plan.group, da_c, _bnsd(q.detach()), k_ring, v_ring, a_c,
                    lse_c, plan.causal, plan.scale, plan.backend, with_dq=q_side,
                    blocks=plan.blocks, layout=plan.layout,
                )
                del da_c, q_side, k_ring, v_ring
                dk = _sbnd(dk)
                if plan.has_post:
                    dk = _post_grad(k, k_lin, norm_params[n_q:], dk, dnorm[n_q:])
                    del k, k_lin
                del q, q_lin
                proj.add(blocks[1], dk)
                proj.add(blocks[2], _sbnd(dv))
                del dk, dv, blocks
            red = [*proj.grads(), dw_proj_j]
            proj = None  # its buffers are in red
            if plan.p > 1:
                # Reduce to rank j (Alg. 6 line 11), completed one step later so it overlaps
                # head group j + 1. Every rank posts the same collectives in the same order.
                dst = plan.global_ranks[j]
                handles = [dist.reduce(g, dst=dst, op=dist.ReduceOp.SUM,
                                       group=plan.weight_group, async_op=True)
                           for g in red if g is not None]
                pending.append((handles, red, j))
                if len(pending) > 1:
                    _finish_reduce(pending.pop(0), plan, own_grads)
            else:
                own_grads = red
        while pending:
            _finish_reduce(pending.pop(0), plan, own_grads)
        dw_qkv, db_qkv, dw_proj = own_grads
        return (None, dx2d.view(s, b, h), dw_qkv.to(w_qkv.dtype),
                db_qkv.to(b_qkv.dtype) if ctx.has_bias else None,
                dw_proj.to(w_proj.dtype), *dnorm)


def _post_grad(out, inp, params, grad, accs):
    """``d inp`` of ``out = post(inp)`` (q/k norm, RoPE) given ``grad = d out``; the norm
    weights' gradients are added to ``accs``. Q and K have separate graphs (and norms), so
    taking them one at a time gives what one joint ``autograd.grad`` gives."""
    grads = torch.autograd.grad(out, [inp] + list(params), grad, allow_unused=True)
    for acc, g in zip(accs, grads[1:]):
        if g is not None:
            acc += g
    return grads[0]


class _ProjectionBackward:
    """linear_qkv's backward for head group j, one row block (q, k or v rows of some query
    groups) at a time: ``dX += g W_part`` in place and ``dW_qkv_j``'s (``db_qkv_j``'s) rows of
    the block.

    The gradient buffers are allocated at the first block, i.e. after the ring's kernels, as
    they would be after the ring returns: the ring's peak memory does not include them.
    """

    def __init__(self, plan: _Plan, x2d, dx2d, gacc, w_qkv_j, b_qkv_j):
        self.plan, self.x2d, self.dx2d = plan, x2d, dx2d
        self.w_shape = w_qkv_j.shape
        self.b_shape = b_qkv_j.shape if b_qkv_j is not None else None
        self.gacc = gacc
        self.dw4 = self.db3 = None

    def add(self, block, g: torch.Tensor) -> None:
        plan, h = self.plan, self.x2d.shape[1]
        if self.dw4 is None:
            self.dw4 = torch.empty(self.w_shape, dtype=self.gacc, device=g.device).view(
                plan.groups_p, -1, plan.d, h)
            self.db3 = (torch.empty(self.b_shape, dtype=self.gacc, device=g.device).view(
                plan.groups_p, -1, plan.d) if self.b_shape is not None else None)
        gs, rows, heads, w_part, _ = block
        ng = gs.stop - gs.start
        g2d = g.reshape(self.x2d.shape[0], heads * plan.d)
        self.dx2d.addmm_(g2d, w_part)
        self.dw4[gs, rows] = g2d.t().mm(self.x2d).view(ng, -1, plan.d, h)
        if self.db3 is not None:
            self.db3[gs, rows] = g2d.sum(0).view(ng, -1, plan.d)

    def grads(self):
        """(dW_qkv_j, db_qkv_j or None), once every block was added."""
        return (self.dw4.view(self.w_shape),
                self.db3.view(self.b_shape) if self.db3 is not None else None)


def _gather_rows(t: Optional[torch.Tensor], plan: _Plan, async_op: bool = False):
    """Every rank's ``t`` stacked along dim 0 over the weight group (TP rank order): for
    ``linear_qkv``'s shards that is the TP = 1 weight (Megatron splits it by whole query groups).
    Returns ``(full, handle)``; ``handle`` is None unless ``async_op``."""
    if t is None:
        return None, None
    if plan.p == 1:
        return t, None
    t = t.contiguous()
    full = torch.empty((plan.p * t.shape[0], *t.shape[1:]), dtype=t.dtype, device=t.device)
    handle = dist.all_gather_into_tensor(full, t, group=plan.weight_group, async_op=async_op)
    return full, handle if async_op else None


def _scatter_rows(full: Optional[torch.Tensor], plan: _Plan):
    """Sum ``full`` over the weight group and keep this rank's rows (async): ``(mine, handle)``."""
    if full is None:
        return None, None
    if plan.p == 1:
        return full, None
    mine = torch.empty((full.shape[0] // plan.p, *full.shape[1:]), dtype=full.dtype,
                       device=full.device)
    return mine, dist.reduce_scatter_tensor(mine, full, group=plan.weight_group, async_op=True)


def _split_qkv(qkv: torch.Tensor, plan: _Plan, s: int, b: int):
    """``[s, b, ng, n/ng + 2, d]`` (Megatron's per-query-group rows, all groups) -> q
    ``[s, b, n, d]`` (a copy) and k, v ``[s, b, ng, d]`` (views)."""
    rep = plan.heads_p // plan.groups_p
    ng = qkv.shape[2]
    # contiguous(): with one query head per group the reshape is a view, which would keep the
    # whole projection output alive through the ring.
    q = qkv[:, :, :, :rep].reshape(s, b, ng * rep, plan.d).contiguous()
    return q, qkv[:, :, :, rep], qkv[:, :, :, rep + 1]


def _project_gathered(x2d, w_qkv, b_qkv, plan: _Plan):
    """``x2d W_qkv^T + b`` with the full (gathered) ``W_qkv``, gathered as two halves of every
    rank's rows, so that the first half's GEMM runs while the second half travels (one
    gather would be exposed at the start of the attention). Each output is one GEMM's, as in
    TP (no split of the reduction); one copy puts the halves back in Megatron's row order."""
    if plan.p == 1:
        return F.linear(x2d, w_qkv, b_qkv)
    rows, sb = w_qkv.shape[0], x2d.shape[0]
    cut = rows // 2
    w_lo, lo = _gather_rows(w_qkv[:cut], plan, async_op=True)
    w_hi, hi = _gather_rows(w_qkv[cut:], plan, async_op=True)
    b_full, bh = _gather_rows(b_qkv, plan, async_op=True)
    lo.wait()
    first = x2d.mm(w_lo.t()).view(sb, plan.p, cut)
    del w_lo
    hi.wait()
    second = x2d.mm(w_hi.t()).view(sb, plan.p, rows - cut)
    out = torch.cat((first, second), dim=2).view(sb, plan.p * rows)
    if bh is not None:
        bh.wait()
        out.add_(b_full)
    return out


class _MetpWholeFunction(torch.autograd.Function):
    """Every head group in one K/V ring pass: the coarse end of the head slicing.

    The ``p`` head groups' weights are all-gathered once (``linear_qkv``'s and ``linear_proj``'s
    shards, h(h + 2 ng d) + h^2 elements, the bytes of the p broadcasts), Q/K/V of all heads come
    from one GEMM on this rank's tokens, one ring pass moves all K/V heads (p - 1 hops of one
    message each), and the output projection is one GEMM. Backward mirrors it, with the weight
    gradients reduce-scattered to their owners. The same arithmetic as the per-head-group loop
    in fewer, larger operations (``head_chunks``: a few kernels and messages instead of p per
    hop), at the price of all heads' Q/K/V at once: about ``(n + 2 ng) d`` values per token
    while the ring runs, which is why long inputs keep the per-head-group loop. Saved for
    backward as there: x, A and the lse.
    """

    @staticmethod
    def forward(ctx, plan: _Plan, x, w_qkv, b_qkv, w_proj, *norm_params):
        s, b, h = x.shape
        x2d = x.reshape(s * b, h)
        qkv = _project_gathered(x2d, w_qkv, b_qkv, plan).view(
            s, b, -1, plan.heads_p // plan.groups_p + 2, plan.d)
        # W_proj^T's rows are the heads in order: gathered while the ring computes.
        wpt, wpt_handle = _gather_rows(w_proj.t(), plan, async_op=True)
        q, k, v = _split_qkv(qkv, plan, s, b)
        if plan.has_post:
            q, k = plan.post(q, k)
        # K and V into the buffer the ring sends; the projection's output is freed before it.
        k, v = stack_kv(_bnsd(k), _bnsd(v))
        # QKV_BACKWARD "save": the projection stays for backward; else it is freed here, before
        # the ring's buffers exist, and backward recomputes it.
        kept = qkv if plan.save_qkv else None
        del qkv
        a, lse = ring_attention_forward(plan.group, _bnsd(q), k, v, plan.causal,
                                        plan.scale, plan.backend, plan.blocks, plan.layout)
        del q, k, v
        if wpt_handle is not None:
            wpt_handle.wait()
        out = _flat(a).mm(wpt)
        ctx.plan = plan
        ctx.has_bias = b_qkv is not None
        ctx.save_for_backward(x, w_qkv, b_qkv, w_proj, a, lse, kept)
        return out.view(s, b, h)

    @staticmethod
    def backward(ctx, dout):
        plan: _Plan = ctx.plan
        x, w_qkv, b_qkv, w_proj, a, lse, kept = ctx.saved_tensors
        norm_params = [prm for m in (plan.q_norm, plan.k_norm) if m is not None
                       for prm in m.parameters()]
        n_q = len(list(plan.q_norm.parameters())) if plan.q_norm is not None else 0
        dnorm = [torch.zeros_like(prm) for prm in norm_params]
        s, b, h = x.shape
        x2d, dout2d = x.reshape(s * b, h), dout.reshape(s * b, h)
        wpt, wpt_handle = _gather_rows(w_proj.t(), plan, async_op=True)
        w_full, w_handle = _gather_rows(w_qkv, plan, async_op=True)
        # The bias only enters the recompute: a saved projection needs no gather of it.
        b_full, b_handle = _gather_rows(b_qkv if kept is None else None, plan, async_op=True)
        # Weight gradients are summed over p ranks: in fp32 for bf16/fp16 weights, so the sum
        # adds no rounding TP's single matmul does not have.
        gacc = torch.promote_types(w_proj.dtype, torch.float32)
        a2d = _flat(a)
        # dW_proj^T = A^T dO (this rank's tokens), reduce-scattered while the ring runs.
        dwpt, dwpt_handle = _scatter_rows(a2d.t().mm(dout2d).to(gacc), plan)
        del a2d
        if wpt_handle is not None:
            wpt_handle.wait()
        da = dout2d.mm(wpt.t()).view(s, b, -1, plan.d).permute(1, 2, 0, 3)
        del wpt
        rep = plan.heads_p // plan.groups_p
        if kept is None:
            for hnd in (w_handle, b_handle):
                if hnd is not None:
                    hnd.wait()
            w_handle = None
            # Recompute Q/K/V (Alg. 6 line 6); only the q/k norm and RoPE go through autograd.
            qkv = F.linear(x2d, w_full, b_full).view(s, b, -1, rep + 2, plan.d)
        else:
            # Saved in forward (QKV_BACKWARD "save"); the W_qkv gather is awaited at dX.
            qkv = kept
        del kept
        ng = qkv.shape[2]
        qkv_shape, qkv_dtype = qkv.shape, qkv.dtype
        q_lin, k_lin, v = _split_qkv(qkv, plan, s, b)   # q a copy; k, v views of qkv
        with torch.enable_grad():
            if plan.has_post:
                q_lin.requires_grad_(True)
                # K's own copy for its norm / RoPE gradient: a view would keep qkv alive.
                k_lin = k_lin.clone().requires_grad_(True)
            q, k = plan.post(q_lin, k_lin) if plan.has_post else (q_lin, k_lin)
        k_ring, v_ring = stack_kv(_bnsd(k.detach()), _bnsd(v))
        del qkv, v   # with k (a view of it) when nothing needs k's gradient graph
        if not plan.has_post:
            del k, k_lin
        # dQ, dK, dV in Megatron's row layout, for one GEMM; allocated when the ring hands
        # over dQ (after its kernels), as the per-head-group loop allocates its buffers.
        grads = {}

        def q_side(dq, q=q, q_lin=q_lin):
            dq = _sbnd(dq)
            if plan.has_post:
                dq = _post_grad(q, q_lin, norm_params[:n_q], dq, dnorm[:n_q])
            grads["qkv"] = torch.empty(qkv_shape, dtype=qkv_dtype, device=dq.device)
            grads["qkv"][:, :, :, :rep] = dq.view(s, b, ng, rep, plan.d)

        _, dk, dv = ring_attention_backward(
            plan.group, da, _bnsd(q.detach()), k_ring, v_ring, a, lse,
            plan.causal, plan.scale, plan.backend, with_dq=q_side, blocks=plan.blocks,
            layout=plan.layout)
        del da, q_side, k_ring, v_ring
        dk = _sbnd(dk)
        if plan.has_post:
            dk = _post_grad(k, k_lin, norm_params[n_q:], dk, dnorm[n_q:])
            del k, k_lin
        dqkv = grads.pop("qkv")
        dqkv[:, :, :, rep] = dk
        dqkv[:, :, :, rep + 1] = _sbnd(dv)
        del q, q_lin, dk, dv
        dqkv2d = dqkv.view(s * b, -1)
        # The weight gradient first, so that its reduce-scatter runs behind dX's GEMM.
        dw, dw_handle = _scatter_rows(dqkv2d.t().mm(x2d).to(gacc), plan)
        db, db_handle = _scatter_rows(dqkv2d.sum(0).to(gacc) if ctx.has_bias else None, plan)
        if w_handle is not None:
            w_handle.wait()
        dx = dqkv2d.mm(w_full)
        del w_full, b_full
        for hnd in (dwpt_handle, dw_handle, db_handle):
            if hnd is not None:
                hnd.wait()
        return (None, dx.view(s, b, h), dw.to(w_qkv.dtype),
                db.to(b_qkv.dtype) if ctx.has_bias else None,
                dwpt.t().contiguous().to(w_proj.dtype), *dnorm)


def _finish_reduce(item, plan: _Plan, own_grads: list) -> None:
    handles, red, j = item
    for hnd in handles:
        hnd.wait()
    if j == plan.rank:
        own_grads[:] = red


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
    ("save+fc1")."""
    from megatron_metp.metp.mlp import MetpMLP

    check_qkv_backward(value)
    for m in module.modules():
        if isinstance(m, MetpSelfAttention):
            m.qkv_backward = value
        elif isinstance(m, MetpMLP):
            m.keep_fc1 = value == "save+fc1"


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
        # "auto", "recompute" or "save": the one pass's Q/K/V in backward (QKV_BACKWARD,
        # --metp-qkv-backward on the config; read once here).
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
            # The range check reads the host copy (no GPU sync); the device copy is made once
            # per micro batch (the layout keeps both).
            need = int(layout.block_positions(block, s_shard).max()) + 1 if s_shard else 0
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
                     balanced and layout is None, balanced_blocks=balanced)
        norm_params = [prm for m in (self.q_layernorm, self.k_layernorm) if m is not None
                       for prm in m.parameters()]
        fn = _MetpWholeFunction if plan.whole else _MetpMHAFunction
        out = fn.apply(
            plan, hidden_states, self.linear_qkv.weight, self.linear_qkv.bias,
            self.linear_proj.weight, *norm_params,
        )
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
