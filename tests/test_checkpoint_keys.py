"""Checkpoint keys as Megatron-LM's own GPT spec writes them.

* Every mode's model (tp, metp, wallfacer; GPT and LLaMA) has exactly the sharded-state-dict
  keys, global shapes and shard layout of a ``GPTModel`` built from Megatron-Core's
  ``get_gpt_layer_local_spec()`` (the spec ``pretrain_gpt.py --transformer-impl local`` builds;
  its TE spec writes the same norm names), at p = 2.
* A checkpoint of megatron-metp 0.1 (plain norm names) still loads through ``metp train``'s
  loader, bit for bit, and ``python -m megatron_metp.checkpoint_keys`` converts one into a copy
  that Megatron-Core's own loader reads under the new names, bit for bit.

(Whole-run transfers between pretrain_gpt.py and the modes: tests/test_megatron_lm_training.py.)
"""

from __future__ import annotations

import os

import pytest
import torch
import torch.distributed as dist

from tests import _models as M
from tests._harness import run_ranks


def _stock_model(style: str):
    """Megatron-Core's GPTModel with its own local spec, as pretrain_gpt.py builds it, with the
    same config and sizes as ``tests._models.build``."""
    from megatron.core.models.gpt import GPTModel
    from megatron.core.models.gpt.gpt_layer_specs import get_gpt_layer_local_spec

    from megatron_metp.model import make_config

    # Without apex the local spec's norm is WrappedTorchNorm, which refuses sequence
    # parallelism; SP changes no checkpoint key or shape, so the stock model is built without it.
    config = make_config(style=style, num_layers=2, hidden_size=32, num_attention_heads=4,
                         sequence_parallel=False)
    spec = get_gpt_layer_local_spec(normalization=config.normalization)
    return GPTModel(config, spec, vocab_size=M.VOCAB, max_sequence_length=M.SEQ,
                    position_embedding_type="rope" if style == "llama" else "learned_absolute",
                    share_embeddings_and_output_weights=False)


def _layout(model) -> dict:
    """{checkpoint key: (global shape, this rank's global offsets)} of the model's tensors."""
    from megatron.core.dist_checkpointing.mapping import ShardedTensor, ShardedTensorFactory
    from megatron.core.dist_checkpointing.dict_utils import nested_values

    out = {}
    for item in nested_values(model.sharded_state_dict()):
        if isinstance(item, ShardedTensorFactory):
            built = item.build()
            items = (list(nested_values(built)) if isinstance(built, (dict, list, tuple))
                     else [built])
        else:
            items = [item]
        for t in items:
            if isinstance(t, ShardedTensor):
                out.setdefault(t.key, []).append((tuple(t.global_shape), tuple(t.global_offset)))
    return {k: sorted(v) for k, v in out.items()}


def _keys_task():
    from megatron_metp.model import destroy_parallel

    res = {}
    for mode in ("tp", "metp", "wallfacer"):
        for style in ("gpt", "llama"):
            M.setup(tp=2, mode=mode)
            if mode != "wallfacer":
                stock = _layout(_stock_model(style))
            else:
                # WallFacer runs on CP 2 with TP 1. CP shards no weight (and Megatron's local
                # core attention refuses CP), so the stock model at TP 1 has its keys and shapes.
                destroy_parallel()
                M.setup(tp=1, mode="tp")
                stock = _layout(_stock_model(style))
                destroy_parallel()
                M.setup(tp=1, mode="wallfacer", context_parallel_size=2)
            mine = _layout(M.build(mode, style))
            destroy_parallel()
            res[f"{mode}/{style}"] = dict(
                only_stock=sorted(set(stock) - set(mine)),
                only_mine=sorted(set(mine) - set(stock)),
                differ=sorted(k for k in set(stock) & set(mine)
                              if k != "embedding.position_embeddings.weight"
                              and stock[k] != mine[k]),
                norm=[k for k in mine if "layer_norm_weight" in k])
    return res


def test_every_mode_writes_megatron_lm_checkpoint_keys(report):
    out = run_ranks(2, _keys_task)
    for rank in out:
        for case, r in rank.items():
            assert r["only_stock"] == [] and r["only_mine"] == [], (case, r)
            # Same global shapes and shard offsets (METP's position table shard holds two
            # chunks of the sequence under the balanced layout and is checked by
            # test_checkpoints_load_across_modes_and_sizes instead).
            assert r["differ"] == [], (case, r["differ"])
            assert sorted(r["norm"]) == [
                "decoder.layers.mlp.linear_fc1.layer_norm_weight",
                "decoder.layers.self_attention.linear_qkv.layer_norm_weight"], (case, r["norm"])
    report("checkpoint keys = Megatron-Core's local GPT spec's (p = 2): "
           + ", ".join(sorted(out[0])))


