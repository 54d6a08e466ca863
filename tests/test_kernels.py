"""The attention kernel boundary against a single-process fp64 reference (autograd through
plain softmax attention), on every backend this machine has (CPU flash op and math path)."""

import math

import pytest
import torch

from megatron_metp import kernels
from tests import _reference as R


def _inputs(dtype, b=2, n_q=4, n_kv=2, s=8, d=16, seed=0, amp=1.0):
    g = torch.Generator().manual_seed(seed)
    q = torch.randn(b, n_q, s, d, generator=g, dtype=torch.float64) * amp
    k = torch.randn(b, n_kv, s, d, generator=g, dtype=torch.float64) * amp
    v = torch.randn(b, n_kv, s, d, generator=g, dtype=torch.float64)
    dout = torch.randn(b, n_q, s, d, generator=g, dtype=torch.float64)
    return [t.to(dtype) for t in (q, k, v, dout)]


def _close(actual, expected, dtype):
    # fp32: rtol 1e-5 and atol 1e-5 * max|ref| (the ring kernels' stated bound; a single block's fp32 softmax
    # and matmuls over d = 16 and s = 8 terms stay ~1e-7 relative). fp64: 1e-10.
    rtol = 1e-10 if dtype == torch.float64 else 1e-5
    atol = rtol * expected.abs().max().item()
    torch.testing.assert_close(actual.double(), expected.double(), rtol=rtol, atol=atol)


@pytest.mark.parametrize("backend", ["torch_flash_cpu", "math"])
@pytest.mark.parametrize("dtype", [torch.float32, torch.float64])
@pytest.mark.parametrize("causal", [False, True])
@pytest.mark.parametrize("n_kv", [4, 2, 1])
def test_forward_backward_match_fp64(backend, dtype, causal, n_kv, report):
    q, k, v, dout = _inputs(dtype, n_kv=n_kv)
    scale = 0.3  # not 1/sqrt(d): the scale must be honoured
    assert kernels.select_backend(q, k, v, backend) == backend
    out, lse = kernels.attention_forward(q, k, v, causal=causal, softmax_scale=scale,
                                         backend=backend)
    dq, dk, dv = kernels.attention_backward(
        dout, q, k, v, out, lse, causal=causal, softmax_scale=scale, backend=backend
    )
    assert out.dtype == dtype and out.shape == q.shape
    assert lse.shape == q.shape[:3] and lse.dtype == (
        torch.float64 if dtype == torch.float64 else torch.float32
    )
    assert dk.shape == k.shape and dv.shape == v.shape
    ref_out, ref_lse, ref_dq, ref_dk, ref_dv = R.attention_grads(q, k, v, dout, scale=scale,
                                                                 causal=causal)
    for got, ref in ((out, ref_out), (lse, ref_lse), (dq, ref_dq), (dk, ref_dk), (dv, ref_dv)):
        _close(got, ref.detach(), dtype)
    if dtype == torch.float32 and n_kv == 2:
        err = (dq.double() - ref_dq).abs()
        report(f"kernels {backend} causal={causal} fp32 dq: max {err.max():.2e} mean {err.mean():.2e}")


def test_default_scale_and_auto_backend():
    q, k, v, _ = _inputs(torch.float32)
    assert kernels.select_backend(q, k, v) == "torch_flash_cpu"
    out, lse = kernels.attention_forward(q, k, v, causal=False)
    ref_out, ref_lse = R.attention(q.double(), k.double(), v.double(),
                                   scale=1 / math.sqrt(q.shape[-1]))
    _close(out, ref_out.detach(), torch.float32)
    _close(lse, ref_lse.detach(), torch.float32)


