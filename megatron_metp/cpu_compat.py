"""Every CPU stand-in for Megatron-Core's CUDA-only calls lives here (applied only without CUDA).

What the specs cannot replace is patched at run time by :func:`apply`, which does nothing when
``torch.cuda.is_available()`` and is idempotent. The norm and core attention are not patched:
the plugin's specs use ``megatron_metp.layers.Norm`` / ``SDPACoreAttention`` instead of
``WrappedTorchNorm`` (refuses sequence parallelism) and ``DotProductAttention`` (score buffer on
the CUDA device, causal mask built with ``device="cuda"``).

Stand-ins (each names the Megatron-Core code it covers; tests/test_cpu_compat.py exercises each):

1. ``torch.cuda.current_device`` -> ``torch.device("cpu")``. Megatron-Core allocates with
   ``device=torch.cuda.current_device()`` in the SP mappings (``tensor_parallel.mappings.
   _gather_along_first_dim`` / ``_reduce_scatter_along_first_dim``), ``GlobalMemoryBuffer.get_tensor``,
   ``RotaryEmbedding.forward``, the DDP grad buffers (``distributed.param_and_grad_buffer``),
   ``ChainedOptimizer.get_loss_scale``, the pipeline P2P shape exchange
   (``pipeline_parallel.p2p_communication``) and dist-checkpointing's validation all-reduces.
   On a CPU build the original raises "Torch not compiled with CUDA enabled", so only code that
   would otherwise crash sees the stand-in; code that checks ``is_available()`` first is unaffected.
2. ``torch.cuda.synchronize`` -> no-op: there is no device queue to drain on CPU. Called by
   dist-checkpointing (``strategies.fully_parallel``, ``filesystem_async``, ``async_utils``),
   the pipeline P2P (``p2p_communication._communicate``) and DDP's ``free_overlap_buffers``.
3. Megatron's RNG tracker (``tensor_parallel.random.CudaRNGStatesTracker.add`` / ``.fork`` and the
   module functions ``_get_cuda_rng_state`` / ``_set_cuda_rng_state``, used by
   ``model_parallel_cuda_manual_seed``, ``get_cuda_rng_tracker().fork()`` and activation
   recomputation's ``CheckpointFunction``): on CPU the generator that draws dropout masks for CPU
   tensors is torch's default CPU generator, so the tracked named states are CPU generator states.
4. ``device='cuda'`` literals, rewritten to CPU inside the Megatron functions that contain them:
   ``optimizer.optimizer.FP32Optimizer.__init__`` (``_scale``), ``MixedPrecisionOptimizer.__init__``
   (``found_inf``), ``Float16OptimizerWithFloat16Params.__init__`` (which also dispatches on
   CUDA type names: inside it a CPU tensor's ``.type()`` reports the CUDA name of its dtype),
   ``optimizer.clip_grads.get_grad_norm_fp32`` / ``count_zeros_fp32`` (and
   ``utils.local_multi_tensor_l2_norm`` beneath them), dist-checkpointing's
   ``state_dict_saver.verify_global_md_reuse``, and the pipeline schedules
   (``pipeline_parallel.schedules.forward_backward_no_pipelining`` /
   ``_pipelining_without_interleaving`` / ``_pipelining_with_interleaving``: their token counter),
   and ``LanguageModule.setup_embeddings_and_output_layer`` (tied embeddings with pipeline
   parallelism: ``.cuda()`` on the last stage's word-embedding copy, kept on CPU).
   The rewrite is a ``TorchFunctionMode`` active only while the wrapped function runs (for the
   schedules that is the whole forward/backward step: a Python-level check per torch call,
   negligible next to a CPU matmul).
5. ``optimizer.clip_grads.clip_grad_by_total_norm_fp32`` asserts CUDA gradient types: replaced
   by a device-agnostic version with the same coefficient.

6. Megatron-LM's default fusions whose kernels are CUDA extensions, so that the stock ``tp``
   baseline (``megatron_metp.model.STOCK_FUSIONS``) keeps what the GPU kernels keep:
   ``--apply-rope-fusion`` (``rope_utils.fused_apply_rotary_pos_emb``, Transformer Engine's
   ``FusedRoPEFunc``: saves only the [s, 1, 1, d] fp32 angle table and recomputes cos/sin in
   backward, where the unfused path keeps cos/sin copies) and ``--gradient-accumulation-fusion``
   (apex's ``fused_weight_gradient_mlp_cuda.wgrad_gemm_accum_fp32/_fp16``: the weight gradient
   GEMM accumulates straight into ``main_grad``, no transient ``.grad``). Same math, on CPU.
   The fused bias-GeLU and SwiGLU functions (``fusions.fused_bias_gelu`` / ``fused_bias_swiglu``)
   are compiled functions (Megatron's ``jit_fuser``) that a GPU fuses into one kernel with no
   intermediate tensors; on CPU (and under fake tensors) each elementwise step would allocate
   a full-size temporary, so they run here eagerly in 16 token chunks: same values,
   temporaries 1/16 of that size. Eagerly, not compiled: inductor's CPU code rounds by the
   host's vector ISA, so a compiled run would not equal a run on another machine bit for bit.
7. ``tensor_parallel.random.CheckpointWithoutOutput`` (``--recompute-modules layernorm``):
   its constructor takes ``fp8 is not None`` as "fp8 on", so the default ``fp8=False`` calls
   Transformer Engine's ``FP8GlobalStateManager``, a NameError without TE. Without TE there is
   no fp8: the stand-in keeps it off.

8. Megatron-Core's ``DistributedOptimizer`` (``--use-distributed-optimizer``) on its fallback to
   torch's Adam (no Apex, no Transformer Engine; :func:`_install_torch_adam_fixes`): its
   constructor dispatches on CUDA type names (as in 4), ``get_parameter_state_dp_zero`` (the
   fully reshardable checkpoint form) moves its gather buffers with ``.cuda()`` (kept on CPU),
   and three defects of that fallback's checkpoint path are mended: the load request of a
   fresh run asserts on the empty Adam state (Megatron's own zero-gradient step creates it,
   as it does for its fsdp_dtensor form), every parameter is handed one shared ``step`` tensor
   that Adam then increments once per parameter, and the per-parameter state copy demands or
   overwrites ``step``. A GPU run without Apex and Transformer Engine would meet the same
   three; with either (every Megatron-LM GPU image) Adam keeps its step in the param groups.
9. Megatron-FSDP (``--use-megatron-fsdp``: ``distributed.fsdp.mcore_fsdp_adapter.
   FullyShardedDataParallel``; :func:`apply_megatron_fsdp`, which ``metp train`` calls only
   when it builds Megatron-FSDP, not :func:`apply`). Its CUDA streams
   (``MegatronFSDP.__init__``'s two side streams; the gradient reduce-scatter and parameter
   all-gather pipelines of ``param_and_grad_buffer`` wait on them, enter them and record events
   on them) become streams whose waits do nothing: a CPU process is one in-order executor, and
   every gloo collective is still waited on through its work handle. ``MegatronFSDP.__init__``
   formats ``cuda:{current_device()}`` only to compare it with its ``device`` argument (stand-in
   1 would make that ``cuda:cpu``): there ``current_device()`` is CUDA's index, 0. The
   adapter's ``DeviceMesh.from_group(..., device_type="cuda")`` meshes are CPU meshes over the
   same groups, and ``uneven_dtensor.validate_uneven_dtensor``'s ``.cuda()`` stays on CPU (as 4).
   Without Transformer Engine the adapter's ``TELinear`` is a mock (Megatron's TE extension
   module builds its classes on a MagicMock), which its TP > 1 check passes to ``isinstance``;
   no module is a TELinear then, so a class that nothing derives from stands in. Its TP > 1
   RNG synchronisation (``_get_rng_state_dict`` / ``_load_rng_state_dict``) reads and sets
   ``torch.cuda``'s generator besides the CPU one; the CPU twins leave that entry out.
   One setting is not a stand-in: ``gradient_reduce_div_fusion`` (an NCCL-only pre-multiplied
   sum) is off under gloo, where Megatron scales by 1/d before the sum instead (``metp train``).
   The parameter all-gathers (coalesced, asynchronous, prefetched ahead of the layer that needs
   them) complete before ``all_gather_params`` returns, as Megatron-FSDP does with
   ``async_param_gather=False``. Asynchronous, a rank process died in about 1 run of 30 of
   ``tests/test_megatron_fsdp.py`` with glibc's ``malloc(): unaligned tcache chunk detected``
   (heap corruption, SIGABRT), caught in Megatron-FSDP's coalesced parameter all-gather on gloo
   (``_coalescing_manager.__exit__``, ``all_gather_single_coalesced``); its peers then saw
   gloo's "Connection reset by peer". The likely mechanism (not proven: the corruption is
   found where it is next detected, not where it is made): a gloo worker thread still writing
   a prefetched bucket while the main thread frees or re-allocates bucket storage
   (``_free_storage`` resizes the storage to 0 under every view of it). Synchronous gathers
   leave no gloo thread running beside the main one. The cost on CPU is the overlap of a
   prefetch with compute, which two cores barely give. Not applied on GPU, where the streams
   and the caching allocator order the same sequence.
"""

