"""Checkpoint names of the layer norms, as Megatron-LM's own GPT specs write them.

Megatron-LM's local spec (``get_gpt_layer_local_spec``) keeps the norms as modules of their own
but renames them in ``sharded_state_dict`` (``TransformerLayerSubmodules.
sharded_state_dict_keys_map``), and its Transformer Engine spec fuses them into the linears
(``TELayerNormColumnParallelLinear``), whose parameters carry the same names::

    decoder.layers.input_layernorm.weight     ->  decoder.layers.self_attention.linear_qkv.layer_norm_weight
    decoder.layers.pre_mlp_layernorm.weight   ->  decoder.layers.mlp.linear_fc1.layer_norm_weight
    (and .bias for LayerNorm)

Every layer spec of the plugin (``megatron_metp.specs``: tp, metp, metp_mlp, wallfacer) carries
:data:`NORM_KEYS_MAP`, so a checkpoint written by Megatron-LM's ``pretrain_gpt.py`` (local or TE
spec) and one written under ``--tensor-parallel-mode metp`` or ``wallfacer`` name the same
tensors alike. Only the checkpoint keys change: module and parameter names (``state_dict``)
are Megatron's as before.

Checkpoints written by earlier versions of the plugin keep the plain names (``LEGACY``).
:func:`uses_legacy_norm_keys` tells them apart from the checkpoint's own metadata;
``metp train --load`` reads them with :func:`legacy_norm_keys` (and saves the new names), and
``python -m megatron_metp.checkpoint_keys SRC DST`` writes a renamed copy for Megatron-LM's own
loader, which the Megatron-LM route asks for in one line when ``--load`` holds one.
"""

from __future__ import annotations

import contextlib
import os
import shutil
import sys
from typing import Iterator, Optional

NORM_KEYS_MAP = {
    "input_layernorm.": "self_attention.linear_qkv.layer_norm_",
    "pre_mlp_layernorm.": "mlp.linear_fc1.layer_norm_",
}
# What earlier plugin versions wrote, and what the map renames it to (for checkpoint keys).
LEGACY = {f"{old}{p}": f"{new}{p}" for old, new in NORM_KEYS_MAP.items()
          for p in ("weight", "bias")}
_LEGACY_PROBE = "decoder.layers.input_layernorm.weight"
_METADATA = ".metadata"   # PyTorch distributed checkpoint (Megatron's torch_dist format)


def _read_metadata(ckpt_dir: str):
    from torch.distributed.checkpoint import FileSystemReader

    return FileSystemReader(ckpt_dir).read_metadata()


def uses_legacy_norm_keys(ckpt_dir: str) -> bool:
    """Whether the torch_dist checkpoint in ``ckpt_dir`` (an ``iter_*`` directory) names the
    norms as earlier plugin versions did (``decoder.layers.input_layernorm.weight``). False for
    directories without a distributed checkpoint's metadata (nothing to tell)."""
    if not os.path.isfile(os.path.join(ckpt_dir, _METADATA)):
        return False
    keys = _read_metadata(ckpt_dir).state_dict_metadata
    return any(k == _LEGACY_PROBE or k.endswith("." + _LEGACY_PROBE) for k in keys)


