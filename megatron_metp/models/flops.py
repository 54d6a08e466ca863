"""Training FLOPs per iteration (Megatron-LM's formula) and MFU against a GPU's dense bf16 peak.

Re-implemented from the description of ``num_floating_point_operations`` in Megatron-LM's
``megatron/training/training.py`` (dense GPT, MHA or GQA; no MoE, MLA or MTP). Every GEMM is
counted 3 times (forward, weight gradient, data gradient) at 2 FLOPs per multiply-add, so with
B samples of s tokens, L layers, hidden h, FFN width f, q = kv_channels * heads,
k = kv_channels * query_groups and padded vocabulary V::

    F = 6 B s [ L ( h (q + 2k)          QKV projection
                  + 2 q s / 2           QK^T and (QK^T)V, half the scores under a causal mask
                  + q h                 output projection
                  + g h f )             MLP, g = 3 with SwiGLU (h->2f and f->h), else 2
              + h V ]                   logits

Megatron-LM counts the causal half only; ``causal=False`` (DiT-style full attention) counts the
whole score matrix. Activation recomputation is not counted (model FLOPs, as in MFU).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Optional

# Dense (no sparsity) bf16 tensor-core peaks from NVIDIA's data sheets, TFLOP/s per GPU,
# matched against ``torch.cuda.get_device_name()`` in this order (first match wins).
GPU_BF16_PEAK_TFLOPS = (
    ("H200", 989.0),
    ("H100 PCIe", 756.0),
    ("H100", 989.0),      # SXM / HBM3
    ("H800", 989.0),
    ("GH200", 989.0),
    ("B200", 2250.0),
    ("A100", 312.0),
    ("A800", 312.0),
    ("L40S", 362.0),
    ("A10G", 70.0),
    ("A10", 125.0),
    ("V100", 125.0),      # V100 has no bf16; fp16 tensor-core peak
)


@dataclass(frozen=True)
class FlopModel:
    """The model quantities the formula needs (Megatron-LM argument names)."""

    num_layers: int
    hidden_size: int
    num_attention_heads: int
    num_query_groups: int
    kv_channels: int
    ffn_hidden_size: int
    padded_vocab_size: int
    swiglu: bool = False
    causal: bool = True


def training_flops(m: FlopModel, batch_size: int, seq_length: int) -> float:
    """FLOPs of one training iteration over ``batch_size`` samples of ``seq_length`` tokens."""
    h, s = m.hidden_size, seq_length
    q = m.kv_channels * m.num_attention_heads
    kv = m.kv_channels * m.num_query_groups
    score_fraction = 0.5 if m.causal else 1.0
    attention = h * (q + 2 * kv) + 2 * q * s * score_fraction + q * h
    mlp = (3 if m.swiglu else 2) * h * m.ffn_hidden_size
    logits = h * m.padded_vocab_size
    return 3 * 2 * batch_size * s * (m.num_layers * (attention + mlp) + logits)


def gpu_peak_tflops(device_name: Optional[str] = None) -> Optional[float]:
    """Dense bf16 peak of the current (or named) GPU; None on CPU or an unknown GPU."""
    if device_name is None:
        import torch

        if not torch.cuda.is_available():
            return None
        device_name = torch.cuda.get_device_name()
    for key, peak in GPU_BF16_PEAK_TFLOPS:
        if key in device_name:
            return peak
    return None


def throughput(flops_per_iter: float, seconds: float, num_devices: int,
               peak_tflops: Optional[float] = None):
    """(TFLOP/s per device, MFU or None): MFU only when a GPU peak is known."""
    tflops = flops_per_iter / seconds / num_devices / 1e12
    mfu = tflops / peak_tflops if peak_tflops else None
    return tflops, mfu
