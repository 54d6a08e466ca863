"""``--save`` / ``--load`` for ``metp train`` with Megatron-Core's dist_checkpointing.

Layout (as Megatron-LM's): ``SAVE/iter_0000020/`` holds one sharded checkpoint (model, optimizer,
and in the common part the iteration and the LR scheduler) plus one RNG-state file per rank;
``SAVE/latest_checkpointed_iteration.txt``
names the newest complete one and is written only after every rank has finished saving, so a
run killed mid-save leaves the previous checkpoint as the latest loadable one. Because every
mode keeps TP's parameter names and shards, the keys are the same under tp, metp and wallfacer.
"""

from __future__ import annotations

import contextlib
import os
from typing import List, Optional

import torch.distributed as dist

TRACKER = "latest_checkpointed_iteration.txt"


def _rng_path(path: str) -> str:
    return os.path.join(path, f"rng_rank{dist.get_rank():05d}_of_{dist.get_world_size()}.pt")


def _layout() -> dict:
    """This rank's place in the parallel layout: a stream saved at one place is only the right
    stream at the same place (two TP ranks sharing one would draw identical dropout masks)."""
    from megatron.core import parallel_state as mpu

    return {"tp": (mpu.get_tensor_model_parallel_rank(), mpu.get_tensor_model_parallel_world_size()),
            "cp": (mpu.get_context_parallel_rank(), mpu.get_context_parallel_world_size()),
            "pp": (mpu.get_pipeline_model_parallel_rank(),
                   mpu.get_pipeline_model_parallel_world_size()),
            "dp": (mpu.get_data_parallel_rank(), mpu.get_data_parallel_world_size())}


def _rng_state() -> dict:
    """Every generator a training step draws from (dropout masks come from Megatron's tracked
    streams), so that a resumed run repeats the uninterrupted run's masks bit for bit."""
    import random

    import numpy as np
    import torch
    from megatron.core.tensor_parallel.random import get_cuda_rng_tracker

    state = {"random": random.getstate(), "numpy": np.random.get_state(),
             "torch": torch.get_rng_state(), "tracker": get_cuda_rng_tracker().get_states(),
             "layout": _layout()}
    if torch.cuda.is_available():
        state["cuda"] = torch.cuda.get_rng_state()
    return state


def _set_rng_state(state: dict) -> None:
    import random

    import numpy as np
    import torch
    from megatron.core.tensor_parallel.random import get_cuda_rng_tracker

    random.setstate(state["random"])
    np.random.set_state(state["numpy"])
    torch.set_rng_state(state["torch"])
    get_cuda_rng_tracker().set_states(state["tracker"])
    if "cuda" in state and torch.cuda.is_available():
        torch.cuda.set_rng_state(state["cuda"])


def _ckpt_dir(root: str, iteration: int) -> str:
    return os.path.join(root, f"iter_{iteration:07d}")


def _unwrap(chunk):
    """The GPTModel inside Megatron's DDP wrapper: keys without the wrapper's ``module.``
    prefix, as Megatron-LM's checkpoints have them."""
    return getattr(chunk, "module", chunk)


def _is_distributed(optimizer) -> bool:
    """Whether ``optimizer`` (or, when chained, its parts) is Megatron's DistributedOptimizer."""
    from megatron.core.optimizer.distrib_optimizer import DistributedOptimizer

    chain = getattr(optimizer, "chained_optimizers", None) or [optimizer]
    return any(isinstance(o, DistributedOptimizer) for o in chain)


def content_metadata(optimizer, fully_reshardable: bool, layout: str = "") -> dict:
    """What the optimizer's part of the checkpoint looks like, as Megatron-LM records it
    (``_build_sharded_state_dict_metadata``): the distributed optimizer writes
    ``dp_reshardable`` (its flat per-rank buffers) unless ``--dist-ckpt-optim-fully-reshardable``
    asks for ``fully_reshardable`` (gathered into each parameter's own shape, so it reshards to
    any mode and size). ``metp_layout`` (:func:`layout_tag`) records where the buffers were cut,
    for :func:`check_loadable`. The plain optimizer records nothing."""
    if not _is_distributed(optimizer):
        return {}
    return {"distrib_optim_sharding_type":
            "fully_reshardable" if fully_reshardable else "dp_reshardable",
            "metp_layout": layout}


def layout_tag(mode: str, tp: int, cp: int, pp: int, dp: int) -> str:
    return f"{mode} DPxTPxCPxPP {dp}x{tp}x{cp}x{pp}"


def check_loadable(root: str, distributed_optimizer: bool, layout: str) -> None:
    """Refuse, before any rank starts, a ``--load`` whose optimizer state this run cannot read
    (Megatron-Core 0.16.1 reads neither optimizer's state with the other, and reads the
    distributed optimizer's ``dp_reshardable`` buffers only where they were cut; resharding
    along data-parallel ranks alone is Megatron's claim, not exercised here, so the whole
    layout must match)."""
    if not root or not has_checkpoint(root):
        return
    from megatron_metp.checkpoint_keys import check_intact

    check_intact("--load", root)
    iteration = latest_iteration(root)
    if iteration == 0:  # the initial weights: no optimizer state in it
        return
    from megatron.core import dist_checkpointing

    meta = dist_checkpointing.load_content_metadata(_ckpt_dir(root, iteration)) or {}
    kind = meta.get("distrib_optim_sharding_type")
    if kind and not distributed_optimizer:
        raise ValueError(f"--load {root}: written with --use-distributed-optimizer, whose "
                         f"optimizer state Megatron's plain optimizer cannot read: add "
                         f"--use-distributed-optimizer")
    if not kind and distributed_optimizer:
        raise ValueError(f"--load {root}: no distributed-optimizer state recorded (written "
                         f"without --use-distributed-optimizer, or by a metp train before it "
                         f"recorded its form), which the distributed optimizer cannot read: "
                         f"drop --use-distributed-optimizer")
    if kind == "dp_reshardable" and meta.get("metp_layout") != layout:
        raise ValueError(f"--load {root}: the distributed optimizer's dp_reshardable state was "
                         f"cut for {meta.get('metp_layout')}, not {layout}: load it in that "
                         f"layout, or save with --dist-ckpt-optim-fully-reshardable")


