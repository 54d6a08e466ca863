"""Reproducer: Megatron's DistributedOptimizer leaves gloo threads alive.

Two gloo ranks in this process's children, each running ``metp train`` in-process (WallFacer,
CP 2, two iterations) ``--cycles`` times, printing rank 0's threads and sockets after each
cycle (``train.run`` ends its groups through ``destroy_parallel``), the gloo thread names, and
which training objects are still alive after ``gc.collect()``. Compare with
``--no-distributed-optimizer``. Measured on this machine (torch 2.13.0+cpu, megatron-core
0.16.1), threads / sockets: with the distributed optimizer 6/6 -> 55/28 -> 103/50 -> 151/72 ->
199/94 (about 16 gloo groups per cycle), without it 9/8 flat; DDP, the optimizer and the model
outlive the run although no module global reaches them.

Cause: DDP's gradient hooks sit on the parameters' AccumulateGrad nodes (C++ objects the garbage
collector cannot traverse) and close over the DDP object, an uncollectable cycle holding the
optimizer and its groups. Fixed in ``megatron_metp.model.release_ddp_hooks`` (called by
``destroy_parallel``): now 9/8 after every cycle with the distributed optimizer too.

    python scripts/repro_distributed_optimizer_threads.py [--cycles 4] [--no-distributed-optimizer]
"""
import argparse
import collections
import datetime
import gc
import os
import sys
from pathlib import Path

import torch
import torch.distributed as dist
import torch.multiprocessing as mp

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))


def _counts():
    socks = 0
    for f in os.listdir("/proc/self/fd"):
        try:
            socks += os.readlink(f"/proc/self/fd/{f}").startswith("socket:")
        except OSError:
            pass
    return len(os.listdir("/proc/self/task")), socks


def _rank(r, world, port, cycles, dopt):
    import warnings

    warnings.filterwarnings("ignore")
    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port), RANK=str(r),
                      WORLD_SIZE=str(world), LOCAL_RANK=str(r), CUDA_VISIBLE_DEVICES="")
    torch.set_num_threads(1)
    dist.init_process_group("gloo", rank=r, world_size=world,
                            timeout=datetime.timedelta(seconds=60))
    from megatron_metp import cpu_compat

    cpu_compat.apply()
    from megatron_metp.training import cli, train

    rows = [("start",) + _counts()]
    for c in range(cycles):
        argv = ["train", "--tensor-parallel-mode", "wallfacer", "--tensor-model-parallel-size",
                str(world), "--train-iters", "2", "--lr-warmup-iters", "0", "--seq-length", "32"]
        if dopt:
            argv.append("--use-distributed-optimizer")
        parser, _ = cli.build_parser()
        train.run(parser.parse_args(argv), cli.explicit_flags(argv))
        gc.collect()
        rows.append((f"after cycle {c}",) + _counts())
    if r == 0:
        print("threads / sockets of rank 0:", rows)
        names = collections.Counter(open(f"/proc/self/task/{t}/comm").read().strip()
                                    for t in os.listdir("/proc/self/task"))
        print("thread names:", dict(names))
        kinds = ("DistributedOptimizer", "DistributedDataParallel", "GPTModel",
                 "_ParamAndGradBuffer", "ChainedOptimizer", "ProcessGroupCollection")
        alive = collections.Counter(type(o).__name__ for o in gc.get_objects()
                                    if type(o).__name__ in kinds)
        print("training objects alive after the runs:", dict(alive))
    dist.destroy_process_group()


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--cycles", type=int, default=4)
    ap.add_argument("--no-distributed-optimizer", action="store_true")
    a = ap.parse_args()
    dopt = not a.no_distributed_optimizer
    mp.spawn(_rank, args=(2, 29600 + int(dopt), a.cycles, dopt), nprocs=2, join=True)


if __name__ == "__main__":
    main()