from __future__ import annotations

import contextlib
import functools
import sys
from typing import Any, Callable, List

import torch
from torch.overrides import TorchFunctionMode

from megatron_metp.kernels import has_widening_gemm, is_fake

_APPLIED = False


# --------------------------------------------------------------------------------------------
# 1-2. torch.cuda.current_device / torch.cuda.synchronize


def _cpu_current_device() -> torch.device:
    """CPU stand-in for ``torch.cuda.current_device`` (Megatron allocates on this device)."""
    return torch.device("cpu")


def _cpu_synchronize(device: Any = None) -> None:
    """CPU stand-in for ``torch.cuda.synchronize``: CPU ops complete in program order."""
    return None


# --------------------------------------------------------------------------------------------
# 3. RNG tracker


def _cpu_get_rng_state(device: Any = "cuda", clone: bool = False, graph_safe: bool = False):
    """Stand-in for ``tensor_parallel.random._get_cuda_rng_state``: the CPU generator's state."""
    return torch.get_rng_state()


def _cpu_set_rng_state(new_state: torch.Tensor, device: int = -1, graph_safe: bool = False):
    """Stand-in for ``tensor_parallel.random._set_cuda_rng_state``."""
    torch.set_rng_state(new_state)


def _cpu_tracker_add(self, name: str, seed: int) -> None:
    """Stand-in for ``CudaRNGStatesTracker.add``: a named CPU generator state seeded with ``seed``."""
    self._is_initialized = True
    if seed in self.seeds_:
        raise Exception(f"seed {seed} already exists")
    self.seeds_.add(seed)
    if name in self.states_:
        raise Exception(f"rng state {name} already exists")
    # A private generator leaves the default generator's stream untouched.
    self.states_[name] = torch.Generator().manual_seed(seed).get_state()


