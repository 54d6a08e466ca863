"""WallFacer attention: team all-gather, multi-ring P2P, lse-merged reduce-scatter (Alg. 1).

Layout inside this module is *chunk-major*: a rank's tokens are its two chunks of the 2P-chunk
sequence (``zigzag``), kept as a leading dim so that every chunk is a contiguous view::

    q          [2, b, n,    c, d]   this rank's queries: chunk ids zigzag.chunk_ids(idx)
    k, v       [2, b, n_kv, c, d]   this rank's keys / values (GQA: n_kv heads travel)
    q_team     [C, 2, b, n, c, d]   the team's queries after the all-gather (member-major)
    kv_team    [C, 2(k|v), 2, b, n_kv, c, d]   a team's K/V: the block that travels the ring
    out        [2, b, n, c, d]      q's dtype;   lse [2, b, n, c] fp32 (fp64 for fp64)

with c = s / (2P) tokens per chunk and C the team size. Causal attention is computed chunk pair
by chunk pair (key chunk < query chunk: full; equal: the diagonal's causal mask; greater:
skipped), so any chunk layout is exact and Megatron's zigzag layout is balanced
(see ``zigzag``). Every kernel call goes through ``megatron_metp.kernels``.

Forward (per rank (team t = (g, j), member m); G = P / C^2 ring steps)::

    1  all-gather q, k, v in the team                    (C - 1) (A_q + 2 A_kv) received
    2  init send: kv_team -> init_send_to                 2 C A_kv  (none for a self-send)
    3  G steps: compute q_team x kv_cur while kv_cur goes to ring_next   (G - 1) 2 C A_kv
    4  all-gather the team's lse, rescale, reduce-scatter the fp32 outputs
                                                           (C - 1) (A_q + L)
Backward (K/V and their gradients stay, queries travel; the transposes of 1 and 4)::

    1  all-gather [q | dout | out] and lse in the team; all-gather k, v; init send again
    2  G steps: the query package (q, dout, out, lse) goes round the sub-ring; each rank adds
       its dq contribution to a travelling fp32 accumulator that starts one rank after the
       owner (the owner's own contribution stays local), so dq takes G - 1 hops, not G
    3  dk, dv (fp32) go back along the reversed init send
    4  reduce-scatter [dq | dk | dv] in the team (fp32)

A_q = b n s/P d, A_kv = b n_kv s/P d, L = b n s/P (elements per rank). ``formulas`` holds the
resulting element counts and the tests compare them with counted traffic.
"""

from __future__ import annotations

from typing import List, Optional

import torch
import torch.distributed as dist

from megatron_metp import kernels
from megatron_metp.comm import P2PComm
from megatron_metp.wallfacer import config_generator as cg
from megatron_metp.wallfacer import zigzag
from megatron_metp.wallfacer.groups import WallFacerGroups


def _acc_dtype(dtype: torch.dtype) -> torch.dtype:
    return torch.float64 if dtype == torch.float64 else torch.float32


def _team_chunks(plan: WallFacerGroups, team: int) -> List[int]:
    """Chunk ids of a team's tokens in member-major order: index a * 2 + h."""
    pairs = zigzag.team_chunk_ids(team, plan.cp_size, plan.team_size, plan.placement, plan.layout)
    return [c for pair in pairs for c in pair]


def _pairs(q_ids: List[int], k_ids: List[int], causal: bool):
    """(q index, k index, diagonal?) of every chunk pair that is not fully masked."""
    for qi, qc in enumerate(q_ids):
        for ki, kc in enumerate(k_ids):
            if causal and kc > qc:
                continue
            yield qi, ki, causal and kc == qc


def _gather(x: torch.Tensor, plan: WallFacerGroups, async_op: bool = False):
    """``x [...] -> [C, ...]`` over the team (member-major); C = 1 is a view, no copy."""
    if plan.team_size == 1:
        return x.unsqueeze(0), None
    x = x.contiguous()
    # gloo wants the output concatenated along dim 0; the [C, ...] view is the same memory.
    out = x.new_empty((plan.team_size * x.shape[0],) + tuple(x.shape[1:]))
    work = dist.all_gather_into_tensor(out, x, group=plan.team_group_pg, async_op=async_op)
    return out.view((plan.team_size,) + tuple(x.shape)), work


