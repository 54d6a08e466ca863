"""METP attention, every head group in one K/V ring pass (``--metp-ring-pass whole``): the
weights are all-gathered once (W_qkv as its query rows and its key/value rows, the larger part
behind the smaller part's GEMM, where no layer before posted it whole and the layer is large;
a small one gathers it whole: ``wgrad_accum.scatters_together``), Q, K/V and the output
projection are one GEMM each and one ring carries every head's K/V; the weight gradients are
reduce-scattered (a small layer's ``W_proj^T`` gradient with ``W_qkv``'s, in one call).
``--metp-qkv-backward save`` keeps what the ring read for backward instead of recomputing it;
``save+fc1+weights`` keeps the gathered weights too, and the backward gathers none; W_qkv
gathered in two parts is kept so, and each part's gradients are reduce-scattered on their own.
The module and its shapes: ``metp.attention``.
"""

from __future__ import annotations

from typing import Optional

import torch
import torch.nn.functional as F

from megatron_metp.comm import (gather_rows, gather_rows_together, scatter_rows,
                                scatter_rows_together)
from megatron_metp.kernels import widening_mm
from megatron_metp.metp.a2a_attention import (a2a_attention_backward, a2a_attention_forward,
                                              a2a_heads_backward, a2a_heads_forward,
                                              post_backward_inputs)
from megatron_metp.metp.attention_plan import _Plan, _bnsd, _flat, _post_grad, _sbnd
from megatron_metp.metp.ring_attention import (ring_attention_backward, ring_attention_forward,
                                               stack_kv)
from megatron_metp.metp.wgrad_accum import (fuses, param_of, placeholder, reduce_dtype, shard_outs,
                                            weight_grad, weight_grads)


def _attend(plan: _Plan, q, k, v):
    """``(out, lse)``: the K/V ring, or its all-to-all replacement (``--metp-ring-pass a2a``)."""
    if plan.a2a:
        return a2a_attention_forward(plan.group, q, k, v, plan.causal, plan.scale, plan.backend)
    return ring_attention_forward(plan.group, q, k, v, plan.causal, plan.scale, plan.backend,
                                  plan.blocks, plan.layout)


def _attend_backward(plan: _Plan, dout, q, k, v, out, lse, with_dq, posted=None):
    """``(dq, dk, dv)`` of :func:`_attend`; ``posted``: the all-to-alls' exchanges of saved
    inputs posted earlier (``a2a_attention.post_backward_inputs``)."""
    if plan.a2a:
        return a2a_attention_backward(plan.group, dout, q, k, v, out, lse, plan.causal,
                                      plan.scale, plan.backend, with_dq=with_dq, posted=posted)
    return ring_attention_backward(plan.group, dout, q, k, v, out, lse, plan.causal, plan.scale,
                                   plan.backend, with_dq=with_dq, blocks=plan.blocks,
                                   layout=plan.layout)


def _gather_rows(t: Optional[torch.Tensor], plan: _Plan, async_op: bool = False):
    """Every rank's ``t`` stacked along dim 0 over the weight group (TP rank order): for
    ``linear_qkv``'s shards that is the TP = 1 weight (Megatron splits it by whole query groups).
    Returns ``(full, handle)``; ``handle`` is None unless ``async_op``."""
    return gather_rows(t, plan.weight_group, plan.p, async_op)


def _scatter_rows(full: Optional[torch.Tensor], plan: _Plan):
    """Sum ``full`` over the weight group and keep this rank's rows (async): ``(mine, handle)``."""
    return scatter_rows(full, plan.weight_group, plan.p)


def _split_qkv(qkv: torch.Tensor, plan: _Plan, s: int, b: int):
    """``[s, b, ng, n/ng + 2, d]`` (Megatron's per-query-group rows, all groups: the backward's
    recomputed projection) -> q ``[s, b, n, d]`` (a copy) and k, v ``[s, b, ng, d]`` (views)."""
    rep = plan.heads_p // plan.groups_p
    ng = qkv.shape[2]
    # contiguous(): with one query head per group the reshape is a view, which would keep the
    # whole projection output alive through the ring.
    q = qkv[:, :, :, :rep].reshape(s, b, ng * rep, plan.d).contiguous()
    return q, qkv[:, :, :, rep], qkv[:, :, :, rep + 1]