def _cpu_tracker_fork(self, name: str = "model-parallel-rng"):
    """Stand-in for ``CudaRNGStatesTracker.fork``: swap the CPU generator to the named state.

    Megatron's version also warns when the CPU state changes inside the fork, which on CPU is
    exactly what the fork is for; the nesting rules (an outer named fork is saved and restored)
    are Megatron's.
    """

    @contextlib.contextmanager
    def _fork():
        if name not in self.states_:
            raise Exception(f"rng state {name} is not added")
        outer_state = torch.get_rng_state()
        outer_name = self._current_state_name
        if outer_name != "default-rng":
            self.states_[outer_name] = outer_state
        torch.set_rng_state(self.states_[name])
        self._current_state_name = name
        try:
            yield
        finally:
            self.states_[name] = torch.get_rng_state()
            if outer_name != "default-rng":
                outer_state = self.states_[outer_name]
            torch.set_rng_state(outer_state)
            self._current_state_name = outer_name

    return _fork()


# --------------------------------------------------------------------------------------------
# 4. device='cuda' literals


class _CudaLiteralsOnCpu(TorchFunctionMode):
    """Rewrites an explicit CUDA ``device=`` argument of torch calls to CPU.

    With ``cuda_type_names``, a CPU tensor's ``.type()`` also reports the CUDA name of its dtype
    ('torch.cuda.BFloat16Tensor'), for Megatron code that dispatches on those names; that part
    is enabled only around the one constructor that needs it.
    """

    def __init__(self, cuda_type_names: bool = False):
        super().__init__()
        self.cuda_type_names = cuda_type_names

    def __torch_function__(self, func, types, args=(), kwargs=None):
        kwargs = kwargs or {}
        if self.cuda_type_names and func is torch.Tensor.type and len(args) == 1 and not kwargs:
            name = func(*args)
            return name if ".cuda." in name else name.replace("torch.", "torch.cuda.", 1)
        if func is torch.Tensor.cuda:  # a move to the GPU: on CPU the tensor stays where it is
            return args[0]
        dev = kwargs.get("device")
        if dev is not None and torch.device(dev).type == "cuda":
            kwargs = dict(kwargs, device="cpu")
        return func(*args, **kwargs)


def _cuda_literals_on_cpu(fn: Callable, cuda_type_names: bool = False) -> Callable:
    """Wrap a Megatron function so that its ``device='cuda'`` tensor literals land on CPU."""
    if getattr(fn, "_metp_cpu_wrapped", False):
        return fn

    @functools.wraps(fn)
    def wrapper(*args, **kwargs):
        with _CudaLiteralsOnCpu(cuda_type_names):
            return fn(*args, **kwargs)

    wrapper._metp_cpu_wrapped = True
    return wrapper


def _rebind_everywhere(old: Callable, new: Callable) -> None:
    """Point every loaded ``megatron.core`` module attribute that holds ``old`` at ``new``
    (functions imported by name, e.g. ``from .clip_grads import get_grad_norm_fp32``)."""
    for mod_name, mod in list(sys.modules.items()):
        if mod is None or not mod_name.startswith("megatron.core"):
            continue
        for attr, val in list(vars(mod).items()):
            if val is old:
                setattr(mod, attr, new)


def _wrap_function(module: Any, name: str) -> None:
    old = getattr(module, name)
    new = _cuda_literals_on_cpu(old)
    if new is not old:
        _rebind_everywhere(old, new)


def _wrap_method(cls: type, name: str, cuda_type_names: bool = False) -> None:
    setattr(cls, name, _cuda_literals_on_cpu(cls.__dict__[name], cuda_type_names))


def _cpu_clip_grad_by_total_norm_fp32(
    parameters, max_norm: float, total_norm: float, use_decoupled_grad: bool = False
) -> None:
    """Stand-in for ``optimizer.clip_grads.clip_grad_by_total_norm_fp32``.

    Megatron's version asserts ``grad.type() == 'torch.cuda.FloatTensor'``; this one accepts fp32
    (and, for decoupled grads, bf16) gradients on any device and scales them in place by the
    same coefficient, ``max_norm / (total_norm + 1e-6)`` when that is below 1.
    """
    from megatron.core.utils import to_local_if_dtensor

    if isinstance(parameters, torch.Tensor):
        parameters = [parameters]
    attr = "decoupled_grad" if use_decoupled_grad else "grad"
    allowed = (torch.float32, torch.bfloat16) if use_decoupled_grad else (torch.float32,)
    grads = []
    for param in parameters:
        grad = getattr(param, attr, None)
        if grad is not None:
            if grad.dtype not in allowed:
                raise TypeError(f"clip_grad_by_total_norm_fp32: {attr} of dtype {grad.dtype}")
            grads.append(to_local_if_dtensor(grad).detach())
    clip_coeff = max_norm / (total_norm + 1.0e-6)
    if clip_coeff < 1.0 and grads:
        torch._foreach_mul_(grads, clip_coeff)