def _init_send(kv_team: torch.Tensor, plan: WallFacerGroups, reverse: bool = False):
    """Alg. 2's initial send (``reverse``: its transpose, for the K/V gradients).

    Returns (the block this rank now holds, the block it gave away or None). A self-send is an
    alias, not a copy.
    """
    if plan.init_send_to == plan.idx:
        return kv_team, None
    send_to, recv_from = plan.init_send_to, plan.init_recv_from
    if reverse:
        send_to, recv_from = recv_from, send_to
    comm = P2PComm(plan.cp_group, send_to=send_to, recv_from=recv_from)
    got = comm.send_recv(kv_team)
    # Nothing can be computed before the block arrives (step 0 needs it), so commit + wait.
    comm.commit()
    comm.wait()
    return got, kv_team


def wallfacer_forward(q, k, v, plan: WallFacerGroups, *, causal: bool,
                      softmax_scale: Optional[float] = None, stats: Optional[dict] = None):
    """Alg. 1 on chunk-major shards; returns ``(out [2,b,n,c,d], lse [2,b,n,c])``.

    ``stats`` (optional dict) receives ``work`` = chunk-pair units computed per ring step.
    """
    C, G = plan.team_size, plan.ring_length
    acc = _acc_dtype(q.dtype)
    # 1. Team all-gather. K/V first: the init send waits on it; the q gather overlaps the send.
    kv_team, kv_work = _gather(torch.stack([k, v]), plan, async_op=True)
    q_team, q_work = _gather(q, plan, async_op=True)
    if kv_work is not None:
        kv_work.wait()
    # 2. Initial send (Alg. 2): this rank now holds the K/V of team kv_team_at_step(idx, 0).
    kv_cur, spare = _init_send(kv_team, plan)
    del kv_team
    if q_work is not None:
        q_work.wait()
    q_ids = _team_chunks(plan, plan.team)
    outs: List[Optional[torch.Tensor]] = [None] * len(q_ids)
    lses: List[Optional[torch.Tensor]] = [None] * len(q_ids)
    ring = P2PComm(plan.cp_group, send_to=plan.ring_next, recv_from=plan.ring_prev) if G > 1 \
        else None
    work_per_step = []
    # 3. G ring steps (Alg. 3), double-buffered: kv_cur is read by the send and by the
    #    kernels, never written; the next block lands in ``spare``, untouched until wait().
    for step in range(G):
        if step + 1 < G:
            if spare is None:
                spare = torch.empty_like(kv_cur)
            ring.send_recv(kv_cur, spare)
            ring.commit()
        k_ids = _team_chunks(plan, cg.kv_team_at_step(plan.idx, step, plan.cp_size, C,
                                                        plan.placement))
        units = 0.0
        for qi, ki, diag in _pairs(q_ids, k_ids, causal):
            a, h = divmod(qi, 2)
            cm, h2 = divmod(ki, 2)
            blk_out, blk_lse = kernels.attention_forward(
                q_team[a, h], kv_cur[cm, 0, h2], kv_cur[cm, 1, h2], causal=diag,
                softmax_scale=softmax_scale)
            outs[qi], lses[qi] = kernels.merge_partial(outs[qi], lses[qi], blk_out, blk_lse)
            units += 0.5 if diag else 1.0
        work_per_step.append(units)
        if step + 1 < G:
            ring.wait()
            kv_cur, spare = spare, kv_cur
    del kv_cur, spare, q_team
    if stats is not None:
        stats["work"] = work_per_step
    # Causal, C > 1: a query chunk may see none of this member's keys (all of them later in
    # the sequence): its partial is empty, out = 0 with lse = -inf (no weight in the merge).
    b, n, c, d = q.shape[1:]
    for i, o in enumerate(outs):
        if o is None:
            outs[i] = q.new_zeros((b, n, c, d), dtype=acc)
            lses[i] = q.new_full((b, n, c), float("-inf"), dtype=acc)
    out_acc = torch.stack(outs).view(C, 2, b, n, c, d)
    lse_acc = torch.stack(lses).view(C, 2, b, n, c).to(acc)
    del outs, lses
    if C == 1:
        return out_acc[0].to(q.dtype), lse_acc[0]
    # 4. The members' partial outputs cover disjoint key sets: the row's true lse is the
    #    log-sum-exp of theirs, so exchange lse first, rescale, then a plain summing
    #    reduce-scatter gives each member its own tokens' output.
    lse_all, _ = _gather(lse_acc, plan)                                   # [C, C, 2, b, n, c]
    lse_fin = torch.logsumexp(lse_all, dim=0)
    weight = torch.exp(lse_acc - lse_fin).nan_to_num_(0.0)               # -inf - -inf: no weight
    out_acc.mul_(weight.unsqueeze(-1))
    out_local = out_acc.new_empty(out_acc.shape[1:])
    dist.reduce_scatter_tensor(out_local, out_acc.flatten(0, 1), group=plan.team_group_pg)
    return out_local.to(q.dtype), lse_fin[plan.member]


