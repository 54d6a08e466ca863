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

from megatron_metp import kernels, packing
from megatron_metp.comm import P2PComm
from megatron_metp.wallfacer import config_generator as cg
from megatron_metp.wallfacer import zigzag
from megatron_metp.wallfacer.groups import WallFacerGroups


def _team_chunks(plan: WallFacerGroups, team: int) -> List[int]:
    """Chunk ids of a team's tokens in member-major order: index a * 2 + h."""
    pairs = zigzag.team_chunk_ids(team, plan.cp_size, plan.team_size, plan.placement, plan.layout)
    return [c for pair in pairs for c in pair]


def _pairs(q_ids: List[int], k_ids: List[int], causal: bool,
           layout=None, c: int = 0):
    """(q index, k index, pieces) of every chunk pair that is not fully masked; ``pieces``
    are the pair's kernel calls (``megatron_metp.packing``): the whole pair (causal on the
    diagonal) or, with packed documents (``layout``; ``c`` tokens per chunk), what they leave."""
    for qi, qc in enumerate(q_ids):
        for ki, kc in enumerate(k_ids):
            if layout is None:
                if causal and kc > qc:
                    continue
                pieces = packing.whole(causal and kc == qc)
            else:
                pieces = layout.chunk_pieces(qc, kc, c, causal)
                if not pieces:
                    continue
            yield qi, ki, pieces


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


def _init_comm(plan: WallFacerGroups, reverse: bool = False) -> Optional[P2PComm]:
    """Alg. 2's initial send (``reverse``: its transpose, for the K/V gradients); None for a
    self-send, which keeps the block in place."""
    if plan.init_send_to == plan.idx:
        return None
    send_to, recv_from = plan.init_send_to, plan.init_recv_from
    if reverse:
        send_to, recv_from = recv_from, send_to
    return P2PComm(plan.cp_group, send_to=send_to, recv_from=recv_from)


class _Pieces:
    """A K/V block as 2C pieces ``[2 (k, v), b, n_kv, c, d]``, piece ``a * 2 + h`` = member a's
    zigzag chunk h, each in its own storage.

    Pieces move member shard by member shard (two pieces per batch). A piece's memory becomes
    a receive buffer as soon as its send completed, so moving the whole block costs one spare
    shard, not a second block, and the kernels can start on the first shard that arrived while
    the next is in flight.
    """

    def __init__(self, k: torch.Tensor, v: torch.Tensor, plan: WallFacerGroups):
        """All-gather the team's K/V (async, one gather per zigzag chunk), every piece in its
        own storage, so that a piece's memory is freed or reused on its own."""
        C = plan.team_size
        self.items: List[Optional[torch.Tensor]] = [None] * (2 * C)
        self.works = []
        for h in range(2):
            shards, work = _gather_shards(torch.stack([k[h], v[h]]), plan)
            for m, shard in enumerate(shards):
                self.items[m * 2 + h] = shard
            self.works.append(work)
        self.spare: List[torch.Tensor] = []

    def wait(self) -> None:
        for w in self.works:
            if w is not None:
                w.wait()
        self.works = []   # a Work holds the stacked local K/V until dropped

    def post(self, comm: P2PComm, idx: List[int]) -> List[torch.Tensor]:
        """Post sending pieces ``idx`` (one batch) and receiving their replacements; returns
        the receive buffers."""
        bufs = []
        for i in idx:
            buf = self.spare.pop() if self.spare else torch.empty_like(self.items[i])
            comm.send_recv(self.items[i], buf)
            bufs.append(buf)
        comm.commit()
        return bufs

    def replace(self, comm: P2PComm, idx: List[int], bufs: List[torch.Tensor]) -> None:
        """Complete the transfer of pieces ``idx``: ``bufs`` now hold them, their old memory is
        spare."""
        comm.wait()
        for i, buf in zip(idx, bufs):
            self.spare.append(self.items[i])
            self.items[i] = buf


def _shard(cm: int) -> List[int]:
    """The pieces of member shard ``cm``: its two zigzag chunks."""
    return [2 * cm, 2 * cm + 1]


