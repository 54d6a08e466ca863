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
"""

from __future__ import annotations

from typing import Optional

import torch

__all__ = ["param_of", "fuses", "placeholder", "weight_grad"]


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
