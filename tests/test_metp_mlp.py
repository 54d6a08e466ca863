"""METP MLP (Alg. 1-2) equals an fp64 reference and Megatron's TP+SP MLP; its communication and
memory are the paper's Table 1 figures; bad configurations are refused naming the flag.

Layer shapes are tiny (2 CPU cores); the memory case uses s = 16h as the issue asks.
"""

import pytest
import torch
import torch.distributed as dist
import torch.nn.functional as F

from megatron_metp.measure import formulas
from megatron_metp.measure.comm_counter import CommCounter
from megatron_metp.measure.memory import PeakMemory
from megatron_metp.metp.weight_ring import MLP_MIN_ROWS
from megatron_metp.validation import MetpConfigError
from tests import _reference as R
from tests._harness import run_ranks
from tests._models import max_errors, shard_like

S, B, H, FFN = 8, 2, 8, 16

# fp32: rtol 1e-5 and atol 1e-5 * max|ref| (the bound; the paper reports mean element
# errors below 1e-5). Each output element is a sum of F products accumulated in a different order
# than the reference (per ring step, then across steps), so errors are a few ulp of the largest
# partial sums: ~1e-7 relative to max|ref|, 100x inside the bound. fp64: the same argument with
# ulp 1e-16 gives ~1e-15, so rtol = atol/max|ref| = 1e-10 leaves a wide margin yet would catch any
# wrong shard, missing step or mis-routed gradient (those are O(1) errors).
TOL = {torch.float32: 1e-5, torch.float64: 1e-10}


def _config(p, *, gated, bias, dtype=torch.float32, hidden=H, ffn=FFN, mlp_pass="ring", **kw):
    # mlp_pass: these tests hold the paper's weight ring to its Table 1 figures; at their tiny
    # shapes --metp-mlp-pass auto would take the gathered pass (metp.gathered_mlp), tested here
    # by name.
    from megatron_metp.model import make_config

    return make_config(
        "llama" if gated else "gpt",
        metp_mlp_pass=mlp_pass,
        hidden_size=hidden,
        ffn_hidden_size=ffn,
        num_attention_heads=4,
        num_query_groups=4,
        add_bias_linear=bias,
        params_dtype=dtype,
        tensor_model_parallel_size=p,
        **{"sequence_parallel": p > 1, **kw},
    )


def _build(cls, config, ffn=FFN):
    from megatron.core.tensor_parallel.layers import ColumnParallelLinear, RowParallelLinear
    from megatron.core.transformer.mlp import MLPSubmodules

    sub = MLPSubmodules(linear_fc1=ColumnParallelLinear, linear_fc2=RowParallelLinear)
    return cls(config, sub, ffn_hidden_size=ffn)


def _full_tensors(gated, bias, hidden=H, ffn=FFN, s=S, b=B, seed=7):
    """fp64 full (TP = 1) weights in Megatron's layout (fc1 = [gate; up]), input and grad."""
    g = torch.Generator().manual_seed(seed)
    r = lambda *shape: torch.randn(*shape, generator=g, dtype=torch.float64)  # noqa: E731
    f1 = 2 * ffn if gated else ffn
    t = {
        "linear_fc1.weight": r(f1, hidden) / hidden**0.5,
        "linear_fc2.weight": r(hidden, ffn) / ffn**0.5,
        "x": r(s, b, hidden),
        "g": r(s, b, hidden),
    }
    if bias:
        t["linear_fc1.bias"] = r(f1)
        t["linear_fc2.bias"] = r(hidden)
    return t


