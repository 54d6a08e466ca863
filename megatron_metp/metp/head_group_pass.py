"""METP attention, one K/V ring pass per head group (paper Alg. 5-6; ``--metp-ring-pass
head-group``): head group j's weights are broadcast from rank j one step ahead, its Q/K/V
projected, its ring attention run and its output projected; the backward broadcasts the weights
again, recomputes Q/K/V and reduces dW_qkv_j / dW_proj_j to rank j while the next head group
computes. Long inputs slice each head group into query groups (``attention_plan.head_chunks``).
The module and its shapes: ``metp.attention``.
"""

from __future__ import annotations

from typing import List, Optional

import torch
import torch.distributed as dist

from megatron_metp.metp.attention_plan import (_Plan, _bnsd, _finish_reduce, _flat, _post_grad,
                                               _sbnd)
from megatron_metp.metp.ring_attention import (ring_attention_backward, ring_attention_forward,
                                               stack_kv)
from megatron_metp.metp.wgrad_accum import reduce_dtype, weight_grad


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
        # Weight gradients are reduced over p ranks: keep them (and the reduce) in fp32 for
        # bf16/fp16 weights, so the sum adds no rounding TP's single matmul does not have; in
        # bf16 under bf16 main_grad (wgrad_accum.reduce_dtype, read off this rank's own shard).
        gacc = reduce_dtype(w_proj)
        for j in range(plan.p):
            w_qkv_j, b_qkv_j, w_proj_j = weights.get(j)
            weights.post(j + 1)
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
        return (None, dx2d.view(s, b, h), weight_grad(dw_qkv, w_qkv, plan.fuse_wgrad),
                weight_grad(db_qkv, b_qkv, plan.fuse_wgrad) if ctx.has_bias else None,
                weight_grad(dw_proj, w_proj, plan.fuse_wgrad), *dnorm)

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
