r"""METP's attention inner loop (paper Alg. 3-4): each rank keeps its queries, K/V travel a ring.

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

K and V travel as one buffer ``[2, b, n_kv, s/p, d]`` (one send and one receive per step,
posted together as one ``batch_isend_irecv``), and so do a block's dK and dV.

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
from megatron_metp.kernels import acc_dtype, backward_rows
from megatron_metp.packing import ALL, Layout, add_pieces, backward_pieces, forward_pieces, whole

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


def _post_next(comm: RingComm, buf: DoubleBuffer) -> None:
    """Post the K/V block in hand (K and V in one buffer: one send and one receive per step) to
    the next rank, receiving the previous rank's into the other buffer (never the one the kernel
    reads)."""
    comm.send_recv(buf.current, buf.recv_buffer())
    comm.commit()


def _kv_buffer(k: torch.Tensor, v: torch.Tensor) -> torch.Tensor:
    """K and V as one contiguous ``[2, ...]`` buffer, the one the ring sends: the caller's own
    when ``k`` and ``v`` are its two halves (no copy; :func:`stack_kv`), else a stacked copy."""
    base = k._base
    if (base is not None and v._base is base and base.dim() == k.dim() + 1
            and base.shape[0] == 2 and base.is_contiguous() and k.shape == base.shape[1:]
            and k.stride() == base.stride()[1:] and v.stride() == base.stride()[1:]
            and k.storage_offset() == base.storage_offset()
            and v.storage_offset() == base.storage_offset() + base.stride(0)):
        return base
    return torch.stack((k, v))


def stack_kv(k: torch.Tensor, v: torch.Tensor) -> Tuple[torch.Tensor, torch.Tensor]:
    """``(k', v')``: the halves of one new contiguous buffer holding ``k`` and ``v``, which the
    ring then sends as it is. For callers that can drop their own K/V before the ring runs."""
    kv = torch.stack((k, v))
    return kv[0], kv[1]


def _visible(layout) -> bool:
    """Whether every row of every block piece sees a key (no padding rows): unpacked rings,
    contiguous or balanced. The lean merge then applies (``packing.forward_pieces``)."""
    return layout is None or getattr(layout, "balanced", False)


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
    ``layout``: packed documents (``megatron_metp.packing``): attention only inside each;
    or the balanced layout's block rule (``megatron_metp.token_layout``)."""
    p = dist.get_world_size(group) if group is not None or dist.is_initialized() else 1
    rank = dist.get_rank(group) if p > 1 else 0
    block = _block_of(blocks, p)
    comm = RingComm(group) if p > 1 else None
    # K and V travel together: one contiguous [2, b, n_kv, s/p, d] buffer.
    # The layout's checks (block size, documents) run here, before anything is posted: an error
    # raised inside the loop would leave a posted batch behind and hang a caller that retries.
    _block_pieces(layout, causal, block(rank), block(rank), q.shape[2])
    kv = DoubleBuffer(_kv_buffer(k, v) if p > 1 else (k, v))
    visible = _visible(layout)
    out = lse = None
    for j in range(p):
        src = (rank - j) % p
        if j < p - 1:
            # Post the block we compute on: the receive lands in the *other* buffer, so the
            # transfer never writes what the kernel reads. That buffer was last read by the
            # previous step's kernel; on NCCL the batch is ordered after kernels already queued
            # on the compute stream, so it cannot overwrite them early.
            _post_next(comm, kv)
        out, lse = forward_pieces(
            _block_pieces(layout, causal, block(rank), block(src), q.shape[2]), q,
            kv.current[0], kv.current[1], out, lse, softmax_scale=softmax_scale,
            backend=backend, visible=visible)
        if j < p - 1:
            comm.wait()
            kv.advance()
    if out is None:
        # Packed, and every token of this rank is padding: nothing is visible to any row.
        acc = acc_dtype(q.dtype)
        out = torch.zeros(q.shape, dtype=acc, device=q.device)
        lse = torch.full(q.shape[:3], float("-inf"), dtype=acc, device=q.device)
    # Unpacked, the diagonal block is never skipped, so every row has seen a key; packed, a
    # padding row keeps out = 0 and lse = -inf.
    return out.to(q.dtype), lse