@pytest.mark.parametrize("backend", ["torch_flash_cpu", "math"])
def test_merge_of_key_blocks_equals_full_attention(backend):
    """Split the keys in three blocks (one causal diagonal, two visible): merge == full."""
    q, k, v, dout = _inputs(torch.float32, s=12)
    s_blk = 4
    q_blk = q[:, :, 2 * s_blk :]  # last query block: sees blocks 0, 1 fully, block 2 causally
    out = lse = None
    for j in range(3):
        kb, vb = k[:, :, j * s_blk : (j + 1) * s_blk], v[:, :, j * s_blk : (j + 1) * s_blk]
        o, l = kernels.attention_forward(q_blk, kb, vb, causal=(j == 2), backend=backend)
        out, lse = kernels.merge_partial(out, lse, o, l)
    assert out.dtype == torch.float32
    ref_out, ref_lse = R.attention(q.double(), k.double(), v.double(), scale=1 / 4.0,
                                   causal=True)
    _close(out, ref_out.detach()[:, :, 2 * s_blk :], torch.float32)
    _close(lse, ref_lse.detach()[:, :, 2 * s_blk :], torch.float32)


def test_merge_handles_fully_masked_rows_and_huge_lse():
    torch.manual_seed(3)
    b_out = torch.randn(1, 1, 4, 3)
    # Row 0: nothing visible in either; row 1: only the block; row 2: only the running value;
    # row 3: lse ~ 1e4 in both (exp(lse) alone would overflow fp32).
    lse = torch.tensor([[[-math.inf, -math.inf, 5.0, 1e4]]])
    b_lse = torch.tensor([[[-math.inf, 2.0, -math.inf, 1e4 + math.log(3.0)]]])
    out = torch.randn(1, 1, 4, 3)
    out[0, 0, 0] = 0.0
    b_out[0, 0, 2] = float("nan")  # garbage in a masked row must not leak
    new_out, new_lse = kernels.merge_partial(out, lse, b_out, b_lse)
    assert not new_out.isnan().any() and not new_lse.isnan().any()
    torch.testing.assert_close(new_out[0, 0, 0], torch.zeros(3))
    assert new_lse[0, 0, 0] == -math.inf
    torch.testing.assert_close(new_out[0, 0, 1], b_out[0, 0, 1])
    torch.testing.assert_close(new_out[0, 0, 2], out[0, 0, 2])
    # Weights ~1/4 and ~3/4. fp32 stores lse ~1e4 with spacing 2^-10, so the weights follow from
    # the *stored* values: w_b = sigmoid(b_lse - lse), computed here in fp64 from them. The
    # merge's own error is then fp32 rounding of exp and the sums (~1e-7 relative).
    diff = b_lse[0, 0, 3].double() - lse[0, 0, 3].double()
    w_b = torch.sigmoid(diff)
    expect = (1 - w_b) * out[0, 0, 3].double() + w_b * b_out[0, 0, 3].double()
    torch.testing.assert_close(new_out[0, 0, 3].double(), expect, rtol=1e-6, atol=1e-6)
    expect_lse = lse[0, 0, 3].double() + torch.nn.functional.softplus(diff)
    # lse itself is an fp32 number near 1e4: one rounding step (2^-10) is its resolution.
    torch.testing.assert_close(new_lse[0, 0, 3].double(), expect_lse, rtol=0, atol=2**-10)


@pytest.mark.parametrize("backend", ["torch_flash_cpu", "math"])
def test_large_logits_are_finite(backend):
    # |scores| ~ 1e4: q, k entries ~ 25 with d = 16 give q.k up to ~1e4.
    q, k, v, dout = _inputs(torch.float32, amp=25.0)
    out, lse = kernels.attention_forward(q, k, v, causal=True, softmax_scale=1.0,
                                         backend=backend)
    grads = kernels.attention_backward(dout, q, k, v, out, lse, causal=True, softmax_scale=1.0,
                                       backend=backend)
    assert lse.abs().max() > 1e3
    for t in (out, lse, *grads):
        assert torch.isfinite(t).all()
    ref_out, _ = R.attention(q.double(), k.double(), v.double(), scale=1.0, causal=True)
    # Near-one-hot softmax: out is a copy of one v row; rounding of the 1e4-sized logits in fp32
    # (spacing ~1e-3) may shift weights by ~1e-3 relative where two logits nearly tie.
    torch.testing.assert_close(out.double(), ref_out.detach(), rtol=0, atol=5e-3)