def _set_states_keeping_step(set_states: Callable) -> Callable:
    """``DistributedOptimizer._set_main_param_and_optimizer_states``: with torch's Adam each
    parameter's state also holds ``step``, which ``load_state_dict`` has already set from the
    checkpoint's param groups (Megatron's loaders treat it apart). The per-parameter copy then
    copies every destination key from the loaded tensors: the fully reshardable ones carry no
    ``step`` (a KeyError), the dp_reshardable ones carry the placeholder state's (a resumed
    run would restart Adam's bias correction). The stand-in hands the step already set back to
    the copy (a copy onto itself), and copies under ``no_grad`` (the dp_reshardable loader lacks
    the guard, and an fp32 model's main parameters are views of its parameters)."""

    @functools.wraps(set_states)
    def wrapper(self, model_param, tensors):
        group_index, group_order = self.model_param_group_index_map[model_param]
        main_param = self.optimizer.param_groups[group_index]["params"][group_order]
        step = self.optimizer.state.get(main_param, {}).get("step")
        if step is not None:
            tensors = dict(tensors, step=step)
        with torch.no_grad():
            return set_states(self, model_param, tensors)

    return wrapper


def _load_with_own_steps(load_state_dict: Callable) -> Callable:
    """``DistributedOptimizer.load_state_dict``: without Apex or TE it gives every parameter's
    state the same ``step`` tensor, which torch's Adam then increments in place once per
    parameter per step (a resumed run's bias correction jumps). Each state gets its own copy."""

    @functools.wraps(load_state_dict)
    def wrapper(self, state_dict):
        out = load_state_dict(self, state_dict)
        for st in self.optimizer.state.values():
            if isinstance(st.get("step"), torch.Tensor):
                st["step"] = st["step"].clone()
        return out

    return wrapper


def _sharded_state_dict_with_state(sharded_state_dict: Callable) -> Callable:
    """``DistributedOptimizer.sharded_state_dict``: without Apex or TE its ``state_dict`` reads
    ``step`` from torch's Adam state, which is empty before the first step (an assertion when
    a fresh run builds its load request). Megatron's own remedy for its fsdp_dtensor form, a
    step with zero gradients that creates the state, runs first; the load overwrites it all."""

    @functools.wraps(sharded_state_dict)
    def wrapper(self, model_sharded_state_dict, is_loading=False, *args, **kwargs):
        if is_loading and not self.optimizer.state:
            self._init_optimizer_states_with_dummy_values()
        return sharded_state_dict(self, model_sharded_state_dict, is_loading, *args, **kwargs)

    return wrapper


class _CpuStream:
    """``torch.cuda.Stream`` without a device: one in-order executor, nothing to wait for."""

    def __init__(self, *args, **kwargs):
        pass

    def wait_stream(self, stream) -> None:
        return None

    def wait_event(self, event) -> None:
        return None

    def synchronize(self) -> None:
        return None

    def query(self) -> bool:
        return True

    def record_event(self, event=None):
        return _CpuEvent()


class _CpuEvent:
    """What :meth:`_CpuStream.record_event` returns: the work before it has already run."""

    def wait(self, stream=None) -> None:
        return None

    def synchronize(self) -> None:
        return None

    def query(self) -> bool:
        return True


_CPU_STREAM = _CpuStream()


class _CpuMeshes:
    """``DeviceMesh`` as ``mcore_fsdp_adapter`` uses it (``from_group`` only), on CPU."""

    @staticmethod
    def from_group(group, device_type, *args, **kwargs):
        from torch.distributed import DeviceMesh

        return DeviceMesh.from_group(group, "cpu" if device_type == "cuda" else device_type,
                                     *args, **kwargs)


def _fsdp_rng_state_dict() -> dict:
    """``mcore_fsdp_adapter._get_rng_state_dict`` without its ``torch.cuda.get_rng_state()``
    entry: on CPU the generator it names is the CPU one, already in ``torch_rng_state``."""
    import random

    import numpy as np
    from megatron.core import tensor_parallel

    return {"random_rng_state": random.getstate(), "np_rng_state": np.random.get_state(),
            "torch_rng_state": torch.get_rng_state(),
            "rng_tracker_states": tensor_parallel.get_cuda_rng_tracker().get_states()}


def _fsdp_load_rng_state_dict(state: dict) -> None:
    """``mcore_fsdp_adapter._load_rng_state_dict``'s CPU twin (see :func:`_fsdp_rng_state_dict`)."""
    import random

    import numpy as np
    from megatron.core import tensor_parallel

    random.setstate(state["random_rng_state"])
    np.random.set_state(state["np_rng_state"])
    torch.set_rng_state(state["torch_rng_state"])
    tensor_parallel.get_cuda_rng_tracker().set_states(state["rng_tracker_states"])


def _index_as_current_device(init: Callable) -> Callable:
    @functools.wraps(init)
    def wrapper(*args, **kwargs):
        saved = torch.cuda.current_device
        torch.cuda.current_device = lambda: 0
        try:
            return init(*args, **kwargs)
        finally:
            torch.cuda.current_device = saved

    return wrapper


