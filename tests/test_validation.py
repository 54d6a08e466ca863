"""Start-up validation: every rule refuses a bad configuration, naming the flag.

Table-driven: each case is a valid base configuration with a few fields changed, the flag the
error must name, and a fragment of the fix. No process groups: every case runs in microseconds.
The valid bases are checked too, so a rule that rejects good configurations fails here.
"""

from __future__ import annotations

import time
from argparse import Namespace

import pytest

# METP's rules live beside its modules and validate_args calls them; import them (and torch /
# megatron.core behind them) once here so the per-case timings measure the checks alone.
import megatron_metp.metp.attention  # noqa: F401
import megatron_metp.metp.mlp  # noqa: F401
from megatron_metp.validation import (
    MetpConfigError,
    groups_placement,
    validate_args,
)
from megatron_metp.wallfacer.config_generator import PLACEMENTS as GROUP_PLACEMENTS


def _ns(mode="tp", **kw) -> Namespace:
    """A small valid configuration with Megatron-LM's argument names (after the mode remap)."""
    base = dict(
        tensor_parallel_mode=mode, tensor_model_parallel_size=4, context_parallel_size=1,
        pipeline_model_parallel_size=1, virtual_pipeline_model_parallel_size=None,
        num_layers_per_virtual_pipeline_stage=None, sequence_parallel=True, seq_length=64,
        hidden_size=64, num_attention_heads=8, num_query_groups=None,
        group_query_attention=False, kv_channels=None, ffn_hidden_size=256, swiglu=False,
        num_layers=4, num_experts=None, cp_comm_type=["p2p"], wallfacer_team_size=None,
        wallfacer_placement="team-consecutive", world_size=8, use_flash_attn=False,
        micro_batch_size=1, global_batch_size=4, overlap_p2p_comm=True,
    )
    if mode == "wallfacer":  # the remapped form: P = 8 context ranks, TP 1
        base.update(tensor_model_parallel_size=1, context_parallel_size=8,
                    sequence_parallel=False, cp_comm_type=["wallfacer"], world_size=8,
                    global_batch_size=1)
    base.update(kw)
    return Namespace(**base)


GOOD = [
    ("tp", {}),
    ("tp", {"group_query_attention": True, "num_query_groups": 2}),  # fewer groups than p: ok
    ("tp", {"sequence_parallel": False, "seq_length": 30}),  # no SP: s need not divide p
    ("metp", {}),
    ("metp", {"group_query_attention": True, "num_query_groups": 4, "swiglu": True,
              "ffn_hidden_size": None, "hidden_size": 192, "num_attention_heads": 8}),
    ("metp", {"tensor_model_parallel_size": 1, "sequence_parallel": False, "world_size": 1,
              "global_batch_size": 1}),
    ("metp", {"context_parallel_size": 2, "global_batch_size": 1}),  # TP 4 x CP 2, s = 64
    ("metp", {"context_parallel_size": 4, "tensor_model_parallel_size": 2, "world_size": 8,
              "global_batch_size": 1}),  # TP 2 x CP 4
    ("metp_mlp", {"group_query_attention": True, "num_query_groups": 2}),
    ("metp", {"sft": True}),  # packed THD batches at CP 1
    ("wallfacer", {"sft": True}),  # Megatron-LM's THD split under CP
    ("metp", {"sft": True, "context_parallel_size": 2, "global_batch_size": 1}),  # the same
    ("wallfacer", {}),
    ("wallfacer", {"wallfacer_team_size": 2, "context_parallel_size": 4, "world_size": 4}),
    ("wallfacer", {"num_attention_heads": 6, "hidden_size": 48}),  # heads need not divide P
    ("wallfacer", {"tensor_model_parallel_size": 2, "context_parallel_size": 2,
                   "sequence_parallel": True, "world_size": 8, "global_batch_size": 2}),
    ("tp", {"pipeline_model_parallel_size": 4, "tensor_model_parallel_size": 2, "world_size": 8,
            "num_layers": 8, "virtual_pipeline_model_parallel_size": 2, "global_batch_size": 1}),
]