def wallfacer_forward(q, k, v, plan: WallFacerGroups, *, causal: bool,
                      softmax_scale: Optional[float] = None, stats: Optional[dict] = None,
                      layout: Optional[packing.Layout] = None):
    """Alg. 1 on chunk-major shards; returns ``(out [2,b,n,c,d], lse [2,b,n,c])``.

    ``stats`` (optional dict) receives ``work`` = chunk-pair units computed per ring step.
    ``layout``: packed documents (``megatron_metp.packing``), attended each on its own; a
    query row that sees no key (padding) ends with out = 0, lse = -inf.

    Overlap. The K/V block moves member shard by member shard (each shard's two zigzag
    chunks in their own storages, :class:`_Pieces`): at step 0 the initial send of shard
    cm + 1 is in flight while the kernels read shard cm (only shard 0 is waited for before the
    first kernel); at steps 0..G-2 shard cm goes on round the sub-ring while the kernels read
    it. With the zigzag layout every member shard has a visible chunk pair, so every transfer
    has a kernel to hide behind. The last step runs query chunk by query chunk, so chunk 0's lse
    all-gather (team group) runs while chunk 1 computes, and chunk 0's output reduce-scatter
    while chunk 1 is rescaled.

    Memory: the block, plus at step 0 the receive buffers of two shards (the initial send's
    next shard and the ring's), later one: 2 C A_kv + 4 A_kv at most, where moving whole
    blocks would take 4 C A_kv.
    """
    C, G = plan.team_size, plan.ring_length
    acc = kernels.acc_dtype(q.dtype)
    # 1. Team all-gather. K/V first (the init send waits on it); the q gather overlaps the
    #    init send of piece 0.
    kv = _Pieces(k, v, plan)
    q_team, q_work = _gather_shards(q, plan)        # q_team[a]: member a's queries
    kv.wait()
    # 2. Initial send (Alg. 2): afterwards this rank holds the K/V of team
    #    kv_team_at_step(idx, 0). Piece 0 is needed before any kernel; the others move
    #    during step 0 (below).
    init = _init_comm(plan)
    if init is not None:
        kv.replace(init, _shard(0), kv.post(init, _shard(0)))
    if q_work is not None:
        q_work.wait()
        q_work = None
    q_ids = _team_chunks(plan, plan.team)
    b, n, c, d = q.shape[1:]
    # Query-chunk major ([h, member, ...]), so that chunk h's team merge takes one
    # contiguous block.
    out_acc = torch.zeros((2, C, b, n, c, d), dtype=acc, device=q.device)
    lse_acc = torch.full((2, C, b, n, c), float("-inf"), dtype=acc, device=q.device)
    ring = P2PComm(plan.cp_group, send_to=plan.ring_next, recv_from=plan.ring_prev) if G > 1 \
        else None
    merge = _TeamMerge(out_acc, lse_acc, plan) if C > 1 else None

    def compute(pairs):
        units = 0.0
        for qi, ki, pieces in pairs:
            a, h = divmod(qi, 2)
            piece = kv.items[ki]
            packing.forward_pieces(pieces, q_team[a][h], piece[0], piece[1], out_acc[h, a],
                                   lse_acc[h, a], softmax_scale=softmax_scale)
            units += packing.piece_work(pieces, c)
        return units

    work_per_step = []
    # 3. G ring steps (Alg. 3).
    for step in range(G):
        k_ids = _team_chunks(plan, cg.kv_team_at_step(plan.idx, step, plan.cp_size, C,
                                                        plan.placement))
        pairs = list(_pairs(q_ids, k_ids, causal, layout, c))
        units = 0.0
        if step == G - 1 and step > 0:
            # Last step (nothing travels on): query chunk by query chunk, each chunk's team
            # merge posted as soon as its partials are final.
            for h in range(2):
                units += compute([pr for pr in pairs if pr[0] % 2 == h])
                if merge is not None:
                    merge.done(h)
        else:
            for cm in range(C):
                nxt = None
                if step == 0 and init is not None and cm + 1 < C:
                    nxt = kv.post(init, _shard(cm + 1))   # the initial send, one shard ahead
                fwd = kv.post(ring, _shard(cm)) if step + 1 < G else None   # shard cm goes on
                units += compute([pr for pr in pairs if pr[1] // 2 == cm])
                if nxt is not None:
                    kv.replace(init, _shard(cm + 1), nxt)
                if fwd is not None:
                    kv.replace(ring, _shard(cm), fwd)
                nxt = fwd = None
            if step + 2 >= G:
                kv.spare = []     # nothing moves after this step: drop the spare pieces
            if step == G - 1 and merge is not None:
                merge.done(0)
                merge.done(1)
        work_per_step.append(units)
    kv = q_team = None   # free the block and the team's queries before the merge
    if stats is not None:
        stats["work"] = work_per_step
    # Causal, C > 1: a query chunk may see none of this member's keys (all later in the
    # sequence): its partial stays out = 0, lse = -inf, and gets no weight in the merge.
    if C == 1:
        return out_acc[:, 0].to(q.dtype), lse_acc[:, 0]
    return merge.result(q.dtype)


class _TeamMerge:
    """Step 4 of the forward, per query chunk h: the members' partial outputs cover disjoint
    key sets, so the row's true lse is the log-sum-exp of theirs: all-gather the lse, rescale,
    then a plain summing reduce-scatter gives each member its own tokens' output.

    ``done(h)`` posts chunk h's lse all-gather as soon as its partials are final (chunk 0's
    then runs while chunk 1 computes); ``result`` rescales and reduce-scatters (team group).
    """

    def __init__(self, out_acc, lse_acc, plan: WallFacerGroups):
        self.out_acc, self.lse_acc, self.plan = out_acc, lse_acc, plan
        self.lse_all, self.lse_fin = [None, None], [None, None]
        self.out_local = None
        self.gathers, self.scatters = [None, None], [None, None]

    def done(self, h: int) -> None:
        C = self.plan.team_size
        self.lse_all[h] = self.lse_acc.new_empty((C,) + tuple(self.lse_acc.shape[1:]))
        self.gathers[h] = dist.all_gather_into_tensor(
            self.lse_all[h].view((-1,) + tuple(self.lse_all[h].shape[2:])), self.lse_acc[h],
            group=self.plan.team_group_pg, async_op=True)

    def _scatter(self, h: int) -> None:
        self.gathers[h].wait()
        self.gathers[h] = None
        # lse_all[h] [C (holder), C (member), b, n, c]: the row's lse over the holders.
        lse_fin = torch.logsumexp(self.lse_all[h], dim=0)
        self.lse_all[h] = None
        weight = torch.exp(self.lse_acc[h] - lse_fin).nan_to_num_(0.0)   # -inf - -inf: none
        self.out_acc[h].mul_(weight.unsqueeze(-1))
        del weight
        self.lse_fin[h] = lse_fin[self.plan.member]
        if self.out_local is None:
            out = self.out_acc
            self.out_local = out.new_empty(out.shape[:1] + out.shape[2:])
        # Flat views: gloo wants output x C = input along dim 0.
        self.scatters[h] = dist.reduce_scatter_tensor(
            self.out_local[h].view(-1), self.out_acc[h].view(-1),
            group=self.plan.team_group_pg, async_op=True)

    def result(self, dtype):
        """Called once the K/V block and the team's queries are freed: the rescale and the
        output buffer then take their memory. Chunk 0's reduce-scatter runs while chunk 1 is
        rescaled."""
        self._scatter(0)
        self._scatter(1)
        for w in self.scatters:
            w.wait()
        return self.out_local.to(dtype), torch.stack(self.lse_fin)


def wallfacer_backward(dout, q, k, v, out, lse, plan: WallFacerGroups, *, causal: bool,
                       softmax_scale: Optional[float] = None,
                       layout: Optional[packing.Layout] = None):
    """Backward of :func:`wallfacer_forward`; returns ``(dq, dk, dv)`` like ``q, k, v``.

    The team's gradient partials live in one fp32 buffer ``grad_team [C, |q| + |k| + |v|]``
    (member-major: [dq | dk | dv] per member), so the final reduce-scatter needs no copy.

    Overlap. The query package goes round the sub-ring member shard by member shard behind the
    kernels of that shard, and the dq accumulator's hops behind member shard 0's. In the last
    step, member shard a's dq goes its last hop while shard a + 1 computes, and the last query
    shard runs K/V shard by K/V shard, each one's dK/dV going back to its team (the reversed
    initial send) while the next computes. Exposed: the initial send (step 0's first query
    shard reads every K/V shard), the last query shard's dq hop, the last K/V shard's return
    and the team reduce-scatter.
    """
    C, G = plan.team_size, plan.ring_length
    acc = kernels.acc_dtype(q.dtype)
    kv = _Pieces(k, v, plan)   # after the init send: team kv_team_at_step(idx, 0)
    # The query package [q | dout] and its row statistics [lse | D], D = rowsum(dout * out)
    # (all the backward kernels need of out: one value per query row, not d), as member shards
    # (own slot = a fresh copy, since received shards will be written into it).
    dout = dout.to(q.dtype)
    pkg, pkg_work = _gather_shards(torch.stack([q, dout]), plan)
    stat_pkg, stat_work = _gather_shards(
        torch.stack([lse.to(acc), kernels.row_delta(dout, out.to(q.dtype))]), plan)
    kv.wait()
    init = _init_comm(plan)
    if init is not None:
        for cm in range(C):
            kv.replace(init, _shard(cm), kv.post(init, _shard(cm)))
    kv.spare = []
    for w in (pkg_work, stat_work):
        if w is not None:
            w.wait()
    del pkg_work, stat_work
    k_ids = _team_chunks(plan, cg.kv_team_at_step(plan.idx, 0, plan.cp_size, C, plan.placement))
    n_q, n_kv = q.numel(), 2 * k.numel()
    grad_team = torch.zeros((C, n_q + n_kv), dtype=acc, device=q.device)
    dq_own = grad_team[:, :n_q].view((C,) + tuple(q.shape))
    # dK/dV by K/V piece: [C (member cm), 2 (chunk h2), 2 (k, v), ...]; piece cm * 2 + h2
    dkv = grad_team[:, n_q:].view((C, 2, 2) + tuple(k.shape[1:]))
    ring = P2PComm(plan.cp_group, send_to=plan.ring_next, recv_from=plan.ring_prev) if G > 1 \
        else None
    back = _init_comm(plan, reverse=True)
    returns = _ShardByShard(back, dkv, add=False) if back is not None else None
    last_hop = _ShardByShard(ring, dq_own, add=True) if G > 1 else None
    pkg_free = stat_free = None
    acc_prev = acc_in = None
    for step in range(G):
        q_ids = _team_chunks(plan, cg.q_team_at_step(plan.idx, step, plan.cp_size, C,
                                                       plan.placement))
        last = step == G - 1
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
            pairs = list(_pairs(q_ids[2 * a:2 * a + 2], k_ids, causal, layout, q.shape[3]))
            if last and a == C - 1:
                # The backward's last kernels, K/V member shard by member shard: a shard's
                # dK/dV is final after its pairs, and goes home while the next shard computes
                # (with the zigzag layout every query shard sees every K/V shard's early chunk,
                # so each shard has kernels).
                for cm in range(C):
                    _backward_pairs([pr for pr in pairs if pr[1] // 2 == cm], pkg[a],
                                    stat_pkg[a], kv, dq_a, dkv, softmax_scale)
                    if returns is not None:
                        returns.post(dkv, cm)
            else:
                _backward_pairs(pairs, pkg[a], stat_pkg[a], kv, dq_a, dkv, softmax_scale)
            if posted:
                ring.wait()
            if dq is None:
                dq = acc_in
                dq[a].add_(dq_a)
            del dq_a
            if step + 1 < G:
                pkg[a], pkg_free = pkg_free, pkg[a]
                stat_pkg[a], stat_free = stat_free, stat_pkg[a]
            if last and last_hop is not None and a < C - 1:
                # Member shard a of the last step's accumulator is complete: its last hop (to
                # ring_next, the owner) runs while shard a + 1 computes.
                last_hop.post(dq, a)
        if step >= 1:
            acc_prev = dq
        acc_in = None
    del pkg, pkg_free, stat_pkg, stat_free, kv
    if last_hop is not None:
        last_hop.post(acc_prev, C - 1)
        last_hop.finish()
        del acc_prev
    if returns is not None:
        returns.finish()
    if C == 1:
        res = grad_team[0]
    else:
        res = grad_team.new_empty(grad_team.shape[1:])
        dist.reduce_scatter_tensor(res, grad_team.view(-1), group=plan.team_group_pg)
    dq_l = res[:n_q].view(q.shape).to(q.dtype)
    dkv_l = res[n_q:].view((2, 2) + tuple(k.shape[1:]))     # [chunk, (k, v), ...]
    return dq_l, dkv_l[:, 0].to(k.dtype), dkv_l[:, 1].to(v.dtype)


def _backward_pairs(pairs, pkg_a, stat_a, kv: _Pieces, dq_a, dkv, softmax_scale) -> None:
    """The backward kernels of member shard a's (query chunk, K/V piece) pairs: dq into
    ``dq_a``, dK/dV into their piece's rows of ``dkv``."""
    for h, ki, pieces in pairs:
        piece = kv.items[ki]
        dk_b, dv_b = packing.backward_pieces(
            pieces, pkg_a[1, h], pkg_a[0, h], piece[0], piece[1], None, stat_a[0, h], dq_a[h],
            delta=stat_a[1, h], softmax_scale=softmax_scale)
        g = dkv[ki // 2, ki % 2]
        g[0].add_(dk_b)   # in place on the view: `g[0] += ...` would copy it onto itself too
        g[1].add_(dv_b)


class _ShardByShard:
    """Member shards sent one at a time to a fixed peer, each posted once the previous one is
    complete, so that one is in flight while the caller computes. The peer's shard i lands in
    ``target[i]``: added (``add``; the dq accumulator's last hop into ``dq_own``) or copied over
    the shard just sent (the dK/dV return into ``grad_team``'s rows)."""

    def __init__(self, comm: P2PComm, target, add: bool):
        self.comm, self.target, self.add = comm, target, add
        self.pending = None   # (shard, receive buffer)

    def post(self, src, i: int) -> None:
        self.finish()
        self.pending = (i, self.comm.send_recv(src[i]))
        self.comm.commit()

    def finish(self) -> None:
        if self.pending is not None:
            self.comm.wait()
            i, buf = self.pending
            if self.add:
                self.target[i].add_(buf)
            else:
                self.target[i].copy_(buf)
            self.pending = None


class WallFacerAttnFunc(torch.autograd.Function):
    """Thin autograd wrapper: fills ctx and delegates (the attention output is the checkpoint:
    the backward never recomputes the forward's attention)."""

    @staticmethod
    def forward(ctx, q, k, v, plan, causal, softmax_scale, layout=None):
        out, lse = wallfacer_forward(q, k, v, plan, causal=causal, softmax_scale=softmax_scale,
                                     layout=layout)
        ctx.save_for_backward(q, k, v, out, lse)
        ctx.plan, ctx.causal, ctx.softmax_scale, ctx.layout = plan, causal, softmax_scale, layout
        return out

    @staticmethod
    def backward(ctx, dout):
        q, k, v, out, lse = ctx.saved_tensors
        dq, dk, dv = wallfacer_backward(dout, q, k, v, out, lse, ctx.plan, causal=ctx.causal,
                                        softmax_scale=ctx.softmax_scale, layout=ctx.layout)
        return dq, dk, dv, None, None, None, None


def to_chunk_major(x_sbnd: torch.Tensor) -> torch.Tensor:
    """``[s_local, b, n, d] -> [2, b, n, c, d]`` (a copy; c = s_local / 2)."""
    s, b, n, d = x_sbnd.shape
    return x_sbnd.view(2, s // 2, b, n, d).permute(0, 2, 3, 1, 4).contiguous()


def from_chunk_major(x: torch.Tensor) -> torch.Tensor:
    """``[2, b, n, c, d] -> [s_local, b, n, d]``."""
    two, b, n, c, d = x.shape
    return x.permute(0, 3, 1, 2, 4).reshape(two * c, b, n, d)


def wallfacer_attention(q, k, v, plan: WallFacerGroups, *, causal: bool,
                        softmax_scale: Optional[float] = None,
                        layout: Optional[packing.Layout] = None) -> torch.Tensor:
    """Differentiable WallFacer attention on Megatron-shaped shards.

    q [s/P, b, n, d], k / v [s/P, b, n_kv, d] (this rank's zigzag tokens) -> [s/P, b, n, d].
    ``layout``: packed documents of the whole sequence (b = 1), None for one sequence.
    """
    out = WallFacerAttnFunc.apply(to_chunk_major(q), to_chunk_major(k), to_chunk_major(v),
                                  plan, causal, softmax_scale, layout)
    return from_chunk_major(out)
