"""``--save`` / ``--load`` for ``metp train`` with Megatron-Core's dist_checkpointing.

Layout (as Megatron-LM's): ``SAVE/iter_0000020/`` holds one sharded checkpoint (model, optimizer,
and in the common part the iteration and the LR scheduler); ``SAVE/latest_checkpointed_iteration.txt``
names the newest complete one and is written only after every rank has finished saving, so a
run killed mid-save leaves the previous checkpoint as the latest loadable one. Because every
mode keeps TP's parameter names and shards, the keys are the same under tp, metp and wallfacer.
"""

from __future__ import annotations

import os
from typing import List

import torch.distributed as dist

TRACKER = "latest_checkpointed_iteration.txt"


def _ckpt_dir(root: str, iteration: int) -> str:
    return os.path.join(root, f"iter_{iteration:07d}")


def _sharded_state_dict(model_chunks: List, optimizer) -> dict:
    model_sd = model_chunks[0].sharded_state_dict()
    return {"model": model_sd, "optimizer": optimizer.sharded_state_dict(model_sd)}


def save(root: str, iteration: int, model_chunks: List, optimizer, scheduler) -> str:
    from megatron.core import dist_checkpointing

    path = _ckpt_dir(root, iteration)
    if dist.get_rank() == 0:
        os.makedirs(path, exist_ok=True)
    dist.barrier()
    sd = _sharded_state_dict(model_chunks, optimizer)
    sd["iteration"] = iteration
    sd["opt_param_scheduler"] = scheduler.state_dict()
    dist_checkpointing.save(sd, path)
    dist.barrier()  # every rank's shards are on disk before the tracker names this checkpoint
    if dist.get_rank() == 0:
        tmp = os.path.join(root, TRACKER + ".tmp")
        with open(tmp, "w") as f:
            f.write(str(iteration))
        os.replace(tmp, os.path.join(root, TRACKER))
    dist.barrier()
    return path


def latest_iteration(root: str) -> int:
    tracker = os.path.join(root, TRACKER)
    if not os.path.isfile(tracker):
        raise FileNotFoundError(f"--load {root}: no {TRACKER} (no complete checkpoint saved "
                                f"there with --save)")
    with open(tracker) as f:
        return int(f.read().strip())


def load(root: str, model_chunks: List, optimizer, scheduler) -> int:
    """Load the newest complete checkpoint under ``root``; return its iteration."""
    from megatron.core import dist_checkpointing

    iteration = latest_iteration(root)
    sd = _sharded_state_dict(model_chunks, optimizer)
    loaded = dist_checkpointing.load(sd, _ckpt_dir(root, iteration))
    model_chunks[0].load_state_dict(loaded["model"])
    optimizer.load_state_dict(loaded["optimizer"])
    scheduler.load_state_dict(loaded["opt_param_scheduler"])
    return int(loaded["iteration"])
