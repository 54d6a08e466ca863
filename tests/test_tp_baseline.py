"""The ``tp`` baseline on CPU/gloo: Megatron-Core's GPTModel with TP + sequence parallelism.

What is shown, for a GPT-style (LayerNorm, GeLU, biases, learned positions) and a LLaMA-style
(RMSNorm, SwiGLU, RoPE, GQA with 2 query groups) config:

* forward, backward, Megatron's DDP + finalize_model_grads and an Adam step through
  ``get_megatron_optimizer`` (with grad clipping) run on 1 rank (TP = 1) and 2 ranks (TP = 2 + SP);
* the initial TP = 2 shards are exactly slices of the TP = 1 weights (use_cpu_initialization);
* TP = 2 + SP equals TP = 1: logits, loss, every parameter gradient (gathered), the gradient
  norm and the loss after one optimizer step;
* a dist-checkpoint saved by TP = 2 loads back into TP = 2 and into TP = 1, bit-identical.
"""

import pytest
import torch

from tests import _models as M
from tests import _reference as R
from tests._harness import run_ranks

STYLES = ("gpt", "llama")
# The numerics cases: the two styles, plus multi-query attention (1 query group < TP = 2), which
# the tp mode allows (Megatron replicates the K/V head on both TP ranks).
CASES = {"gpt": ("gpt", {}), "llama": ("llama", {}), "llama_mqa": ("llama", {"num_query_groups": 1})}

# Tolerance for TP = 2 + SP vs TP = 1 in fp32. The two runs use identical weights and inputs and
# differ only in how sums are split: RowParallelLinear and the vocab-parallel softmax sum partial
# results from 2 ranks, and the SP all-reduce of the norm gradients adds 2 partial sums. Each
# such regrouping changes a result by a few fp32 ulps (2^-24 ~ 6e-8 relative) per summation
# level; over 2 layers plus embedding and loss we measured max errors below 1e-6 relative to
# each tensor's own scale. 1e-5 (rtol and atol relative to max|ref|) keeps a 10x margin, while a
# wrong shard, a missing reduction or a mis-ordered SwiGLU half gives O(1) relative errors.
RTOL = 1e-5
ATOL_SCALE = 1e-5


def _run_tp(tp: int, ref=None):
    """One training step per case at TP = ``tp``; gathers everything to full (TP = 1) shapes."""
    import megatron.core.parallel_state as mpu

    M.setup(tp=tp)
    out = {}
    for case, (style, overrides) in CASES.items():
        model = M.build("tp", style, **overrides)
        cfg = model.config
        assert cfg.sequence_parallel == (tp > 1)
        assert mpu.get_tensor_model_parallel_world_size() == tp
        init = M.full_state(model)
        if ref is not None:
            # Initial weights do not depend on the TP size: every shard is the slice of the
            # TP = 1 weight that Megatron's layout assigns to this rank.
            for n, p in model.named_parameters():
                assert torch.equal(p.detach(), M.shard_like(ref[case]["init"][n], p)), n
        # Norm parameters carry the tag Megatron uses to all-reduce SP partial gradients.
        norms = [p for n, p in model.named_parameters() if "layernorm" in n]
        assert norms and all(getattr(p, "sequence_parallel", None) == (tp > 1) for p in norms)

        ddp = M.wrap_ddp(model)
        opt = M.optimizer(ddp, lr=1e-3, clip_grad=1.0)
        b = M.batch()
        r = M.step(ddp, b)
        grads = {n: M.gather_full(r["grads"][n], p) for n, p in model.named_parameters()}
        ok, grad_norm, _ = opt.step()
        assert ok
        after = M.step(ddp, b, gather_logits=False)
        out[case] = dict(
            init=init if ref is None else None,
            loss=r["loss"],
            logits=r["logits"],
            grads=grads,
            grad_norm=grad_norm,
            loss_after=after["loss"],
            finite=all(torch.isfinite(g).all().item() for g in grads.values()),
        )
    return out


@pytest.fixture(scope="module")
def tp1_reference():
    (ref,) = run_ranks(1, _run_tp, 1)
    return ref


def test_tp1_trains_on_one_rank(tp1_reference):
    for style in CASES:
        r = tp1_reference[style]
        assert r["finite"] and r["grad_norm"] > 0
        # One Adam step at lr 1e-3 on the batch it was computed on lowers that batch's loss.
        assert r["loss_after"] < r["loss"], style