def damage(ckpt_dir: str) -> Optional[str]:
    """What is missing or damaged in the torch_dist checkpoint ``ckpt_dir`` (an ``iter_*``
    directory), in a few words; None when it is whole. Checked before any rank starts: the
    files Megatron's loader opens (``metadata.json``, PyTorch's ``.metadata``, and
    ``common.pt`` where ``metadata.json`` names it, as megatron-core 0.16.1 writes it) exist and
    parse, and every ``.distcp`` file that ``.metadata`` points into exists and is
    long enough for every byte range it records (a truncated copy fails here, not mid-load)."""
    import json

    if not os.path.isdir(ckpt_dir):
        return "the iteration directory named by latest_checkpointed_iteration.txt is missing"
    cfg = os.path.join(ckpt_dir, "metadata.json")
    if not os.path.isfile(cfg):
        return "metadata.json is missing"
    try:
        with open(cfg) as f:
            meta = json.load(f)
    except (OSError, ValueError) as e:
        return f"metadata.json cannot be read ({e.__class__.__name__})"
    if meta.get("sharded_backend") != "torch_dist":
        return None    # other formats are Megatron's to check
    # megatron-core 0.16.1 writes the common state to common.pt (and says so in metadata.json);
    # 0.19 keeps it inside the distributed checkpoint and writes no common.pt.
    if meta.get("common_backend") == "torch":
        common = _common_damage(os.path.join(ckpt_dir, "common.pt"))
        if common:
            return common
    if not os.path.isfile(os.path.join(ckpt_dir, _METADATA)):
        return f"{_METADATA} (PyTorch's index of the shards) is missing"
    try:
        storage = _read_metadata(ckpt_dir).storage_data
    except Exception as e:  # noqa: BLE001 - any unreadable index is damage
        return f"{_METADATA} cannot be read ({e.__class__.__name__})"
    need = {}
    for info in storage.values():
        end = (info.offset or 0) + (info.length or 0)
        need[info.relative_path] = max(need.get(info.relative_path, 0), end)
    for name, end in sorted(need.items()):
        path = os.path.join(ckpt_dir, name)
        if not os.path.isfile(path):
            return f"shard file {name} is missing"
        size = os.path.getsize(path)
        if size < end:
            return f"shard file {name} is truncated ({size} of at least {end} bytes)"
    return None


def _common_damage(path: str) -> Optional[str]:
    """What is wrong with ``common.pt`` (torch.save's zip archive: the run's arguments, RNG and
    iteration), in a few words; None when every member's CRC checks. Nothing is unpickled."""
    import zipfile

    if not os.path.isfile(path):
        return "common.pt is missing"
    try:
        with zipfile.ZipFile(path) as z:
            bad = z.testzip()
    except (OSError, zipfile.BadZipFile, EOFError) as e:
        return (f"common.pt cannot be read ({os.path.getsize(path)} bytes, not a whole torch.save "
                f"archive: {e.__class__.__name__})")
    return None if bad is None else f"common.pt cannot be read (member {bad} fails its CRC)"


def _tracked(root: str) -> Optional[str]:
    """The text of ``root``'s ``latest_checkpointed_iteration.txt``; None without one."""
    tracker = os.path.join(root, "latest_checkpointed_iteration.txt")
    if not os.path.isfile(tracker):
        return None
    with open(tracker, errors="replace") as f:
        return f.read().strip()


def _tracked_dir(root: str, text: str) -> Optional[str]:
    """The directory a tracker's ``text`` names; None where it names no iteration."""
    if text == "release":
        return os.path.join(root, "release")
    return os.path.join(root, f"iter_{int(text):07d}") if text.isdigit() else None


def check_intact(flag: str, root: str) -> None:
    """Raise ValueError with one line when ``root``'s newest checkpoint is damaged."""
    text = _tracked(root)
    if text is not None and _tracked_dir(root, text) is None and \
            not os.path.isfile(os.path.join(root, _METADATA)):
        shown = text if len(text) <= 20 else text[:20] + "..."
        raise ValueError(f"{flag} {root}: latest_checkpointed_iteration.txt holds {shown!r}, not "
                         f"an iteration number or 'release'; write the number of a saved "
                         f"iteration (an iter_NNNNNNN directory there) into it")
    path = latest_checkpoint_dir(root)
    if path is None and text is not None:   # the tracker names a directory that is not there
        path = os.path.join(root, "iter_?")
    if path is None:
        return
    what = damage(path)
    if what:
        raise ValueError(f"{flag} {root}: the checkpoint in {path} is damaged: {what}; restore "
                         f"it from a copy, or load an earlier iteration (point "
                         f"latest_checkpointed_iteration.txt at one that is whole)")


