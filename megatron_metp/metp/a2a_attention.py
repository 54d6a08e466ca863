r"""METP attention with all-to-alls in place of the K/V ring (``--metp-ring-pass a2a``).

The whole pass (``metp.whole_pass``) as it is, weights all-gathered once and every head's Q/K/V
from one GEMM on this rank's tokens, with the ring's inner loop (``metp.ring_attention``)
swapped for DeepSpeed-Ulysses' exchange, the algorithm of Megatron-LM's ``--cp-comm-type a2a``:

1. Q, K and V each go through one all-to-all over the METP group: rank r gives up its tokens of
   the other ranks' heads and receives every rank's tokens of its own n/p heads (n_kv/p K/V
   heads). METP's balanced layout (rank r: chunks r and 2p-1-r of 2p) is Megatron's CP
   layout, so ``ulysses.attention`` puts the received chunks in sequence order.
2. One attention over the whole sequence through the kernel boundary (``megatron_metp.kernels``):
   no block pieces, no fp32 merges, no travelling fp32 dK/dV.
3. The output and its log-sum-exp go back through one all-to-all each, heads for sequence.

Backward: dO, Q, K, V, O and the log-sum-exp in (the forward's tensors, saved sequence-sharded by
the whole pass as for the ring), one attention backward, dQ, dK, dV out.

The functions take and return exactly what the ring's do (:func:`a2a_attention_forward` /
:func:`a2a_attention_backward` against ``ring_attention_forward`` / ``ring_attention_backward``),
so the whole pass saves the same tensors either way and the memory plan differs only in the
transients: the whole-sequence tensors of this rank's heads (the bytes of the local shards) and
the exchange's send and receive buffers, one tensor at a time. That is the pass where Q/K/V are
recomputed in backward, or saved before a q/k norm: 14 all-to-alls per layer over the METP
group, 12 of a Q- or K/V-sized tensor and 2 of the log-sum-exp (forward: Q, K, V in, O and its
lse out; backward: Q, K, V, O, lse and dO in, dQ, dK, dV out), (p-1)/p of each on the wire, and
two layout copies per exchange (``ulysses.attention``).

Saving the heads (:func:`a2a_heads_forward` / :func:`a2a_heads_backward`; the whole pass with
``--metp-qkv-backward save`` or more and no q/k norm, RoPE or nothing after the projection):
what backward's attention reads of Q/K/V and the lse is what the forward's exchange delivered,
the whole sequence of this rank's heads, and that is what is saved: as many bytes as this
rank's tokens of every head (the ring's saved Q and K/V buffer), so the memory plan is the
same, and backward exchanges none of them. Q, K and V travel in one all-to-all (one send
buffer, this rank's tokens of each rank's query, key and value heads side by side: one copy in,
one reordering cat out), and dQ, dK, dV come back in one, laid straight into the rows of the
weight gradient's GEMM (``whole_pass._rows_to_qkv``). Backward sends O to heads ahead of the
output projection's GEMMs, or, where it is small (:data:`FUSE_OUT_MAX_VALUES`), with dO in one
exchange. Per layer 4 or 5 all-to-alls instead of 14 (forward Q/K/V in, O out; backward O and
dO in, dQ/dK/dV out) and the bytes of backward's Q, K, V and lse exchanges fewer: BERT-Large's
layer at p = 8 (with the one-GEMM projection, ``whole_pass._project_posted``) issues 85 ops
instead of 118 (``metp plan --timeline``, ``save+fc1``). The same kernels on the same values:
bit for bit against the recomputing pass (``tests/test_metp_a2a_attention.py``).

The forward's exchanges wait on the compute stream; the backward's of what the whole pass saved
(O, and its lse and Q/K/V where the heads are not saved) are posted before the output
projection's two GEMMs and travel behind them (:func:`post_backward_inputs`), where the ring's
p - 1 hops hide behind its blocks' kernels. What it saves against the ring: the ring's p - 1
merges into the fp32 output (two strided passes over it each), the p - 1 fp32 dQ and 2(p-1)
fp32 dK/dV adds, the half-block kernel calls, and the ring's K/V (forward) and K/V + fp32 dK/dV
(backward) traffic: p - 1 hops of 2 n_kv d (forward) and 6 n_kv d (backward) values per token
against 12 exchanges of at most n d (5, saving the heads). And memory: no fp32 state the size
of the output and of dK/dV (LLaMA-7B at p = 8, 128k: 60.9 GiB planned per GPU against 62.1
with the ring, Q/K/V and fc1 saved). ``metp plan --timeline --metp-ring-pass a2a`` gives the
time (ESTIMATE).

Where it applies: one sequence per micro batch in the balanced layout (causal), or any layout
without a mask (non-causal: attention is the same under one permutation of queries, keys and
values), with no context parallelism (the METP group is the TP group) and an even number of
tokens per rank. n and n_kv divisible by p, as METP requires anyway. Elsewhere (packed
documents, under CP) the whole pass keeps its ring: ``_Plan.a2a``.
"""