def wallfacer_backward(dout, q, k, v, out, lse, plan: WallFacerGroups, *, causal: bool,
                       softmax_scale: Optional[float] = None):
    """Backward of :func:`wallfacer_forward`; returns ``(dq, dk, dv)`` like ``q, k, v``."""
    C, G = plan.team_size, plan.ring_length
    acc = _acc_dtype(q.dtype)
    kv_team, kv_work = _gather(torch.stack([k, v]), plan, async_op=True)
    pkg, pkg_work = _gather(torch.stack([q, dout.to(q.dtype), out.to(q.dtype)]), plan,
                            async_op=True)                                # [C, 3, 2, b, n, c, d]
    lse_pkg, lse_work = _gather(lse.to(acc), plan, async_op=True)          # [C, 2, b, n, c]
    if kv_work is not None:
        kv_work.wait()
    kv, _ = _init_send(kv_team, plan)        # stationary: team kv_team_at_step(idx, 0)
    del kv_team
    for w in (pkg_work, lse_work):
        if w is not None:
            w.wait()
    k_ids = _team_chunks(plan, cg.kv_team_at_step(plan.idx, 0, plan.cp_size, C, plan.placement))
    dkv = torch.zeros(kv.shape, dtype=acc, device=kv.device)
    ring = P2PComm(plan.cp_group, send_to=plan.ring_next, recv_from=plan.ring_prev) if G > 1 \
        else None
    pkg_spare = lse_spare = None
    dq_own = acc_prev = acc_in = None
    for step in range(G):
        posted = False
        if step + 1 < G:
            if pkg_spare is None:
                pkg_spare, lse_spare = torch.empty_like(pkg), torch.empty_like(lse_pkg)
            ring.send_recv(pkg, pkg_spare)
            ring.send_recv(lse_pkg, lse_spare)
            posted = True
        if step >= 2:
            # acc_prev (the block of step - 1, complete) goes on; ours arrives from ring_prev.
            acc_in = ring.send_recv(acc_prev)
            posted = True
        if posted:
            # Safe: pkg, lse_pkg and acc_prev are only read until wait(); receives land in
            # fresh or spare buffers that nothing reads before wait().
            ring.commit()
        q_ids = _team_chunks(plan, cg.q_team_at_step(plan.idx, step, plan.cp_size, C,
                                                       plan.placement))
        dq = torch.zeros(pkg.shape[:1] + pkg.shape[2:], dtype=acc, device=pkg.device)
        for qi, ki, diag in _pairs(q_ids, k_ids, causal):
            a, h = divmod(qi, 2)
            cm, h2 = divmod(ki, 2)
            dq_b, dk_b, dv_b = kernels.attention_backward(
                pkg[a, 1, h], pkg[a, 0, h], kv[cm, 0, h2], kv[cm, 1, h2], pkg[a, 2, h],
                lse_pkg[a, h], causal=diag, softmax_scale=softmax_scale)
            dq[a, h] += dq_b
            dkv[cm, 0, h2] += dk_b
            dkv[cm, 1, h2] += dv_b
        if posted:
            ring.wait()
        if step + 1 < G:
            pkg, pkg_spare = pkg_spare, pkg
            lse_pkg, lse_spare = lse_spare, lse_pkg
        if step == 0:
            dq_own = dq                        # the owner's contribution never travels
        elif step == 1:
            acc_prev = dq
        else:
            acc_prev = dq.add_(acc_in)
    del pkg, pkg_spare, lse_pkg, lse_spare, kv
    if G > 1:
        # Last hop: the accumulator of step G-1 belongs to ring_next; ours comes from ring_prev.
        acc_in = ring.send_recv(acc_prev)
        ring.commit()
        ring.wait()
        dq_own.add_(acc_in)
        del acc_prev, acc_in
    # dK/dV back to the team that owns these keys (the transpose of the init send).
    dkv_mine, _ = _init_send(dkv, plan, reverse=True)
    del dkv
    n_q = dq_own[0].numel()
    if C == 1:
        dq_l, dkv_l = dq_own[0], dkv_mine[0]
    else:
        flat = torch.cat([dq_own.reshape(C, -1), dkv_mine.reshape(C, -1)], dim=1)
        del dq_own, dkv_mine
        res = flat.new_empty(flat.shape[1:])
        dist.reduce_scatter_tensor(res, flat.view(-1), group=plan.team_group_pg)
        dq_l, dkv_l = res[:n_q], res[n_q:]
    dq_l = dq_l.reshape(q.shape).to(q.dtype)
    dkv_l = dkv_l.reshape((2,) + tuple(k.shape))
    return dq_l, dkv_l[0].to(k.dtype), dkv_l[1].to(v.dtype)


