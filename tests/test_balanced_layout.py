"""METP's balanced causal layout (``megatron_metp.token_layout``): rank r holds chunks r and
2p-1-r. The permutation and its block rule checked exhaustively on one process; ring attention in
that layout against single-process fp64 attention on 2, 4 and 8 ranks, with the kernel work of
every rank counted (it must be the same on every rank); the model level (permuted batch, RoPE,
sharded position table, losses back in sequence order) is ``tests/test_metp_model.py``.
"""

import pytest
import torch
import torch.distributed as dist

from megatron_metp import token_layout as TL
from megatron_metp.metp.ring_attention import ring_attention
from tests import _reference as R
from tests._harness import run_ranks


@pytest.mark.parametrize("p", [2, 3, 4, 8])
def test_pieces_cover_exactly_the_causal_pairs(p):
    # Every (query, key) pair with key <= query is covered by exactly one piece of exactly one
    # (query block, key block) pair, and nothing else is; every rank's work is 1/2 + (p-1)/2
    # blocks, and the inverse permutation restores the sequence.
    s = 2 * p * 3
    n = s // p
    order = TL.balanced_order(s, p)
    assert torch.equal(order[TL.balanced_inverse(s, p)], torch.arange(s))
    seen = torch.zeros(s, s, dtype=torch.int64)
    for qb in range(p):
        qpos = TL.balanced_positions(qb, p, n)
        assert qpos.tolist() == order[qb * n:(qb + 1) * n].tolist()
        work = 0.0
        for kb in range(p):
            kpos = TL.balanced_positions(kb, p, n)
            for qs, ks, causal in TL.BALANCED.block_pieces(qb, kb, n, True):
                qi, ki = qpos[qs], kpos[ks]
                vis = torch.ones(len(qi), len(ki), dtype=torch.int64)
                if causal:
                    vis = vis.tril()
                    # a causal piece is square and its positions increase along the block
                    assert torch.equal(qi, ki) and bool((qi[1:] > qi[:-1]).all())
                seen[qi[:, None], ki[None, :]] += vis
                work += len(qi) * len(ki) * (0.5 if causal else 1.0) / n ** 2
        assert work == pytest.approx(0.5 + (p - 1) / 2), (p, qb)
    assert torch.equal(seen, torch.ones(s, s, dtype=torch.int64).tril())
    assert TL.BALANCED.block_pieces(1, 0, n, False) == [(TL.ALL, TL.ALL, False)]


def test_can_balance_and_refusals():
    assert TL.can_balance(16, 4) and not TL.can_balance(12, 4) and not TL.can_balance(16, 1)
    with pytest.raises(ValueError, match="2 x 4 equal chunks"):
        TL.balanced_order(12, 4)
    with pytest.raises(ValueError, match="no two equal chunks"):
        TL.BALANCED.block_pieces(0, 1, 3)
    x = torch.arange(24).view(2, 12)
    assert torch.equal(TL.permute_sequence(TL.permute_sequence(x, 3), 3, inverse=True), x)


def _ring_balanced(cases):
    """Each rank: its two chunks of a full-sequence fp64 problem, ring attention in the balanced
    layout, its rows of out/dQ/dK/dV compared with the fp64 reference; returns the errors and the
    attention FLOPs this rank's kernels ran (counted at the kernel boundary)."""
    import megatron_metp.kernels as K

    rank, p = dist.get_rank(), dist.get_world_size()
    group = dist.new_group(list(range(p)))
    flops = {"fwd": 0.0, "bwd": 0.0}
    fwd, bwd = K.attention_forward, K.attention_backward
    K.attention_forward = _counter(fwd, flops, "fwd", 4)
    K.attention_backward = _counter(bwd, flops, "bwd", 10)
    errs = {}
    try:
        for dtype, n_kv in cases:
            b, n, s, d = 2, 4, 4 * p, 8   # two chunks of 2 tokens per rank
            g = torch.Generator().manual_seed(99)
            q = torch.randn(b, n, s, d, generator=g, dtype=torch.float64)
            k, v = (torch.randn(b, n_kv, s, d, generator=g, dtype=torch.float64) for _ in "kv")
            dout = torch.randn(b, n, s, d, generator=g, dtype=torch.float64)
            scale = d ** -0.5
            out64, _, dq64, dk64, dv64 = R.attention_grads(q, k, v, dout, scale=scale, causal=True)
            pos = TL.balanced_positions(rank, p, s // p)
            q_s, k_s, v_s = (t.index_select(2, pos).to(dtype).requires_grad_(True)
                             for t in (q, k, v))
            out = ring_attention(q_s, k_s, v_s, group, causal=True, softmax_scale=scale,
                                 layout=TL.BALANCED)
            out.backward(dout.index_select(2, pos).to(dtype))
            for name, got, ref in (("out", out, out64), ("dq", q_s.grad, dq64),
                                   ("dk", k_s.grad, dk64), ("dv", v_s.grad, dv64)):
                ref = ref.index_select(2, pos)
                # fp32 against fp64: the bound of tests/test_metp_ring_attention.py (rtol 1e-5,
                # atol 1e-5 * max|ref|; p - 1 fp32 merges add ~1e-7 each); fp64: 1e-10.
                tol = 1e-10 if dtype == torch.float64 else 1e-5
                torch.testing.assert_close(got.detach().double(), ref, rtol=tol,
                                           atol=tol * ref.abs().max().item(),
                                           msg=lambda m, name=name: f"{dtype} n_kv={n_kv} {name}: {m}")
                err = (got.detach().double() - ref).abs().max().item() / ref.abs().max().item()
                errs[name] = max(errs.get(name, 0.0), err)
    finally:
        K.attention_forward, K.attention_backward = fwd, bwd
    return errs, flops


def _counter(fn, flops, phase, per_pair):
    """Wrap a kernel-boundary call to add its FLOPs (``per_pair`` x b x heads x d per visible
    query-key pair: 4 forward, 10 backward, a causal square piece half its pairs)."""
    def wrapped(*args, **kw):
        q, k = args[:2] if phase == "fwd" else args[1:3]   # backward: (dout, q, k, v, ...)
        pairs = q.shape[2] * k.shape[2] * (0.5 if kw["causal"] else 1.0)
        flops[phase] += per_pair * q.shape[0] * q.shape[1] * q.shape[3] * pairs
        return fn(*args, **kw)
    return wrapped


# p = 8 (8 ranks on 2 cores, ~30 s) in the full tier; the default tier runs p = 2 and 4, and
# the model parity tests cover p = 8 there too.
@pytest.mark.parametrize("world", [2, 4, pytest.param(8, marks=pytest.mark.full)])
def test_balanced_ring_matches_fp64_and_every_rank_works_alike(world, report):
    cases = [(torch.float32, 4), (torch.float32, 2), (torch.float64, 1)]  # MHA, GQA, MQA
    results = run_ranks(world, _ring_balanced, cases)
    work = [r[1] for r in results]
    for phase in ("fwd", "bwd"):
        per_rank = [w[phase] for w in work]
        # The same kernel shapes on every rank: equal to the flop, not approximately.
        assert max(per_rank) == min(per_rank) > 0, (phase, per_rank)
    worst = {k: max(r[0][k] for r in results) for k in ("out", "dq", "dk", "dv")}
    report(f"balanced ring p={world} vs fp64 (x max|ref|, worst of MHA/GQA fp32, MQA fp64): "
           + ", ".join(f"{k} {v:.1e}" for k, v in worst.items())
           + f"; attention FLOPs per rank equal: fwd {work[0]['fwd']:.0f}, bwd {work[0]['bwd']:.0f}")
