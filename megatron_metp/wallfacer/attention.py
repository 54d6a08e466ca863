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

    1  all-gather [q | dout] and [lse | D] in the team (D = rowsum(dout * out), fp32, one
       value per query row: all the kernels need of out); all-gather k, v; init send again
    2  G steps: the query package (q, dout; lse, D) goes round the sub-ring; each rank adds
       its dq contribution to a travelling fp32 accumulator that starts one rank after the
       owner (the owner's own contribution stays local), so dq takes G - 1 hops, not G
    3  dk, dv (fp32) go back along the reversed init send
    4  reduce-scatter [dq | dk | dv] in the team (fp32)

A_q = b n s/P d, A_kv = b n_kv s/P d, L = b n s/P (elements per rank). Sending D rather than
out makes a hop's query package 2 A_q + 2 L (L in fp32) instead of 3 A_q + L. ``formulas``
holds the resulting element and byte counts and the tests compare them with counted traffic.

Memory. The gathered q and K/V are lists of member shards, each in its own storage, and this
rank's own slot is its input (no copy). The travelling K/V block moves shard by shard (the
shard being sent is also the one being computed on; the next block's shard lands in one spare
shard), so the forward holds (C - 1) A_q + 2 (C - 1) A_kv + (C - 1) A_q (fp32 partial outputs)
more than ring attention (C = 1) -- measured at 2.1-4.1 (C - 1) A for C = 2, against the
paper's 3 (C - 1) A (Eq. 6-7), which counts only the duplicated q, k, v. The backward moves
its query package shard by shard too, but holds the team's [q | dout] (2 C A_q), the
stationary team K/V, fp32 team gradients and two travelling dq blocks, so its excess over
ring attention is larger (measured 4.0-8.25 (C - 1) A for C = 2, 9.1 when out travelled
instead of D; Eq. 6-7 do not cover it).
Nothing here synchronises the device; waits only order communication.
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


def _send_shards(shards: List[torch.Tensor], free: Optional[torch.Tensor], comm: P2PComm):
    """Replace every shard of a team block by the peer's, one member shard at a time.

    Only one spare shard is needed: a shard's memory becomes the next receive buffer as soon as
    its send completed. Returns (new shards, spare). Used where nothing can be computed
    meanwhile (the initial send, whose result step 0 needs).
    """
    for i in range(len(shards)):
        if free is None:
            free = torch.empty_like(shards[i])
        comm.send_recv(shards[i], free)
        comm.commit()
        comm.wait()
        shards[i], free = free, shards[i]
    return shards, free


def _gather_shards(x: torch.Tensor, plan: WallFacerGroups):
    """``x -> [x of member 0, ..., x of member C-1]``, each in its own storage (async).

    Separate storages let the shard-by-shard sends below release or reuse each member's shard
    on its own; one gathered buffer would stay alive while any of its shards is referenced.
    This rank's own slot *is* ``x`` (no copy): the team's buffers cost (C - 1) shards more than
    ring attention's, not C. ``x`` must not be written by the caller afterwards.
    """
    x = x.contiguous()
    if plan.team_size == 1:
        return [x], None
    shards = [x if m == plan.member else torch.empty_like(x) for m in range(plan.team_size)]
    return shards, dist.all_gather(shards, x, group=plan.team_group_pg, async_op=True)


def _init_send(shards: List[torch.Tensor], plan: WallFacerGroups, reverse: bool = False):
    """Alg. 2's initial send (``reverse``: its transpose, for the K/V gradients).

    Returns (the shards this rank now holds, a spare shard buffer or None). A self-send keeps
    the block in place (no copy).
    """
    if plan.init_send_to == plan.idx:
        return shards, None
    send_to, recv_from = plan.init_send_to, plan.init_recv_from
    if reverse:
        send_to, recv_from = recv_from, send_to
    return _send_shards(shards, None, P2PComm(plan.cp_group, send_to=send_to,
                                               recv_from=recv_from))


