"""Measure one transformer layer (and the LM head) of a training step: memory and communication.

The same function runs on a real backend (gloo/NCCL, real tensors) and, for ``metp plan``, under
``FakeTensorMode`` with the ``fake`` process-group backend, where a 175B-parameter layer at
s = 512k costs no memory and well under a second of work per rank step. Shapes per rank::

    x_shard_s      [s/p, b, h]   the layer's input (sequence-parallel for tp and metp, the
                                 context-parallel shard for wallfacer), bf16, requires grad
    grad_shard_s   [s/p, b, h]   the gradient arriving from above (created inside the region)

``LayerMeasure`` (bytes are tracked tensor bytes on this rank, MemTracker):

=====================  ==========================================================================
``retained``            bytes a layer keeps alive from its forward until its backward, its output
                        included and its input excluded (the input is the previous layer's output)
``shared_buffer``       Megatron's ``GlobalMemoryBuffer`` at the end (the SP all-gather scratch,
                        one per process, reused by every layer): in ``peak``, not in ``retained``
``peak``                the high-water mark of the layer's forward + backward over the baseline
                        (parameters and the input), the incoming gradient included
``fwd_peak``            the high-water mark of the (training, grad-enabled) forward alone
``handle_allowance``    bytes a live communication handle holds that a fake run cannot see: the
                        largest single P2P send of the layer (one send in flight per ring step;
                        ../shared/FACTS.md: a gloo ``Work`` holds its send buffer until dropped)
``params``              parameter elements on this rank
``sent_elements``       elements this rank sends per step, papers' convention (``CommCounter``)
``payload_bytes``       payload bytes per op type (``CommCounter``'s convention)
=====================  ==========================================================================

Parameter gradients: Megatron's DDP copies every ``param.grad`` into its fp32 ``main_grad``
buffer in a post-accumulate hook and drops it; the probe does the same (drops the ``.grad``), so
the bf16 gradient is transient here too and the persistent fp32 buffer is part of the model state
the planner adds (``planner.optimizer_bytes_per_param``).
"""

from __future__ import annotations

import contextlib
from dataclasses import dataclass, field
from typing import Dict, Iterator, Optional

import torch
from torch.distributed._tools.mem_tracker import MemTracker

from megatron_metp.measure.comm_counter import CommCounter

__all__ = ["LayerMeasure", "measure_layer", "measure_head", "build_layer", "give_main_grads",
           "ddp_grad_hooks"]


@dataclass
class LayerMeasure:
    retained: int
    peak: int
    handle_allowance: int
    params: int
    sent_elements: float
    payload_bytes: Dict[str, int] = field(default_factory=dict)
    calls: int = 0
    fwd_peak: int = 0
    shared_buffer: int = 0


def _total(snap: Dict) -> int:
    return sum(int(d.get("Total", 0)) for d in snap.values())


def _drop_param_grads(module: torch.nn.Module) -> list:
    """Megatron DDP's hook: the bf16 ``.grad`` lives only until it is added to ``main_grad``."""
    handles = []
    for prm in module.parameters():
        if prm.requires_grad:
            handles.append(prm.register_post_accumulate_grad_hook(
                lambda t: setattr(t, "grad", None)))
    return handles


_MAIN_GRAD_DTYPE = [torch.float32]


@contextlib.contextmanager
def main_grads_in(dtype: torch.dtype):
    """:func:`give_main_grads` gives ``main_grad`` s of ``dtype`` inside: bf16 is Megatron-LM's
    ``--grad-reduce-in-bf16`` (DDP's buffers, and so METP's weight-gradient reductions,
    ``metp.wgrad_accum.reduce_dtype``, in bf16)."""
    _MAIN_GRAD_DTYPE.append(dtype)
    try:
        yield
    finally:
        _MAIN_GRAD_DTYPE.pop()


