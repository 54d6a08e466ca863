"""METP attention's options and the plan both ring passes share (``metp.attention``).

What a layer's METP attention is told before it runs, read once at construction or from the
launcher: the configurations it refuses (:func:`check_metp_attention_config`), how many head
groups one ring pass takes (``--metp-ring-pass``, :data:`RING_PASSES`, :func:`whole_pass`,
:func:`head_chunks`) and what the one pass keeps for backward (``--metp-qkv-backward``,
:data:`QKV_BACKWARD`); and :class:`_Plan`, the static description of one layer's attention
that the two passes (``metp.head_group_pass``: one pass per head group, Alg. 5-6;
``metp.whole_pass``: every head group in one pass) receive, with the layout helpers they
share.
"""

from __future__ import annotations

from typing import List

import torch
import torch.distributed as dist
import torch.nn.functional as F
from megatron.core.models.common.embeddings.rope_utils import apply_rotary_pos_emb
from megatron.core.models.common.embeddings.yarn_rotary_pos_embedding import (
    _yarn_get_concentration_factor_from_config,
)
from megatron.core.transformer.transformer_config import TransformerConfig

from megatron_metp.metp.a2a_attention import fuse_out
from megatron_metp.metp.wgrad_accum import scatters_together
from megatron_metp.token_layout import BALANCED


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
    if cp != 1 and getattr(config, "metp_ring_pass", None) == "a2a":
        raise ValueError(
            f"--metp-ring-pass a2a conflicts with --context-parallel-size {cp}: its all-to-alls "
            f"run over the TP group only; use --metp-ring-pass whole (or auto), or "
            f"--context-parallel-size 1")
    if config.attention_dropout and config.attention_dropout > 0:
        raise ValueError(
            f"--attention-dropout {config.attention_dropout} (Megatron-LM's default 0.1 where "
            f"not given): --tensor-parallel-mode metp's ring kernels implement no attention "
            f"dropout; set --attention-dropout 0"
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
# "a2a": the whole pass with all-to-alls in place of its K/V ring (metp.a2a_attention), where
# that applies (_Plan.a2a; elsewhere the whole pass's ring). The launchers' "auto" (the planner,
# measure.planner.Planner.metp_choices) tries it first; a model built without a launcher keeps
# the token rule above, which never takes it.
RING_PASSES = ("auto", "whole", "head-group", "a2a")

# What the one-pass backward does for Q/K/V (--metp-qkv-backward; the per-head-group loop always
# recomputes). "recompute" (Alg. 6 line 6): one more Q/K/V GEMM per layer in backward, nothing
# kept. "save": what the forward's ring read (Q after RoPE and the K/V buffer; with a q/k norm,
# the projection before it), (n + 2 ng) d values per token, is kept for backward, which then
# skips that GEMM, the bias gather and RoPE's second run: 2 (n + 2 ng) d bytes more per token and
# layer (bf16; 3 bsh/p x 2 bytes for MHA). "auto": the launchers
# (`metp train`, Megatron-LM's argument hook) and `metp plan` ask the planner
# (measure.planner.resolve_metp_attention) and save when the run still fits the GPU's memory
# with the saved Q/K/V; a model built without a launcher keeps "auto", which recomputes.
# "save+fc1": as "save", and the MLP's weight ring keeps every step's fc1 output for its backward
# too (metp.mlp.MetpMLP, weight_ring.metp_mlp_forward(keep_fc1=True)): F' more values per token
# and layer, the size of what Megatron's MLP keeps of fc1, and no fc1 GEMM in backward.
# "save+fc1+weights": as "save+fc1", and the weights the one pass and the gathered MLP
# all-gathered in forward (W_qkv, W_proj, fc1's and fc2's) stay for their backward, which then
# gathers nothing: the weights travel once per step instead of twice, (p - 1)/p x 2 bytes per
# layer parameter less per rank (of the 8 METP moves), for the whole layer's weights held from
# its forward to its backward (2 bytes per layer parameter, whatever s is: 405 MB per
# LLaMA-7B layer). The weight ring and the per-head-group loop (long sequences) gather nothing
# whole: there it is "save+fc1". It buys time only where the weights' traffic is exposed (short
# sequences) and costs one copy of W_qkv per layer (reassembled for dX), so "auto", which
# chooses by memory, never takes it: `metp plan --frontier` and --tensor-parallel-mode auto
# do, where the timeline has it fastest, and name it in the flags they print.
QKV_BACKWARD = ("auto", "recompute", "save", "save+fc1", "save+fc1+weights")
# The values that keep the MLP's fc1 output, and the one that keeps the gathered weights too.
KEEPS_FC1 = ("save+fc1", "save+fc1+weights")
KEEPS_WEIGHTS = "save+fc1+weights"


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
    return ring_pass in ("whole", "a2a")


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

    def __init__(self, module: torch.nn.Module, freqs_shard_s, causal: bool, tokens: int,
                 layout=None, balanced: bool = False, balanced_blocks: bool = False,
                 s_shard: int = 0):
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
        # Weight gradients straight into main_grad (metp.wgrad_accum).
        self.fuse_wgrad = bool(module.config.gradient_accumulation_fusion)
        self.cp_group = module.pg_collection.cp
        self.mscale = _yarn_get_concentration_factor_from_config(module.config)
        self.causal = causal
        self.scale = module._softmax_scale
        self.backend = module.kernel_backend
        self.chunks = head_chunks(self.groups_p, self.heads_p, self.d, module.config.hidden_size,
                                  self.p, tokens)
        self.whole = whole_pass(module.ring_pass, tokens, self.p)
        # --metp-ring-pass a2a (metp.a2a_attention): one sequence per micro batch, balanced when
        # causal, no CP (the METP group is the TP group), an even number of tokens per rank.
        # Packed documents and CP rings keep the whole pass's ring.
        self.a2a = (module.ring_pass == "a2a" and self.p > 1 and module.kv_blocks is None
                    and (self.layout is BALANCED if causal else layout is None)
                    and s_shard % 2 == 0)
        # a2a saving the heads: the forward's output goes to heads in backward with dO, in one
        # all-to-all, where it is small (a2a_attention.fuse_out), else ahead of two GEMMs.
        self.fuse_out = self.a2a and fuse_out(tokens * self.heads_p * self.p * self.d)
        # The whole pass's W_proj^T gradient reduce-scattered with W_qkv's, in one call, where
        # the layer is small (wgrad_accum.scatters_together).
        self.wgrads_together = scatters_together(tokens, module.config.hidden_size)
        # The one pass keeps its Q/K/V projection for backward (QKV_BACKWARD "save",
        # "save+fc1" or "save+fc1+weights": "auto" is resolved by the launcher, before the
        # model exists), and with "save+fc1+weights" the weights it gathered.
        self.save_qkv = self.whole and module.qkv_backward in ("save",) + KEEPS_FC1
        # Nothing to keep for a forward without autograd (full recompute's first pass); read
        # here, outside the autograd Function, whose forward always runs without it.
        self.keep_weights = (self.whole and module.qkv_backward == KEEPS_WEIGHTS
                             and torch.is_grad_enabled())
        self._neg_freqs = None   # unrotate's -freqs, made on first use
        # The layer's SublayerLink for this forward (metp.layer_schedule), or None: the one
        # pass posts the MLP's gathers behind its own and takes its backward's from it.
        self.link = getattr(module, "link", None) if self.whole else None
        # The layer before waits for this pass's weight-gradient reduce-scatters where both keep
        # their weights (layer_schedule.SublayerLink.defer_next_attention): the box, or None.
        later = getattr(module, "later", None)
        self.later_box = later[0] if later is not None and self.keep_weights else None

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

    @property
    def saves_heads(self) -> bool:
        """The all-to-all pass with Q/K/V saved after RoPE (or nothing): backward keeps what
        its exchange delivered (``metp.a2a_attention``, "Saving the heads")."""
        return self.a2a and self.save_qkv and self.post_is_rotation

    @property
    def post_is_rotation(self) -> bool:
        """Whether :meth:`post` is RoPE alone, or nothing: a rotation of each (q, k) pair of
        channels, linear in its input, so its vector-Jacobian product needs no input
        (:meth:`unrotate`)."""
        return self.q_norm is None and self.k_norm is None

    def unrotate(self, grad, which: int):
        """The gradient of RoPE's input from its output's (``which``: 0 for q, 1 for k).

        RoPE turns each channel pair by an angle; the VJP of a rotation is its transpose, the
        turn by minus that angle, which is RoPE again with ``-freqs``. Megatron's frequencies
        are duplicated over each rotated pair (``cat((f, f))``, or interleaved), so this is the
        same arithmetic, product for product and in the same order, as autograd's backward of
        ``apply_rotary_pos_emb`` (``cos(-f) = cos f``, ``sin(-f) = -sin f``): bit for bit
        (tests/test_metp_attention.py). Only for :attr:`post_is_rotation`."""
        if self.freqs is None:
            return grad
        if self._neg_freqs is None:
            self._neg_freqs = (-self.freqs[0], -self.freqs[1])
        return apply_rotary_pos_emb(grad, self._neg_freqs[which], config=self.config,
                                    mscale=self.mscale, cp_group=self.cp_group)

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

def _flat(t: torch.Tensor) -> torch.Tensor:
    """[b, heads, s, d] -> [s * b, heads * d] (the layout linear_proj multiplies)."""
    b, n, s, d = t.shape
    return t.permute(2, 0, 1, 3).reshape(s * b, n * d)

def _post_grad(out, inp, params, grad, accs):
    """``d inp`` of ``out = post(inp)`` (q/k norm, RoPE) given ``grad = d out``; the norm
    weights' gradients are added to ``accs``. Q and K have separate graphs (and norms), so
    taking them one at a time gives what one joint ``autograd.grad`` gives."""
    grads = torch.autograd.grad(out, [inp] + list(params), grad, allow_unused=True)
    for acc, g in zip(accs, grads[1:]):
        if g is not None:
            acc += g
    return grads[0]

def _finish_reduce(item, plan: _Plan, own_grads: list) -> None:
    handles, red, j = item
    for hnd in handles:
        hnd.wait()
    if j == plan.rank:
        own_grads[:] = red