def _synchronous_param_gather(all_gather_params: Callable) -> Callable:
    """``AllGatherPipeline.all_gather_params`` with its coalesced all-gathers completed before
    it returns (``async_param_gather=False``: Megatron-FSDP's own synchronous form). On gloo an
    async all-gather runs on a worker thread of the process group while the main thread goes
    on, and Megatron-FSDP frees and re-allocates its parameter buckets by resizing their
    storage (``StorageResizeBasedBucketAllocator``), which on CUDA the streams and the caching
    allocator order. See item 9 for what it cost."""
    @functools.wraps(all_gather_params)
    def wrapper(self, *args, **kwargs):
        kwargs["async_param_gather"] = False
        return all_gather_params(self, *args, **kwargs)

    wrapper._metp_synchronous = True
    return wrapper


_FSDP_APPLIED = False


def apply_megatron_fsdp() -> None:
    """Item 9, installed by ``metp train --use-megatron-fsdp`` only (it replaces
    ``torch.cuda.Stream`` for the whole process); a no-op with CUDA and when repeated."""
    global _FSDP_APPLIED
    if torch.cuda.is_available() or _FSDP_APPLIED:
        return
    from megatron.core.distributed.fsdp import mcore_fsdp_adapter
    from megatron.core.distributed.fsdp.src.megatron_fsdp import megatron_fsdp, uneven_dtensor

    torch.cuda.Stream = _CpuStream
    torch.cuda.current_stream = lambda device=None: _CPU_STREAM
    megatron_fsdp.MegatronFSDP.__init__ = _index_as_current_device(
        megatron_fsdp.MegatronFSDP.__init__)
    mcore_fsdp_adapter.DeviceMesh = _CpuMeshes
    mcore_fsdp_adapter._get_rng_state_dict = _fsdp_rng_state_dict
    mcore_fsdp_adapter._load_rng_state_dict = _fsdp_load_rng_state_dict
    # core 0.16.1 imports TELinear for an isinstance check; 0.19 compares the class name instead.
    te_linear = getattr(mcore_fsdp_adapter, "TELinear", None)
    if te_linear is not None and not isinstance(te_linear, type):  # no TE: no TELinear
        mcore_fsdp_adapter.TELinear = type("NoTELinear", (), {})
    from megatron.core.distributed.fsdp.src.megatron_fsdp import param_and_grad_buffer as pgb

    pgb.AllGatherPipeline.all_gather_params = _synchronous_param_gather(
        pgb.AllGatherPipeline.all_gather_params)
    _FSDP_APPLIED = True
    _wrap_function(uneven_dtensor, "validate_uneven_dtensor")


def _install_torch_adam_fixes() -> None:
    """Item 8: Megatron's DistributedOptimizer on its torch-Adam fallback (no Apex, no TE);
    called once, by :func:`apply`."""
    from megatron.core.optimizer import distrib_optimizer

    cls = distrib_optimizer.DistributedOptimizer
    _wrap_method(cls, "__init__", cuda_type_names=True)
    _wrap_method(cls, "get_parameter_state_dp_zero")
    cls._set_main_param_and_optimizer_states = _set_states_keeping_step(
        cls._set_main_param_and_optimizer_states)
    cls.load_state_dict = _load_with_own_steps(cls.load_state_dict)
    cls.sharded_state_dict = _sharded_state_dict_with_state(cls.sharded_state_dict)


# --------------------------------------------------------------------------------------------


class _FusedRoPE(torch.autograd.Function):
    """CPU twin of Transformer Engine's fused RoPE (sbhd layout, rotary_interleaved off)::

        t      [s, b, heads, d]   query or key
        freqs  [s', 1, 1, d_rot]  angles in fp32, s' >= s (the first s rows are used)

    out[..., :d_rot] = t * cos + rotate_half(t) * sin; the rest of ``d`` passes through.
    Only ``freqs`` is kept for backward; d t = g * cos - rotate_half(g * sin).
    """

    @staticmethod
    def _rotate_half(x):
        x1, x2 = torch.chunk(x, 2, dim=-1)
        return torch.cat((-x2, x1), dim=-1)

    @staticmethod
    def forward(ctx, t, freqs):
        f = freqs[: t.shape[0]]
        ctx.save_for_backward(f)
        if is_fake(t):
            # One op, as Transformer Engine's kernel is one launch (the planner's trace and
            # memory tracker: reads t and the table, writes its output, no intermediates).
            return _rope_op()(t, f, False)
        # In token chunks, as the fused kernel runs: its transients are 1/_CHUNKS of the
        # unfused chain's (the same products, element for element).
        return _chunked(lambda x, y: _rope_math(x, y, False), (0, 1), (t, f))

    @staticmethod
    def backward(ctx, g):
        (f,) = ctx.saved_tensors
        if is_fake(g):
            return _rope_op()(g, f, True), None
        return _chunked(lambda x, y: _rope_math(x, y, True), (0, 1), (g, f)), None


