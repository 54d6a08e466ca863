"""WallFacer attention: team all-gather, multi-ring P2P, lse-merged reduce-scatter (Alg. 1).

Layout: a rank's tokens are its two chunks of the 2P-chunk sequence (``zigzag``), in that order,
heads before sequence (the layout the kernels take)::

    q          [b, n,    2c, d]   this rank's queries: rows [0, c) chunk ids[0], [c, 2c) ids[1]
    k, v       [b, n_kv, 2c, d]   this rank's keys / values (GQA: n_kv heads travel)
    kv shard   [2 (k|v), b, n_kv, 2c, d]   one member's K/V in one buffer: what travels
    q_team     C member shards of q after the team all-gather (member-major)
    out        [b, n, 2c, d]      q's dtype;   lse [b, n, 2c] fp32 (fp64 for fp64)

with c = s / (2P) tokens per chunk and C the team size. Causal attention is exact for any chunk
layout: a key chunk before a query chunk is fully visible, the same chunk takes the diagonal's
causal mask, a later one is skipped. Megatron's zigzag layout balances the work (``zigzag``)
and lets one kernel call cover one member's queries against one member's keys
(:func:`_calls`): its own chunks are one causal call over [2c] x [2c] (the top-right quarter is
what the causal mask drops), an earlier rank's keys are seen by both query chunks through the
first key chunk (one call, [2c] x [c]), a later rank's by the second query chunk through both
key chunks (one call, [c] x [2c]). These are the calls of Transformer Engine's
``AttnFuncWithCPAndKVP2P``. Packed documents (``layout``) run per chunk pair, the pieces the
documents leave. Every kernel call goes through ``megatron_metp.kernels``.

Forward (per rank (team t = (g, j), member m); G = P / C^2 ring steps)::

    1  all-gather q and [k | v] in the team               (C - 1) (A_q + 2 A_kv) received
    2  init send: kv_team -> init_send_to                  2 C A_kv  (none for a self-send)
    3  G steps: compute q_team x kv_cur while kv_cur goes to ring_next   (G - 1) 2 C A_kv
    4  all-gather the team's lse, rescale, reduce-scatter the fp32 outputs (one call each)
                                                            (C - 1) (A_q + L)
Each kernel's block merges into the fp32 accumulator with :func:`kernels.merge_ring_` (five
element-wise kernels, none of them a guard).

Backward (K/V and their gradients stay, queries travel; the transposes of 1 and 4)::

    1  all-gather the query packages and [k | v] in the team; init send again
    2  G steps: each member's package goes round the sub-ring, and behind it, one step late,
       the dq accumulated for the package before it, in the same buffer (:class:`_Package`):
       one send per member shard and hop. The owner's own contribution stays local, so dq
       takes G - 1 hops, the last one home to the owner
    3  dk, dv (fp32) go back along the reversed init send
    4  reduce-scatter [dq | dk | dv] in the team (fp32)

A package is [q | dout | out] (data dtype) and lse (fp32): the real output, so the fused
backward kernels read it as they read any output, and nothing stands in for it.
A_q = b n s/P d, A_kv = b n_kv s/P d, L = b n s/P (elements per rank). ``formulas`` holds the
resulting element and byte counts and the tests compare them with counted traffic.

Memory. The gathered q and K/V are lists of member shards, each in its own storage, and this
rank's own slot is its input (no copy). The travelling K/V block moves shard by shard (the
shard being sent is also the one being computed on; the next block's shard lands in one spare
shard), so the forward holds (C - 1) A_q + 2 (C - 1) A_kv + (C - 1) A_q (fp32 partial outputs)
more than ring attention (C = 1), against the paper's 3 (C - 1) A (Eq. 6-7), which counts only
the duplicated q, k, v. The backward holds the team's packages (3 C A_q + C L, plus their fp32
dq slots), the stationary team K/V, fp32 team gradients and one spare package per member
shard; Eq. 6-7 do not cover it. ``tests/test_wallfacer_measure.py`` measures both.
Nothing here synchronises the device; waits only order communication.
"""

