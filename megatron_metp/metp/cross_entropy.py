"""METP's LM head and loss: the vocabulary shards travel the ring, the logits never exist whole.

Megatron's TP head all-gathers the sequence (``[s/p, b, h] -> [s, b, h]``), computes the logits
of every token against this rank's vocabulary shard (``[s, b, V/p]`` in bf16, an fp32 copy in
the vocab-parallel cross entropy, and its softmax) and all-reduces three per-token statistics.
METP keeps the tokens on their rank and passes the output weight's shards around the ring, as
its MLP passes fc1/fc2 (``weight_ring``)::

    x_shard_s   [n/p, h]      this rank's tokens after the final norm (n = s b)
    w_shard_v   [V/p, h]      the output layer's (or the tied embedding's) vocabulary shard
    labels      [n/p]         global vocabulary ids of this rank's tokens
    loss        [n/p] fp32    lse_t - logit_t[label_t]

Forward: at ring step j rank i holds shard ``(i - j) % p``; for each chunk of its tokens it
computes that chunk's fp32 logits against the shard, folds them into a running log-sum-exp and
picks the target logit when the label falls in the shard. Only ``[chunk, V/p]`` fp32 logits
exist at a time (the chunk is sized so that they are no larger than ``x_shard_s``), and nothing
but ``x_shard_s`` and the per-token ``lse`` is kept for backward.

Backward: the shards circulate again (``weight_ring.circulate_for_backward``). Per step and
chunk the logits are recomputed, ``d logits = (softmax - onehot(label)) * grad_loss``, the
input gradient adds ``d logits @ W_r`` and the shard's gradient adds ``d logits^T x`` in fp32,
travelling home with its accumulator: p - 1 hops of the weights in forward, p - 1 of the
weights and p - 1 of the accumulators in backward, as the MLP.

The result equals Megatron's ``vocab_parallel_cross_entropy`` on the full logits (fp32 math in
both; tests against fp64).
"""

from __future__ import annotations

from typing import Optional

import torch
import torch.distributed as dist

from megatron_metp.kernels import acc_dtype
from megatron_metp.metp.weight_ring import (
    _add_mm,
    _ring_size,
    circulate_for_backward,
    circulate_for_forward,
)

__all__ = ["metp_cross_entropy", "MetpCrossEntropyFunction", "default_chunk_tokens"]


