"""METP's ring inner loop (Alg. 3-4) against single-process fp64 attention on 1, 2 and 4 ranks.

Every rank builds the same full-sequence inputs from one seed, computes the fp64 reference by
autograd, runs ring attention on its contiguous shard of the sequence, and compares its slice of
the output and of dQ/dK/dV.
"""

import pytest
import torch
import torch.distributed as dist

from megatron_metp.metp.ring_attention import ring_attention
from tests import _reference as R
from tests._harness import run_ranks


def _check(name, got, ref, dtype, errs, atol_floor=0.0):
    # fp32: the ring kernels' stated bound, rtol 1e-5, atol 1e-5 * max|ref|. A ring of p blocks adds p - 1
    # fp32 merges (relative error ~1e-7 each) on top of the single-block error, far below it.
    # fp64: 1e-10, loose for an all-fp64 computation. ``atol_floor`` covers saturated softmax
    # (see _ring_cases), where a gradient's own max is not the scale of its rounding error.
    rtol = 1e-10 if dtype == torch.float64 else 1e-5
    ref_max = ref.abs().max().item()
    atol = max(rtol * ref_max, atol_floor)
    torch.testing.assert_close(got.double(), ref, rtol=rtol, atol=atol, msg=lambda m: f"{name}: {m}")
    diff = (got.double() - ref).abs()
    errs[name] = (diff.max().item() / ref_max, diff.mean().item() / ref_max)