from __future__ import annotations

import math
from typing import List, Optional, Tuple

import torch
import torch.distributed as dist

from megatron_metp import kernels, packing
from megatron_metp.comm import P2PComm
from megatron_metp.wallfacer import config_generator as cg
from megatron_metp.wallfacer import zigzag
from megatron_metp.wallfacer.groups import WallFacerGroups

ALL = packing.ALL
Call = Tuple[slice, slice, bool]   # (query rows, key columns, causal) of [0, 2c)


def _team_chunks(groups: WallFacerGroups, team: int) -> List[Tuple[int, int]]:
    """The two chunk ids of each member of ``team``, in member order."""
    return zigzag.team_chunk_ids(team, groups.cp_size, groups.team_size, groups.placement,
                                 groups.layout)


def _span(halves: List[int], c: int) -> slice:
    """The rows of chunk halves ``halves`` (0, 1 or both) of a member's [0, 2c)."""
    return ALL if len(halves) == 2 else slice(halves[0] * c, (halves[0] + 1) * c)


def _shift(sl: slice, offset: int, c: int) -> slice:
    """A chunk-local slice of [0, c) as rows of [0, 2c), starting at ``offset``."""
    start = 0 if sl.start is None else sl.start
    stop = c if sl.stop is None else sl.stop
    return slice(offset + start, offset + stop)


def _calls(q_ids, k_ids, causal: bool, layout, c: int) -> List[Call]:
    """The kernel calls of one member's queries (chunks ``q_ids``) against one member's keys
    (``k_ids``); ``[]``: nothing visible. Unpacked: one call whenever the visible chunk pairs
    form a rectangle (always, with the zigzag and contiguous layouts), else one per pair.
    ``layout`` (packed documents): the pieces of each chunk pair, shifted to the member's
    rows (each piece's rows all see a key, so the lean merge needs no guard)."""
    if layout is not None:
        return [(_shift(qs, h * c, c), _shift(ks, h2 * c, c), diag)
                for h, qc in enumerate(q_ids) for h2, kc in enumerate(k_ids)
                for qs, ks, diag in layout.chunk_pieces(qc, kc, c, causal)]
    if not causal:
        return [(ALL, ALL, False)]
    if tuple(q_ids) == tuple(k_ids) and q_ids[0] < q_ids[1]:
        return [(ALL, ALL, True)]   # own chunks: rows of chunk 0 see no key of chunk 1
    seen = [(h, h2, kc == qc) for h, qc in enumerate(q_ids) for h2, kc in enumerate(k_ids)
            if kc <= qc]
    rows, cols = sorted({s[0] for s in seen}), sorted({s[1] for s in seen})
    if seen and not any(s[2] for s in seen) and len(seen) == len(rows) * len(cols):
        return [(_span(rows, c), _span(cols, c), False)]
    return [(_span([h], c), _span([h2], c), diag) for h, h2, diag in seen]


def _units(calls: List[Call], c: int) -> float:
    """Work of ``calls`` in chunk-pair units (a c x c block; a causal call counts half)."""
    rows = range(2 * c)
    return sum(len(rows[qs]) * len(rows[ks]) * (0.5 if diag else 1.0)
               for qs, ks, diag in calls) / (c * c)


def _gather_shards(x: torch.Tensor, groups: WallFacerGroups):
    """``x -> [x of member 0, ..., x of member C-1]``, each in its own storage (async).

    Separate storages let the shard-by-shard sends below release or reuse each member's shard
    on its own; one gathered buffer would stay alive while any of its shards is referenced.
    This rank's own slot *is* ``x`` (no copy): the team's buffers cost (C - 1) shards more than
    ring attention's, not C. ``x`` must not be written by the caller afterwards.
    """
    x = x.contiguous()
    if groups.team_size == 1:
        return [x], None
    shards = [x if m == groups.member else torch.empty_like(x)
              for m in range(groups.team_size)]
    return shards, dist.all_gather(shards, x, group=groups.team_group_pg, async_op=True)