def default_chunk_tokens(n: int, h: int, v_shard: int, elem: int) -> int:
    """Tokens per chunk so that one chunk's fp32 logits ``[chunk, V/p]`` take no more bytes than
    the hidden states ``[n, h]`` themselves (at least one token)."""
    return max(1, min(n, (n * h * elem) // (v_shard * 4)))


def _owner_range(step: int, rank: int, p: int, v_shard: int):
    owner = (rank - step) % p
    return owner * v_shard, (owner + 1) * v_shard


# The softmax math in fp32 (as Megatron's vocab-parallel cross entropy, which casts the
# logits to fp32); fp64 data stays fp64 (the tests' reference precision).
_math_dtype = acc_dtype


def _chunk_logits(x_c: torch.Tensor, w: torch.Tensor) -> torch.Tensor:
    # The GEMM in the data's dtype, as Megatron's output layer.
    return torch.mm(x_c, w.t()).to(_math_dtype(x_c.dtype))


def _targets(labels_c: torch.Tensor, lo: int, hi: int):
    """``(in_shard [c] bool, column [c, 1])``: whether each label is in [lo, hi), and its
    shard-local column (clamped, so valid everywhere; only used where ``in_shard``). Masks, not
    indices: no data-dependent shapes, so fake tensors plan it too."""
    in_shard = (labels_c >= lo) & (labels_c < hi)
    return in_shard, (labels_c - lo).clamp(0, hi - lo - 1).unsqueeze(1)


def metp_ce_forward(x: torch.Tensor, w: torch.Tensor, labels: torch.Tensor,
                    group: Optional[dist.ProcessGroup], chunk: int):
    """``(loss [n] fp32, lse [n] fp32)`` for this rank's tokens ``x [n, h]``."""
    p = _ring_size(group)
    rank = dist.get_rank(group) if p > 1 else 0
    n, v_shard = x.shape[0], w.shape[0]
    acc = _math_dtype(x.dtype)
    lse = torch.full((n,), float("-inf"), dtype=acc, device=x.device)
    target = torch.zeros(n, dtype=acc, device=x.device)

    def step(j: int, cur) -> None:
        (w_r,) = cur
        lo, hi = _owner_range(j, rank, p, v_shard)
        for a in range(0, n, chunk):
            logits = _chunk_logits(x[a:a + chunk], w_r)
            torch.logaddexp(lse[a:a + chunk], torch.logsumexp(logits, dim=-1),
                            out=lse[a:a + chunk])
            in_shard, col = _targets(labels[a:a + chunk], lo, hi)
            picked = logits.gather(1, col).squeeze(1)
            target[a:a + chunk] = torch.where(in_shard, picked, target[a:a + chunk])
            del logits

    circulate_for_forward([w], group, step)
    return lse - target, lse


def metp_ce_backward(x: torch.Tensor, w: torch.Tensor, labels: torch.Tensor,
                     lse: torch.Tensor, grad_loss: torch.Tensor,
                     group: Optional[dist.ProcessGroup], chunk: int):
    """``(grad_x [n, h], grad_w [V/p, h])``, gradients in the dtypes of ``x`` and ``w``."""
    p = _ring_size(group)
    rank = dist.get_rank(group) if p > 1 else 0
    n, v_shard = x.shape[0], w.shape[0]
    grad_x = torch.zeros_like(x)
    g = grad_loss.to(lse.dtype)

    def step(j: int, cur, target):
        (w_r,), (dw,) = cur, target
        lo, hi = _owner_range(j, rank, p, v_shard)
        for a in range(0, n, chunk):
            x_c = x[a:a + chunk]
            d = _chunk_logits(x_c, w_r)
            d.sub_(lse[a:a + chunk, None]).exp_()  # softmax over the whole vocabulary
            in_shard, col = _targets(labels[a:a + chunk], lo, hi)
            d.scatter_add_(1, col, -in_shard.to(d.dtype).unsqueeze(1))  # - onehot(label)
            d.mul_(g[a:a + chunk, None])
            d_lp = d.to(x.dtype)
            del d
            grad_x[a:a + chunk].addmm_(d_lp, w_r)
            _add_mm(dw, d_lp.t(), x_c)  # dw: an accumulator or a Pending contribution
        return None

    (grad_w,) = circulate_for_backward([w], group, step)
    return grad_x, grad_w.to(w.dtype)


class MetpCrossEntropyFunction(torch.autograd.Function):
    """``loss = MetpCrossEntropyFunction.apply(x [n, h], w [V/p, h], labels [n], group, chunk)``.

    Saves ``x``, the per-token ``lse`` and references to ``w`` and ``labels``: no logits.
    """

    @staticmethod
    def forward(ctx, x, w, labels, group, chunk):
        loss, lse = metp_ce_forward(x, w, labels, group, chunk)
        ctx.group, ctx.chunk = group, chunk
        ctx.save_for_backward(x, w, labels, lse)
        return loss

    @staticmethod
    @torch.autograd.function.once_differentiable
    def backward(ctx, grad_loss):
        x, w, labels, lse = ctx.saved_tensors
        grad_x, grad_w = metp_ce_backward(x, w, labels, lse, grad_loss.contiguous(),
                                          ctx.group, ctx.chunk)
        return grad_x, grad_w, None, None, None


def metp_cross_entropy(hidden_shard_s: torch.Tensor, weight_shard_v: torch.Tensor,
                       labels_shard_s: torch.Tensor, group: Optional[dist.ProcessGroup],
                       chunk_tokens: Optional[int] = None) -> torch.Tensor:
    """Per-token loss ``[s/p, b]`` fp32 of ``hidden_shard_s [s/p, b, h]`` (after the final norm)
    against the vocabulary shards of ``weight_shard_v [V/p, h]`` travelling ``group``'s ring.
    ``labels_shard_s [s/p, b]``: global vocabulary ids of the same tokens."""
    s_local, b, h = hidden_shard_s.shape
    x = hidden_shard_s.reshape(s_local * b, h)
    chunk = chunk_tokens or default_chunk_tokens(x.shape[0], h, weight_shard_v.shape[0],
                                                 x.element_size())
    loss = MetpCrossEntropyFunction.apply(x, weight_shard_v, labels_shard_s.reshape(-1),
                                          group, chunk)
    return loss.view(s_local, b)
