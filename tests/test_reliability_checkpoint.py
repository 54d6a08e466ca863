"""Checkpoints are interchangeable across modes and parallel sizes.

``metp train --save`` writes a Megatron-Core dist checkpoint in one mode and size; ``--load``
reads it in another. Pairs covered (4 gloo ranks; p = TP for tp/metp, CP for wallfacer):

    source            targets (one ``--compare`` run each, loading the source's iteration 2)
    tp        p=2  -> tp p=4, metp p=4, wallfacer p=4
    metp      p=4  -> tp p=2, metp p=2, wallfacer p=2
    wallfacer p=2  -> tp p=4, metp p=4

so every ordered pair of modes and both directions of p = 2 <-> 4 are loaded. For each target:
every parameter and every Adam moment (gathered to its full TP = 1 shape) equals, bit for bit,
the source's in-memory state at the moment it saved; and the target's losses for iterations 3-4
equal the uninterrupted source run's within the cross-mode parity tolerance.

The states are captured by wrapping ``megatron_metp.training.train_checkpoint.save`` / ``load`` inside
the ranks (the training loop looks them up through the module at call time), so the real
``metp train`` code path saves and loads.
"""

from __future__ import annotations

import contextlib
import hashlib
import os
from typing import Dict, List

import pytest
import torch
import torch.distributed as dist

from tests import _models as M
from tests._harness import run_ranks

# Tiny, fast, dropout-free (dropout draws differ between layouts, so cross-mode losses could
# not agree with it on). seq 16 is divisible by 2P = 8 (WallFacer's zigzag halves at P = 4).
BASE = ["--seq-length", "16", "--micro-batch-size", "2", "--global-batch-size", "4",
        "--hidden-dropout", "0", "--attention-dropout", "0", "--lr-warmup-iters", "0",
        "--no-progress"]
ITERS = 4        # the source trains 4 iterations and saves at 2 (and 4)
RESUME_AT = 2
# Cross-mode parity tolerance, as tests/test_train.py's --compare test: the modes compute the
# same sums in different orders (ring-accumulated partial products, online-softmax merges, and
# here also p = 2 vs 4 shards and DP = 2 vs 1), so each step differs by a few fp32 ulps that two
# Adam steps carry forward; on losses of ~5.5 that is ~1e-6. 1e-4 (2e-5 relative) leaves room
# for that while a wrongly resharded tensor or a lost Adam moment moves the loss by > 1e-2.
LOSS_TOL = 1e-4


def train_args(*argv):
    from megatron_metp.training import cli

    parser, _ = cli.build_parser()
    full = ["train", *BASE, *argv]
    return parser.parse_args(full), cli.explicit_flags(full)


def _torch_optimizers(optimizer) -> List:
    chain = getattr(optimizer, "chained_optimizers", None) or [optimizer]
    return [o.optimizer for o in chain]


def full_training_state(model_chunks, optimizer) -> Dict[str, torch.Tensor]:
    """Every parameter and Adam moment of this rank's model, gathered to its TP = 1 shape.

    ``{name: param, name + '/exp_avg': m, name + '/exp_avg_sq': v, name + '/step': t}``; the
    moments have the parameter's shape and sharding, so they are gathered the same way.
    """
    model = getattr(model_chunks[0], "module", model_chunks[0])
    state = {}
    for torch_opt in _torch_optimizers(optimizer):
        state.update(torch_opt.state)
    out = {}
    for name, p in model.named_parameters():
        out[name] = M.gather_full(p.detach(), p)
        st = state.get(p, {})
        assert {"exp_avg", "exp_avg_sq"} <= set(st), f"{name}: no Adam moments ({sorted(st)})"
        for key in ("exp_avg", "exp_avg_sq"):
            out[f"{name}/{key}"] = M.gather_full(st[key].detach(), p)
        out[f"{name}/step"] = torch.as_tensor(st["step"]).detach().clone().reshape(1).float()
    return out


@contextlib.contextmanager
def capture_checkpoints(saved: Dict[int, dict], loaded: List[dict]):
    """Wrap train_checkpoint.save/load: record the full state saved (by iteration) and loaded.

    Also lets the daemonic harness rank start dist_checkpointing's writer processes.
    """
    from megatron_metp.training import train_checkpoint as ckpt

    orig_save, orig_load = ckpt.save, ckpt.load

    def save(root, iteration, model_chunks, optimizer, scheduler, **kw):
        saved[iteration] = full_training_state(model_chunks, optimizer)
        with M.child_processes_allowed():
            return orig_save(root, iteration, model_chunks, optimizer, scheduler, **kw)

    def load(root, model_chunks, optimizer, scheduler):
        it = orig_load(root, model_chunks, optimizer, scheduler)
        from megatron.core import parallel_state as mpu
        from megatron.core.tensor_parallel.random import get_cuda_rng_tracker

        # The model-parallel dropout stream after load, to check TP ranks do not share one. A
        # digest, the same in every process (Python's hash() of bytes is salted per process:
        # under the "spawn" start method equal streams hashed apart and the check could not
        # fail).
        stream = get_cuda_rng_tracker().get_states()["model-parallel-rng"]
        loaded.append(dict(iteration=it, state=full_training_state(model_chunks, optimizer),
                           tp_rank=mpu.get_tensor_model_parallel_rank(),
                           dp_rank=mpu.get_data_parallel_rank(),
                           cp_rank=mpu.get_context_parallel_rank(),
                           mp_stream=hashlib.sha256(stream.numpy().tobytes()).hexdigest()))
        return it

    ckpt.save, ckpt.load = save, load
    try:
        yield
    finally:
        ckpt.save, ckpt.load = orig_save, orig_load