def _qkv_part(w_qkv, b_qkv, heads_p: int, groups_p: int, d: int, i: int):
    """Part ``i`` of this rank's ``linear_qkv`` rows: its query heads' rows (0) or its
    key/value rows (1) (``[rows, h]``, with their bias rows or None), in Megatron's order
    within each; a copy, dense for the gather, where there is more than one query group."""
    rep = heads_p // groups_p
    rows = slice(0, rep) if i == 0 else slice(rep, rep + 2)
    w4 = w_qkv.view(groups_p, rep + 2, d, -1)
    b3 = b_qkv.view(groups_p, rep + 2, d) if b_qkv is not None else None
    return (w4[:, rows].reshape(-1, w4.shape[-1]),
            b3[:, rows].reshape(-1) if b3 is not None else None)


def _gather_order(heads_p: int, groups_p: int) -> list:
    """The parts' gather order: the smaller first (:func:`_project_gathered`): ``heads_p``
    query rows against ``2 groups_p`` key/value rows (per head dimension)."""
    rows = (heads_p, 2 * groups_p)
    return sorted(range(2), key=lambda i: rows[i])


def first_gathers(module, weights=None) -> list:
    """What this pass's forward gathers first, for a METP attention ``module``: its whole
    ``W_qkv`` shard and its bias, as ``(name, tensor, transpose, origin)`` (``origin``: the
    tensor the pass will be given). The layer before posts them behind its MLP
    (``metp.layer_schedule``); :func:`_project_gathered` takes them by these names and, given
    them, runs one GEMM (no cut, no split: the gather is hidden already). ``weights``: the
    views ``(w_qkv, b_qkv | None, w_proj)`` the pass is to run on instead of the parameters,
    or None."""
    w, b = ((module.linear_qkv.weight, module.linear_qkv.bias) if weights is None
            else weights[:2])
    return [("first_qkv", w, False, w), ("first_qkv_bias", b, False, b)]


def first_parts(module) -> list:
    """What a METP attention ``module`` whose ``W_qkv`` no layer before posted gathers first,
    for its layer to post when its forward starts (``layer_schedule.MetpTransformerLayer``),
    ahead of its input norm: per part of ``W_qkv`` (:func:`_qkv_part`), in
    :func:`_project_gathered`'s order, the list ``[(name, rows, False, origin)]`` of the part's
    rows and its bias's (a copy each, made when the list is reached)."""
    w, b = module.linear_qkv.weight, module.linear_qkv.bias
    b = b if b is not None and b.numel() else None
    heads_p, groups_p = module.num_attention_heads_per_partition, \
        module.num_query_groups_per_partition
    d = module.hidden_size_per_attention_head

    def part(i):
        wp, bp = _qkv_part(w, b, heads_p, groups_p, d, i)
        return [(f"qkv_part{i}", wp, False, w), (f"qkv_part{i}_bias", bp, False, b)]

    return (part(i) for i in _gather_order(heads_p, groups_p))


def _project_posted(x2d, w_qkv, b_qkv, plan: _Plan, s: int, b: int, kept=None, then=None):
    """:func:`_project_gathered` where the layer before posted the whole ``W_qkv`` (and its
    bias) behind its MLP (:func:`first_gathers`): one GEMM on every row, already in Megatron's
    per-query-group order; Q its rows (a dense copy for the ring), K/V a view of theirs.
    ``kept`` receives the gathered weight itself; ``then`` runs before the GEMM."""
    w_full, wh = plan.link.take("first_qkv", w_qkv)
    b_full, bh = (plan.link.take("first_qkv_bias", b_qkv) if b_qkv is not None
                  else (None, None))
    return _project_whole(x2d, (w_full, wh, b_full, bh), plan, s, b, kept, then)


def _project_whole(x2d, gathered, plan: _Plan, s: int, b: int, kept=None, then=None):
    """:func:`_project_posted` on ``gathered = (W_qkv, its handle, bias, its handle)``, the
    whole shard's gather (posted by the layer before, or by this pass)."""
    rep, d = plan.heads_p // plan.groups_p, plan.d
    w_full, wh, b_full, bh = gathered
    del gathered
    if then is not None:
        then()
    qkv = _linear(x2d, w_full, wh, b_full, bh).view(s, b, -1, rep + 2, d)
    if kept is not None:
        kept[:] = [w_full]
    del w_full, b_full
    q = qkv[:, :, :, :rep].reshape(s, b, -1, d)
    # Dense, so that no view of Q keeps K/V's rows alive through the attention (and the ring
    # reads Q block by block), except where the all-to-alls saving the heads pack it straight
    # into their send buffer and free the projection (_Plan.saves_heads).
    return (q if plan.saves_heads else q.contiguous()), qkv[:, :, :, rep:]