def test_bad_shapes_are_refused():
    q, k, v, _ = _inputs(torch.float32, n_q=4, n_kv=3)
    with pytest.raises(ValueError, match="multiple"):
        kernels.attention_forward(q, k, v, causal=False)
    q, k, v, _ = _inputs(torch.float32)
    with pytest.raises(ValueError, match="diagonal"):
        kernels.attention_forward(q[:, :, :4], k, v, causal=True)
    with pytest.raises(ValueError, match="unknown attention backend"):
        kernels.attention_forward(q, k, v, causal=False, backend="cudnn")


def _cuda_backends():
    if not torch.cuda.is_available():
        return []
    names = ["torch_flash_cuda"]
    if kernels._flash_attn_module() is not None:
        names.append("flash_attn")
    if (torch.cuda.get_device_capability() >= (9, 0) and torch.backends.cudnn.is_available()):
        names.append("torch_cudnn")
    return names


def _ring_of_two_blocks(backend, q, k, v, dout, causal):
    """What METP's ring asks of a kernel, on one device: the keys in two blocks (under
    ``causal``, the second half of the queries against a fully visible block and a diagonal
    one), each block's forward merged into the row's (out, lse), and each block's backward given
    the *merged* out and lse. Returns out, lse, dq (summed over blocks), dk, dv."""
    half = q.shape[2] // 2
    qb, db = (q[:, :, half:], dout[:, :, half:]) if causal else (q, dout)
    blocks = ((slice(0, half), False), (slice(half, None), causal))
    out = lse = None
    for sl, c in blocks:
        o, l = kernels.attention_forward(qb, k[:, :, sl], v[:, :, sl], causal=c, backend=backend)
        out, lse = kernels.merge_partial(out, lse, o, l)
    out = out.to(q.dtype)
    if causal:
        # As the ring hands them over: dO, Q and O one slice of whole-row tensors (the kernels
        # read such views in place where they can, kernels.attention_backward).
        whole = torch.zeros_like(q)
        whole[:, :, half:] = out
        out = whole[:, :, half:]
    dq, dks, dvs = 0, [], []
    for sl, c in blocks:
        g = kernels.attention_backward(db, qb, k[:, :, sl], v[:, :, sl], out, lse, causal=c,
                                       backend=backend)
        dq = dq + g[0].float()
        dks.append(g[1])
        dvs.append(g[2])
    return out, lse, dq, torch.cat(dks, 2), torch.cat(dvs, 2)


@pytest.mark.parametrize("causal", [False, True])
@pytest.mark.parametrize("backend", ["torch_flash_cpu", "math", *_cuda_backends()])
def test_two_block_ring_with_merged_statistics_matches_fp64(backend, causal, report):
    """Each backend as the ring uses it (above), in bf16, against fp64 attention over all keys
    (under ``causal``: the second half's rows of causal attention, whose gradients reach every
    key). Tolerance as test_cuda_backends_match_fp64's GQA bound, 3.5e-2 of max|ref|: bf16
    inputs and outputs (2^-8), with one more bf16 rounding of the merged output."""
    dev = "cuda" if backend in _cuda_backends() else "cpu"
    q, k, v, dout = (t.to(dev) for t in _inputs(torch.bfloat16, n_kv=2, s=16, d=64))
    half = q.shape[2] // 2
    got = _ring_of_two_blocks(backend, q, k, v, dout, causal)
    if causal:
        dout = dout.clone()
        dout[:, :, :half] = 0  # only the second half's rows are the ring's
    ref = R.attention_grads(q.cpu(), k.cpu(), v.cpu(), dout.cpu(), scale=0.125, causal=causal)
    rows = slice(half, None) if causal else slice(None)
    want = (ref[0][:, :, rows], ref[1][:, :, rows], ref[2][:, :, rows], ref[3], ref[4])
    for name, g, r in zip(("out", "lse", "dq", "dk", "dv"), got, want):
        r = r.detach()
        torch.testing.assert_close(g.cpu().double(), r, rtol=3.5e-2,
                                   atol=3.5e-2 * r.abs().max().item(),
                                   msg=lambda m: f"{backend} {name}: {m}")
    report(f"kernels {backend} two-block ring, merged statistics, bf16 causal={causal}: ok")


