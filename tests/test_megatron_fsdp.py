"""``--use-megatron-fsdp``: Megatron-Core's Megatron-FSDP on CPU.

The real ``metp train`` path trains twice from the same seed and data: once with Megatron's DDP
and plain optimizer (every rank holds the whole model, its gradients and its Adam moments), once
with Megatron-FSDP's ``optim_grads_params`` (parameters, gradients and optimizer state sharded
over the data-parallel x context-parallel ranks, each layer's parameters all-gathered before it
runs). Checked:

* the runs agree: losses, and every element of every parameter (each rank compares the shard it
  holds with the same slice of the DDP run's parameter);
* it really shards: summed over the ranks the parameter shards and the Adam moments each cover
  every parameter exactly once, the fp32 gradient shards at least once (with bucket padding),
  no rank holds much more than 1/d of any, and the bytes per rank equal the planner's
  per-parameter count over d (fp32 here);
* WallFacer (CP 4: d = 4 over its CP group) with the GPT-style tiny model (tied embeddings,
  learned positions, biases), and METP (TP 2 x DP 2: d = 2) with the LLaMA-style one.
"""

from __future__ import annotations

from typing import Dict

import pytest
import torch

from tests._harness import run_in_own_workers

BASE = ["--seq-length", "32", "--micro-batch-size", "2", "--global-batch-size", "4",
        "--hidden-dropout", "0", "--attention-dropout", "0", "--lr-warmup-iters", "1",
        "--train-iters", "6", "--no-progress"]
FSDP = ["--use-megatron-fsdp", "--data-parallel-sharding-strategy", "optim_grads_params"]
# The two runs differ in the gradient reduction only (an all-reduce of the whole buffer against
# a reduce-scatter into shards, gloo summing the same d addends in its own order) and in the
# weight gradient of the linears (Megatron-FSDP runs without gradient-accumulation fusion, so
# the GEMM's result is added to main_grad instead of accumulated into it). Each is an fp32 ulp
# or two per gradient element, which Adam's g / sqrt(v) turns into relative parameter changes
# of ~1e-7 per step, more where a gradient element is near Adam's eps. Measured after 6 steps:
# 1.3e-6 on parameters of 0.02-1, 4.8e-7 (one ulp) on losses of ~5-6; 1e-5 is 5x and more.
# A shard updated with another shard's gradient, a gradient not reduced over the whole CP
# group, or a stale all-gathered parameter moves a parameter by ~lr = 3e-3.
PARAM_TOL = 1e-5
LOSS_TOL = 1e-5


def _local(t: torch.Tensor) -> torch.Tensor:
    return t._local_tensor if hasattr(t, "_local_tensor") else t


def _shard_slices(p) -> tuple:
    """The slice of the full parameter that this rank's (uneven) DTensor shard holds."""
    from megatron.core.distributed.fsdp.src.megatron_fsdp.uneven_dtensor import (
        update_uneven_dtensor_chunk_metadata)

    # A collective over the mesh: every rank makes it for every parameter, in the same order
    # (a rank that skipped it where its metadata was already cached would pair its next
    # collective with another rank's one).
    update_uneven_dtensor_chunk_metadata(p)
    meta = p.__create_chunk_list__()[0]
    return tuple(slice(o, o + n) for o, n in zip(meta.offsets, p.to_local().shape))


def _tp_concat(t: torch.Tensor, param) -> torch.Tensor:
    import torch.distributed as dist
    from megatron.core import parallel_state as mpu

    tp = mpu.get_tensor_model_parallel_world_size()
    if tp == 1 or not getattr(param, "tensor_model_parallel", False):
        return t.clone()
    parts = [torch.empty_like(t) for _ in range(tp)]
    dist.all_gather(parts, t.contiguous(), group=mpu.get_tensor_model_parallel_group())
    return torch.cat(parts, dim=param.partition_dim)


