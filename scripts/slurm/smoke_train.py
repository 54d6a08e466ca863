"""A minimal data-parallel training run that proves the SLURM launch path (srun -> torchrun ->
c10d rendezvous -> process group -> collectives), for clusters and tests without `metp train`.

Run by torchrun (``ENTRY=scripts/slurm/smoke_train.py``); it accepts and reports the flags the
sbatch scripts pass. Each rank fits y = X w on its own slice of a fixed synthetic data set and
all-reduces the gradient, so the loss only falls if the ranks really communicate; rank 0 prints
one line per step and a final ``SMOKE OK`` line with the world size and the loss ratio.
"""

from __future__ import annotations

import argparse
import os
import sys

import torch
import torch.distributed as dist


def main() -> int:
    p = argparse.ArgumentParser()
    p.add_argument("--train-iters", type=int, default=20)
    p.add_argument("--lr", type=float, default=0.1)
    p.add_argument("--tensor-parallel-mode", default="tp")
    p.add_argument("--tensor-model-parallel-size", type=int, default=1)
    args, rest = p.parse_known_args()

    backend = "nccl" if torch.cuda.is_available() else "gloo"
    dist.init_process_group(backend)
    rank, world = dist.get_rank(), dist.get_world_size()
    device = torch.device("cuda", int(os.environ["LOCAL_RANK"])) if backend == "nccl" else "cpu"
    if rank == 0:
        print(f"smoke: world={world} backend={backend} mode={args.tensor_parallel_mode} "
              f"tp={args.tensor_model_parallel_size} other flags: {' '.join(rest)}", flush=True)

    g = torch.Generator().manual_seed(0)
    x_all = torch.randn(64 * world, 8, generator=g)
    y_all = x_all @ torch.randn(8, 1, generator=g)
    x, y = x_all[rank::world].to(device), y_all[rank::world].to(device)  # this rank's slice
    w = torch.zeros(8, 1, device=device, requires_grad=True)
    losses = []
    for it in range(args.train_iters):
        loss = ((x @ w - y) ** 2).mean()
        loss.backward()
        with torch.no_grad():
            dist.all_reduce(w.grad)  # data parallelism: average the gradients of all ranks
            w -= args.lr * w.grad / world
            w.grad.zero_()
            dist.all_reduce(loss)
        losses.append(loss.item() / world)
        if rank == 0:
            print(f"iteration {it + 1:3d} | loss {losses[-1]:.6f}", flush=True)
    # Every rank must hold the same weights: they saw different data but shared gradients.
    w_max = w.detach().clone()
    dist.all_reduce(w_max, op=dist.ReduceOp.MAX)
    same = torch.equal(w_max, w.detach())
    ok = same and losses[-1] < 0.5 * losses[0]
    if rank == 0:
        print(f"SMOKE {'OK' if ok else 'FAILED'} world={world} "
              f"loss_ratio={losses[-1] / losses[0]:.4f} weights_equal={same}", flush=True)
    dist.destroy_process_group()
    return 0 if ok else 1


if __name__ == "__main__":
    sys.exit(main())
