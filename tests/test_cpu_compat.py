"""Each CPU stand-in in ``megatron_metp.cpu_compat`` makes the Megatron-Core code it covers work.

Every check calls the Megatron function itself (not the stand-in) and compares its result with
an independent computation. End-to-end use (GPTModel, DDP, optimizer, dist-checkpointing) is in
tests/test_tp_baseline.py.
"""

import math

import pytest
import torch
import torch.distributed as dist

from tests import _models as M
from tests._harness import run_ranks


def _op_names_mode():
    """A TorchDispatchMode that records each dispatched op's name in ``names``."""
    from torch.utils._python_dispatch import TorchDispatchMode

    class OpNames(TorchDispatchMode):
        def __init__(self):
            super().__init__()
            self.names = []

        def __torch_dispatch__(self, func, types, args=(), kwargs=None):
            self.names.append(func.overloadpacket.__name__)
            return func(*args, **(kwargs or {}))

    return OpNames()


def _current_device_users():
    """Stand-in 1 (torch.cuda.current_device): SP mappings, GlobalMemoryBuffer, RoPE, DDP."""
    from megatron.core import parallel_state as mpu
    from megatron.core.models.common.embeddings.rotary_pos_embedding import RotaryEmbedding
    from megatron.core.tensor_parallel import (
        gather_from_sequence_parallel_region,
        reduce_scatter_to_sequence_parallel_region,
    )
    from megatron.core.utils import GlobalMemoryBuffer

    assert torch.cuda.current_device() == torch.device("cpu")
    M.setup(tp=2)
    rank = mpu.get_tensor_model_parallel_rank()

    # SP all-gather along the sequence (mappings._gather_along_first_dim) and its transpose.
    x_shard_s = torch.full((3, 2, 4), float(rank + 1), requires_grad=True)
    x_full = gather_from_sequence_parallel_region(x_shard_s)
    assert torch.equal(x_full, torch.cat([torch.full((3, 2, 4), 1.0), torch.full((3, 2, 4), 2.0)]))
    y_shard_s = reduce_scatter_to_sequence_parallel_region(x_full * (rank + 1))
    # Reduce-scatter: sum over ranks (1 + 2) x the block this rank owns.
    assert torch.equal(y_shard_s, torch.full((3, 2, 4), 3.0 * (rank + 1)))

    # GlobalMemoryBuffer.get_tensor (used by the SP all-gather with a global buffer).
    buf = GlobalMemoryBuffer().get_tensor((2, 3), torch.float32, "probe")
    assert buf.device.type == "cpu" and buf.shape == (2, 3)

    # RotaryEmbedding.get_emb moves inv_freq to the "current device".
    d, s = 8, 5
    emb = RotaryEmbedding(kv_channels=d, rotary_percent=1.0, use_cpu_initialization=True)(s)
    inv_freq = 1.0 / (10000 ** (torch.arange(0, d, 2, dtype=torch.float64) / d))
    freqs = torch.outer(torch.arange(s, dtype=torch.float64), inv_freq)
    expect = torch.cat([freqs, freqs], dim=-1)[:, None, None, :]
    torch.testing.assert_close(emb.double(), expect, rtol=1e-6, atol=1e-6)  # fp32 angles < 5 rad
    return True