def _run_local(mlp, t, dtype):
    """Load this rank's shards, run fwd+bwd on this rank's tokens; return out and grads."""
    from megatron.core import parallel_state as mpu

    p, rank = mpu.get_tensor_model_parallel_world_size(), mpu.get_tensor_model_parallel_rank()
    params = dict(mlp.named_parameters())
    with torch.no_grad():
        for n, prm in params.items():
            prm.copy_(shard_like(t[n], prm).to(dtype))
            prm.grad = None
    sl = slice(rank * S // p, (rank + 1) * S // p)
    x = t["x"][sl].to(dtype).requires_grad_(True)
    out, bias = mlp(x)
    y = out + bias if bias is not None else out
    (y * t["g"][sl].to(dtype)).sum().backward()
    grads = {n: prm.grad for n, prm in params.items()}
    if "linear_fc2.bias" in grads:
        # fc2's bias is replicated and tagged sequence_parallel: each rank holds the sum over its
        # own tokens, and Megatron's finalize_model_grads all-reduces it over the TP group.
        dist.all_reduce(grads["linear_fc2.bias"], group=mpu.get_tensor_model_parallel_group())
    grads["x"] = x.grad
    return y.detach(), grads, sl


def _against_fp64(p, mlp_pass="ring"):
    from megatron_metp.metp.mlp import MetpMLP
    from megatron_metp.model import initialize_parallel

    initialize_parallel(tensor_model_parallel_size=p, seed=1)
    errs = []
    for gated, act in ((False, F.gelu), (True, F.silu)):
        for bias in (True, False):
            t = _full_tensors(gated, bias)
            for dtype in (torch.float32, torch.float64):
                # The reference sees the weights the layer holds (rounded to dtype), in fp64.
                tq = {k: v.to(dtype).double() for k, v in t.items()}
                ref_out, ref_grads = R.mlp(tq, gated, act)
                mlp = _build(MetpMLP, _config(p, gated=gated, bias=bias, dtype=dtype,
                                              mlp_pass=mlp_pass))
                y, grads, sl = _run_local(mlp, tq, dtype)
                tol = TOL[dtype]
                name = f"{'swiglu' if gated else 'gelu'}{'+bias' if bias else ''} {dtype}"
                checks = {"out": (y, ref_out[sl]), "x": (grads["x"], ref_grads["x"][sl])}
                for n, prm in mlp.named_parameters():
                    checks[n] = (grads[n], shard_like(ref_grads[n], prm))
                for what, (a, e) in checks.items():
                    e = e.to(dtype)
                    torch.testing.assert_close(
                        a, e, rtol=tol, atol=tol * e.abs().max().item(),
                        msg=lambda m: f"p={p} {name} {what}: {m}",
                    )
                    errs.append((name, what, *max_errors(a, e)))
    return errs


@pytest.mark.parametrize("mlp_pass", ["ring", "gathered"])
@pytest.mark.parametrize("p", [1, 2, 4])
def test_metp_mlp_equals_fp64_reference(p, mlp_pass, report):
    # The gathered pass (metp.gathered_mlp) sums each output over F in one GEMM and each weight
    # gradient over the ranks in one reduce-scatter: the same few-ulp argument, the same bounds.
    per_rank = run_ranks(p, _against_fp64, p, mlp_pass)
    for dtype in ("float32", "float64"):
        rows = [e for errs in per_rank for e in errs if dtype in e[0]]
        mx = max(r[2] for r in rows)
        mean = sum(r[3] for r in rows) / len(rows)
        report(f"METP MLP ({mlp_pass}) vs fp64 reference, p={p}, {dtype} (GeLU/SwiGLU, +-bias, out and every "
               f"grad): max abs err {mx:.2e}, mean abs err {mean:.2e}")


# ------------------------------------------------------------------------------------------------
# Against Megatron's own TP+SP MLP, same weights; communication counted; parameters and keys.

CASES = (("gelu+bias", False, True), ("swiglu", True, False))
# Megatron-LM's default --bias-swiglu-fusion: Megatron's MLP runs its fused SwiGLU kernels, and
# METP's weight ring takes the same ones, forward and backward (metp.mlp.FusedSwiGLU).
FUSED = ("swiglu fused", True, False)


def _against_megatron(p, mlp_pass="ring"):
    from megatron.core.transformer.mlp import MLP

    from megatron_metp.metp.mlp import MetpMLP
    from megatron_metp.model import initialize_parallel

    initialize_parallel(tensor_model_parallel_size=p, seed=1)
    from megatron_metp.metp.mlp import FusedSwiGLU

    out = {}
    for name, gated, bias in (*CASES, FUSED):
        t = {k: v.float().double() for k, v in _full_tensors(gated, bias).items()}
        cfg = _config(p, gated=gated, bias=bias, bias_activation_fusion=name == FUSED[0],
                      mlp_pass=mlp_pass)
        tp, metp = _build(MLP, cfg), _build(MetpMLP, cfg)
        assert isinstance(metp._act, FusedSwiGLU) == (name == FUSED[0]), name
        # Same parameter names, shapes, TP attributes and checkpoint keys as the TP MLP.
        tp_params, metp_params = dict(tp.named_parameters()), dict(metp.named_parameters())
        assert list(tp_params) == list(metp_params)
        for n, prm in tp_params.items():
            q = metp_params[n]
            assert prm.shape == q.shape, n
            for attr in ("tensor_model_parallel", "partition_dim", "partition_stride",
                         "sequence_parallel"):
                assert getattr(prm, attr, None) == getattr(q, attr, None), (n, attr)
        from megatron.core.transformer.utils import ensure_metadata_has_dp_cp_group

        meta = ensure_metadata_has_dp_cp_group(None)
        sd_tp = tp.sharded_state_dict("mlp.", metadata=meta)
        sd_metp = metp.sharded_state_dict("mlp.", metadata=meta)
        assert sorted(sd_tp) == sorted(sd_metp)
        assert [type(sd_tp[k]).__name__ for k in sorted(sd_tp)] == \
               [type(sd_metp[k]).__name__ for k in sorted(sd_metp)]
        with CommCounter() as cc_tp:
            y_tp, g_tp, _ = _run_local(tp, t, torch.float32)
        with CommCounter() as cc_metp:
            y_metp, g_metp, _ = _run_local(metp, t, torch.float32)
        errs = {}
        # fp32 against fp32: both sum the same products in different orders (TP: one matmul
        # over F/p then a reduce-scatter over ranks; METP: p ring steps), so a few ulp of the
        # largest partial sums; the fp64 tolerance argument above applies unchanged.
        for what in ["out", *g_tp]:
            a, e = (y_metp, y_tp) if what == "out" else (g_metp[what], g_tp[what])
            torch.testing.assert_close(a, e, rtol=1e-5, atol=1e-5 * e.abs().max().item(),
                                       msg=lambda m: f"p={p} {name} {what}: {m}")
            errs[what] = max_errors(a, e)[0]
        # The fc2-bias all-reduce in _run_local is the test's stand-in for DDP, not the layer's.
        if bias:
            cc_tp.events = [e for e in cc_tp.events if e.op != "all_reduce"]
            cc_metp.events = [e for e in cc_metp.events if e.op != "all_reduce"]
        out[name] = dict(errs=errs, tp=_comm(cc_tp), metp=_comm(cc_metp))
    return out


def _comm(cc):
    return dict(sent=cc.sent_elements(),
                ops={op: (s.calls, s.elements) for op, s in cc.stats.items() if s.calls})


def _measured_comm_table():
    """Communication of one MLP layer fwd+bwd at the paper's shape: F = 4h, GeLU, no bias."""
    from megatron.core import parallel_state as mpu
    from megatron.core.transformer.mlp import MLP

    from megatron_metp.metp.mlp import MetpMLP

    p = mpu.get_tensor_model_parallel_world_size()
    res = {}
    t = {k: v.float().double() for k, v in _full_tensors(False, False, ffn=4 * H).items()}
    for cls in (MLP, MetpMLP):
        mlp = _build(cls, _config(p, gated=False, bias=False, ffn=4 * H), ffn=4 * H)
        with CommCounter() as cc:
            _run_local(mlp, t, torch.float32)
        res[cls.__name__] = _comm(cc)
    return res


def _bf16_errors():
    """bf16 METP and bf16 TP+SP, each against the fp64 reference: max error / max|ref|."""
    from megatron.core import parallel_state as mpu
    from megatron.core.transformer.mlp import MLP

    from megatron_metp.metp.mlp import MetpMLP

    p = mpu.get_tensor_model_parallel_world_size()
    res = {}
    for gated, act in ((False, F.gelu), (True, F.silu)):
        t = {k: v.bfloat16().double() for k, v in _full_tensors(gated, True).items()}
        ref_out, ref_g = R.mlp(t, gated, act)
        for cls in (MLP, MetpMLP):
            cfg = _config(p, gated=gated, bias=True, dtype=torch.bfloat16, bf16=True)
            mlp = _build(cls, cfg)
            y, g, sl = _run_local(mlp, t, torch.bfloat16)
            assert y.dtype == torch.bfloat16 and g["x"].dtype == torch.bfloat16
            pairs = {"out": (y, ref_out[sl]), "x": (g["x"], ref_g["x"][sl])}
            for n, prm in mlp.named_parameters():
                assert g[n].dtype == torch.bfloat16, n
                pairs[n] = (g[n], shard_like(ref_g[n], prm))
            res[(gated, cls.__name__)] = max(
                max_errors(a, e)[0] / e.abs().max().item() for a, e in pairs.values())
    return res


def _layer_checks(p):
    out = _against_megatron(p)
    out["paper"] = _measured_comm_table()
    out["bf16"] = _bf16_errors()
    return out


@pytest.mark.parametrize("p", [2, 4])
def test_metp_mlp_equals_megatron_tp_mlp_and_counts(p, report):
    res = run_ranks(p, _layer_checks, p)
    n_tok = S * B
    for rank, r in enumerate(res):
        for name, gated, bias in CASES:
            c = r[name]
            # Counting convention: CommCounter.sent_elements() = elements this rank sends
            # (P2P sends at their size; all-gather / reduce-scatter of a full tensor N at
            # (p-1)/p N), the convention of the paper's Sec. 3.2 and Table 1.
            assert c["metp"]["sent"] == pytest.approx(
                formulas.metp_mlp_comm(H, FFN, p, gated=gated, bias=bias))
            assert set(c["metp"]["ops"]) == {"send", "recv"}, c["metp"]["ops"]
            # Megatron's TP+SP: all-gather X (fwd), X again and dO (bwd); reduce-scatter O (fwd)
            # and dX (bwd); each of the full [s, b, h] tensor.
            assert c["tp"]["ops"] == {"all_gather": (3, 3 * n_tok * H),
                                      "reduce_scatter": (2, 2 * n_tok * H)}, c["tp"]["ops"]
            assert c["tp"]["sent"] == pytest.approx(formulas.tp_sp_mlp_comm(B, S, H, p))
        paper = r["paper"]
        # Table 1: 24 (p-1)/p h^2 for METP (GeLU, F = 4h, no bias), 5 (p-1)/p bsh for TP+SP.
        assert paper["MetpMLP"]["sent"] == pytest.approx(24 * (p - 1) / p * H * H)
        assert paper["MLP"]["sent"] == pytest.approx(5 * (p - 1) / p * B * S * H)
        # Per op: p-1 forward hops + p-1 backward hops of (W_in, W_out), each 2 sends of h*4h/p,
        # and p-1 accumulator hops of the same.
        assert paper["MetpMLP"]["ops"]["send"] == (6 * (p - 1), 24 * (p - 1) * H * H // p)
    r0 = res[0]
    for r in res:
        for key, err in r["bf16"].items():
            # bf16 keeps 8 significant bits (ulp 2^-7 relative at the top of a binade). Inputs,
            # weights, f(T) and every output are rounded to bf16 (TP and METP alike; METP sums
            # its ring steps in fp32), so each result carries a few roundings of 2^-9 relative
            # to the largest entry: 2^-6 = 1.6e-2 bounds them with room, while a wrong shard or
            # gradient hop is an O(1) error. TP+SP is held to the same bound.
            assert err <= 2**-6, (key, err)
    errs = {n: max(r0[n]["errs"].values()) for n, _, _ in (*CASES, FUSED)}
    report(f"METP MLP vs Megatron TP+SP MLP, p={p}, fp32, same weights: max abs err "
           + ", ".join(f"{n} {e:.2e}" for n, e in errs.items()))
    report(f"MLP comm per rank per fwd+bwd, p={p}, b={B} s={S} h={H} F=4h GeLU no bias "
           f"(elements sent, paper convention): METP {r0['paper']['MetpMLP']['sent']:.0f} "
           f"[= 24(p-1)/p h^2 = {24 * (p - 1) / p * H * H:.0f}; ops "
           f"{r0['paper']['MetpMLP']['ops']}], TP+SP {r0['paper']['MLP']['sent']:.0f} "
           f"[= 5(p-1)/p bsh = {5 * (p - 1) / p * B * S * H:.0f}; ops {r0['paper']['MLP']['ops']}]")
    bf = r0["bf16"]
    report(f"bf16 MLP vs fp64 reference, p={p}, max err / max|ref| over out and grads: "
           f"GeLU METP {bf[(False, 'MetpMLP')]:.1e} (TP+SP {bf[(False, 'MLP')]:.1e}), "
           f"SwiGLU METP {bf[(True, 'MetpMLP')]:.1e} (TP+SP {bf[(True, 'MLP')]:.1e})")


def _gathered_checks(p, large):
    from megatron_metp.metp.gathered_mlp import GatheredMLPFunction
    from megatron_metp.metp.weight_ring import MetpMLPFunction
    from tests import _models as M

    calls = []
    # Which autograd function each layer ran: the test fails if the gathered pass is not taken.
    orig = GatheredMLPFunction.apply, MetpMLPFunction.apply
    GatheredMLPFunction.apply = lambda *a: calls.append("gathered") or orig[0](*a)
    MetpMLPFunction.apply = lambda *a: calls.append("ring") or orig[1](*a)
    try:
        # large: a large layer's paths (tests._models.large_layers): fc2's gradient
        # reduce-scattered on its own, as soon as made; the activation recomputed.
        with M.large_layers(large):
            out = _against_megatron(p, "gathered")
    finally:
        GatheredMLPFunction.apply, MetpMLPFunction.apply = orig
    out["calls"] = sorted(set(calls))
    return out


@pytest.mark.parametrize("p", [2, 4])
def test_gathered_mlp_equals_megatron_tp_mlp_and_counts(p, report):
    """--metp-mlp-pass gathered (metp.gathered_mlp) against Megatron's own TP+SP MLP, same
    weights, fp32 (the bounds of _against_megatron: same products, other summation order). It
    sends exactly the weight ring's elements (the weights twice, their gradients once), in
    all-gathers and reduce-scatters instead of p - 1 hops each: 3 + 3 gathers with fc1's bias,
    2 + 2 without, and no point-to-point call; 1 reduce-scatter call with or without bias
    for a small layer (fc1's bias with its weight, comm.scatter_rows_together, and fc2's with
    them, wgrad_accum.scatters_together), 2 for a large one (fc2's on its own, as soon as
    made)."""
    res = run_ranks(p, _gathered_checks, p, False)
    large_res = run_ranks(p, _gathered_checks, p, True)
    for r, rl in zip(res, large_res):
        assert r["calls"] == rl["calls"] == ["gathered"], r["calls"]
        for name, gated, bias in (*CASES, FUSED):
            for large, runs in ((False, r), (True, rl)):
                c = runs[name]["metp"]
                assert c["sent"] == pytest.approx(
                    formulas.metp_mlp_comm(H, FFN, p, gated=gated, bias=bias)), name
                k = 3 if bias else 2
                assert {op: n for op, (n, _) in c["ops"].items()} == \
                    {"all_gather": 2 * k, "reduce_scatter": 1 + large}, (name, c["ops"])
    errs = {n: max(res[0][n]["errs"].values()) for n, _, _ in (*CASES, FUSED)}
    report(f"METP MLP (gathered) vs Megatron TP+SP MLP, p={p}, fp32, same weights: max abs err "
           + ", ".join(f"{n} {e:.2e}" for n, e in errs.items())
           + f"; ops {res[0]['swiglu']['metp']['ops']}")


def test_auto_gathers_only_short_inputs():
    # --metp-mlp-pass auto (gathered_mlp.GATHERED_MLP_BYTES, 512 MiB): LLaMA-7B at p = 8 in
    # bf16 (F' = 2 x 11008 = 22016 gathered fc1 rows) gathers up to 12,192 tokens per rank
    # (s = 97k), where the ring's 301 launches per layer made it host-bound or the two tie;
    # from 128k, where memory decides what fits, the ring.
    from megatron_metp.metp.gathered_mlp import takes_gathered

    f1 = 22016
    assert takes_gathered(12192, f1, 2) and not takes_gathered(12193, f1, 2)
    for s, gathered in ((4096, True), (16384, True), (65536, True), (131072, False),
                        (262144, False)):
        assert takes_gathered(s // 8, f1, 2) == gathered, s


def test_the_activation_is_kept_only_where_small_and_its_backward_is_autograds():
    # gathered_mlp.keeps_act (KEEP_ACT_MAX_VALUES = 2^23): BERT-Large at p = 8 (F = 4096)
    # keeps D up to 2048 tokens per rank (s = 16k), LLaMA-7B (F = 11008) up to 762 (s = 4k
    # and not 8k). And the fused GeLU's backward without a graph is the one autograd runs on
    # F.gelu(approximate="tanh"): the same values, bit for bit.
    import torch.nn.functional as F

    from megatron_metp.metp.gathered_mlp import keeps_act
    from megatron_metp.metp.mlp import TanhGelu

    assert keeps_act(2048, 4096) and not keeps_act(4096, 4096)
    assert keeps_act(512, 11008) and not keeps_act(1024, 11008)
    g = torch.Generator().manual_seed(3)
    for dtype in (torch.float32, torch.bfloat16):
        t = torch.randn(64, 24, generator=g).to(dtype).requires_grad_(True)
        dd = torch.randn(64, 24, generator=g).to(dtype)
        (ref,) = torch.autograd.grad(F.gelu(t, approximate="tanh"), t, dd)
        assert torch.equal(TanhGelu()(t), F.gelu(t, approximate="tanh"))
        assert torch.equal(TanhGelu.backward(dd, t.detach()), ref), dtype


# ------------------------------------------------------------------------------------------------
# Peak tensor memory per rank (MemTracker) of one MLP at s = 16h, GeLU, F = 4h, fp32.

MEM_H, MEM_S, MEM_B = 16, 256, 1


def _memory(p):
    from megatron.core.transformer.mlp import MLP

    from megatron_metp.metp import weight_ring
    from megatron_metp.metp.mlp import MetpMLP
    from megatron_metp.model import initialize_parallel

    # Table 1's regime: token chunks, which the ring runs where memory is short (from ~190k
    # tokens for LLaMA-7B); these small shapes would otherwise run whole (weight_ring.MLP_WHOLE_BYTES).
    weight_ring.MLP_WHOLE_BYTES = 0
    initialize_parallel(tensor_model_parallel_size=p, seed=1)
    h, s, b, ffn = MEM_H, MEM_S, MEM_B, 4 * MEM_H
    res = {}
    for cls in (MLP, MetpMLP):
        mlp = _build(cls, _config(p, gated=False, bias=False, hidden=h, ffn=ffn), ffn=ffn)
        x = torch.randn(s // p, b, h, requires_grad=True)
        g = torch.randn(s // p, b, h)
        # Forward alone: what the forward allocates above the parameters and the input shard.
        with PeakMemory(mlp, x) as fwd:
            out, _ = mlp(x)
        del out
        # One forward + backward: the total per-rank peak, parameters and input included.
        with PeakMemory(mlp, x) as total:
            out, _ = mlp(x)
            out.backward(g)
            del out
        res[cls.__name__] = dict(fwd=fwd.peak_increase, total=total.peak_bytes,
                                 summary=total.summary("KiB"))
    return res


def test_token_chunks_only_where_memory_is_short():
    # LLaMA-7B at p = 8 (F'/p = 2 x 11008 / 8 = 2752, h = 4096, bf16): a ring step runs its
    # tokens whole while the [n, F'/p] temporary is at most 128 MiB (n <= 24,385: s <= 195k),
    # saving each chunk's op sequence (4 forward, ~12 backward per step: 552 -> 404 compute
    # ops per layer at 4k, 1,408 -> 1,124 at 128k); from there the memory rule chunks them.
    from megatron_metp.metp.weight_ring import MLP_WHOLE_BYTES, token_chunks

    f, h = 2752, 4096
    assert MLP_WHOLE_BYTES // (f * 2) == 24385
    for s, k in ((4096, 1), (32768, 1), (131072, 1), (196608, 3), (262144, 3)):
        sl = token_chunks(s // 8, f, h, 2)
        assert len(sl) == k, (s, sl)
        assert sl[0].start == 0 and sl[-1].stop == s // 8
        assert all(a.stop == b.start for a, b in zip(sl, sl[1:]))


def test_chunked_ring_step_equals_one_pass_fp64(monkeypatch):
    """The token-chunked ring step (weight_ring.token_chunks) against autograd on the whole
    MLP in fp64, one rank (no ring): 4 chunks of 256 tokens. fp64, same per-token math and only
    the weight-gradient sums regrouped: agreement to ~1e-15 relative; 1e-12 leaves margin while
    a missed or doubled chunk is an O(1) error."""
    from megatron_metp.metp import weight_ring
    from megatron_metp.metp.weight_ring import metp_mlp_backward, metp_mlp_forward, token_chunks

    g = torch.Generator().manual_seed(0)
    n, h, f = 1024, 16, 64
    # Small enough to run whole (weight_ring.MLP_WHOLE_BYTES); chunked as at long sequences.
    assert len(token_chunks(n, f, h, 8)) == 1
    monkeypatch.setattr(weight_ring, "MLP_WHOLE_BYTES", 0)
    assert len(token_chunks(n, f, h, 8)) == 4
    x, w_in, b_in, w_out, dy = (torch.randn(*sh, generator=g, dtype=torch.float64)
                                for sh in ((n, h), (f, h), (f,), (h, f), (n, h)))
    act = torch.nn.functional.gelu
    out = metp_mlp_forward(x, (w_in, b_in, w_out), act, None)
    dx, (dw_in, db_in, dw_out) = metp_mlp_backward(x, dy, (w_in, b_in, w_out), act, None)
    leaves = [t.clone().requires_grad_() for t in (x, w_in, b_in, w_out)]
    ref = act(leaves[0] @ leaves[1].t() + leaves[2]) @ leaves[3].t()
    ref.backward(dy)
    for got, want in ((out, ref.detach()), (dx, leaves[0].grad), (dw_in, leaves[1].grad),
                      (db_in, leaves[2].grad), (dw_out, leaves[3].grad)):
        torch.testing.assert_close(got, want, rtol=1e-12, atol=1e-12)


@pytest.mark.parametrize("p", [2, 4])
def test_metp_mlp_peak_memory_below_tp(p, report):
    h, s, b, ffn = MEM_H, MEM_S, MEM_B, 4 * MEM_H
    assert s >= 16 * h
    r = run_ranks(p, _memory, p)[0]
    metp, tp = r["MetpMLP"], r["MLP"]
    # METP's forward, by hand (fp32 bytes): the output accumulator [bs/p, h], one token chunk's
    # T and f(T) [rows, F/p] alive together (a ring step runs ceil(4 (F/p) / h) chunks of the
    # bs/p tokens: weight_ring.token_chunks), and the receive buffers of (W_in, W_out) shards:
    # two (double buffering) when more than one shard arrives, one at p = 2.
    w_shard = 2 * h * ffn // p
    recv_bufs = min(2, p - 1)
    n, f_shard = b * s // p, ffn // p
    chunks = max(1, min(-(-4 * f_shard // h), n // MLP_MIN_ROWS))
    rows = -(-n // chunks)
    assert metp["fwd"] == 4 * (n * h + 2 * rows * f_shard + recv_bufs * w_shard)
    assert metp["total"] < tp["total"]
    ratio = metp["fwd"] / tp["fwd"]
    # Table 1 predicts exactly 1/p for the activations (METP bsh/p + 4bsh/p^2 vs TP's
    # bsh + 4bsh/p). Measured, TP also holds GeLU's output and fc2's full [s, b, h] partial sum
    # before its reduce-scatter, so the measured ratio sits at or below 1/p; 5% over is the
    # bound the FFN's memory claim states.
    assert ratio <= 1.05 * formulas.metp_mlp_activation_ratio(p)
    report(f"MLP peak memory per rank, p={p}, s={s}=16h, h={h}, F=4h, fp32: fwd+bwd METP "
           f"{metp['total'] / 1024:.1f} KiB vs TP+SP {tp['total'] / 1024:.1f} KiB; forward "
           f"activations METP/TP = {metp['fwd'] / 1024:.1f}/{tp['fwd'] / 1024:.1f} KiB = "
           f"{ratio:.3f} (Table 1: 1/p = {1 / p:.3f})")


# ------------------------------------------------------------------------------------------------
# Bad input fails at construction / start-up, naming the flag.


def _bad_input():
    from megatron_metp.metp.mlp import MetpMLP, validate_metp_mlp
    from megatron_metp.model import initialize_parallel

    initialize_parallel(tensor_model_parallel_size=2, seed=1)
    cfg = _config(2, gated=False, bias=False)
    with pytest.raises(MetpConfigError, match="--ffn-hidden-size"):
        _build(MetpMLP, cfg, ffn=9)
    with pytest.raises(ValueError, match="--sequence-parallel"):
        _build(MetpMLP, _config(2, gated=False, bias=False, sequence_parallel=False))
    with pytest.raises(MetpConfigError, match="--metp-mlp-pass"):
        _build(MetpMLP, _config(2, gated=False, bias=False, mlp_pass="allgather"))
    with pytest.raises(ValueError, match="--seq-length"):
        validate_metp_mlp(cfg, seq_length=7)
    validate_metp_mlp(cfg, seq_length=8)
    with pytest.raises(ValueError, match="--hidden-size"):
        validate_metp_mlp(cfg, tp_size=3, ffn_hidden_size=12)
    with pytest.raises(ValueError, match="--num-experts"):
        from megatron.core.tensor_parallel.layers import ColumnParallelLinear, RowParallelLinear
        from megatron.core.transformer.mlp import MLPSubmodules

        MetpMLP(cfg, MLPSubmodules(linear_fc1=ColumnParallelLinear,
                                   linear_fc2=RowParallelLinear), is_expert=True, ffn_hidden_size=FFN)
    return True


def test_bad_input_names_the_flag():
    assert all(run_ranks(2, _bad_input))


# ------------------------------------------------------------------------------------------------
# A whole GPTModel: metp_mlp spec against the tp spec, weights copied, dropout 0.


def _gpt_metp_mlp_vs_tp(p):
    from tests import _models as M

    M.setup(tp=p, mode="metp_mlp")
    out = {}
    for style in ("gpt", "llama"):
        kw = {"num_query_groups": p} if style == "llama" else {}
        tp = M.build("tp", style, **kw)
        metp = M.build("metp_mlp", style, **kw)
        assert type(metp.decoder.layers[0].mlp).__name__ == "MetpMLP"
        M.copy_weights(tp, metp)
        b = M.batch()
        r_tp = M.step(M.wrap_ddp(tp), b)
        r_metp = M.step(M.wrap_ddp(metp), b)
        # Same tolerance argument as the tp baseline (tests/test_tp_baseline.py): the models
        # differ only in how the MLP's sums are grouped (ring steps vs one matmul + reduce-
        # scatter), a few fp32 ulps per level; 1e-5 relative to each tensor's scale.
        torch.testing.assert_close(torch.tensor(r_metp["loss"]), torch.tensor(r_tp["loss"]),
                                   rtol=1e-5, atol=0.0)
        torch.testing.assert_close(r_metp["logits"], r_tp["logits"], rtol=1e-5,
                                   atol=1e-5 * r_tp["logits"].abs().max().item())
        worst = M.assert_close_dict(r_metp["grads"], r_tp["grads"], rtol=1e-5, atol_scale=1e-5,
                                    what=style)
        # With Megatron's overlapped gradient reduction (bucket hooks fire as each parameter's
        # gradient is accumulated, here inside the METP backward) the result is the same.
        metp_ov = M.build("metp_mlp", style, **kw)
        M.copy_weights(tp, metp_ov)
        r_ov = M.step(M.wrap_ddp(metp_ov, overlap_grad_reduce=True, bucket_size=1000), b)
        M.assert_close_dict(r_ov["grads"], r_tp["grads"], rtol=1e-5, atol_scale=1e-5,
                            what=f"{style} overlap_grad_reduce")
        out[style] = (abs(r_metp["loss"] - r_tp["loss"]),
                      M.max_errors(r_metp["logits"], r_tp["logits"])[0], worst)
    return out


@pytest.mark.parametrize("p", [2, 4])
def test_gpt_with_metp_mlp_equals_tp(p, report):
    r = run_ranks(p, _gpt_metp_mlp_vs_tp, p)[0]
    for style, (dloss, dlogit, dgrad) in r.items():
        report(f"GPTModel {style} metp_mlp vs tp spec, p={p}, fp32: |dloss| {dloss:.2e}, "
               f"logits max err {dlogit:.2e}, max grad err {dgrad:.2e}")


# ------------------------------------------------------------------------------------------------
# At the paper's scale in one process: FakeTensorMode + the fake process-group backend.

_FAKE_SCRIPT = """
import json, torch, torch.distributed as dist
from torch._subclasses.fake_tensor import FakeTensorMode
from torch.testing._internal.distributed.fake_pg import FakeStore
dist.init_process_group("fake", rank=0, world_size=8, store=FakeStore())
from megatron_metp import cpu_compat
from megatron_metp.metp import weight_ring
cpu_compat.apply()
weight_ring.MLP_WHOLE_BYTES = 0  # the chunked path (the test's docstring)
from megatron.core import parallel_state as mpu
mpu.initialize_model_parallel(tensor_model_parallel_size=8, create_gloo_process_groups=False)
from megatron.core.tensor_parallel.layers import ColumnParallelLinear, RowParallelLinear
from megatron.core.transformer.mlp import MLP, MLPSubmodules
from megatron_metp.measure.comm_counter import CommCounter
from megatron_metp.measure.memory import PeakMemory
from megatron_metp.metp.mlp import MetpMLP
from megatron_metp.model import make_config
h, s, p, out = 8192, 131072, 8, {}
with FakeTensorMode():
    for cls in (MLP, MetpMLP):
        cfg = make_config("gpt", hidden_size=h, ffn_hidden_size=4 * h, num_attention_heads=64,
                          add_bias_linear=False, bf16=True, tensor_model_parallel_size=p,
                          sequence_parallel=True, perform_initialization=False)
        m = cls(cfg, MLPSubmodules(linear_fc1=ColumnParallelLinear,
                                   linear_fc2=RowParallelLinear), ffn_hidden_size=4 * h)
        x = torch.empty(s // p, 1, h, dtype=torch.bfloat16, requires_grad=True)
        with PeakMemory(m, x) as fwd:
            o, _ = m(x)
        del o
        with PeakMemory(m, x) as total, CommCounter() as cc:
            o, _ = m(x)
            o.backward(torch.empty_like(o))
        out[cls.__name__] = dict(fwd=fwd.peak_increase, total=total.peak_bytes,
                                 sent=cc.sent_elements())
print(json.dumps(out))
"""


def test_metp_mlp_at_paper_scale_under_fake_tensors(report):
    import json
    import subprocess
    import sys

    proc = subprocess.run([sys.executable, "-c", _FAKE_SCRIPT], capture_output=True, text=True,
                          timeout=300)
    assert proc.returncode == 0, proc.stderr[-3000:]
    r = json.loads(proc.stdout.strip().splitlines()[-1])
    h, s, b, p, ffn = 8192, 131072, 1, 8, 4 * 8192
    metp, tp = r["MetpMLP"], r["MLP"]
    assert metp["sent"] == pytest.approx(24 * (p - 1) / p * h * h)
    assert tp["sent"] == pytest.approx(5 * (p - 1) / p * b * s * h)
    # METP's forward by hand (bf16 bytes): the output accumulator [bs/p, h], one token chunk's
    # T and f(T) [rows, F/p] alive together (ceil(4 (F/p) / h) = 2 chunks here), and two
    # receive buffers of the (W_in, W_out) shards.
    bf16 = 2
    w_shard = 2 * h * ffn // p
    n, f_shard = b * s // p, ffn // p
    rows = -(-n // min(-(-4 * f_shard // h), n // MLP_MIN_ROWS))
    assert rows == n // 2  # the chunked path, at the paper's shapes
    assert metp["fwd"] == bf16 * (n * h + 2 * rows * f_shard + 2 * w_shard)
    assert metp["total"] < tp["total"]
    ratio = metp["fwd"] / tp["fwd"]
    report(f"MLP at h=8192 s=131072 p=8 bf16 (fake tensors, fake PG): fwd+bwd peak METP "
           f"{metp['total'] / 2**30:.2f} GiB vs TP+SP {tp['total'] / 2**30:.2f} GiB; forward "
           f"activations METP/TP {ratio:.3f} (Table 1: 1/p = {1 / p:.3f}); sent elements METP "
           f"{metp['sent']:.3e} = 24(p-1)/p h^2, TP {tp['sent']:.3e} = 5(p-1)/p bsh")


# ------------------------------------------------------------------------------------------------
# --metp-qkv-backward save+fc1: the MLP keeps every ring step's fc1 output for its backward.


def _kept_then_recomputed(mlp, t, p):
    """Run ``mlp`` keeping fc1 (save+fc1), then recomputing it: whether the two agree bit for bit
    and the shapes each forward saves for backward."""
    from megatron_metp.metp.attention import set_qkv_backward

    def saved_shapes():
        shapes = []
        with torch.autograd.graph.saved_tensors_hooks(lambda x: shapes.append(x.shape) or x,
                                                      lambda x: x):
            mlp(torch.zeros(S // p, B, H, requires_grad=True))
        return [list(s) for s in shapes]

    kept = _run_local(mlp, t, torch.float32)
    kept_shapes = saved_shapes()
    set_qkv_backward(mlp, "recompute")
    again = _run_local(mlp, t, torch.float32)
    same = torch.equal(kept[0], again[0]) and all(
        torch.equal(kept[1][k], again[1][k]) for k in kept[1])
    return dict(same=same, kept=kept_shapes, recomputed=saved_shapes(),
                fc1_rows=mlp.linear_fc1.weight.shape[0])


def _kept_fc1_vs_recomputed(p):
    from megatron_metp.metp.mlp import MetpMLP
    from megatron_metp.model import initialize_parallel

    from megatron_metp.metp import weight_ring

    initialize_parallel(tensor_model_parallel_size=p, seed=1)
    out = {}
    whole = weight_ring.MLP_WHOLE_BYTES, weight_ring.MLP_MIN_ROWS
    for (name, gated, bias), chunked in [(c, k) for c in (*CASES, FUSED) for k in (False, True)]:
        # chunked: each ring step in token chunks, each chunk's T kept in its rows.
        weight_ring.MLP_WHOLE_BYTES, weight_ring.MLP_MIN_ROWS = (0, 2) if chunked else whole
        assert len(weight_ring.token_chunks(S * B // p, 2 * FFN, H, 4)) > 1 or not chunked
        name = f"{name}{' chunked' if chunked else ''}"
        t = _full_tensors(gated, bias)
        cfg = _config(p, gated=gated, bias=bias, bias_activation_fusion=FUSED[0] in name,
                      metp_qkv_backward="save+fc1")
        mlp = _build(MetpMLP, cfg)
        assert mlp.keep_fc1
        # What the forward keeps: x, and [p, n/p, F'/p] of fc1 outputs (none when recomputed).
        out[name] = _kept_then_recomputed(mlp, t, p)
        assert not mlp.keep_fc1
    weight_ring.MLP_WHOLE_BYTES, weight_ring.MLP_MIN_ROWS = whole
    # The gathered pass (metp.gathered_mlp) keeps its one [n/p, F'] fc1 output, and where the
    # activation has a backward of its own (the fused ones: Megatron-LM's default
    # --bias-gelu-fusion / --bias-swiglu-fusion) its [n/p, F] output too (keeps_act: these
    # sizes are far under KEEP_ACT_MAX_VALUES).
    for name, gated, bias in (*CASES, FUSED, ("gelu+bias fused", False, True)):
        t = _full_tensors(gated, bias)
        cfg = _config(p, gated=gated, bias=bias, bias_activation_fusion=name.endswith("fused"),
                      metp_qkv_backward="save+fc1", mlp_pass="gathered")
        out[f"{name} gathered"] = _kept_then_recomputed(_build(MetpMLP, cfg), t, p)
    return out


@pytest.mark.parametrize("p", [2])
def test_kept_fc1_outputs_change_no_bit(p, report):
    res = run_ranks(p, _kept_fc1_vs_recomputed, p)
    for r in res:
        for name, c in r.items():
            if name.endswith("gathered"):
                # One [n/p, F'] tensor (every shard's columns), as many values as the ring's;
                # and the fused activations' [n/p, F] output (F' = 2F gated, F' = F not).
                n = S * B // p
                assert c["same"], name
                assert [n, p * c["fc1_rows"]] in c["kept"], (name, c["kept"])
                assert [n, p * c["fc1_rows"]] not in c["recomputed"], (name, c["recomputed"])
                fused = name.endswith("fused gathered")
                assert c["kept"].count([n, FFN]) == fused + (FFN == p * c["fc1_rows"]), (
                    name, c["kept"])
                continue
            # The backward reads the forward's T instead of running the same GEMM on the same
            # operands again, and the activation's backward sees the same T: every bit equal.
            assert c["same"], name
            n = S * B // p
            assert [p, n, c["fc1_rows"]] in c["kept"], (name, c["kept"])
            assert [p, n, c["fc1_rows"]] not in c["recomputed"], (name, c["recomputed"])
        assert len(r) == 10
    report(f"METP MLP, p={p}, fp32: --metp-qkv-backward save+fc1 keeps [p, n/p, F'/p] (ring) or "
           f"[n/p, F'] (gathered; and the fused activations' [n/p, F] output) and equals "
           f"recomputing fc1 bit for bit (GeLU+bias, SwiGLU, fused SwiGLU; whole and "
           f"token-chunked ring steps, and the gathered pass, with fused GeLU too)")