def _capture(run) -> dict:
    """What this rank holds after a step (called while the groups are alive: the shards'
    offsets come from a collective over the mesh)."""
    inner = run.ddp.module
    model = getattr(inner, "module", inner)  # DDP -> GPTModel; adapter -> MegatronFSDP -> GPTModel
    chain = getattr(run.optimizer, "chained_optimizers", None) or [run.optimizer]
    moments = [_local(t) for o in chain for st in o.optimizer.state.values()  # DTensors
               for k, t in st.items() if k in ("exp_avg", "exp_avg_sq")]    # under FSDP
    out = dict(moment_elems=sum(t.numel() for t in moments) // 2,
               moment_bytes=sum(t.numel() * t.element_size() for t in moments))
    if not hasattr(run.ddp, "param_and_grad_buffer"):  # DDP
        # Megatron-FSDP's DTensors span the TP mesh dimension too: their global tensor is the
        # TP shards laid side by side along the partition dimension (no stride reordering), and
        # their shards' offsets index into that.
        out["params"] = {n: _tp_concat(p.detach(), p) for n, p in model.named_parameters()}
        out["n_params"] = sum(p.numel() for p in model.parameters())
        return out
    # Megatron-FSDP's state dict holds the sharded parameters (DTensors over the dp x cp mesh);
    # the module's own parameters are, between steps, the all-gathered copies for the next
    # forward (prefetched: this model is smaller than one bucket).
    from megatron.core.distributed.fsdp.src.megatron_fsdp.param_and_grad_buffer import (
        AllGatherPipeline)

    # cpu_compat item 9: on CPU the parameter all-gathers complete before the call returns.
    out["sync_gather"] = getattr(AllGatherPipeline.all_gather_params, "_metp_synchronous", False)
    sd = inner.state_dict()
    dts = {n: sd["module." + n if "module." + n in sd else n] for n, _ in model.named_parameters()}
    out["shards"] = {n: (_shard_slices(p), p.to_local().detach().clone()) for n, p in dts.items()}
    out["param_elems"] = sum(_local(p).numel() for p in dts.values())
    out["param_bytes"] = sum(_local(p).numel() * _local(p).element_size() for p in dts.values())
    buffers = {}
    for group in run.ddp.param_and_grad_buffer.parameter_groups:
        for name in ("main_weight_buffer", "main_grad_buffer"):
            buf = getattr(group, name, None)
            if buf is not None and getattr(buf, "data", None) is not None:
                buffers[name] = buffers.get(name, 0) + buf.data.numel() * buf.data.element_size()
    out["buffers"] = buffers
    return out


def _train(*argv) -> dict:
    from tests import _models as M

    losses, held = M.train_capturing(BASE, argv, _capture)
    return dict(held, losses=losses)


def _pairs(cases) -> Dict[str, dict]:
    out = {}
    for name, argv in cases:
        out[name] = {"ddp": _train(*argv), "fsdp": _train(*argv, *FSDP)}
    return out