def _ring_cases(cases):
    rank, p = dist.get_rank(), dist.get_world_size()
    group = dist.new_group(list(range(p)))  # a subgroup, as the TP group is
    errs = {}
    for dtype, causal, n_kv, backend, amp in cases:
        b, n, s, d = 2, 4, 8 * p, 8
        g = torch.Generator().manual_seed(1234)
        q, k = (torch.randn(b, nh, s, d, generator=g, dtype=torch.float64) * amp for nh in (n, n_kv))
        v = torch.randn(b, n_kv, s, d, generator=g, dtype=torch.float64)
        dout = torch.randn(b, n, s, d, generator=g, dtype=torch.float64)
        scale = d ** -0.5
        out64, _, *grads64 = R.attention_grads(q, k, v, dout, scale=scale, causal=causal)
        ref = (out64, *grads64)
        sl = slice(rank * s // p, (rank + 1) * s // p)
        q_s, k_s, v_s = (t[:, :, sl].to(dtype).requires_grad_(True) for t in (q, k, v))
        out_s = ring_attention(q_s, k_s, v_s, group, causal=causal, softmax_scale=scale,
                               backend=backend)
        out_s.backward(dout[:, :, sl].to(dtype))
        # With |logits| ~ 1e4 the softmax is near one-hot and dQ/dK shrink to ~1e-10, below
        # the rounding of the logits themselves (eps * |logit|, times |k| * |dout| * s through
        # the chain rule): that product is the absolute floor. Output and dV stay O(1) and are
        # held to the relative bound.
        logit_max = (q.abs().max() * k.abs().max() * d * scale).item()
        biggest = max(t.abs().max().item() for t in (q, k, v, dout))
        floor = torch.finfo(dtype).eps * logit_max * biggest * s if amp > 1 else 0.0
        tag = f"{str(dtype)[6:]} causal={causal} n_kv={n_kv} {backend or 'auto'} amp={amp}"
        for name, got, r in zip(("out", "dq", "dk", "dv"), (out_s, q_s.grad, k_s.grad, v_s.grad), ref):
            assert got.dtype == dtype and torch.isfinite(got).all(), (tag, name)
            _check(f"{tag} {name}", got.detach(), r[:, :, sl], dtype, errs,
                   floor if name in ("dq", "dk") else 0.0)
    return errs


_CASES = [
    (torch.float32, False, 4, None, 1.0),
    (torch.float32, True, 4, None, 1.0),
    (torch.float32, True, 2, None, 1.0),  # GQA: K/V travel with their own (fewer) heads
    (torch.float32, True, 2, "math", 1.0),
    (torch.float64, True, 4, None, 1.0),
    (torch.float64, False, 1, "math", 1.0),
]


@pytest.mark.parametrize("world", [1, 2, 4])
def test_ring_attention_matches_fp64(world, report):
    per_rank = run_ranks(world, _ring_cases, _CASES)
    worst = {}
    for errs in per_rank:
        for key, (mx, mean) in errs.items():
            old = worst.get(key, (0.0, 0.0))
            worst[key] = (max(old[0], mx), max(old[1], mean))
    # One line per p: the worst fp32 case (causal or not, MHA or GQA, flash or math) per tensor.
    parts = []
    for name in ("out", "dq", "dk", "dv"):
        keys = [key for key in worst if key.startswith("float32") and key.endswith(" " + name)]
        mx = max(worst[key][0] for key in keys)
        mean = max(worst[key][1] for key in keys)
        parts.append(f"{name} max {mx:.1e} mean {mean:.1e}")
    report(f"ring attention p={world} fp32 vs fp64 (x max|ref|, worst case): " + "; ".join(parts))


def test_ring_attention_large_logits_finite():
    # |logits| ~ 1e4 (entries ~ 35, d = 8): exp(lse) alone would overflow fp32; the merge must
    # not. Compared in fp64 so the reference itself is exact; plus a finiteness check in fp32.
    cases = [(torch.float64, True, 4, None, 35.0), (torch.float64, False, 2, "math", 35.0)]
    run_ranks(4, _ring_cases, cases)
    run_ranks(4, _large_fp32)


def _large_fp32():
    rank, p = dist.get_rank(), dist.get_world_size()
    g = torch.Generator().manual_seed(7)
    q, k, v = (torch.randn(1, 2, 4 * p, 8, generator=g) * 35.0 for _ in range(3))
    sl = slice(rank * 4, rank * 4 + 4)
    q_s, k_s, v_s = (t[:, :, sl].clone().requires_grad_(True) for t in (q, k, v))
    out = ring_attention(q_s, k_s, v_s, None, causal=True)
    assert (q_s[0, 0] @ k_s[0, 0].T).abs().max() > 1e3 * 8 ** 0.5
    out.sum().backward()
    for t in (out, q_s.grad, k_s.grad, v_s.grad):
        assert torch.isfinite(t).all()
    # Against fp64 attention of the same (fp32-valued) inputs: fp32 rounds logits of ~1e4 to
    # ~1e-3 (spacing 2^-10 at 1e4), which can move a softmax weight by ~1e-3 where two logits
    # nearly tie, so the output is held to 5e-3 * max|v| absolute.
    ref = R.attention(q.double(), k.double(), v.double(), scale=8 ** -0.5, causal=True)[0]
    torch.testing.assert_close(out.detach().double(), ref[:, :, sl], rtol=0,
                               atol=5e-3 * v.abs().max().item())


def _count_blocks(causal):
    """Kernel calls per rank, forward and backward, with the kernels wrapped to count (the
    ring reaches them through ``megatron_metp.packing``'s block pieces)."""
    import megatron_metp.kernels as ra

    calls = {"fwd": [], "bwd": []}
    fwd, bwd = ra.attention_forward, ra.attention_backward

    def count_fwd(q, k, v, **kw):
        calls["fwd"].append(kw["causal"])
        return fwd(q, k, v, **kw)

    def count_bwd(*args, **kw):
        calls["bwd"].append(kw["causal"])
        return bwd(*args, **kw)

    ra.attention_forward, ra.attention_backward = count_fwd, count_bwd
    try:
        q, k, v = (torch.randn(1, 2, 4, 8, requires_grad=True) for _ in range(3))
        ring_attention(q, k, v, None, causal=causal).sum().backward()
    finally:
        ra.attention_forward, ra.attention_backward = fwd, bwd
    return calls


def test_causal_ring_skips_blocks_above_the_diagonal():
    # Rank r owns the r-th contiguous chunk: it sees blocks 0..r (the r-th causally) and skips
    # the p-1-r blocks above the diagonal, in forward and backward alike.
    p = 4
    for rank, calls in enumerate(run_ranks(p, _count_blocks, True)):
        for phase in ("fwd", "bwd"):
            assert sorted(calls[phase]) == [False] * rank + [True], (rank, phase, calls)
    for calls in run_ranks(p, _count_blocks, False):
        assert calls == {"fwd": [False] * p, "bwd": [False] * p}


def _dense_for(backend: str):
    """Whether a [b, n, s, d] tensor is in the layout ``backend``'s backward takes without a
    copy: dense for cuDNN; dense as [b, s, n, d] (its transpose) for flash-attn."""
    if backend == "flash_attn":
        return lambda t: t.transpose(1, 2).is_contiguous()
    return lambda t: t.is_contiguous()


def _kernel_rows(backend):
    """The ring's backward with a CUDA backend named (cuDNN, flash-attn), on strided
    [b, n, s, d] views of [s, b, n, d] tensors (as METP's attention passes Q and dO): what each
    kernel call is handed, and the gradients. The kernel itself runs the math path (the CUDA
    kernels need a GPU)."""
    import megatron_metp.kernels as K
    from megatron_metp.metp.ring_attention import ring_attention_backward, ring_attention_forward

    rank = dist.get_rank()
    g = torch.Generator().manual_seed(11 + rank)
    q, k, v, dout = (torch.randn(4, 1, 2, 8, generator=g) for _ in range(4))   # [s, b, n, d]
    q, k, v, dout = (t.permute(1, 2, 0, 3) for t in (q, k, v, dout))          # strided views
    out, lse = ring_attention_forward(None, q, k, v, True, backend="math")
    seen, bwd, dense = [], K.attention_backward, _dense_for(backend)

    def record(dout_b, q_b, k_b, v_b, out_b, lse_b, **kw):
        seen.append([(dense(t), t.data_ptr()) for t in (dout_b, q_b, out_b)])
        return bwd(dout_b, q_b, k_b, v_b, out_b, lse_b, **{**kw, "backend": "math"})

    K.attention_backward = record
    try:
        got = ring_attention_backward(None, dout, q, k, v, out, lse, True, backend=backend)
    finally:
        K.attention_backward = bwd
    want = ring_attention_backward(None, dout, q, k, v, out, lse, True, backend="math")
    return seen, [(a - b).abs().max().item() for a, b in zip(got, want)]


@pytest.mark.parametrize("backend", ["torch_cudnn", "flash_attn"])
def test_ring_backward_makes_the_kernels_layout_once(backend):
    # cuDNN's backward takes dense dO / Q / O, flash-attn's dense [b, s, n, d] ones; the ring
    # converts this rank's rows once (kernels.backward_rows) rather than at each of its p
    # blocks. Rank r of a causal ring runs r + 1 blocks: every call must get the same tensors,
    # in the kernel's layout, and the gradients must be the plain ring's (the same math path on
    # the same values: equal bit for bit).
    for rank, (seen, diffs) in enumerate(run_ranks(4, _kernel_rows, backend)):
        assert len(seen) == rank + 1
        for call in seen:
            assert all(dense for dense, _ in call), (rank, call)
            assert [ptr for _, ptr in call] == [ptr for _, ptr in seen[0]], (rank, seen)
        assert diffs == [0.0, 0.0, 0.0], (rank, diffs)
    # The other backends read strided views as they are: no copy is made for them.
    q = torch.randn(4, 1, 2, 8).permute(1, 2, 0, 3)
    import megatron_metp.kernels as K
    for other in ("torch_flash_cpu", "math"):
        rows = K.backward_rows(q, q, q, q, q, other)
        assert all(t is q for t in rows), other
    rows = K.backward_rows(q, q, None, q, q, backend)
    assert all(_dense_for(backend)(t) for t in rows[:2]) and rows[2] is None
    assert torch.equal(rows[0], q) and torch.equal(rows[1], q)