def latest_checkpoint_dir(root: str) -> Optional[str]:
    """The ``iter_*`` directory Megatron-LM (and ``metp train``) would load from ``root``, via
    its ``latest_checkpointed_iteration.txt``; ``root`` itself if it is one; else None."""
    if os.path.isfile(os.path.join(root, _METADATA)):
        return root
    text = _tracked(root)
    path = None if text is None else _tracked_dir(root, text)
    return path if path is not None and os.path.isdir(path) else None


@contextlib.contextmanager
def legacy_norm_keys(model) -> Iterator[None]:
    """While it is open, every ``TransformerLayer`` of ``model`` builds its sharded state dict
    with the plain (legacy) norm names: for loading a checkpoint of an earlier plugin version.
    The map is restored on the way out, so the next save writes Megatron-LM's names."""
    from megatron.core.transformer.transformer_layer import TransformerLayer

    saved = []
    for m in model.modules():
        if isinstance(m, TransformerLayer):
            cfg = m.submodules_config
            saved.append((cfg, cfg.sharded_state_dict_keys_map))
            cfg.sharded_state_dict_keys_map = {k: v for k, v in cfg.sharded_state_dict_keys_map
                                               .items() if k not in NORM_KEYS_MAP}
    try:
        yield
    finally:
        for cfg, keys_map in saved:
            cfg.sharded_state_dict_keys_map = keys_map


def _renamed(key: str) -> str:
    for old, new in LEGACY.items():
        if f"layers.{old}" in key:
            return key.replace(f"layers.{old}", f"layers.{new}")
    return key


def convert(src: str, dst: str) -> int:
    """Copy the checkpoint tree ``src`` to ``dst`` with every legacy norm key renamed (model
    and optimizer entries alike); the tensor files are copied unchanged, only each
    ``iter_*/.metadata`` is rewritten. Returns the number of keys renamed."""
    import pickle

    from torch.distributed.checkpoint.metadata import MetadataIndex

    if os.path.exists(dst):
        raise FileExistsError(f"{dst} exists: name a new directory")
    tmp = dst.rstrip("/") + ".converting"
    shutil.rmtree(tmp, ignore_errors=True)
    shutil.copytree(src, tmp)
    renamed = 0
    for dirpath, _, files in os.walk(tmp):
        if _METADATA not in files:
            continue
        meta = _read_metadata(dirpath)
        new_sd = {}
        for k, v in meta.state_dict_metadata.items():
            nk = _renamed(k)
            renamed += nk != k
            new_sd[nk] = v
        meta.state_dict_metadata = new_sd
        if isinstance(meta.storage_data, dict):
            meta.storage_data = {
                (MetadataIndex(_renamed(i.fqn), i.offset, i.index)
                 if isinstance(i, MetadataIndex) else i): info
                for i, info in meta.storage_data.items()}
        with open(os.path.join(dirpath, _METADATA), "wb") as f:
            pickle.dump(meta, f)
    os.replace(tmp, dst)   # a half-written copy never carries the final name
    return renamed


def main(argv: Optional[list] = None) -> int:
    argv = sys.argv[1:] if argv is None else argv
    if len(argv) != 2 or argv[0].startswith("-"):
        print("usage: python -m megatron_metp.checkpoint_keys SRC DST  (copy a checkpoint "
              "written by megatron-metp 0.1 with Megatron-LM's norm key names)",
              file=sys.stderr)
        return 2
    src, dst = argv
    if not os.path.isdir(src):
        print(f"megatron-metp: {src}: no such checkpoint directory", file=sys.stderr)
        return 2
    try:
        n = convert(src, dst)
    except FileExistsError as e:
        print(f"megatron-metp: {e}", file=sys.stderr)
        return 2
    print(f"megatron-metp: wrote {dst} ({n} keys renamed to Megatron-LM's norm names)")
    return 0


if __name__ == "__main__":
    sys.exit(main())
