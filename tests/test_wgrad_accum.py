"""METP's weight gradients straight into ``main_grad`` (``metp.wgrad_accum``).

With ``--gradient-accumulation-fusion`` every METP pass adds its fp32 shard of a weight's
gradient into Megatron DDP's ``main_grad`` and hands autograd Megatron's placeholder, where it
cast the shard to a ``.grad`` that DDP's hook then added. In fp32 the cast is exact and
``0 + g`` is ``g``, so the two must agree bit for bit, for every pass and over accumulated
micro-batches; in bf16 the fused path must keep the fp32 shard that the cast rounds.
"""

import pytest
import torch

from tests import _models as M
from tests._harness import run_ranks

# (style, model overrides): the passes that end a weight's backward.
CASES = {
    # The whole pass over the all-to-all, the weights kept (layer_schedule's _LaterBox hands
    # the gradients over late; the first layer's W_qkv in two parts, _join_parts), the
    # gathered MLP. GPT-style: fc1 and Q/K/V biases, a transposed W_proj / W_fc2 gradient.
    "gpt a2a kept gathered": ("gpt", dict(metp_ring_pass="a2a",
                                          metp_qkv_backward="save+fc1+weights",
                                          metp_mlp_pass="gathered")),
    # The whole pass over the K/V ring, without the link's late hand-over, the MLP's weight ring.
    "gpt whole ring-mlp": ("gpt", dict(metp_ring_pass="whole", metp_qkv_backward="recompute",
                                       metp_mlp_pass="ring")),
    # The head-group pass (ring reduces of each group's gradient), LLaMA-style (GQA, RoPE).
    "llama head-group gathered": ("llama", dict(num_attention_heads=8, num_query_groups=4,
                                                metp_ring_pass="head-group",
                                                metp_mlp_pass="gathered")),
}


def _metp_weights(model):
    """Names of the parameters whose gradients a METP pass makes: not the norms', the
    embedding's, nor W_proj's and fc2's biases (added to the output outside the passes, by
    Megatron's bias-dropout-add)."""
    return [n for n, _ in model.named_parameters()
            if n.endswith(("linear_qkv.weight", "linear_qkv.bias", "linear_proj.weight",
                           "linear_fc1.weight", "linear_fc1.bias", "linear_fc2.weight"))]


def _fused_vs_cast(p):
    M.setup(tp=p, mode="metp")
    out = {}
    for name, (style, overrides) in CASES.items():
        runs = {}
        for fuse in (False, True):
            model = M.build("metp", style, gradient_accumulation_fusion=fuse, **overrides)
            ddp = M.wrap_ddp(model)
            first = M.step(ddp, M.batch(0))
            # A second micro-batch accumulated on top (no zero_grad_buffer in between).
            b = M.batch(1)
            logits = ddp(b["tokens"], b["position_ids"], b["attention_mask"])
            loss = model.compute_language_model_loss(
                b["labels"], logits.transpose(0, 1).contiguous()).mean()
            loss.backward()
            flags = {n: prm.grad_added_to_main_grad for n, prm in model.named_parameters()}
            runs[fuse] = dict(first, acc={n: prm.main_grad.clone()
                                          for n, prm in model.named_parameters()},
                              flags=flags, weights=_metp_weights(model))
        cast, fused = runs[False], runs[True]
        # The fused path was taken for every METP weight, and only with the fusion on.
        assert fused["weights"] and all(fused["flags"][n] for n in fused["weights"]), name
        assert not any(cast["flags"][n] for n in cast["weights"]), name
        # fp32: the cast is exact and main_grad starts at zero, so the gradients agree bit for
        # bit after one micro-batch and after a second one accumulated on top.
        assert cast["loss"] == fused["loss"], name
        for key in ("grads", "acc"):
            for n, g in cast[key].items():
                assert torch.equal(g, fused[key][n]), (name, key, n)
        out[name] = (fused["loss"], len(fused["weights"]))
    return out


@pytest.mark.parametrize("p", [2])
def test_fused_weight_gradients_equal_cast_ones(p, report):
    res = run_ranks(p, _fused_vs_cast, p)[0]
    report(f"--gradient-accumulation-fusion, METP p={p}, fp32: weight gradients added into "
           "main_grad == cast to .grad and added by DDP's hook, bit for bit, after one and two "
           "micro-batches: " + ", ".join(f"{k} (loss {v[0]:.6f}, {v[1]} weights)"
                                         for k, v in res.items()))


def test_weight_grad_keeps_fp32_and_hands_megatrons_placeholder():
    """One weight, bf16, with DDP's fp32 main_grad: the fused path adds the fp32 shard itself
    (the cast path rounds it to bf16 first: 8 mantissa bits, an error of up to 2^-9 relative,
    which random values show), through a view as ``_GradsLater`` makes them, transposed too."""
    from megatron_metp.metp.wgrad_accum import weight_grad

    g = torch.Generator().manual_seed(0)
    prm = torch.nn.Parameter(torch.zeros(4, 6, dtype=torch.bfloat16))
    mine = torch.randn(6, 4, generator=g)           # fp32, as reduce-scattered, transposed
    prm.main_grad = torch.full((4, 6), 0.5)
    prm.grad_added_to_main_grad = False

    cast = weight_grad(mine, prm.view_as(prm), on=False, transpose=True)
    assert cast.dtype == torch.bfloat16 and cast.is_contiguous()
    assert torch.equal(cast, mine.t().to(torch.bfloat16))
    assert not torch.equal(cast.float(), mine.t())   # the rounding the fused path avoids

    got = weight_grad(mine, prm.view_as(prm), on=True, transpose=True)
    assert torch.equal(prm.main_grad, 0.5 + mine.t())   # exact in fp32
    assert prm.grad_added_to_main_grad
    assert got.shape == prm.shape and got.dtype == prm.dtype   # Megatron's placeholder

    prm.zero_out_wgrad = True   # Megatron's placeholder is zeros then
    assert torch.equal(weight_grad(mine, prm, on=True, transpose=True),
                       torch.zeros_like(prm))
    # Without DDP's flag there is no placeholder (Megatron's linears return None too).
    bare = torch.nn.Parameter(torch.zeros(3))
    bare.main_grad = torch.zeros(3)
    assert weight_grad(torch.ones(3), bare, on=True) is None
    assert torch.equal(bare.main_grad, torch.ones(3))
    # Without main_grad (no DDP) the fusion falls back to the cast.
    plain = torch.nn.Parameter(torch.zeros(3, dtype=torch.bfloat16))
    assert torch.equal(weight_grad(torch.ones(3), plain, on=True), torch.ones(3).bfloat16())
