"""A whole GPTModel with the ``metp`` spec (METP MLP + METP attention) against the same model
with the ``tp`` spec (Megatron's TP+SP), weights copied, dropout 0: logits, loss and every
parameter gradient after Megatron's DDP and finalize_model_grads. GPT-style (LayerNorm, GeLU,
biases, learned positions) and LLaMA-style (RMSNorm, SwiGLU, RoPE, GQA) on 2 and 4 ranks.
"""

import contextlib

import pytest
import torch

from tests import _models as M
from tests._harness import run_ranks

# fp32, same weights and inputs: the two models differ only in summation order (METP sums head
# groups and K/V blocks one by one, merges softmax blocks by their lse, and reduces weight
# gradients to their owner; TP reduce-scatters partial products). Each regrouping moves a result
# by a few fp32 ulps; over 2 layers, embedding and loss the measured error stays below ~1e-6 of
# each tensor's own scale. 1e-5 (rtol, and atol relative to max|ref|) leaves a 10x margin,
# while a wrong head group, shard, RoPE position or missing reduction gives O(1) errors.
RTOL = 1e-5
ATOL_SCALE = 1e-5


def _cases(p):
    # LLaMA-style needs query groups divisible by p under metp: 2 groups at p = 2, 4 at p = 4,
    # 8 at p = 8 (16 heads: still GQA, two query heads per group).
    if p == 8:
        return {"gpt": ("gpt", {"num_attention_heads": 8}),
                "llama": ("llama", {"num_attention_heads": 16, "num_query_groups": 8})}
    llama = {"num_query_groups": 2} if p == 2 else {"num_attention_heads": 8, "num_query_groups": 4}
    return {"gpt": ("gpt", {}), "llama": ("llama", llama)}


@contextlib.contextmanager
def _counting_a2a():
    """Count the whole pass's calls of the all-to-all attention (--metp-ring-pass a2a)."""
    from megatron_metp.metp import whole_pass

    calls, orig = [], whole_pass.a2a_attention_forward
    whole_pass.a2a_attention_forward = lambda *a, **k: calls.append(1) or orig(*a, **k)
    try:
        yield calls
    finally:
        whole_pass.a2a_attention_forward = orig


def _compare(p, ring_pass=None):
    from megatron_metp.metp.attention import MetpSelfAttention

    M.setup(tp=p, mode="metp")
    out = {}
    for case, (style, overrides) in _cases(p).items():
        tp_model = M.build("tp", style, **overrides)
        metp_model = M.build("metp", style, **overrides,
                             **({"metp_ring_pass": ring_pass} if ring_pass else {}))
        layers = metp_model.decoder.layers
        assert all(isinstance(layer.self_attention, MetpSelfAttention) for layer in layers)
        # The balanced causal layout is what runs here (rank r: chunks r and 2p-1-r).
        assert metp_model.uses_balanced_layout(M.SEQ)
        assert all(layer.self_attention.balanced_layout for layer in layers)
        assert type(layers[0].mlp).__name__ == "MetpMLP"
        # Checkpoints carry over: same parameter names/shapes and sharded_state_dict keys.
        assert sorted(tp_model.sharded_state_dict().keys()) == sorted(
            metp_model.sharded_state_dict().keys())
        # METP's position table holds this rank's rows only: copy through the full (TP = 1) state.
        M.load_full_state(metp_model, M.full_state(tp_model))
        if style == "gpt":  # the planner's count of the table on a rank = the real model's
            from types import SimpleNamespace

            from megatron_metp.measure.planner import position_table_params

            cfg = SimpleNamespace(position_embedding_type="learned_absolute",
                                  max_position_embeddings=M.SEQ, hidden_size=32)
            for mode, model in (("tp", tp_model), ("metp", metp_model)):
                table = model.embedding.position_embeddings.weight
                assert table.numel() == position_table_params(cfg, mode, p, M.SEQ), mode
            assert metp_model.embedding.position_embeddings.weight.shape[0] == M.SEQ // p
        b = M.batch()
        res = {}
        for mode, model in (("tp", tp_model), ("metp", metp_model)):
            with _counting_a2a() as a2a_calls:
                r = M.step(M.wrap_ddp(model), b)
            # --metp-ring-pass a2a: every layer's attention took the all-to-alls.
            assert len(a2a_calls) == (len(layers) if mode == "metp" and ring_pass == "a2a"
                                      else 0), (mode, ring_pass, a2a_calls)
            r["grads"] = M.full_grads(model, r["grads"])
            res[mode] = r
        ref, got = res["tp"], res["metp"]
        torch.testing.assert_close(torch.tensor(got["loss"]), torch.tensor(ref["loss"]),
                                   rtol=RTOL, atol=0.0)
        torch.testing.assert_close(got["logits"], ref["logits"], rtol=RTOL,
                                   atol=ATOL_SCALE * ref["logits"].abs().max().item())
        worst = M.assert_close_dict(got["grads"], ref["grads"], rtol=RTOL, atol_scale=ATOL_SCALE,
                                    what=f"{case} p={p}")
        assert all(torch.isfinite(g).all() for g in got["grads"].values())
        out[case] = (abs(got["loss"] - ref["loss"]),
                     M.max_errors(got["logits"], ref["logits"]), worst, len(got["grads"]))
    return out