def _rope_math(t: torch.Tensor, f: torch.Tensor, backward: bool) -> torch.Tensor:
    """RoPE by the angles ``f`` (``backward``: by ``-f``, its vector-Jacobian product)."""
    rot = f.shape[-1]
    cos, sin = torch.cos(f).to(t.dtype), torch.sin(f).to(t.dtype)
    head, rest = t[..., :rot], t[..., rot:]
    out = (head * cos - _FusedRoPE._rotate_half(head * sin) if backward
           else head * cos + _FusedRoPE._rotate_half(head) * sin)
    return torch.cat((out, rest), dim=-1) if rest.numel() else out


_ROPE_OP = []


def _rope_op():
    """``megatron_metp_cpu::fused_rope``: :class:`_FusedRoPE`'s forward or backward as one op
    on fake tensors (its CPU kernel, the same math, is never reached: real tensors take
    :class:`_FusedRoPE`'s own code)."""
    if not _ROPE_OP:
        op = torch.library.custom_op("megatron_metp_cpu::fused_rope", _rope_math,
                                     mutates_args=())

        @op.register_fake
        def _(t, f, backward):
            return torch.empty_like(t)

        _ROPE_OP.append(op)
    return _ROPE_OP[0]


def fused_apply_rotary_pos_emb_cpu(t: torch.Tensor, freqs: torch.Tensor,
                                   interleaved: bool = False) -> torch.Tensor:
    if interleaved:
        raise ValueError("--rotary-interleaved with --apply-rope-fusion needs Transformer "
                         "Engine's kernel; on CPU pass --no-rope-fusion")
    return _FusedRoPE.apply(t, freqs)


class _WgradAccum:
    """CPU twin of apex's ``fused_weight_gradient_mlp_cuda``: ``main_grad += g^T x``.

    The GEMM runs in the activations' dtype and its weight-sized result is added to
    ``main_grad``: one transient of the weight's size, where apex's kernel writes into
    ``main_grad`` directly. Casting the [tokens, features] operands to fp32 first would add
    activation-sized transients that the GPU kernel does not have."""

    @staticmethod
    def _accum(total_input, grad_output, main_grad):
        from torch._subclasses.fake_tensor import FakeTensor

        x = total_input.reshape(-1, total_input.shape[-1])
        g = grad_output.reshape(-1, grad_output.shape[-1])
        if (isinstance(main_grad, FakeTensor) and main_grad.dtype == torch.float32
                and g.dtype in (torch.bfloat16, torch.float16) and has_widening_gemm()):
            # Fake tensors plan the GPU: there apex's kernel is one GEMM that adds its fp32
            # result into main_grad (beta = 1), no transient; one op here too, of its FLOPs and
            # bytes (the CPU kernels have no bf16-in, fp32-out GEMM: a real CPU run keeps two).
            torch.addmm(main_grad, g.t(), x, out_dtype=torch.float32, out=main_grad)
            return
        if isinstance(main_grad, FakeTensor) and main_grad.dtype == g.dtype:
            # A bf16 main_grad (--grad-reduce-in-bf16): apex's fp16 kernel, one GEMM with
            # beta = 1 into it; one op here too.
            torch.addmm(main_grad, g.t(), x, out=main_grad)
            return
        main_grad.add_(torch.mm(g.t(), x))

    wgrad_gemm_accum_fp32 = _accum
    wgrad_gemm_accum_fp16 = _accum


_CHUNKS = 16


