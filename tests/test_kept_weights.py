"""``--metp-qkv-backward save+fc1+weights``: the backward reuses the weights its forward gathered.

Keeping the gathered weights changes what the backward receives, and where W_qkv was gathered
in two parts (a large layer that no layer before posts it for: the first of a device, and
every one unlinked; a small one gathers it whole) how dX is summed: each part's GEMM is run on
the part as kept, so dX is two partial sums added where the regathered weight's one GEMM has
one sum. Everything else is the same
GEMMs on the same values. So the model must equal the ``save+fc1`` one bit for bit in its loss,
its logits and every gradient that no such dX reaches (gloo's reductions are deterministic),
and within a few fp32 roundings in the gradients that one does; and its step must post exactly
the backward's weight all-gathers fewer: per layer W_proj, W_qkv, fc1 and fc2 (``save+fc1``
gathers no bias in backward: Q/K/V and fc1's output are saved, the biases enter nothing the
backward recomputes).
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
    # With Megatron's q/k norm, whose gradient needs its input: the backward's third way to
    # dQ/dK/dV (the projection saved, the norm run again through autograd).
    "llama q/k norm": ("llama", {"num_attention_heads": 8, "num_query_groups": 4,
                                 "qk_layernorm": True}),
}


def _counting():
    """The project's ``CommCounter`` (a dispatch mode: every weight gather and gradient
    reduce-scatter of the whole pass and the gathered MLP is one call)."""
    from megatron_metp.measure.comm_counter import CommCounter

    return CommCounter()


@contextlib.contextmanager
def _deferred():
    """How many weight gradients the layer's box made after waiting for their reduce-scatters
    (``metp.layer_schedule``; for a ``_GradsLater`` node to hand autograd, when it runs or
    earlier at the attention's ``_LaterBox.drain``): ``[count]``."""
    from megatron_metp.metp import layer_schedule as L

    n, make = [0], L._LaterBox._make

    def rec(self, indices):
        n[0] += sum(i in self.pending for i in indices)
        return make(self, indices)

    L._LaterBox._make = rec
    try:
        yield n
    finally:
        L._LaterBox._make = make


@contextlib.contextmanager
def _joined():
    """How many ``linear_qkv`` gradients (weight or bias) were joined from their two parts'
    reduce-scatters (``whole_pass._join_parts``: W_qkv kept as its two gathered parts):
    ``[count]``."""
    from megatron_metp.metp import whole_pass as W

    n, join = [0], W._join_parts

    def rec(*a, **k):
        n[0] += 1
        return join(*a, **k)

    W._join_parts = rec
    try:
        yield n
    finally:
        W._join_parts = join


# A gradient reached by a dX summed from W_qkv's two parts (module docstring): that dX element
# takes one rounding more (the second partial sum added to the first), <= 1 ulp of it, which a
# LayerNorm's backward and the embedding's sum over tokens carry on as a few fp32 ulps: 1e-6
# relative to the gradient's largest element is ~8 ulps. Measured: <= 1.6e-7.
PARTED_DX_RTOL = 1e-6


def _assert_alike(kept: dict, saved: dict, parted: int, where) -> None:
    """``kept`` (``save+fc1+weights``) equals ``saved`` (``save+fc1``) as the module docstring
    says: loss, logits and every gradient that no parted layer's dX reaches bit for bit; those
    that one does (the last parted layer's input norm, every layer below it, the embedding),
    and each parted layer's own W_qkv gradient (its two GEMMs), within ``PARTED_DX_RTOL``. ``parted``: how many layers, the first ones, ran it."""
    assert kept["loss"] == saved["loss"], where
    if "logits" in saved:
        assert torch.equal(kept["logits"], saved["logits"]), where
    assert kept["grads"].keys() == saved["grads"].keys()
    reached = ("embedding.", f"decoder.layers.{parted - 1}.input_layernorm.") + tuple(
        f"decoder.layers.{i}." for i in range(parted - 1)) if parted else ()
    # A parted layer's W_qkv gradient is two GEMMs, one per kept part, over halves of its
    # output rows. A CPU BLAS may block a narrower GEMM's sum over tokens differently (oneDNN
    # on AVX-512 does), which reorders the fp32 additions: the same sum, rounded in another
    # order, within PARTED_DX_RTOL. Measured on such a CPU: <= 1.2e-7; bit-equal on others.
    reached += tuple(f"decoder.layers.{i}.self_attention.linear_qkv." for i in range(parted))
    exact = 0
    for name, g in saved["grads"].items():
        if name.startswith(reached):
            err = (kept["grads"][name] - g).abs().max() / g.abs().max()
            assert err <= PARTED_DX_RTOL, where + (name, err.item())
        else:
            assert torch.equal(kept["grads"][name], g), where + (name,)
            exact += 1
    assert exact > 0, where   # the layers above the last parted one, the head


def _regathered(model, p: int) -> int:
    """The bytes ``save+fc1``'s backward gathers again and ``save+fc1+weights`` keeps: every
    layer's whole W_proj, W_qkv, fc1 and fc2 (``p`` shards each)."""
    return sum(p * prm.numel() * prm.element_size() for name, prm in model.named_parameters()
               if name.endswith(("linear_proj.weight", "linear_qkv.weight",
                                 "linear_fc1.weight", "linear_fc2.weight")))


def _kept_vs_saved(p, large):
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
                    model = M.build("metp", style, **kw)
                    with M.large_layers(large), ctx, _counting() as c, _deferred() as later, \
                            _joined() as joined:
                        runs[qkv] = M.step(M.wrap_ddp(model), M.batch())
                    counts[qkv] = {op: c.stats[op].calls
                                   for op in ("all_gather", "reduce_scatter")}
                    counts[qkv].update({f"{op} bytes": c.stats[op].bytes
                                        for op in ("all_gather", "reduce_scatter")})
                    counts[qkv]["later"] = later[0]
                    counts[qkv]["joined"] = joined[0]
                kept, saved = runs["save+fc1+weights"], runs["save+fc1"]
                where = (case, ring_pass, linked)
                # The layers whose W_qkv was gathered in two parts (large layers only; a small
                # one gathers it whole): the first (linked; the second took its whole W_qkv
                # from the first's MLP) or both (unlinked). Each joins its weight's (and
                # bias's) two reduce-scattered parts.
                parted = (1 if linked else 2) if large else 0
                n_joined = parted * (2 if case == "gpt" else 1)
                assert (counts["save+fc1"]["joined"], counts["save+fc1+weights"]["joined"]) \
                    == (0, n_joined), counts
                _assert_alike(kept, saved, parted, where)
                # The 2 layers' W_proj, W_qkv, fc1 and fc2 are not gathered again (their
                # bytes: gathers coalesce, comm.call_groups, so calls do not say it); every
                # weight gradient still goes home, a parted layer's W_qkv (with its bias) in
                # two reduce-scatters, one call each.
                assert counts["save+fc1"]["all_gather bytes"] - \
                    counts["save+fc1+weights"]["all_gather bytes"] == _regathered(model, p), \
                    counts
                assert counts["save+fc1"]["all_gather"] > counts["save+fc1+weights"][
                    "all_gather"], counts
                assert counts["save+fc1"]["reduce_scatter bytes"] == \
                    counts["save+fc1+weights"]["reduce_scatter bytes"] > 0, counts
                # Small layers post each sublayer's gradients in one call, and, linked with
                # the weights kept, the second attention's in the first MLP's call.
                fewer = -parted if large else (1 if linked else 0)
                assert counts["save+fc1"]["reduce_scatter"] - fewer == \
                    counts["save+fc1+weights"]["reduce_scatter"], counts
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


def _with_overlapped_grad_reduce(p, large):
    """Megatron DDP's ``--overlap-grad-reduce`` starts a bucket's reduction from the gradient
    hooks, as each parameter's gradient reaches autograd: with the weights kept, the second
    layer's attention gradients reach it late (after the first layer's MLP backward,
    ``layer_schedule``). The model still equals ``save+fc1`` without the overlap (as the module
    docstring says)."""
    M.setup(tp=p, mode="metp")
    style, overrides = CASES["gpt"]
    runs = {}
    for qkv, overlap in (("save+fc1", False), ("save+fc1+weights", True)):
        kw = dict(overrides, metp_ring_pass="a2a", metp_qkv_backward=qkv,
                  metp_mlp_pass="gathered")
        with M.large_layers(large), _deferred() as later, _joined() as joined:
            runs[qkv] = M.step(M.wrap_ddp(M.build("metp", style, **kw),
                                          overlap_grad_reduce=overlap, bucket_size=4096),
                               M.batch())
        runs[qkv]["later"] = later[0]
        runs[qkv]["joined"] = joined[0]
    kept, saved = runs["save+fc1+weights"], runs["save+fc1"]
    assert kept["later"] == 9 and saved["later"] == 6, (kept["later"], saved["later"])
    # Large layers: the first layer's W_qkv (and bias) kept as its two gathered parts. Small
    # ones: whole, and the second attention's gradients posted in the first MLP's call.
    assert (kept["joined"], saved["joined"]) == ((2, 0) if large else (0, 0))
    _assert_alike(kept, saved, 1 if large else 0, "overlap")
    return kept["loss"], len(saved["grads"])


@pytest.mark.parametrize("large", [False, True], ids=["small", "large"])
def test_late_gradients_with_overlapped_grad_reduce(large, report):
    loss, n = run_ranks(2, _with_overlapped_grad_reduce, 2, large)[0]
    report(f"save+fc1+weights with --overlap-grad-reduce (buckets of 4096), p=2 GPT-style a2a, "
           f"{'large' if large else 'small'} layers' paths: == save+fc1 without it ({n} "
           f"gradients, loss {loss:.6f}; bit for bit"
           + (" but for the first layer's two-part dX)" if large else ")"))


def _under_full_recompute(p, large):
    """Megatron's full recompute runs each layer's forward without autograd, then again inside
    backward: the kept weights are those of the second forward, used by the backward right
    after it. Equal to ``save+fc1`` without recompute as the module docstring says (under
    recompute no layer hands the next its ``W_qkv``, so both are parted), and ``save+fc1``
    under recompute to itself without, bit for bit (the recomputed forward is the same
    arithmetic)."""
    M.setup(tp=p, mode="metp")
    style, overrides = CASES["llama"]
    runs, counts = {}, {}
    for qkv in ("save+fc1", "save+fc1+weights"):
        for rc in (False, True):
            extra = dict(recompute_granularity="full", recompute_method="uniform",
                         recompute_num_layers=1) if rc else {}
            kw = dict(overrides, metp_ring_pass="a2a", metp_qkv_backward=qkv,
                      metp_mlp_pass="gathered", **extra)
            model = M.build("metp", style, **kw)
            # large: a layer that gathers its own W_qkv gathers it in two parts; small: whole.
            with M.large_layers(large), _counting() as c, _joined() as joined:
                runs[qkv, rc] = M.step(M.wrap_ddp(model), M.batch())
            counts[qkv, rc] = c.stats["all_gather"].bytes
            runs[qkv, rc]["joined"] = joined[0]
    ref = runs["save+fc1", False]
    for key, r in runs.items():
        # The kept runs against save+fc1 (module docstring: their parted layers' dX; LLaMA-
        # style has no bias, so one join per such layer). Under recompute both layers gather
        # their own W_qkv (each forward runs inside its own checkpoint: no chain) ...
        assert r["joined"] == (0 if key[0] == "save+fc1" or not large
                               else 2 if key[1] else 1), key
        _assert_alike(r, ref, r["joined"], key)
    # ... and under recompute save+fc1 equals itself without, bit for bit.
    _assert_alike(runs["save+fc1", True], ref, 0, "save+fc1 recompute")
    # Under recompute as without it: the 2 layers' 4 weights are not gathered in backward.
    assert counts["save+fc1", True] - counts["save+fc1+weights", True] == \
        _regathered(model, p), counts
    return {f"{q} {'full recompute' if rc else 'no recompute'}": n
            for (q, rc), n in counts.items()}


@pytest.mark.full   # 10 s; the default tier has p = 2 without recompute
@pytest.mark.parametrize("large", [False, True], ids=["small", "large"])
def test_kept_weights_under_full_recompute(large, report):
    res = run_ranks(2, _under_full_recompute, 2, large)[0]
    report(f"save+fc1+weights under --recompute-granularity full (uniform 1), p=2, "
           f"{'large' if large else 'small'} layers' paths, LLaMA-style "
           "a2a: == save+fc1 (bit for bit but for the two-part dX of layers that gather their own "
           "W_qkv), save+fc1 == itself without recompute bit for bit; all-gathered bytes per step "
           + ", ".join(f"{k} {v}" for k, v in res.items()))


@pytest.mark.parametrize("p,large", [(2, False), (2, True),
                                     pytest.param(4, False, marks=pytest.mark.full),
                                     pytest.param(4, True, marks=pytest.mark.full)],
                         ids=["2-small", "2-large", "4-small", "4-large"])
def test_kept_weights_equal_regathered_ones(p, large, report):
    res = run_ranks(p, _kept_vs_saved, p, large)[0]
    report(f"save+fc1+weights p={p}, {'large' if large else 'small'} layers' paths: == "
           f"save+fc1 bit for bit (loss, logits, every gradient "
           f"no two-part dX or W_qkv GEMM reaches; those within {PARTED_DX_RTOL:g}), "
           "all-gathers per step save+fc1 -> save+fc1+weights: "
           + ", ".join(f"{k} {v[1]} -> {v[2]} (loss {v[0]:.6f}; gradients handed over "
                       f"late {v[3]} -> {v[4]})" for k, v in res.items()))