# p = 8: the balanced layout's 16 chunks of the 16-token sequence, one token each;
# in the full tier for time (~34 s of 8 ranks on 2 cores; p = 2 and 4 are the same claim).
# "a2a": METP's attention with all-to-alls in place of its K/V ring (--metp-ring-pass a2a).
@pytest.mark.parametrize("world,ring_pass", [(2, None), (4, None), (4, "a2a"),
                                             pytest.param(8, None, marks=pytest.mark.full)])
def test_metp_model_equals_tp_model(world, ring_pass, report):
    results = run_ranks(world, _compare, world, ring_pass)
    for case, (dloss, (lmax, lmean), gmax, n) in results[0].items():
        report(f"metp model {case} p={world}{' a2a' if ring_pass else ''} vs tp: "
               f"|dloss|={dloss:.1e} logits max/mean err {lmax:.1e}/{lmean:.1e} max grad err "
               f"{gmax:.1e} over {n} params")


# ------------------------------------------------------------------------------------------
# Selective recompute: Megatron's own --recompute-granularity selective
# --recompute-modules layernorm frees each norm's output after its consumer has saved it and
# recomputes it in backward. METP's attention and MLP save the norm output tensor itself, so the
# same mechanism works for them: a layer keeps 3 bsh/p instead of 5 (tests/test_planner.py).


def _recompute_compare(p):
    M.setup(tp=p, mode="metp")
    out = {}
    for case, (style, overrides) in _cases(p).items():
        res = {}
        for mode in ("tp", "metp"):
            for rc in (False, True):
                extra = dict(recompute_granularity="selective",
                             recompute_modules=["layernorm"]) if rc else {}
                model = M.build(mode, style, **overrides, **extra)
                layer = model.decoder.layers[0]
                assert layer.recompute_input_layernorm == rc
                assert layer.recompute_pre_mlp_layernorm == rc
                r = M.step(M.wrap_ddp(model), M.batch())
                r["grads"] = M.full_grads(model, r["grads"])
                res[(mode, rc)] = r
        for mode in ("tp", "metp"):
            a, b = res[(mode, True)], res[(mode, False)]
            # The recomputed norm output is the same computation on the same input: identical
            # bits, so the loss and every gradient must be equal, not just close.
            assert a["loss"] == b["loss"], (case, mode)
            bad = [n for n in a["grads"] if not torch.equal(a["grads"][n], b["grads"][n])]
            assert not bad, (case, mode, bad)
        ref, got = res[("tp", True)], res[("metp", True)]
        M.assert_close_dict(got["grads"], ref["grads"], rtol=RTOL, atol_scale=ATOL_SCALE,
                            what=f"recompute {case} p={p}")
        out[case] = abs(got["loss"] - ref["loss"])
    return out


