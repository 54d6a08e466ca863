"""A damaged checkpoint is refused before any rank starts, in one line naming the directory and
what is missing or damaged, in ``metp train`` and on the Megatron-LM route;
``--exit-on-missing-checkpoint`` refuses a ``--load`` that holds none.

The checkpoint is a real torch_dist one, as Megatron's ``dist_checkpointing.save`` lays it out
(``metadata.json``, ``common.pt``, PyTorch's ``.metadata`` and ``.distcp`` shards), written in
this process by ``torch.distributed.checkpoint`` without a process group."""

from __future__ import annotations

import argparse
import json
import os
import re
import shutil

import pytest
import torch

from megatron_metp import megatron_lm as mlm
from megatron_metp.checkpoint_keys import damage
from megatron_metp.training import cli
from megatron_metp.validation import MetpConfigError


def _checkpoint(root) -> str:
    import torch.distributed.checkpoint as dcp

    it = os.path.join(root, "iter_0000005")
    os.makedirs(it)
    dcp.save({"w": torch.arange(4096, dtype=torch.float32), "b": torch.ones(7)},
             checkpoint_id=it, no_dist=True)
    with open(os.path.join(it, "metadata.json"), "w") as f:
        json.dump({"sharded_backend": "torch_dist", "sharded_backend_version": 1,
                   "common_backend": "torch", "common_backend_version": 1}, f)
    torch.save({"iteration": 5}, os.path.join(it, "common.pt"))
    with open(os.path.join(root, "latest_checkpointed_iteration.txt"), "w") as f:
        f.write("5")
    return it


def _truncate(it):
    shard = next(n for n in os.listdir(it) if n.endswith(".distcp"))
    path = os.path.join(it, shard)
    with open(path, "r+b") as f:
        f.truncate(os.path.getsize(path) // 2)
    return f"shard file {shard} is truncated"


def _cut(it, name, what):
    """Truncate ``name`` to half its length; return the words the refusal must hold."""
    path = os.path.join(it, name)
    with open(path, "r+b") as f:
        f.truncate(os.path.getsize(path) // 2)
    return what


def _garble(it, name, what):
    """Overwrite ``name`` with bytes of its own length that are no valid file of its kind."""
    path = os.path.join(it, name)
    size = max(os.path.getsize(path), 16)
    with open(path, "wb") as f:
        f.write(b"\x00\xff" * (size // 2))
    return what


def _tracker(it, text):
    with open(os.path.join(os.path.dirname(it), "latest_checkpointed_iteration.txt"), "w") as f:
        f.write(text)
    return "latest_checkpointed_iteration.txt holds"


# Each file Megatron-LM's loader opens, missing, truncated and garbled. A garbled .distcp shard
# of the right length is not among them: only reading every tensor would tell, which is the
# load itself (the check reads no shard).
DAMAGE = {
    "truncated shard": _truncate,
    "truncated common.pt": lambda it: _cut(it, "common.pt", "common.pt cannot be read"),
    "garbled common.pt": lambda it: _garble(it, "common.pt", "common.pt cannot be read"),
    "truncated metadata.json": lambda it: _cut(it, "metadata.json",
                                               "metadata.json cannot be read"),
    "garbled metadata.json": lambda it: _garble(it, "metadata.json",
                                                "metadata.json cannot be read"),
    "truncated .metadata": lambda it: _cut(it, ".metadata", ".metadata cannot be read"),
    "empty tracker": lambda it: _tracker(it, ""),
    "garbled tracker": lambda it: _tracker(it, "\x00\x01iter"),
    "missing shard": lambda it: (os.remove(os.path.join(it, next(
        n for n in os.listdir(it) if n.endswith(".distcp")))), "is missing")[1],
    "no metadata.json": lambda it: (os.remove(os.path.join(it, "metadata.json")),
                                    "metadata.json is missing")[1],
    # megatron-core 0.16.1 names common.pt in metadata.json (0.19 writes neither).
    "no common.pt": lambda it: (os.remove(os.path.join(it, "common.pt")),
                                "common.pt is missing")[1],
    "no .metadata": lambda it: (os.remove(os.path.join(it, ".metadata")),
                                ".metadata (PyTorch's index of the shards) is missing")[1],
    "garbled .metadata": lambda it: (open(os.path.join(it, ".metadata"), "wb").write(b"x" * 9),
                                     ".metadata cannot be read")[1],
    "no iteration dir": lambda it: (shutil.rmtree(it), "iteration directory")[1],
}


@pytest.mark.parametrize("case", list(DAMAGE))
def test_damage_is_named_in_both_routes(case, tmp_path, capsys):
    root = str(tmp_path / "ckpt")
    it = _checkpoint(root)
    assert damage(it) is None                      # whole: nothing to say
    what = DAMAGE[case](it)
    # metp train: exit 2, one line, before any rank (the launcher never starts).
    rc = cli.main(["train", "--load", root, "--nproc-per-node", "2", "--train-iters", "6"])
    err = [ln for ln in capsys.readouterr().err.splitlines() if ln.strip()]
    assert rc == 2 and len(err) == 1, err
    assert f"--load {root}" in err[0] and what in err[0], err[0]
    assert "restore" in err[0] or "write the number" in err[0], err[0]   # and the fix
    # The Megatron-LM route's start-up check (run in parse_args' hook).
    with pytest.raises(MetpConfigError, match=f"--load {re.escape(root)}: .*{re.escape(what[:20])}"):
        mlm.check_load_keys(argparse.Namespace(load=root, exit_on_missing_checkpoint=False))


def test_exit_on_missing_checkpoint(tmp_path, capsys):
    empty = str(tmp_path / "none")
    rc = cli.main(["train", "--load", empty, "--exit-on-missing-checkpoint",
                   "--nproc-per-node", "2", "--train-iters", "6"])
    err = [ln for ln in capsys.readouterr().err.splitlines() if ln.strip()]
    assert rc == 2 and len(err) == 1 and "--exit-on-missing-checkpoint" in err[0], err
    with pytest.raises(MetpConfigError, match="no checkpoint there"):
        mlm.check_load_keys(argparse.Namespace(load=empty, exit_on_missing_checkpoint=True))
    mlm.check_load_keys(argparse.Namespace(load=empty, exit_on_missing_checkpoint=False))
