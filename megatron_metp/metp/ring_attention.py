"""METP's attention inner loop (paper Alg. 3-4): each rank keeps its queries, K/V travel a ring.

Shapes on rank r of a ring of p ranks (rank r owns tokens [r*s/p, (r+1)*s/p), contiguous)::

    q_shard_s     [b, n,   s/p, d]   this rank's queries (never leave the rank)
    k_shard_s     [b, n_kv, s/p, d]  this rank's keys / values; travel the ring
    v_shard_s     [b, n_kv, s/p, d]
    out_shard_s   [b, n,   s/p, d]   q's dtype
    lse_shard_s   [b, n,   s/p]      fp32 (fp64 for fp64 inputs)

Forward, step j = 0 .. p-1: rank r holds the K/V block of rank src = (r - j) mod p (RingComm
sends to r+1 and receives from r-1), posts the transfer of that block to r+1 (receiving the
next into the other half of a double buffer), attends its queries to the block through the
kernel boundary (``megatron_metp.kernels``), merges the partial result into an fp32 accumulator
with the max-subtracted log-sum-exp merge, then waits for the transfer. The paper's Alg. 3 keeps
an unnormalised sum and a row sum (lines 5-7, 12); merging normalised blocks by their lse is the
same computation without the exp overflow.

Causal with contiguous shards::

              key block src ->   0     1     2     3
    query rank 0              [  \  |  .  |  .  |  .  ]    \  diagonal: causal mask
               1              [  #  |  \  |  .  |  .  ]    #  below: fully visible
               2              [  #  |  #  |  \  |  .  ]    .  above: skipped (the block is
               3              [  #  |  #  |  #  |  \  ]       still forwarded on the ring)

Under context parallelism the ring is longer than the TP group (METP's K/V ring, see
``megatron_metp.parallel_state``) and ring order is not sequence order: ``blocks[i]`` is the index
of ring rank i's block in the sequence (all blocks of s/p tokens, p = ring length), and the
causal rule above reads those indices instead of the ring ranks (``blocks=None``: identity).

Backward (Alg. 4): K/V make the same trip; dQ accumulates locally in fp32; the dK/dV of a block
travel with it so they end at its owner. The owner keeps its own (step 0) contribution local;
the travelling accumulator is born at rank src+1 and reaches the owner after p-1 hops, each
one sent while the next block is computed; the last, after the last block, while the caller's
``with_dq`` work runs (METP attention's dQ back-projection). dK/dV travel in fp32 (accumulating
p-1 partial sums in bf16 would lose bits the TP baseline keeps).
"""

from __future__ import annotations

from typing import Callable, Optional, Sequence, Tuple

import torch
import torch.distributed as dist

from megatron_metp.comm import DoubleBuffer, RingComm
from megatron_metp.kernels import acc_dtype
from megatron_metp.packing import Layout, backward_pieces, forward_pieces, whole

# Layouts a [b, n, s, d] block may be stored in without a copy: bnsd itself, Megatron's
# sbnd (a projection of [s, b, h] hidden states) and bsnd (flash-attn's).
_LAYOUTS = ((0, 1, 2, 3), (2, 0, 1, 3), (0, 2, 1, 3))


def _travel_layout(t: torch.Tensor):
    """``(base, back)``: a contiguous tensor holding ``t``'s data and the permutation giving
    back the [b, n, s, d] view. Blocks travel as ``base`` so that sending needs no copy."""
    for perm in _LAYOUTS:
        base = t.permute(perm)
        if base.is_contiguous():
            back = tuple(perm.index(i) for i in range(4))
            return base, back
    return t.contiguous(), (0, 1, 2, 3)


def _block_mode(causal: bool, q_block: int, k_block: int) -> Optional[bool]:
    """None: skip the block; otherwise the ``causal`` flag of the kernel call. ``q_block`` /
    ``k_block``: the sequence positions of the query and key blocks, in units of one block
    (every rank holds one contiguous block of equal length)."""
    if not causal:
        return False
    if k_block == q_block:
        return True
    return False if k_block < q_block else None


def _block_pieces(layout, causal: bool, q_block: int, k_block: int, n: int):
    """The kernel calls of one (query block, key block) pair: the whole block or nothing
    (:func:`_block_mode`), or, for packed documents, the pieces they leave
    (``megatron_metp.packing``); ``n``: tokens per block."""
    if layout is None:
        return whole(_block_mode(causal, q_block, k_block))
    return layout.block_pieces(q_block, k_block, n, causal)