def _ddp_data_parallel():
    """Stand-in 1 in DDP's grad buffers (param_and_grad_buffer): DP = 2 averages gradients."""
    from megatron.core.distributed import finalize_model_grads

    M.setup(tp=1)  # 2 ranks -> data-parallel size 2
    model = M.build("tp", "gpt", num_layers=1)
    plain = M.build("tp", "gpt", num_layers=1)  # same seed: same weights, no DDP
    ddp = M.wrap_ddp(model)
    b = M.batch(seed=dist.get_rank())  # each DP rank its own micro-batch
    ddp.zero_grad_buffer()
    token_losses = ddp(b["tokens"], b["position_ids"], b["attention_mask"], labels=b["labels"])
    token_losses.mean().backward()
    finalize_model_grads([ddp])
    loss = plain(b["tokens"], b["position_ids"], b["attention_mask"], labels=b["labels"]).mean()
    loss.backward()
    for (n, p), (_, q) in zip(model.named_parameters(), plain.named_parameters()):
        local = [torch.empty_like(q.grad) for _ in range(2)]
        dist.all_gather(local, q.grad)
        # DDP averages over data-parallel ranks (fp32 sum of 2 then scale: exact to ~1 ulp).
        torch.testing.assert_close(p.main_grad, (local[0] + local[1]) / 2, rtol=1e-6, atol=1e-7)
    return True


def _synchronize_users():
    """Stand-in 2 (torch.cuda.synchronize): dist-checkpointing's D2H preload."""
    from megatron.core.dist_checkpointing.strategies.filesystem_async import FileSystemWriterAsync

    assert torch.cuda.synchronize() is None
    t = torch.arange(6.0)
    bucket = ("file", "key", ([], [("item", t)]))
    # non_blocking=True is the path that ends in torch.cuda.synchronize().
    (out,) = FileSystemWriterAsync.preload_tensors([bucket], non_blocking=True)
    assert torch.equal(out[2][1][0][1], t)
    return True


def _rng_tracker():
    """Stand-in 3: Megatron's RNG tracker, seeding, fork and activation recomputation."""
    from megatron.core import parallel_state as mpu
    from megatron.core import tensor_parallel
    from megatron.core.tensor_parallel.random import model_parallel_cuda_manual_seed

    M.setup(tp=2, seed=77)
    tp_rank = mpu.get_tensor_model_parallel_rank()
    tracker = tensor_parallel.get_cuda_rng_tracker()
    assert set(tracker.get_states()) >= {"model-parallel-rng", "data-parallel-rng"}

    def draws(seed):
        model_parallel_cuda_manual_seed(seed)
        torch.manual_seed(seed)
        with tracker.fork():
            inside = torch.rand(4)
        after = torch.rand(4)
        return inside, after

    inside, after = draws(77)
    # Megatron's rule: the TP stream is seeded with seed + 2718 + tp_rank.
    assert torch.equal(inside, torch.rand(4, generator=torch.Generator().manual_seed(77 + 2718 + tp_rank)))
    # The fork leaves the default stream where it was.
    torch.manual_seed(77)
    assert torch.equal(after, torch.rand(4))
    # TP ranks draw different masks inside the fork, the same ones outside it.
    both = [torch.empty(4) for _ in range(2)], [torch.empty(4) for _ in range(2)]
    dist.all_gather(both[0], inside)
    dist.all_gather(both[1], after)
    assert not torch.equal(both[0][0], both[0][1]) and torch.equal(both[1][0], both[1][1])
    # Reproducible after re-seeding.
    assert torch.equal(draws(77)[0], inside)

    # Activation recomputation (CheckpointFunction) saves and restores the tracked states so the
    # recomputed dropout mask equals the forward one: gradients equal the non-recomputed ones.
    def block(x):
        with tracker.fork():
            return torch.nn.functional.dropout(x * 2, p=0.5, training=True).sum(dim=0)

    x = torch.randn(64, 8, requires_grad=True)
    model_parallel_cuda_manual_seed(5)
    y_ref = block(x)
    y_ref.square().sum().backward()
    g_ref, x.grad = x.grad, None
    model_parallel_cuda_manual_seed(5)
    y = tensor_parallel.checkpoint(block, False, x)
    torch.rand(3)  # move the default stream between forward and recomputation
    y.square().sum().backward()
    assert torch.equal(y, y_ref) and torch.equal(x.grad, g_ref)
    return True