from __future__ import annotations

from typing import Callable, Dict, Optional, Tuple

import torch
import torch.distributed as dist

from megatron_metp import kernels
from megatron_metp.ulysses.attention import (Pending, post_heads_to_rows, post_heads_to_seq,
                                             post_rows_to_heads, post_seq_to_heads)


def _post_to_heads(t: torch.Tensor, group) -> Pending:
    """Post ``[b, n, s/p, d]`` (this rank's tokens, any strides) -> ``[b, n/p, s, d]``."""
    return post_seq_to_heads(t.permute(2, 0, 1, 3), group)


class _Seq:
    """A :class:`Pending` heads-to-sequence exchange whose result is ``[b, n, s/p, d]`` (a view
    of a ``[s/p, b, n, d]`` tensor), or ``[b, n, s/p]`` for the log-sum-exp (``squeeze``)."""

    def __init__(self, t: torch.Tensor, group, squeeze: bool = False):
        self._pending = post_heads_to_seq(t.unsqueeze(-1) if squeeze else t, group)
        self._squeeze = squeeze

    def result(self) -> torch.Tensor:
        out = self._pending.result().permute(1, 2, 0, 3)
        return out[..., 0] if self._squeeze else out


class _Heads:
    """The lse's sequence-to-heads exchange: ``[b, n, s/p]`` -> ``[b, n/p, s]``."""

    def __init__(self, lse: torch.Tensor, group):
        self._pending = _post_to_heads(lse.unsqueeze(-1), group)

    def result(self) -> torch.Tensor:
        return self._pending.result()[..., 0]


def a2a_attention_forward(
    group: dist.ProcessGroup,
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    causal: bool,
    softmax_scale: Optional[float] = None,
    backend: Optional[str] = None,
) -> Tuple[torch.Tensor, torch.Tensor]:
    """Attention of this rank's queries ``q [b, n, s/p, d]`` to every rank's keys (``k, v
    [b, n_kv, s/p, d]``); returns ``(out [b, n, s/p, d] in q's dtype, lse [b, n, s/p] fp32)``,
    as ``ring_attention_forward`` does. The three exchanges are posted together."""
    posted = [_post_to_heads(t, group) for t in (q, k, v)]
    qh, kh, vh = (x.result() for x in posted)
    del posted
    out_h, lse_h = kernels.attention_forward(qh, kh, vh, causal=causal,
                                             softmax_scale=softmax_scale, backend=backend)
    del qh, kh, vh
    out, lse = _Seq(out_h, group), _Seq(lse_h.to(kernels.acc_dtype(q.dtype)), group, True)
    del out_h, lse_h
    return out.result(), lse.result()


def post_backward_inputs(group: dist.ProcessGroup, q=None, k=None, v=None, out=None,
                         lse=None) -> Dict[str, object]:
    """Post the exchanges of the backward's saved inputs that the caller already has, before
    the work that makes dO (the whole pass: the output projection's two GEMMs), so that they
    travel behind it; hand the result to :func:`a2a_attention_backward` (``posted``). Tensors
    as :func:`a2a_attention_backward` takes them; None: posted there instead."""
    posted = {}
    for name, t in (("q", q), ("k", k), ("v", v), ("out", out)):   # out: in q's dtype
        if t is not None:
            posted[name] = _post_to_heads(t, group)
    if lse is not None:
        posted["lse"] = _Heads(lse, group)
    return posted