def _whole(raw) -> bool:
    """Whether a block's raw piece gradients (``packing.backward_pieces``) are one whole block."""
    return len(raw) == 1 and raw[0][0] == ALL


def _start_dkv(raw, k, acc):
    """A ``[2, *k.shape]`` accumulator (dK, dV) in ``acc`` from a block's raw piece gradients
    (``packing.backward_pieces``): the whole block's converted into it (one pass each), or zeros
    plus the pieces."""
    if _whole(raw):
        dkv = torch.empty((2, *k.shape), dtype=acc, device=k.device)
        dkv[0].copy_(raw[0][1])
        dkv[1].copy_(raw[0][2])
        return dkv
    return add_pieces(torch.zeros((2, *k.shape), dtype=acc, device=k.device), raw)


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
    _block_pieces(layout, causal, block(rank), block(rank), q.shape[2])   # before any post
    kv = DoubleBuffer(_kv_buffer(k, v) if p > 1 else (k, v))
    dq = None   # fp32 (fp64) dQ, made from the first block's (packing.backward_pieces)
    q_dtype, q_shape = q.dtype, q.shape
    # This rank's rows in the layout the kernel takes, once for the p blocks (cuDNN copies
    # strided dO / Q / O at every call otherwise).
    dout, q, out = backward_rows(dout, q, out, k, v, backend)
    own = None
    # The travelling (dK, dV) accumulators, fp32 [2, b, n_kv, s/p, d] each (one message per
    # hop): the one sent at the previous step and the one receiving. They swap roles every
    # step, so the ring holds two.
    sent = recv = None
    for j in range(p):
        src = (rank - j) % p
        if j < p - 1:
            _post_next(kv_comm, kv)
        dq, raw = backward_pieces(
            _block_pieces(layout, causal, block(rank), block(src), q.shape[2]), dout, q,
            kv.current[0], kv.current[1], out, lse, dq, softmax_scale=softmax_scale,
            backend=backend, raw=True)
        if j == 0:
            # The owner's contribution never travels (zero for a rank of padding only). A whole
            # block's stays as the kernel gave it (k's dtype) until the last hop's sum is added
            # to it, in the accumulator's dtype and rounded once (the same values as
            # converting it first: that conversion is exact).
            own = raw[0][1:] if _whole(raw) and p > 1 else _start_dkv(raw, k, acc)
            del raw
        else:
            if j == 1:
                # The accumulator of block src is born here (src + 1 is its first visitor).
                cur = _start_dkv(raw, k, acc)
                target = torch.empty_like(cur)
            else:
                # It arrived during this step's compute, from rank - 1 (its previous visitor);
                # the one sent at the previous step is free again (that batch is complete).
                dkv_comm.wait()
                cur, target = recv, sent
                add_pieces(cur, raw)
            del raw
            # Send to rank + 1: the next visitor of block src, or its owner after the last step.
            dkv_comm.send_recv(cur, target)
            dkv_comm.commit()
            sent, recv = cur, target
        if j < p - 1:
            kv_comm.wait()
            kv.advance()
    del dout, q, out   # the dense copies, where backward_rows made them
    dq = dq.to(q_dtype) if dq is not None else torch.zeros(q_shape, dtype=q_dtype,
                                                           device=k.device)
    if with_dq is not None:
        # The last dK/dV hop (posted at step p-1) is in flight and ``with_dq`` does not need it.
        # The K/V receive buffers are dropped first: they would otherwise outlive the ring.
        del kv
        with_dq(dq)
    if p == 1:
        return dq, own[0].to(k.dtype), own[1].to(v.dtype)
    dkv_comm.wait()
    # The owner's part plus the travelled sum, computed in the accumulator's dtype and written
    # in k's: one pass, where adding in place and converting after took two.
    dk = torch.add(recv[0], own[0], out=torch.empty_like(k, memory_format=torch.contiguous_format))
    dv = torch.add(recv[1], own[1], out=torch.empty_like(v, memory_format=torch.contiguous_format))
    return dq, dk, dv


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
