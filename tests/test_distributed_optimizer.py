"""``--use-distributed-optimizer`` on CPU: Megatron-Core's own DistributedOptimizer.

WallFacer runs TP = 1 over its CP group, so every rank holds the whole model; Megatron shards the
optimizer over the data-parallel x context-parallel group. These runs train the real
``metp train`` code path twice from the same seed and data, once with Megatron's plain optimizer
(DDP all-reduces the gradients, every rank holds every Adam moment) and once with its
DistributedOptimizer (gradients reduce-scattered, each rank updates its 1/d of the parameters and
all-gathers them back), and check:

* the two runs agree: losses, and every parameter after the last step;
* the optimizer state really is sharded: summed over the d ranks, the Adam moments cover every
  parameter exactly once, and no rank holds more than its 1/d share plus Megatron's bucket
  padding; the measured bytes per rank equal the planner's count for the same model;
* a distributed-optimizer checkpoint resumes bit for bit in both of Megatron-LM's forms, and
  the fully reshardable one loads under another mode and split (METP TP 2 x DP 2, the optimizer
  resharded from 4 ranks to 2); loads this optimizer cannot read are refused at start-up.
"""

from __future__ import annotations

import os
from typing import Dict

import pytest
import torch
import torch.distributed as dist

from tests._harness import run_ranks

BASE = ["--seq-length", "32", "--micro-batch-size", "2", "--global-batch-size", "4",
        "--hidden-dropout", "0", "--attention-dropout", "0", "--lr-warmup-iters", "1",
        "--no-progress"]
ITERS = 6
RESUME_AT = 3
# The two optimizers do the same arithmetic except for the gradient reduction: an all-reduce of
# the whole buffer against a reduce-scatter of it (gloo sums the same 4 addends in its own order
# in each), so gradients can differ by an fp32 ulp, which Adam's g / sqrt(v) turns into a
# relative parameter change of ~1e-7 per step, more where a gradient element is near Adam's eps.
# Measured: 1.9e-6 on parameters of size ~0.02-1 after 6 steps, losses equal; 1e-5 is 5x that.
# An unsynchronised shard (a rank that never receives the others' updated parameters) or a
# gradient reduced over the wrong group moves parameters by ~lr = 3e-3 after one step.
PARAM_TOL = 1e-5
LOSS_TOL = 1e-5
# Cross-mode tolerance of tests/test_reliability_checkpoint.py (METP's ring sums in another
# order than WallFacer's; one step carries a few ulps forward).
CROSS_MODE_TOL = 1e-4


def _state(run) -> dict:
    """This rank's final local parameters and the Adam state it holds (elements, bytes)."""
    model = getattr(run.ddp, "module", run.ddp)
    chain = getattr(run.optimizer, "chained_optimizers", None) or [run.optimizer]
    moments = [t for o in chain for st in o.optimizer.state.values()
               for k, t in st.items() if k in ("exp_avg", "exp_avg_sq")]
    return dict(params={n: p.detach().clone() for n, p in model.named_parameters()},
                n_params=sum(p.numel() for p in model.parameters()),
                moment_elems=sum(t.numel() for t in moments) // 2,
                moment_bytes=sum(t.numel() * t.element_size() for t in moments))


def _train(*argv) -> dict:
    from tests import _models as M

    losses, state = M.train_capturing(BASE, argv, _state)
    return dict(state, losses=losses)


def _resume_at(root: str) -> None:
    """Make RESUME_AT the newest complete checkpoint, as if the run had stopped there."""
    dist.barrier()
    if dist.get_rank() == 0:
        with open(os.path.join(root, "latest_checkpointed_iteration.txt"), "w") as f:
            f.write(str(RESUME_AT))
    dist.barrier()