def _init_comm(groups: WallFacerGroups, reverse: bool = False) -> Optional[P2PComm]:
    """Alg. 2's initial send (``reverse``: its transpose, for the K/V gradients); None for a
    self-send, which keeps the block in place."""
    if groups.init_send_to == groups.idx:
        return None
    send_to, recv_from = groups.init_send_to, groups.init_recv_from
    if reverse:
        send_to, recv_from = recv_from, send_to
    return P2PComm(groups.cp_group, send_to=send_to, recv_from=recv_from)


def _ring_comm(groups: WallFacerGroups) -> Optional[P2PComm]:
    """The sub-ring's P2P (None when the ring has one rank)."""
    if groups.ring_length == 1:
        return None
    return P2PComm(groups.cp_group, send_to=groups.ring_next, recv_from=groups.ring_prev)


class _Shards:
    """A team's K/V block as C member shards ``[2 (k, v), b, n_kv, 2c, d]``, each in its own
    storage and each one buffer: a shard moves in one send.

    A shard's memory becomes a receive buffer as soon as its send completed, so moving the
    whole block costs one spare shard, not a second block, and the kernels can start on the
    first shard that arrived while the next is in flight.
    """

    def __init__(self, k: torch.Tensor, v: torch.Tensor, groups: WallFacerGroups):
        """All-gather the team's K/V (async, one call)."""
        self.items, self.work = _gather_shards(torch.stack([k, v]), groups)
        self.spare: List[torch.Tensor] = []

    def wait(self) -> None:
        if self.work is not None:
            self.work.wait()
        self.work = None   # a Work holds the stacked local K/V until dropped

    def post(self, comm: P2PComm, i: int) -> torch.Tensor:
        """Post sending shard ``i`` and receiving its replacement; returns the receive
        buffer."""
        buf = self.spare.pop() if self.spare else torch.empty_like(self.items[i])
        comm.send_recv(self.items[i], buf)
        comm.commit()
        return buf

    def replace(self, comm: P2PComm, i: int, buf: torch.Tensor) -> None:
        """Complete the transfer of shard ``i``: ``buf`` now holds it, its old memory is
        spare."""
        comm.wait()
        self.spare.append(self.items[i])
        self.items[i] = buf


def _forward_calls(calls: List[Call], q, kv, out, lse, softmax_scale, fresh: bool) -> bool:
    """Attention of ``q [b, n, 2c, d]`` to one K/V shard over ``calls``, merged into ``out`` /
    ``lse`` (fp32, in place). ``fresh``: the accumulator has seen nothing yet, so a call that
    covers every row is copied in instead of merged. Returns whether it is still fresh."""
    for qs, ks, causal in calls:
        blk_out, blk_lse = kernels.attention_forward(
            q[:, :, qs], kv[0][:, :, ks], kv[1][:, :, ks], causal=causal,
            softmax_scale=softmax_scale)
        if fresh and qs == ALL:
            out.copy_(blk_out)
            lse.copy_(blk_lse)
        else:
            kernels.merge_ring_(out[:, :, qs], lse[:, :, qs], blk_out, blk_lse)
        fresh = False
    return fresh