def _copies_of_cudnn_backward(k, v, q, dout, out, lse):
    """Copies ``attention_backward(backend="torch_cudnn")`` makes before the kernel, as (op,
    shape), on fake tensors (cuDNN's op has a meta kernel: no GPU needed)."""
    from torch.utils._python_dispatch import TorchDispatchMode

    seen = []

    class Log(TorchDispatchMode):
        def __torch_dispatch__(self, func, types, args=(), kwargs=None):
            out_ = func(*args, **(kwargs or {}))
            name = func.overloadpacket.__name__
            # Of the operands of d values per row; the lse statistics ([b, n, s], one value a
            # row) are reshaped for the op, a copy of 1/d of a row block's size.
            if (name in ("clone", "copy_", "_to_copy", "contiguous", "repeat_interleave")
                    and args[0].shape[-1] > 1):
                seen.append((name, tuple(args[0].shape)))
            return out_

    with Log():
        kernels.attention_backward(dout, q, k, v, out, lse, causal=False,
                                   backend="torch_cudnn")
    return seen


def test_cudnn_backward_reads_the_rings_half_blocks_in_place():
    # METP's balanced layout hands the kernel half of a block: K/V rows of the ring's
    # [b, n, s, d] buffer against all of this rank's queries, or half of this rank's query rows
    # (dO, Q and O sliced alike from kernels.backward_rows' dense tensors) against a whole
    # block. cuDNN's backward reads such views in place, as its forward does (the H100 probe of
    # docs/calibration/README.md), so no copy may appear. Copies must still be made where the
    # kernel needs them: K/V rows that are not unit-stride, and dO / O whose strides are not
    # Q's (PyTorch's cached cuDNN graph is keyed on Q's strides only). On fake tensors: the
    # op's meta kernel runs on any machine (the GPU tier checks the numbers:
    # test_two_block_ring_with_merged_statistics_matches_fp64 passes such halves).
    from torch._subclasses.fake_tensor import FakeTensorMode

    with FakeTensorMode():
        b, n, s, d = 1, 4, 16, 64
        half = slice(0, s // 2)
        kv = torch.empty(2, b, n, s, d, dtype=torch.bfloat16)
        q, dout, out = (torch.empty(b, n, s, d, dtype=torch.bfloat16) for _ in range(3))
        lse = torch.empty(b, n, s)
        k, v = kv[0][:, :, half], kv[1][:, :, half]
        assert not k.is_contiguous()
        assert _copies_of_cudnn_backward(k, v, q, dout, out, lse) == []
        # Half of the query rows against a whole block.
        qh, dh, oh = q[:, :, half], dout[:, :, half], out[:, :, half]
        assert not qh.is_contiguous()
        assert _copies_of_cudnn_backward(kv[0], kv[1], qh, dh, oh, lse[:, :, half]) == []
        # Columns strided (a transposed view): K and V are copied, once each.
        kt = torch.empty(b, n, d, s // 2, dtype=torch.bfloat16).transpose(2, 3)
        assert kt.stride(-1) != 1
        got = _copies_of_cudnn_backward(kt, kt, q, dout, out, lse)
        assert [shape for _, shape in got] == [tuple(kt.shape)] * 2, got
        # O dense but Q and dO halves: all three go dense (the two views are copied).
        got = _copies_of_cudnn_backward(kv[0], kv[1], qh, dh, oh.contiguous(), lse[:, :, half])
        assert [shape for _, shape in got] == [tuple(qh.shape)] * 2, got


@pytest.mark.skipif(not torch.cuda.is_available(), reason="GPU tier: needs CUDA")
@pytest.mark.parametrize("causal", [False, True])
@pytest.mark.parametrize("n_kv", [4, 2])
def test_cuda_backends_match_fp64(causal, n_kv, report):
    """The GPU tier: each CUDA flash backend against fp64 attention of the same bf16 inputs.

    Tolerance: Transformer Engine's context-parallel test tolerances for bf16, 2.5e-2 (MHA) and
    3.5e-2 (GQA) relative to max|ref|: the kernels round P and the output to bf16 (2^-8).
    """
    q, k, v, dout = (t.cuda() for t in _inputs(torch.bfloat16, n_kv=n_kv, d=64))
    tol = 2.5e-2 if n_kv == 4 else 3.5e-2
    for backend in _cuda_backends():
        out, lse = kernels.attention_forward(q, k, v, causal=causal, backend=backend)
        dq, dk, dv = kernels.attention_backward(dout, q, k, v, out, lse, causal=causal,
                                                backend=backend)
        ref_out, ref_lse, ref_dq, ref_dk, ref_dv = R.attention_grads(
            q.cpu(), k.cpu(), v.cpu(), dout.cpu(), scale=0.125, causal=causal)
        for name, got, ref in (("out", out, ref_out), ("lse", lse, ref_lse), ("dq", dq, ref_dq),
                               ("dk", dk, ref_dk), ("dv", dv, ref_dv)):
            ref = ref.detach()
            torch.testing.assert_close(got.cpu().double(), ref, rtol=tol,
                                       atol=tol * ref.abs().max().item(),
                                       msg=lambda m: f"{backend} {name}: {m}")
        report(f"kernels {backend} bf16 causal={causal} n_kv={n_kv}: ok within {tol}")


@pytest.mark.skipif(not torch.cuda.is_available(), reason="GPU tier: needs CUDA")
@pytest.mark.parametrize("s", [1, 7, 100, 4095])
def test_cuda_gqa_eight_groups_match_fp64(s, report):
    """Grouped-query attention as LLaMA-3-8B has it (32 query heads, 8 K/V groups, d = 128),
    K/V at their own head count wherever the backend takes that, against fp64 attention of the
    same bf16 inputs: odd lengths (1, 7, 100) and one past a tile (4095). Causal needs
    s_q == s_k: every case is a diagonal block. Tolerance: the GQA one above (3.5e-2 of
    max|ref|, Transformer Engine's bf16 CP tolerance)."""
    q, k, v, dout = (t.cuda() for t in _inputs(torch.bfloat16, b=1, n_q=32, n_kv=8, s=s,
                                               d=128))
    ref = R.attention_grads(q.cpu(), k.cpu(), v.cpu(), dout.cpu(), scale=128 ** -0.5,
                            causal=True)
    for backend in _cuda_backends():
        out, lse = kernels.attention_forward(q, k, v, causal=True, backend=backend)
        got = (out, lse, *kernels.attention_backward(dout, q, k, v, out, lse, causal=True,
                                                     backend=backend))
        for name, g, r in zip(("out", "lse", "dq", "dk", "dv"), got, ref):
            r = r.detach()
            torch.testing.assert_close(g.cpu().double(), r, rtol=3.5e-2,
                                       atol=3.5e-2 * r.abs().max().item(),
                                       msg=lambda m: f"{backend} {name} s={s}: {m}")
        native = backend != "torch_cudnn" or kernels.cudnn_takes_gqa(q, 4)
        report(f"kernels {backend} GQA 32/8 d=128 s={s}: ok within 3.5e-2 "
               f"(K/V {'at 8 heads' if native else 'repeated to 32 heads'})")


def test_gpu_kernels_take_kv_at_their_own_head_count():
    """On the GPU backends' own ops (fake CUDA tensors: their shapes, no GPU needed), K/V of a
    grouped-query block reach PyTorch's flash kernel at their 8 heads, not repeated to Q's 32,
    and its dK/dV come back at 8 heads; cuDNN's the same once its feature test says it takes
    GQA (``kernels.cudnn_takes_gqa``), and repeated (then summed back) otherwise."""
    from torch._subclasses.fake_tensor import FakeTensorMode
    from torch.utils._python_dispatch import TorchDispatchMode

    class Shapes(TorchDispatchMode):
        def __init__(self):
            super().__init__()
            self.calls = []

        def __torch_dispatch__(self, func, types, args=(), kwargs=None):
            name = str(func)
            if "attention" in name or "repeat" in name or "index_select" in name:
                self.calls.append((name, [tuple(a.shape) for a in args
                                          if isinstance(a, torch.Tensor)]))
            return func(*args, **(kwargs or {}))

    def run(backend):
        with FakeTensorMode():
            q = torch.empty(1, 32, 256, 128, dtype=torch.bfloat16, device="cuda")
            k = torch.empty(1, 8, 256, 128, dtype=torch.bfloat16, device="cuda")
            with Shapes() as rec:
                out, lse = kernels.attention_forward(q, k, k, causal=True, backend=backend)
                _, dk, dv = kernels.attention_backward(out, q, k, k, out, lse, causal=True,
                                                       backend=backend)
            assert dk.shape == dv.shape == k.shape
            return rec.calls

    def kv_heads(calls):   # the K and V heads each kernel call was given
        return [shapes[1][1] if "backward" not in n else shapes[2][1]
                for n, shapes in calls if "attention" in n]

    flash = run("torch_flash_cuda")
    assert kv_heads(flash) == [8, 8] and not any("repeat" in n for n, _ in flash), flash
    saved = dict(kernels._CUDNN_GQA)
    try:
        kernels._CUDNN_GQA.clear()
        assert kv_heads(run("torch_cudnn")) == [32, 32]   # no GPU has said it takes GQA
        kernels._CUDNN_GQA["a GPU"] = True
        assert kv_heads(run("torch_cudnn")) == [8, 8]
    finally:
        kernels._CUDNN_GQA.clear()
        kernels._CUDNN_GQA.update(saved)


def test_widening_mm_is_one_fp32_gemm_where_the_gpu_has_one():
    """``kernels.widening_mm`` (METP's weight-gradient GEMMs): on the planner's fake tensors,
    which stand for the GPU, one GEMM with an fp32 output (cuBLAS's bf16-in, fp32-out GEMM:
    ``torch.mm(..., out_dtype=)``), its FLOPs and bytes those of the GEMM alone, no cast;
    on CPU tensors, which have no such kernel, the bf16 GEMM and a cast, equal bit for bit to
    what the METP passes computed before; fp32 inputs, the plain GEMM."""
    from torch._subclasses.fake_tensor import FakeTensorMode

    from megatron_metp.measure.op_trace import OpRecorder

    g = torch.Generator().manual_seed(0)
    a = torch.randn(64, 32, generator=g).to(torch.bfloat16)
    b = torch.randn(32, 48, generator=g).to(torch.bfloat16)
    got = kernels.widening_mm(a, b, torch.float32)
    assert got.dtype == torch.float32 and torch.equal(got, a.mm(b).to(torch.float32))
    # The sum itself: within bf16's rounding of the result (2^-8 relative) of fp64's.
    ref = a.double() @ b.double()
    assert (got.double() - ref).abs().max() <= 2 ** -8 * ref.abs().max()
    af, bf = a.float(), b.float()
    assert torch.equal(kernels.widening_mm(af, bf, torch.float32), af.mm(bf))
    with FakeTensorMode():
        fa, fb = torch.empty(64, 32, dtype=torch.bfloat16), torch.empty(32, 48,
                                                                        dtype=torch.bfloat16)
        with OpRecorder() as rec:
            out = kernels.widening_mm(fa, fb, torch.float32)
    assert out.dtype == torch.float32 and out.shape == (64, 48)
    ops = [(o.name, o.flops, o.bytes) for o in rec.ops if o.kind == "compute"]
    assert ops == [("mm", 2.0 * 64 * 32 * 48, 64 * 32 * 2 + 32 * 48 * 2 + 64 * 48 * 4)], ops


def test_widening_mm_falls_back_where_torch_has_no_widening_gemm(monkeypatch):
    """A torch older than the ``aten::mm.dtype`` overload (2.8; the NGC containers of 2025
    ship 2.6-2.7): ``has_widening_gemm`` says no and ``widening_mm`` takes the GEMM in the
    inputs' dtype and a cast, on the planner's fake tensors (which stand for the GPU) too, so
    no call reaches an overload that torch lacks. The feature test itself reads the overloads
    this torch registers."""
    from torch._subclasses.fake_tensor import FakeTensorMode

    assert kernels.has_widening_gemm() == ("dtype" in torch.ops.aten.mm.overloads())
    monkeypatch.setattr(kernels, "has_widening_gemm", lambda: False)
    with FakeTensorMode():
        fa = torch.empty(64, 32, dtype=torch.bfloat16)
        fb = torch.empty(32, 48, dtype=torch.bfloat16)
        real_mm = torch.mm

        def mm(*args, **kwargs):
            assert "out_dtype" not in kwargs, "the widening overload was called"
            return real_mm(*args, **kwargs)

        monkeypatch.setattr(torch, "mm", mm)
        out = kernels.widening_mm(fa, fb, torch.float32)
    assert out.dtype == torch.float32 and out.shape == (64, 48)


def _release_schemas():
    """Each torch release of the supported range (pyproject's floor, megatron-core 0.16.1's
    torch>=2.6, up to this one): its attention ops' schemas, as its own headers state them
    (``torch/include/ATen/ops/<op>_ops.h``, ``schema_str``), and ``aten::mm``'s overloads;
    this torch's read live."""
    import json
    from pathlib import Path

    data = json.loads((Path(__file__).parent / "data" / "aten_schemas.json").read_text())
    live = {n: str(getattr(torch.ops.aten, n).default._schema).split("::", 1)[1]
            for n in data[next(iter(data))]["schemas"]}
    data[torch.__version__.split("+")[0]] = dict(schemas=live,
                                                 mm_overloads=torch.ops.aten.mm.overloads())
    return data


def test_every_torch_release_in_range_takes_the_kernel_calls():
    """The GPU backends' calls (and the CPU one's), bound by argument name, against the schema
    of every torch release from the floor to this one: each binds, and binds each argument
    to the position its release expects (a call built positionally for one release would put
    ``None`` in another's ``dropout_p``). The floor is the one pyproject states. And the
    widening GEMM's feature test reads ``aten::mm``'s overloads, which the releases from 2.8
    have."""
    import re
    from pathlib import Path

    from megatron_metp import aten_calls

    floor = re.search(r'"torch>=([0-9.]+)"', (Path(__file__).parents[1] / "pyproject.toml")
                      .read_text()).group(1)
    releases = _release_schemas()
    assert min(releases, key=lambda v: tuple(map(int, v.split(".")))).startswith(floor), floor
    t = torch.empty(1, 1, 1, 1, device="meta")
    for version, rel in releases.items():
        schemas = {n: torch._C.parse_schema(f"aten::{s}") for n, s in rel["schemas"].items()}
        for backend in kernels.CALLS:
            assert kernels.op_binds(backend, schemas), (version, backend)
            name, values, optional = kernels.BACKWARD_CALLS[backend](t, t, t, t, t, t, True,
                                                                    0.5)
            args, kwargs = aten_calls.bind(schemas[name], values, optional)
            names = [a.name for a in schemas[name].arguments if not a.kwarg_only]
            assert args[names.index("dropout_p")] == 0.0 and args[names.index("is_causal")]
            assert kwargs["scale"] == 0.5
        assert ("dtype" in rel["mm_overloads"]) == (tuple(map(int, version.split(".")[:2]))
                                                    >= (2, 8)), version


def test_a_schema_without_an_argument_is_refused_by_name():
    """A release whose op lacks an argument the call must give, or requires one it does not
    know, fails the feature test (the backend is not picked) and names the argument."""
    from megatron_metp import aten_calls

    s = torch._C.parse_schema("aten::f(Tensor query, Tensor extra, float dropout_p=0.0) -> Tensor")
    assert not aten_calls.binds(s, ["query"])
    with pytest.raises(TypeError, match="'extra'"):
        aten_calls.bind(s, dict(query=1))
    with pytest.raises(TypeError, match="is_causal"):
        aten_calls.bind(s, dict(query=1, extra=2, is_causal=True))
    assert aten_calls.bind(s, dict(query=1, extra=2), dict(attn_bias=None)) == ([1, 2, 0.0], {})