def _wallfacer_runs(tmp: str) -> Dict[str, dict]:
    from tests import _models as M

    # WallFacer takes the TP size as its CP group (as every cross-mode test): the vocabulary is
    # then padded as for TP 4, the same rows METP TP 2 builds, so the embedding moves between them.
    wf = ["--tensor-parallel-mode", "wallfacer", "--tensor-model-parallel-size", "4",
          "--train-iters", str(ITERS)]
    dopt = ["--use-distributed-optimizer", "--save-interval", str(RESUME_AT)]
    dp_root, fr_root = os.path.join(tmp, "dp_reshardable"), os.path.join(tmp, "fully_reshardable")
    out = {"plain": _train(*wf)}
    with M.child_processes_allowed():  # dist_checkpointing's writer processes
        # Megatron-LM's default form (dp_reshardable), and the fully reshardable one.
        out["distopt"] = _train(*wf, *dopt, "--save", dp_root)
        out["distopt_fr"] = _train(*wf, *dopt, "--save", fr_root,
                                   "--dist-ckpt-optim-fully-reshardable")
        _resume_at(dp_root)
        _resume_at(fr_root)
        out["resumed"] = _train(*wf, "--use-distributed-optimizer", "--load", dp_root)
        out["resumed_fr"] = _train(*wf, "--use-distributed-optimizer", "--load", fr_root)
        # Another mode, size and shard count: METP TP 2 x DP 2, the optimizer over d = 2.
        out["metp"] = _train("--tensor-parallel-mode", "metp", "--tensor-model-parallel-size",
                             "2", "--use-distributed-optimizer", "--train-iters", str(ITERS),
                             "--load", fr_root)
        # Under an outside launcher (torchrun, srun) the ranks check it themselves, before
        # building any group: the dp_reshardable form in another layout is refused.
        try:
            _train("--tensor-parallel-mode", "metp", "--tensor-model-parallel-size", "2",
                   "--use-distributed-optimizer", "--train-iters", str(ITERS), "--load", dp_root)
            out["refused"] = None
        except ValueError as e:
            out["refused"] = str(e)
    return out


