"""The one boundary to attention kernels (METP's ring inner loop and WallFacer use only this).

Everything above this module is kernel-agnostic: it calls attention of one Q block against one
K/V block, gets the block's output and log-sum-exp, and merges blocks with :func:`merge_partial`
(new tensors) or, in ring loops that own their fp32 accumulator, :func:`merge_start` /
:func:`merge_partial_` (in place, no temporary of the accumulator's size) and
:func:`merge_ring_` (in place, one fused op, for blocks whose rows all saw a key).

Shapes (heads before sequence, as PyTorch's SDPA ops take them)::

    q        [b, n_q,  s_q, d]   queries of this block
    k, v     [b, n_kv, s_k, d]   keys / values; n_q % n_kv == 0 (GQA: the n_q/n_kv query heads
                                 of a group are consecutive, as in Megatron's layout)
    out      [b, n_q,  s_q, d]   q's dtype
    lse      [b, n_q,  s_q]      fp32 (fp64 when the inputs are fp64), natural log; -inf for a
                                 row that attends to nothing
    dq       like q;  dk, dv like k, v (n_kv heads)

``causal=True`` is the top-left-aligned causal mask of a *diagonal* block (query i sees keys
0..i), so it requires s_q == s_k; off-diagonal blocks are either fully visible (causal=False)
or skipped by the caller. (flash-attn aligns the mask bottom-right when s_q != s_k, which is
why the ambiguous case is refused rather than passed through.)

Backends, chosen per call by :func:`select_backend`:

==================  ===========================================  ===========================
name                kernel                                       used when
==================  ===========================================  ===========================
``torch_cudnn``     cuDNN's fused attention,                     CUDA sm90+ (Hopper and
                    ``aten._scaled_dot_product_cudnn_attention``   newer), fp16/bf16,
                    (+ ``_backward``), log-sum-exp returned      d % 8 == 0, d <= 128, cuDNN
``flash_attn``      flash-attn 2 (2.7 <= version < 3),            CUDA, fp16/bf16, d % 8 == 0,
                    ``_flash_attn_forward/_backward``            d <= 256, package importable
``torch_flash_cuda`` ``aten._scaled_dot_product_flash_attention``  CUDA, fp16/bf16, d % 8 == 0,
                    (+ ``_backward``)                            d <= 256
``torch_flash_cpu``  ``aten._scaled_dot_product_flash_attention_``  CPU, fp16/bf16/fp32/fp64
                    ``for_cpu`` (+ ``_backward``)
``math``            plain matmul/softmax in fp32 (fp64 for       anything else (e.g. fp32 on
                    fp64), scores materialised                   CUDA), or when forced
==================  ===========================================  ===========================

On Hopper, cuDNN's kernel is the one PyTorch's SDPA (stock's core attention) runs, and what
Transformer Engine's fused attention runs for stock Megatron-LM. FlashAttention-2 (PyTorch's
op or the flash-attn package) ran METP's attention at half its FLOP rate on an H200
(``docs/calibration/README.md``), so sm90+ takes ``torch_cudnn`` first. flash-attn 3 (the
Hopper build) is not wired: its private forward/backward signatures changed across its beta
releases.
``backend=`` names a backend for one call (tests use it to run the math path); callers
above (the rings, the attention modules) take it as a parameter too, so no switch is read
inside autograd. The CUDA backends are written against the documented op schemas and
flash-attn 2.7/2.8's interface and are not exercised by the CPU test suite;
``tests/test_kernels.py`` is the check to run on a GPU. ``torch_cudnn`` and ``torch_flash_cuda``
passed it on an H200 (torch 2.11, cuDNN 9.19); flash-attn was not installed there.

The backward of a block takes the *merged* output and lse of the whole row (not the block's
own): the kernels recompute P = exp(S - lse) and D = rowsum(dout * out), which with the global
statistics gives this block's exact share of the gradient. That is what lets a ring compute
dK/dV block by block without a second pass.
"""

from __future__ import annotations

import functools
import math
from typing import Optional, Tuple

import torch

from megatron_metp import aten_calls

BACKENDS = ("torch_cudnn", "flash_attn", "torch_flash_cuda", "torch_flash_cpu", "math")

_FLASH_ATTN = None  # False once an import/version check failed; the module once it passed.