def _same(a, b) -> bool:
    pa, pb = dict(a.named_parameters()), dict(b.named_parameters())
    return sorted(pa) == sorted(pb) and all(torch.equal(pa[n], pb[n]) for n in pa)


def _legacy_task(root: str):
    """Write a model-only checkpoint the way megatron-metp 0.1 did (plain norm keys), then read
    it back through metp train's loader into a model with other weights."""
    from megatron.core import dist_checkpointing

    from megatron_metp import checkpoint_keys as ck
    from megatron_metp.model import destroy_parallel
    from megatron_metp.training import train_checkpoint as tc

    class Sched:
        def state_dict(self):
            return {"num_steps": 0}

        def load_state_dict(self, state):
            self.state = state

    M.setup(tp=2, mode="metp")
    src = M.build("metp", "llama", seed=1)
    with ck.legacy_norm_keys(src), M.child_processes_allowed():
        tc.save(root, 0, [src], None, Sched())
    path = tc._ckpt_dir(root, 0)
    legacy = ck.uses_legacy_norm_keys(path)
    dst = M.build("metp", "llama", seed=2)
    tc.load(root, [dst], None, Sched())
    via_loader = _same(src, dst)
    dist.barrier()
    converted = root + "-converted"
    if dist.get_rank() == 0:
        renamed = ck.convert(root, converted)
    dist.barrier()
    new_path = tc._ckpt_dir(converted, 0)
    # Megatron-Core's own loader under the new names (no legacy handling in between).
    third = M.build("metp", "llama", seed=3)
    loaded = dist_checkpointing.load({"model": third.sharded_state_dict()}, new_path)
    third.load_state_dict(loaded["model"])
    via_megatron = _same(src, third)
    differs = not _same(src, M.build("metp", "llama", seed=2))
    # Megatron-LM's route refuses the old one at argument time, naming the conversion, and
    # takes the converted one.
    from types import SimpleNamespace

    from megatron_metp.megatron_lm import check_load_keys
    from megatron_metp.validation import MetpConfigError

    try:
        check_load_keys(SimpleNamespace(load=root))
        refusal = None
    except MetpConfigError as e:
        refusal = str(e)
    check_load_keys(SimpleNamespace(load=converted))
    destroy_parallel()
    return dict(refusal=refusal, legacy=legacy, converted_legacy=ck.uses_legacy_norm_keys(new_path),
                via_loader=via_loader, via_megatron=via_megatron, differs=differs,
                renamed=renamed if dist.get_rank() == 0 else None)


def test_plugin_0_1_checkpoints_load_and_convert(tmp_path, report):
    out = run_ranks(2, _legacy_task, str(tmp_path / "ckpt"))
    for r in out:
        assert r["differs"]          # the seeds give other weights: the load did the work
        assert r["legacy"] and not r["converted_legacy"], r
        assert r["via_loader"] and r["via_megatron"], r
        assert r["refusal"] and "\n" not in r["refusal"], r
        assert "python -m megatron_metp.checkpoint_keys" in r["refusal"], r
    # 2 layers share one stacked key per norm tensor: input_layernorm and pre_mlp_layernorm
    # weights (RMSNorm: no bias).
    assert out[0]["renamed"] == 2, out[0]
    report(f"megatron-metp 0.1 checkpoint (plain norm keys): metp train's loader and the "
           f"converted copy ({out[0]['renamed']} keys renamed) both load bit for bit")


def test_convert_refuses_an_existing_destination(tmp_path, capsys):
    from megatron_metp import checkpoint_keys as ck

    src, dst = tmp_path / "a", tmp_path / "b"
    src.mkdir()
    dst.mkdir()
    assert ck.main([str(src), str(dst)]) == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1 and "exists" in err[0]
    assert ck.main([str(tmp_path / "none"), str(tmp_path / "c")]) == 2
    assert not os.path.exists(tmp_path / "c")


if __name__ == "__main__":
    pytest.main([__file__])
