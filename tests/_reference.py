"""The suite's independent references, in one place: single-process PyTorch written from the
definitions (no plugin or Megatron code), run in whatever dtype the inputs have (fp64 in the
parity tests).

    attention / attention_grads   softmax attention with GQA, causal or masked, any layout
    norm, rope                    LayerNorm / RMSNorm; rotary embedding (non-interleaved halves)
    mlp                           f(x W1^T + b1) W2^T + b2, GeLU or gated (SwiGLU) with grads
    attention_sublayer            Megatron's linear_qkv layout -> attention -> linear_proj
    vocab_cross_entropy           logsumexp(logits) - logits[label], logits = x W^T
    gpt_loss                      a whole GPT / LLaMA-style model from TP = 1 weights
"""

from __future__ import annotations

import math
from typing import Dict, Optional

import torch

_LAYOUTS = ("bhsd", "bshd", "sbhd")  # axis order of q/k/v: batch, heads, sequence, head dim


def _to_bhsd(t: torch.Tensor, layout: str) -> torch.Tensor:
    return t.permute(*[layout.index(c) for c in "bhsd"])


def _from_bhsd(t: torch.Tensor, layout: str) -> torch.Tensor:
    return t.permute(*["bhsd".index(c) for c in layout])


def attention(q, k, v, *, scale: float, causal: bool = False,
              mask: Optional[torch.Tensor] = None, layout: str = "bhsd"):
    """softmax(q k^T * scale, masked) v; returns (out in ``layout``, lse [b, h, s_q]).

    GQA: each K/V head serves q.heads / k.heads consecutive query heads. ``mask`` is boolean,
    True = masked out, broadcastable to [b, h, s_q, s_k]; ``causal`` masks keys after the query.
    """
    assert layout in _LAYOUTS, layout
    q, k, v = (_to_bhsd(t, layout) for t in (q, k, v))
    rep = q.shape[1] // k.shape[1]
    k, v = k.repeat_interleave(rep, 1), v.repeat_interleave(rep, 1)
    scores = q @ k.transpose(-1, -2) * scale
    if causal:
        s_q, s_k = scores.shape[-2:]
        scores = scores.masked_fill(
            torch.ones(s_q, s_k, dtype=torch.bool, device=q.device).triu(1), float("-inf"))
    if mask is not None:
        scores = scores.masked_fill(mask, float("-inf"))
    return _from_bhsd(scores.softmax(-1) @ v, layout), scores.logsumexp(-1)


def attention_grads(q, k, v, dout, *, scale: float, causal: bool = False, layout: str = "bhsd"):
    """fp64 ``attention`` and its gradients by autograd: (out, lse, dq, dk, dv), all fp64."""
    leaves = [t.detach().double().requires_grad_(True) for t in (q, k, v)]
    out, lse = attention(*leaves, scale=scale, causal=causal, layout=layout)
    out.backward(dout.double())
    return (out.detach(), lse.detach(), *(t.grad for t in leaves))


def sequence_case(s: int, b: int, n: int, n_kv: int, d: int, seed: int, causal: bool):
    """A seeded whole-sequence attention case in Megatron's [s, b, heads, d] layout and its fp64
    reference: ``dict(q, k, v, dout, out, dq, dk, dv)``, every tensor fp64 (context-parallel
    tests shard it per rank)."""
    g = torch.Generator().manual_seed(seed)
    q = torch.randn(s, b, n, d, generator=g, dtype=torch.float64)
    k = torch.randn(s, b, n_kv, d, generator=g, dtype=torch.float64)
    v = torch.randn(s, b, n_kv, d, generator=g, dtype=torch.float64)
    dout = torch.randn(s, b, n, d, generator=g, dtype=torch.float64)
    out, _, dq, dk, dv = attention_grads(q, k, v, dout, scale=d ** -0.5, causal=causal,
                                         layout="sbhd")
    return dict(q=q, k=k, v=v, dout=dout, out=out, dq=dq, dk=dk, dv=dv)