def _assemble_qkv(parts, plan: _Plan) -> torch.Tensor:
    """The gathered ``W_qkv`` in Megatron's per-query-group row order (what one gather of the
    whole shards gives) from its two gathered parts, every rank's query rows and every rank's
    key/value rows (:func:`_project_gathered` with ``kept``): one copy of the weight, so that
    dX is the same GEMM on the same values as where the backward gathers it."""
    wq, wkv = parts
    rep, d, h = plan.heads_p // plan.groups_p, plan.d, wq.shape[-1]
    ng = wkv.shape[0] // (2 * d)
    full = torch.empty(ng, rep + 2, d, h, dtype=wq.dtype, device=wq.device)
    full[:, :rep] = wq.view(ng, rep, d, h)
    full[:, rep:] = wkv.view(ng, 2, d, h)
    return full.view(-1, h)


def _project_gathered(x2d, w_qkv, b_qkv, plan: _Plan, s: int, b: int, kept=None, then=None):
    """Q ``[s, b, n, d]`` and K, V ``[s, b, ng, d]`` of every head from this rank's tokens
    ``x2d`` and the gathered ``W_qkv``, as two GEMMs: one on the query rows of every rank, one
    on the key/value rows. Each part's weight rows are gathered on their own, the smaller
    first, so that the larger part travels while the smaller part's GEMM runs (one gather
    would be exposed at the start of the attention). Every rank's rows stack in rank order,
    so each output is Megatron's head order as it stands, with no copy to put rows back in
    order: returns Q and ``[s, b, ng, 2, d]`` (K and V of each query group), the GEMMs'
    outputs themselves. ``kept``: a list of two that receives the gathered weight parts (query
    rows, key/value rows) instead of their being freed (``--metp-qkv-backward
    save+fc1+weights``). Where the layer before posted the whole shard's gather behind its MLP
    (``metp.layer_schedule``), one GEMM on it instead (:func:`_project_posted`). ``then``
    runs once the parts' gathers are posted, before the first GEMM waits for them: the
    layer's next gathers go there, so that they queue right behind these. A small layer
    (``_Plan.wgrads_together``) gathers the whole shard and its bias in one call and runs one
    GEMM (:func:`_project_whole`), unless its layer posted the parts."""
    d = plan.d
    if plan.link is not None and plan.link.holds("first_qkv"):
        return _project_posted(x2d, w_qkv, b_qkv, plan, s, b, kept, then)
    order = _gather_order(plan.heads_p, plan.groups_p)
    if plan.wgrads_together and not (plan.link is not None
                                     and plan.link.holds(f"qkv_part{order[0]}")):
        # Small (host-bound, _Plan.wgrads_together): the whole shard and its bias in one
        # gather and one GEMM, as SublayerLink.post_first posts them for such a layer; the
        # parts' cuts, second gather and GEMM, and their gradients' second reduce-scatter,
        # cost more ops than the exposed gather they hide.
        (w_full, b_full), handle = gather_rows_together([w_qkv, b_qkv], plan.weight_group,
                                                        plan.p)
        return _project_whole(x2d, (w_full, handle, b_full, None), plan, s, b, kept, then)
    gathered = {}
    link = plan.link
    for i in order:
        if link is not None and link.holds(f"qkv_part{i}"):
            # Posted by the layer when its forward started (first_parts).
            def part(j, i=i):
                return lambda: _qkv_part(w_qkv, b_qkv, plan.heads_p, plan.groups_p, d, i)[j]
            w_full, wh = link.take(f"qkv_part{i}", part(0), origin=w_qkv)
            b_full, bh = (link.take(f"qkv_part{i}_bias", part(1), origin=b_qkv)
                          if b_qkv is not None else (None, None))
            gathered[i] = (w_full, wh, b_full, bh)
            continue
        # A part's rows and its bias in one call (comm.gather_rows_together), each posted as
        # soon as its copy is made: the first gather, which the first GEMM waits for, does
        # not wait for the second part's copy too (GPT-175B's first layer at 16k: 0.08 ms).
        (w_full, b_full), handle = gather_rows_together(
            _qkv_part(w_qkv, b_qkv, plan.heads_p, plan.groups_p, d, i), plan.weight_group,
            plan.p)
        gathered[i] = (w_full, handle, b_full, None)
    if then is not None:
        then()
    out = [None, None]
    for i in order:
        w_full, wh, b_full, bh = gathered.pop(i)
        out[i] = _linear(x2d, w_full, wh, b_full, bh)
        if kept is not None:
            kept[i] = w_full
        del w_full, b_full
    return out[0].view(s, b, -1, d), out[1].view(s, b, -1, 2, d)


