"""No device-to-host read inside a training step, and at most one per packed micro batch.

On a GPU every host read of a tensor's values (``.tolist()``, ``.item()``, ``int()`` ...)
waits for the compute stream, and the NCCL waits queued on it: the host's run-ahead, which
the post-early/wait-late schedule depends on, is gone. The CPU cannot show such a wait, so
these tests count the reads themselves (``tests._host_reads``) during forward and backward of
whole models, each step with a batch of its own documents. Counted by the plugin's line that
made them; reads torch or Megatron-Core make for their own use are counted as ``outside``.

* unpacked batches: no read at all (METP's input fingerprint is checked by a device-side
  assert, WallFacer has nothing to read);
* packed batches: exactly one read per micro batch, by ``packing.read_once`` at the model's
  forward (the ``cu_seqlens`` values, with METP's fingerprint in the same copy); the layers,
  and the recompute of the backward, use those values.
"""

import pytest
import torch
import torch.distributed as dist

from tests._harness import run_ranks
from tests.test_packed import S, _packed_batch, _thd_partition

READ_ONCE = "packing.py"


def _steps(model, batches, call):
    """Forward and backward of each batch, counting host reads per step."""
    from tests._host_reads import count_host_reads

    out = []
    for b in batches:
        with count_host_reads() as seen:
            call(model, b).sum().backward()
        out.append(dict(seen))
    return out


def _metp_task(recompute):
    from tests import _models as M

    M.setup(tp=2, mode="metp")
    kw = dict(recompute_granularity="full", recompute_method="uniform",
              recompute_num_layers=1) if recompute else {}
    model = M.build("metp", "llama", max_sequence_length=S, num_query_groups=2, **kw)
    packed = [_packed_batch(c) for c in ("docs", "padded", "balanced_thd")]
    plain = [dict(p, params=None) for p in packed[:2]]

    def call(m, b):
        return m(b["tokens"], None if b["params"] is not None else b["position_ids"], None,
                 labels=b["labels"], packed_seq_params=b["params"])
    return dict(unpacked=_steps(model, plain, call), packed=_steps(model, packed, call))


def _wallfacer_task():
    from megatron_metp.wallfacer.scheduler import initialize_wallfacer
    from tests import _models as M

    cp = dist.get_world_size()
    M.setup(tp=1, context_parallel_size=cp)
    plan = initialize_wallfacer(2, "collective_intra")
    model = M.build("wallfacer", "llama", max_sequence_length=S, cp_comm_type="wallfacer",
                    num_query_groups=2)
    mine = _thd_partition(plan.idx, cp)
    packed = [_packed_batch("thd_cp", seed=s) for s in (5, 6)]
    from megatron_metp.wallfacer import zigzag

    def call(m, b):
        if b["params"] is None:
            shard = lambda t: zigzag.shard_sequence(t, plan.idx, cp, dim=1)  # noqa: E731
        else:
            shard = lambda t: t.index_select(1, mine)  # noqa: E731
        return m(shard(b["tokens"]), shard(b["position_ids"]), None,
                 packed_seq_params=b["params"])
    plain = [dict(p, params=None, position_ids=torch.arange(S)[None]) for p in packed]
    return dict(unpacked=_steps(model, plain, call), packed=_steps(model, packed, call))


# Megatron-Core's own reads the plugin cannot remove: its unfused THD RoPE
# (``_apply_rotary_pos_emb_thd``) splits the tokens by ``cu_seqlens.tolist()`` in every layer,
# for stock Megatron as for WallFacer, which keeps Megatron's RoPE. A GPU run with Transformer
# Engine takes its fused THD RoPE instead (``--apply-rope-fusion``, Megatron-LM's default),
# which reads nothing.
MEGATRON_OWN = ("outside megatron/core/models/common/embeddings/rope_utils.py",)


def _check(per_rank, what, report):
    for rank, got in enumerate(per_rank):
        for step in got["unpacked"]:
            assert step == {}, (what, rank, "unpacked", step)
        for step in got["packed"]:
            mine = {k: n for k, n in step.items() if not k.startswith("outside")}
            assert sum(mine.values()) == 1, (what, rank, "packed", step)
            (where,) = mine
            assert where.startswith(READ_ONCE), (what, rank, where)
            theirs = set(step) - set(mine)
            assert all(k.startswith(MEGATRON_OWN) for k in theirs), (what, rank, theirs)
    got = per_rank[0]

    def mine(step):
        return sum(n for k, n in step.items() if not k.startswith("outside"))
    megatron = sum(n for k, n in got["packed"][0].items() if k.startswith("outside"))
    report(f"{what}: the plugin's host reads per step, unpacked "
           f"{[mine(s) for s in got['unpacked']]}, packed {[mine(s) for s in got['packed']]} "
           f"(packing.read_once); Megatron-Core's unfused THD RoPE: {megatron} per packed step")


