"""``--metp-ring-pass a2a`` (``metp.a2a_attention``): METP's whole pass with all-to-alls in place
of its K/V ring, against the fp64 reference and against the ring itself with the same weights;
where it applies and where the ring stays."""

import pytest
import torch
import torch.distributed as dist

from tests import _reference as R
from tests._harness import run_ranks
from tests.test_metp_attention import B, S, _build, _cfg, _freqs, _run


def _comm_calls(rec):
    return [o.name for o in rec.ops if o.kind == "comm"]


def _a2a_cases(kinds, causal):
    from megatron_metp.measure.op_trace import OpRecorder
    from megatron_metp.metp import a2a_attention
    from megatron_metp.token_layout import chunks_of, permute_sequence
    from tests._models import gather_full, setup

    p = dist.get_world_size()
    setup(tp=p, mode="metp")
    r = dist.get_rank()
    n = S // p
    if causal:
        # The balanced layout MetpGPTModel hands over: rank r holds chunks r and 2p-1-r of 2p.
        mine = torch.cat([torch.arange(c * n // 2, (c + 1) * n // 2) for c in chunks_of(r, p)])
    else:
        mine = torch.arange(r * n, (r + 1) * n)
    out = {}
    for kind in kinds:
        config, rope = _cfg(p, kind)
        gen = torch.Generator().manual_seed(11)
        x = torch.randn(S, B, config.hidden_size, generator=gen)
        g = torch.randn(S, B, config.hidden_size, generator=gen)
        freqs = _freqs(config, rope)
        if causal and freqs is not None:
            freqs = permute_sequence(freqs, p, dim=0)   # the table in the tokens' order
        runs = {}
        for variant in ("whole", "a2a", "a2a-save", "a2a-save-ahead"):
            torch.manual_seed(5)
            attn = _build(config, "metp", causal=causal, ring_pass=variant.replace("-ahead", ""))
            attn.balanced_layout = causal
            with torch.no_grad():
                for prm in attn.parameters():
                    prm.add_(0.05 * torch.randn_like(prm))   # nonzero biases (same everywhere)
            # -ahead: the output sent to heads ahead of backward's GEMMs, as at long sequences
            # (a2a_attention.FUSE_OUT_MAX_VALUES; these shapes are below it).
            limit = a2a_attention.FUSE_OUT_MAX_VALUES
            a2a_attention.FUSE_OUT_MAX_VALUES = -1 if variant.endswith("-ahead") else limit
            try:
                with OpRecorder() as rec:
                    res = _run(attn, x[mine], g[mine], freqs)
            finally:
                a2a_attention.FUSE_OUT_MAX_VALUES = limit
            runs[variant] = (res, _comm_calls(rec), attn)
        # Saving the exchanged Q/K/V (a2a-save) and recomputing them (a2a) run the same kernel
        # on the same values: bit for bit (with a q/k norm the save path keeps the
        # projection, and the norm runs again through autograd: held to the bound below).
        bitwise = kind != "qkln"
        for other in ("a2a-save", "a2a-save-ahead") if bitwise else ():
            (o1, dx1, g1), (o2, dx2, g2) = runs["a2a"][0], runs[other][0]
            assert torch.equal(o1, o2) and torch.equal(dx1, dx2), (kind, other)
            assert all(torch.equal(g1[k], g2[k]) for k in g1), (kind, other)
        attn = runs["a2a"][2]
        full = {k: gather_full(prm.detach(), prm) for k, prm in attn.named_parameters()}
        ref_out, ref_dx, ref_dw = R.attention_sublayer(full, config, x, g, rope, causal=causal)
        errs = {}
        for variant in ("a2a", "a2a-save", "a2a-save-ahead"):
            (o, dx, grads), calls, mod = runs[variant]
            ring = runs["whole"][0]
            pairs = [("out", o, ref_out[mine], ring[0]), ("dx", dx, ref_dx[mine], ring[1])]
            for k, prm in mod.named_parameters():
                grad = grads[k].clone()
                if not getattr(prm, "tensor_model_parallel", False):
                    dist.all_reduce(grad)   # replicated: per-rank partial sums over tokens
                ring_grad = runs["whole"][0][2][k].clone()
                if not getattr(prm, "tensor_model_parallel", False):
                    dist.all_reduce(ring_grad)
                else:
                    grad, ring_grad = gather_full(grad, prm), gather_full(ring_grad, prm)
                pairs.append((f"d{k}", grad, ref_dw[k], ring_grad))
            for name, got, ref, by_ring in pairs:
                ref = (by_ring if kind == "qkln" else ref).double()
                # (The fp64 reference has no q/k norm: qkln is held to the ring, which
                # test_metp_attention holds to Megatron's TP module.)
                # fp32 against fp64: the bound of the ring's own tests (rtol 1e-5, atol 1e-5 x
                # max|ref|): one softmax over the whole sequence instead of p merged blocks, and
                # the weight gradients summed over p ranks, a few fp32 ulps each.
                torch.testing.assert_close(got.double(), ref, rtol=1e-5,
                                           atol=1e-5 * ref.abs().max().item(),
                                           msg=lambda m: f"{kind} {variant} {name}: {m}")
                errs[f"{variant} {name}"] = ((got.double() - ref).abs().max()
                                             / ref.abs().max()).item()
                # And against the ring's result (same weights): the same arithmetic up to
                # summation order, within the same bound.
                torch.testing.assert_close(got.double(), by_ring.double(), rtol=1e-5,
                                           atol=1e-5 * ref.abs().max().item())
        out[kind] = dict(errs=errs, calls={v: runs[v][1] for v in runs})
    return out


@pytest.mark.parametrize("world", [2, 4])
@pytest.mark.parametrize("causal", [True, False])
def test_a2a_matches_fp64_and_the_ring(world, causal, report):
    per_rank = run_ranks(world, _a2a_cases, ["mha", "gqa", "qkln"], causal)
    for res in per_rank:
        for kind, got in res.items():
            for variant in ("a2a", "a2a-save", "a2a-save-ahead"):
                calls = got["calls"][variant]
                # Recomputing Q/K/V (or saving them before a q/k norm): forward Q, K, V in, the
                # output and its lse back (5); backward dO, Q, K, V, O and the lse in, dQ, dK,
                # dV out (9). Saving them after RoPE (a2a-save, no q/k norm): the head-sharded
                # Q/K/V and lse are saved, so forward Q/K/V in (one exchange) and the output
                # back (2), backward O and dO in (one) and dQ/dK/dV out (one; 2); O sent ahead
                # (-ahead), O and dO in two (3).
                heads = variant != "a2a" and kind != "qkln"
                want = (4 if variant == "a2a-save" else 5) if heads else 14
                assert calls.count("all_to_all") == want, (kind, variant, calls)
                assert not any(c in ("send", "recv", "batch_isend_irecv") for c in calls), calls
            ring = got["calls"]["whole"]
            assert "all_to_all" not in ring and any(
                c in ("send", "recv", "batch_isend_irecv") for c in ring), ring
    worst = {}
    for res in per_rank:
        for kind, got in res.items():
            for key, v in got["errs"].items():
                worst[f"{kind} {key}"] = max(worst.get(f"{kind} {key}", 0.0), v)
    for key in sorted(worst):
        if key.endswith((" out", " dx", "dlinear_qkv.weight")):
            against = "the ring" if key.startswith("qkln") else "fp64"
            report(f"metp a2a p={world} causal={causal} {key} vs {against}: max "
                   f"{worst[key]:.1e} (x max|ref|)")


def _a2a_fallback():
    """--metp-ring-pass a2a on causal tokens not in the balanced layout (contiguous shards, as a
    packed batch's documents are not either): the whole pass keeps its K/V ring."""
    from megatron_metp.measure.op_trace import OpRecorder
    from tests._models import gather_full, setup

    p = dist.get_world_size()
    setup(tp=p, mode="metp")
    r = dist.get_rank()
    config, rope = _cfg(p, "gqa")
    gen = torch.Generator().manual_seed(11)
    x = torch.randn(S, B, config.hidden_size, generator=gen)
    g = torch.randn(S, B, config.hidden_size, generator=gen)
    torch.manual_seed(5)
    attn = _build(config, "metp", ring_pass="a2a")
    assert attn.ring_pass == "a2a" and not attn.balanced_layout
    sl = slice(r * S // p, (r + 1) * S // p)
    with OpRecorder() as rec:
        out, dx, _ = _run(attn, x[sl], g[sl], _freqs(config, rope))
    full = {k: gather_full(prm.detach(), prm) for k, prm in attn.named_parameters()}
    ref_out, ref_dx, _ = R.attention_sublayer(full, config, x, g, rope)
    for got, ref in ((out, ref_out[sl]), (dx, ref_dx[sl])):
        ref = ref.double()
        # fp32 against fp64, the bound above (rtol 1e-5, atol 1e-5 x max|ref|).
        torch.testing.assert_close(got.double(), ref, rtol=1e-5, atol=1e-5 * ref.abs().max().item())
    return _comm_calls(rec)


def test_a2a_keeps_the_ring_where_it_does_not_apply(report):
    for calls in run_ranks(2, _a2a_fallback):
        assert "all_to_all" not in calls and any(
            c in ("send", "recv", "batch_isend_irecv") for c in calls), calls
    report("metp a2a p=2, causal tokens in contiguous shards: the K/V ring ran, matches fp64")