def wallfacer_forward(q, k, v, plan: WallFacerGroups, *, causal: bool,
                      softmax_scale: Optional[float] = None, stats: Optional[dict] = None):
    """Alg. 1 on chunk-major shards; returns ``(out [2,b,n,c,d], lse [2,b,n,c])``.

    ``stats`` (optional dict) receives ``work`` = chunk-pair units computed per ring step.

    Memory: the travelling K/V block moves member shard by member shard, so a rank holds the
    block plus one spare shard, 2 (C + 1) A_kv, rather than two blocks, 4 C A_kv; the output
    accumulator is allocated after the initial send.
    """
    C, G = plan.team_size, plan.ring_length
    acc = kernels.acc_dtype(q.dtype)
    # 1. Team all-gather. K/V first: the init send waits on it; the q gather overlaps the send.
    kv_team, kv_work = _gather_shards(torch.stack([k, v]), plan)
    q_team, q_work = _gather_shards(q, plan)        # q_team[a]: member a's queries
    if kv_work is not None:
        kv_work.wait()
        kv_work = None            # the Work holds the stacked local K/V until dropped
    # 2. Initial send (Alg. 2): this rank now holds the K/V of team kv_team_at_step(idx, 0).
    shards, free = _init_send(kv_team, plan)
    del kv_team
    if G == 1:
        free = None               # no ring step follows: the spare shard is not needed
    if q_work is not None:
        q_work.wait()
        q_work = None
    q_ids = _team_chunks(plan, plan.team)
    b, n, c, d = q.shape[1:]
    out_acc = torch.zeros((C, 2, b, n, c, d), dtype=acc, device=q.device)
    lse_acc = torch.full((C, 2, b, n, c), float("-inf"), dtype=acc, device=q.device)
    ring = P2PComm(plan.cp_group, send_to=plan.ring_next, recv_from=plan.ring_prev) if G > 1 \
        else None
    work_per_step = []
    # 3. G ring steps (Alg. 3). Within a step, member shard cm goes to ring_next while the
    #    kernels read it (both only read it); the next block's shard cm lands in ``free``,
    #    which nothing reads until wait(); then shard cm's memory is the next ``free``.
    for step in range(G):
        k_ids = _team_chunks(plan, cg.kv_team_at_step(plan.idx, step, plan.cp_size, C,
                                                        plan.placement))
        units = 0.0
        for cm in range(C):
            if step + 1 < G:
                if free is None:
                    free = torch.empty_like(shards[cm])
                ring.send_recv(shards[cm], free)
                ring.commit()
            kv = shards[cm]
            for qi, h2, diag in _pairs(q_ids, k_ids[2 * cm:2 * cm + 2], causal):
                a, h = divmod(qi, 2)
                blk_out, blk_lse = kernels.attention_forward(
                    q_team[a][h], kv[0, h2], kv[1, h2], causal=diag, softmax_scale=softmax_scale)
                kernels.merge_partial_(out_acc[a, h], lse_acc[a, h], blk_out, blk_lse)
                units += 0.5 if diag else 1.0
            if step + 1 < G:
                ring.wait()
                shards[cm], free = free, shards[cm]
        work_per_step.append(units)
    del shards, free, q_team, kv
    if stats is not None:
        stats["work"] = work_per_step
    # Causal, C > 1: a query chunk may see none of this member's keys (all later in the
    # sequence): its partial stays out = 0, lse = -inf, and gets no weight below.
    if C == 1:
        return out_acc[0].to(q.dtype), lse_acc[0]
    # 4. The members' partial outputs cover disjoint key sets: the row's true lse is the
    #    log-sum-exp of theirs, so exchange lse first, rescale, then a plain summing
    #    reduce-scatter gives each member its own tokens' output.
    lse_all, _ = _gather(lse_acc, plan)                                   # [C, C, 2, b, n, c]
    lse_fin = torch.logsumexp(lse_all, dim=0)
    del lse_all
    weight = torch.exp(lse_acc - lse_fin).nan_to_num_(0.0)               # -inf - -inf: no weight
    out_acc.mul_(weight.unsqueeze(-1))
    del weight
    out_local = out_acc.new_empty(out_acc.shape[1:])
    dist.reduce_scatter_tensor(out_local, out_acc.flatten(0, 1), group=plan.team_group_pg)
    return out_local.to(q.dtype), lse_fin[plan.member]


