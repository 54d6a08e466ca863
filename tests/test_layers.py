"""The spec building blocks (``megatron_metp.layers``) and the layer specs (``megatron_metp.specs``).

* ``Norm`` equals LayerNorm / RMSNorm written out in fp64 (outputs and gradients).
* ``SDPACoreAttention`` equals fp64 softmax attention (causal, explicit mask, no mask, GQA) and
  Megatron's own ``DotProductAttention`` given the same explicit mask.
* A GPTModel from the ``tp`` spec has exactly the parameter names, shapes and sharded_state_dict
  keys of Megatron's stock local spec (``get_gpt_layer_local_spec``) and, with the weights
  copied, the same logits.
* Spec names, lazy references, and clear errors for bad modes and missing modules.
"""

import math

import pytest
import torch

from tests import _models as M
from tests import _reference as R
from tests._harness import run_ranks


def _cfg(**kw):
    from megatron_metp.model import make_config

    return make_config(**kw)


def _norm_checks():
    from megatron_metp.layers import Norm

    g = torch.Generator().manual_seed(0)
    x = torch.randn(5, 2, 16, dtype=torch.float64, generator=g, requires_grad=True)
    for normalization in ("LayerNorm", "RMSNorm"):
        for zero_centered in (False, True):
            cfg = _cfg(
                style="gpt" if normalization == "LayerNorm" else "llama",
                params_dtype=torch.float64,
                layernorm_zero_centered_gamma=zero_centered,
            )
            norm = Norm(config=cfg, hidden_size=16, eps=1e-5)  # TransformerLayer's call
            with torch.no_grad():
                for p in norm.parameters():
                    p.copy_(torch.randn(p.shape, generator=g, dtype=torch.float64))
            gamma = norm.weight + 1 if zero_centered else norm.weight
            if normalization == "LayerNorm":
                mu = x.mean(-1, keepdim=True)
                ref = (x - mu) / torch.sqrt(((x - mu) ** 2).mean(-1, keepdim=True) + 1e-5)
                ref = ref * gamma + norm.bias
            else:
                assert norm.bias is None
                ref = x / torch.sqrt((x**2).mean(-1, keepdim=True) + 1e-5) * gamma
            out = norm(x)
            dy = torch.randn(out.shape, generator=g, dtype=torch.float64)
            got = torch.autograd.grad(out, [x, *norm.parameters()], dy)
            want = torch.autograd.grad(ref, [x, *norm.parameters()], dy)
            # fp64, same formula in a different operation order: 1e-12 is ~1e4 ulps of margin.
            torch.testing.assert_close(out, ref, rtol=1e-12, atol=1e-12)
            for a, b in zip(got, want):
                torch.testing.assert_close(a, b, rtol=1e-12, atol=1e-12)
    # Sequence-parallel tag (Megatron all-reduces tagged grads over TP).
    sp = Norm(config=_cfg(tensor_model_parallel_size=2), hidden_size=8)
    assert all(p.sequence_parallel for p in sp.parameters())
    with pytest.raises(ValueError, match="--normalization"):
        Norm(config=_cfg(), hidden_size=8, normalization="L2Norm")

    # RMSNorm keeps for backward only what a fused kernel keeps: its input, gamma and one fp32
    # rstd per token (bf16 input [64, 2, 32]: 8 KiB + 64 B + 512 B).
    saved = []
    rms = Norm(config=_cfg(style="llama", params_dtype=torch.bfloat16), hidden_size=32)
    xb = torch.randn(64, 2, 32, dtype=torch.bfloat16, requires_grad=True)
    with torch.autograd.graph.saved_tensors_hooks(
            lambda t: saved.append(t.numel() * t.element_size()) or t, lambda t: t):
        rms(xb)
    assert sum(saved) == 64 * 2 * 32 * 2 + 32 * 2 + 64 * 2 * 4, saved
    return True


def test_norm_matches_formulas():
    assert all(run_ranks(1, _norm_checks))


