"""All-to-all context-parallel attention (``--cp-comm-type a2a``): heads for sequence.

Megatron-LM's a2a context parallelism runs Transformer Engine's ``AttnFuncWithCPAndQKVOA2A``,
which needs CUDA. This is the same algorithm in plain collectives, so that stock TP x CP plans
with a2a trace and measure on CPU (``measure.planner.CP_A2A_STAND_IN``):

1. Q, K and V each go through one all-to-all over the CP group: every rank gives up its
   sequence shard of the other ranks' heads and receives all ranks' shards of its own heads.
   After it a rank holds the whole sequence for n/cp query heads (n_kv/cp K/V heads).
2. The received chunks are put in sequence order (Megatron's CP layout gives rank r chunks r
   and 2cp-1-r of 2cp), and one causal attention runs over the whole sequence: the kernel
   boundary (``megatron_metp.kernels``), no ring and no merge.
3. The output goes back through one all-to-all, heads for sequence.

The backward mirrors it: dO in, one attention backward, dQ, dK, dV out (four all-to-alls each
way, the forward's three plus dO's or the output's).

Saved for backward: the whole-sequence Q, K, V of this rank's heads, the output and the fp32
log-sum-exp [b, n/cp, s]. These are the bytes of the local shards with all heads (s n / cp =
(s / cp) n): TE's a2a saves the same (its ``ctx.save_for_backward`` of the post-a2a q, k, v,
the output and the softmax statistics).

Shapes (Megatron's, sequence first; this rank's tokens in Megatron's CP order)::

    q            [s/cp, b, n,    d]
    k, v         [s/cp, b, n_kv, d]     n % cp == 0 and n_kv % cp == 0 (TE's condition too)
    returns      [s/cp, b, n,    d]
"""

from __future__ import annotations

from typing import Optional

import torch
import torch.distributed as dist

from megatron_metp import kernels


def check_heads(n: int, n_kv: int, cp: int) -> None:
    """a2a splits the heads over the CP ranks: refuse head counts it cannot split."""
    if n % cp or n_kv % cp:
        raise ValueError(
            f"--cp-comm-type a2a splits the attention heads over --context-parallel-size {cp}: "
            f"{n} query heads and {n_kv} key/value heads per tensor-parallel rank must both be "
            f"multiples of it; use --cp-comm-type p2p or a smaller context-parallel size")


def _exchange(send: torch.Tensor, group, async_op: bool = False):
    """One all-to-all of ``send`` [cp, ...]: row j goes to rank j; row i of the result came
    from rank i. Returns ``(recv, work)``; ``work`` is None unless ``async_op`` (wait on it
    before reading ``recv``)."""
    recv = torch.empty_like(send)
    if dist.get_world_size(group) == 1:
        recv.copy_(send)
        return recv, None
    return recv, dist.all_to_all_single(recv, send, group=group, async_op=async_op)


class Pending:
    """An exchange in flight (:func:`post_seq_to_heads`, :func:`post_heads_to_seq`):
    :meth:`result` waits for it and lays the received rows out."""

    def __init__(self, recv, work, finish, send):
        self._recv, self._work, self._finish = recv, work, finish
        self._send = send   # alive until the exchange completes

    def result(self) -> torch.Tensor:
        if self._work is not None:
            self._work.wait()
        out = self._finish(self._recv)
        self._recv = self._send = self._work = None
        return out