def _device_literals():
    """Stand-ins 4-5: optimizer, grad norm / clipping / zero count, dist-ckpt plan check."""
    from megatron.core.dist_checkpointing.strategies.state_dict_saver import verify_global_md_reuse
    from megatron.core.optimizer import OptimizerConfig
    from megatron.core.optimizer.clip_grads import (
        clip_grad_by_total_norm_fp32,
        count_zeros_fp32,
        get_grad_norm_fp32,
    )
    from megatron.core.optimizer.optimizer import FP32Optimizer
    from torch.distributed.checkpoint.planner import SavePlan
    from torch.distributed.checkpoint.utils import _DistWrapper

    M.setup(tp=1)
    rank = dist.get_rank()
    world = dist.group.WORLD

    p = torch.nn.Parameter(torch.zeros(4))
    opt = FP32Optimizer(torch.optim.SGD([p], lr=0.1), OptimizerConfig(lr=0.1), None)
    assert opt.get_loss_scale().device.type == "cpu" and opt.get_loss_scale().item() == 1.0

    g = torch.tensor([3.0, 0.0, 4.0 * (rank + 1), 0.0])
    # get_grad_norm_fp32: L2 over ranks = sqrt(sum_r ||g_r||^2), and the inf-norm.
    expect = math.sqrt((9 + 16) + (9 + 64))
    assert get_grad_norm_fp32([g.clone()], grad_stats_parallel_group=world) == pytest.approx(expect, rel=1e-6)
    assert get_grad_norm_fp32([g.clone()], norm_type=math.inf, grad_stats_parallel_group=world) == 8.0

    params = [torch.nn.Parameter(torch.zeros(4)) for _ in range(2)]
    params[0].grad, params[1].grad = g.clone(), torch.ones(4)
    # count_zeros_fp32: zeros summed over ranks (2 per rank in params[0]).
    assert count_zeros_fp32(params, grad_stats_parallel_group=world) == 4
    # clip_grad_by_total_norm_fp32 scales by max_norm / (total + 1e-6) when that is below 1.
    clip_grad_by_total_norm_fp32(params, max_norm=1.0, total_norm=10.0)
    torch.testing.assert_close(params[1].grad, torch.full((4,), 1.0 / (10.0 + 1e-6)))
    clip_grad_by_total_norm_fp32(params, max_norm=100.0, total_norm=10.0)  # no-op above 1
    torch.testing.assert_close(params[1].grad, torch.full((4,), 1.0 / (10.0 + 1e-6)))

    # verify_global_md_reuse all-reduces (MIN) whether every rank's plan matches the stored one.
    wrapper = _DistWrapper(group=None, use_dist=True, coordinator_rank=0)
    same = SavePlan(items=[])
    assert verify_global_md_reuse([same, same], same, rank, wrapper) is True
    other = SavePlan(items=[], planner_data="changed")
    mine = other if rank == 1 else same
    assert verify_global_md_reuse([same, same], mine, rank, wrapper) is False
    return True


def _float16_optimizer():
    """Stand-in 4 in Float16OptimizerWithFloat16Params.__init__ (CUDA type-name dispatch)."""
    from megatron.core.optimizer import OptimizerConfig
    from megatron.core.optimizer.optimizer import Float16OptimizerWithFloat16Params

    g = torch.Generator().manual_seed(0)
    w0 = torch.randn(8, generator=g)
    p16 = torch.nn.Parameter(w0.to(torch.bfloat16))
    cfg = OptimizerConfig(optimizer="adam", lr=0.1, bf16=True, clip_grad=0.0)
    opt = Float16OptimizerWithFloat16Params(torch.optim.Adam([p16], lr=0.1), cfg, None, None)
    # The bf16 parameter got an fp32 main copy (the branch taken for 'torch.cuda.BFloat16Tensor').
    (main,) = opt.fp32_from_float16_groups[0]
    assert main.dtype == torch.float32 and torch.equal(main, p16.detach().float())
    ref = torch.nn.Parameter(p16.detach().float())
    ref_opt = torch.optim.Adam([ref], lr=0.1)
    for _ in range(2):
        grad = torch.randn(8, generator=g)
        p16.grad = grad.to(torch.bfloat16)
        ref.grad = grad.to(torch.bfloat16).float()
        ok, _, _ = opt.step()
        ref_opt.step()
        assert ok
        # The fp32 main weights follow plain fp32 Adam; the bf16 weights are their rounding.
        torch.testing.assert_close(main, ref.detach(), rtol=1e-6, atol=1e-7)
        assert torch.equal(p16.detach(), main.to(torch.bfloat16))
    return True