def give_main_grads(module: torch.nn.Module) -> list:
    """What Megatron's DDP gives every parameter: an fp32 ``main_grad`` (bf16 inside
    :func:`main_grads_in`), and the flag
    ``grad_added_to_main_grad`` (False; DDP's ``zero_grad_buffer`` resets it every step). With
    ``--gradient-accumulation-fusion`` (Megatron-LM's default) the weight-gradient GEMM of its
    linears accumulates straight into it, sets the flag and hands autograd an uninitialised
    placeholder (METP's weights too: ``metp.wgrad_accum``). Laid out as DDP's
    ``_ParamAndGradBuffer`` lays them out: views of one flat buffer, the parameters in reverse
    order, each starting at a multiple of 64 values (the distributed optimizer's alignment;
    without it DDP pads nothing, so a bias of another size would share one add with its
    weight in training and not here: the paper models' biases are multiples of 64 at p = 8;
    one bucket: the layers traced here are far under Megatron-LM's 40M-value buckets). Returns
    the buffer (``[]`` where nothing trains). Model state, not activation: the planner counts
    it in ``optimizer_bytes_per_param``."""
    prms = [prm for prm in module.parameters()
            if prm.requires_grad and not hasattr(prm, "main_grad")]
    if not prms:
        return []
    starts, end = [], 0
    for prm in reversed(prms):
        start = -(-end // 64) * 64
        starts.append(start)
        end = start + prm.numel()
    buf = torch.zeros(end, dtype=_MAIN_GRAD_DTYPE[-1], device=prms[0].device)
    for prm, start in zip(reversed(prms), starts):
        prm.main_grad = buf[start:start + prm.numel()].view(prm.shape)
        prm.grad_added_to_main_grad = False
    return [buf]


def ddp_grad_hooks(module: torch.nn.Module) -> list:
    """Megatron DDP's backward post-hook on every parameter of ``module`` (``distributed.
    DistributedDataParallel._make_backward_post_hook``): a ``.grad`` that was not already
    added to ``main_grad`` (by a fused weight-gradient GEMM) is added there, one kernel per
    parameter, and dropped. Returns the hook handles (remove them after the step)."""

    def hook(prm):
        if prm.grad is not None and not getattr(prm, "grad_added_to_main_grad", False):
            prm.main_grad.add_(prm.grad)
        prm.grad = None

    return [prm.register_post_accumulate_grad_hook(hook)
            for prm in module.parameters() if prm.requires_grad]


def _global_buffer():
    """Megatron's ``GlobalMemoryBuffer`` (the SP all-gather scratch), or None."""
    from megatron.core import parallel_state as mpu

    try:
        return mpu.get_global_memory_buffer()
    except AssertionError:
        return None


def _buffer_bytes(gbuf) -> int:
    if gbuf is None:
        return 0
    return sum(t.numel() * t.element_size() for t in gbuf.buffer.values())


@contextlib.contextmanager
def _fake_storage_copy(fake: bool) -> Iterator[None]:
    """Under FakeTensorMode, make ``UntypedStorage.copy_`` a no-op for the region.

    Megatron's selective recompute (``CheckpointWithoutOutput``) frees a norm's output with
    ``storage.resize_(0)`` and restores it in backward with ``resize_`` + ``storage.copy_``. On
    fake storages that ``copy_`` keeps both storages counted for the rest of the step (measured:
    a real run frees them when the tensors die, a fake one never does), so the planner would
    read one recomputed output too many at a later peak. Fake data has no values to copy.
    """
    if not fake:
        yield
        return
    orig = torch.UntypedStorage.copy_
    torch.UntypedStorage.copy_ = lambda self, src, non_blocking=None: self
    try:
        yield
    finally:
        torch.UntypedStorage.copy_ = orig


def _measure(module: torch.nn.Module, x: torch.Tensor, run_forward, extra=()) -> LayerMeasure:
    """fwd (``run_forward(x) -> output``), then bwd with a gradient of the output's shape."""
    hooks = _drop_param_grads(module)
    main_grads = give_main_grads(module)
    # Megatron's SP linears all-gather into one process-wide scratch buffer that outlives every
    # layer: start empty so it is allocated (and counted) inside the region, and report it apart
    # (``shared_buffer``) so the planner counts it once per rank, not once per layer. Emptying it
    # also drops tensors of an earlier FakeTensorMode.
    gbuf = _global_buffer()
    if gbuf is not None:
        gbuf.buffer.clear()
    tracker = MemTracker()
    tracker.track_external(module, x, *extra, *main_grads)
    try:
        from torch._subclasses.fake_tensor import FakeTensor

        with tracker, CommCounter() as cc, _fake_storage_copy(isinstance(x, FakeTensor)):
            base = _total(tracker.get_tracker_snapshot("current"))
            out = run_forward(x)
            retained = _total(tracker.get_tracker_snapshot("current")) - base
            retained -= _buffer_bytes(gbuf)
            fwd_peak = _total(tracker.get_tracker_snapshot("peak")) - base
            grad = torch.empty_like(out) if out.dim() else torch.ones_like(out)
            out.backward(grad)
            del out, grad
        peak = _total(tracker.get_tracker_snapshot("peak")) - base
    finally:
        for h in hooks:
            h.remove()
    sends = [e.bytes for e in cc.events if e.op == "send"]
    return LayerMeasure(
        retained=retained,
        peak=peak,
        fwd_peak=fwd_peak,
        shared_buffer=_buffer_bytes(gbuf),
        handle_allowance=max(sends, default=0),
        params=sum(prm.numel() for prm in module.parameters()),
        sent_elements=cc.sent_elements(),
        payload_bytes={op: st.bytes for op, st in cc.stats.items() if st.calls},
        calls=cc.calls(),
    )


@dataclass
class SavedTensor:
    module: str        # innermost module running when autograd saved it ('' = the layer itself)
    shape: tuple
    dtype: str
    bytes: int         # of its storage (a view keeps its whole storage alive)


def saved_for_backward(module: torch.nn.Module, x: torch.Tensor, run_forward,
                       extra=()) -> list:
    """Every distinct storage that autograd saves for backward during ``run_forward(x)``, with
    the module that saved it first: the itemised form of ``retained`` (parameters, ``x`` and
    ``extra`` left out, as they exist before the layer runs). Works under FakeTensorMode."""
    names = {m: n for n, m in module.named_modules()}
    stack: list = []
    def enter(m, args) -> None:
        stack.append(names[m])

    def leave(m, args, out) -> None:  # returning a value would replace the module's output
        stack.pop()

    pre = [m.register_forward_pre_hook(enter) for m in names]
    post = [m.register_forward_hook(leave) for m in names]
    give_main_grads(module)
    gbuf = _global_buffer()
    if gbuf is not None:  # its scratch may hold tensors of an earlier FakeTensorMode
        gbuf.buffer.clear()
    skip = {t.untyped_storage()._cdata for t in (*module.parameters(), x, *extra)
            if isinstance(t, torch.Tensor)}
    found: Dict[int, SavedTensor] = {}

    def pack(t):
        key = t.untyped_storage()._cdata
        if key not in skip and key not in found:
            found[key] = SavedTensor(stack[-1] if stack else "", tuple(t.shape),
                                     str(t.dtype).replace("torch.", ""),
                                     t.untyped_storage().nbytes())
        return t

    try:
        with torch.autograd.graph.saved_tensors_hooks(pack, lambda t: t):
            out = run_forward(x)
    finally:
        for h in pre + post:
            h.remove()
    del out
    return list(found.values())


# The probe mode of stock TP x CP with --cp-comm-type a2a (planner.probe_mode).
A2A_PROBE = "tp_a2a"


def build_layer(config, mode: str, causal: bool = True, ring_pass: Optional[str] = None):
    """One Megatron ``TransformerLayer`` of ``mode``'s spec (``wallfacer`` needs its groups;
    :data:`A2A_PROBE`: stock tp over Megatron's CP group with the a2a stand-in).
    ``ring_pass``: METP attention's head groups per ring pass (``metp.attention.RING_PASSES``;
    None keeps its default, ``auto``)."""
    from megatron.core.transformer.enums import AttnMaskType
    from megatron.core.transformer.spec_utils import build_module

    from megatron_metp.specs import check_spec_importable, get_gpt_layer_spec

    if mode == A2A_PROBE:
        # Stock TP x CP with --cp-comm-type a2a: Megatron's tp layer, the a2a stand-in as its
        # core attention on Megatron's CP group (planner.CP_A2A_STAND_IN).
        from megatron.core import parallel_state as mpu

        spec = get_gpt_layer_spec("tp", qk_layernorm=bool(config.qk_layernorm),
                                  cp_a2a_group=mpu.get_context_parallel_group())
    else:
        spec = get_gpt_layer_spec(mode, qk_layernorm=bool(config.qk_layernorm))
    if not causal:
        spec.submodules.self_attention.params = {"attn_mask_type": AttnMaskType.no_mask}
    check_spec_importable(spec)
    layer = build_module(spec, config=config, layer_number=1)
    if mode == "metp":
        # As MetpGPTModel trains it: causal tokens in the balanced layout (rank r holds chunks r
        # and 2p-1-r), so every rank's trace is the same work.
        from megatron_metp.metp.attention import set_balanced_layout

        set_balanced_layout(layer, causal)
        if ring_pass is not None:
            from megatron_metp.metp.attention import set_ring_pass

            set_ring_pass(layer, ring_pass)
    return layer


def _layer_step(config, mode: str, seq_length: int, micro_batch: int, causal: bool,
                rope: bool, rotary_base: int, layer: Optional[torch.nn.Module],
                device: Optional[torch.device]):
    """``(layer, x_shard_s, extra, fwd)``: one training-mode layer of ``mode``, its
    ``[s/p, b, h]`` input, the tensors made outside it (the rotary table) and its forward."""
    p = config.tensor_model_parallel_size * config.context_parallel_size
    if seq_length % p:
        raise ValueError(f"--seq-length {seq_length} must be divisible by the parallel size {p}")
    layer = layer if layer is not None else build_layer(config, mode, causal)
    layer.train()
    x = torch.empty(seq_length // p, micro_batch, config.hidden_size, dtype=config.params_dtype,
                    device=device).normal_().requires_grad_()
    rot = None
    if rope:
        from megatron.core.models.common.embeddings.rotary_pos_embedding import RotaryEmbedding

        # Megatron's rotary table for the whole sequence, [s, 1, 1, d] fp32, made once per step
        # by GPTModel (outside the layers): counted as external, like the input.
        rot = RotaryEmbedding(kv_channels=config.kv_channels, rotary_percent=1.0,
                              rotary_base=rotary_base)(seq_length).to(device or "cpu")
        attn = getattr(layer, "self_attention", None)
        if getattr(attn, "uses_balanced_layout", None) and attn.uses_balanced_layout(
                seq_length // p, causal):
            # The table in the balanced order, as MetpGPTModel hands it to its layers.
            from megatron_metp.token_layout import permute_sequence

            rot = permute_sequence(rot, config.tensor_model_parallel_size, dim=0)

    def fwd(inp):
        out, _ = layer(inp, attention_mask=None, rotary_pos_emb=rot)
        return out

    if getattr(config, "recompute_granularity", None) == "full":
        # --recompute-granularity full, one layer per chunk: Megatron's own CheckpointFunction
        # around the layer, as TransformerBlock._checkpointed_forward calls it. It keeps the
        # layer's input (external here) and its output, and runs the forward again, ring
        # traffic included, inside the backward.
        from megatron.core import tensor_parallel

        plain = fwd

        def fwd(inp):  # noqa: F811 - the checkpointed forward replaces the plain one
            return tensor_parallel.checkpoint(plain, config.distribute_saved_activations, inp)

    return layer, x, (rot,) if rot is not None else (), fwd


def measure_layer(config, mode: str, seq_length: int, micro_batch: int = 1, *,
                  causal: bool = True, rope: bool = False, rotary_base: int = 10000,
                  layer: Optional[torch.nn.Module] = None,
                  device: Optional[torch.device] = None) -> LayerMeasure:
    """Forward + backward of one layer on this rank's ``[s/p, b, h]`` shard (see module doc).

    Call inside ``FakeTensorMode`` for a fake run, or with real process groups for a real one.
    ``p`` is the size of the group that shards the sequence (TP for tp/metp, CP for wallfacer).
    """
    layer, x, extra, fwd = _layer_step(config, mode, seq_length, micro_batch, causal, rope,
                                       rotary_base, layer, device)
    return _measure(layer, x, fwd, extra=extra)


def itemise_layer(config, mode: str, seq_length: int, micro_batch: int = 1, *,
                  causal: bool = True, rope: bool = False, rotary_base: int = 10000,
                  device: Optional[torch.device] = None) -> list:
    """What one layer keeps for backward, tensor by tensor (:func:`saved_for_backward`), its
    output last: the breakdown of ``measure_layer``'s ``retained``."""
    layer, x, extra, fwd = _layer_step(config, mode, seq_length, micro_batch, causal, rope,
                                       rotary_base, None, device)
    items = saved_for_backward(layer, x, fwd, extra=extra)
    items.append(SavedTensor("(layer output)", tuple(x.shape), str(x.dtype).replace("torch.", ""),
                             x.numel() * x.element_size()))
    return items


class _Head(torch.nn.Module):
    """Final norm, the output layer (vocab-parallel ``ColumnParallelLinear``) and the loss.

    ``tp`` / ``wallfacer``: Megatron's logits and ``vocab_parallel_cross_entropy`` (GPTModel's
    ``compute_language_model_loss`` without fused cross entropy). ``metp``: the same weight, its
    vocabulary shards on the METP ring (``metp.cross_entropy``), no logits tensor."""

    def __init__(self, config, vocab_size: int, mode: str = "tp"):
        super().__init__()
        from megatron.core.tensor_parallel.layers import ColumnParallelLinear

        from megatron_metp.layers import Norm

        self.mode = mode
        self.norm = Norm(config, config.hidden_size, eps=config.layernorm_epsilon)
        self.output_layer = ColumnParallelLinear(
            config.hidden_size, vocab_size, config=config, init_method=config.init_method,
            bias=False, gather_output=False, skip_bias_add=True)

    def forward(self, x, labels):
        from megatron.core import tensor_parallel

        if self.mode == "metp":
            from megatron.core import parallel_state as mpu

            from megatron_metp.metp.cross_entropy import metp_cross_entropy

            return metp_cross_entropy(self.norm(x), self.output_layer.weight, labels,
                                      mpu.get_tensor_model_parallel_group()).mean()
        logits, _ = self.output_layer(self.norm(x))
        # GPTModel.compute_language_model_loss (no fused cross entropy): [s, b] per-token loss.
        return tensor_parallel.vocab_parallel_cross_entropy(logits, labels).mean()


def measure_head(config, vocab_size: int, seq_length: int, micro_batch: int = 1,
                 device: Optional[torch.device] = None, mode: str = "tp") -> LayerMeasure:
    """The LM head (final norm, logits, cross entropy) forward + backward; ``mode`` ``metp``
    takes METP's ring cross entropy (see ``_Head``)."""
    p = config.tensor_model_parallel_size * config.context_parallel_size
    head = _Head(config, vocab_size, mode)
    x = torch.empty(seq_length // p, micro_batch, config.hidden_size, dtype=config.params_dtype,
                    device=device).normal_().requires_grad_()
    # Labels of the tokens whose logits this rank computes: all s under TP's SP head (the output
    # layer all-gathers the sequence), s/p under METP and WallFacer.
    # Under CP each rank's head sees its CP shard (s / cp, all-gathered over TP with SP).
    rows = seq_length // config.context_parallel_size \
        if config.sequence_parallel and mode != "metp" else seq_length // p
    labels = torch.zeros(rows, micro_batch, dtype=torch.long, device=device)
    return _measure(head, x, lambda inp: head(inp, labels), extra=(labels,))



def measure_sublayers(config, mode: str, seq_length: int, micro_batch: int = 1, *,
                      causal: bool = True, ring_pass: Optional[str] = None
                      ) -> Dict[str, Dict[str, int]]:
    """Forward activation peak of the attention and the MLP sublayers alone (METP Tables 1-2).

    Tables 1-2 compare the *peak memory overhead during forward propagation* of one sublayer's
    intermediate results, so this measures each sublayer's training forward (autograd on, so
    what it saves for backward counts, as in the tables) high-water mark over its parameters and
    its ``[s/p, b, h]`` input (``fwd_peak``), and for reference its forward + backward one
    (``peak``) and what it keeps for backward (``retained``). No rotary embedding.
    ``ring_pass``: as :func:`build_layer`.
    """
    layer = build_layer(config, mode, causal, ring_pass)
    layer.train()
    p = config.tensor_model_parallel_size * config.context_parallel_size
    out: Dict[str, Dict[str, int]] = {}
    for name, module, call in (
        ("attention", layer.self_attention,
         lambda m, x: m(x, attention_mask=None)[0]),
        ("mlp", layer.mlp, lambda m, x: m(x)[0]),
    ):
        x = torch.empty(seq_length // p, micro_batch, config.hidden_size,
                        dtype=config.params_dtype).normal_().requires_grad_()
        full = _measure(module, x, lambda inp, m=module, c=call: c(m, inp))
        out[name] = dict(fwd_peak=full.fwd_peak, peak=full.peak, retained=full.retained)
    return out
