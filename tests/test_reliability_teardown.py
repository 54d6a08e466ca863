"""Set-up and tear-down leave nothing behind: process groups, threads, sockets.

Each gloo process group keeps two worker threads, a TCP loop thread and one socket per peer
until ``torch.distributed.destroy_process_group`` ends it; Megatron-Core's
``destroy_model_parallel`` only drops references. Before ``megatron_metp.model.destroy_parallel``
one cycle at TP = 2 on two ranks left ~51 threads and ~26 sockets per rank behind, and a long
test worker reached ~1,500 threads.
"""

from __future__ import annotations

import os
from pathlib import Path

import torch

from tests import _models
from tests._harness import run_ranks

CYCLES = 10


def _threads_and_sockets() -> tuple:
    threads = len(os.listdir("/proc/self/task"))
    sockets = 0
    for fd in Path("/proc/self/fd").iterdir():
        try:
            sockets += os.readlink(fd).startswith("socket:")
        except OSError:  # closed between listing and reading
            pass
    return threads, sockets


def _one_cycle(mode: str) -> int:
    """Set up ``mode``'s groups, one forward + backward of a tiny model (LLaMA-style for metp,
    GPT-style for wallfacer: Megatron's RoPE under CP pins memory, which a CPU build refuses),
    tear down."""
    from megatron_metp import parallel_state as ps
    from megatron_metp.model import destroy_parallel

    if mode == "wallfacer":
        _models.setup(context_parallel_size=2, mode=mode, wallfacer_team_size=1)
        model = _models.build(mode, cp_comm_type="wallfacer")
    else:
        # LLaMA-style: its RoPE module is what Megatron's rotary lru_cache kept alive, with
        # its cp_group, past destroy_parallel (3 threads a cycle until that cache was cleared).
        _models.setup(tp=2, mode=mode)
        model = _models.build(mode, "llama")
    b = _models.batch(s=_models.SEQ)
    if mode == "wallfacer":
        from megatron_metp.wallfacer import zigzag

        idx = ps.get_wallfacer_groups().idx
        b = {k: zigzag.shard_sequence(b[k], idx, 2, dim=1)
             for k in ("tokens", "position_ids", "labels")}
    loss = model(b["tokens"], b["position_ids"], None, labels=b["labels"]).float().sum()
    loss.backward()
    created = len(ps.live_groups())
    del model, loss
    ended = destroy_parallel()
    assert ended == created, (ended, created)
    assert not ps.live_groups(), ps.live_groups()
    return ended


def _cycles_task():
    counts, ended = [], []
    for i in range(CYCLES):
        ended.append(_one_cycle("metp" if i % 2 == 0 else "wallfacer"))
        counts.append(_threads_and_sockets())
    # destroy_parallel is safe to repeat and without a live set-up
    from megatron_metp.model import destroy_parallel

    assert destroy_parallel() == 0
    return counts, ended


def test_ten_setup_teardown_cycles_leak_nothing(report):
    torch.manual_seed(0)
    results = run_ranks(2, _cycles_task, timeout=300)
    for rank, (counts, ended) in enumerate(results):
        (t2, s2), (t10, s10) = counts[1], counts[-1]
        # The bound: after cycle 10 within 10 % of cycle 2 (cycle 1 is excluded: it
        # also starts lazily created pools, e.g. the autograd engine's worker threads).
        assert t10 <= 1.1 * t2, (rank, counts)
        assert s10 <= 1.1 * s2, (rank, counts)
        # Each cycle really built groups (Megatron's ~20 at TP = 2), and ended all of them.
        assert min(ended) > 5, ended
    counts, ended = results[0]
    report(f"set-up/tear-down x{CYCLES} on 2 ranks (metp / wallfacer alternating): groups "
           f"ended per cycle {ended[0]} (metp) / {ended[1]} (wallfacer); threads "
           f"{[c[0] for c in counts]}, sockets {[c[1] for c in counts]} (rank 0, after each cycle)")
