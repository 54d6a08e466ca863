"""A whole GPTModel with the ``wallfacer`` spec (CP = P, TP = 1; and TP = 2 x CP = 4) against
the ``tp`` model.

Inside one 4-rank task: the reference is the ``tp``-spec model at TP = CP = 1, run on the whole
sequence on every rank; then Megatron is re-initialised with CP = 4, the WallFacer groups are
built, the ``wallfacer``-spec model is built from the same seed (its weights are also copied
from the reference by name, so the comparison does not rely on initialisation), and every rank
runs its zigzag tokens. The loss is the global token mean (each rank sums its tokens' losses
over the global count), so summing the ranks' gradients over the CP group gives the full
gradient, which is what Megatron's DDP does over data x context ranks.
"""

import pytest
import torch
import torch.distributed as dist

from megatron_metp.wallfacer import zigzag
from tests import _models

P = 4
SEQ = 16


def _loss_sum(model, tokens, position_ids, labels):
    logits_bsv = model(tokens, position_ids, None)
    losses = model.compute_language_model_loss(labels, logits_bsv.transpose(0, 1).contiguous())
    return logits_bsv, losses.sum()


def _compare_models(style, team_size, placement, tp=1):
    from megatron.core import parallel_state as mpu

    from megatron_metp.model import destroy_parallel
    from megatron_metp.wallfacer.scheduler import initialize_wallfacer

    b = _models.batch(seed=3, s=SEQ)
    n_tokens = b["tokens"].numel()
    # Reference: tp spec, no model parallelism, whole sequence.
    _models.setup(tp=1)
    ref_model = _models.build("tp", style, max_sequence_length=SEQ)
    logits_ref, loss_ref = _loss_sum(ref_model, b["tokens"], b["position_ids"], b["labels"])
    (loss_ref / n_tokens).backward()
    ref_state = {n: p.detach().clone() for n, p in ref_model.named_parameters()}
    ref_grads = {n: p.grad.detach().clone() for n, p in ref_model.named_parameters()}
    logits_ref = logits_ref.detach()
    del ref_model
    destroy_parallel()

    # WallFacer: CP = world / tp (TP = 1: CP over all ranks), weights copied (TP-sharded).
    cp = dist.get_world_size() // tp
    _models.setup(tp=tp, context_parallel_size=cp)
    plan = initialize_wallfacer(team_size, placement)
    model = _models.build("wallfacer", style, max_sequence_length=SEQ, cp_comm_type="wallfacer")
    if tp == 1:
        names = {n: tuple(p.shape) for n, p in model.named_parameters()}
        assert names == {n: tuple(t.shape) for n, t in ref_state.items()}, "names/shapes"
    _models.load_full_state(model, ref_state)
    shard = lambda t: zigzag.shard_sequence(t, plan.idx, cp, dim=1)  # noqa: E731
    logits, loss_local = _loss_sum(model, shard(b["tokens"]), shard(b["position_ids"]),
                                   shard(b["labels"]))
    (loss_local / n_tokens).backward()
    cp_group = mpu.get_context_parallel_group()
    loss = loss_local.detach().clone()
    dist.all_reduce(loss, group=cp_group)
    grads = {}
    for n, p in model.named_parameters():
        g = p.grad.detach().clone()
        if tp > 1 and getattr(p, "sequence_parallel", False):
            # SP norms see only this TP rank's tokens (what finalize_model_grads all-reduces).
            dist.all_reduce(g, group=mpu.get_tensor_model_parallel_group())
        dist.all_reduce(g, group=cp_group)
        grads[n] = _models.gather_full(g, p)
    if tp > 1:
        from megatron.core.tensor_parallel import gather_from_tensor_model_parallel_region

        logits = gather_from_tensor_model_parallel_region(logits.detach())
    # fp32 vs fp32 with a different summation order (blockwise softmax merge, rank sums):
    # differences are a few ulps of each tensor's largest entries; rtol 1e-5 and atol
    # 1e-5 x max|ref| keep a margin of ~10x over what we measure while any wrong mask,
    # position or gradient route (errors ~|ref|) fails.
    torch.testing.assert_close(loss, loss_ref.detach(), rtol=1e-5, atol=0.0)
    ref_local = shard(logits_ref)
    torch.testing.assert_close(logits.detach(), ref_local, rtol=1e-5,
                               atol=1e-5 * ref_local.abs().max().item())
    worst = _models.assert_close_dict(grads, ref_grads, rtol=1e-5, atol_scale=1e-5,
                                      what=f"{style} C={team_size} {placement}")
    return dict(loss=loss.item() / n_tokens, loss_ref=loss_ref.item() / n_tokens,
                logits_err=_models.max_errors(logits.detach(), ref_local)[0], grad_err=worst)


@pytest.mark.parametrize("style,team_size,placement", [
    ("gpt", 2, "collective_intra"),
    ("llama", 2, "p2p_intra"),
])
def test_wallfacer_gpt_equals_tp(style, team_size, placement, report):
    res = _run(style, team_size, placement)
    r = res[0]
    report(f"wallfacer GPT ({style}, CP={P}, C={team_size}, {placement}) vs tp: loss "
           f"{r['loss']:.6f} vs {r['loss_ref']:.6f}; max|logit err| "
           f"{max(x['logits_err'] for x in res):.2e}; max|grad err| "
           f"{max(x['grad_err'] for x in res):.2e}")


def _run(style, team_size, placement, tp=1, world=P):
    from tests._harness import run_ranks

    return run_ranks(world, _compare_models, style, team_size, placement, tp,
                     timeout=600)


def test_wallfacer_composes_with_tensor_parallelism(report):
    """8 ranks: TP = 2 (+SP) x CP = 4 with C = 2, LLaMA-style (GQA, RoPE) against tp."""
    res = _run("llama", 2, "collective_intra", tp=2, world=8)
    r = res[0]
    report(f"wallfacer GPT (llama, TP=2+SP x CP=4, C=2) vs tp: loss {r['loss']:.6f} vs "
           f"{r['loss_ref']:.6f}; max|logit err| {max(x['logits_err'] for x in res):.2e}; "
           f"max|grad err| {max(x['grad_err'] for x in res):.2e}")
