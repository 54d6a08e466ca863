"""CPU-capable building blocks for the plugin's layer specs (norm and core attention).

Megatron-Core's local spec cannot run TP+SP on a CPU-only build: ``WrappedTorchNorm`` refuses
sequence parallelism, and ``DotProductAttention`` takes its score buffer from the global memory
buffer on the current CUDA device and builds its default causal mask with ``device="cuda"``. The
two classes here replace them through the spec (no runtime patch) and run on CPU and GPU alike;
every device follows the input tensors.

``Norm``
    LayerNorm or RMSNorm chosen by ``config.normalization`` at construction, with the
    constructor ``TransformerLayer`` uses for norms. Under sequence parallelism each rank
    normalises its own tokens, so the weight gradient is a partial sum over this rank's tokens:
    the parameters are tagged ``sequence_parallel=True``, which is how Megatron's DDP /
    finalize_model_grads knows to all-reduce them over the TP group.

``SDPACoreAttention``
    ``DotProductAttention``'s constructor and forward signature on top of
    ``torch.nn.functional.scaled_dot_product_attention``::

        query   [sq, b, np, hn]   this TP rank's query heads
        key     [sk, b, ng, hn]   this TP rank's query groups (GQA: ng divides np)
        value   [sk, b, ng, hn]
        output  [sq, b, np * hn]
"""

from __future__ import annotations

import math
from typing import Optional, Tuple

import torch
import torch.nn.functional as F
from megatron.core import tensor_parallel
from megatron.core.transformer.enums import AttnMaskType
from megatron.core.transformer.module import MegatronModule
from megatron.core.transformer.transformer_config import TransformerConfig
from megatron.core.utils import divide

from megatron_metp.kernels import acc_dtype, is_fake


_NORM_CHUNKS = 16
_NORM_MIN_ROWS = 1024  # below this a chunk's temporaries are negligible; fewer, larger ops


