"""METP's MLP with its weights all-gathered once (the short-sequence form of the weight ring).

The weight ring (``metp.weight_ring``, paper Alg. 1-2) moves each fc1/fc2 shard around the ring
and computes one shard at a time: p steps, each with its GEMMs, its activation, its sends and
receives, and in backward its travelling fp32 accumulators. That is what keeps METP's MLP
activations at ``[n/p, F'/p]`` per step, and what makes it cost ~100 launched operations and ~80
point-to-point calls per layer at p = 8 whatever the sequence. On a GPU every one of them is
issued by the host (~30 us each, ``docs/calibration/README.md``), so at short sequences the
ring is host-bound: LLaMA-7B's METP layer at 4k-16k took ~9 ms of host time for ~2-6 ms of
GPU work (``metp plan --timeline``, ESTIMATE).

This pass moves the same weights with the same per-rank bytes in a constant number of
operations, as METP's whole attention pass (``metp.whole_pass``) treats the attention's::

    forward    W_in  = all_gather(w_in)   [F', h]   (every rank's [gate_r; up_r] rows, in order)
               W_out^T = all_gather(w_out^T) [F, h] (travels behind fc1's GEMM)
               T = X_i W_in^T (+ b_in)   [n/p, F']  one GEMM on this rank's tokens
               D = f(T), per shard       [n/p, F]   (gated units: each shard's own halves)
               O_i = D W_out^T^T         [n/p, h]   one GEMM
    backward   the two gathers again; D = f(T) again (T kept, or one GEMM again; D kept
               too where small, keeps_act);
               dW_out^T = D^T dO_i, reduce-scattered to the owners (fp32 for half types);
               dT = f'(T) dD with dD = dO_i W_out^T^T;
               dW_in = dT^T X_i (and db_in = sum dT), reduce-scattered (a small layer's
               dW_out^T with them, in one call: wgrad_accum.scatters_together);
               dX_i = dT W_in.

Per rank it sends what the ring sends: (p-1)/p of the weights twice and of their fp32
gradients once; with ``--metp-qkv-backward save+fc1+weights`` the gathered weights stay from the
forward to the backward, which gathers nothing (the weights once, for 2 h F' + 2 h F bytes
held per layer). The tokens never move: activations stay sequence-sharded, so the memory
Table 1 counts is unchanged. What it costs instead: this rank's tokens' whole ``[n/p, F']``
intermediate at once (the ring's steps hold ``[n/p, F'/p]``; with ``--metp-qkv-backward
save+fc1`` the ring keeps the p steps' outputs, the same ``[n/p, F']``), the gathered weights
(3hF values for a gated unit) and their fp32 gradients before the reduce-scatter. So
``MetpMLP`` takes it only where that intermediate is small (``GATHERED_MLP_BYTES``): short
sequences, where the ring's launches cost the most and memory the least.

Precision: the GEMMs run in the data's dtype, as the ring's and Megatron's. Weight gradients
are computed in one GEMM over this rank's tokens, cast to fp32 for half types and summed over
the p ranks by the reduce-scatter (the ring sums its p contributions in fp32 too).
"""

from __future__ import annotations

from typing import Callable, Optional, Tuple

import torch
import torch.distributed as dist

from megatron_metp.comm import gather_rows as _gather, scatter_rows as _scatter
from megatron_metp.comm import scatter_rows_together
from megatron_metp.kernels import widening_mm
from megatron_metp.metp.wgrad_accum import reduce_dtype, shard_outs, weight_grad, weight_grads
from megatron_metp.metp.weight_ring import _fc1

__all__ = ["GATHERED_MLP_BYTES", "takes_gathered", "GatheredMLPFunction"]