def _attention_checks():
    from megatron.core.transformer.dot_product_attention import DotProductAttention
    from megatron.core.transformer.enums import AttnMaskType

    from megatron_metp.layers import SDPACoreAttention

    M.setup(tp=1)
    s, b, heads, groups, d = 6, 2, 4, 2, 8
    g = torch.Generator().manual_seed(1)
    errs = []
    for dtype in (torch.float64, torch.float32):
        cfg = _cfg(
            style="llama", num_attention_heads=heads, num_query_groups=groups, hidden_size=heads * d,
            params_dtype=dtype,
        )
        q = torch.randn(s, b, heads, d, generator=g, dtype=dtype, requires_grad=True)
        k = torch.randn(s, b, groups, d, generator=g, dtype=dtype, requires_grad=True)
        v = torch.randn(s, b, groups, d, generator=g, dtype=dtype, requires_grad=True)
        causal = torch.triu(torch.ones(s, s, dtype=torch.bool), 1)
        padding = torch.rand(b, 1, s, s, generator=g) < 0.3
        padding[..., 0] = False  # every query keeps at least one key
        cases = [
            (AttnMaskType.causal, None, causal, None),
            (AttnMaskType.causal, padding, padding, None),
            (AttnMaskType.no_mask, None, None, None),
            (AttnMaskType.padding_causal, None, causal, None),
            (AttnMaskType.causal, None, causal, 0.3),  # explicit softmax scale
        ]
        for mask_type, given, effective, scale in cases:
            attn = SDPACoreAttention(cfg, 1, mask_type, "self", softmax_scale=scale)
            out = attn(q, k, v, given)
            ref = R.attention(q.double(), k.double(), v.double(), mask=effective,
                              scale=scale or 1 / math.sqrt(d), layout="sbhd")[0].flatten(2)
            dy = torch.randn(out.shape, generator=g, dtype=dtype)
            got = torch.autograd.grad(out, (q, k, v), dy)
            want = torch.autograd.grad(ref, (q, k, v), dy.double())
            # fp64: operation order only (1e-10). fp32: softmax over 6 keys and sums of 8-term
            # products round at ~1e-7 relative; 1e-5 (relative to the tensor's max) is 100x that.
            tol = 1e-10 if dtype == torch.float64 else 1e-5
            for a, w in zip((out, *got), (ref, *want)):
                w = w.double()
                torch.testing.assert_close(a.double(), w, rtol=tol, atol=tol * w.abs().max().item())
                errs.append((dtype, M.max_errors(a, w)[0]))
        if dtype == torch.float32:
            # Megatron's own (local) core attention, which on CPU needs an explicit mask.
            mcore = DotProductAttention(cfg, 1, AttnMaskType.causal, "self")
            ours = SDPACoreAttention(cfg, 1, AttnMaskType.causal, "self")
            mask = causal[None, None]
            torch.testing.assert_close(ours(q, k, v, mask), mcore(q, k, v, mask), rtol=1e-5, atol=1e-6)

    # Dropout: active in training, off in eval; the eval result is the dropout-free one.
    cfg = _cfg(attention_dropout=0.5)
    q = torch.randn(s, b, 4, 16, generator=g)
    attn = SDPACoreAttention(cfg, 1, AttnMaskType.causal, "self")
    plain = SDPACoreAttention(_cfg(), 1, AttnMaskType.causal, "self")
    assert not torch.allclose(attn.train()(q, q, q, None), plain(q, q, q, None))
    assert torch.equal(attn.eval()(q, q, q, None), plain.eval()(q, q, q, None))

    with pytest.raises(ValueError, match="sk != sq"):
        attn(q[:2], q, q, None)  # causal with a longer key sequence needs an explicit mask
    with pytest.raises(ValueError, match="--context-parallel-size"):
        SDPACoreAttention(_cfg(context_parallel_size=2), 1, AttnMaskType.causal, "self")
    return max(e for dt, e in errs if dt == torch.float32)


def test_core_attention(report):
    (err,) = run_ranks(1, _attention_checks)
    report(f"SDPACoreAttention fp32 vs fp64 reference: max abs err {err:.2e}")


def _same_as_megatron_local_spec():
    """TP = 1 without SP (the only setting Megatron's local spec runs in on CPU)."""
    from megatron.core.models.gpt import GPTModel
    from megatron.core.models.gpt.gpt_layer_specs import get_gpt_layer_local_spec

    M.setup(tp=1)
    for style in ("gpt", "llama"):
        ours = M.build("tp", style)
        cfg = ours.config
        stock = GPTModel(
            config=cfg,
            transformer_layer_spec=get_gpt_layer_local_spec(normalization=cfg.normalization),
            vocab_size=M.VOCAB,
            max_sequence_length=M.SEQ,
            position_embedding_type="rope" if style == "llama" else "learned_absolute",
        )
        M.copy_weights(ours, stock)  # asserts equal names and shapes
        assert set(ours.state_dict()) == set(stock.state_dict())
        assert set(ours.sharded_state_dict()) == set(stock.sharded_state_dict())
        b = M.batch()
        a = ours(b["tokens"], b["position_ids"], b["attention_mask"])
        e = stock(b["tokens"], b["position_ids"], b["attention_mask"])
        # fp32, same weights, different kernels (SDPA vs baddbmm + masked softmax): see
        # test_tp_baseline for the 1e-5 budget.
        torch.testing.assert_close(a, e, rtol=1e-5, atol=1e-5 * e.abs().max().item())
    return True


