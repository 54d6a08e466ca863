"""a2a context-parallel attention (``--cp-comm-type a2a``, the planner's stand-in for
Transformer Engine's): forward and dQ/dK/dV against single-process fp64 attention. Inside
Megatron's own ``SelfAttention`` (``layer_probe.A2A_PROBE``) the planner's fake-tensor memory of
the layer is checked against a real gloo run in tests/test_planner.py.

Every rank builds the same full q, k, v (seeded), computes the fp64 reference with plain
softmax attention and autograd, and compares its own shard of Megatron's CP layout (chunks r
and 2cp-1-r) with what the a2a attention computes in fp32 on the cp ranks.
"""

import pytest
import torch
import torch.distributed as dist

from megatron_metp.ulysses.attention import check_heads, ulysses_attention
from megatron_metp.wallfacer import zigzag
from tests import _reference as R
from tests._harness import run_ranks


def _compare(got, ref):
    """rtol=1e-5, atol=1e-5 * max|ref|: fp32 against fp64. An fp32 softmax attention and its
    gradient at these sizes (s <= 32, d = 8) are off by a few ulps of the largest entries
    (~1e-7 relative); a chunk put back in the wrong place, a head sent to the wrong rank or a
    wrong mask moves entries by O(|ref|), far beyond the bound."""
    ref = ref.float()
    torch.testing.assert_close(got, ref, rtol=1e-5, atol=1e-5 * ref.abs().max().item())
    return (got - ref).abs().max().item()


def _attention_vs_fp64(seq_per_rank=4, b=2, n=4, d=8):
    cp = dist.get_world_size()
    out = []
    for causal in (True, False):
        for n_kv in (n, n // 2 if (n // 2) % cp == 0 else n):
            c = R.sequence_case(seq_per_rank * cp, b, n, n_kv, d, 77 + n_kv + causal, causal)
            shard = lambda t: zigzag.shard_sequence(t, dist.get_rank(), cp)  # noqa: E731
            ql, kl, vl = (shard(c[x]).float().requires_grad_() for x in "qkv")
            o = ulysses_attention(ql, kl, vl, dist.group.WORLD, causal=causal,
                                  softmax_scale=d ** -0.5)
            o.backward(shard(c["dout"]).float())
            out.append((causal, n_kv, max(_compare(o.detach(), shard(c["out"])),
                                          _compare(ql.grad, shard(c["dq"])),
                                          _compare(kl.grad, shard(c["dk"])),
                                          _compare(vl.grad, shard(c["dv"])))))
    return out


# cp = 4 in the full tier (the default tier is <= 10 minutes on 2 cores): the same claim at a
# larger cp.
@pytest.mark.parametrize("cp", [2, pytest.param(4, marks=pytest.mark.full)])
def test_a2a_attention_matches_fp64(cp, report):
    per_rank = run_ranks(cp, _attention_vs_fp64)
    cases = {(c, nkv) for res in per_rank for c, nkv, _ in res}
    assert len(cases) == (4 if cp == 2 else 2)   # GQA n_kv = 2 splits over cp = 2 only
    worst = max(e for res in per_rank for *_, e in res)
    report(f"a2a attention cp={cp}: max|err| {worst:.2e} (out, dq, dk, dv vs fp64)")


def test_a2a_refuses_heads_it_cannot_split():
    with pytest.raises(ValueError, match="--cp-comm-type a2a splits the attention heads"):
        check_heads(8, 1, 2)   # LLaMA-70B's 8 query groups at TP 8: one K/V head per rank
    check_heads(8, 2, 2)