def _post_behind_qkv(plan: _Plan, w_qkv, b_qkv, w_proj, keeps_weights: bool):
    """Post what the forward gathers after ``W_qkv`` and return ``(W_proj^T gathered, its
    handle)``. W_proj^T's rows are the heads in order: gathered while the attention computes.
    With the layer's link, the MLP's weights travel next, behind the attention's compute (with
    W_proj^T in one call where they are small: comm.call_groups), and the link learns what
    this pass's backward gathers, which the MLP's backward posts ahead of its reduce-scatters
    (metp.layer_schedule; the bias only enters a recomputed projection; nothing when the
    weights are kept, save+fc1+weights). Called once W_qkv's gathers are posted and before
    the projection's GEMM waits for them (:func:`_project_gathered`'s ``then``), so that the
    link carries them back to back: posted after that GEMM, GPT-175B's layer at 16k left the
    link idle for 1.5 ms while its fc1 gather was still to come (``metp plan --timeline``,
    ESTIMATE)."""
    if plan.link is None:
        return _gather_rows(w_proj.t(), plan, async_op=True)
    plan.link.attention_gathers = [] if keeps_weights else [
        ("proj", w_proj, True), ("qkv", w_qkv, False),
        ("qkv_bias", None if plan.save_qkv else b_qkv, False)]
    plan.link.attention_whole = True
    plan.link.post_mlp(lead=(("proj_out", w_proj, True),))
    return plan.link.take("proj_out", w_proj, transpose=True)


def _linear(x2d, w_full, wh, b_full, bh) -> torch.Tensor:
    """``x2d w^T + b`` once the gathers ``wh`` / ``bh`` (None: done) are in: one GEMM with
    the bias (``addmm``, as ``F.linear`` runs the backward's recomputed projection)."""
    for hnd in (wh, bh):
        if hnd is not None:
            hnd.wait()
    if b_full is None:
        return x2d.mm(w_full.t())
    return torch.addmm(b_full, x2d, w_full.t())


def _dqkv_slots(s: int, b: int, ng: int, rep: int, d: int, dtype, device, parted: bool):
    """Where backward lays dQ, dK and dV for the weight-gradient and dX GEMMs: one
    ``[s, b, ng, rep + 2, d]`` in Megatron's row layout, or, where the forward kept ``W_qkv``'s
    two gathered parts (query rows, key/value rows: :func:`_project_gathered`), two of their
    own, ``[s, b, ng, rep, d]`` and ``[s, b, ng, 2, d]``, so that each part's GEMMs run on the
    part as kept. Returns ``(mats, q, k, v)``: the GEMMs' ``[s b, -]`` matrices (one or two),
    and the slots ``[s, b, ng, rep, d]``, ``[s, b, ng, 1, d]``, ``[s, b, ng, 1, d]``."""
    if not parted:
        t = torch.empty((s, b, ng, rep + 2, d), dtype=dtype, device=device)
        return [t.view(s * b, -1)], t[:, :, :, :rep], t[:, :, :, rep:rep + 1], t[:, :, :, rep + 1:]
    tq = torch.empty((s, b, ng, rep, d), dtype=dtype, device=device)
    tkv = torch.empty((s, b, ng, 2, d), dtype=dtype, device=device)
    return [tq.view(s * b, -1), tkv.view(s * b, -1)], tq, tkv[:, :, :, :1], tkv[:, :, :, 1:]


def _rows_to_qkv(rows: torch.Tensor, plan: _Plan, parted: bool) -> list:
    """``a2a_heads_backward``'s ``[s, b, p, H, d]`` (row j: rank j's heads' gradients in
    Megatron's row order, per query group its dQ heads, dK, dV) -> the GEMMs' matrices of
    :func:`_dqkv_slots` (``parted``: one per kept part of ``W_qkv``): one copy per matrix, or,
    with RoPE, dQ and dK turned back first (:meth:`_Plan.unrotate`, on ``[s, b, heads, d]`` as
    the ring's backward applies it) and dV copied."""
    s, b, p, _, d = rows.shape
    nkv = plan.groups_p
    rep = plan.heads_p // nkv
    mats, *slots = _dqkv_slots(s, b, p * nkv, rep, d, rows.dtype, rows.device, parted)
    rows = rows.view(s, b, p, nkv, rep + 2, d)
    if plan.freqs is None:
        bounds = ((0, rep), (rep, rep + 2)) if parted else ((0, rep + 2),)
        for mat, (lo, hi) in zip(mats, bounds):
            mat.view(s, b, p, nkv, hi - lo, d).copy_(rows[:, :, :, :, lo:hi])
        return mats
    for which, (lo, hi) in enumerate(((0, rep), (rep, rep + 1), (rep + 1, rep + 2))):
        part = rows[:, :, :, :, lo:hi]
        if which < 2:
            part = plan.unrotate(part.reshape(s, b, p * nkv * (hi - lo), d), which).view(
                s, b, p, nkv, hi - lo, d)
        slots[which].view(s, b, p, nkv, hi - lo, d).copy_(part)
    return mats


