"""``MetpMLP``: Megatron-Core's MLP with METP's weight ring (paper Alg. 1-2) as its forward.

A drop-in for ``megatron.core.transformer.mlp.MLP`` in a layer spec (``megatron_metp.specs``):
same constructor, same submodules, same parameters. ``linear_fc1`` (``ColumnParallelLinear``) and
``linear_fc2`` (``RowParallelLinear``) are built exactly as the TP MLP builds them and kept as
parameter containers, so parameter names, shapes, TP attributes (``partition_dim``,
``partition_stride`` 2 for SwiGLU's fc1) and ``sharded_state_dict`` keys (including SwiGLU's
fc1 factory) are TP's: a checkpoint written in ``tp`` mode loads here and back. Only the forward
differs: instead of all-gathering the sequence (``[s/p, b, h] -> [s, b, h]``), computing on the
fc1 column / fc2 row shards and reduce-scattering, the tokens stay put and the shards travel::

    hidden_states  x_shard_s  [s/p, b, h]    this rank's sequence chunk (sequence parallel)
    linear_fc1     w_in       [F'/p, h]      F' = F, or 2F as [gate_r; up_r] for gated units
                   b_in       [F'/p]         travels with w_in
    linear_fc2     w_out      [h, F/p]
                   bias       [h]            not sharded; returned (skip_bias_add), added once
    output         out_shard_s [s/p, b, h]   = sum_r f(x W_in_r^T + b_in_r) W_out_r^T

Activation memory per rank: the forward keeps only ``x_shard_s`` and peaks at one step's
``[s/p, b, F'/p]`` intermediate (Table 1: bsh/p + 4bsh/p^2 against TP+SP's bsh + 4bsh/p).

Short sequences (``--metp-mlp-pass``, :data:`MLP_PASSES`): the same shards all-gathered once
instead of one per ring step (``metp.gathered_mlp``), the same bytes in a constant number of
operations, at the price of this rank's whole ``[s/p, b, F']`` fc1 output at once; ``auto``
takes it while that output is small (``gathered_mlp.GATHERED_MLP_BYTES``).

``f`` is ``config.activation_func`` (GeLU, SiLU, ...), gated as Megatron gates it
(``act(gate) * (up + glu_linear_offset)``, with ``activation_func_clamp_value``). Megatron's fused
bias-activation kernels are not called (the ring applies ``f`` per shard and recomputes it in
backward); with ``bias_activation_fusion`` GeLU is their tanh approximation, the same function.
"""

from __future__ import annotations

from typing import Callable, Optional

import torch
import torch.distributed as dist
import torch.nn.functional as F
from megatron.core.transformer.mlp import MLP, MLPSubmodules
from megatron.core.transformer.transformer_config import TransformerConfig
from megatron.core.utils import get_tensor_model_parallel_group_if_none

from megatron_metp.metp.attention_plan import KEEPS_FC1, KEEPS_WEIGHTS
from megatron_metp.metp.gathered_mlp import GatheredMLPFunction, keeps_act, takes_gathered
from megatron_metp.metp.weight_hooks import run_pre_hooks
from megatron_metp.metp.weight_ring import MetpMLPFunction
from megatron_metp.metp.wgrad_accum import scatters_together
from megatron_metp.errors import MetpConfigError

__all__ = ["MetpMLP", "validate_metp_mlp", "make_activation", "MLP_PASSES"]

# How the METP MLP moves its weights: "ring", the paper's weight ring (metp.weight_ring: one
# shard per step, p steps); "gathered", every shard all-gathered once (metp.gathered_mlp: the
# same bytes in a constant number of operations, with this rank's whole [n/p, F'] fc1 output at
# once); "auto", gathered while that output is small (gathered_mlp.GATHERED_MLP_BYTES), else
# the ring.
MLP_PASSES = ("auto", "ring", "gathered")