# MetpMLP (--metp-mlp-pass auto) runs this pass while one [n/p, F'] fc1 output (this rank's
# tokens, every shard) is at most this many bytes: in bf16 at p = 8, LLaMA-7B up to 12,192
# tokens per rank (s <= 97k), LLaMA-70B to 37k, GPT-175B to 44k, BERT-Large to 512k. Its
# backward holds about three such tensors (T, dT, and D and dD at half the width each), under
# 2 GB. The planner's timeline (ESTIMATE, H100, p = 8, one METP layer) has it faster than the
# ring at 4k / 8k / 16k: LLaMA-7B 5.3 / 5.8 / 7.9 ms against 9.5 / 9.6 / 10.1 (the ring is
# host-bound there, 301 launched operations per layer against 139), LLaMA-70B 18.1 / 19.0 /
# 25.0 against 21.2 / 22.3 / 26.9, GPT-175B 38.1 / 39.7 / 48.7 against 42.9 / 44.7 / 54.0;
# at 32k and 64k within 1.5 % (GPT-175B 32k 85.5 against 86.7 ms, BERT-Large 64k 14.3 against
# 18.3), where the ring's launches and hops hide behind its GEMMs. So above this, where memory
# decides what fits, the ring keeps its [n/p, F'/p] steps.
GATHERED_MLP_BYTES = 512 * 2**20


def takes_gathered(tokens: int, fc1_rows: int, itemsize: int,
                   limit: Optional[int] = None) -> bool:
    """Whether ``--metp-mlp-pass auto`` gathers the weights for ``tokens`` tokens on this rank
    and ``fc1_rows`` gathered fc1 rows (F'), ``itemsize`` bytes per value."""
    limit = GATHERED_MLP_BYTES if limit is None else limit
    return tokens * fc1_rows * itemsize <= limit


# The activation's output D ([tokens, F] on this rank) kept for backward beside fc1's output T
# (``keep_fc1``) where it has at most this many values (16 MiB in bf16, under 0.4 GiB for
# BERT-Large's or LLaMA-7B's whole stack): backward then skips the activation it otherwise
# runs again for fc2's weight gradient, as Megatron's MLP keeps fc2's input. That is one op
# fewer per layer where the layer is host-bound (BERT-Large up to 16k tokens and LLaMA-7B at
# 4k at p = 8, ``measure.timeline``: ~30 us per op); above it the bytes count, and D is
# recomputed from T.
KEEP_ACT_MAX_VALUES = 1 << 23


def keeps_act(tokens: int, width: int) -> bool:
    """Whether a forward that keeps T also keeps D, ``tokens x width`` values
    (:data:`KEEP_ACT_MAX_VALUES`). Decided by the MLP's forward, outside autograd."""
    return tokens * width <= KEEP_ACT_MAX_VALUES


def _wait(*handles) -> None:
    for h in handles:
        if h is not None:
            h.wait()