def _mlp_gradients_now(plan: _Plan) -> None:
    """Before the backward waits for its own reduce-scatters: the layer's MLP, whose
    reduce-scatters the weight group carried first, makes its gradients now, while these
    travel (``layer_schedule.SublayerLink.mlp_gradients_now``)."""
    if plan.link is not None:
        plan.link.mlp_gradients_now()


def _join_parts(parts, like: torch.Tensor, plan: _Plan) -> torch.Tensor:
    """This rank's ``linear_qkv`` weight (or bias) gradient in ``like``'s dtype and Megatron's
    per-query-group row order from its two reduce-scattered parts (query rows, key/value rows;
    :func:`_qkv_part`'s split): the cast the whole gradient takes anyway, in two copies; or,
    where the gradient goes straight into ``main_grad`` (``metp.wgrad_accum``), two adds
    there."""
    rep = plan.heads_p // plan.groups_p
    fused = fuses(like, plan.fuse_wgrad)
    out = param_of(like).main_grad if fused else torch.empty_like(like)
    o = out.view(plan.groups_p, rep + 2, plan.d, *like.shape[1:])
    step = torch.Tensor.add_ if fused else torch.Tensor.copy_
    step(o[:, :rep], parts[0].view(plan.groups_p, rep, plan.d, *like.shape[1:]))
    step(o[:, rep:], parts[1].view(plan.groups_p, 2, plan.d, *like.shape[1:]))
    return placeholder(like) if fused else out