def test_tp2_sp_equals_tp1(tp1_reference, report):
    ranks = run_ranks(2, _run_tp, 2, tp1_reference)
    for style in CASES:
        ref = tp1_reference[style]
        for rank, res in enumerate(ranks):
            got = res[style]
            assert got["finite"]
            torch.testing.assert_close(
                torch.tensor(got["loss"]), torch.tensor(ref["loss"]), rtol=RTOL, atol=0.0
            )
            torch.testing.assert_close(
                got["logits"],
                ref["logits"],
                rtol=RTOL,
                atol=ATOL_SCALE * ref["logits"].abs().max().item(),
            )
            worst_grad = M.assert_close_dict(
                got["grads"], ref["grads"], rtol=RTOL, atol_scale=ATOL_SCALE, what=style
            )
            # The grad norm is reduced over TP by Megatron's get_grad_norm_fp32 (CPU stand-in).
            assert got["grad_norm"] == pytest.approx(ref["grad_norm"], rel=RTOL)
            # After one clipped Adam step from equal weights and gradients. Adam divides each
            # gradient by its own running RMS, so an entry whose gradient is at fp32 noise level
            # could move differently; the loss is an average over all of them, and 1e-4 leaves
            # room for such entries while a missing or doubled update is far larger.
            assert got["loss_after"] == pytest.approx(ref["loss_after"], rel=1e-4)
        got = ranks[0][style]
        logit_err = M.max_errors(got["logits"], ref["logits"])
        report(
            f"tp baseline {style}: TP=2+SP vs TP=1 fp32: |dloss|={abs(got['loss'] - ref['loss']):.2e}"
            f" logits max/mean err={logit_err[0]:.2e}/{logit_err[1]:.2e}"
            f" max grad err={worst_grad:.2e} |dloss after step|="
            f"{abs(got['loss_after'] - ref['loss_after']):.2e}"
        )


def _bf16_tp2_training():
    """TP = 2 + SP in bf16 with Megatron's Float16 optimizer (fp32 main weights) on CPU."""
    from megatron.core.optimizer import OptimizerConfig, get_megatron_optimizer

    M.setup(tp=2)
    model = M.build("tp", "llama", bf16=True, params_dtype=torch.bfloat16)
    assert all(p.dtype == torch.bfloat16 for p in model.parameters())
    ddp = M.wrap_ddp(model, grad_reduce_in_fp32=True)
    cfg = OptimizerConfig(optimizer="adam", lr=1e-2, bf16=True, clip_grad=1.0)
    opt = get_megatron_optimizer(cfg, [ddp], use_gloo_process_groups=False)
    b = M.batch()
    losses, logits = [], None
    for _ in range(4):
        r = M.step(ddp, b, gather_logits=logits is None)
        logits = r["logits"].float() if logits is None else logits
        losses.append(r["loss"])
        ok, _, _ = opt.step()
        assert ok
    return losses, logits


def test_bf16_tp2_trains(tp1_reference, report):
    losses, logits = run_ranks(2, _bf16_tp2_training)[0]
    fp32 = tp1_reference["llama"]
    # Same initial weights rounded to bf16 (8-bit mantissa, rounding unit 2^-9 ~ 2e-3): every
    # matmul / norm output carries relative errors of that order and 2 layers compound a few of
    # them; 3e-2 of max|logit| bounds that, while a wrong dtype path or shard is O(1). (At
    # initialisation the loss itself is close to ln(vocab) for any model, so logits are compared.)
    err = M.max_errors(logits, fp32["logits"])[0]
    assert err <= 3e-2 * fp32["logits"].abs().max().item(), err
    assert losses[0] == pytest.approx(fp32["loss"], rel=1e-2)
    assert losses[-1] < losses[0] - 0.1, losses  # 3 Adam steps at lr 1e-2 on one batch
    report(f"tp baseline llama bf16 TP=2+SP vs fp32 TP=1: max logit err {err:.2e} (max|logit| "
           f"{fp32['logits'].abs().max().item():.2e}); loss {losses[0]:.4f} -> {losses[-1]:.4f} "
           "after 3 steps")


def _tp1_against_fp64_reference():
    """Megatron's GPTModel (TP = 1, fp64) against tests._reference.gpt_loss (fp64)."""
    M.setup(tp=1)
    out = {}
    for style in STYLES:
        model = M.build("tp", style, params_dtype=torch.float64).double()
        g = torch.Generator().manual_seed(3)
        with torch.no_grad():  # non-trivial biases and norm weights (Megatron inits them 0 / 1)
            for p in model.parameters():
                p.add_(0.1 * torch.randn(p.shape, generator=g, dtype=p.dtype))
        b = M.batch()
        logits_bsv = model(b["tokens"], b["position_ids"], b["attention_mask"])
        # Megatron's vocab-parallel cross entropy computes in fp32 by design; it is checked at
        # fp32 precision (rtol 1e-6: a mean of 32 log-softmax terms rounds to a few 1e-7), and
        # the fp64 backward runs from an fp64 cross entropy of Megatron's own logits.
        mcore_loss = model.compute_language_model_loss(
            b["labels"], logits_bsv.transpose(0, 1).contiguous()
        ).mean()
        loss = torch.nn.functional.cross_entropy(logits_bsv.flatten(0, 1), b["labels"].flatten())
        loss.backward()
        ref_params = {n: p.detach().clone().requires_grad_() for n, p in model.named_parameters()}
        ref_loss, ref_logits = R.gpt_loss(ref_params, model.config, b, rope_on=style == "llama")
        ref_loss.backward()
        assert mcore_loss.item() == pytest.approx(ref_loss.item(), rel=1e-6)
        # fp64 (eps 1.1e-16): the two computations differ only in operation order, a few hundred
        # ulps at most through 2 layers; 1e-10 is far above that and far below any real mismatch.
        tol = dict(rtol=1e-10, atol_scale=1e-10)
        M.assert_close_dict({"logits": logits_bsv}, {"logits": ref_logits}, **tol, what=style)
        grads = {n: p.grad for n, p in model.named_parameters()}
        worst = M.assert_close_dict(grads, {n: p.grad for n, p in ref_params.items()}, **tol, what=style)
        out[style] = (M.max_errors(logits_bsv, ref_logits)[0], worst)
    return out