# (id, mode, overrides, flag the message must name, fragment of the message)
BAD = [
    ("unknown-mode", "tp", {"tensor_parallel_mode": "ulysses"}, "--tensor-parallel-mode",
     "choose one of"),
    ("world-not-product", "tp", {"world_size": 6}, "--tensor-model-parallel-size",
     "multiple of 4"),
    ("world-with-cp-pp", "tp", {"context_parallel_size": 2, "pipeline_model_parallel_size": 2,
                                "world_size": 8}, "--context-parallel-size", "multiple of 16"),
    ("size-zero", "tp", {"pipeline_model_parallel_size": 0}, "--pipeline-model-parallel-size",
     ">= 1"),
    ("pp-layers", "tp", {"pipeline_model_parallel_size": 2, "num_layers": 3, "world_size": 8,
                         "tensor_model_parallel_size": 2, "global_batch_size": 2},
     "--pipeline-model-parallel-size", "divisor of 3"),
    ("vpp-layers", "tp", {"pipeline_model_parallel_size": 4, "tensor_model_parallel_size": 2,
                          "num_layers": 8, "virtual_pipeline_model_parallel_size": 3,
                          "global_batch_size": 1}, "--num-virtual-stages-per-pipeline-rank",
     "does not divide"),
    ("vpp-per-stage", "tp", {"pipeline_model_parallel_size": 2, "tensor_model_parallel_size": 4,
                             "num_layers": 8, "num_layers_per_virtual_pipeline_stage": 3,
                             "world_size": 8, "global_batch_size": 1},
     "--num-layers-per-virtual-pipeline-stage", "does not divide"),
    ("vpp-needs-pp", "tp", {"pipeline_model_parallel_size": 2, "tensor_model_parallel_size": 4,
                            "num_layers": 8, "virtual_pipeline_model_parallel_size": 2,
                            "overlap_p2p_comm": False, "global_batch_size": 1},
     "--pipeline-model-parallel-size", ">= 3"),
    ("hidden-heads", "tp", {"hidden_size": 60}, "--num-attention-heads", "dividing"),
    ("groups-divide-heads", "tp", {"group_query_attention": True, "num_query_groups": 3},
     "--num-query-groups", "must divide"),
    ("gbs", "tp", {"global_batch_size": 3}, "--global-batch-size", "multiple of 2"),
    ("warmup", "tp", {"lr_warmup_iters": 5, "train_iters": 4}, "--lr-warmup-iters",
     "shorten the warm-up"),
    ("tp-heads", "tp", {"num_attention_heads": 6, "hidden_size": 48}, "--num-attention-heads",
     "divisible by --tensor-model-parallel-size"),
    # 3 groups on TP 2: neither a multiple nor a divisor (Megatron-Core's TransformerConfig rule).
    ("tp-groups-neither", "tp", {"tensor_model_parallel_size": 2, "group_query_attention": True,
                                 "num_query_groups": 3, "num_attention_heads": 6,
                                 "hidden_size": 48, "global_batch_size": 4},
     "--num-query-groups", "multiple or a divisor"),
    ("tp-ffn", "tp", {"ffn_hidden_size": 250}, "--ffn-hidden-size", "multiple of 4"),
    ("tp-seq-sp", "tp", {"seq_length": 30}, "--seq-length", "--sequence-parallel"),
    ("tp-cp-seq", "tp", {"context_parallel_size": 2, "world_size": 8, "seq_length": 34,
                         "global_batch_size": 1}, "--seq-length", "load-balanced"),
    ("metp-sp-off", "metp", {"sequence_parallel": False}, "--sequence-parallel",
     "sequence"),
    # METP x CP: allowed with an even TP size and s % (TP x CP) == 0 (GOOD);
    # refused: an odd TP size, a sequence that does not split into TP blocks per CP rank, a CP
    # communication type of Megatron's, hierarchical CP, and metp_mlp (Megatron's attention).
    ("metp-cp-odd-tp", "metp", {"context_parallel_size": 2, "tensor_model_parallel_size": 1,
                                "sequence_parallel": False, "world_size": 2,
                                "global_batch_size": 1},
     "--tensor-model-parallel-size", "even"),
    ("metp-cp-seq", "metp", {"context_parallel_size": 2, "seq_length": 68,
                             "global_batch_size": 1}, "--seq-length", "multiple of 16"),
    ("metp-cp-comm-type-a2a", "metp", {"context_parallel_size": 2, "cp_comm_type": ["a2a"],
                                       "global_batch_size": 1}, "--cp-comm-type", "K/V ring"),
    ("metp-cp-hierarchical", "metp", {"context_parallel_size": 2, "global_batch_size": 1,
                                      "hierarchical_context_parallel_sizes": [2, 1]},
     "--hierarchical-context-parallel-sizes", "K/V ring"),
    ("metp-mlp-cp", "metp_mlp", {"context_parallel_size": 2, "global_batch_size": 1},
     "--context-parallel-size", "use --tensor-parallel-mode metp"),
    ("metp-moe", "metp", {"num_experts": 8}, "--num-experts", "drop --num-experts"),
    ("metp-mla", "metp", {"multi_latent_attention": True}, "--multi-latent-attention", "MLA"),
    ("metp-tp-overlap", "metp", {"tp_comm_overlap": True}, "--tp-comm-overlap", "overlap"),
    ("metp-legacy", "metp", {"use_legacy_models": True}, "--use-legacy-models", "Megatron-Core"),
    ("metp-ffn", "metp", {"ffn_hidden_size": 250}, "--ffn-hidden-size", "ring"),
    ("metp-mtp", "metp", {"mtp_num_layers": 1}, "--mtp-num-layers", "multi-token"),
    ("metp-hidden", "metp", {"hidden_size": 66, "num_attention_heads": 6,
                             "tensor_model_parallel_size": 4}, "--hidden-size", "multiple of 4"),
    ("metp-heads", "metp", {"hidden_size": 64, "num_attention_heads": 2, "world_size": 8},
     "--num-attention-heads", "ring length"),
    ("metp-groups", "metp", {"group_query_attention": True, "num_query_groups": 2},
     "--num-query-groups", "tp mode allows fewer groups"),
    ("metp-attention-dropout", "metp", {"attention_dropout": 0.1}, "--attention-dropout", "0"),
    ("metp-window", "metp", {"window_size": (64, 0)}, "--window-size", "metp"),
    ("metp-reset-mask", "metp", {"reset_attention_mask": True}, "--reset-attention-mask",
     "packed_seq_params"),
    ("wf-reset-mask", "wallfacer", {"reset_attention_mask": True}, "--reset-attention-mask",
     "packed_seq_params"),
    ("metp-seq", "metp", {"seq_length": 30}, "--seq-length", "s/p"),
    ("metp-heterogeneous", "metp", {"heterogeneous_layers_config_path": "layers.json"},
     "--heterogeneous-layers-config-path", "one layer spec"),
    ("wf-attention-variant", "wallfacer", {"experimental_attention_variant": "gated_delta_net"},
     "--experimental-attention-variant", "drop"),
    ("metp-spec", "metp", {"spec": ["my.module", "my_spec"]}, "--spec", "drop --spec"),
    ("metp-team-size", "metp", {"wallfacer_team_size": 2}, "--wallfacer-team-size",
     "applies only"),
    ("metp-cp-comm-type", "metp", {"cp_comm_type": ["wallfacer"]}, "--cp-comm-type",
     "needs --tensor-parallel-mode wallfacer"),
    ("metp-mlp-groups-tp-rule", "metp_mlp", {"group_query_attention": True,
                                             "num_query_groups": 2, "num_attention_heads": 6,
                                             "hidden_size": 48, "ffn_hidden_size": 192},
     "--num-attention-heads", "divisible"),
    ("wf-team-not-square-divisor", "wallfacer", {"wallfacer_team_size": 2,
                                                 "context_parallel_size": 2, "global_batch_size": 4},
     "--wallfacer-team-size", "valid team sizes for P = 2 are [1]"),
    ("wf-team-3", "wallfacer", {"wallfacer_team_size": 3, "context_parallel_size": 8},
     "--wallfacer-team-size", "C^2"),
    ("wf-team-bad-string", "wallfacer", {"wallfacer_team_size": "two"}, "--wallfacer-team-size",
     "'auto'"),
    ("wf-seq-zigzag", "wallfacer", {"seq_length": 72}, "--seq-length", "zigzag"),
    ("wf-cp-comm-type", "wallfacer", {"cp_comm_type": ["a2a"]}, "--cp-comm-type", "drop"),
    ("wf-cp-comm-type-per-layer", "wallfacer", {"cp_comm_type": ["wallfacer", "p2p"]},
     "--cp-comm-type", "drop"),
    ("wf-groups-tp-inside", "wallfacer", {"tensor_model_parallel_size": 2,
                                          "context_parallel_size": 2, "sequence_parallel": True,
                                          "group_query_attention": True, "num_query_groups": 1,
                                          "global_batch_size": 2},
     "--num-query-groups", "divisible"),
    ("wf-placement", "wallfacer", {"wallfacer_placement": "node-major"}, "--wallfacer-placement",
     "team-consecutive"),
    ("wf-moe", "wallfacer", {"num_experts": 4}, "--num-experts", "no MoE"),
    ("wf-hier-cp", "wallfacer", {"hierarchical_context_parallel_sizes": [2, 4]},
     "--hierarchical-context-parallel-sizes", "sub-rings"),
    ("wf-tp-inside-heads", "wallfacer", {"tensor_model_parallel_size": 2,
                                         "context_parallel_size": 2, "sequence_parallel": True,
                                         "num_attention_heads": 3, "hidden_size": 48,
                                         "global_batch_size": 2},
     "--num-attention-heads", "divisible"),
    ("wf-attention-dropout", "wallfacer", {"attention_dropout": 0.1}, "--attention-dropout",
     "no attention dropout"),
    ("wf-softmax", "wallfacer", {"softmax_type": "learnable"}, "--softmax-type", "vanilla"),
    ("wf-team-zero", "wallfacer", {"wallfacer_team_size": 0}, "--wallfacer-team-size", "C^2"),
]