def test_tp_spec_matches_megatron_local_spec():
    assert all(run_ranks(1, _same_as_megatron_local_spec))


def _qk_layernorm_builds():
    M.setup(tp=1)
    model = M.build("tp", "llama", qk_layernorm=True)
    names = [n for n, _ in model.named_parameters()]
    assert "decoder.layers.0.self_attention.q_layernorm.weight" in names
    b = M.batch()
    out = model(b["tokens"], b["position_ids"], b["attention_mask"])
    assert torch.isfinite(out).all()
    return True


def test_qk_layernorm_spec_builds():
    assert all(run_ranks(1, _qk_layernorm_builds))


def test_spec_objects_and_errors():
    from megatron.core.transformer.attention import SelfAttention
    from megatron.core.transformer.mlp import MLP
    from megatron.core.transformer.spec_utils import ModuleSpec

    from megatron_metp import specs
    from megatron_metp.layers import SDPACoreAttention

    def parts(spec):
        sub = spec.submodules
        return sub.mlp.module, sub.self_attention.module, sub.self_attention.submodules.core_attention

    assert all(
        isinstance(getattr(specs, n), ModuleSpec)
        for n in ("tp_layer_spec", "metp_layer_spec", "metp_mlp_layer_spec", "wallfacer_layer_spec")
    )
    assert parts(specs.tp_layer_spec) == (MLP, SelfAttention, SDPACoreAttention)
    mlp, attn, core = parts(specs.metp_layer_spec)
    assert (mlp, attn, core) == (specs.METP_MLP, specs.METP_SELF_ATTENTION, SDPACoreAttention)
    mlp, attn, core = parts(specs.metp_mlp_layer_spec)
    assert (mlp, attn, core) == (specs.METP_MLP, SelfAttention, SDPACoreAttention)
    mlp, attn, core = parts(specs.wallfacer_layer_spec)
    # WallFacer: Megatron's SelfAttention subclassed only to check packed batches before its
    # THD RoPE (same parameters and checkpoint keys), WallFacer's core attention inside.
    assert (mlp, attn, core.module) == (MLP, specs.WALLFACER_SELF_ATTENTION,
                                        specs.WALLFACER_CORE_ATTENTION)
    from megatron_metp.wallfacer.core_attention import WallFacerSelfAttention

    assert issubclass(WallFacerSelfAttention, SelfAttention)
    with pytest.raises(ValueError, match="--tensor-parallel-mode"):
        specs.get_gpt_layer_spec("ulysses")
    missing = ModuleSpec(module=("megatron_metp.no_such_module", "Nothing"))
    with pytest.raises(ImportError, match="megatron_metp.no_such_module.Nothing"):
        specs.check_spec_importable(missing)


def test_chunked_rms_norm_equals_whole_tensor_fp64():
    """``layers.rms_norm`` runs in token chunks (4 of 1024 here) against the whole-tensor
    formula under autograd, fp64: per-token values are the same expression (agreement to
    ~1e-16 relative), only dw's sum over tokens is regrouped; 1e-12 leaves margin while a
    skipped or doubled chunk is an O(1) error."""
    from megatron_metp.layers import _token_chunks, rms_norm

    g = torch.Generator().manual_seed(0)
    x = torch.randn(4096, 1, 8, generator=g, dtype=torch.float64, requires_grad=True)
    w = torch.randn(8, generator=g, dtype=torch.float64, requires_grad=True)
    dy = torch.randn(4096, 1, 8, generator=g, dtype=torch.float64)
    assert len(_token_chunks(4096)) == 4
    y = rms_norm(x, w, 1e-5)
    dx, dw = torch.autograd.grad(y, (x, w), dy)
    xr, wr = x.detach().clone().requires_grad_(), w.detach().clone().requires_grad_()
    yr = xr * torch.rsqrt(xr.pow(2).mean(-1, keepdim=True) + 1e-5) * wr
    dxr, dwr = torch.autograd.grad(yr, (xr, wr), dy)
    for got, want in ((y, yr), (dx, dxr), (dw, dwr)):
        torch.testing.assert_close(got, want, rtol=1e-12, atol=1e-12)
