"""METP's weight gradients added straight into Megatron's ``main_grad``: gradient-accumulation
fusion, as Megatron's own linears do it.

Every METP pass ends a weight's backward with this rank's shard of the gradient in fp32: the
output of its reduce-scatter (the whole pass, the gathered MLP) or of its ring reduce (the head
group pass, the MLP's weight ring). Without fusion that shard becomes a bf16 ``.grad`` (one
cast), which Megatron DDP's backward hook then adds into the fp32 ``main_grad`` (one add per
parameter): two kernels per weight, and the gradient rounded to bf16 between them.

With ``--gradient-accumulation-fusion`` (Megatron-LM's default, ``TransformerConfig.
gradient_accumulation_fusion``), Megatron's linears run apex's fused weight-gradient GEMM,
which accumulates into ``main_grad`` itself; they set ``grad_added_to_main_grad`` and hand
autograd an uninitialised placeholder of the weight's shape, so that DDP's hook runs (it
counts the parameter as ready for its bucket) and adds nothing. METP does the same with its
shard: one add into ``main_grad``, in fp32, where the cast and DDP's add ran. The placeholder
is where the bf16 gradient was, so memory does not change. Without DDP (no ``main_grad``), or
with the fusion off (Megatron-FSDP requires it off), the shard is cast as before.

:func:`param_of` finds the parameter behind a weight that reached the pass as a view
(``layer_schedule._GradsLater``'s). The switch reaches the passes as an argument or on their
plan, read outside autograd.

One add for several gradients: Megatron's DDP lays every ``main_grad`` out in one flat buffer,
the parameters in reverse order, so a linear's bias is followed by its weight (``bias, weight``
as ``_ParamAndGradBuffer`` places them: adjacent in memory unless the distributed optimizer's
64-value start padding falls between them; a bucket boundary between them does not matter, as
both adds come before either parameter's DDP hook). Where the reduce-scatter outputs of a
weight's and its bias's shards are laid out the same way (:func:`shard_outs`), one add takes
both (:func:`add_together`, :func:`weight_grads`): a kernel
fewer per biased linear (``linear_qkv`` and ``linear_fc1`` of BERT-Large and GPT), the same
values element for element. Elsewhere each is added on its own, as before.
"""

from __future__ import annotations

from typing import Optional

import torch

__all__ = ["param_of", "fuses", "reduce_dtype", "placeholder", "weight_grad", "weight_grads", "shard_outs",
           "spans_together", "add_together", "WGRADS_TOGETHER_MAX_VALUES", "scatters_together"]


# A sublayer's weight-gradient reduce-scatters in one call (W_proj^T's with W_qkv's, fc2's with
# fc1's) instead of each as soon as its GEMM has run, where the layer's tokens on this rank x
# the hidden size are at most this many: there the layer is host-bound (``measure.timeline``:
# ~30 us per op, each call one), and the earlier posts hid nothing the host did not already
# hide; the call fewer per sublayer is two ops per layer. BERT-Large at p = 8 (h = 1024): up
# to 8k tokens (2^20 values; a layer in a stack 1.80 -> 1.74 ms, ESTIMATE, H100). Not LLaMA-7B
# at 4k (2^21), whose layer waits for its weights' traffic, not for its host: one layer alone
# took 3.45 -> 3.64 ms there, its W_proj^T gradient no longer travelling early. Above it each
# goes as soon as it is made, where its bytes take long enough to be worth hiding.
WGRADS_TOGETHER_MAX_VALUES = 1 << 20


def scatters_together(tokens: int, hidden: int) -> bool:
    """Whether a sublayer posts its weight-gradient reduce-scatters in one call
    (:data:`WGRADS_TOGETHER_MAX_VALUES`). Decided outside autograd (the plan, the MLP's
    forward)."""
    return tokens * hidden <= WGRADS_TOGETHER_MAX_VALUES