def wallfacer_forward(q, k, v, groups: WallFacerGroups, *, causal: bool,
                      softmax_scale: Optional[float] = None, stats: Optional[dict] = None,
                      layout: Optional[packing.Layout] = None):
    """Alg. 1 on this rank's ``[b, n, 2c, d]`` tokens; returns ``(out, lse [b, n, 2c])``.

    ``stats`` (optional dict) receives ``work`` = chunk-pair units computed per ring step.
    ``layout``: packed documents (``megatron_metp.packing``), attended each on its own; a
    query row that sees no key (padding) ends with out = 0, lse = -inf.

    Overlap. The K/V block moves member shard by member shard: at step 0 the initial send of
    shard cm + 1 is in flight while the kernels read shard cm (only shard 0 is waited for
    before the first kernel); at steps 0..G-2 shard cm goes on round the sub-ring while the
    kernels read it. With the zigzag layout every member shard has a visible chunk pair, so
    every transfer has a kernel to hide behind. The team merge (C > 1) follows the last
    kernel: one lse all-gather and one reduce-scatter, exposed.

    Memory: the block, plus at step 0 the receive buffers of two shards (the initial send's
    next shard and the ring's), later one: 2 C A_kv + 4 A_kv at most.
    """
    C, G = groups.team_size, groups.ring_length
    acc = kernels.acc_dtype(q.dtype)
    # 1. Team all-gather. K/V first (the init send waits on it); the q gather overlaps the
    #    init send of shard 0.
    kv = _Shards(k, v, groups)
    q_team, q_work = _gather_shards(q, groups)        # q_team[a]: member a's queries
    kv.wait()
    # 2. Initial send (Alg. 2): afterwards this rank holds the K/V of team
    #    kv_team_at_step(idx, 0). Shard 0 is needed before any kernel; the others move during
    #    step 0 (below).
    init = _init_comm(groups)
    if init is not None:
        kv.replace(init, 0, kv.post(init, 0))
    if q_work is not None:
        q_work.wait()
        q_work = None
    q_ids = _team_chunks(groups, groups.team)
    c = q.shape[2] // 2
    out_acc = torch.zeros((C,) + tuple(q.shape), dtype=acc, device=q.device)
    lse_acc = torch.full((C,) + tuple(q.shape[:3]), float("-inf"), dtype=acc, device=q.device)
    fresh = [True] * C
    ring = _ring_comm(groups)
    work_per_step = []
    # 3. G ring steps (Alg. 3).
    for step in range(G):
        k_ids = _team_chunks(groups, cg.kv_team_at_step(groups.idx, step, groups.cp_size, C,
                                                          groups.placement))
        units = 0.0
        for cm in range(C):
            nxt = None
            if step == 0 and init is not None and cm + 1 < C:
                nxt = kv.post(init, cm + 1)   # the initial send, one shard ahead
            fwd = kv.post(ring, cm) if step + 1 < G else None   # shard cm goes on
            for a in range(C):
                calls = _calls(q_ids[a], k_ids[cm], causal, layout, c)
                fresh[a] = _forward_calls(calls, q_team[a], kv.items[cm], out_acc[a],
                                          lse_acc[a], softmax_scale, fresh[a])
                units += _units(calls, c)
            if nxt is not None:
                kv.replace(init, cm + 1, nxt)
            if fwd is not None:
                kv.replace(ring, cm, fwd)
            nxt = fwd = None
        if step + 2 >= G:
            kv.spare = []     # nothing moves after this step: drop the spare shards
        work_per_step.append(units)
    kv = q_team = None   # free the block and the team's queries before the merge
    if stats is not None:
        stats["work"] = work_per_step
    if C == 1:
        return out_acc[0].to(q.dtype), lse_acc[0]
    return _team_merge(out_acc, lse_acc, groups, q.dtype)


def _team_merge(out_acc, lse_acc, groups: WallFacerGroups, dtype):
    """Step 4: the members' partial outputs cover disjoint key sets, so a row's true lse is the
    log-sum-exp of theirs: all-gather the lse, rescale, then a plain summing reduce-scatter
    gives each member its own tokens' output. Causal: a query row may see none of a member's
    keys (all later in the sequence); its partial stays out = 0, lse = -inf, and gets no
    weight (exp(-inf - -inf) is NaN, zeroed)."""
    C = groups.team_size
    lse_all = lse_acc.new_empty((C,) + tuple(lse_acc.shape))   # [holder, member, b, n, 2c]
    dist.all_gather_into_tensor(lse_all.view((-1,) + tuple(lse_acc.shape[1:])), lse_acc,
                                group=groups.team_group_pg)
    lse_fin = torch.logsumexp(lse_all, dim=0)
    del lse_all
    out_acc.mul_(torch.exp(lse_acc - lse_fin).nan_to_num_(0.0).unsqueeze(-1))
    out_local = out_acc.new_empty(out_acc.shape[1:])
    # Flat views: gloo wants output x C = input along dim 0.
    dist.reduce_scatter_tensor(out_local.view(-1), out_acc.view(-1),
                               group=groups.team_group_pg)
    return out_local.to(dtype), lse_fin[groups.member]