def test_metp_step_reads_nothing_and_a_packed_one_once(report):
    for recompute in (False, True):
        _check(run_ranks(2, _metp_task, recompute),
               f"METP TP=2{' full recompute' if recompute else ''}", report)


@pytest.mark.full
def test_wallfacer_step_reads_nothing_and_a_packed_one_once(report):
    _check(run_ranks(4, _wallfacer_task), "WallFacer CP=4 C=2 (THD)", report)


# ----------------------------------------------------------------------------------------------
# The same steps on GPUs: torch's sync debug mode reports every synchronisation the CUDA
# runtime is asked for, including those the counter above cannot see (a pageable copy, a
# kernel library's own read).


def _step_on_rank(rank: int, world: int, init_file: str, out_dir: str, backend: str) -> None:
    """METP (TP = ``world``) steps on one rank: one to warm up, then an unpacked step under
    ``torch.cuda.set_sync_debug_mode("error")`` and a packed one under ``"warn"``, whose
    synchronisations are counted. With ``backend="gloo"`` the same body runs on the CPU (no
    sync debug mode there): the CPU suite runs the test's own code that way."""
    import json
    import os
    import warnings

    from megatron_metp import cpu_compat
    from tests import _models as M

    cuda = backend == "nccl"
    if cuda:
        torch.cuda.set_device(rank)
    else:
        cpu_compat.apply()
    dev = torch.device("cuda", rank) if cuda else torch.device("cpu")
    dist.init_process_group(backend, init_method=f"file://{init_file}", rank=rank,
                            world_size=world)
    got = {}
    try:
        M.setup(tp=world, mode="metp")
        model = M.build("metp", "llama", max_sequence_length=S, num_query_groups=2).to(dev)

        def step(b):
            params = b["params"]
            if params is not None:
                for f in ("cu_seqlens_q", "cu_seqlens_kv", "cu_seqlens_q_padded",
                          "cu_seqlens_kv_padded"):
                    t = getattr(params, f)
                    if t is not None:
                        setattr(params, f, t.to(dev))
            loss = model(b["tokens"].to(dev), None if params is not None
                         else b["position_ids"].to(dev), None, labels=b["labels"].to(dev),
                         packed_seq_params=params)
            loss.sum().backward()

        step(dict(_packed_batch("docs"), params=None))          # warm-up: caches, allocator
        step(_packed_batch("padded"))
        mode = torch.cuda.set_sync_debug_mode if cuda else (lambda m: None)
        mode("error")
        try:
            step(dict(_packed_batch("docs", seed=6), params=None))
        finally:
            mode(0)
        with warnings.catch_warnings(record=True) as caught:
            warnings.simplefilter("always")
            mode("warn")
            try:
                step(_packed_batch("balanced_thd"))
            finally:
                mode(0)
        got["packed syncs"] = sum("synchroniz" in str(w.message) for w in caught)
        if cuda:
            torch.cuda.synchronize()   # a device-side assert would surface here
    finally:
        dist.destroy_process_group()
    with open(os.path.join(out_dir, f"rank{rank}.json"), "w") as f:
        json.dump(got, f)


def _spawn_steps(world, backend):
    import json
    import os
    import tempfile
    from pathlib import Path

    import torch.multiprocessing as mp

    with tempfile.TemporaryDirectory() as tmp:
        mp.spawn(_step_on_rank, args=(world, os.path.join(tmp, "init"), tmp, backend),
                 nprocs=world, join=True)
        return [json.loads(Path(tmp, f"rank{r}.json").read_text()) for r in range(world)]


def test_sync_debug_step_body_runs_on_cpu():
    """The GPU test's body on gloo: it builds, steps and writes its result (no sync debug
    mode on the CPU, so the count is 0 here)."""
    assert _spawn_steps(2, "gloo") == [{"packed syncs": 0}] * 2


N_GPU = torch.cuda.device_count() if torch.cuda.is_available() else 0


@pytest.mark.skipif(N_GPU == 0, reason="GPU tier: needs CUDA")
def test_cuda_step_has_no_sync_and_a_packed_one_has_one(report):
    world = 2 if N_GPU >= 2 else 1
    per_rank = _spawn_steps(world, "nccl")
    report(f"GPU tier, METP TP={world} on NCCL: unpacked step under sync debug 'error' passed; "
           f"packed step synchronisations per rank {[r['packed syncs'] for r in per_rank]}")
    assert all(r["packed syncs"] <= 1 for r in per_rank), per_rank