class _MetpWholeFunction(torch.autograd.Function):
    """Every head group in one K/V ring pass: the coarse end of the head slicing.

    The ``p`` head groups' weights are all-gathered once (``linear_qkv``'s and ``linear_proj``'s
    shards, h(h + 2 ng d) + h^2 elements, the bytes of the p broadcasts), Q/K/V of all heads come
    from one GEMM on this rank's tokens, one ring pass moves all K/V heads (p - 1 hops of one
    message each), and the output projection is one GEMM. Backward mirrors it, with the weight
    gradients reduce-scattered to their owners. The same arithmetic as the per-head-group loop
    in fewer, larger operations (``head_chunks``: a few kernels and messages instead of p per
    hop), at the price of all heads' Q/K/V at once: about ``(n + 2 ng) d`` values per token
    while the ring runs, which is why long inputs keep the per-head-group loop. Saved for
    backward as there: x, A and the lse.
    """

    @staticmethod
    def forward(ctx, plan: _Plan, x, w_qkv, b_qkv, w_proj, *norm_params):
        s, b, h = x.shape
        x2d = x.reshape(s * b, h)
        kept = [None, None] if plan.keep_weights else None
        posted, keeps = [], kept is not None
        # W_proj^T and the MLP's weights, posted right behind W_qkv's gathers
        # (_post_behind_qkv).
        q_lin, kv_lin = _project_gathered(
            x2d, w_qkv, b_qkv, plan, s, b, kept,
            then=lambda: posted.extend(_post_behind_qkv(plan, w_qkv, b_qkv, w_proj, keeps)))
        wpt, wpt_handle = posted
        posted.clear()
        q, k = q_lin, kv_lin[:, :, :, 0]
        if plan.has_post:
            q, k = plan.post(q, k)
        ctx.rotated = plan.save_qkv and plan.post_is_rotation
        # --metp-ring-pass a2a with Q/K/V saved after RoPE: the all-to-all's head-sharded
        # Q/K/V and lse are what backward keeps (metp.a2a_attention, "Saving the heads"); the
        # same bytes as this rank's tokens of every head, and backward exchanges none of them.
        ctx.heads = plan.saves_heads
        if ctx.heads:
            # Handed over as a list the exchange empties: the projection is freed once packed.
            qkv = [q, k, kv_lin[:, :, :, 1]]
            del q, k, q_lin, kv_lin
            a, qkv_h, lse = a2a_heads_forward(plan.group, qkv, plan.causal, plan.scale,
                                              plan.backend)
            keep = (qkv_h, None)
            del qkv_h
        else:
            # K and V into the buffer the ring sends; the projection's output is freed before
            # it.
            k, v = stack_kv(_bnsd(k), _bnsd(kv_lin[:, :, :, 1]))
            # QKV_BACKWARD "save": what the ring reads stays for backward, else it is freed
            # here and backward recomputes it. With RoPE alone (or nothing) after the
            # projection, that is Q after RoPE and the K/V buffer (the ring never writes it:
            # comm.DoubleBuffer), as many values as the projection, (n + 2 ng) d per token:
            # backward then runs neither the split's copies nor RoPE again, and takes RoPE's
            # gradient as a turn by -θ (_Plan.unrotate). A q/k norm needs its input for its
            # gradient: the projection's two parts are kept.
            keep = ((q, k._base) if ctx.rotated
                    # (dense: views of one projection would keep all of it)
                    else (q_lin.contiguous(), kv_lin.contiguous()) if plan.save_qkv
                    else (None, None))
            del q_lin, kv_lin
            a, lse = _attend(plan, _bnsd(q), k, v)
            del q, k, v
        if kept is not None:
            # save+fc1+weights: W_qkv gathered whole (posted by the layer before), or its two
            # parts as gathered: the backward runs each part's GEMMs on it (_dqkv_slots), so
            # nothing copies the weight. Reassembled (one copy of it) only where the layer
            # before is to wait for this pass's gradients (plan.later_box: it hands autograd
            # one tensor per weight), which in practice comes with a whole, posted W_qkv.
            kept = (kept[0] if len(kept) == 1 else tuple(kept) if plan.later_box is None
                    else _assemble_qkv(kept, plan))
        if wpt_handle is not None:
            wpt_handle.wait()
        out = _flat(a).mm(wpt)
        ctx.plan = plan
        ctx.has_bias = b_qkv is not None
        # save+fc1+weights: the gathered W_qkv and W_proj^T for the backward, which then gathers
        # nothing. Not saved tensors: autograd's version check guards w_qkv and w_proj, which
        # they were gathered from and which are saved.
        ctx.kept = (kept, wpt) if kept is not None else None
        del kept
        ctx.save_for_backward(x, w_qkv, b_qkv, w_proj, a, lse, *keep)
        del keep
        return out.view(s, b, h)

    @staticmethod
    def backward(ctx, dout):
        plan: _Plan = ctx.plan
        x, w_qkv, b_qkv, w_proj, a, lse, keep_q, keep_kv = ctx.saved_tensors
        norm_params = [prm for m in (plan.q_norm, plan.k_norm) if m is not None
                       for prm in m.parameters()]
        n_q = len(list(plan.q_norm.parameters())) if plan.q_norm is not None else 0
        dnorm = [torch.zeros_like(prm) for prm in norm_params]
        s, b, h = x.shape
        x2d, dout2d = x.reshape(s * b, h), dout.reshape(s * b, h)
        # The bias only enters the recompute: a saved projection needs no gather of it.
        b_src = None if keep_q is not None else b_qkv
        # The layer before waits for this pass's reduce-scatters, after its MLP's backward
        # (layer_schedule.SublayerLink.defer_next_attention), where the weights are kept.
        box = plan.later_box if ctx.kept is not None else None
        parted = False
        if ctx.kept is not None:
            # save+fc1+weights: Q/K/V saved (save_qkv), both gathered weights kept.
            (w_full, wpt), ctx.kept = ctx.kept, None
            b_full = None
            # W_qkv as its two gathered parts (query rows, key/value rows), or whole.
            parted = isinstance(w_full, tuple)
            wpt_handle = w_handle = b_handle = None
        elif plan.link is not None:
            # Posted by the MLP's backward (metp.layer_schedule), or gathered now.
            wpt, wpt_handle = plan.link.take("proj", w_proj, transpose=True)
            w_full, w_handle = plan.link.take("qkv", w_qkv)
            b_full, b_handle = plan.link.take("qkv_bias", b_src)
        else:
            wpt, wpt_handle = _gather_rows(w_proj.t(), plan, async_op=True)
            w_full, w_handle = _gather_rows(w_qkv, plan, async_op=True)
            b_full, b_handle = _gather_rows(b_src, plan, async_op=True)
        # Weight gradients are summed over p ranks: in fp32 for bf16/fp16 weights, so the sum
        # adds no rounding TP's single matmul does not have; in bf16 under bf16 main_grad.
        gacc = reduce_dtype(w_proj)
        # --metp-ring-pass a2a: the exchanges of what backward's attention reads and we already
        # hold travel behind the two GEMMs below: O and its lse. Saved head-sharded
        # (ctx.heads) only O is to travel: ahead, or with dO in one exchange where that is
        # faster (_Plan.fuse_out).
        posted = None
        if plan.a2a and not (ctx.heads and plan.fuse_out):
            posted = post_backward_inputs(plan.group, out=a, lse=None if ctx.heads else lse)
        a2d = _flat(a)
        # dW_proj^T = A^T dO (this rank's tokens), reduce-scattered while the ring runs; or,
        # where the layer is small, with W_qkv's in one call (_Plan.wgrads_together; not
        # with W_qkv's two kept parts, each reduce-scattered on its own).
        dwpt_full = widening_mm(a2d.t(), dout2d, gacc)
        late_proj = plan.wgrads_together and not parted
        if not late_proj:
            dwpt, dwpt_handle = _scatter_rows(dwpt_full, plan)
            if box is None:
                del dwpt_full
        del a2d
        if wpt_handle is not None:
            wpt_handle.wait()
        da = dout2d.mm(wpt.t()).view(s, b, -1, plan.d).permute(1, 2, 0, 3)
        del wpt
        rep = plan.heads_p // plan.groups_p
        # dQ, dK, dV in Megatron's row layout, for one GEMM (or one per kept part of W_qkv:
        # _dqkv_slots); allocated when the ring hands over dQ (after its kernels), as the
        # per-head-group loop allocates its buffers.
        grads = {}
        mats = None
        if ctx.heads:
            rows = a2a_heads_backward(plan.group, da, posted.pop("out") if posted else a,
                                      keep_q, lse, plan.causal, plan.scale, plan.backend)
            del da, keep_q, keep_kv, lse
            mats = _rows_to_qkv(rows, plan, parted)
            del rows
        elif ctx.rotated:
            q_rot, kv_rot = keep_q, keep_kv
            del keep_q, keep_kv
            # Saved after RoPE: the ring's backward reads what its forward read, and RoPE's
            # gradient is the turn by -θ, applied to dQ while the last dK/dV hop travels.
            ng, q_dtype = q_rot.shape[2] // rep, q_rot.dtype

            def q_side_rot(dq):
                grads["qkv"] = _dqkv_slots(s, b, ng, rep, plan.d, q_dtype, dq.device, parted)
                grads["qkv"][1].copy_(plan.unrotate(_sbnd(dq), 0).view(s, b, ng, rep, plan.d))

            _, dk, dv = _attend_backward(plan, da, _bnsd(q_rot), kv_rot[0], kv_rot[1], a, lse,
                                         q_side_rot, posted)
            del da, q_side_rot, q_rot, kv_rot
            dk = plan.unrotate(_sbnd(dk), 1)
        else:
            # The projection, saved (with a q/k norm) or run again: split, q/k norm and
            # RoPE again through autograd, then the ring's backward.
            if keep_q is None:
                for hnd in (w_handle, b_handle):
                    if hnd is not None:
                        hnd.wait()
                w_handle = None
                # Recompute Q/K/V (Alg. 6 line 6); only the q/k norm and RoPE go through
                # autograd.
                qkv = F.linear(x2d, w_full, b_full).view(s, b, -1, rep + 2, plan.d)
                q_lin, k_lin, v = _split_qkv(qkv, plan, s, b)   # q a copy; k, v views of qkv
            else:
                # The forward's two GEMM outputs (QKV_BACKWARD "save" with a q/k norm); the
                # W_qkv gather is awaited at dX.
                qkv = keep_kv
                q_lin, k_lin, v = keep_q.detach(), qkv[:, :, :, 0], qkv[:, :, :, 1]
            del keep_q, keep_kv
            ng, qkv_dtype = q_lin.shape[2] // rep, q_lin.dtype
            with torch.enable_grad():
                if plan.has_post:
                    q_lin.requires_grad_(True)
                    # K's own copy for its norm / RoPE gradient: a view would keep qkv alive.
                    k_lin = k_lin.clone().requires_grad_(True)
                q, k = plan.post(q_lin, k_lin) if plan.has_post else (q_lin, k_lin)
            k_ring, v_ring = stack_kv(_bnsd(k.detach()), _bnsd(v))
            del qkv, v   # with k (a view of it) when nothing needs k's gradient graph
            if not plan.has_post:
                del k, k_lin

            def q_side(dq, q=q, q_lin=q_lin):
                dq = _sbnd(dq)
                if plan.has_post:
                    dq = _post_grad(q, q_lin, norm_params[:n_q], dq, dnorm[:n_q])
                grads["qkv"] = _dqkv_slots(s, b, ng, rep, plan.d, qkv_dtype, dq.device, parted)
                grads["qkv"][1].copy_(dq.view(s, b, ng, rep, plan.d))

            _, dk, dv = _attend_backward(plan, da, _bnsd(q.detach()), k_ring, v_ring, a, lse,
                                         q_side, posted)
            del da, q_side, k_ring, v_ring
            dk = _sbnd(dk)
            if plan.has_post:
                dk = _post_grad(k, k_lin, norm_params[n_q:], dk, dnorm[n_q:])
                del k, k_lin
            del q, q_lin
        # dK (through RoPE / the q/k norm) and dV into the rows the q side allocated.
        if mats is None:
            mats, _, k_slot, v_slot = grads.pop("qkv")
            k_slot.copy_(dk.unsqueeze(3))
            v_slot.copy_(_sbnd(dv).unsqueeze(3))
            del dk, dv, k_slot, v_slot
        if parted:
            # W_qkv kept as its two gathered parts (save+fc1+weights, no layer before to wait
            # for the gradients): each part's weight gradient is reduce-scattered on its own,
            # the smaller first, behind the larger's GEMM and dX's (one whole reduce-scatter
            # would start only after the whole weight-gradient GEMM); dX is the sum of the
            # parts' GEMMs (two partial sums where the gathered weight had one: still fewer
            # than TP's dX, reduce-scattered from p).
            # Per part: ([weight's, bias's] reduce-scattered in one call, its handle).
            mines, handles = [None, None], [None, None]
            for i in _gather_order(plan.heads_p, plan.groups_p):
                dw_part = widening_mm(mats[i].t(), x2d, gacc)
                db_part = mats[i].sum(0, dtype=gacc) if ctx.has_bias else None
                mines[i], handles[i] = scatter_rows_together([dw_part, db_part],
                                                             plan.weight_group, plan.p)
                del dw_part, db_part
            dx = mats[0].mm(w_full[0])
            dx.addmm_(mats[1], w_full[1])
            del w_full, mats
            _mlp_gradients_now(plan)
            for hnd in (dwpt_handle, *handles):
                if hnd is not None:
                    hnd.wait()
            return (None, dx.view(s, b, h), _join_parts([m[0] for m in mines], w_qkv, plan),
                    _join_parts([m[1] for m in mines], b_qkv, plan) if ctx.has_bias else None,
                    weight_grad(dwpt, w_proj, plan.fuse_wgrad, transpose=True), *dnorm)
        (dqkv2d,) = mats
        # The weight gradient first, so that its reduce-scatter runs behind dX's GEMM (where
        # it is posted here: a small layer's deferred ones are posted by the layer before's
        # MLP, below).
        dw_full = widening_mm(dqkv2d.t(), x2d, gacc)
        db_full = dqkv2d.sum(0, dtype=gacc) if ctx.has_bias else None
        # The weight's and the bias's in one call (comm.scatter_rows_together), laid out as
        # their main_grads are where one add can take both (wgrad_accum); W_proj^T's in the
        # same call where the layer is small (late_proj). Small, and the layer before waits
        # for them: not posted here, but by that layer's MLP backward, next, in its own call
        # (_LaterBox.hold_unposted).
        fulls = [dw_full, db_full] + ([dwpt_full] if late_proj else [])
        outs = shard_outs(fulls, [w_qkv, b_qkv, None], plan.p, plan.fuse_wgrad)
        unposted = box is not None and late_proj
        if not unposted:
            mines, dw_handle = scatter_rows_together(fulls, plan.weight_group, plan.p, outs)
            dw, db = mines[:2]
            db_handle = dw_handle
            if late_proj:
                dwpt, dwpt_handle = mines[2], dw_handle
            del fulls, mines
            if box is None:
                del dw_full, db_full
                if late_proj:
                    del dwpt_full
        if w_handle is not None:
            w_handle.wait()
        dx = dqkv2d.mm(w_full)
        del w_full, b_full
        if unposted:
            outs = outs or [None] * 3
            late = dict(group=plan.weight_group, p=plan.p)
            return (None, dx.view(s, b, h),
                    box.hold_unposted(0, dw_full, w_qkv, mine=outs[0], **late),
                    box.hold_unposted(1, db_full, b_qkv, mine=outs[1], **late)
                    if ctx.has_bias else None,
                    box.hold_unposted(2 if ctx.has_bias else 1, dwpt_full, w_proj,
                                      transpose=True, **late), *dnorm)
        del outs
        if box is not None:
            # Posted, not waited for: the box keeps each reduce-scatter's input alive and hands
            # autograd the gradient once the layer before has waited (_GradsLater).
            return (None, dx.view(s, b, h), box.hold(0, dw, dw_handle, dw_full, w_qkv),
                    box.hold(1, db, db_handle, db_full, b_qkv) if ctx.has_bias else None,
                    box.hold(2 if ctx.has_bias else 1, dwpt, dwpt_handle, dwpt_full, w_proj,
                             transpose=True), *dnorm)
        _mlp_gradients_now(plan)
        for hnd in (dwpt_handle, dw_handle, db_handle):
            if hnd is not None:
                hnd.wait()
        g_w, g_b = weight_grads([dw, db], [w_qkv, b_qkv], plan.fuse_wgrad)
        return (None, dx.view(s, b, h), g_w, g_b,
                weight_grad(dwpt, w_proj, plan.fuse_wgrad, transpose=True), *dnorm)