def test_layernorm_recompute_is_exact_for_metp_and_tp(report):
    for r in run_ranks(2, _recompute_compare, 2):
        for case, dloss in r.items():
            assert dloss < 1e-5
    report(f"selective layernorm recompute (p=2, gpt+llama): tp and metp bit-identical to no "
           f"recompute; metp vs tp |dloss| {max(r.values()):.1e}")


# ------------------------------------------------------------------------------------------
# Full recompute: --recompute-granularity full runs Megatron's own
# TransformerBlock._checkpointed_forward around METP's layers: only each chunk's input is kept,
# and the backward runs the layer's forward again, weight ring and K/V ring included. The
# recomputed forward is the same computation on the same inputs in the same order (CPU kernels
# are deterministic, dropout 0), so the loss and every gradient must equal the run without
# recompute bit for bit; the methods cover one layer per chunk, both layers in one chunk, and
# Megatron's block method with only the first layer checkpointed.
FULL_RECOMPUTE = {"uniform-1": ("uniform", 1), "uniform-2": ("uniform", 2), "block-1": ("block", 1)}


def _full_recompute_compare(p, ring_pass=None):
    M.setup(tp=p, mode="metp")
    out = {}
    for case, (style, overrides) in _cases(p).items():
        base = None
        for name, rc in [("none", None)] + list(FULL_RECOMPUTE.items()):
            extra = dict(recompute_granularity="full", recompute_method=rc[0],
                         recompute_num_layers=rc[1]) if rc else {}
            if ring_pass:
                extra["metp_ring_pass"] = ring_pass
            model = M.build("metp", style, **overrides, **extra)
            assert model.decoder.config.recompute_granularity == ("full" if rc else None)
            calls = []
            if rc:  # the checkpointed path is what runs: count Megatron's CheckpointFunction
                from megatron.core.tensor_parallel import random as mrandom

                orig = mrandom.CheckpointFunction.apply
                mrandom.CheckpointFunction.apply = lambda *a, _o=orig: calls.append(1) or _o(*a)
            try:
                with _counting_a2a() as a2a_calls:
                    r = M.step(M.wrap_ddp(model), M.batch())
            finally:
                if rc:
                    mrandom.CheckpointFunction.apply = orig
            # a2a: every layer's forward took the all-to-alls, and its recompute again.
            assert bool(a2a_calls) == (ring_pass == "a2a"), (name, a2a_calls)
            # uniform 1: one chunk per layer (2); uniform 2: one chunk; block 1: the first layer.
            assert len(calls) == {None: 0, ("uniform", 1): 2, ("uniform", 2): 1,
                                  ("block", 1): 1}[rc], (name, calls)
            r["grads"] = M.full_grads(model, r["grads"])
            if base is None:
                base = r
                continue
            assert r["loss"] == base["loss"], (case, name, r["loss"], base["loss"])
            bad = [n for n in r["grads"] if not torch.equal(r["grads"][n], base["grads"][n])]
            assert not bad, (case, name, bad)
            assert torch.equal(r["logits"], base["logits"]), (case, name)
        out[case] = (base["loss"], len(base["grads"]))
    return out


@pytest.mark.parametrize("world,ring_pass", [(2, None), (4, None), (2, "a2a")])
def test_metp_full_recompute_is_bit_identical(world, ring_pass, report):
    res = run_ranks(world, _full_recompute_compare, world, ring_pass)
    for case, (loss, n) in res[0].items():
        report(f"metp full recompute p={world}{' a2a' if ring_pass else ''} {case}: "
               f"{', '.join(FULL_RECOMPUTE)} equal the run without recompute bit for bit "
               f"(loss {loss:.6f}, {n} gradients)")


# ------------------------------------------------------------------------------------------
# The METP LM head inside the model: with labels, MetpGPTModel's loss is the
# ring cross entropy (no logits); it must equal GPTModel's TP+SP loss, per token, with every
# gradient, for tied and untied output weights.