def validate_metp_mlp(
    config: TransformerConfig,
    seq_length: Optional[int] = None,
    tp_size: Optional[int] = None,
    ffn_hidden_size: Optional[int] = None,
) -> None:
    """Refuse a configuration the METP MLP cannot run, naming the Megatron-LM flag.

    Call at start-up with the training sequence length (``MetpMLP`` calls it at construction
    without one). ``tp_size`` defaults to ``config.tensor_model_parallel_size`` (the METP ring is
    the TP group). Raises :class:`~megatron_metp.validation.MetpConfigError` (a ``ValueError``).
    """
    p = tp_size if tp_size is not None else config.tensor_model_parallel_size
    ffn = ffn_hidden_size if ffn_hidden_size is not None else config.ffn_hidden_size
    if p > 1 and not config.sequence_parallel:
        raise MetpConfigError(
            f"the METP MLP keeps the sequence sharded over the {p} ranks of its ring, so it needs "
            "sequence parallelism: add --sequence-parallel (or use --tensor-parallel-mode tp)"
        )
    if ffn % p:
        raise MetpConfigError(
            f"--ffn-hidden-size {ffn} is not divisible by --tensor-model-parallel-size {p}: the "
            f"METP ring passes one fc1/fc2 shard per rank; pick a multiple of {p}"
        )
    if config.hidden_size % p:
        raise MetpConfigError(
            f"--hidden-size {config.hidden_size} is not divisible by "
            f"--tensor-model-parallel-size {p}; pick a multiple of {p}"
        )
    if seq_length is not None and seq_length % p:
        raise MetpConfigError(
            f"--seq-length {seq_length} is not divisible by --tensor-model-parallel-size {p}: "
            f"each METP rank holds s/p tokens; pad or pick a multiple of {p}"
        )


class TanhGelu:
    """GeLU with the tanh approximation, and its backward as autograd runs it (``aten.
    gelu_backward``, the same values), callable without a graph: a backward that kept the
    activation's output (``gathered_mlp.KEEP_ACT_MAX_VALUES``) or recomputes it without
    autograd needs only ``dL/dt``."""

    def __call__(self, t: torch.Tensor) -> torch.Tensor:
        return F.gelu(t, approximate="tanh")

    @staticmethod
    def backward(grad: torch.Tensor, t: torch.Tensor) -> torch.Tensor:
        """dL/dt given dL/d(gelu(t)) = ``grad``."""
        return torch.ops.aten.gelu_backward(grad, t, approximate="tanh")


def make_activation(config: TransformerConfig) -> Callable[[torch.Tensor], torch.Tensor]:
    """``f`` of Eq. (1) for this config: ``[n, F'/p] -> [n, F/p]`` (gated) or elementwise.

    With ``bias_activation_fusion`` (Megatron-LM's default) Megatron's MLP computes GeLU with its
    fused kernels, which use the tanh approximation; so does this (``F.gelu(approximate='tanh')``,
    whose constant sqrt(2/pi) differs from the kernel's 0.79788456 by 1e-9 relative).
    """
    act = config.activation_func
    if config.bias_activation_fusion and act is F.gelu:
        act = TanhGelu()
    if not config.gated_linear_unit:
        return act
    clamp = getattr(config, "activation_func_clamp_value", None)
    offset = getattr(config, "glu_linear_offset", 0.0)
    if config.bias_activation_fusion and act is F.silu and clamp is None and not offset:
        return FusedSwiGLU()

    def glu(t: torch.Tensor) -> torch.Tensor:
        # Each shard is [gate_r; up_r] (fc1's stride-2 layout), so halving the shard's own
        # columns splits gate from up, exactly as Megatron's MLP does on its TP shard.
        gate, up = torch.chunk(t, 2, dim=-1)
        if clamp is not None:
            gate = gate.clamp(min=None, max=clamp)
            up = up.clamp(min=-clamp, max=clamp)
        return act(gate) * (up + offset) if offset else act(gate) * up

    return glu