def a2a_attention_backward(
    group: dist.ProcessGroup,
    dout: torch.Tensor,
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    out: torch.Tensor,
    lse: torch.Tensor,
    causal: bool,
    softmax_scale: Optional[float] = None,
    backend: Optional[str] = None,
    with_dq: Optional[Callable[[torch.Tensor], None]] = None,
    posted: Optional[Dict[str, object]] = None,
) -> Tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """Gradients of :func:`a2a_attention_forward`: ``(dq, dk, dv)`` for this rank's tokens, in
    the inputs' dtypes. ``with_dq(dq)``: the caller's work on ``dq``, run while dK and dV travel
    back (the ring's contract). ``posted``: :func:`post_backward_inputs`' exchanges (the
    others are posted here, in the same order on every rank)."""
    posted = dict(posted or {})
    missing = {n: t for n, t in (("q", q), ("k", k), ("v", v), ("out", out.to(q.dtype)),
                                 ("lse", lse)) if n not in posted}
    posted.update(post_backward_inputs(group, **missing))
    dout_h = _post_to_heads(dout.to(q.dtype), group)
    qh, kh, vh, outh, lseh = (posted.pop(n).result() for n in ("q", "k", "v", "out", "lse"))
    douth = dout_h.result()
    del dout_h
    # The kernels' layout for the one call (cuDNN's dense operands, flash-attn's [b, s, n, d]).
    douth, qh, outh = kernels.backward_rows(douth, qh, outh, kh, vh, backend)
    dqh, dkh, dvh = kernels.attention_backward(douth, qh, kh, vh, outh, lseh, causal=causal,
                                               softmax_scale=softmax_scale, backend=backend)
    del douth, qh, kh, vh, outh, lseh
    back = [_Seq(t, group) for t in (dqh.to(q.dtype), dkh.to(k.dtype), dvh.to(v.dtype))]
    del dqh, dkh, dvh
    dq = back[0].result()
    if with_dq is not None:
        with_dq(dq)
    return dq, back[1].result(), back[2].result()