class WallFacerAttnFunc(torch.autograd.Function):
    """Thin autograd wrapper: fills ctx and delegates (the attention output is the checkpoint:
    the backward never recomputes the forward's attention)."""

    @staticmethod
    def forward(ctx, q, k, v, plan, causal, softmax_scale):
        out, lse = wallfacer_forward(q, k, v, plan, causal=causal, softmax_scale=softmax_scale)
        ctx.save_for_backward(q, k, v, out, lse)
        ctx.plan, ctx.causal, ctx.softmax_scale = plan, causal, softmax_scale
        return out

    @staticmethod
    def backward(ctx, dout):
        q, k, v, out, lse = ctx.saved_tensors
        dq, dk, dv = wallfacer_backward(dout, q, k, v, out, lse, ctx.plan, causal=ctx.causal,
                                        softmax_scale=ctx.softmax_scale)
        return dq, dk, dv, None, None, None


def to_chunk_major(x_sbnd: torch.Tensor) -> torch.Tensor:
    """``[s_local, b, n, d] -> [2, b, n, c, d]`` (a copy; c = s_local / 2)."""
    s, b, n, d = x_sbnd.shape
    return x_sbnd.view(2, s // 2, b, n, d).permute(0, 2, 3, 1, 4).contiguous()


def from_chunk_major(x: torch.Tensor) -> torch.Tensor:
    """``[2, b, n, c, d] -> [s_local, b, n, d]``."""
    two, b, n, c, d = x.shape
    return x.permute(0, 3, 1, 2, 4).reshape(two * c, b, n, d)


def wallfacer_attention(q, k, v, plan: WallFacerGroups, *, causal: bool,
                        softmax_scale: Optional[float] = None) -> torch.Tensor:
    """Differentiable WallFacer attention on Megatron-shaped shards.

    q [s/P, b, n, d], k / v [s/P, b, n_kv, d] (this rank's zigzag tokens) -> [s/P, b, n, d].
    """
    out = WallFacerAttnFunc.apply(to_chunk_major(q), to_chunk_major(k), to_chunk_major(v),
                                  plan, causal, softmax_scale)
    return from_chunk_major(out)
