"""METP's LM-head cross entropy: vocabulary shards on the ring, logits chunked.

Against (1) a single-process fp64 reference (full logits, ``logsumexp - target``, autograd), and
(2) Megatron-Core's own TP path with the same weights: sequence all-gather, vocab-parallel
logits, ``tensor_parallel.vocab_parallel_cross_entropy``. Loss, input gradient and the weight
shard's gradient, on 1, 2 and 4 ranks, for several chunk sizes (one token, a size that leaves a
short last chunk, the default).
"""

import pytest
import torch
import torch.distributed as dist

from tests import _reference as R
from tests._harness import run_ranks

N_LOCAL, B, H, V_SHARD = 6, 2, 16, 24  # tokens per rank per sequence, batch, hidden, V/p


def _data(p: int, dtype):
    g = torch.Generator().manual_seed(7)
    x_full = torch.randn(N_LOCAL * p, B, H, generator=g, dtype=torch.float64)
    w_full = torch.randn(V_SHARD * p, H, generator=g, dtype=torch.float64) * 0.5
    labels = torch.randint(0, V_SHARD * p, (N_LOCAL * p, B), generator=g)
    grad = torch.rand(N_LOCAL * p, B, generator=g, dtype=torch.float64)
    return x_full.to(dtype), w_full.to(dtype), labels, grad


def _ranks_task(dtype, chunk):
    from megatron_metp.metp.cross_entropy import metp_cross_entropy

    p, r = dist.get_world_size(), dist.get_rank()
    group = dist.new_group(list(range(p)))
    x_full, w_full, labels, grad = _data(p, dtype)
    mine = slice(r * N_LOCAL, (r + 1) * N_LOCAL)
    x = x_full[mine].clone().requires_grad_()
    w = w_full[r * V_SHARD:(r + 1) * V_SHARD].clone().requires_grad_()
    loss = metp_cross_entropy(x, w, labels[mine], group, chunk_tokens=chunk)
    loss.backward(grad[mine].to(loss.dtype))
    ref_loss, ref_dx, ref_dw = R.vocab_cross_entropy(x_full, w_full, labels, grad)
    return dict(loss=(loss.detach().double(), ref_loss[mine]),
                dx=(x.grad.double(), ref_dx[mine]),
                dw=(w.grad.double(), ref_dw[r * V_SHARD:(r + 1) * V_SHARD]),
                dtype=str(loss.dtype))


# fp64: the same math in another order, ~1e-15 relative. fp32: logits and softmax in fp32 with
# sums over up to 96 vocabulary entries and 48 tokens: a few 1e-7 relative; 2e-5 of the
# tensor's scale leaves a wide margin while a wrong shard, label offset or missing ring step
# gives O(1) errors.
TOL = {torch.float64: 1e-12, torch.float32: 2e-5}


# Every ring length, both precisions, and each chunking (one token per chunk; a size that leaves
# a short last chunk; the default, one chunk here) at least once.
CASES = [(1, torch.float64, 5), (2, torch.float64, 1), (2, torch.float64, 5),
         (2, torch.float32, None), (4, torch.float64, 5), (4, torch.float32, None)]


@pytest.mark.parametrize("p,dtype,chunk", CASES,
                         ids=[f"p{p}-{str(d)[6:]}-chunk{c}" for p, d, c in CASES])
def test_metp_cross_entropy_equals_fp64(p, dtype, chunk, report):
    worst = 0.0
    for rank, out in enumerate(run_ranks(p, _ranks_task, dtype, chunk)):
        # Per-token loss in fp32 as Megatron's (fp64 data: fp64).
        assert out["dtype"] == str(torch.promote_types(dtype, torch.float32))
        for name in ("loss", "dx", "dw"):
            got, ref = out[name]
            scale = ref.abs().max().item()
            torch.testing.assert_close(got, ref, rtol=TOL[dtype], atol=TOL[dtype] * scale,
                                       msg=f"{name} rank {rank} p={p} {dtype} chunk={chunk}")
            worst = max(worst, (got - ref).abs().max().item() / scale)
    if chunk is None and dtype == torch.float32:
        report(f"METP cross entropy p={p} fp32 vs fp64 (loss, dx, dW): max rel err {worst:.1e}")


def _megatron_task():
    """Megatron's TP+SP head on the same weights: all-gather, logits, vocab-parallel CE."""
    from megatron.core import parallel_state as mpu
    from megatron.core import tensor_parallel

    from megatron_metp.metp.cross_entropy import metp_cross_entropy
    from megatron_metp.model import initialize_parallel

    initialize_parallel(tensor_model_parallel_size=dist.get_world_size(), mode="metp")
    p, r = mpu.get_tensor_model_parallel_world_size(), mpu.get_tensor_model_parallel_rank()
    x_full, w_full, labels, grad = _data(p, torch.float32)
    mine = slice(r * N_LOCAL, (r + 1) * N_LOCAL)
    w_shard = w_full[r * V_SHARD:(r + 1) * V_SHARD]
    out = {}
    for mode in ("tp", "metp"):
        x = x_full[mine].clone().requires_grad_()
        w = w_shard.clone().requires_grad_()
        if mode == "tp":
            x_all = tensor_parallel.gather_from_sequence_parallel_region(x)
            logits = torch.einsum("sbh,vh->sbv", x_all, w)
            loss_all = tensor_parallel.vocab_parallel_cross_entropy(logits, labels)
            loss_all.backward(grad.float())
            loss = loss_all[mine]
        else:
            loss = metp_cross_entropy(x, w, labels[mine], mpu.get_tensor_model_parallel_group())
            loss.backward(grad[mine].float())
        out[mode] = (loss.detach(), x.grad, w.grad)
    return out


@pytest.mark.parametrize("p", [2, 4])
def test_metp_cross_entropy_equals_megatron_vocab_parallel(p):
    for out in run_ranks(p, _megatron_task):
        for a, b in zip(out["metp"], out["tp"]):
            # fp32 both: same logits up to GEMM order, Megatron sums exp over shards by an
            # all-reduce, METP by logaddexp per shard: a few ulps of fp32.
            torch.testing.assert_close(a, b, rtol=2e-5, atol=2e-5 * b.abs().max().item())