def norm(x, w, b, kind: str, eps: float):
    """LayerNorm (``kind == 'LayerNorm'``, with bias ``b``) or RMSNorm over the last axis."""
    if kind == "LayerNorm":
        mu = x.mean(-1, keepdim=True)
        var = ((x - mu) ** 2).mean(-1, keepdim=True)
        return (x - mu) / torch.sqrt(var + eps) * w + b
    return x / torch.sqrt((x**2).mean(-1, keepdim=True) + eps) * w


def rope(x_bshd, positions):
    """Rotary embedding, non-interleaved halves: x * cos + rotate_half(x) * sin.

    The angle table is built in fp32 (cos/sin of fp32 angles, then cast), because that is the
    precision Megatron's RotaryEmbedding defines it at; everything else runs in x's dtype.
    """
    d = x_bshd.shape[-1]
    inv_freq = 1.0 / (10000 ** (torch.arange(0, d, 2, dtype=torch.float32) / d))
    ang = torch.outer(positions.float(), inv_freq)  # [s, d/2]
    ang = torch.cat([ang, ang], dim=-1)[None, :, None, :]
    cos, sin = ang.cos().to(x_bshd.dtype), ang.sin().to(x_bshd.dtype)
    x1, x2 = x_bshd.chunk(2, dim=-1)
    return x_bshd * cos + torch.cat([-x2, x1], dim=-1) * sin


def mlp(t: Dict[str, torch.Tensor], gated: bool, act):
    """out = f(x W1^T + b1) W2^T + b2 by autograd against the output gradient ``t['g']``.

    ``t`` holds ``x``, ``g`` and Megatron's names (``linear_fc1.weight`` = [gate | up] when
    gated); returns out and the gradients by name (``x`` included)."""
    leaves = {k: v.clone().requires_grad_(True) for k, v in t.items() if k != "g"}
    z = leaves["x"] @ leaves["linear_fc1.weight"].T
    if "linear_fc1.bias" in leaves:
        z = z + leaves["linear_fc1.bias"]
    if gated:
        gate, up = z.chunk(2, dim=-1)
        z = act(gate) * up
    else:
        z = act(z)
    out = z @ leaves["linear_fc2.weight"].T
    if "linear_fc2.bias" in leaves:
        out = out + leaves["linear_fc2.bias"]
    (out * t["g"]).sum().backward()
    return out.detach(), {k: v.grad for k, v in leaves.items()}