def _block_of(blocks: Optional[Sequence[int]], p: int):
    if blocks is None:
        return lambda i: i
    if len(blocks) != p:
        raise ValueError(f"ring attention: {len(blocks)} block indices for a ring of {p} ranks")
    return blocks.__getitem__


def _post_next_kv(comm: RingComm, k_buf: DoubleBuffer, v_buf: DoubleBuffer) -> None:
    """Post the K/V blocks in hand to the next rank, receiving the previous rank's into the other
    buffers (never the ones the kernel reads)."""
    comm.send_recv(k_buf.current, k_buf.recv_buffer())
    comm.send_recv(v_buf.current, v_buf.recv_buffer())
    comm.commit()


def ring_attention_forward(
    group: Optional[dist.ProcessGroup],
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    causal: bool,
    softmax_scale: Optional[float] = None,
    backend: Optional[str] = None,
    blocks: Optional[Sequence[int]] = None,
    layout: Optional[Layout] = None,
) -> Tuple[torch.Tensor, torch.Tensor]:
    """Attention of this rank's queries to every rank's keys; returns ``(out, lse)``.
    ``backend``: the kernel (``megatron_metp.kernels.BACKENDS``), None to choose per block.
    ``blocks``: each ring rank's block index in the sequence (module docstring).
    ``layout``: packed documents (``megatron_metp.packing``): attention only inside each."""
    p = dist.get_world_size(group) if group is not None or dist.is_initialized() else 1
    rank = dist.get_rank(group) if p > 1 else 0
    block = _block_of(blocks, p)
    comm = RingComm(group) if p > 1 else None
    (k_base, k_back), (v_base, v_back) = _travel_layout(k), _travel_layout(v)
    k_buf, v_buf = DoubleBuffer(k_base), DoubleBuffer(v_base)
    out = lse = None
    for j in range(p):
        src = (rank - j) % p
        if j < p - 1:
            # Post the block we compute on: the receive lands in the *other* buffer, so the
            # transfer never writes what the kernel reads. That buffer was last read by the
            # previous step's kernel; on NCCL the batch is ordered after kernels already queued
            # on the compute stream, so it cannot overwrite them early.
            _post_next_kv(comm, k_buf, v_buf)
        out, lse = forward_pieces(
            _block_pieces(layout, causal, block(rank), block(src), q.shape[2]), q,
            k_buf.current.permute(k_back), v_buf.current.permute(v_back), out, lse,
            softmax_scale=softmax_scale, backend=backend)
        if j < p - 1:
            comm.wait()
            k_buf.advance()
            v_buf.advance()
    if out is None:
        # Packed, and every token of this rank is padding: nothing is visible to any row.
        acc = acc_dtype(q.dtype)
        out = torch.zeros(q.shape, dtype=acc, device=q.device)
        lse = torch.full(q.shape[:3], float("-inf"), dtype=acc, device=q.device)
    # Unpacked, the diagonal block is never skipped, so every row has seen a key; packed, a
    # padding row keeps out = 0 and lse = -inf.
    return out.to(q.dtype), lse


