"""``--metp-qkv-backward save+fc1+weights``: the backward reuses the weights its forward gathered.

Keeping the gathered weights changes what the backward receives, never what it computes: the
same GEMMs on the same values (W_qkv is reassembled in Megatron's row order before dX, one copy
of the weight), so the model must equal the ``save+fc1`` one bit for bit (gloo's reductions are
deterministic), and its step must post exactly the backward's weight all-gathers fewer: per
layer W_proj, W_qkv, fc1 and fc2 (``save+fc1`` gathers no bias in backward: Q/K/V and fc1's
output are saved, the biases enter nothing the backward recomputes).
"""

import contextlib

import pytest
import torch

from tests import _models as M
from tests._harness import run_ranks

CASES = {
    # GPT-style: GeLU, fc1 and Q/K/V biases.
    "gpt": ("gpt", {}),
    # LLaMA-style: SwiGLU, RoPE, GQA, no biases.
    "llama": ("llama", {"num_attention_heads": 8, "num_query_groups": 4}),
}


def _counting():
    """The project's ``CommCounter`` (a dispatch mode: every weight gather and gradient
    reduce-scatter of the whole pass and the gathered MLP is one call)."""
    from megatron_metp.measure.comm_counter import CommCounter

    return CommCounter()


@contextlib.contextmanager
def _deferred():
    """How many weight gradients a ``_GradsLater`` node handed autograd after waiting for their
    reduce-scatters (``metp.layer_schedule``): ``[count]``."""
    from megatron_metp.metp import layer_schedule as L

    n, finish = [0], L._LaterBox.finish

    def rec(self, i, grad):
        n[0] += i in self.pending
        return finish(self, i, grad)

    L._LaterBox.finish = rec
    try:
        yield n
    finally:
        L._LaterBox.finish = finish


def _kept_vs_saved(p):
    M.setup(tp=p, mode="metp")
    out = {}
    for case, (style, overrides) in CASES.items():
        for ring_pass in ("whole", "a2a"):
            for linked in (True, False):
                runs, counts = {}, {}
                for qkv in ("save+fc1", "save+fc1+weights"):
                    kw = dict(overrides, metp_ring_pass=ring_pass, metp_qkv_backward=qkv,
                              metp_mlp_pass="gathered")
                    ctx = contextlib.nullcontext() if linked else M.unlinked()
                    with ctx, _counting() as c, _deferred() as later:
                        runs[qkv] = M.step(M.wrap_ddp(M.build("metp", style, **kw)), M.batch())
                    counts[qkv] = {op: c.stats[op].calls
                                   for op in ("all_gather", "reduce_scatter")}
                    counts[qkv]["later"] = later[0]
                kept, saved = runs["save+fc1+weights"], runs["save+fc1"]
                where = (case, ring_pass, linked)
                assert kept["loss"] == saved["loss"], where
                assert torch.equal(kept["logits"], saved["logits"]), where
                assert kept["grads"].keys() == saved["grads"].keys()
                for name, g in saved["grads"].items():
                    assert torch.equal(kept["grads"][name], g), where + (name,)
                # 2 layers x (W_proj, W_qkv, fc1, fc2) fewer all-gathers; the same
                # reduce-scatters (every weight gradient still goes home).
                assert counts["save+fc1"]["all_gather"] - \
                    counts["save+fc1+weights"]["all_gather"] == 2 * 4, counts
                assert counts["save+fc1"]["reduce_scatter"] == \
                    counts["save+fc1+weights"]["reduce_scatter"] > 0, counts
                # Gradients handed over late (layer_schedule): linked, each layer's MLP's (w_in,
                # [b_in,] w_out), and with the weights kept the second layer's attention's
                # (W_qkv, [b_qkv,] W_proj), waited for by the first layer after its MLP.
                n = 3 if case == "gpt" else 2
                assert counts["save+fc1"]["later"] == (2 * n if linked else 0), counts
                assert counts["save+fc1+weights"]["later"] == (3 * n if linked else 0), counts
                out[f"{case} {ring_pass} {'linked' if linked else 'unlinked'}"] = (
                    kept["loss"], counts["save+fc1"]["all_gather"],
                    counts["save+fc1+weights"]["all_gather"], counts["save+fc1"]["later"],
                    counts["save+fc1+weights"]["later"])
    return out