def _pipeline_losses_and_grads(pp: int, full=None, tied: bool = False):
    """Two micro-batches through Megatron's schedule for PP = ``pp`` (no pipelining at PP = 1).

    ``tied``: input and output embeddings share one weight; with PP = 2 the last stage holds a
    copy (``output_layer.weight``) that Megatron equalises at build time (the ``.cuda()`` of
    stand-in 4) and whose gradient it all-reduces with the first stage's."""

    from megatron.core import parallel_state as mpu
    from megatron.core.distributed import finalize_model_grads
    from megatron.core.pipeline_parallel import get_forward_backward_func

    M.setup(tp=1, pipeline_model_parallel_size=pp)
    model = M.build("tp", "gpt", num_layers=2, share_embeddings_and_output_weights=tied)
    # Stage s holds global layers s*L/pp ...: local "decoder.layers.i" is global i + offset.
    offset = mpu.get_pipeline_model_parallel_rank() * (2 // pp)
    built = {n: p.detach().clone() for n, p in model.named_parameters()}

    def global_name(n):
        if tied and n == "output_layer.weight":  # the last stage's copy of the tied weight
            return "embedding.word_embeddings.weight"
        if n.startswith("decoder.layers."):
            i, rest = n[len("decoder.layers."):].split(".", 1)
            return f"decoder.layers.{int(i) + offset}.{rest}"
        return n

    if full is not None:
        with torch.no_grad():
            for n, p in model.named_parameters():
                p.copy_(full[global_name(n)])
    ddp = M.wrap_ddp(model)

    def forward_step(data_iterator, model):
        b = next(data_iterator)
        out = model(b["tokens"], b["position_ids"], b["attention_mask"], labels=b["labels"])

        def loss_func(token_losses):
            loss = token_losses.float().mean()
            return loss, {"lm loss": loss.detach()}

        return out, loss_func

    ddp.zero_grad_buffer()
    losses = get_forward_backward_func()(
        forward_step_func=forward_step,
        data_iterator=iter([M.batch(seed=0), M.batch(seed=1)]),
        model=[ddp],
        num_microbatches=2,
        seq_length=M.SEQ,
        micro_batch_size=M.MICRO_BATCH,
    )
    finalize_model_grads([ddp])
    params = {global_name(n): p.detach().clone() for n, p in model.named_parameters()}
    grads = {global_name(n): p.main_grad.clone() for n, p in model.named_parameters()}
    return dict(params=params, grads=grads, losses=[l["lm loss"].item() for l in losses],
                built=built)


def test_pipeline_schedules():
    """Stand-ins 1, 2, 4 in the schedules and P2P: PP = 2 equals Megatron's no-pipelining run."""
    (ref,) = run_ranks(1, _pipeline_losses_and_grads, 1)
    stages = run_ranks(2, _pipeline_losses_and_grads, 2, ref["params"])
    assert stages[0]["losses"] == []  # only the last stage computes the loss
    # The stages send activations and gradients unchanged, so the same operations run in the
    # same order on the same values: equal to fp32 rounding (1e-6 relative is ~10 ulps).
    assert stages[1]["losses"] == pytest.approx(ref["losses"], rel=1e-6)
    got = {**stages[0]["grads"], **stages[1]["grads"]}
    M.assert_close_dict(got, ref["grads"], rtol=1e-6, atol_scale=1e-6, what="pp=2")


def test_pipeline_tied_embeddings():
    """Stand-in 4 in ``LanguageModule.setup_embeddings_and_output_layer``: with tied embeddings
    and PP = 2 the last stage's copy starts equal to the first stage's weight (it is built
    zero and all-reduced), and after the step both stages hold the PP = 1 gradient of the one
    weight (its two uses summed), to the same fp32 rounding as the untied test above."""
    (ref,) = run_ranks(1, _pipeline_losses_and_grads, 1, None, True)
    first, last = run_ranks(2, _pipeline_losses_and_grads, 2, None, True)
    # Megatron builds the copy as zeros; only the build-time all-reduce makes it equal.
    assert torch.equal(last["built"]["output_layer.weight"],
                       first["built"]["embedding.word_embeddings.weight"])
    stages = run_ranks(2, _pipeline_losses_and_grads, 2, ref["params"], True)
    assert stages[1]["losses"] == pytest.approx(ref["losses"], rel=1e-6)
    key = "embedding.word_embeddings.weight"
    for stage in stages:
        torch.testing.assert_close(stage["grads"][key], ref["grads"][key], rtol=1e-6, atol=1e-7)


def test_float16_optimizer():
    assert all(run_ranks(1, _float16_optimizer))


def test_current_device_users():
    assert all(run_ranks(2, _current_device_users))


def test_ddp_grad_buffers_data_parallel():
    assert all(run_ranks(2, _ddp_data_parallel))


def test_synchronize_users():
    assert all(run_ranks(1, _synchronize_users))


def test_rng_tracker():
    assert all(run_ranks(2, _rng_tracker))


def test_device_literals():
    assert all(run_ranks(2, _device_literals))


def _idempotent():
    from megatron.core.optimizer import clip_grads, optimizer

    from megatron_metp import cpu_compat

    before = (optimizer.FP32Optimizer.__init__, clip_grads.get_grad_norm_fp32, torch.cuda.current_device)
    cpu_compat.apply()
    cpu_compat._APPLIED = False  # force a second installation: nothing may be wrapped twice
    cpu_compat.apply()
    after = (optimizer.FP32Optimizer.__init__, clip_grads.get_grad_norm_fp32, torch.cuda.current_device)
    assert before == after
    return True


def test_apply_is_idempotent():
    assert all(run_ranks(1, _idempotent))


def _cp_rope_slicing():
    """Stand-in 6 (rope_utils.get_pos_emb_on_this_cp_rank): RotaryEmbedding with CP = 2."""
    from megatron.core import parallel_state as mpu
    from megatron.core.models.common.embeddings.rotary_pos_embedding import RotaryEmbedding

    M.setup(tp=1, context_parallel_size=2)
    cp_rank = mpu.get_context_parallel_rank()
    d, s = 8, 8
    rope = RotaryEmbedding(kv_channels=d, rotary_percent=1.0, use_cpu_initialization=True,
                           cp_group=mpu.get_context_parallel_group())
    emb = rope(s)
    # Megatron's CP layout: rank r keeps chunks r and 2P-1-r of 2P (here chunk size 2).
    inv_freq = 1.0 / (10000 ** (torch.arange(0, d, 2, dtype=torch.float64) / d))
    pos = torch.arange(s, dtype=torch.float64).view(4, 2)[[cp_rank, 3 - cp_rank]].reshape(-1)
    freqs = torch.outer(pos, inv_freq)
    expect = torch.cat([freqs, freqs], dim=-1)[:, None, None, :]
    torch.testing.assert_close(emb.double(), expect, rtol=1e-6, atol=1e-6)  # fp32 angles < 8 rad
    return True


def test_cp_rope_slicing():
    assert all(run_ranks(2, _cp_rope_slicing))


# ------------------------------------------------------------------------------------------
# Stand-in 6: Megatron-LM's default fusions on CPU (the stock tp baseline). Each twin is checked
# against an independent computation in fp64, value and gradient; the elementwise ones must be
# exact (same operations, only split into token chunks).


def test_fused_rope_twin_equals_unfused_rope():
    from megatron.core.models.common.embeddings import rope_utils

    from megatron_metp import cpu_compat

    cpu_compat.apply()
    assert rope_utils.fused_apply_rotary_pos_emb is cpu_compat.fused_apply_rotary_pos_emb_cpu
    torch.manual_seed(0)
    s, b, n, d = 12, 2, 3, 8
    t = torch.randn(s, b, n, d, dtype=torch.float64, requires_grad=True)
    freqs = torch.randn(s + 4, 1, 1, 6, dtype=torch.float64)  # partial rotary, longer table
    g = torch.randn(s, b, n, d, dtype=torch.float64)
    out = rope_utils.fused_apply_rotary_pos_emb(t, freqs)
    (dt,) = torch.autograd.grad(out, t, g)
    # Independent: rotate the first 6 channels by the angles, pass the rest through.
    f = freqs[:s]
    x1, x2, rest = t[..., :3], t[..., 3:6], t[..., 6:]
    ref = torch.cat((x1 * f[..., :3].cos() - x2 * f[..., :3].sin(),
                     x2 * f[..., 3:].cos() + x1 * f[..., 3:].sin(), rest), dim=-1)
    (dref,) = torch.autograd.grad(ref, t, g)
    # fp64, same operations in another order: rounding ~1e-16 relative; 1e-12 leaves margin.
    torch.testing.assert_close(out, ref, rtol=1e-12, atol=1e-12)
    torch.testing.assert_close(dt, dref, rtol=1e-12, atol=1e-12)


def test_fused_rope_twin_is_one_op_each_way_on_fake_tensors():
    """Under fake tensors (the planner and the timeline) Transformer Engine's fused RoPE is one
    op forward and one backward, as its kernel is one launch each way, with the real run's
    shapes and dtypes; the real run (token chunks of the same products) runs many ops."""
    from torch._subclasses.fake_tensor import FakeTensorMode

    from megatron_metp import cpu_compat

    cpu_compat.apply()

    def run():
        t = torch.randn(40, 2, 3, 8, dtype=torch.bfloat16, requires_grad=True)
        freqs = torch.randn(44, 1, 1, 8, dtype=torch.float32)
        with _op_names_mode() as names:
            out = cpu_compat.fused_apply_rotary_pos_emb_cpu(t, freqs)
            (dt,) = torch.autograd.grad(out, t, torch.ones_like(out))
        return out, dt, names.names

    real = run()
    with FakeTensorMode():
        fake = run()
    for r, k in zip(real[:2], fake[:2]):
        assert (k.shape, k.dtype) == (r.shape, r.dtype)
    assert fake[2].count("fused_rope") == 2, fake[2]  # one forward, one backward
    # nothing of the unfused chain (views and metadata queries launch no kernel)
    assert not {"cos", "sin", "mul", "neg", "cat", "add", "sub", "_to_copy"} & set(fake[2]), \
        fake[2]
    assert real[2].count("fused_rope") == 0 and real[2].count("cos") >= 2, real[2]


def test_wgrad_accumulation_twin():
    from megatron.core.tensor_parallel import layers

    from megatron_metp import cpu_compat

    cpu_compat.apply()
    assert layers._grad_accum_fusion_available
    torch.manual_seed(0)
    x, g = torch.randn(5, 2, 7, dtype=torch.float64), torch.randn(5, 2, 3, dtype=torch.float64)
    main_grad = torch.randn(3, 7, dtype=torch.float64)
    expect = main_grad + g.reshape(10, 3).t() @ x.reshape(10, 7)
    layers.fused_weight_gradient_mlp_cuda.wgrad_gemm_accum_fp32(x, g, main_grad)
    torch.testing.assert_close(main_grad, expect, rtol=1e-12, atol=1e-12)  # fp64 GEMM rounding


@pytest.mark.parametrize("kind", ["gelu", "swiglu"])
def test_fused_activations_in_chunks_are_exact(kind):
    from megatron.core.fusions import fused_bias_gelu, fused_bias_swiglu

    from megatron_metp import cpu_compat

    cpu_compat.apply()
    torch.manual_seed(0)
    s, f = 37, 10  # 37 tokens: the last of the 16 chunks is a short one
    y = torch.randn(s, 2, 2 * f if kind == "swiglu" else f, requires_grad=True)
    bias = torch.randn(y.shape[-1], requires_grad=True)
    g = torch.randn(s, 2, f)
    if kind == "gelu":
        out = fused_bias_gelu.bias_gelu_impl(y, bias)
        x = y + bias
        ref = x * 0.5 * (1.0 + torch.tanh(0.79788456 * x * (1 + 0.044715 * x * x)))
    else:
        out = fused_bias_swiglu.bias_swiglu_impl(y, bias)
        x1, x2 = torch.chunk(y + bias, 2, dim=-1)
        ref = torch.nn.functional.silu(x1) * x2
    grads = torch.autograd.grad(out, (y, bias), g)
    refs = torch.autograd.grad(ref, (y, bias), g)
    if kind == "gelu":  # the same elementwise operations per token: bit-identical
        assert torch.equal(out, ref)
    else:  # the kernel's sigmoid form of silu: fp32 rounding
        torch.testing.assert_close(out, ref, rtol=0, atol=1e-6)
    # Backward: Megatron's hand-written derivative vs autograd of the formula (fp32 rounding;
    # the bias gradient sums 74 terms).
    for a, r in zip(grads, refs):
        torch.testing.assert_close(a, r, rtol=1e-5, atol=1e-5)
    assert getattr(fused_bias_gelu.bias_gelu, "__metp_chunked__", False)


@pytest.mark.parametrize("kind", ["gelu", "swiglu"])
def test_fused_activations_are_one_op_each_way_on_fake_tensors(kind):
    """Under fake tensors (the planner and the timeline) each fused activation is one op forward
    and one backward, as the GPU's fused kernel is one launch, with the real run's output and
    gradient shapes and dtypes; the real run's chunks would trace 16 x the ops."""
    from torch._subclasses.fake_tensor import FakeTensorMode

    from megatron.core.fusions import fused_bias_gelu, fused_bias_swiglu

    from megatron_metp import cpu_compat

    cpu_compat.apply()

    def run():
        s, f = 37, 10
        y = torch.randn(s, 2, 2 * f if kind == "swiglu" else f, dtype=torch.bfloat16,
                        requires_grad=True)
        bias = torch.randn(y.shape[-1], dtype=torch.bfloat16, requires_grad=True)
        impl = fused_bias_gelu.bias_gelu_impl if kind == "gelu" else \
            fused_bias_swiglu.bias_swiglu_impl
        out = impl(y, bias)
        with _op_names_mode() as names:
            dy, db = torch.autograd.grad(out, (y, bias), torch.ones_like(out))
        return out, dy, db, names.names

    real = run()
    with FakeTensorMode():
        fake = run()
    for r, k in zip(real[:3], fake[:3]):
        assert (k.shape, k.dtype) == (r.shape, r.dtype)
    back = {"gelu": "bias_gelu_back", "swiglu": "bias_swiglu_back"}[kind]
    assert fake[3].count(back) == 1 and real[3].count(back) == 0  # the real run: chunked aten ops
    # Backward's ops besides the kernel: the bias gradient's sum and views ("device" is a fake
    # tensor's device query, not an op a GPU runs).
    assert [n for n in fake[3] if n not in ("device", "view", "ones_like")] == [back, "sum"]
    assert sum(n in ("mul", "sigmoid", "tanh") for n in real[3]) >= 16  # one+ per chunk