def _loss_with_labels(p):
    from megatron.core.distributed import finalize_model_grads

    from megatron_metp.metp.gpt_model import MetpGPTModel

    M.setup(tp=p, mode="metp")
    out = {}
    for case, (style, overrides) in _cases(p).items():
        for tied in (True, False):
            res = {}
            for mode in ("tp", "metp"):
                from megatron_metp.model import build_gpt_model, make_config

                torch.manual_seed(1234)
                config = make_config(style=style, **{**dict(num_layers=2, hidden_size=32,
                                                            num_attention_heads=4), **overrides})
                model = build_gpt_model(
                    config, mode, vocab_size=M.VOCAB, max_sequence_length=M.SEQ,
                    position_embedding_type="rope" if style == "llama" else "learned_absolute",
                    share_embeddings_and_output_weights=tied)
                assert isinstance(model, MetpGPTModel) == (mode == "metp")
                ddp = M.wrap_ddp(model)
                b = M.batch()
                ddp.zero_grad_buffer()
                loss_bs = ddp(b["tokens"], b["position_ids"], b["attention_mask"],
                              labels=b["labels"])
                loss_bs.mean().backward()
                finalize_model_grads([ddp])
                res[mode] = (loss_bs.detach().clone(), M.full_grads(model, {
                    n: q.main_grad.detach().clone() for n, q in model.named_parameters()}))
            (l_tp, g_tp), (l_metp, g_metp) = res["tp"], res["metp"]
            assert l_metp.shape == l_tp.shape  # [b, s] per-token losses, as GPTModel's
            torch.testing.assert_close(l_metp, l_tp, rtol=RTOL, atol=0.0)
            M.assert_close_dict(g_metp, g_tp, rtol=RTOL, atol_scale=ATOL_SCALE,
                                what=f"head {case} tied={tied} p={p}")
            out[f"{case}/{'tied' if tied else 'untied'}"] = (l_metp - l_tp).abs().max().item()
    return out


@pytest.mark.parametrize("p", [2])  # p = 4: test_metp_cross_entropy against Megatron's CE
def test_metp_head_loss_equals_tp(p, report):
    worst = {}
    for r in run_ranks(p, _loss_with_labels, p):
        for k, v in r.items():
            worst[k] = max(worst.get(k, 0.0), v)
    report(f"MetpGPTModel ring-CE loss vs GPTModel TP+SP p={p}: max |dloss per token| "
           + ", ".join(f"{k} {v:.1e}" for k, v in worst.items()))


def _middle_stage_rotary():
    """A METP model stage that gets no tokens (Megatron-LM's middle pipeline stages): the
    rotary table its layers receive is in the balanced order, as on the first stage."""
    from megatron_metp.metp.gpt_model import MetpGPTModel
    from megatron_metp.model import make_config
    from megatron_metp.specs import get_gpt_layer_spec
    from megatron_metp.token_layout import permute_sequence

    M.setup(tp=2, mode="metp")
    config = make_config("llama", num_layers=1, hidden_size=32, num_attention_heads=4,
                         num_query_groups=2)
    model = MetpGPTModel(config=config, transformer_layer_spec=get_gpt_layer_spec("metp"),
                         vocab_size=M.VOCAB, max_sequence_length=M.SEQ, pre_process=False,
                         post_process=False, position_embedding_type="rope")
    seen = {}
    model.decoder.register_forward_pre_hook(
        lambda mod, args, kwargs: seen.update(rot=kwargs["rotary_pos_emb"]), with_kwargs=True)
    model.set_input_tensor(torch.randn(M.SEQ // 2, 1, 32))
    model(None, None, None)
    full = model.rotary_pos_emb(M.SEQ)
    assert model.balanced_layout
    assert torch.equal(seen["rot"], permute_sequence(full, 2, dim=0))
    return True


def test_middle_pipeline_stage_gets_the_balanced_rotary_table():
    assert all(run_ranks(2, _middle_stage_rotary))