def wallfacer_backward(dout, q, k, v, out, lse, plan: WallFacerGroups, *, causal: bool,
                       softmax_scale: Optional[float] = None):
    """Backward of :func:`wallfacer_forward`; returns ``(dq, dk, dv)`` like ``q, k, v``.

    The team's gradient partials live in one fp32 buffer ``grad_team [C, |q| + |k| + |v|]``
    (member-major: [dq | dk | dv] per member), so the final reduce-scatter needs no copy.
    """
    C, G = plan.team_size, plan.ring_length
    acc = kernels.acc_dtype(q.dtype)
    kv_team, kv_work = _gather_shards(torch.stack([k, v]), plan)
    # The query package [q | dout] and its row statistics [lse | D], D = rowsum(dout * out)
    # (all the backward kernels need of out: one value per query row, not d), as member shards
    # (own slot = a fresh copy, since received shards will be written into it).
    dout = dout.to(q.dtype)
    pkg, pkg_work = _gather_shards(torch.stack([q, dout]), plan)
    stat_pkg, stat_work = _gather_shards(
        torch.stack([lse.to(acc), kernels.row_delta(dout, out.to(q.dtype))]), plan)
    if kv_work is not None:
        kv_work.wait()
        kv_work = None
    kv, _ = _init_send(kv_team, plan)        # stationary: team kv_team_at_step(idx, 0)
    del kv_team
    for w in (pkg_work, stat_work):
        if w is not None:
            w.wait()
    del pkg_work, stat_work
    k_ids = _team_chunks(plan, cg.kv_team_at_step(plan.idx, 0, plan.cp_size, C, plan.placement))
    n_q, n_kv = q.numel(), 2 * k.numel()
    grad_team = torch.zeros((C, n_q + n_kv), dtype=acc, device=q.device)
    dq_own = grad_team[:, :n_q].view((C,) + tuple(q.shape))
    dkv = grad_team[:, n_q:].view((C, 2) + tuple(k.shape))
    ring = P2PComm(plan.cp_group, send_to=plan.ring_next, recv_from=plan.ring_prev) if G > 1 \
        else None
    pkg_free = stat_free = None
    acc_prev = acc_in = None
    for step in range(G):
        q_ids = _team_chunks(plan, cg.q_team_at_step(plan.idx, step, plan.cp_size, C,
                                                       plan.placement))
        # Step 0 is this rank's own team: its contribution is written in place and never
        # travels; later steps fill a fresh accumulator that will.
        # From step 2 on, the incoming accumulator (received during sub-step 0) *becomes* this
        # step's dq; sub-step 0's own contribution goes to a one-shard scratch meanwhile.
        dq = dq_own if step == 0 else (torch.zeros_like(dq_own) if step == 1 else None)
        # The package moves member shard by member shard, as the forward's K/V do.
        for a in range(C):
            posted = False
            if step + 1 < G:
                if pkg_free is None:
                    pkg_free, stat_free = torch.empty_like(pkg[a]), torch.empty_like(stat_pkg[a])
                ring.send_recv(pkg[a], pkg_free)
                ring.send_recv(stat_pkg[a], stat_free)
                posted = True
            if a == 0 and step >= 2:
                # acc_prev (the block of step - 1, complete) goes on; ours arrives from
                # ring_prev.
                acc_in = ring.send_recv(acc_prev)
                posted = True
            if posted:
                # Safe: pkg[a], stat_pkg[a] and acc_prev are only read until wait(); receives
                # land in spare or fresh buffers that nothing reads before wait().
                ring.commit()
            dq_a = dq[a] if dq is not None else torch.zeros_like(dq_own[0])
            for h, ki, diag in _pairs(q_ids[2 * a:2 * a + 2], k_ids, causal):
                cm, h2 = divmod(ki, 2)
                dq_b, dk_b, dv_b = kernels.attention_backward(
                    pkg[a][1, h], pkg[a][0, h], kv[cm][0, h2], kv[cm][1, h2], None,
                    stat_pkg[a][0, h], causal=diag, softmax_scale=softmax_scale,
                    delta=stat_pkg[a][1, h])
                dq_a[h] += dq_b
                dkv[cm, 0, h2] += dk_b
                dkv[cm, 1, h2] += dv_b
            if posted:
                ring.wait()
            if dq is None:
                dq = acc_in
                dq[a].add_(dq_a)
            del dq_a
            if step + 1 < G:
                pkg[a], pkg_free = pkg_free, pkg[a]
                stat_pkg[a], stat_free = stat_free, stat_pkg[a]
        if step >= 1:
            acc_prev = dq
        acc_in = None
    del pkg, pkg_free, stat_pkg, stat_free, kv
    if G > 1:
        # Last hop: the accumulator of step G-1 belongs to ring_next; ours comes from ring_prev.
        acc_in = ring.send_recv(acc_prev)
        ring.commit()
        ring.wait()
        dq_own.add_(acc_in)
        del acc_prev, acc_in
    # dK/dV back to the team that owns these keys (the transpose of the init send), shard by
    # shard into their rows of grad_team (a row is sent before it is overwritten).
    if plan.init_send_to != plan.idx:
        back = P2PComm(plan.cp_group, send_to=plan.init_recv_from, recv_from=plan.init_send_to)
        tmp = torch.empty_like(dkv[0])
        for i in range(C):
            back.send_recv(dkv[i], tmp)
            back.commit()
            back.wait()
            dkv[i].copy_(tmp)
        del tmp
    if C == 1:
        res = grad_team[0]
    else:
        res = grad_team.new_empty(grad_team.shape[1:])
        dist.reduce_scatter_tensor(res, grad_team.view(-1), group=plan.team_group_pg)
    dq_l = res[:n_q].view(q.shape).to(q.dtype)
    dkv_l = res[n_q:].view((2,) + tuple(k.shape))
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