class FusedSwiGLU:
    """SwiGLU as Megatron's MLP runs it with ``bias_activation_fusion`` (Megatron-LM's default):
    on a GPU, and on the planner's fake tensors, its fused ``swiglu`` forward and
    ``swiglu_back`` backward (``megatron.core.fusions.fused_bias_swiglu``: one jit-fused kernel
    each on a GPU, one traced op each under ``cpu_compat``), looked up at each call. The weight
    ring's backward (``weight_ring._grad_step``) calls :meth:`backward` instead of differentiating
    the unfused chunk / silu / mul graph (five more kernels per ring step, and their traffic).
    Real CPU tensors take the same formulas as plain tensor ops: there Megatron's functions are
    the token-chunked CPU twins of TorchScript code, 2.7x slower per ring step at test sizes,
    with the same values. Each shard is [gate_r; up_r] (fc1's stride-2 layout): halving its
    columns splits gate from up, as Megatron's MLP does on its TP shard."""

    @staticmethod
    def _kernels(t: torch.Tensor) -> bool:
        from torch._subclasses.fake_tensor import FakeTensor

        return t.is_cuda or isinstance(t, FakeTensor)

    def __call__(self, t: torch.Tensor) -> torch.Tensor:
        if self._kernels(t):
            from megatron.core.fusions import fused_bias_swiglu

            return fused_bias_swiglu.swiglu(t)
        gate, up = torch.chunk(t, 2, dim=-1)
        if torch.is_grad_enabled() and t.requires_grad:
            return F.silu(gate) * up
        # In place: the output is the only tensor made, as the fused kernel's (the planner
        # counts that kernel's output and nothing else; the real gloo runs are held to it).
        return F.silu(gate).mul_(up)

    @classmethod
    def backward(cls, grad: torch.Tensor, t: torch.Tensor) -> torch.Tensor:
        """dL/dt given dL/d(swiglu(t)) = ``grad``."""
        if cls._kernels(t):
            from megatron.core.fusions import fused_bias_swiglu

            return fused_bias_swiglu.swiglu_back(grad, t)
        gate, up = torch.chunk(t, 2, dim=-1)
        # d silu(g) / dg = sig (1 + g (1 - sig)) = sig (1 + g - g sig); d (silu(g) u) / du =
        # silu(g) = g sig. Written into the output's two halves in place, with the up half as
        # sig's scratch, so that the output is the only tensor made, as the fused kernel's.
        out = torch.empty_like(t, dtype=torch.promote_types(grad.dtype, t.dtype))
        d_gate, d_up = torch.chunk(out, 2, dim=-1)
        torch.sigmoid(gate, out=d_up)
        d_gate.copy_(d_up).mul_(gate).neg_().add_(gate).add_(1).mul_(d_up).mul_(up).mul_(grad)
        d_up.mul_(gate).mul_(grad)
        return out