def test_tp1_equals_fp64_reference(report):
    (errs,) = run_ranks(1, _tp1_against_fp64_reference)
    for style, (logit_err, grad_err) in errs.items():
        report(f"tp baseline {style}: TP=1 fp64 vs pure-PyTorch fp64 reference: max logit err "
               f"{logit_err:.2e}, max grad err {grad_err:.2e}")


def _save_and_reload(ckpt_dir: str):
    """TP = 2: train one step, save with dist_checkpointing, load into a differently seeded model."""
    from megatron.core import dist_checkpointing

    M.setup(tp=2)
    out = {}
    for style in STYLES:
        model = M.build("tp", style)
        ddp = M.wrap_ddp(model)
        opt = M.optimizer(ddp)
        M.step(ddp, M.batch(), gather_logits=False)
        opt.step()  # so that the saved weights are not the initial ones
        path = f"{ckpt_dir}/{style}"
        if torch.distributed.get_rank() == 0:
            import os

            os.makedirs(path, exist_ok=True)
        torch.distributed.barrier()
        with M.child_processes_allowed():
            dist_checkpointing.save(model.sharded_state_dict(), path)
        fresh = M.build("tp", style, seed=999)
        assert not all(
            torch.equal(a, b) for a, b in zip(fresh.parameters(), model.parameters())
        ), "a differently seeded model must start from other weights"
        fresh.load_state_dict(dist_checkpointing.load(fresh.sharded_state_dict(), path))
        for (n, a), (_, b) in zip(model.named_parameters(), fresh.named_parameters()):
            assert torch.equal(a, b), n
        ddp_f = M.wrap_ddp(fresh)
        out[style] = dict(full=M.full_state(model), loss=M.step(ddp_f, M.batch(1))["loss"])
    return out


def _load_into_tp1(ckpt_dir: str, saved):
    from megatron.core import dist_checkpointing

    M.setup(tp=1)
    out = {}
    for style in STYLES:
        model = M.build("tp", style, seed=4321)
        sd = dist_checkpointing.load(model.sharded_state_dict(), f"{ckpt_dir}/{style}")
        model.load_state_dict(sd)
        for n, p in model.named_parameters():
            assert torch.equal(p.detach(), saved[style]["full"][n]), n
        out[style] = M.step(M.wrap_ddp(model), M.batch(1))["loss"]
    return out


def test_dist_checkpoint_round_trip(tmp_path):
    saved = run_ranks(2, _save_and_reload, str(tmp_path))
    (tp1_losses,) = run_ranks(1, _load_into_tp1, str(tmp_path), saved[0])
    for style in STYLES:
        # The same weights at TP = 1 give TP = 2's loss (tolerance as in test_tp2_sp_equals_tp1).
        assert tp1_losses[style] == pytest.approx(saved[0][style]["loss"], rel=RTOL)


def _bad_input():
    from megatron_metp.model import build_gpt_model, initialize_parallel, make_config

    with pytest.raises(ValueError, match="--tensor-parallel-mode"):
        initialize_parallel(tensor_model_parallel_size=2, mode="ulysses")
    with pytest.raises(ValueError, match="--tensor-model-parallel-size 4"):
        initialize_parallel(tensor_model_parallel_size=4)  # 2 ranks
    with pytest.raises(ValueError, match="style"):
        make_config(style="bert")
    M.setup(tp=2)
    cfg = make_config(num_layers=1, hidden_size=32, num_attention_heads=4)
    with pytest.raises(ValueError, match="--make-vocab-size-divisible-by"):
        build_gpt_model(cfg, "tp", vocab_size=63, max_sequence_length=16)
    with pytest.raises(ValueError, match="--position-embedding-type"):
        build_gpt_model(cfg, "tp", vocab_size=64, max_sequence_length=16,
                        position_embedding_type="alibi")
    with pytest.raises(ValueError, match="--tensor-parallel-mode"):
        build_gpt_model(cfg, "ring", vocab_size=64, max_sequence_length=16)
    return True


def test_bad_input_is_refused():
    assert all(run_ranks(2, _bad_input))