def param_of(t: torch.Tensor) -> torch.Tensor:
    """The tensor ``t`` is a view of (the parameter behind ``_GradsLater``'s views), or ``t``."""
    while t._base is not None:
        t = t._base
    return t


def fuses(weight: Optional[torch.Tensor], on: bool) -> bool:
    """Whether ``weight``'s gradient goes straight into its parameter's ``main_grad``: the
    fusion is ``on``, DDP gave the parameter a ``main_grad`` and the parameter trains. Not
    under Megatron-FSDP (``__fsdp_param__``), whose ``main_grad`` is set per bucket by its
    own gradient hook and may still name the last bucket (Megatron's linears take a branch of
    their own there; Megatron-FSDP requires the fusion off, which ``metp train`` sets)."""
    if not on or weight is None:
        return False
    prm = param_of(weight)
    return (hasattr(prm, "main_grad") and prm.requires_grad
            and not hasattr(prm, "__fsdp_param__"))


def reduce_dtype(weight: torch.Tensor) -> torch.dtype:
    """The dtype a METP pass sums ``weight``'s gradient in over its ring steps and reduces it in
    over the weight group: the data's for fp32 and fp64 weights; for half types fp32 (TP
    computes each weight gradient in one matmul, METP sums p contributions, and fp32 keeps
    that sum as exact as TP's), unless Megatron DDP gave the parameter a ``main_grad`` in the
    weight's own dtype: Megatron-LM's ``--grad-reduce-in-bf16``, under which DDP reduces its
    buckets in bf16, so METP reduces in bf16 too and moves half the gradient bytes (2 B per
    element instead of 4). Read outside the reduction, once per pass."""
    dt = weight.dtype
    if dt in (torch.float32, torch.float64):
        return dt
    main = getattr(param_of(weight), "main_grad", None)
    return dt if main is not None and main.dtype == dt else torch.float32


def placeholder(weight: torch.Tensor, spare: Optional[torch.Tensor] = None
                ) -> Optional[torch.Tensor]:
    """What autograd gets once ``weight``'s gradient is in ``main_grad``, as Megatron's
    linears hand it over: None where DDP keeps no ``grad_added_to_main_grad`` flag; else the
    flag is set and an uninitialised tensor of the weight's shape (zeros with
    ``zero_out_wgrad``) keeps DDP's hook on the backward thread: ``spare`` where the caller
    has one allocated."""
    prm = param_of(weight)
    if not hasattr(prm, "grad_added_to_main_grad"):
        return None
    prm.grad_added_to_main_grad = True
    out = spare if spare is not None else torch.empty(weight.shape, dtype=weight.dtype,
                                                      device=weight.device)
    return out.zero_() if getattr(prm, "zero_out_wgrad", False) else out


def weight_grad(mine: Optional[torch.Tensor], weight: Optional[torch.Tensor], on: bool,
                transpose: bool = False, out: Optional[torch.Tensor] = None
                ) -> Optional[torch.Tensor]:
    """Autograd's gradient for ``weight`` from this rank's shard ``mine`` (``mine.t()`` with
    ``transpose``): added into ``main_grad`` and :func:`placeholder` where :func:`fuses`, else
    ``mine`` in ``weight``'s dtype and layout, one copy (into ``out`` if given, a tensor of
    ``weight``'s kind)."""
    if mine is None or weight is None:
        return None
    src = mine.t() if transpose else mine
    if fuses(weight, on):
        param_of(weight).main_grad.add_(src)
        return placeholder(weight, out)
    if out is None and not transpose:
        return src.to(weight.dtype)
    if out is None:
        out = torch.empty(weight.shape, dtype=weight.dtype, device=weight.device)
    return out.copy_(src)