class MetpMLP(MLP):
    """Megatron's ``MLP`` whose forward is METP's weight ring (see the module docstring)."""

    def __init__(
        self,
        config: TransformerConfig,
        submodules: MLPSubmodules,
        is_expert: bool = False,
        input_size: Optional[int] = None,
        ffn_hidden_size: Optional[int] = None,
        tp_group: Optional[dist.ProcessGroup] = None,
        pg_collection=None,
        is_mtp_layer: bool = False,
        name: Optional[str] = None,
    ):
        # Megatron-Core >= 0.19's TransformerLayer calls its mlp submodule with pg_collection,
        # is_mtp_layer and name (MLP.as_mlp_submodule's signature); 0.16.1 passes none of them.
        if tp_group is None and pg_collection is not None:
            tp_group = pg_collection.tp
        extra = {} if name is None else {"name": name}
        if is_expert:
            raise MetpConfigError(
                "the METP MLP is not an expert MLP: MoE layers (--num-experts) keep Megatron's "
                "expert parallelism; drop --num-experts or use --tensor-parallel-mode tp"
            )
        if getattr(config, "use_te_activation_func", False):
            raise MetpConfigError(
                "--use-te-activation-func is not supported by the METP MLP (it applies "
                "config.activation_func itself); drop the flag"
            )
        group = get_tensor_model_parallel_group_if_none(tp_group, is_expert=False)
        p = dist.get_world_size(group) if group is not None else 1
        validate_metp_mlp(config, tp_size=p, ffn_hidden_size=ffn_hidden_size)
        super().__init__(config, submodules, is_expert, input_size, ffn_hidden_size, tp_group,
                         **extra)
        # Built by MLP.__init__ from the same group; kept explicitly for the ring.
        self.ring_group = group
        self.ring_size = p
        # The gathered pass's all-gathers and reduce-scatters go where METP attention's weights
        # go (a communicator of their own over the same ranks, when initialize_metp made one).
        from megatron_metp.parallel_state import metp_weight_group

        self.weight_group = metp_weight_group(group)
        self._act = make_activation(config)
        # --metp-qkv-backward save+fc1 (metp.attention.QKV_BACKWARD, carried on the config; read
        # once here): every ring step's fc1 output is kept for the backward, which then runs no
        # fc1 GEMM; "save+fc1+weights": the gathered pass keeps its gathered weights too, and
        # its backward gathers nothing (the ring passes its shards on: nothing whole to keep).
        qkv_backward = getattr(config, "metp_qkv_backward", "auto")
        self.keep_fc1 = qkv_backward in KEEPS_FC1
        self.keep_weights = qkv_backward == KEEPS_WEIGHTS
        # --metp-mlp-pass (MLP_PASSES, carried on the config; read once here).
        self.mlp_pass = getattr(config, "metp_mlp_pass", None) or "auto"
        if self.mlp_pass not in MLP_PASSES:
            raise MetpConfigError(f"--metp-mlp-pass {self.mlp_pass!r}: pick one of "
                                  f"{', '.join(MLP_PASSES)}")
        # Set by MetpTransformerLayer for one forward (metp.layer_schedule.SublayerLink).
        self.link = None
        for name in ("linear_fc1", "linear_fc2"):
            if not isinstance(getattr(getattr(self, name), "weight", None), torch.Tensor):
                raise MetpConfigError(
                    f"MetpMLP needs {name} to hold its weight as a tensor (Megatron's local "
                    "ColumnParallelLinear / RowParallelLinear); use megatron_metp.specs' layer "
                    "specs, not Transformer Engine's fused linears"
                )

    def takes_gathered_for(self, tokens: int, itemsize: int) -> bool:
        """Whether a forward on ``tokens`` tokens of this rank (``itemsize`` bytes per value)
        runs the gathered pass (``--metp-mlp-pass``)."""
        return self.mlp_pass == "gathered" or (self.mlp_pass == "auto" and takes_gathered(
            tokens, self.linear_fc1.weight.shape[0] * self.ring_size, itemsize))

    def forward(self, hidden_states: torch.Tensor, per_token_scale=None, **kwargs):
        """``hidden_states`` x_shard_s [s/p, b, h] -> ``(out_shard_s [s/p, b, h], fc2 bias)``."""
        if per_token_scale is not None:
            raise ValueError("MetpMLP: per_token_scale is for MoE experts, which METP does not run")
        fc1, fc2 = self.linear_fc1, self.linear_fc2
        if self.link is None or not self.link.mlp_prepared:
            # fc1 / fc2's forward pre-hooks (metp.weight_hooks), unless the layer's link ran
            # them before it posted their gathers.
            run_pre_hooks(fc1, fc2)
        x_shard_s = hidden_states
        s_local, b, h = x_shard_s.shape
        weights = (fc1.weight, fc1.bias if fc1.bias is not None and fc1.bias.numel() else None,
                   fc2.weight)
        # Nothing to keep for a forward without autograd (full recompute's first pass).
        keep = self.keep_fc1 and torch.is_grad_enabled()
        # Weight gradients straight into main_grad (metp.wgrad_accum).
        fuse = bool(self.config.gradient_accumulation_fusion)
        x2d = x_shard_s.reshape(s_local * b, h)
        if self.takes_gathered_for(s_local * b, x_shard_s.element_size()):
            # The layer's link (metp.layer_schedule), when it was opened for these tokens: the
            # weights as it hands them over, their gathers posted behind the attention.
            link = self.link if self.link is not None and self.link.tokens == s_local * b \
                else None
            if link is not None:
                weights = link.mlp_weights
            # The activation kept too where it is small (gathered_mlp.keeps_act).
            keep_act = keep and keeps_act(s_local * b, fc2.weight.shape[1] * self.ring_size)
            # fc2's and fc1's weight-gradient reduce-scatters in one call where it is small.
            together = scatters_together(s_local * b, h)
            out_2d = GatheredMLPFunction.apply(x2d, *weights, self._act, self.weight_group,
                                               keep, link, self.keep_weights, fuse, keep_act,
                                               together)
        else:
            out_2d = MetpMLPFunction.apply(x2d, *weights, self._act, self.ring_group, keep,
                                           fuse)
        out_shard_s = out_2d.view(s_local, b, -1)
        bias = fc2.bias if fc2.bias is not None and fc2.bias.numel() else None
        # Megatron's MLP returns fc2's bias for the fused bias-dropout-add (skip_bias_add);
        # honour the linear's setting if it was built otherwise.
        if bias is not None and not fc2.skip_bias_add:
            return out_shard_s + bias, None
        return out_shard_s, bias