def _token_chunks(n: int):
    """Slices covering ``n`` tokens in at most ``_NORM_CHUNKS`` pieces of at least
    ``_NORM_MIN_ROWS`` tokens (one piece for short inputs)."""
    step = max(_NORM_MIN_ROWS, -(-n // _NORM_CHUNKS))
    return [slice(i, min(i + step, n)) for i in range(0, n, step)]


class _RMSNormFn(torch.autograd.Function):
    """RMSNorm that keeps only its input and the per-token rstd for backward, as Transformer
    Engine's and Apex's fused kernels do. ``F.rms_norm``'s CPU decomposition lets autograd keep
    its fp32 intermediates instead (measured: 5 ``bsh/p`` per norm against 1 here), which would
    dominate what a long-sequence layer keeps.

    Forward and backward run over the tokens in ``_NORM_CHUNKS`` chunks into one output: a fused
    kernel keeps its fp32 working values in registers, and the whole-tensor expression would
    materialise five fp32 copies of ``x`` at once (10 ``bsh/p`` in bf16 units: what made a
    LLaMA layer's backward peak 16 ``bsh/p`` against 9 for a LayerNorm layer). Every value is a
    per-token expression, so the chunking changes no bit of ``y`` or ``dx``; ``dw`` sums the
    chunks' partial sums in fp32.

        x [..., h]   input (any float dtype; statistics in fp32, fp64 stays fp64)
        w [h]        gamma
    """

    @staticmethod
    def forward(ctx, x, w, eps):
        y, rstd = _rms_forward(x, w, eps)
        ctx.save_for_backward(x, w, rstd)
        return y

    @staticmethod
    def backward(ctx, g):
        x, w, rstd = ctx.saved_tensors
        dx, dw = _rms_backward(g, x, w, rstd)
        return dx, dw, None


def _rms_forward_loop(x: torch.Tensor, w: torch.Tensor, eps: float):
    """``(y, rstd)``: the forward over the tokens in chunks (see :class:`_RMSNormFn`)."""
    acc = acc_dtype(x.dtype)
    h = x.shape[-1]
    x2 = x.reshape(-1, h)
    y2 = torch.empty_like(x2)
    rstd = torch.empty(x2.shape[0], 1, dtype=acc, device=x.device)
    wf = w.to(acc)
    for sl in _token_chunks(x2.shape[0]):
        xf = x2[sl].to(acc)
        r = torch.rsqrt(xf.pow(2).mean(-1, keepdim=True) + eps)
        rstd[sl] = r
        y2[sl] = (xf * r * wf).to(x.dtype)
    return y2.reshape(x.shape), rstd.reshape(*x.shape[:-1], 1)


def _rms_backward_loop(g: torch.Tensor, x: torch.Tensor, w: torch.Tensor, rstd: torch.Tensor):
    """``(dx, dw)`` given the output gradient ``g`` (see :class:`_RMSNormFn`)."""
    acc = rstd.dtype
    h = x.shape[-1]
    x2, g2, r2 = x.reshape(-1, h), g.reshape(-1, h), rstd.reshape(-1, 1)
    dx2 = torch.empty_like(x2)
    dw = torch.zeros(h, dtype=acc, device=x.device)
    wf = w.to(acc)
    for sl in _token_chunks(x2.shape[0]):
        r, gf = r2[sl], g2[sl].to(acc)
        x_hat = x2[sl].to(acc) * r
        gw = gf * wf
        dx2[sl] = (r * (gw - x_hat * (gw * x_hat).mean(-1, keepdim=True))).to(x.dtype)
        dw += (gf * x_hat).sum(0)
    return dx2.reshape(x.shape), dw.to(w.dtype)


# On fake tensors (the planner's memory probes and op traces) each direction is one op, as
# Transformer Engine's and apex's fused RMSNorm kernels are on a GPU (one launch each way, their
# fp32 working values in registers): the chunk loop would trace up to 16 chunks x ~10 ops and
# charge each a launch and its own memory traffic. Real tensors run the loop directly.
@torch.library.custom_op("megatron_metp::rms_norm_fwd", mutates_args=())
def _rms_forward_op(x: torch.Tensor, w: torch.Tensor, eps: float
                    ) -> Tuple[torch.Tensor, torch.Tensor]:
    return _rms_forward_loop(x, w, eps)


@_rms_forward_op.register_fake
def _(x, w, eps):
    return torch.empty_like(x), x.new_empty((*x.shape[:-1], 1), dtype=acc_dtype(x.dtype))


@torch.library.custom_op("megatron_metp::rms_norm_bwd", mutates_args=())
def _rms_backward_op(g: torch.Tensor, x: torch.Tensor, w: torch.Tensor, rstd: torch.Tensor
                     ) -> Tuple[torch.Tensor, torch.Tensor]:
    return _rms_backward_loop(g, x, w, rstd)


@_rms_backward_op.register_fake
def _(g, x, w, rstd):
    return torch.empty_like(x), torch.empty_like(w)


def _rms_forward(x, w, eps):
    return _rms_forward_op(x, w, eps) if is_fake(x) else _rms_forward_loop(x, w, eps)


def _rms_backward(g, x, w, rstd):
    return _rms_backward_op(g, x, w, rstd) if is_fake(x) else _rms_backward_loop(g, x, w, rstd)


def rms_norm(x: torch.Tensor, weight: torch.Tensor, eps: float) -> torch.Tensor:
    """RMSNorm over the last dim that keeps only ``x`` and rstd for backward (see above)."""
    return _RMSNormFn.apply(x, weight, eps)


class Norm(torch.nn.Module):
    """LayerNorm / RMSNorm over the last dim of ``x [s(/tp), b, h]``; SP-aware parameters.

    Parameter names follow the local spec's norms (``weight``, and ``bias`` for LayerNorm), so
    state dicts and sharded_state_dict keys match Megatron's. ``config.layernorm_zero_centered_gamma``
    stores ``weight`` as gamma - 1, as Megatron's fused norms do.
    """

    def __init__(
        self,
        config: TransformerConfig,
        hidden_size: int,
        eps: float = 1e-5,
        persist_layer_norm: bool = False,  # accepted for constructor compatibility; unused
        zero_centered_gamma: bool = False,
        normalization: Optional[str] = None,
    ):
        super().__init__()
        self.normalization = normalization or config.normalization
        if self.normalization not in ("LayerNorm", "RMSNorm"):
            raise ValueError(
                f"megatron_metp Norm supports --normalization LayerNorm or RMSNorm, got "
                f"{self.normalization!r}"
            )
        self.hidden_size = hidden_size
        self.eps = eps
        self.zero_centered_gamma = zero_centered_gamma or config.layernorm_zero_centered_gamma
        # Where Megatron's own layers put parameters: CPU with use_cpu_initialization (or no GPU),
        # else the current GPU.
        if config.use_cpu_initialization or not torch.cuda.is_available():
            device = torch.device("cpu")
        else:
            device = torch.device("cuda", torch.cuda.current_device())
        init = torch.zeros if self.zero_centered_gamma else torch.ones
        self.weight = torch.nn.Parameter(
            init(hidden_size, dtype=config.params_dtype, device=device)
        )
        if self.normalization == "LayerNorm":
            self.bias = torch.nn.Parameter(
                torch.zeros(hidden_size, dtype=config.params_dtype, device=device)
            )
        else:
            self.register_parameter("bias", None)
        # Each SP rank sees s/tp tokens, so its weight/bias gradients are partial sums that
        # Megatron all-reduces over TP for parameters carrying this tag.
        for p in self.parameters():
            setattr(p, "sequence_parallel", bool(config.sequence_parallel))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        gamma = self.weight + 1 if self.zero_centered_gamma else self.weight
        if self.normalization == "LayerNorm":
            return F.layer_norm(x, (self.hidden_size,), gamma, self.bias, self.eps)
        return rms_norm(x, gamma, self.eps)


class SDPACoreAttention(MegatronModule):
    """Core attention (softmax(q k^T * scale [+ mask]) v) with DotProductAttention's interface.

    Masking: an explicit ``attention_mask`` (bool, True = masked out, broadcastable to
    [b, np, sq, sk]) is applied as given, as the local DotProductAttention does; with no mask,
    causal mask types (``causal``, ``padding_causal``) use SDPA's built-in causal mask and other
    types attend everywhere. An explicit mask costs an [s, s] tensor and keeps SDPA off its fused
    causal kernels: for long sequences pass none (Megatron-LM:
    ``--no-create-attention-mask-in-dataloader``).
    Dropout on the probabilities runs inside SDPA; without sequence parallelism it forks the
    tensor-parallel RNG stream, as DotProductAttention does.
    """

    def __init__(
        self,
        config: TransformerConfig,
        layer_number: int,
        attn_mask_type: AttnMaskType,
        attention_type: str,
        attention_dropout: Optional[float] = None,
        softmax_scale: Optional[float] = None,
        cp_comm_type: Optional[str] = None,
        pg_collection=None,
    ):
        super().__init__(config=config)
        if config.context_parallel_size != 1:
            raise ValueError(
                "SDPACoreAttention (tp/metp specs) does not implement context parallelism: use "
                "--context-parallel-size 1, or --tensor-parallel-mode wallfacer for the "
                "WallFacer core attention"
            )
        if config.softmax_type != "vanilla":
            raise ValueError(
                f"SDPACoreAttention supports --softmax-type vanilla only, got {config.softmax_type!r}"
            )
        if config.window_size is not None:
            raise ValueError("SDPACoreAttention does not support --window-size (sliding window)")
        if pg_collection is None:
            from megatron.core.process_groups_config import ProcessGroupCollection

            pg_collection = ProcessGroupCollection.use_mpu_process_groups(required_pgs=["tp"])
        self.pg_collection = pg_collection
        self.tp_group = pg_collection.tp
        tp_size = self.tp_group.size()

        self.layer_number = max(1, layer_number)
        self.attn_mask_type = attn_mask_type
        self.attention_type = attention_type
        self.heads_per_partition = divide(config.num_attention_heads, tp_size)
        self.groups_per_partition = divide(config.num_query_groups, tp_size)
        self.head_dim = config.kv_channels
        # apply_query_key_layer_scaling divides the scores by layer_number and the fused softmax
        # multiplies them back, so the effective scale is unchanged: 1/sqrt(hn) by default.
        self.softmax_scale = (
            softmax_scale if softmax_scale is not None else 1.0 / math.sqrt(self.head_dim)
        )
        self.dropout_p = (
            config.attention_dropout if attention_dropout is None else attention_dropout
        )

    def forward(
        self,
        query: torch.Tensor,
        key: torch.Tensor,
        value: torch.Tensor,
        attention_mask: Optional[torch.Tensor],
        attn_mask_type: Optional[AttnMaskType] = None,
        attention_bias: Optional[torch.Tensor] = None,
        packed_seq_params=None,
    ) -> torch.Tensor:
        if packed_seq_params is not None or attention_bias is not None:
            raise ValueError("SDPACoreAttention supports neither packed sequences nor attention bias")
        mask_type = attn_mask_type if attn_mask_type is not None else self.attn_mask_type
        sq, b, np_, hn = query.shape
        # GQA: SDPA pairs query head i with key/value head i // (np / ng), Megatron's layout
        # (the np/ng query heads of a group are consecutive), without materialising K/V at the
        # full head count as a repeat_interleave would (flash and TE kernels do not either).
        gqa = np_ != key.shape[2]
        # [s, b, heads, hn] -> [b, heads, s, hn]
        q_bhsd, k_bhsd, v_bhsd = (t.permute(1, 2, 0, 3) for t in (query, key, value))
        sdpa_mask = None
        is_causal = False
        if attention_mask is not None:
            sdpa_mask = ~attention_mask.to(torch.bool)  # SDPA: True = attend
        elif mask_type in (AttnMaskType.causal, AttnMaskType.padding_causal) and sq > 1:
            if key.shape[0] != sq:
                # SDPA's causal mask is aligned top-left; with a KV cache (sk > sq) Megatron's
                # causal mask is aligned bottom-right.
                raise ValueError(
                    "SDPACoreAttention: a causal mask with sk != sq (KV-cache prefill) needs an "
                    "explicit attention_mask"
                )
            is_causal = True
        dropout_p = self.dropout_p if self.training else 0.0

        def attend():
            return F.scaled_dot_product_attention(
                q_bhsd,
                k_bhsd,
                v_bhsd,
                attn_mask=sdpa_mask,
                dropout_p=dropout_p,
                is_causal=is_causal,
                scale=self.softmax_scale,
                enable_gqa=gqa,
            )

        if dropout_p > 0 and not self.config.sequence_parallel:
            # Heads differ per TP rank: draw dropout masks from the TP-rank stream.
            with tensor_parallel.get_cuda_rng_tracker().fork():
                ctx = attend()
        else:
            ctx = attend()
        # [b, np, sq, hn] -> [sq, b, np * hn]
        return ctx.permute(2, 0, 1, 3).reshape(sq, b, np_ * hn)