class _Package:
    """One member shard's query package, in one byte buffer (so that a hop is one send)::

        head   [q | dout | out]  [3, b, n, 2c, d] data dtype, and lse [b, n, 2c] fp32:
               read-only, it travels ahead of the kernels that read it
        tail   dq                [b, n, 2c, d] fp32: the dq accumulated for the package that
               was in this buffer's place one step before (it travels one step late)

    The typed views alias the buffer: a receive into ``head`` or ``tail`` fills them.
    """

    def __init__(self, buf: torch.Tensor, shape, dtype: torch.dtype, acc: torch.dtype):
        self.buf, self.shape, self.dtype, self.acc = buf, tuple(shape), dtype, acc
        n = math.prod(self.shape)
        data_end = 3 * n * dtype.itemsize
        head_end = data_end + n // self.shape[-1] * acc.itemsize
        if data_end % acc.itemsize:
            raise ValueError(f"WallFacer: a query package of {n} {dtype} elements does not "
                             f"align its {acc} statistics; use an even head dimension")
        self.data = buf[:data_end].view(dtype).view((3,) + self.shape)
        self.lse = buf[data_end:head_end].view(acc).view(self.shape[:-1])
        self.dq = buf[head_end:].view(acc).view(self.shape)
        self.head, self.tail = buf[:head_end], buf[head_end:]

    @classmethod
    def of(cls, q, dout, out, lse, acc: torch.dtype) -> "_Package":
        n = q.numel()
        nbytes = 3 * n * q.element_size() + (n // q.shape[-1] + n) * acc.itemsize
        pkg = cls(torch.empty(nbytes, dtype=torch.uint8, device=q.device), q.shape, q.dtype,
                  acc)
        for i, t in enumerate((q, dout, out)):
            pkg.data[i].copy_(t)
        pkg.lse.copy_(lse)
        return pkg

    def empty_like(self) -> "_Package":
        return _Package(torch.empty_like(self.buf), self.shape, self.dtype, self.acc)

    def part(self, head: bool, tail: bool) -> torch.Tensor:
        """The bytes to move: the head, the tail, or both (the whole buffer)."""
        return self.buf if head and tail else self.head if head else self.tail


def _gather_packages(own: _Package, groups: WallFacerGroups):
    """The team's packages (heads only: a dq slot is written before it is read), async."""
    if groups.team_size == 1:
        return [own], None
    pkgs = [own if m == groups.member else own.empty_like() for m in range(groups.team_size)]
    work = dist.all_gather([p.head for p in pkgs], own.head, group=groups.team_group_pg,
                           async_op=True)
    return pkgs, work


def _backward_calls(calls: List[Call], pkg: _Package, kv, dq_acc, dkv_acc,
                    softmax_scale) -> None:
    """The backward kernels of one package against one K/V shard: dq into ``dq_acc``, dK/dV
    into ``dkv_acc [2, b, n_kv, 2c, d]`` (fp32, in place on the views)."""
    q, dout, out = pkg.data[0], pkg.data[1], pkg.data[2]
    for qs, ks, causal in calls:
        dq_b, dk_b, dv_b = kernels.attention_backward(
            dout[:, :, qs], q[:, :, qs], kv[0][:, :, ks], kv[1][:, :, ks], out[:, :, qs],
            pkg.lse[:, :, qs], causal=causal, softmax_scale=softmax_scale)
        # .add_ on the view: `x[i] += y` would also copy the sum onto itself (__setitem__).
        dq_acc[:, :, qs].add_(dq_b)
        dkv_acc[0][:, :, ks].add_(dk_b)
        dkv_acc[1][:, :, ks].add_(dv_b)


class _ShardByShard:
    """Shards sent one at a time to a fixed peer, each posted once the previous one is
    complete, so that one is in flight while the caller computes. The peer's shard lands in
    ``target[i]``: added (``add``; the dq accumulator's last hop into the team's dq) or copied
    over the shard just sent (the dK/dV return into the team's gradient rows)."""

    def __init__(self, comm: P2PComm, target, add: bool):
        self.comm, self.target, self.add = comm, target, add
        self.pending = None   # (shard, receive buffer)

    def post(self, src: torch.Tensor, i: int) -> None:
        self.finish()
        self.pending = (i, self.comm.send_recv(src))
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


def wallfacer_backward(dout, q, k, v, out, lse, groups: WallFacerGroups, *, causal: bool,
                       softmax_scale: Optional[float] = None,
                       layout: Optional[packing.Layout] = None):
    """Backward of :func:`wallfacer_forward`; returns ``(dq, dk, dv)`` like ``q, k, v``.

    The team's gradient partials live in one fp32 buffer ``grad_team [C, |q| + |k| + |v|]``
    (member-major: [dq | dk | dv] per member), so the final reduce-scatter needs no copy.

    Hops (:class:`_Package`). At step s this rank computes on package X_s (X_0 its own team's)
    and sends, in one buffer per member shard, X_s's head (while s + 1 < G: ring_next computes
    it next) and the dq it accumulated for X_{s-1} (from s = 2 on: X_1's dq starts here, since
    its owner's contribution stays local). What arrives is X_{s+1} and X_s's dq so far, to
    which this step's contribution is added. After the last step each X_{G-1}'s dq goes home
    to ring_next, its owner.

    Overlap. A member shard's hop is posted before its kernels and waited for after them. In
    the last step, shard a's dq goes home while shard a + 1 computes, and the last query shard
    runs K/V shard by K/V shard, each one's dK/dV going back to its team (the reversed initial
    send) while the next computes. Exposed: the initial send, the last shard's dq hop home,
    the last K/V shard's return and the team reduce-scatter.
    """
    C, G = groups.team_size, groups.ring_length
    acc = kernels.acc_dtype(q.dtype)
    kv = _Shards(k, v, groups)   # after the init send: team kv_team_at_step(idx, 0)
    own = _Package.of(q, dout.to(q.dtype), out.to(q.dtype), lse, acc)
    pkgs, pkg_work = _gather_packages(own, groups)
    kv.wait()
    init = _init_comm(groups)
    if init is not None:
        for cm in range(C):
            kv.replace(init, cm, kv.post(init, cm))
    kv.spare = []
    if pkg_work is not None:
        pkg_work.wait()
    del pkg_work, own
    k_ids = _team_chunks(groups, cg.kv_team_at_step(groups.idx, 0, groups.cp_size, C,
                                                      groups.placement))
    n_q, n_kv = q.numel(), 2 * k.numel()
    grad_team = torch.zeros((C, n_q + n_kv), dtype=acc, device=q.device)
    dq_own = grad_team[:, :n_q].view((C,) + tuple(q.shape))
    dkv = grad_team[:, n_q:].view((C, 2) + tuple(k.shape))   # member cm's [dk | dv]
    ring = _ring_comm(groups)
    back = _init_comm(groups, reverse=True)
    returns = _ShardByShard(back, dkv, add=False) if back is not None else None
    # The hops home: a P2PComm of their own, so one can be in flight beside a step's hop.
    home = _ShardByShard(_ring_comm(groups), dq_own, add=True) if G > 1 else None
    # One spare package: member shards hop one after another, and each hop's sent buffer is
    # free once it completed, so it becomes the next shard's receive buffer.
    spare: Optional[_Package] = pkgs[0].empty_like() if G > 1 else None
    c = q.shape[2] // 2
    for step in range(G):
        q_ids = _team_chunks(groups, cg.q_team_at_step(groups.idx, step, groups.cp_size, C,
                                                         groups.placement))
        head, tail, last = step + 1 < G, step >= 2, step == G - 1
        for a in range(C):
            cur = pkgs[a]
            if head or tail:
                # Safe: cur's bytes are only read until wait(); the receive lands in spare,
                # which nothing reads (or writes) before wait().
                ring.send_recv(cur.part(head, tail), spare.part(head, tail))
                ring.commit()
            # Step 0 is this rank's own team: its contribution is written in place and never
            # travels; later steps fill a scratch added to the arriving dq after the wait.
            target = dq_own[a] if step == 0 else torch.zeros_like(dq_own[a])
            for cm in range(C):
                calls = _calls(q_ids[a], k_ids[cm], causal, layout, c)
                _backward_calls(calls, cur, kv.items[cm], target, dkv[cm], softmax_scale)
                if last and a == C - 1 and returns is not None:
                    returns.post(dkv[cm], cm)   # K/V shard cm's gradients are final
            if head or tail:
                ring.wait()
            if step >= 1:
                if tail:
                    spare.dq.add_(target)
                else:
                    spare.dq.copy_(target)
            del target
            if last and G > 1:
                home.post(spare.dq, a)      # X_{G-1}'s dq to its owner, ring_next
                pkgs[a], spare = None, cur  # home's P2PComm holds the sent buffer
            elif G > 1:
                pkgs[a], spare = spare, cur
    del pkgs, spare, kv
    if home is not None:
        home.finish()
    if returns is not None:
        returns.finish()
    if C == 1:
        res = grad_team[0]
    else:
        res = grad_team.new_empty(grad_team.shape[1:])
        dist.reduce_scatter_tensor(res, grad_team.view(-1), group=groups.team_group_pg)
    dkv_l = res[n_q:].view((2,) + tuple(k.shape))
    return res[:n_q].view(q.shape).to(q.dtype), dkv_l[0].to(k.dtype), dkv_l[1].to(v.dtype)


class WallFacerAttnFunc(torch.autograd.Function):
    """Thin autograd wrapper: fills ctx and delegates (the attention output is the checkpoint:
    the backward never recomputes the forward's attention). Takes and returns this rank's
    ``[b, n, 2c, d]`` tokens (:func:`to_heads_first`)."""

    @staticmethod
    def forward(ctx, q, k, v, groups, causal, softmax_scale, layout=None):
        out, lse = wallfacer_forward(q, k, v, groups, causal=causal,
                                     softmax_scale=softmax_scale, layout=layout)
        ctx.save_for_backward(q, k, v, out, lse)
        ctx.groups, ctx.causal, ctx.softmax_scale, ctx.layout = (groups, causal, softmax_scale,
                                                                  layout)
        return out

    @staticmethod
    def backward(ctx, dout):
        q, k, v, out, lse = ctx.saved_tensors
        dq, dk, dv = wallfacer_backward(dout, q, k, v, out, lse, ctx.groups, causal=ctx.causal,
                                        softmax_scale=ctx.softmax_scale, layout=ctx.layout)
        return dq, dk, dv, None, None, None, None


def to_heads_first(x_sbnd: torch.Tensor) -> torch.Tensor:
    """``[s_local, b, n, d] -> [b, n, s_local, d]`` (a copy: the kernels' layout)."""
    return x_sbnd.permute(1, 2, 0, 3).contiguous()


def from_heads_first(x: torch.Tensor) -> torch.Tensor:
    """``[b, n, s_local, d] -> [s_local, b, n, d]``."""
    return x.permute(2, 0, 1, 3)


def wallfacer_attention(q, k, v, groups: WallFacerGroups, *, causal: bool,
                        softmax_scale: Optional[float] = None,
                        layout: Optional[packing.Layout] = None) -> torch.Tensor:
    """Differentiable WallFacer attention on Megatron-shaped shards.

    q [s/P, b, n, d], k / v [s/P, b, n_kv, d] (this rank's zigzag tokens) -> [s/P, b, n, d].
    ``layout``: packed documents of the whole sequence (b = 1), None for one sequence.
    """
    out = WallFacerAttnFunc.apply(to_heads_first(q), to_heads_first(k), to_heads_first(v),
                                  groups, causal, softmax_scale, layout)
    return from_heads_first(out)