def _sharded_state_dict(model_chunks: List, optimizer, iteration: int,
                        is_loading: bool = False, metadata: Optional[dict] = None) -> dict:
    """Model, and the optimizer once it has taken a step: before the first step (``--save`` with
    ``--train-iters 0``, the initial weights) Adam has no moments to save or to load.

    ``metadata``: the checkpoint's content metadata (:func:`content_metadata`); the distributed
    optimizer builds its part in that form (a distributed-optimizer load always finds one:
    :func:`check_loadable` refuses checkpoints without it)."""
    model_sd = _unwrap(model_chunks[0]).sharded_state_dict()
    if iteration == 0:
        return {"model": model_sd}
    # is_loading: Megatron's optimizer first creates its (still empty) Adam moments, so that the
    # request names exp_avg / exp_avg_sq and they are loaded rather than silently left at zero.
    if not _is_distributed(optimizer):
        return {"model": model_sd,
                "optimizer": optimizer.sharded_state_dict(model_sd, is_loading=is_loading)}
    return {"model": model_sd,
            "optimizer": optimizer.sharded_state_dict(model_sd, is_loading=is_loading,
                                                      metadata=metadata or {})}


def save(root: str, iteration: int, model_chunks: List, optimizer, scheduler,
         fully_reshardable: bool = False, layout: str = "") -> str:
    from megatron.core import dist_checkpointing

    from megatron_metp.training.lifetime import own_checkpoint_helpers

    own_checkpoint_helpers()  # the writer's helper process dies with this rank
    path = _ckpt_dir(root, iteration)
    if dist.get_rank() == 0:
        os.makedirs(path, exist_ok=True)
    dist.barrier()
    meta = content_metadata(optimizer, fully_reshardable, layout)
    sd = _sharded_state_dict(model_chunks, optimizer, iteration, metadata=meta)
    sd["iteration"] = iteration
    sd["opt_param_scheduler"] = scheduler.state_dict()
    dist_checkpointing.save(sd, path, content_metadata=meta)
    import torch

    torch.save(_rng_state(), _rng_path(path))
    dist.barrier()  # every rank's shards are on disk before the tracker names this checkpoint
    if dist.get_rank() == 0:
        tmp = os.path.join(root, TRACKER + ".tmp")
        with open(tmp, "w") as f:
            f.write(str(iteration))
        os.replace(tmp, os.path.join(root, TRACKER))
    dist.barrier()
    return path


def has_checkpoint(root: str) -> bool:
    """Whether ``root`` holds a complete checkpoint (its tracker is written last)."""
    return os.path.isfile(os.path.join(root, TRACKER))


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

    from megatron_metp.checkpoint_keys import legacy_norm_keys, uses_legacy_norm_keys

    iteration = latest_iteration(root)
    path = _ckpt_dir(root, iteration)
    meta = dist_checkpointing.load_content_metadata(path) or {}
    # A checkpoint of megatron-metp 0.1 names the norms plainly: read under those names (the
    # next save writes Megatron-LM's, megatron_metp.checkpoint_keys).
    legacy = (legacy_norm_keys(_unwrap(model_chunks[0])) if uses_legacy_norm_keys(path)
              else contextlib.nullcontext())
    with legacy:
        sd = _sharded_state_dict(model_chunks, optimizer, iteration, is_loading=True,
                                 metadata=meta)
    loaded = dist_checkpointing.load(sd, path)
    _unwrap(model_chunks[0]).load_state_dict(loaded["model"])
    if "optimizer" in loaded:
        optimizer.load_state_dict(loaded["optimizer"])
    scheduler.load_state_dict(loaded["opt_param_scheduler"])
    import torch

    rng = _rng_path(_ckpt_dir(root, iteration))
    state = torch.load(rng, weights_only=False) if os.path.isfile(rng) else None
    # Restore only if every rank sits where it sat at save time (same TP/CP/PP/DP ranks and
    # sizes); otherwise all ranks keep the streams seeded from --seed, consistently.
    same = torch.tensor([int(state is not None and state.get("layout") == _layout())],
                        device="cuda" if torch.cuda.is_available() else "cpu")
    dist.all_reduce(same, op=dist.ReduceOp.MIN)
    if same.item():
        _set_rng_state(state)
    elif dist.get_rank() == 0:
        # Another world size or layout (e.g. a checkpoint from another mode): weights and
        # optimizer state load; the random streams restart from --seed.
        print(f"[metp] {root}: no RNG state for this rank layout; dropout streams restart "
              f"from --seed", flush=True)
    return int(loaded["iteration"])