def _with_overlapped_grad_reduce(p):
    """Megatron DDP's ``--overlap-grad-reduce`` starts a bucket's reduction from the gradient
    hooks, as each parameter's gradient reaches autograd: with the weights kept, the second
    layer's attention gradients reach it late (after the first layer's MLP backward,
    ``layer_schedule``). The model still equals ``save+fc1`` without the overlap, bit for bit."""
    M.setup(tp=p, mode="metp")
    style, overrides = CASES["gpt"]
    runs = {}
    for qkv, overlap in (("save+fc1", False), ("save+fc1+weights", True)):
        kw = dict(overrides, metp_ring_pass="a2a", metp_qkv_backward=qkv,
                  metp_mlp_pass="gathered")
        with _deferred() as later:
            runs[qkv] = M.step(M.wrap_ddp(M.build("metp", style, **kw),
                                          overlap_grad_reduce=overlap, bucket_size=4096),
                               M.batch())
        runs[qkv]["later"] = later[0]
    kept, saved = runs["save+fc1+weights"], runs["save+fc1"]
    assert kept["later"] == 9 and saved["later"] == 6, (kept["later"], saved["later"])
    assert kept["loss"] == saved["loss"]
    for name, g in saved["grads"].items():
        assert torch.equal(kept["grads"][name], g), name
    return kept["loss"], len(saved["grads"])


def test_late_gradients_with_overlapped_grad_reduce_bit_for_bit(report):
    loss, n = run_ranks(2, _with_overlapped_grad_reduce, 2)[0]
    report(f"save+fc1+weights with --overlap-grad-reduce (buckets of 4096), p=2 GPT-style a2a: "
           f"== save+fc1 without it bit for bit ({n} gradients, loss {loss:.6f})")


def _under_full_recompute(p):
    """Megatron's full recompute runs each layer's forward without autograd, then again inside
    backward: the kept weights are those of the second forward, used by the backward right
    after it. Equal bit for bit to ``save+fc1`` under the same recompute, and to itself
    without recompute (the recomputed forward is the same arithmetic)."""
    M.setup(tp=p, mode="metp")
    style, overrides = CASES["llama"]
    runs, counts = {}, {}
    for qkv in ("save+fc1", "save+fc1+weights"):
        for rc in (False, True):
            extra = dict(recompute_granularity="full", recompute_method="uniform",
                         recompute_num_layers=1) if rc else {}
            kw = dict(overrides, metp_ring_pass="a2a", metp_qkv_backward=qkv,
                      metp_mlp_pass="gathered", **extra)
            with _counting() as c:
                runs[qkv, rc] = M.step(M.wrap_ddp(M.build("metp", style, **kw)), M.batch())
            counts[qkv, rc] = c.stats["all_gather"].calls
    ref = runs["save+fc1", False]
    for key, r in runs.items():
        assert r["loss"] == ref["loss"], key
        assert torch.equal(r["logits"], ref["logits"]), key
        for name, g in ref["grads"].items():
            assert torch.equal(r["grads"][name], g), key + (name,)
    # Under recompute as without it: 2 layers x 4 backward all-gathers fewer.
    assert counts["save+fc1", True] - counts["save+fc1+weights", True] == 8, counts
    return {f"{q} {'full recompute' if rc else 'no recompute'}": n
            for (q, rc), n in counts.items()}


@pytest.mark.full   # 10 s; the default tier has p = 2 without recompute
def test_kept_weights_under_full_recompute_bit_for_bit(report):
    res = run_ranks(2, _under_full_recompute, 2)[0]
    report("save+fc1+weights under --recompute-granularity full (uniform 1), p=2, LLaMA-style "
           "a2a: == save+fc1 and == no recompute bit for bit; all-gathers per step "
           + ", ".join(f"{k} {v}" for k, v in res.items()))


@pytest.mark.parametrize("p", [2, pytest.param(4, marks=pytest.mark.full)])
def test_kept_weights_equal_regathered_ones_bit_for_bit(p, report):
    res = run_ranks(p, _kept_vs_saved, p)[0]
    report(f"save+fc1+weights p={p}: == save+fc1 bit for bit (loss, logits, every gradient), "
           "all-gathers per step save+fc1 -> save+fc1+weights: "
           + ", ".join(f"{k} {v[1]} -> {v[2]} (loss {v[0]:.6f}; gradients handed over "
                       f"late {v[3]} -> {v[4]})" for k, v in res.items()))