def point_tracker_at(root: str, iteration: int) -> None:
    """Make ``iteration`` the newest complete checkpoint (as if the run had stopped there)."""
    from megatron_metp.training.train_checkpoint import TRACKER

    dist.barrier()
    if dist.get_rank() == 0:
        assert os.path.isdir(os.path.join(root, f"iter_{iteration:07d}"))
        with open(os.path.join(root, TRACKER), "w") as f:
            f.write(str(iteration))
    dist.barrier()


def mismatches(a: Dict[str, torch.Tensor], b: Dict[str, torch.Tensor]) -> List[str]:
    """Names whose tensors are not bit-identical (NaN-aware), plus names in only one dict."""
    bad = sorted(set(a) ^ set(b))
    for n in sorted(set(a) & set(b)):
        x, y = a[n], b[n]
        if x.shape != y.shape or x.dtype != y.dtype or not torch.equal(x.view(-1), y.view(-1)):
            bad.append(n)
    return bad


def _source_then_targets(tmp: str, sources: List[tuple]) -> List[dict]:
    """For each (mode, p, target_modes, target_p): train the source with --save, then load its
    iteration 2 under every target mode at target_p in one --compare run."""
    from megatron_metp.training import train

    results = []
    for mode, p, targets, tp in sources:
        root = os.path.join(tmp, f"{mode}{p}")
        saved, loaded = {}, []
        with capture_checkpoints(saved, loaded):
            args, explicit = train_args("--tensor-parallel-mode", mode,
                                        "--tensor-model-parallel-size", str(p),
                                        "--train-iters", str(ITERS), "--save", root,
                                        "--save-interval", str(RESUME_AT))
            src = train.run(args, explicit)[mode]["losses"]
            point_tracker_at(root, RESUME_AT)
            args, explicit = train_args("--compare", ",".join(targets),
                                        "--tensor-model-parallel-size", str(tp),
                                        "--train-iters", str(ITERS), "--load", root)
            out = train.run(args, explicit)
        assert sorted(saved) == [RESUME_AT, ITERS], sorted(saved)
        assert len(loaded) == len(targets)
        for target, rec in zip(targets, loaded):
            assert rec["iteration"] == RESUME_AT
            results.append(dict(
                pair=f"{mode} p={p} -> {target} p={tp}",
                bad=mismatches(rec["state"], saved[RESUME_AT]),
                n_tensors=len(rec["state"]),
                tp_rank=rec["tp_rank"], dp_rank=rec["dp_rank"], cp_rank=rec["cp_rank"],
                mp_stream=rec["mp_stream"],
                src_losses=src[RESUME_AT:],
                dst_losses=out[target]["losses"],
            ))
    return results


# In the full tier for time (the default tier is <= 10 minutes on 2 cores): ~33 s.
@pytest.mark.full
def test_checkpoints_load_across_modes_and_sizes(tmp_path, report):
    # Every mode saves once and is loaded by each other mode, at another size (a same-mode
    # resume is test_train's cut-short test).
    sources = [("tp", 2, ["metp", "wallfacer"], 4),
               ("metp", 4, ["tp", "wallfacer"], 2),
               ("wallfacer", 2, ["tp", "metp"], 4)]
    out = run_ranks(4, _source_then_targets, str(tmp_path), sources, timeout=500)
    worst = 0.0
    for rank_results in out:
        for r in rank_results:
            assert r["bad"] == [], f"{r['pair']}: not bit-identical after load: {r['bad'][:8]}"
            # 2 layers x 12 + 5 model tensors (embeddings, final norm), x 4 (param, moments, step)
            assert r["n_tensors"] >= 4 * 20, r
            assert len(r["dst_losses"]) == ITERS - RESUME_AT, r
            diff = max(abs(a - b) for a, b in zip(r["dst_losses"], r["src_losses"]))
            assert diff <= LOSS_TOL, (r["pair"], r["dst_losses"], r["src_losses"])
            worst = max(worst, diff)
    # A checkpoint from another layout must not hand one TP rank's dropout stream to another:
    # within each pair's TP groups (same data-parallel and context-parallel rank), every TP
    # rank draws from its own stream. (CP ranks share theirs, as in stock Megatron: its seeds
    # follow the TP rank, model_parallel_cuda_manual_seed, and the pipeline stage.)
    tp_groups = 0
    for i, r0 in enumerate(out[0]):
        by_group = {}
        for rank_results in out:
            r = rank_results[i]
            by_group.setdefault((r["dp_rank"], r["cp_rank"]), []).append(r["mp_stream"])
        for streams in by_group.values():
            assert len(set(streams)) == len(streams), f"{r0['pair']}: TP ranks share a stream"
            tp_groups += len(streams) > 1
    assert tp_groups >= 4  # metp / tp at TP 2 and 4: the check has groups to look at
    pairs = [r["pair"] for r in out[0]]
    report(f"checkpoints across modes ({len(pairs)} pairs: {'; '.join(pairs)}): params + Adam "
           f"moments bit-identical after load; max |loss - source's| over iterations 3-4 "
           f"{worst:.2e} (tol {LOSS_TOL:g})")