# In the full tier for time (the default tier is <= 10 minutes on 2 cores): ~34 s;
# METP's distributed optimizer stays in the default tier.
@pytest.mark.full
def test_wallfacer_distributed_optimizer(tmp_path, report):
    from megatron_metp.measure import planner

    out = run_ranks(4, _wallfacer_runs, str(tmp_path), timeout=500)
    d = 4
    plain0 = out[0]["plain"]
    worst_loss = worst_param = cross = 0.0
    for rank, r in enumerate(out):
        plain, sharded = r["plain"], r["distopt"]
        assert plain["losses"] == plain0["losses"], rank  # every rank reports the same curve
        assert len(sharded["losses"]) == ITERS
        worst_loss = max(worst_loss, max(abs(a - b) for a, b in
                                         zip(sharded["losses"], plain["losses"])))
        assert sorted(sharded["params"]) == sorted(plain["params"])
        for name, p in plain["params"].items():
            worst_param = max(worst_param, (sharded["params"][name] - p).abs().max().item())
        # WallFacer replicates the model: the plain optimizer holds every moment on every rank.
        assert plain["moment_elems"] == plain["n_params"], (rank, plain["moment_elems"])
        # Saving in either form does not disturb the run.
        assert r["distopt_fr"]["losses"] == sharded["losses"], rank
        # Resumed from either form at RESUME_AT: bit for bit (Adam's step and moments restored;
        # a lost or shared step counter changes the next update's bias correction).
        for key in ("resumed", "resumed_fr"):
            assert r[key]["losses"] == sharded["losses"][RESUME_AT:], (rank, key, r[key]["losses"])
            for name, p in sharded["params"].items():
                assert torch.equal(r[key]["params"][name], p), (rank, key, name)
        # Loaded under METP TP 2 x DP 2 (optimizer resharded from 4 to 2 ranks).
        cross = max(cross, max(abs(a - b) for a, b in
                               zip(r["metp"]["losses"], sharded["losses"][RESUME_AT:])))
    for r in out:
        assert r["refused"] and "--dist-ckpt-optim-fully-reshardable" in r["refused"], r["refused"]
    assert cross <= CROSS_MODE_TOL, (cross, out[0]["metp"]["losses"], out[0]["distopt"]["losses"])
    assert worst_loss <= LOSS_TOL, worst_loss
    assert worst_param <= PARAM_TOL, worst_param

    n = plain0["n_params"]
    shards = [r["distopt"]["moment_elems"] for r in out]
    # Every parameter's moments live on exactly one rank (Megatron's shard ranges partition the
    # gradient buffer; its padding to a multiple of d x 128 elements belongs to no parameter).
    assert sum(shards) == n, (shards, n)
    assert max(shards) <= -(-n // d) + 128, (shards, n)
    # METP TP 2 x DP 2: each rank's TP shard (n / 2 here: every weight is split, the norms'
    # and biases' few elements are counted by Megatron's own shard ranges) over d = 2.
    metp_shards = [r["metp"]["moment_elems"] for r in out]
    assert sum(metp_shards) == sum(r["metp"]["n_params"] for r in out) // 2, metp_shards
    # The planner's sharded optimizer state: Adam's 8 B per parameter over d (the fp32 master
    # copy of its 12 B is the model's own fp32 parameter here: no bf16 model copy on CPU).
    planned = 8 * n / d
    measured = max(r["distopt"]["moment_bytes"] for r in out)
    assert planner.optimizer_bytes_per_param("wallfacer", d, True) == 6.0 + 12.0 / d
    assert abs(measured - planned) / planned < 0.02, (measured, planned)
    report(f"WallFacer CP 4, --use-distributed-optimizer vs plain Megatron optimizer, {ITERS} "
           f"iterations (fp32, gloo): max |loss diff| {worst_loss:.1e}, max |param diff| "
           f"{worst_param:.1e}; Adam moments per rank {shards} elements of {n} parameters "
           f"({measured / 2**10:.1f} KiB per rank vs {8 * n / 2**10:.1f} KiB replicated; "
           f"planned 8n/d = {planned / 2**10:.1f} KiB); resumed bit for bit from both "
           f"checkpoint forms; the fully reshardable one under METP TP 2 x DP 2: max |loss "
           f"diff| {cross:.1e}")

    # Start-up refusals against these real checkpoints (before any rank would start).
    from megatron_metp.training.train_checkpoint import check_loadable, layout_tag

    dp_root = str(tmp_path / "dp_reshardable")
    fr_root = str(tmp_path / "fully_reshardable")
    wf_layout = layout_tag("wallfacer", 1, 4, 1, 1)
    check_loadable(dp_root, True, wf_layout)
    check_loadable(fr_root, True, layout_tag("metp", 2, 1, 1, 2))
    for root, dopt, layout, words in (
            (dp_root, False, wf_layout, "add --use-distributed-optimizer"),
            (dp_root, True, layout_tag("metp", 2, 1, 1, 2), "--dist-ckpt-optim-fully-reshardable"),
            (fr_root, False, layout_tag("metp", 2, 1, 1, 2), "add --use-distributed-optimizer")):
        with pytest.raises(ValueError, match=words):
            check_loadable(root, dopt, layout)


def _cycles(n: int):
    """``n`` whole ``metp train`` runs with the distributed optimizer in one process (WallFacer
    CP 2, one iteration each), the rank's threads and sockets after each."""
    import gc

    from megatron_metp.training import cli, train
    from tests.test_reliability_teardown import _threads_and_sockets as counts

    rows = []
    argv = ["train", *BASE, "--tensor-parallel-mode", "wallfacer",
            "--tensor-model-parallel-size", "2", "--global-batch-size", "2",
            "--train-iters", "1", "--lr-warmup-iters", "0", "--use-distributed-optimizer"]
    for _ in range(n):
        parser, _ = cli.build_parser()
        train.run(parser.parse_args(argv), cli.explicit_flags(argv))
        gc.collect()
        rows.append(counts())
    alive = sorted({type(o).__name__ for o in gc.get_objects() if type(o).__name__ in (
        "DistributedOptimizer", "DistributedDataParallel", "GPTModel")})
    return rows, alive


# In the full tier for time (the default tier is <= 10 minutes on 2 cores; ~13 s):
# tests/test_reliability_teardown.py keeps ten setup/teardown cycles in the default tier.
@pytest.mark.full
def test_ten_runs_with_the_distributed_optimizer_leave_nothing(report):
    # Megatron's DDP hooks its gradient accumulators with closures over itself,
    # a cycle through C++ autograd nodes that Python's collector cannot free, so every run kept
    # its DDP, DistributedOptimizer and gloo groups: +48 threads and +22 sockets per run.
    # destroy_parallel (model.release_ddp_hooks) now breaks it.
    out = run_ranks(2, _cycles, 10, timeout=300)
    for rank, (rows, alive) in enumerate(out):
        assert alive == [], (rank, alive)
        # Flat from the first run on (the first also starts lazily created pools): exactly
        # equal counts, since each gloo group would add whole threads and sockets.
        assert all(r == rows[0] for r in rows), (rank, rows)
    report(f"metp train --use-distributed-optimizer x10 in one process (rank 0): threads / "
           f"sockets after each run {out[0][0]}")


# --overlap-param-gather: Megatron DDP finishes each bucket's parameter all-gather in the forward
# pre-hook of a module holding its parameters, and dispatches the next bucket's there. METP's
# attention and MLP read linear_qkv / linear_proj / linear_fc1 / linear_fc2's weights without
# calling those modules (metp.weight_hooks). Buckets of a few hundred parameters put those
# weights in buckets of their own, the case where no other module's hook covers them.
OVERLAP_BUCKET = 1000
OVERLAP_CASES = {
    # the whole pass with the layer's link: fc1 / fc2's gathers are posted inside the attention
    "gpt whole + gathered MLP": ("gpt", dict(metp_ring_pass="whole", metp_mlp_pass="gathered")),
    # the head-group pass and the MLP's weight ring: no link
    "llama head-group + ring MLP": ("llama", dict(num_attention_heads=8, num_query_groups=4,
                                                  metp_ring_pass="head-group",
                                                  metp_mlp_pass="ring")),
}


def _overlap_param_gather_run(style, kw, overlap, steps=3, ring_loss=False):
    from megatron.core.distributed import finalize_model_grads
    from megatron.core.optimizer import OptimizerConfig, get_megatron_optimizer

    from tests import _models as M

    model = M.build("metp", style, **kw)
    called = set()
    for m in model.modules():
        m.register_forward_pre_hook(lambda mod, args: called.add(mod))
    ddp = M.wrap_ddp(model, use_distributed_optimizer=True, overlap_grad_reduce=True,
                     overlap_param_gather=overlap, bucket_size=OVERLAP_BUCKET)
    opt = get_megatron_optimizer(
        OptimizerConfig(optimizer="adam", lr=1e-2, use_distributed_optimizer=True), [ddp],
        use_gloo_process_groups=False)
    losses = []
    for i in range(steps):  # Megatron-LM's train_step: DDP's hooks stay on from its constructor
        b = M.batch(seed=i)
        ddp.zero_grad_buffer()
        opt.zero_grad()
        if ring_loss:   # labels given: METP's ring loss reads the output layer's weight
            loss = ddp(b["tokens"], b["position_ids"], b["attention_mask"],
                       labels=b["labels"]).mean()
        else:
            logits = ddp(b["tokens"], b["position_ids"], b["attention_mask"])
            loss = model.compute_language_model_loss(
                b["labels"], logits.transpose(0, 1).contiguous()).mean()
        loss.backward()
        finalize_model_grads([ddp])
        opt.step()
        losses.append(loss.item())
    skipped = sorted(n for n, m in model.named_modules()
                     if list(m.parameters(recurse=False)) and m not in called)
    linears = {p for n, m in model.named_modules()
               if n.rsplit(".", 1)[-1] in ("linear_qkv", "linear_proj", "linear_fc1",
                                           "linear_fc2") for p in m.parameters()}
    if ring_loss:   # the bucket that must hold the (untied) output weight alone
        linears = {model.output_layer.weight}
    # buckets that hold nothing but those linears' parameters
    n_buckets = sum(set(bk.params) <= linears for g in ddp.bucket_groups for bk in g.buckets)
    if overlap:
        ddp.disable_forward_pre_hook()  # as Megatron-LM does at the end of training
    return losses, skipped, n_buckets


def _overlap_param_gather_cases():
    from tests import _models as M

    M.setup(tp=2, mode="metp")  # 4 ranks: TP 2 x DP 2
    out = {}
    cases = [(case, style, kw, False) for case, (style, kw) in OVERLAP_CASES.items()]
    # Labels given to the untied model: the loss is METP's ring over the output weight, which
    # it reads without calling output_layer; that weight fills a bucket of its own.
    cases.append(("gpt whole + gathered MLP, ring loss", *OVERLAP_CASES[
        "gpt whole + gathered MLP"], True))
    for case, style, kw, ring_loss in cases:
        plain, _, _ = _overlap_param_gather_run(style, kw, overlap=False, ring_loss=ring_loss)
        overlapped, skipped, n_buckets = _overlap_param_gather_run(style, kw, overlap=True,
                                                                   ring_loss=ring_loss)
        out[case] = (plain, overlapped, skipped, n_buckets)
    return out


def test_metp_under_overlap_param_gather_trains_as_without(report):
    res = run_ranks(4, _overlap_param_gather_cases)
    for case, (plain, overlapped, skipped, n_buckets) in res[0].items():
        # Each forward reads every weight after its bucket's all-gather has finished, so the
        # two runs do the same arithmetic: equal losses bit for bit (a weight read before its
        # gather would carry the other DP rank's last-step shard: off by ~lr = 1e-2). Without
        # the linears' hooks METP's second step stopped on Megatron's own assertion
        # (start_param_sync: a bucket's gather still pending).
        assert overlapped == plain, (case, plain, overlapped)
        assert not skipped, (case, skipped)  # every module holding parameters saw its hook run
        assert n_buckets >= 1, n_buckets  # a bucket holding only those linears' weights
        report(f"--overlap-param-gather, METP TP 2 x DP 2, {case}: {len(plain)} steps equal "
               f"bit for bit to the run without ({n_buckets} buckets hold only METP-read weights; "
               f"losses "
               f"{', '.join(f'{x:.6f}' for x in plain)})")