def post_seq_to_heads(x: torch.Tensor, group, async_op: bool = True) -> Pending:
    """Post :func:`seq_to_heads`'s exchange of ``x``; its result when :meth:`Pending.result`
    is asked for."""
    cp = dist.get_world_size(group)
    sl, b, n, d = x.shape
    send = x.reshape(sl, b, cp, n // cp, d).permute(2, 0, 1, 3, 4).contiguous()
    return post_rows_to_heads(send, group, async_op)


def post_rows_to_heads(send: torch.Tensor, group, async_op: bool = True) -> Pending:
    """Post the exchange of ``send [cp, s/cp, b, hh, d]`` (row j: this rank's tokens of rank
    j's ``hh`` heads, dense), whose result is ``[b, hh, s, d]``: the whole sequence in order,
    this rank's heads (:func:`post_seq_to_heads` makes ``send`` from a ``[s/cp, b, n, d]``
    tensor; one ``send`` may hold several tensors' heads side by side)."""
    cp, sl, b, hh, d = send.shape
    recv, work = _exchange(send, group, async_op)     # [cp (source rank), s/cp, b, hh, d]

    def finish(recv):
        # [b, hh, c, d] views of the 2cp received chunks.
        halves = recv.view(cp, 2, sl // 2, b, hh, d).permute(0, 1, 3, 4, 2, 5)
        # Rank i sent chunks i and 2cp-1-i: the first halves are chunks 0..cp-1, the second
        # halves in reverse rank order chunks cp..2cp-1. One cat of the 2cp chunk views puts
        # them in order (a flip would copy the second halves once more first), into a dense
        # [b, hh, s, d]: the layout cuDNN's attention reads without a copy of its own.
        chunks = [halves[i, 0] for i in range(cp)] + [halves[i, 1] for i in reversed(range(cp))]
        return torch.cat(chunks, dim=2)

    return Pending(recv, work, finish, send)


def seq_to_heads(x: torch.Tensor, group) -> torch.Tensor:
    """``[s/cp, b, n, d]`` (this rank's two chunks, all heads) -> ``[b, n/cp, s, d]`` (the
    whole sequence in order, this rank's heads)."""
    return post_seq_to_heads(x, group, async_op=False).result()


def post_heads_to_seq(y: torch.Tensor, group, async_op: bool = True) -> Pending:
    """Post :func:`heads_to_seq`'s exchange of ``y``."""
    return post_heads_to_rows(y, group, async_op, flat=True)


def post_heads_to_rows(y: torch.Tensor, group, async_op: bool = True,
                       flat: bool = False) -> Pending:
    """Post the exchange of ``y [b, hh, s, d]`` (the whole sequence, this rank's heads) whose
    result is ``[s/cp, b, cp, hh, d]``: this rank's tokens, rank j's heads in row j (a view of
    what was received, no copy); ``flat``: ``[s/cp, b, cp hh, d]`` (:func:`post_heads_to_seq`,
    one copy)."""
    cp = dist.get_world_size(group)
    b, hh, s, d = y.shape
    c = s // (2 * cp)
    chunks = y.permute(2, 0, 1, 3).reshape(2 * cp, c, b, hh, d)   # splits s: a view
    # Rank i gets chunks i and 2cp-1-i: one stack of the 2cp chunk views in that order.
    send = torch.stack([chunks[k] for i in range(cp) for k in (i, 2 * cp - 1 - i)]).view(
        cp, 2, c, b, hh, d)
    recv, work = _exchange(send, group, async_op)        # [cp (head group), 2, c, b, hh, d]

    def finish(recv):
        rows = recv.permute(1, 2, 3, 0, 4, 5)                # [2, c, b, cp, hh, d]
        return rows.reshape(2 * c, b, cp * hh, d) if flat else rows.flatten(0, 1)

    return Pending(recv, work, finish, send)


def heads_to_seq(y: torch.Tensor, group) -> torch.Tensor:
    """The inverse of :func:`seq_to_heads`: ``[b, n/cp, s, d] -> [s/cp, b, n, d]``."""
    return post_heads_to_seq(y, group, async_op=False).result()


class UlyssesAttnFunc(torch.autograd.Function):
    """a2a attention (module docstring); saves the whole-sequence tensors of its heads."""

    @staticmethod
    def forward(ctx, q, k, v, group, causal, softmax_scale):
        qh, kh, vh = (seq_to_heads(t, group) for t in (q, k, v))
        out, lse = kernels.attention_forward(qh, kh, vh, causal=causal,
                                             softmax_scale=softmax_scale)
        ctx.save_for_backward(qh, kh, vh, out, lse)
        ctx.group, ctx.causal, ctx.softmax_scale = group, causal, softmax_scale
        return heads_to_seq(out, ctx.group)

    @staticmethod
    def backward(ctx, dout):
        qh, kh, vh, out, lse = ctx.saved_tensors
        douth = seq_to_heads(dout, ctx.group)
        dq, dk, dv = kernels.attention_backward(douth, qh, kh, vh, out, lse, causal=ctx.causal,
                                                softmax_scale=ctx.softmax_scale)
        return (heads_to_seq(dq, ctx.group), heads_to_seq(dk, ctx.group),
                heads_to_seq(dv, ctx.group), None, None, None)


def ulysses_attention(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, group, *,
                      causal: bool, softmax_scale: Optional[float] = None) -> torch.Tensor:
    """Differentiable a2a attention on Megatron-shaped CP shards (module docstring)."""
    cp = dist.get_world_size(group)
    check_heads(q.shape[2], k.shape[2], cp)
    if q.shape[0] % 2:
        raise ValueError(f"a2a attention needs an even number of tokens per CP rank (two "
                         f"chunks of Megatron's CP layout), not {q.shape[0]}")
    return UlyssesAttnFunc.apply(q, k, v, group, causal, softmax_scale)