def _per_shard(t: torch.Tensor, p: int) -> torch.Tensor:
    """``[n, F']`` -> ``[n, p, F'/p]``: each rank's columns on their own, so that a gated
    activation halves each shard's [gate_r; up_r] (fc1's stride-2 layout) as on the ring."""
    return t.view(t.shape[0], p, t.shape[1] // p)


class GatheredMLPFunction(torch.autograd.Function):
    """``out = GatheredMLPFunction.apply(x, w_in, b_in, w_out, act, group, keep_fc1)``.

    ``x [n/p, h]`` this rank's tokens; ``w_in [F'/p, h]``, ``b_in [F'/p]`` or None and
    ``w_out [h, F/p]`` its shards (Megatron's TP layout); returns ``[n/p, h]`` without fc2's
    bias. Saves ``x`` and the parameters, and with ``keep_fc1`` the fc1 output T (the backward
    then runs no fc1 GEMM); with ``keep_weights`` (``--metp-qkv-backward save+fc1+weights``,
    only with ``keep_fc1``) the gathered W_in and W_out^T too, and the backward gathers
    nothing: the same GEMMs on the same values, the weights moved once per step instead of
    twice, for 2 h F' + 2 h F bytes (bf16) held from this forward to its backward.
    ``link``: the layer's ``metp.layer_schedule.SublayerLink`` or None; with it the forward
    takes the gathers the attention posted, the backward posts the attention's before its
    reduce-scatters, and leaves those to the link to wait for (the attention's backward,
    before it waits for its own, or else the layer's ``_GradsLater`` node).
    ``keep_act``: with ``keep_fc1``, the activation's output D kept too (:func:`keeps_act`);
    ``together``: fc2's weight-gradient reduce-scatter posted with fc1's, in one call
    (``wgrad_accum.scatters_together``), not as soon as its GEMM has run.
    The group, the choices and the link arrive as arguments: nothing global is read here.
    """

    @staticmethod
    def forward(ctx, x, w_in, b_in, w_out, act: Callable, group, keep_fc1: bool = False,
                link=None, keep_weights: bool = False, fuse_wgrad: bool = False,
                keep_act: bool = False, together: bool = False):
        keep_weights = keep_weights and keep_fc1
        # D too (keeps_act), where the activation has a backward of its own to run without
        # D's graph.
        keep_act = keep_act and keep_fc1 and getattr(act, "backward", None) is not None
        p = dist.get_world_size(group) if dist.is_initialized() else 1
        if link is not None:
            # Posted behind the attention (metp.layer_schedule), or gathered now.
            w_full, wh = link.take("fc1", w_in)
            b_full, bh = link.take("fc1_bias", b_in)
            wot, woh = link.take("fc2", w_out, transpose=True)
        else:
            w_full, wh = _gather(w_in, group, p)
            b_full, bh = _gather(b_in, group, p)
            # fc2's shards as rows of W_out^T: stacked in rank order they are W_out^T itself.
            wot, woh = _gather(w_out.t(), group, p)
        _wait(wh, bh)
        t = _fc1(x, w_full, b_full)
        del b_full
        if not keep_weights:
            del w_full
            w_full = None
        d = act(_per_shard(t, p)).reshape(t.shape[0], -1)
        d_kept = d if keep_act else None
        if not keep_fc1:
            del t
            t = None
        _wait(woh)
        if link is not None:
            # The next layer's first gathers, behind this GEMM (metp.layer_schedule).
            link.post_next()
        out = torch.mm(d, wot)
        ctx.act, ctx.group, ctx.p, ctx.link = act, group, p, link
        ctx.fuse_wgrad = fuse_wgrad
        ctx.together = together   # fc2's gradient reduce-scattered with fc1's, in one call
        ctx.has_bias = b_in is not None
        # The gathered weights, when kept, are not saved tensors (autograd's version check
        # guards w_in and w_out, which they were gathered from, and which are saved).
        ctx.kept = (w_full, wot) if keep_weights else None
        ctx.save_for_backward(x, w_in, b_in, w_out, t, d_kept)
        return out

    @staticmethod
    @torch.autograd.function.once_differentiable
    def backward(ctx, grad_out):
        x, w_in, b_in, w_out, t, d = ctx.saved_tensors
        act, group, p = ctx.act, ctx.group, ctx.p
        g = grad_out.contiguous()
        gacc = reduce_dtype(w_in)
        if ctx.kept is not None:
            # save+fc1+weights: T and both gathered weights kept; nothing to gather.
            (w_full, wot), ctx.kept = ctx.kept, None
            wh = woh = None
        elif t is None:
            # fc1 again: its weights first.
            w_full, wh = _gather(w_in, group, p)
            b_full, bh = _gather(b_in, group, p)
            wot, woh = _gather(w_out.t(), group, p)
            _wait(wh, bh)
            t = _fc1(x, w_full, b_full)
            del b_full
        else:
            # T kept: W_out^T is needed first, W_in only for dX at the end.
            wot, woh = _gather(w_out.t(), group, p)
            w_full, wh = _gather(w_in, group, p)
        link = ctx.link
        if link is not None:
            # The attention's backward gathers, ahead of this pass's reduce-scatters in the
            # weight group's queue (metp.layer_schedule).
            link.post_attention()
        box = link.box if link is not None and p > 1 else None
        n = t.shape[0]
        ts = _per_shard(t, p)
        back = getattr(act, "backward", None)  # a fused activation's own backward (mlp.py)
        if d is not None:
            d3 = d.view(n, p, -1)   # kept by the forward (keeps_act)
        elif back is None:
            ts = ts.detach().requires_grad_(True)
            with torch.enable_grad():
                d3 = act(ts)
        else:
            d3 = act(ts)
        d = d3.reshape(n, -1)
        # dW_out^T = D^T dO over this rank's tokens; summed over the ranks behind dD's GEMM.
        dwot_full = widening_mm(d.t(), g, gacc)
        if not ctx.together:
            dwot, dwot_h = _scatter(dwot_full, group, p)
            if box is None:
                del dwot_full
        _wait(woh)
        dd = torch.mm(g, wot.t())
        del wot
        if back is None:
            (dt,) = torch.autograd.grad(d3, ts, dd.view_as(d3))
        else:
            dt = back(dd.view_as(d3), ts)
        del d, d3, dd, ts, t
        dt = dt.reshape(n, -1)
        dw_in_full = widening_mm(dt.t(), x, gacc)
        db_in_full = dt.sum(0, dtype=gacc) if ctx.has_bias else None
        # The weight's and the bias's in one call (comm.scatter_rows_together), laid out as
        # their main_grads are where one add can take both (wgrad_accum); fc2's in the same
        # call where the layer is small (``together``: wgrad_accum.scatters_together).
        fulls = [dw_in_full, db_in_full] + ([dwot_full] if ctx.together else [])
        outs = shard_outs(fulls, [w_in, b_in, None], p, ctx.fuse_wgrad) or [None] * len(fulls)
        # And, small too, the next layer's attention's, which it left to this call
        # (layer_schedule._LaterBox.hold_unposted): its node waits for them next.
        sent = link.sent_box if link is not None and ctx.together else None
        theirs = sent.take_unposted(group) if sent is not None else []
        mines, dw_in_h = scatter_rows_together(
            fulls + [full for _, full, _ in theirs], group, p,
            outs + [mine for _, _, mine in theirs])
        if theirs:
            sent.posted([i for i, _, _ in theirs], mines[len(fulls):], dw_in_h)
        del theirs, outs
        dw_in, db_in = mines[:2]
        db_in_h = dw_in_h
        if ctx.together:
            dwot, dwot_h = mines[2], dw_in_h
        del fulls, mines
        if box is None:
            del dw_in_full, db_in_full
            if ctx.together:
                del dwot_full
        _wait(wh)
        dx = torch.mm(dt, w_full)
        del w_full, dt
        if box is not None:
            # Waited for by the attention's backward before it waits for its own, or else
            # after it by the layer's _GradsLater node (metp.layer_schedule); the box keeps
            # their inputs alive until then.
            return (dx, box.hold(0, dw_in, dw_in_h, dw_in_full, w_in),
                    box.hold(1, db_in, db_in_h, db_in_full, b_in) if ctx.has_bias else None,
                    box.hold(2 if ctx.has_bias else 1, dwot, dwot_h, dwot_full, w_out,
                             transpose=True), None, None, None, None, None, None, None, None)
        _wait(dwot_h, dw_in_h, db_in_h)
        fuse = ctx.fuse_wgrad
        g_in, g_b = weight_grads([dw_in, db_in], [w_in, b_in], fuse)
        return (dx, g_in, g_b, weight_grad(dwot, w_out, fuse, transpose=True), None, None,
                None, None, None, None, None, None)


def gathered_mlp(x: torch.Tensor, weights: Tuple[torch.Tensor, Optional[torch.Tensor],
                                                 torch.Tensor],
                 act: Callable, group, keep_fc1: bool = False) -> torch.Tensor:
    """:class:`GatheredMLPFunction` on ``(w_in, b_in, w_out)``."""
    w_in, b_in, w_out = weights
    return GatheredMLPFunction.apply(x, w_in, b_in, w_out, act, group, keep_fc1)