def _post_side_by_side(ts, group) -> Pending:
    """One all-to-all of the tensors ``ts`` (``[s/p, b, heads_i, d]`` each, any strides) side
    by side: row j of the one send buffer (one copy in) holds this rank's tokens of rank j's
    heads of each in turn. Its result is ``[b, sum_i heads_i / p, s, d]``
    (``ulysses.attention.post_rows_to_heads``)."""
    p = dist.get_world_size(group)
    sl, b, _, d = ts[0].shape
    send = torch.empty((p, sl, b, sum(t.shape[2] for t in ts) // p, d), dtype=ts[0].dtype,
                       device=ts[0].device)
    torch.cat([t.view(sl, b, p, t.shape[2] // p, d).permute(2, 0, 1, 3, 4) for t in ts], dim=3,
              out=send)
    return post_rows_to_heads(send, group)


def a2a_heads_forward(
    group: dist.ProcessGroup,
    qkv_in: list,
    causal: bool,
    softmax_scale: Optional[float] = None,
    backend: Optional[str] = None,
) -> Tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """The forward whose backward reads the exchanged tensors (module docstring, "Saving the
    heads"): ``qkv_in = [q [s/p, b, n, d], k [s/p, b, n_kv, d], v]`` (sequence first, any
    strides; the list is emptied, so that they are freed once packed) in one all-to-all, one
    attention, the output back in another. Returns ``(out [b, n, s/p,
    d], qkv [b, (n + 2 n_kv)/p, s, d], lse [b, n/p, s])``: the output as
    :func:`a2a_attention_forward`'s, and what :func:`a2a_heads_backward` takes, the whole
    sequence of this rank's query heads, then its key heads, then its value heads, and the
    log-sum-exp of its query heads."""
    p = dist.get_world_size(group)
    q, k, v = qkv_in
    qkv_in.clear()
    nq, nkv = q.shape[2] // p, k.shape[2] // p
    dtype = q.dtype
    posted = _post_side_by_side((q, k, v), group)
    del q, k, v
    qkv = posted.result()
    del posted
    out_h, lse_h = kernels.attention_forward(qkv[:, :nq], qkv[:, nq:nq + nkv], qkv[:, nq + nkv:],
                                             causal=causal, softmax_scale=softmax_scale,
                                             backend=backend)
    out = _Seq(out_h, group)
    del out_h
    return out.result(), qkv, lse_h.to(kernels.acc_dtype(dtype))


# The forward's output (``tokens per rank x hidden`` values) at or below which backward sends
# it to heads in one all-to-all with dO (three ops fewer) rather than ahead of the output
# projection's two GEMMs (hidden behind them): that is where those GEMMs take less time than
# the host takes to issue the three ops, and the layer is host-bound (``measure.timeline``:
# ~30 us per op; BERT-Large at 16k and LLaMA-7B at 4k tokens, p = 8, have 2^21 values: their
# layer in a stack 2.22 -> 2.13 and 3.238 -> 3.228 ms fused; LLaMA-7B at 8k and 16k (2^22,
# 2^23) 3.478 -> 3.524 and 6.297 -> 6.383 ms, so there O goes ahead. ESTIMATES, H100).
FUSE_OUT_MAX_VALUES = 1 << 21


def fuse_out(values: int) -> bool:
    """Whether :func:`a2a_heads_backward` is to take the forward's output (``values`` per
    rank) with dO (:data:`FUSE_OUT_MAX_VALUES`) rather than posted ahead
    (:func:`post_backward_inputs`). Decided by the plan, outside autograd (``_Plan``)."""
    return values <= FUSE_OUT_MAX_VALUES


def a2a_heads_backward(
    group: dist.ProcessGroup,
    dout: torch.Tensor,
    out,
    qkv: torch.Tensor,
    lse: torch.Tensor,
    causal: bool,
    softmax_scale: Optional[float] = None,
    backend: Optional[str] = None,
) -> torch.Tensor:
    """Gradients of :func:`a2a_heads_forward`: ``dout`` and the forward's output ``out``
    (``[b, n, s/p, d]`` each, this rank's tokens) in one all-to-all (:func:`fuse_out`), or
    ``out`` as the :class:`Pending` exchange :func:`post_backward_inputs` posted ahead; ``qkv``
    and ``lse`` as the forward returned them. Returns ``[s/p, b, p, (n + 2 n_kv)/p, d]``: this
    rank's tokens, row j rank j's heads' gradients in Megatron's row order (per query group
    its n/n_kv query heads' dQ, then its dK and dV), as one all-to-all delivered them (a view,
    no copy): the caller lays them out for its weight gradient, one copy where nothing turns
    them first (``whole_pass._rows_to_qkv``)."""
    nq = dout.shape[1] // dist.get_world_size(group)
    nkv = (qkv.shape[1] - nq) // 2
    if isinstance(out, Pending):
        douth = _post_to_heads(dout.to(qkv.dtype), group).result()
        outh = out.result()
    else:
        both = _post_side_by_side([t.to(qkv.dtype).permute(2, 0, 1, 3) for t in (out, dout)],
                                  group).result()
        outh, douth = both[:, :nq], both[:, nq:]
        del both
    qh, kh, vh = qkv[:, :nq], qkv[:, nq:nq + nkv], qkv[:, nq + nkv:]
    douth, qh, outh = kernels.backward_rows(douth, qh, outh, kh, vh, backend)
    dqh, dkh, dvh = kernels.attention_backward(douth, qh, kh, vh, outh, lse, causal=causal,
                                               softmax_scale=softmax_scale, backend=backend)
    del douth, qh, kh, vh, outh
    # Each query group's dQ, dK, dV side by side (Megatron's rows of W_qkv): one cat, as
    # three heads-blocks would be.
    b, _, s, d = dqh.shape
    dqkv = torch.cat([t.to(qkv.dtype).view(b, nkv, -1, s, d) for t in (dqh, dkh, dvh)],
                     dim=2).view(b, -1, s, d)
    del dqh, dkh, dvh
    back = post_heads_to_rows(dqkv, group)
    del dqkv
    return back.result()