def ring_attention_backward(
    group: Optional[dist.ProcessGroup],
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
    blocks: Optional[Sequence[int]] = None,
    layout: Optional[Layout] = None,
) -> Tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """Gradients of :func:`ring_attention_forward`: ``(dq, dk, dv)`` for this rank's shards.

    ``out`` / ``lse`` are this rank's merged forward results (the kernels recompute each
    block's probabilities from them). ``with_dq(dq)``: the caller's work on the finished ``dq``
    (q's dtype), run while the last dK/dV hop is in flight rather than after it (METP attention
    back-projects dQ there); ``dq`` is returned as well. ``blocks``, ``layout``: as for the
    forward.
    """
    p = dist.get_world_size(group) if group is not None or dist.is_initialized() else 1
    rank = dist.get_rank(group) if p > 1 else 0
    block = _block_of(blocks, p)
    acc = acc_dtype(q.dtype)
    kv_comm = RingComm(group) if p > 1 else None
    # A second ring for the gradient accumulators: their transfer overlaps the next block's
    # compute. Every rank issues the two rings' batches in the same program order, so the
    # pairwise message order (gloo) / communicator order (NCCL) matches on both ends.
    dkv_comm = RingComm(group) if p > 1 else None
    (k_base, k_back), (v_base, v_back) = _travel_layout(k), _travel_layout(v)
    k_buf, v_buf = DoubleBuffer(k_base), DoubleBuffer(v_base)
    dq = torch.zeros(q.shape, dtype=acc, device=q.device)
    dk_own = dv_own = None
    # The travelling (dK, dV) accumulator pairs, fp32 [b, n_kv, s/p, d] each: the one sent at
    # the previous step and the one receiving. They swap roles every step, so the ring holds
    # two pairs; at the first hop the block's own kernel gradients are sent, not a copy.
    sent = recv = None
    for j in range(p):
        src = (rank - j) % p
        if j < p - 1:
            _post_next_kv(kv_comm, k_buf, v_buf)
        dk_b, dv_b = backward_pieces(
            _block_pieces(layout, causal, block(rank), block(src), q.shape[2]), dout, q,
            k_buf.current.permute(k_back), v_buf.current.permute(v_back), out, lse, dq,
            softmax_scale=softmax_scale, backend=backend)
        if j == 0:
            # The owner's contribution never travels (zero for a rank of padding only).
            if dk_b is None:
                dk_own = torch.zeros(k.shape, dtype=acc, device=k.device)
                dv_own = torch.zeros(v.shape, dtype=acc, device=v.device)
            else:
                dk_own, dv_own = dk_b.to(acc), dv_b.to(acc)
        else:
            if j == 1:
                # The accumulator of block src is born here (src + 1 is its first visitor).
                if dk_b is None:
                    cur = (torch.zeros(k.shape, dtype=acc, device=k.device),
                           torch.zeros(v.shape, dtype=acc, device=v.device))
                else:
                    cur = (dk_b.to(acc).contiguous(), dv_b.to(acc).contiguous())
                target = tuple(torch.empty_like(t) for t in cur)
            else:
                # It arrived during this step's compute, from rank - 1 (its previous visitor);
                # the pair sent at the previous step is free again (that batch is complete).
                dkv_comm.wait()
                cur, target = recv, sent
                if dk_b is not None:
                    cur[0].add_(dk_b)
                    cur[1].add_(dv_b)
            del dk_b, dv_b
            # Send to rank + 1: the next visitor of block src, or its owner after the last step.
            dkv_comm.send_recv(cur[0], target[0])
            dkv_comm.send_recv(cur[1], target[1])
            dkv_comm.commit()
            sent, recv = cur, target
        if j < p - 1:
            kv_comm.wait()
            k_buf.advance()
            v_buf.advance()
    dq = dq.to(q.dtype)
    if with_dq is not None:
        # The last dK/dV hop (posted at step p-1) is in flight and ``with_dq`` does not need it.
        # The K/V receive buffers are dropped first: they would otherwise outlive the ring.
        del k_buf, v_buf
        with_dq(dq)
    if p > 1:
        dkv_comm.wait()
        dk_own, dv_own = dk_own.add_(recv[0]), dv_own.add_(recv[1])
    return dq, dk_own.to(k.dtype), dv_own.to(v.dtype)


class RingAttentionFunction(torch.autograd.Function):
    """Autograd wrapper: fills ``ctx`` and delegates to the stateless functions above."""

    @staticmethod
    def forward(ctx, q, k, v, group, causal, softmax_scale, backend, blocks=None, layout=None):
        out, lse = ring_attention_forward(group, q, k, v, causal, softmax_scale, backend, blocks,
                                          layout)
        ctx.save_for_backward(q, k, v, out, lse)
        ctx.group, ctx.causal, ctx.softmax_scale = group, causal, softmax_scale
        ctx.backend, ctx.blocks, ctx.layout = backend, blocks, layout
        return out

    @staticmethod
    def backward(ctx, dout):
        q, k, v, out, lse = ctx.saved_tensors
        dq, dk, dv = ring_attention_backward(
            ctx.group, dout, q, k, v, out, lse, ctx.causal, ctx.softmax_scale, ctx.backend,
            blocks=ctx.blocks, layout=ctx.layout,
        )
        return dq, dk, dv, None, None, None, None, None, None


def ring_attention(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    group: Optional[dist.ProcessGroup],
    causal: bool = True,
    softmax_scale: Optional[float] = None,
    backend: Optional[str] = None,
    blocks: Optional[Sequence[int]] = None,
    layout: Optional[Layout] = None,
) -> torch.Tensor:
    """Differentiable ring attention over ``group`` (shapes in the module docstring);
    ``blocks``: each ring rank's block index in the sequence, None for ring order;
    ``layout``: packed documents, None for one sequence."""
    return RingAttentionFunction.apply(q, k, v, group, causal, softmax_scale, backend,
                                       None if blocks is None else tuple(blocks), layout)