def _span(ts) -> Optional[torch.Tensor]:
    """The 1-D view of one buffer that ``ts`` tile in this order, each dense and starting where
    the one before ends, or None."""
    base = param_of(ts[0])
    if not base.is_contiguous():
        return None
    for t in ts:
        if (param_of(t) is not base or not t.is_contiguous() or t.dtype != base.dtype):
            return None
    for a, b in zip(ts, ts[1:]):
        if a.storage_offset() + a.numel() != b.storage_offset():
            return None
    start = ts[0].storage_offset() - base.storage_offset()
    return base.view(-1)[start:start + sum(t.numel() for t in ts)]


def _main_grads_in_order(weights, on: bool) -> Optional[list]:
    """The positions of ``weights`` in the order their ``main_grad`` s tile one buffer
    (:func:`_span`), where all of them fuse (:func:`fuses`) and they do; else None."""
    if len(weights) < 2 or not all(fuses(w, on) for w in weights):
        return None
    grads = [param_of(w).main_grad for w in weights]
    order = sorted(range(len(grads)), key=lambda i: grads[i].storage_offset())
    return order if _span([grads[i] for i in order]) is not None else None


def shard_outs(fulls, weights, p: int, on: bool) -> Optional[list]:
    """Outputs for the reduce-scatters of ``fulls`` (the gradients of ``weights`` summed over
    the ranks, rows split p ways; a None in either is skipped): views of one buffer laid out as
    the weights' ``main_grad`` s are, so that :func:`add_together` adds them in one kernel;
    None where those are not one run of DDP's buffer, or a shard is not of its weight's
    shape."""
    live = [i for i, (f, w) in enumerate(zip(fulls, weights)) if f is not None and w is not None]
    if len({fulls[i].dtype for i in live}) != 1:
        return None
    order = _main_grads_in_order([weights[i] for i in live], on)
    if order is None:
        return None
    shapes = [(fulls[i].shape[0] // p, *fulls[i].shape[1:]) for i in live]
    if any(tuple(s) != tuple(weights[i].shape) for s, i in zip(shapes, live)):
        return None
    like = fulls[live[0]]
    flat = torch.empty(sum(weights[i].numel() for i in live), dtype=like.dtype,
                       device=like.device)
    outs, start = [None] * len(fulls), 0
    for k in order:
        i = live[k]
        outs[i] = flat[start:start + weights[i].numel()].view(weights[i].shape)
        start += weights[i].numel()
    return outs


def spans_together(mines, weights, on: bool):
    """``(main_grad span, shard span)``: the 1-D runs that one add takes for the shards
    ``mines`` (not transposed) of ``weights``, where both tile one buffer in the same order
    (:func:`shard_outs` made ``mines``) and every weight fuses; else None."""
    order = _main_grads_in_order(list(weights), on)
    if order is None or any(m.shape != w.shape for m, w in zip(mines, weights)):
        return None
    src = _span([mines[i] for i in order])
    if src is None:
        return None
    return _span([param_of(weights[i]).main_grad for i in order]), src


def add_together(mines, weights, on: bool) -> bool:
    """Add the shards ``mines`` into the ``main_grad`` s of ``weights`` in one kernel where
    :func:`spans_together` finds the runs; True if done (the caller then hands autograd each
    weight's :func:`placeholder`), False where nothing was added."""
    spans = spans_together(mines, weights, on)
    if spans is None:
        return False
    spans[0].add_(spans[1])
    return True


def weight_grads(mines, weights, on: bool) -> list:
    """:func:`weight_grad` of each shard in ``mines`` (not transposed) for its weight in
    ``weights`` (a None in either gives None), the ones that fuse in one add where
    :func:`add_together` can take them."""
    live = [i for i, (m, w) in enumerate(zip(mines, weights)) if m is not None and w is not None]
    if len(live) > 1 and add_together([mines[i] for i in live], [weights[i] for i in live], on):
        return [placeholder(weights[i]) if i in live else None for i in range(len(mines))]
    return [weight_grad(m, w, on) for m, w in zip(mines, weights)]
