"""Config schema (unknown/missing keys, types, derived defaults), the shipped configs, and the
FLOP formula against hand counts."""

from __future__ import annotations

from pathlib import Path

import pytest

from megatron_metp.models.config import ConfigError, load_config, parse_config
from megatron_metp.models.flops import FlopModel, gpu_peak_tflops, throughput, training_flops

CONFIGS = sorted((Path(__file__).resolve().parents[1] / "configs").glob("*.yaml"))
BASE = dict(num_layers=2, hidden_size=64, num_attention_heads=4)


def test_every_shipped_config_loads():
    names = {p.stem for p in CONFIGS}
    assert {"tiny-gpt", "tiny-llama", "bert-large", "llama-7b", "llama-70b", "gpt-175b",
            "wallfacer-gpt-3b", "wallfacer-gpt-7b", "dit-1b", "llama3-8b"} <= names
    for p in CONFIGS:
        cfg = load_config(p)
        assert cfg.hidden_size % cfg.num_attention_heads == 0, p
        if p.stem.startswith("tiny-"):
            continue
        # the papers' configs name the source of every model field in a comment
        for line in p.read_text().splitlines():
            if line.strip() and not line.startswith((" ", "#")):
                key = line.split(":")[0]
                if key not in ("name", "description", "architecture"):
                    assert "#" in line, f"{p.name}: {key} has no source comment"


def test_paper_values():
    # METP Table 3 and WallFacer Table 3, plus the public-config fields.
    l70 = load_config("llama-70b")
    assert (l70.num_layers, l70.hidden_size, l70.num_attention_heads, l70.layers_per_device,
            l70.num_query_groups, l70.ffn_hidden_size) == (80, 8192, 64, 5, 8, 28672)
    g175 = load_config("gpt-175b")
    assert (g175.num_layers, g175.hidden_size, g175.num_attention_heads,
            g175.layers_per_device) == (96, 12288, 96, 1)
    g3 = load_config("wallfacer-gpt-3b")
    assert (g3.num_layers, g3.hidden_size) == (16, 4096) and 4096 % g3.num_attention_heads == 0
    assert not load_config("dit-1b").causal and load_config("tiny-gpt").causal
    bert = load_config("bert-large")
    assert (bert.num_layers, bert.hidden_size, bert.num_attention_heads) == (24, 1024, 16)
    l3 = load_config("llama3-8b")
    assert (l3.num_layers, l3.hidden_size, l3.num_attention_heads, l3.num_query_groups,
            l3.ffn_hidden_size, l3.vocab_size) == (32, 4096, 32, 8, 14336, 128256)
    # Its parameters counted from the fields, against Meta's published 8.03 B (model card):
    # two untied 128,256 x 4096 tables; per layer Q, O (h x h), K, V (h x h/4), SwiGLU's three
    # h x 14,336 matrices and two norms; the final norm. The card rounds to 0.01 B.
    h, f, kv = l3.hidden_size, l3.ffn_hidden_size, l3.kv_channels * l3.num_query_groups
    layer = 2 * h * h + 2 * h * kv + 3 * h * f + 2 * h
    total = 2 * l3.vocab_size * h + l3.num_layers * layer + h
    assert abs(total / 1e9 - 8.03) < 0.005, total


def test_defaults_follow_megatron():
    c = parse_config(dict(BASE))
    assert (c.ffn_hidden_size, c.kv_channels, c.num_query_groups) == (256, 16, 4)
    c = parse_config(dict(BASE, hidden_size=4096, num_attention_heads=32, swiglu=True))
    assert c.ffn_hidden_size == 10880  # Megatron-LM: int(4h * 2/3 / 64) * 64
    ns = parse_config(dict(BASE, num_query_groups=2)).namespace(tensor_model_parallel_size=2)
    assert ns.group_query_attention and ns.num_query_groups == 2


@pytest.mark.parametrize("data,match", [
    (dict(BASE, hiden_size=64), r"unknown key 'hiden_size' \(did you mean 'hidden_size'\?\)"),
    ({"num_layers": 2, "num_attention_heads": 4},
     r"missing required key 'hidden_size'.*--hidden-size"),
    (dict(BASE, num_layers="two"), r"num_layers \(--num-layers\) must be int"),
    (dict(BASE, swiglu=1), r"swiglu \(--swiglu\) must be bool"),
    (dict(BASE, normalization="BatchNorm"), r"normalization .* must be one of LayerNorm, RMSNorm"),
    (dict(BASE, num_attention_heads=5), r"not divisible by num_attention_heads 5"),
    (dict(BASE, num_query_groups=3), r"--num-query-groups\) must divide"),
    (dict(BASE, tensor_parallel_mode="zero"), r"tensor_parallel_mode .* must be one of"),
    (dict(BASE, lr=-1.0), r"lr \(--lr\) must be >= 0"),
    ([1, 2], r"a YAML mapping"),
])
def test_schema_errors(data, match):
    with pytest.raises(ConfigError, match=match):
        parse_config(data)


def test_unknown_config_name():
    with pytest.raises(ConfigError, match=r"--config nope.*known configs:.*tiny-gpt"):
        load_config("nope")


def test_flops_hand_count():
    # tiny GPT: L=2, h=64, 4 heads (d=16), MHA, f=256, V=384, B=8, s=32, causal.
    m = FlopModel(num_layers=2, hidden_size=64, num_attention_heads=4, num_query_groups=4,
                  kv_channels=16, ffn_hidden_size=256, padded_vocab_size=384)
    # Per token, forward multiply-adds: QKV 64*192 = 12288, scores QK^T and AV over half of the
    # 32 keys: 2 * 64 * 16 = 2048, projection 64*64 = 4096, MLP 2*64*256 = 32768
    # -> 51200 per layer, x2 layers = 102400, logits 64*384 = 24576: 126976 MACs per token.
    # x 2 FLOPs/MAC x 3 (fwd + wgrad + dgrad) x 256 tokens.
    assert training_flops(m, batch_size=8, seq_length=32) == 126976 * 2 * 3 * 256
    # SwiGLU adds a third f x h GEMM; GQA (1 group) shrinks K and V to one head each; full
    # (non-causal) attention counts all 32 keys.
    m2 = FlopModel(2, 64, 4, 1, 16, 256, 384, swiglu=True, causal=False)
    per_layer = 64 * (64 + 2 * 16) + 2 * 64 * 32 + 64 * 64 + 3 * 64 * 256
    assert training_flops(m2, 8, 32) == 6 * 256 * (2 * per_layer + 64 * 384)


def test_mfu_only_with_a_gpu_peak():
    assert gpu_peak_tflops("NVIDIA H100 80GB HBM3") == 989.0
    assert gpu_peak_tflops("NVIDIA H100 PCIe") == 756.0
    assert gpu_peak_tflops("NVIDIA A100-SXM4-80GB") == 312.0
    tflops, mfu = throughput(2e12, seconds=1.0, num_devices=2)
    assert tflops == 1.0 and mfu is None
    assert throughput(989e12, 1.0, 1, peak_tflops=989.0)[1] == 1.0