# In the full tier (`bash scripts/run_tests.sh --full`) for time only (~40 s of 4 ranks; the
# default suite is over
# its 10 minutes). It was first set aside because a rank worker died in about 1 run of 30 (its
# peers seeing gloo's "Connection reset by peer"): glibc found the heap corrupted ("malloc():
# unaligned tcache chunk detected", SIGABRT) inside Megatron-FSDP's asynchronous coalesced
# parameter all-gather on gloo. cpu_compat item 9 now makes those gathers synchronous on CPU
# (see there for the mechanism); docs/results.md has the runs before and after (40 of 40 pass).
# The test runs in workers of its own (run_in_own_workers).
@pytest.mark.full
def test_megatron_fsdp_shards_and_matches_ddp(report):
    from megatron_metp.measure import planner

    cases = [("wallfacer", ["--tensor-parallel-mode", "wallfacer",
                            "--tensor-model-parallel-size", "4"]),
             ("metp", ["--config", "tiny-llama", "--tensor-parallel-mode", "metp",
                       "--tensor-model-parallel-size", "2"])]
    d_of = {"wallfacer": 4, "metp": 2}
    out = run_in_own_workers(4, _pairs, cases, timeout=500)
    lines = []
    for name, _ in cases:
        d = d_of[name]
        worst_loss = worst_param = 0.0
        for rank, r in enumerate(out):
            ddp, fsdp = r[name]["ddp"], r[name]["fsdp"]
            assert fsdp["sync_gather"], rank
            assert len(fsdp["losses"]) == len(ddp["losses"]) == 6
            worst_loss = max(worst_loss, max(abs(a - b) for a, b in
                                             zip(fsdp["losses"], ddp["losses"])))
            assert sorted(fsdp["shards"]) == sorted(ddp["params"]), rank
            for pname, (slices, shard) in fsdp["shards"].items():
                ref = ddp["params"][pname][slices]
                assert ref.shape == shard.shape, (rank, pname, ref.shape, shard.shape)
                if shard.numel():
                    worst_param = max(worst_param, (shard - ref).abs().max().item())
        assert worst_loss <= LOSS_TOL, (name, worst_loss)
        assert worst_param <= PARAM_TOL, (name, worst_param)

        # Sharding. A model-parallel group (TP 2 for METP) holds n_local of its own TP shards;
        # the d ranks that share them (data-parallel x context-parallel) split those n_local.
        ranks = [r[name] for r in out]
        n_local = ranks[0]["ddp"]["n_params"]
        groups = len(out) // d
        elems = [r["fsdp"]["param_elems"] for r in ranks]
        moments = [r["fsdp"]["moment_elems"] for r in ranks]
        assert sum(elems) == groups * n_local, (name, elems, n_local)  # each element once
        assert sum(moments) == groups * n_local, (name, moments, n_local)
        # Megatron-FSDP pads each bucket to a multiple of d (and of its alignment), so a rank
        # can hold a few hundred elements above n / d; 1 % of n (or 256 elements) bounds it.
        slack = max(256, n_local // 100)
        assert max(elems) <= n_local // d + slack, (name, elems)
        assert max(moments) <= n_local // d + slack, (name, moments)
        grads = [r["fsdp"]["buffers"]["main_grad_buffer"] for r in ranks]
        assert sum(grads) >= 4 * groups * n_local, (name, grads, n_local)
        assert max(grads) <= 4 * (n_local // d + slack), (name, grads)
        # Bytes per rank against the planner's 18 / d B per parameter, in its fp32 form here:
        # the parameter shard (4 B, bf16's 2 B on GPU) + fp32 main weight (4) + fp32 gradient
        # (4) + Adam moments (8) = 20 B over d.
        measured = max(r["fsdp"]["param_bytes"] + r["fsdp"]["buffers"].get("main_weight_buffer", 0)
                       + r["fsdp"]["buffers"]["main_grad_buffer"] + r["fsdp"]["moment_bytes"]
                       for r in ranks)
        planned = (planner.optimizer_bytes_per_param("wallfacer", d, False, megatron_fsdp=True)
                   + 2 / d) * n_local
        assert planner.optimizer_bytes_per_param("wallfacer", d, False,
                                                 megatron_fsdp=True) == 18 / d
        assert abs(measured - planned) / planned <= 0.05, (name, measured, planned)
        ddp_bytes = 4 * n_local + 4 * n_local + 8 * n_local  # param, fp32 grad, moments
        lines.append(f"{name} (d = {d}): max |loss diff| {worst_loss:.1e}, max |param diff| "
                     f"{worst_param:.1e}; per rank {measured / 2**10:.0f} KiB of parameters, "
                     f"master weights, gradients and Adam state (planned 20n/d = "
                     f"{planned / 2**10:.0f} KiB) against DDP's {ddp_bytes / 2**10:.0f} KiB")
    report("Megatron-FSDP optim_grads_params vs DDP + plain optimizer, 6 iterations (fp32, "
           "gloo): " + "; ".join(lines))