def _chunked(fn, token_args, args):
    n = args[token_args[0]].shape[0]
    step = -(-n // _CHUNKS)
    out = None
    for i in range(0, n, step):
        part = fn(*(a[i:i + step] if k in token_args else a for k, a in enumerate(args)))
        if out is None:
            out = part.new_empty((n, *part.shape[1:]))
        out[i:i + step] = part
    return out


def _like(k):
    return lambda ts: tuple(ts[k].shape)


def _half_of(k):
    return lambda ts: (*ts[k].shape[:-1], ts[k].shape[-1] // 2)


# Megatron-Core's fused activations: (module, function, positions of the token-shaped
# arguments, the output's shape from the arguments'). swiglu's y is [.., 2f], its output [.., f].
_FUSED = (("fused_bias_gelu", "bias_gelu", (1,), _like(1)),                # (bias, y)
          ("fused_bias_gelu", "bias_gelu_back", (0, 2), _like(2)),         # (g, bias, y)
          ("fused_bias_swiglu", "swiglu", (0,), _half_of(0)),              # (y)
          ("fused_bias_swiglu", "bias_swiglu", (0,), _half_of(0)),         # (y, bias)
          ("fused_bias_swiglu", "swiglu_back", (0, 1), _like(1)),          # (g, y)
          ("fused_bias_swiglu", "bias_swiglu_back", (0, 1), _like(1)))     # (g, y, bias)
_ONE_KERNEL = {}


def _one_kernel_op(module: str, name: str, fn, token_args, out_shape):
    """``fn`` as one op, ``megatron_metp_cpu::<name>``, for fake tensors: what a planner's op
    trace and memory tracker see of one fused GPU kernel (one launch, reads its inputs, writes
    its output, no intermediates). Its fake kernel makes the output; its CPU kernel is the
    chunked loop, never reached by the plugin (real tensors take the loop directly)."""
    key = f"{module}.{name}"
    if key not in _ONE_KERNEL:
        def real(tensors: List[torch.Tensor]) -> torch.Tensor:
            return _chunked(fn, token_args, tensors)

        op = torch.library.custom_op(f"megatron_metp_cpu::{name}", real, mutates_args=())

        @op.register_fake
        def _(tensors):
            dtype = functools.reduce(torch.promote_types, (t.dtype for t in tensors))
            return tensors[token_args[0]].new_empty(out_shape(tensors), dtype=dtype)

        _ONE_KERNEL[key] = op
    return _ONE_KERNEL[key]


def _in_token_chunks(fn, token_args, op):
    """``fn`` (elementwise over dim 0 of the arguments at ``token_args``; the others broadcast)
    run on 1/_CHUNKS of the tokens at a time into one output, as a fused kernel would run
    (its transients are 1/_CHUNKS of the unfused chain's). On fake tensors (the planner, the
    timeline) it runs as ``op``, one op: chunking there would trace _CHUNKS x the ops of one
    GPU kernel and charge stock's fused activations 16 launches each."""
    from torch._subclasses.fake_tensor import FakeTensor

    @functools.wraps(fn)
    def run(*args):
        if (isinstance(args[token_args[0]], FakeTensor)
                and not (torch.is_grad_enabled()
                         and any(isinstance(a, torch.Tensor) and a.requires_grad
                                 for a in args))):
            return op(list(args))
        return _chunked(fn, token_args, args)

    run.__metp_chunked__ = True
    return run


def _install_recompute_fix() -> None:
    from megatron.core.tensor_parallel import random as mrandom

    if getattr(mrandom, "HAVE_TE", True):
        return
    cls = mrandom.CheckpointWithoutOutput
    if getattr(cls.__init__, "__metp_no_fp8__", False):
        return
    original = cls.__init__

    @functools.wraps(original)
    def init(self, *args, **kwargs):
        original(self, *args, **kwargs)
        self.fp8 = False  # no Transformer Engine, no fp8

    init.__metp_no_fp8__ = True
    cls.__init__ = init


def _fused_activation_twins() -> list:
    """``(module, name, twin)`` for each of Megatron's fused activations not yet replaced: the
    token-chunked twin, one op on fake tensors (:func:`_in_token_chunks`)."""
    import importlib
    import inspect

    out = []
    for module, name, tokens, out_shape in _FUSED:
        mod = importlib.import_module(f"megatron.core.fusions.{module}")
        fn = getattr(mod, name)
        if not getattr(fn, "__metp_chunked__", False):
            # The Python function under Megatron's ``jit_fuser`` (``torch.compile`` from torch
            # 2.2): on a CPU, inductor's generated C++ rounds by the machine's vector ISA
            # (an AVX-512 host's tanh differs from eager PyTorch's, and from an AVX2 host's,
            # by an ulp), so two machines, or a compiled and an eager run, would not agree bit
            # for bit. Eager is the same math on every machine, and compiles nothing.
            fn = inspect.unwrap(fn)
            out.append((mod, name, _in_token_chunks(
                fn, tokens, _one_kernel_op(module, name, fn, tokens, out_shape))))
    return out


def _install_fusion_kernels() -> None:
    from megatron.core.models.common.embeddings import rope_utils
    from megatron.core.tensor_parallel import layers

    if rope_utils.fused_apply_rotary_pos_emb is None:
        rope_utils.fused_apply_rotary_pos_emb = fused_apply_rotary_pos_emb_cpu
    if not layers._grad_accum_fusion_available:
        layers.fused_weight_gradient_mlp_cuda = _WgradAccum
        layers._grad_accum_fusion_available = True
    for mod, name, twin in _fused_activation_twins():
        setattr(mod, name, twin)


_MISSING = object()


def _with_current_device(fn: Callable, current_device: Callable) -> Callable:
    """``fn`` run with ``torch.cuda.current_device`` as ``current_device`` (the GPU's index)."""

    @functools.wraps(fn)
    def run(*args, **kwargs):
        inside = torch.cuda.current_device
        torch.cuda.current_device = current_device
        try:
            return fn(*args, **kwargs)
        finally:
            torch.cuda.current_device = inside

    return run


def _planning_fork(self, name: str = "model-parallel-rng"):
    """``CudaRNGStatesTracker.fork`` inside :func:`planning` on a GPU node: fake tensors draw no
    random numbers, so no generator state is swapped."""
    return contextlib.nullcontext()


@contextlib.contextmanager
def planning():
    """The stand-ins a plan on fake tensors needs, on any machine (``op_trace.trace_layer``,
    the planner's probes). A plan's layers are fake *CPU* tensors, whatever the machine has.

    Without CUDA, :func:`apply` installs the stand-ins for good. With CUDA, ``apply`` does
    nothing, yet a GPU node plans too: ``--tensor-parallel-mode auto`` and the METP attention
    choice before the rank's group starts, ``metp plan`` there, ``metp bench --calibrate``.
    Stock's fake layer would then meet Megatron's ``torch.cuda.current_device()`` allocations
    (the SP all-gather scratch: "found two different devices cuda:0, cpu"), Transformer Engine's
    RoPE and apex's wgrad kernels, and the compiled fused activations. For the plan's duration
    only, they are swapped for the CPU twins (items 1, 3 and 6), which keep the GPU kernels'
    saved tensors and trace as one op each. Everything is restored on exit, so a real run on the
    GPU afterwards keeps its kernels. Nested uses are fine."""
    if not torch.cuda.is_available():
        apply()
        yield
        return
    from megatron.core.models.common.embeddings import rope_utils
    from megatron.core.tensor_parallel import layers
    from megatron.core.tensor_parallel import random as mrandom

    gpu_index = torch.cuda.current_device
    swaps = [(torch.cuda, "current_device", _cpu_current_device),
             # Megatron's RNG code indexes torch.cuda.default_generators by current_device():
             # it keeps the GPU's index and generators (seeding the fake world's tracker, a
             # recompute's saved state). A fake layer draws nothing: its forks swap no state.
             (mrandom, "_get_cuda_rng_state",
              _with_current_device(mrandom._get_cuda_rng_state, gpu_index)),
             (mrandom, "_set_cuda_rng_state",
              _with_current_device(mrandom._set_cuda_rng_state, gpu_index)),
             (mrandom.CudaRNGStatesTracker, "fork", _planning_fork),
             (rope_utils, "fused_apply_rotary_pos_emb", fused_apply_rotary_pos_emb_cpu),
             (layers, "fused_weight_gradient_mlp_cuda", _WgradAccum),
             (layers, "_grad_accum_fusion_available", True),
             *_fused_activation_twins()]
    saved = [(obj, name, getattr(obj, name, _MISSING)) for obj, name, _ in swaps]
    try:
        for obj, name, value in swaps:
            setattr(obj, name, value)
        _install_recompute_fix()
        yield
    finally:
        for obj, name, value in reversed(saved):
            if value is _MISSING:
                delattr(obj, name)
            else:
                setattr(obj, name, value)


def _mcore_release() -> tuple:
    """(major, minor) of the installed megatron-core (its distribution's version)."""
    from importlib.metadata import version

    major, minor = version("megatron-core").split("+")[0].split(".")[:2]
    return int(major), int(minor)


def apply() -> None:
    """Install the CPU stand-ins if CUDA is absent; a no-op on GPU machines and when repeated."""
    global _APPLIED
    if torch.cuda.is_available() or _APPLIED:
        return

    torch.cuda.current_device = _cpu_current_device
    torch.cuda.synchronize = _cpu_synchronize
    # Megatron-Core >= 0.19: DDP's start_grad_sync (distributed.param_and_grad_buffer) asks
    # torch.cuda.current_stream() on every gradient sync, overlap or not; one in-order executor.
    # Only where that release is installed (0.16.1 asks it on the overlap path alone).
    if _mcore_release() >= (0, 19):
        torch.cuda.current_stream = lambda device=None: _CPU_STREAM

    from megatron.core.tensor_parallel import random as mrandom

    mrandom._get_cuda_rng_state = _cpu_get_rng_state
    mrandom._set_cuda_rng_state = _cpu_set_rng_state
    mrandom.CudaRNGStatesTracker.add = _cpu_tracker_add
    mrandom.CudaRNGStatesTracker.fork = _cpu_tracker_fork

    from megatron.core.dist_checkpointing.strategies import state_dict_saver
    from megatron.core.optimizer import clip_grads, optimizer

    _wrap_method(optimizer.FP32Optimizer, "__init__")
    _wrap_method(optimizer.MixedPrecisionOptimizer, "__init__")
    _wrap_method(optimizer.Float16OptimizerWithFloat16Params, "__init__", cuda_type_names=True)
    # core 0.19: ChainedOptimizer.step -> MegatronOptimizer.has_grad_norm_group all-reduces a
    # flag made with device='cuda' (absent in 0.16.1).
    if "has_grad_norm_group" in vars(optimizer.MegatronOptimizer):
        _wrap_method(optimizer.MegatronOptimizer, "has_grad_norm_group")
    # Tied embeddings under pipeline parallelism: the last stage's copy of the word embedding
    # is moved with .cuda() before the first/last-stage all-reduce that equalises it.
    from megatron.core.models.common.language_module.language_module import LanguageModule

    _wrap_method(LanguageModule, "setup_embeddings_and_output_layer")
    _install_torch_adam_fixes()
    for fn_name in ("get_grad_norm_fp32", "count_zeros_fp32"):
        _wrap_function(clip_grads, fn_name)
    _rebind_everywhere(clip_grads.clip_grad_by_total_norm_fp32, _cpu_clip_grad_by_total_norm_fp32)
    _wrap_function(state_dict_saver, "verify_global_md_reuse")

    from megatron.core.pipeline_parallel import schedules

    for fn_name in (
        "forward_backward_no_pipelining",
        "forward_backward_pipelining_without_interleaving",
        "forward_backward_pipelining_with_interleaving",
    ):
        _wrap_function(schedules, fn_name)

    # rope_utils.get_pos_emb_on_this_cp_rank (called by RotaryEmbedding.forward with CP > 1)
    # builds its chunk index with pin_memory=True and .cuda(); the plugin's zigzag module takes
    # the same chunks (r and 2P-1-r of 2P) on the embedding's own device.
    from megatron.core.models.common.embeddings import rope_utils

    from megatron_metp.wallfacer import zigzag

    _rebind_everywhere(rope_utils.get_pos_emb_on_this_cp_rank, zigzag.get_pos_emb_on_this_cp_rank)
    _install_fusion_kernels()
    _install_recompute_fix()

    _APPLIED = True