@pytest.mark.parametrize("mode,kw", GOOD, ids=[f"{m}-{i}" for i, (m, _) in enumerate(GOOD)])
def test_valid_configurations_pass(mode, kw):
    ns = _ns(mode, **kw)
    assert validate_args(ns, flash_attn_available=lambda: False) is ns


@pytest.mark.parametrize("case,mode,kw,flag,fragment", BAD, ids=[b[0] for b in BAD])
def test_bad_configuration_names_the_flag(case, mode, kw, flag, fragment):
    ns = _ns(mode, **kw)
    t0 = time.perf_counter()
    with pytest.raises(MetpConfigError) as info:
        validate_args(ns, flash_attn_available=lambda: True)
    elapsed = time.perf_counter() - t0
    msg = str(info.value)
    assert isinstance(info.value, ValueError)
    assert flag in msg, msg
    assert fragment in msg, msg
    assert elapsed < 1.0  # pure argument checks; no process group, no import of a model


def test_team_size_auto_is_accepted():
    # 'auto' is resolved after the groups exist (the topology scheduler profiles each C).
    validate_args(_ns("wallfacer", wallfacer_team_size="auto"))


def test_flash_attn_requested_but_absent():
    with pytest.raises(MetpConfigError, match="--use-flash-attn"):
        validate_args(_ns("metp", use_flash_attn=True), flash_attn_available=lambda: False)
    # Present: the same configuration passes.
    validate_args(_ns("metp", use_flash_attn=True), flash_attn_available=lambda: True)


def test_rules_count():
    # At least 20 table-driven cases.
    assert len(BAD) + 1 >= 20


def test_placement_names_map_to_the_config_generator():
    assert groups_placement("team-consecutive") == "collective_intra"
    assert groups_placement("ring-consecutive") == "p2p_intra"
    assert {groups_placement(p) for p in ("team-consecutive", "ring-consecutive")} == set(
        GROUP_PLACEMENTS)
    # The generator's own names are accepted too (e.g. from a metp train config).
    validate_args(_ns("wallfacer", wallfacer_placement="p2p_intra"))