def _split_qkv(qkv, b, s, n, ng, d):
    """Megatron's per-query-group linear_qkv layout [q heads of the group | k | v] -> q, k, v
    as [b, s, heads, d]."""
    qkv = qkv.view(b, s, ng, (n // ng + 2) * d)
    q = qkv[..., : n // ng * d].reshape(b, s, n, d)
    return q, qkv[..., n // ng * d : (n // ng + 1) * d], qkv[..., (n // ng + 1) * d :]


def attention_sublayer(full: Dict[str, torch.Tensor], config, x, g, rope_on: bool,
                       causal: bool = True):
    """The self-attention sublayer (causal unless told) from TP = 1 weights ``full``
    (linear_qkv, linear_proj, optional biases) on x [s, b, h], by fp64 autograd against the
    output gradient ``g``.

    Returns (out [s, b, h], dx, {name: dweight})."""
    w = {n: t.double().requires_grad_(True) for n, t in full.items()}
    x = x.double().requires_grad_(True)
    S, B = x.shape[:2]
    n, ng, d = config.num_attention_heads, config.num_query_groups, config.kv_channels
    qkv = x.transpose(0, 1) @ w["linear_qkv.weight"].T
    if "linear_qkv.bias" in w:
        qkv = qkv + w["linear_qkv.bias"]
    q, k, v = _split_qkv(qkv, B, S, n, ng, d)
    if rope_on:
        q, k = rope(q, torch.arange(S)), rope(k, torch.arange(S))
    ctx, _ = attention(q, k, v, scale=1 / math.sqrt(d), causal=causal, layout="bshd")
    out = ctx.reshape(B, S, n * d).transpose(0, 1) @ w["linear_proj.weight"].T
    if "linear_proj.bias" in w:
        out = out + w["linear_proj.bias"]
    (out * g.double()).sum().backward()
    return out.detach(), x.grad, {k_: t.grad for k_, t in w.items()}


def vocab_cross_entropy(x_full, w_full, labels, grad):
    """Per-token loss logsumexp(x W^T) - (x W^T)[label] for x [s, b, h], W [V, h], by fp64
    autograd against the loss gradient ``grad``; returns (loss, dx, dW)."""
    x = x_full.double().clone().requires_grad_()
    w = w_full.double().clone().requires_grad_()
    logits = torch.einsum("sbh,vh->sbv", x, w)
    loss = torch.logsumexp(logits, -1) - logits.gather(-1, labels[..., None])[..., 0]
    loss.backward(grad)
    return loss.detach(), x.grad, w.grad


def gpt_loss(params: Dict[str, torch.Tensor], config, b: dict, rope_on: bool):
    """Mean next-token loss and logits [b, s, V] of a GPT with TP = 1 weights ``params``.

    Written from the model's definition, not from Megatron's code: pre-norm layers,
    ``linear_qkv`` in Megatron's per-query-group layout ([q heads of the group | k | v] for each
    group), causal softmax attention with GQA, GeLU MLP or SwiGLU (``linear_fc1`` = [gate | up]).
    """
    P = lambda n: params[n]  # noqa: E731
    h_heads, ng = config.num_attention_heads, config.num_query_groups
    hn, eps, kind = config.kv_channels, config.layernorm_epsilon, config.normalization
    tokens = b["tokens"]
    bsz, s = tokens.shape
    x = P("embedding.word_embeddings.weight")[tokens]
    if not rope_on:
        x = x + P("embedding.position_embeddings.weight")[b["position_ids"]]
    for i in range(config.num_layers):
        pre = f"decoder.layers.{i}."
        bias = lambda n: params.get(pre + n, 0.0)  # noqa: E731
        y = norm(x, P(pre + "input_layernorm.weight"), bias("input_layernorm.bias"), kind, eps)
        qkv = y @ P(pre + "self_attention.linear_qkv.weight").T
        q, k, v = _split_qkv(qkv + bias("self_attention.linear_qkv.bias"), bsz, s, h_heads, ng, hn)
        if rope_on:
            pos = torch.arange(s)
            q, k = rope(q, pos), rope(k, pos)
        ctx, _ = attention(q, k, v, scale=1 / math.sqrt(hn), causal=True, layout="bshd")
        ctx = ctx.reshape(bsz, s, h_heads * hn)
        x = (x + ctx @ P(pre + "self_attention.linear_proj.weight").T
             + bias("self_attention.linear_proj.bias"))
        y = norm(x, P(pre + "pre_mlp_layernorm.weight"), bias("pre_mlp_layernorm.bias"), kind, eps)
        z = y @ P(pre + "mlp.linear_fc1.weight").T + bias("mlp.linear_fc1.bias")
        if config.gated_linear_unit:
            gate, up = z.chunk(2, dim=-1)
            z = config.activation_func(gate) * up
        else:
            z = config.activation_func(z)
        x = x + z @ P(pre + "mlp.linear_fc2.weight").T + bias("mlp.linear_fc2.bias")
    x = norm(x, P("decoder.final_layernorm.weight"),
             params.get("decoder.final_layernorm.bias", 0.0), kind, eps)
    logits = x @ P("output_layer.weight").T
    loss = torch.nn.functional.cross_entropy(logits.flatten(0, 1), b["labels"].flatten())
    return loss, logits