def _flash_attn_module():
    """flash-attn 2's interface module if a supported version is installed, else None.

    The private ``_flash_attn_forward/_backward`` signature used here (separate window sizes,
    softcap, rng_state) is the one of flash-attn 2.7 and 2.8.
    """
    global _FLASH_ATTN
    if _FLASH_ATTN is None:
        _FLASH_ATTN = False
        try:
            import flash_attn
            from flash_attn import flash_attn_interface

            major, minor = (int(x) for x in flash_attn.__version__.split(".")[:2])
            if major == 2 and minor >= 7:
                _FLASH_ATTN = flash_attn_interface
        except Exception:  # not installed, or built for another torch/CUDA: use torch's ops
            pass
    return _FLASH_ATTN or None


def select_backend(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor,
                   backend: Optional[str] = None) -> str:
    """The backend :func:`attention_forward` / :func:`attention_backward` use for these inputs:
    ``backend`` if given (one of ``BACKENDS``), else the fastest one that takes them."""
    if backend is not None:
        if backend not in BACKENDS:
            raise ValueError(f"unknown attention backend {backend!r}; choose one of {BACKENDS}")
        return backend
    d = q.shape[-1]
    if not (q.dtype == k.dtype == v.dtype) or v.shape[-1] != d:
        return "math"
    if q.device.type == "cuda":
        # Both CUDA flash kernels take fp16/bf16 with head dims up to 256 in multiples of 8
        # (flash-attn's padding lives in its autograd wrappers, not in the functions used here).
        # Both also need an Ampere or newer GPU (sm80+); older ones take the math path.
        if (q.dtype in (torch.float16, torch.bfloat16) and d <= 256 and d % 8 == 0
                and torch.cuda.get_device_capability(q.device) >= (8, 0)):
            if (d <= 128 and torch.cuda.get_device_capability(q.device) >= (9, 0)
                    and torch.backends.cudnn.is_available() and op_binds("torch_cudnn")):
                return "torch_cudnn"
            if _flash_attn_module() is not None:
                return "flash_attn"
            if op_binds("torch_flash_cuda"):
                return "torch_flash_cuda"
        return "math"
    if q.device.type == "cpu" and q.dtype in (
        torch.float16,
        torch.bfloat16,
        torch.float32,
        torch.float64,
    ) and op_binds("torch_flash_cpu"):
        return "torch_flash_cpu"
    return "math"


def is_fake(t: torch.Tensor) -> bool:
    """Whether ``t`` is a FakeTensor (the planner's and the timeline's traces): there a fused
    GPU kernel's CPU twin runs as one op instead of its real loop."""
    from torch._subclasses.fake_tensor import FakeTensor

    return isinstance(t, FakeTensor)


def has_widening_gemm() -> bool:
    """Whether this torch has ``torch.mm(..., out_dtype=)`` (the ``aten::mm.dtype`` overload,
    torch >= 2.8): a feature test, not a version string."""
    return "dtype" in torch.ops.aten.mm.overloads()


