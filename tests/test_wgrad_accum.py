"""METP's weight gradients straight into ``main_grad`` (``metp.wgrad_accum``).

With ``--gradient-accumulation-fusion`` every METP pass adds its fp32 shard of a weight's
gradient into Megatron DDP's ``main_grad`` and hands autograd Megatron's placeholder, where it
cast the shard to a ``.grad`` that DDP's hook then added. In fp32 the cast is exact and
``0 + g`` is ``g``, so the two must agree bit for bit, for every pass and over accumulated
micro-batches; in bf16 the fused path must keep the fp32 shard that the cast rounds.
"""

import contextlib

import pytest
import torch

from tests import _models as M
from tests._harness import run_ranks

# (style, model overrides): the passes that end a weight's backward.
CASES = {
    # The whole pass over the all-to-all, the weights kept (layer_schedule's _LaterBox hands
    # the gradients over late; a large layer's first W_qkv in two parts, _join_parts), the
    # gathered MLP. GPT-style: fc1 and Q/K/V biases, a transposed W_proj / W_fc2 gradient.
    "gpt a2a kept gathered": ("gpt", dict(metp_ring_pass="a2a",
                                          metp_qkv_backward="save+fc1+weights",
                                          metp_mlp_pass="gathered")),
    # The same with Megatron-LM's default --bias-gelu-fusion: the fused GeLU has a backward of
    # its own, so a small layer keeps the activation's output too (gathered_mlp.keeps_act).
    "gpt a2a kept gathered fused-gelu": ("gpt", dict(metp_ring_pass="a2a",
                                                     metp_qkv_backward="save+fc1+weights",
                                                     metp_mlp_pass="gathered",
                                                     bias_activation_fusion=True)),
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


def _biased_pairs(model):
    """``(weight, bias)`` of every linear_qkv / linear_fc1 with a bias: those whose two
    gradients one add can take (``wgrad_accum.add_together``)."""
    return [(m.weight, m.bias) for n, m in model.named_modules()
            if n.endswith(("linear_qkv", "linear_fc1")) and getattr(m, "bias", None) is not None
            and m.bias.numel()]


@contextlib.contextmanager
def _counting_adds_together():
    """Record, for each time a pass asked whether one add takes several gradients
    (``wgrad_accum.spans_together``, behind ``add_together`` and ``_LaterBox``), whether it
    did."""
    from unittest import mock

    from megatron_metp.metp import layer_schedule, wgrad_accum

    real, hits = wgrad_accum.spans_together, []

    def counted(mines, weights, on):
        spans = real(mines, weights, on)
        hits.append(spans is not None)
        return spans

    with mock.patch.object(wgrad_accum, "spans_together", counted), \
            mock.patch.object(layer_schedule, "spans_together", counted):
        yield hits


def _fused_vs_cast(p, large):
    from megatron_metp.metp.wgrad_accum import _main_grads_in_order

    M.setup(tp=p, mode="metp")
    out = {}
    # Megatron DDP's own buffer (0.16 and 0.19: the parameters in reverse order) puts every
    # biased linear's bias right before its weight, so one add takes both; under the
    # distributed optimizer each parameter starts at a multiple of 64 values, so only a bias
    # of a multiple of 64 values is followed by its weight (the paper models' are: BERT-Large's
    # 384 and 512 at p = 8); this tiny model's are not, and nothing is merged there.
    for ddp_kw in ({}, dict(use_distributed_optimizer=True)):
        model = M.build("metp", "gpt", gradient_accumulation_fusion=True)
        M.wrap_ddp(model, **ddp_kw)
        pairs = _biased_pairs(model)
        assert pairs
        for w, b in pairs:
            together = not ddp_kw or b.numel() % 64 == 0
            assert (_main_grads_in_order([w, b], True) == [1, 0]) == together, ddp_kw
    for name, (style, overrides) in CASES.items():
        runs = {}
        for fuse in (False, True):
            model = M.build("metp", style, gradient_accumulation_fusion=fuse, **overrides)
            ddp = M.wrap_ddp(model)
            with M.large_layers(large), _counting_adds_together() as hits:
                first = M.step(ddp, M.batch(0))
            # The fused GPT runs took a biased linear's two gradients in one add: each of the
            # 2 layers' whole-pass W_qkv where it is one part (not a large first layer's two
            # parts, _join_parts) and, with the gathered MLP, each fc1. LLaMA has no biases,
            # and the cast runs add nothing.
            want = 0 if not (fuse and style == "gpt") else \
                2 if "ring-mlp" in name else 3 if large else 4
            assert sum(hits) == want, (name, hits)
            # A second micro-batch accumulated on top (no zero_grad_buffer in between).
            b = M.batch(1)
            with M.large_layers(large):
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


def _bf16_step(model, ddp_kw):
    """One bf16 step as Megatron-LM runs it (``metp train --bf16``'s path): Megatron's
    ``Float16Module`` around the bf16 model (inputs cast at the boundary, an fp32 loss), DDP
    with fp32 ``main_grad``. Returns the loss and every parameter's ``main_grad``."""
    from megatron.core.distributed import finalize_model_grads
    from megatron.core.transformer.module import Float16Module

    ddp = M.wrap_ddp(Float16Module(model.config, model), **(ddp_kw or {}))
    b = M.batch(0)
    ddp.zero_grad_buffer()
    logits = ddp(b["tokens"], b["position_ids"], b["attention_mask"])
    loss = model.compute_language_model_loss(
        b["labels"], logits.float().transpose(0, 1).contiguous()).mean()
    loss.backward()
    finalize_model_grads([ddp])
    return dict(loss=loss.item(), grads={n: prm.main_grad.detach().clone()
                                         for n, prm in model.named_parameters()})


def _variants(p, large):
    """The fused path where nothing hands gradients over late (no SublayerLink: the gathered
    MLP returns its gradients itself) and under ``--overlap-grad-reduce`` (DDP's hook then
    starts a bucket's reduction once its parameters' gradients arrive: the placeholder must
    arrive after the add), each against the cast path, fp32, bit for bit; and in bf16 (fp32
    main_grad, as Megatron-LM reduces bf16 gradients), where the cast path's gradients after
    one micro-batch are bf16 values and the fused path keeps the fp32 shard."""
    M.setup(tp=p, mode="metp")
    out = {}

    def run(fuse, ddp_kw=None, unlinked=False, case="gpt a2a kept gathered", **extra):
        style, overrides = CASES[case]
        model = M.build("metp", style, gradient_accumulation_fusion=fuse, **overrides,
                        **extra)
        with (M.unlinked() if unlinked else contextlib.nullcontext()), M.large_layers(large):
            if extra.get("bf16"):
                r = _bf16_step(model, ddp_kw)
            else:
                r = M.step(M.wrap_ddp(model, **(ddp_kw or {})), M.batch(0))
        r["weights"] = _metp_weights(model)
        r["flags"] = {n: prm.grad_added_to_main_grad for n, prm in model.named_parameters()}
        return r

    for name, kw in (("unlinked", dict(unlinked=True)),
                     ("overlap-grad-reduce", dict(ddp_kw=dict(overlap_grad_reduce=True,
                                                              bucket_size=4096)))):
        cast, fused = run(False, **kw), run(True, **kw)
        assert all(fused["flags"][n] for n in fused["weights"]), name
        assert cast["loss"] == fused["loss"], name
        for n, g in cast["grads"].items():
            assert torch.equal(g, fused["grads"][n]), (name, n)
        out[name] = fused["loss"]

    bf16 = dict(bf16=True, params_dtype=torch.bfloat16)
    ddp = dict(grad_reduce_in_fp32=True)
    out["bf16"] = 0
    # The gathered MLP and the MLP's weight ring (the whole pass with each).
    for case in ("gpt a2a kept gathered", "gpt whole ring-mlp"):
        cast, fused = run(False, ddp, case=case, **bf16), run(True, ddp, case=case, **bf16)
        for n in cast["weights"]:
            c, f = cast["grads"][n], fused["grads"][n]
            assert c.dtype == f.dtype == torch.float32, n
            # Cast path: 0 + a bf16 value, exactly a bf16 value. Fused: the fp32 shard itself,
            # whose elements are bf16 values with probability 2^-16 each (the test would fail
            # only if every element of a weight were: ~2^-512 for the smallest, a 32-element
            # bias).
            assert torch.equal(c, c.bfloat16().float()), (case, n)
            assert not torch.equal(f, f.bfloat16().float()), (case, n)
            # The same gradient either way, within the cast's rounding: bf16 keeps 8 bits, a
            # relative error of at most 2^-9 per element; the forward is the same arithmetic.
            assert torch.allclose(c, f, rtol=2 ** -8, atol=0), (case, n, (c - f).abs().max())
        out["bf16"] += len(cast["weights"])
    return out


@pytest.mark.parametrize("large", [False, True], ids=["small", "large"])
def test_fused_weight_gradients_unlinked_overlapped_and_bf16(large, report):
    res = run_ranks(2, _variants, 2, large)[0]
    report(f"--gradient-accumulation-fusion, METP p=2, {'large' if large else 'small'} layers' "
           "paths: == the cast path bit for bit without the "
           f"layer's link (loss {res['unlinked']:.6f}) and with --overlap-grad-reduce (loss "
           f"{res['overlap-grad-reduce']:.6f}), fp32; bf16 with fp32 main_grad: the "
           f"{res['bf16']} METP weights' fused gradients (gathered MLP and weight ring) keep fp32 "
           "bits the cast path rounds away, equal within bf16's rounding")


@pytest.mark.parametrize("p,large", [(2, False), (2, True)], ids=["2-small", "2-large"])
def test_fused_weight_gradients_equal_cast_ones(p, large, report):
    res = run_ranks(p, _fused_vs_cast, p, large)[0]
    report(f"--gradient-accumulation-fusion, METP p={p}, {'large' if large else 'small'} "
           "layers' paths, fp32: weight gradients added into "
           "main_grad == cast to .grad and added by DDP's hook, bit for bit, after one and two "
           "micro-batches: " + ", ".join(f"{k} (loss {v[0]:.6f}, {v[1]} weights)"
                                         for k, v in res.items()))


def test_one_add_takes_a_weight_and_its_bias_where_ddp_lays_them_out_together():
    """``shard_outs`` lays a weight's and its bias's reduce-scatter outputs out as DDP's buffer
    lays out their main_grads (bias, then weight, from the reverse parameter order), and
    ``add_together`` then adds both in one kernel: the same values as two adds. Where the
    main_grads are not one run (a bucket's padding between them, or each its own tensor) it
    lays out nothing and adds nothing."""
    from megatron_metp.metp.wgrad_accum import add_together, shard_outs, weight_grad

    g = torch.Generator().manual_seed(0)
    w = torch.nn.Parameter(torch.zeros(4, 6, dtype=torch.bfloat16))
    b = torch.nn.Parameter(torch.zeros(4, dtype=torch.bfloat16))
    p = 2
    full_w, full_b = torch.randn(8, 6, generator=g), torch.randn(8, generator=g)

    def ddp_like(gap):
        buf = torch.full((4 + gap + 24,), 0.25)
        b.main_grad, w.main_grad = buf[:4], buf[4 + gap:].view(4, 6)
        for prm in (w, b):
            prm.grad_added_to_main_grad = False
        return buf

    buf = ddp_like(0)
    outs = shard_outs([full_w, full_b], [w, b], p, on=True)
    assert outs[0].shape == w.shape and outs[1].shape == b.shape
    assert outs[1].data_ptr() + 4 * 4 == outs[0].data_ptr()   # bias, then weight, as DDP
    outs[0].copy_(full_w[:4])
    outs[1].copy_(full_b[:4])
    ops = []

    class Count(torch.utils._python_dispatch.TorchDispatchMode):
        def __torch_dispatch__(self, func, types, args=(), kwargs=None):
            ops.append(func)
            return func(*args, **(kwargs or {}))

    with Count():
        assert add_together(outs, [w.view_as(w), b.view_as(b)], on=True)
    assert ops.count(torch.ops.aten.add_.Tensor) == 1, ops
    assert torch.equal(w.main_grad, 0.25 + full_w[:4]) and torch.equal(b.main_grad,
                                                                        0.25 + full_b[:4])
    # The same as two adds, element for element.
    buf2 = ddp_like(0)
    weight_grad(outs[0], w, on=True)
    weight_grad(outs[1], b, on=True)
    assert torch.equal(buf, buf2)
    # Padding between them, each its own tensor, or the fusion off: nothing merged.
    ddp_like(64)
    assert shard_outs([full_w, full_b], [w, b], p, on=True) is None
    assert not add_together(outs, [w, b], on=True)
    w.main_grad, b.main_grad = torch.zeros(4, 6), torch.zeros(4)
    assert shard_outs([full_w, full_b], [w, b], p, on=True) is None
    ddp_like(0)
    assert shard_outs([full_w, full_b], [w, b], p, on=False) is None
    # Shards laid out apart (not by shard_outs) are added one by one by the caller.
    assert not add_together([full_w[:4].clone(), full_b[:4].clone()], [w, b], on=True)


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


def _reduce_dtypes_and_bytes(model, main_grad_fp32: bool, large: bool):
    """One bf16 micro-batch under Float16Module and DDP with ``main_grad`` in fp32 (Megatron's
    default) or bf16 (``--grad-reduce-in-bf16``). Returns the loss, every ``main_grad``, the
    dtypes of the backward's reductions (reduce-scatter, reduce, all-reduce) and the bytes its
    P2P sends moved."""
    import torch.distributed as dist
    from megatron.core.transformer.module import Float16Module

    ddp = M.wrap_ddp(Float16Module(model.config, model), grad_reduce_in_fp32=main_grad_fp32)
    b = M.batch(0)
    ddp.zero_grad_buffer()
    seen, sent = set(), [0]
    real = {k: getattr(dist, k) for k in ("reduce_scatter_tensor", "reduce", "all_reduce",
                                          "batch_isend_irecv")}

    def reduction(name):
        def call(*args, **kwargs):
            t = kwargs.get("input", args[1] if name == "reduce_scatter_tensor" else args[0])
            seen.add(t.dtype)
            return real[name](*args, **kwargs)
        return call

    def p2p(ops):
        sent[0] += sum(op.tensor.numel() * op.tensor.element_size() for op in ops
                       if op.op is dist.isend)
        return real["batch_isend_irecv"](ops)

    with M.large_layers(large):
        logits = ddp(b["tokens"], b["position_ids"], b["attention_mask"])
        loss = model.compute_language_model_loss(
            b["labels"], logits.float().transpose(0, 1).contiguous()).mean()
        for k in ("reduce_scatter_tensor", "reduce", "all_reduce"):
            setattr(dist, k, reduction(k))
        dist.batch_isend_irecv = p2p
        try:
            loss.backward()
        finally:
            for k, f in real.items():
                setattr(dist, k, f)
    return dict(loss=loss.item(), seen=seen, sent=sent[0],
                grads={n: prm.main_grad.detach().float().clone()
                       for n, prm in model.named_parameters()},
                weights=_metp_weights(model))


def _bf16_reduction(p, large):
    M.setup(tp=p, mode="metp")
    out = {}
    for name, (style, overrides) in CASES.items():
        runs = {}
        for fp32 in (True, False):
            model = M.build("metp", style, gradient_accumulation_fusion=True, bf16=True,
                            params_dtype=torch.bfloat16, **overrides)
            runs[fp32] = _reduce_dtypes_and_bytes(model, fp32, large)
        ref, lever = runs[True], runs[False]
        # The same bf16 forward, so the same loss bit for bit.
        assert ref["loss"] == lever["loss"], name
        # Default: METP reduces its weight gradients in fp32. --grad-reduce-in-bf16: every
        # reduction of the backward is bf16 (the whole pass's and the gathered MLP's
        # reduce-scatters, the head-group pass's reduces, DDP's own), and the MLP's weight
        # ring, whose gradient accumulators travel point to point, sends fewer bytes; the
        # other passes' P2P traffic (K/V rings) is the same.
        assert torch.float32 in ref["seen"], (name, ref["seen"])
        assert lever["seen"] <= {torch.bfloat16}, (name, lever["seen"])
        assert (lever["sent"] < ref["sent"]) if "ring-mlp" in name \
            else lever["sent"] == ref["sent"], (name, lever["sent"], ref["sent"])
        for n in lever["weights"]:
            g, r = lever["grads"][n], ref["grads"][n]
            # bf16 keeps 8 bits: each of the p = 2 partial sums and their sum rounds once
            # (2^-9 relative each), so the gradient's error is a few 2^-9 of the partials'
            # size; in norm, 2^-6 of the fp32-reduced gradient (itself within fp32 of TP's:
            # the test above and tests/test_metp_mlp.py against fp64) holds that with room,
            # and a lost or doubled contribution (an error near the gradient's own norm)
            # fails it.
            err = ((g - r).norm() / r.norm()).item()
            assert err <= 2 ** -6, (name, n, err)
        out[name] = (lever["sent"], ref["sent"])
    return out


def test_grad_reduce_in_bf16_reduces_metp_weight_gradients_in_bf16(report):
    """Megatron-LM's --grad-reduce-in-bf16 (DDP's ``main_grad`` in bf16): METP sums and reduces
    its weight gradients in bf16 as DDP's own buckets do (``wgrad_accum.reduce_dtype``), half
    the gradient bytes, within bf16's rounding of the fp32 reduction; every METP pass."""
    res = run_ranks(2, _bf16_reduction, 2, False)[0]
    report("--grad-reduce-in-bf16, METP p=2, bf16: weight gradients reduced in bf16 within "
           "2^-6 (norm) of the fp32 reduction; P2P bytes of the backward: " + ", ".join(
               f"{k} {a:,} vs {b:,}" for k, (a, b) in res.items()))
