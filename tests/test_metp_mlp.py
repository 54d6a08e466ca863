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
from megatron_metp.validation import MetpConfigError
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


def _config(p, *, gated, bias, dtype=torch.float32, hidden=H, ffn=FFN, **kw):
    from megatron_metp.model import make_config

    return make_config(
        "llama" if gated else "gpt",
        hidden_size=hidden,
        ffn_hidden_size=ffn,
        num_attention_heads=4,
        num_query_groups=4,
        add_bias_linear=bias,
        params_dtype=dtype,
        tensor_model_parallel_size=p,
        sequence_parallel=p > 1,
        **kw,
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


def _reference(t, gated, act):
    """out = f(x W1^T + b1) W2^T + b2 in fp64 autograd; returns out and grads by name."""
    leaves = {k: v.clone().requires_grad_(True) for k, v in t.items() if k != "g"}
    z = leaves["x"] @ leaves["linear_fc1.weight"].T
    if "linear_fc1.bias" in leaves:
        z = z + leaves["linear_fc1.bias"]
    if gated:
        gate, up = z.chunk(2, dim=-1)
        z = act(gate) * up
    else:
        z = act(z)
    out = z @ leaves["linear_fc2.weight"].T
    if "linear_fc2.bias" in leaves:
        out = out + leaves["linear_fc2.bias"]
    (out * t["g"]).sum().backward()
    return out.detach(), {k: v.grad for k, v in leaves.items()}


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


def _against_fp64(p):
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
                ref_out, ref_grads = _reference(tq, gated, act)
                mlp = _build(MetpMLP, _config(p, gated=gated, bias=bias, dtype=dtype))
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


@pytest.mark.parametrize("p", [1, 2, 4])
def test_metp_mlp_equals_fp64_reference(p, report):
    per_rank = run_ranks(p, _against_fp64, p)
    for dtype in ("float32", "float64"):
        rows = [e for errs in per_rank for e in errs if dtype in e[0]]
        mx = max(r[2] for r in rows)
        mean = sum(r[3] for r in rows) / len(rows)
        report(f"METP MLP vs fp64 reference, p={p}, {dtype} (GeLU/SwiGLU, +-bias, out and every "
               f"grad): max abs err {mx:.2e}, mean abs err {mean:.2e}")