def widening_mm(a: torch.Tensor, b: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
    """``a @ b`` in ``dtype`` (a weight gradient in fp32, to be summed over ranks in it): one
    GEMM whose output is ``dtype`` where there is one (cuBLAS takes bf16 / fp16 in and gives
    fp32 out, ``torch.mm(..., out_dtype=)``, as Megatron's fused weight-gradient GEMM writes
    fp32 ``main_grad``; fake tensors, which plan the GPU, run it so), else the GEMM in the
    inputs' dtype and a cast (the CPU kernels have none: there ``a @ b`` is rounded to bf16
    first, where the one GEMM keeps its fp32 sum). Either way one more op on a CPU than on a
    GPU, never different FLOPs. A torch without the widening GEMM (:func:`has_widening_gemm`)
    takes the GEMM and the cast on a GPU too."""
    if a.dtype == dtype:
        return a.mm(b)
    if dtype == torch.float32 and a.dtype in (torch.bfloat16, torch.float16) and (
            a.is_cuda or is_fake(a)) and has_widening_gemm():
        return torch.mm(a, b, out_dtype=dtype)
    return a.mm(b).to(dtype)


def acc_dtype(dtype: torch.dtype) -> torch.dtype:
    """The accumulator / statistics dtype for data of ``dtype``: fp32, or fp64 for fp64 data
    (the tests' references). The one such rule of the package: the rings' merges, WallFacer's
    accumulators, the norms and the cross entropy use it."""
    return torch.promote_types(dtype, torch.float32)


def _check(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, causal: bool) -> int:
    if q.dim() != 4 or k.dim() != 4 or v.dim() != 4:
        raise ValueError("attention kernels take [b, heads, s, d] tensors")
    n_q, n_kv = q.shape[1], k.shape[1]
    if n_q % n_kv != 0 or v.shape[1] != n_kv:
        raise ValueError(f"query heads ({n_q}) must be a multiple of key/value heads ({n_kv})")
    if causal and q.shape[2] != k.shape[2]:
        raise ValueError(
            "causal=True means a diagonal block (s_q == s_k); got "
            f"s_q={q.shape[2]}, s_k={k.shape[2]}"
        )
    return n_q // n_kv


_CUDNN_GQA: dict = {}


def cudnn_takes_gqa(q: torch.Tensor, rep: int) -> bool:
    """Whether this torch's cuDNN attention takes K/V with fewer heads than Q (grouped-query
    attention) itself, so that K/V need not be repeated to Q's head count: a feature test, run
    once per GPU model on a small grouped call (forward and backward) against the repeated
    one, not a version string. False for ``rep == 1`` (nothing to repeat) and on fake tensors
    (the planner's trace: it plans the repeated K/V, the larger footprint) unless a GPU of this
    process already answered."""
    if rep == 1:
        return False
    if is_fake(q) or q.device.type != "cuda":
        return any(_CUDNN_GQA.values())
    key = torch.cuda.get_device_name(q.device)
    if key not in _CUDNN_GQA:
        _CUDNN_GQA[key] = _probe_cudnn_gqa(q.device)
    return _CUDNN_GQA[key]


def _probe_cudnn_gqa(device) -> bool:
    """One grouped cuDNN call (4 query heads, 2 K/V heads) and its backward, against the
    repeated one: equal within bf16 rounding, or the call refused (False)."""
    g = torch.Generator(device="cpu").manual_seed(0)
    q, k, v, do = (torch.randn(1, h, 128, 64, generator=g).to(device, torch.bfloat16)
                   for h in (4, 2, 2, 4))
    try:
        got, want = [], []
        for kk, vv, acc in ((k, v, got), (_expand_kv(k, 2), _expand_kv(v, 2), want)):
            out, lse = aten_calls.call(*_cudnn_fwd(q, kk, vv, True, 0.125))[:2]
            grads = aten_calls.call(*_cudnn_bwd(do, q, kk, vv, out, lse, True, 0.125))
            acc += [out, grads[0]] + [gr if acc is got else _reduce_kv(gr, 2)
                                      for gr in grads[1:]]
        return all(a.shape == b.shape and torch.allclose(a.float(), b.float(), rtol=2e-2,
                                                         atol=2e-2) for a, b in zip(got, want))
    except (RuntimeError, ValueError, TypeError):
        return False


def _expand_kv(t: torch.Tensor, rep: int) -> torch.Tensor:
    # Megatron's GQA layout: query heads g*rep .. g*rep+rep-1 share key/value head g.
    return t if rep == 1 else t.repeat_interleave(rep, dim=1)


def _unit_rows(t: torch.Tensor) -> torch.Tensor:
    """``t`` itself when its last dimension is unit-stride (any strides elsewhere), else a dense
    copy: what cuDNN's attention kernels read in place."""
    return t if t.stride(-1) == 1 else t.contiguous()


def _reduce_kv(grad: torch.Tensor, rep: int) -> torch.Tensor:
    if rep == 1:
        return grad
    b, n, s, d = grad.shape
    return grad.view(b, n // rep, rep, s, d).sum(dim=2)


# ---------------------------------------------------------------------------------------------
# math path


def _math_probs(q, k, causal, scale, lse=None):
    """Scores in the statistics dtype; returns (probabilities, lse)."""
    acc = acc_dtype(q.dtype)
    scores = torch.matmul(q.to(acc), k.to(acc).transpose(-1, -2)) * scale
    if causal:
        s_q, s_k = scores.shape[-2:]
        mask = torch.ones(s_q, s_k, dtype=torch.bool, device=q.device).triu(1)
        scores = scores.masked_fill(mask, float("-inf"))
    if lse is None:
        lse = torch.logsumexp(scores, dim=-1)
    # A row with lse = -inf has no visible key: its probabilities are 0, not exp(-inf + inf).
    safe_lse = torch.where(torch.isinf(lse), torch.zeros_like(lse), lse)
    probs = torch.exp(scores - safe_lse.to(acc).unsqueeze(-1))
    return probs, lse


def _math_forward(q, k, v, causal, scale, rep):
    k, v = _expand_kv(k, rep), _expand_kv(v, rep)
    probs, lse = _math_probs(q, k, causal, scale)
    out = torch.matmul(probs, v.to(probs.dtype))
    return out.to(q.dtype), lse


def _math_backward(dout, q, k, v, out, lse, causal, scale, rep):
    acc = acc_dtype(q.dtype)
    k_full, v_full = _expand_kv(k, rep), _expand_kv(v, rep)
    probs, _ = _math_probs(q, k_full, causal, scale, lse=lse.to(acc))
    dout_a = dout.to(acc)
    delta = (dout_a * out.to(acc)).sum(-1, keepdim=True)  # D = rowsum(dO * O)
    dv = torch.matmul(probs.transpose(-1, -2), dout_a)
    dp = torch.matmul(dout_a, v_full.to(acc).transpose(-1, -2))
    ds = probs * (dp - delta)
    dq = torch.matmul(ds, k_full.to(acc)) * scale
    dk = torch.matmul(ds.transpose(-1, -2), q.to(acc)) * scale
    return dq.to(q.dtype), _reduce_kv(dk, rep).to(k.dtype), _reduce_kv(dv, rep).to(v.dtype)


# ---------------------------------------------------------------------------------------------
# public API


# Each PyTorch attention op's call by argument name (``aten_calls``): (op, values, optional),
# where ``optional`` holds arguments some releases of the supported range lack (their default).
def _cudnn_fwd(q, k, v, causal, scale):
    return ("_scaled_dot_product_cudnn_attention",
            dict(query=q, key=k, value=v, dropout_p=0.0, is_causal=causal,
                 return_debug_mask=False, scale=scale),
            dict(attn_bias=None, compute_log_sumexp=True))


class _Placeholder:
    """A tensor's stand-in for the binding checks: only the names are bound, so they allocate
    nothing (a check that runs inside a measured step leaves its byte count as it was)."""

    shape = (1, 1, 1, 1)


def _philox(q, shape, dtype):
    """A philox seed/offset placeholder on ``q``'s device (never read with dropout 0)."""
    if isinstance(q, _Placeholder):
        return q
    return torch.zeros(shape, dtype=dtype, device=q.device)


def _cudnn_bwd(dout, q, k, v, out, lse, causal, scale):
    seed = _philox(q, (), torch.int64)
    return ("_scaled_dot_product_cudnn_attention_backward",
            dict(grad_out=dout, query=q, key=k, value=v, out=out, logsumexp=lse,
                 philox_seed=seed, philox_offset=seed, cum_seq_q=None, cum_seq_k=None,
                 max_q=q.shape[2], max_k=k.shape[2], dropout_p=0.0, is_causal=causal,
                 scale=scale),
            dict(attn_bias=None))


def _flash_cuda_fwd(q, k, v, causal, scale):
    return ("_scaled_dot_product_flash_attention",
            dict(query=q, key=k, value=v, dropout_p=0.0, is_causal=causal,
                 return_debug_mask=False, scale=scale), {})


def _flash_cuda_bwd(dout, q, k, v, out, lse, causal, scale):
    seed, offset = _philox(q, 2, torch.uint64), _philox(q, (), torch.uint64)
    return ("_scaled_dot_product_flash_attention_backward",
            dict(grad_out=dout, query=q, key=k, value=v, out=out, logsumexp=lse,
                 cum_seq_q=None, cum_seq_k=None, max_q=q.shape[2], max_k=k.shape[2],
                 dropout_p=0.0, is_causal=causal, philox_seed=seed, philox_offset=offset,
                 scale=scale), {})


def _flash_cpu_fwd(q, k, v, causal, scale):
    return ("_scaled_dot_product_flash_attention_for_cpu",
            dict(query=q, key=k, value=v, dropout_p=0.0, is_causal=causal, scale=scale), {})


def _flash_cpu_bwd(dout, q, k, v, out, lse, causal, scale):
    return ("_scaled_dot_product_flash_attention_for_cpu_backward",
            dict(grad_out=dout, query=q, key=k, value=v, out=out, logsumexp=lse,
                 dropout_p=0.0, is_causal=causal, scale=scale), {})


CALLS = {"torch_cudnn": _cudnn_fwd, "torch_flash_cuda": _flash_cuda_fwd,
         "torch_flash_cpu": _flash_cpu_fwd}
BACKWARD_CALLS = {"torch_cudnn": _cudnn_bwd, "torch_flash_cuda": _flash_cuda_bwd,
                  "torch_flash_cpu": _flash_cpu_bwd}


def op_binds(backend: str, schemas: Optional[dict] = None) -> bool:
    """Whether the PyTorch ops of ``backend`` take the calls above by name: this torch's
    (cached), or those of ``schemas`` (op name -> schema: another release's, for the tests).
    The feature test :func:`select_backend` asks before it picks a PyTorch backend."""
    if schemas is None:
        return _live_op_binds(backend)
    return _binds(backend, schemas.get)


@functools.lru_cache(maxsize=None)
def _live_op_binds(backend: str) -> bool:
    return _binds(backend, aten_calls.schema_of)


def _binds(backend: str, schema_of) -> bool:
    t = _Placeholder()
    calls = (CALLS[backend](t, t, t, True, 1.0),
             BACKWARD_CALLS[backend](t, t, t, t, t, t, True, 1.0))
    return all(aten_calls.binds(schema_of(name), values, optional)
               for name, values, optional in calls)


# flash-attn 2's arguments for plain attention: no dropout, no sliding window, no softcap, no
# ALiBi (the same in its forward and backward).
_FLASH_ATTN_PLAIN = dict(dropout_p=0.0, window_size_left=-1, window_size_right=-1, softcap=0.0,
                         alibi_slopes=None)


def attention_forward(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    *,
    causal: bool,
    softmax_scale: Optional[float] = None,
    backend: Optional[str] = None,
) -> Tuple[torch.Tensor, torch.Tensor]:
    """softmax(q k^T * scale [causal]) v for one block; returns ``(out, lse)`` (shapes above)."""
    rep = _check(q, k, v, causal)
    scale = softmax_scale if softmax_scale is not None else 1.0 / math.sqrt(q.shape[-1])
    backend = select_backend(q, k, v, backend)
    stat = acc_dtype(q.dtype)
    if backend == "torch_flash_cpu":
        # The CPU op handles GQA itself (checked against repeat_interleave in the tests).
        out, lse = aten_calls.call(*CALLS["torch_flash_cpu"](q, k, v, causal, scale))
        return out, lse.to(stat)
    if backend == "torch_cudnn":
        # Its log-sum-exp comes as [b, n, s, 1] fp32 (cuDNN's softmax statistics).
        kx, vx = (k, v) if cudnn_takes_gqa(q, rep) else (_expand_kv(k, rep), _expand_kv(v, rep))
        res = aten_calls.call(*CALLS["torch_cudnn"](q, kx, vx, causal, scale))
        return res[0], res[1].reshape(q.shape[:3]).to(stat)
    if backend == "torch_flash_cuda":
        # PyTorch's flash kernel takes GQA itself (K/V at their own head count).
        out, lse = aten_calls.call(*CALLS["torch_flash_cuda"](q, k, v, causal, scale))[:2]
        return out, lse.to(stat)
    if backend == "flash_attn":
        fa = _flash_attn_module()
        # flash-attn takes [b, s, heads, d] and handles GQA natively.
        out, lse, _, _ = fa._flash_attn_forward(
            q.transpose(1, 2).contiguous(),
            k.transpose(1, 2).contiguous(),
            v.transpose(1, 2).contiguous(),
            softmax_scale=scale, causal=causal, return_softmax=False, **_FLASH_ATTN_PLAIN,
        )
        return out.transpose(1, 2), lse.to(stat)
    return _math_forward(q, k, v, causal, scale, rep)


def attention_backward(
    dout: torch.Tensor,
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    out: torch.Tensor,
    lse: torch.Tensor,
    *,
    causal: bool,
    softmax_scale: Optional[float] = None,
    backend: Optional[str] = None,
) -> Tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """Gradients of one block given the row's (merged) ``out`` and ``lse``; dk, dv in n_kv heads.

    ``dout`` and ``out`` are [b, n_q, s_q, d] in q's dtype (cast here if not).
    """
    rep = _check(q, k, v, causal)
    d = q.shape[-1]
    scale = softmax_scale if softmax_scale is not None else 1.0 / math.sqrt(d)
    backend = select_backend(q, k, v, backend)
    dout = dout.to(q.dtype)
    out = out.to(q.dtype)
    if backend == "torch_flash_cpu":
        lse_k = lse.to(acc_dtype(q.dtype))
        return aten_calls.call(*BACKWARD_CALLS["torch_flash_cpu"](
            dout, q, k, v, out, lse_k, causal, scale))
    if backend == "torch_cudnn":
        # No bias and no cumulative sequence lengths (None: undefined tensors); with dropout 0
        # the philox seed/offset are never read. cuDNN reads any strides with unit-stride rows,
        # as its forward does: the rings' blocks are often half of a [b, n, s, d] tensor (the
        # balanced layout's pieces), and copying those halves dense cost 14-21 copies per
        # 128k layer (the H100 probe of docs/calibration/README.md: K/V halves in place give
        # dK and dV equal to the dense call's bit for bit, dQ within cuDNN's accumulation
        # order). K and V go as they are (their strides key PyTorch's cached cuDNN graph).
        # dO, Q and O go as they are only when all three have Q's strides (the rings' rows:
        # one slice of kernels.backward_rows' dense tensors): PyTorch keys that graph on Q's
        # strides, not on O's or dO's, so those must follow from Q's. Else all three dense.
        rows = (dout, q, out)
        if not (dout.stride() == q.stride() == out.stride() and q.stride(-1) == 1):
            rows = tuple(t.contiguous() for t in rows)
        s_q, s_k = q.shape[2], k.shape[2]
        gqa = cudnn_takes_gqa(q, rep)
        kx, vx = (k, v) if gqa else (_expand_kv(k, rep), _expand_kv(v, rep))
        dq, dk, dv = aten_calls.call(*BACKWARD_CALLS["torch_cudnn"](
            rows[0], rows[1], _unit_rows(kx), _unit_rows(vx), rows[2],
            lse.float().reshape(*q.shape[:3], 1).contiguous(), causal, scale))
        return (dq, dk, dv) if gqa else (dq, _reduce_kv(dk, rep), _reduce_kv(dv, rep))
    if backend == "torch_flash_cuda":
        # Dense (not nested) inputs: no cumulative sequence lengths (the forward returns None
        # for them); with dropout 0 the philox seed/offset are never read, so placeholders do.
        dq, dk, dv = aten_calls.call(*BACKWARD_CALLS["torch_flash_cuda"](
            dout.contiguous(), q, k, v, out, lse.float().contiguous(), causal, scale))
        return dq, dk, dv   # at K/V's head count: the kernel sums each group's gradients
    if backend == "flash_attn":
        fa = _flash_attn_module()
        q_t, k_t, v_t = (t.transpose(1, 2).contiguous() for t in (q, k, v))
        dq, dk, dv = torch.empty_like(q_t), torch.empty_like(k_t), torch.empty_like(v_t)
        fa._flash_attn_backward(
            dout.transpose(1, 2).contiguous(),
            q_t,
            k_t,
            v_t,
            out.transpose(1, 2).contiguous(),
            lse.float().contiguous(),
            dq,
            dk,
            dv,
            softmax_scale=scale, causal=causal, deterministic=False, rng_state=None,
            **_FLASH_ATTN_PLAIN,
        )
        return dq.transpose(1, 2), dk.transpose(1, 2), dv.transpose(1, 2)
    return _math_backward(dout, q, k, v, out, lse, causal, scale, rep)


def backward_rows(
    dout: torch.Tensor,
    q: torch.Tensor,
    out: Optional[torch.Tensor],
    k: torch.Tensor,
    v: torch.Tensor,
    backend: Optional[str] = None,
) -> Tuple[torch.Tensor, torch.Tensor, Optional[torch.Tensor]]:
    """``(dout, q, out)`` as :func:`attention_backward` hands them to the backend, made once.

    For a caller that runs the backward of many K/V blocks against the same query rows (the
    rings: p blocks per layer). cuDNN's backward takes dense operands, flash-attn dense
    ``[b, s, heads, d]`` ones and PyTorch's flash backward on CUDA a dense ``dout``, so
    :func:`attention_backward` copies the others at every call: at p = 8 that was 8 copies of
    each Q-sized operand per layer where one does (LLaMA-7B, 128k: the H200 profile's 29
    Q-sized copies, ``docs/calibration/README.md``). Converted here, those calls copy nothing.
    The CPU and math backends read strided views as they are and get the tensors back
    unchanged. ``out`` may be None (a caller that converts it elsewhere); ``k``, ``v``: a
    block's keys and values, which only choose the backend.
    """
    name = select_backend(q, k, v, backend)
    # (.to(dtype, memory_format=...) returns a strided tensor unchanged when its dtype already
    # matches: hence the separate .contiguous().)
    if name == "torch_cudnn":
        dense = torch.Tensor.contiguous
    elif name == "flash_attn":
        def dense(t):   # [b, n, s, d] whose transpose(1, 2) flash-attn takes without a copy
            return t.transpose(1, 2).contiguous().transpose(1, 2)
    elif name == "torch_flash_cuda":
        return dout.to(q.dtype).contiguous(), q, out
    else:
        return dout, q, out
    return dense(dout.to(q.dtype)), dense(q), None if out is None else dense(out.to(q.dtype))


def merge_partial(
    out: Optional[torch.Tensor],
    lse: Optional[torch.Tensor],
    block_out: torch.Tensor,
    block_lse: torch.Tensor,
) -> Tuple[torch.Tensor, torch.Tensor]:
    """Merge a block's ``(block_out, block_lse)`` into the running ``(out, lse)``; new tensors.

    ::

        out, block_out   [b, n, s, d]   result in fp32 (fp64 for fp64 data)
        lse, block_lse   [b, n, s]

    ``out=None`` starts the accumulator from the block. The merge is max-subtracted:
    m = max(lse, block_lse); w = exp(lse - m), w_b = exp(block_lse - m) (each <= 1, one of them
    exactly 1, so nothing overflows however large the logits); out = (w out + w_b block_out) /
    (w + w_b); lse = m + log(w + w_b). Rows where both are -inf (nothing visible yet) stay
    out = 0, lse = -inf, without NaN; a block row with lse = -inf contributes nothing even if
    the kernel left NaN in it. The inputs are not modified.
    """
    acc = acc_dtype(block_out.dtype if out is None else out.dtype)
    if out is None:
        return merge_start(block_out.to(acc, copy=True), block_lse.to(acc, copy=True))
    return merge_partial_(
        out.to(acc, copy=True), lse.to(acc, copy=True), block_out.clone(), block_lse
    )


def merge_start(block_out: torch.Tensor, block_lse: torch.Tensor):
    """Start an accumulator from a block (no copy when it already has the statistics dtype).

    May modify ``block_out`` in place (rows with lse = -inf are zeroed).
    """
    acc = acc_dtype(block_out.dtype)
    out = block_out.to(acc)
    lse = block_lse.to(acc)
    out.masked_fill_(torch.isneginf(lse).unsqueeze(-1), 0.0)
    return out, lse


def merge_partial_(
    out: torch.Tensor,
    lse: torch.Tensor,
    block_out: torch.Tensor,
    block_lse: torch.Tensor,
) -> Tuple[torch.Tensor, torch.Tensor]:
    """In-place :func:`merge_partial` for the ring loops: ``out``/``lse`` are the caller's fp32
    accumulators and are updated in place (and returned); ``block_out`` (the kernel's fresh
    output, owned by the caller) may be modified. No temporary of the size of ``out`` is made:
    the rescales are [b, n, s] vectors broadcast over d.
    """
    b_lse = block_lse.to(lse.dtype)
    m = torch.maximum(lse, b_lse)
    m_safe = torch.where(torch.isneginf(m), torch.zeros_like(m), m)
    w = torch.exp(lse - m_safe)
    w_b = torch.exp(b_lse - m_safe)
    denom = w + w_b
    denom = torch.where(denom == 0, torch.ones_like(denom), denom)
    # A masked block row may hold NaN/garbage: zero it so that its zero weight means zero.
    block_out.masked_fill_(torch.isneginf(b_lse).unsqueeze(-1), 0.0)
    out.mul_((w / denom).unsqueeze(-1))
    out.addcmul_(block_out, (w_b / denom).unsqueeze(-1))
    lse.copy_(m + torch.log(denom))
    return out, lse


def merge_visible_(out: torch.Tensor, lse: torch.Tensor, block_out: torch.Tensor,
                   block_lse: torch.Tensor) -> Tuple[torch.Tensor, torch.Tensor]:
    """:func:`merge_partial_` for blocks where every row of the accumulator and of the block has
    seen at least one key (unpacked causal or full rings: no ``-inf`` rows to guard), in seven
    element-wise passes over [b, n, s] vectors and two over ``out`` instead of seventeen.

    With ``d = lse_b - lse``: ``out = sigmoid(-d) out + sigmoid(d) out_b`` (the two softmax
    weights ``e^lse / (e^lse + e^lse_b)`` and ``e^lse_b / (...)``, each computed directly, so
    neither loses precision to ``1 - w``), ``lse = logaddexp(lse, lse_b)``.
    """
    d = block_lse.to(lse.dtype) - lse
    out.mul_(torch.sigmoid(-d).unsqueeze(-1))
    out.addcmul_(block_out, torch.sigmoid(d).unsqueeze(-1))
    torch.logaddexp(lse, block_lse.to(lse.dtype), out=lse)
    return out, lse



def _merge_ring_eager(out: torch.Tensor, lse: torch.Tensor, block_out: torch.Tensor,
                      block_lse: torch.Tensor) -> None:
    w = torch.sigmoid(block_lse.to(lse.dtype) - lse).unsqueeze(-1)
    out.addcmul_(out - block_out, w, value=-1.0)
    torch.logaddexp(lse, block_lse.to(lse.dtype), out=lse)


_MERGE_COMPILED = None   # False once compiling failed or cannot work here


def _merge_ring_cuda():
    """The merge as one fused kernel on a GPU (``torch.compile``, as Transformer Engine fuses
    its ring's lse and output corrections), or None where that cannot run (no Triton) or
    failed once; then the five eager kernels run."""
    global _MERGE_COMPILED
    if _MERGE_COMPILED is None:
        _MERGE_COMPILED = False
        try:
            from torch.utils._triton import has_triton

            if has_triton():
                _MERGE_COMPILED = torch.compile(_merge_ring_eager, dynamic=True)
        except Exception:  # an old torch or a broken install: the eager kernels
            pass
    return _MERGE_COMPILED or None


@torch.library.custom_op("megatron_metp::merge_ring_", mutates_args=("out", "lse"))
def _merge_ring_op(out: torch.Tensor, lse: torch.Tensor, block_out: torch.Tensor,
                   block_lse: torch.Tensor) -> None:
    fused = _merge_ring_cuda() if out.is_cuda else None
    if fused is not None:
        try:
            fused(out, lse, block_out, block_lse)
            return
        except Exception:  # compilation failed (before anything ran): eager from now on
            global _MERGE_COMPILED
            _MERGE_COMPILED = False
    _merge_ring_eager(out, lse, block_out, block_lse)


@_merge_ring_op.register_fake
def _merge_ring_fake(out, lse, block_out, block_lse) -> None:
    return None


def merge_ring_(out: torch.Tensor, lse: torch.Tensor, block_out: torch.Tensor,
                block_lse: torch.Tensor) -> Tuple[torch.Tensor, torch.Tensor]:
    """Merge a block into a ring's accumulator in place: the stable fp32 form::

        w = sigmoid(lse_b - lse)     the block's share e^lse_b / (e^lse + e^lse_b)
        out -= w (out - out_b)
        lse = logaddexp(lse, lse_b)

    Neither exponent is formed, so nothing overflows however large the logits. Every row of
    the block must have seen a key (finite ``block_lse``): true of every call the rings make,
    packed pieces included. The accumulator's rows may have seen nothing (``lse = -inf``,
    ``out = 0``): ``w = 1`` there and the row becomes the block's. ``block_out`` is not
    modified.

    One op (``megatron_metp::merge_ring_``): on a GPU with Triton one fused kernel
    (``torch.compile``), elsewhere five element-wise kernels (three over [b, n, s] vectors,
    two over ``out``). Traces on fake tensors count it as the one fused kernel, reading
    ``out``, ``lse`` and the block and writing ``out`` and ``lse``.
    """
    _merge_ring_op(out, lse, block_out, block_lse)
    return out, lse
