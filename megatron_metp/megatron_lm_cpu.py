"""CPU stand-ins for Megatron-LM's own training loop (``megatron.training``), applied only without
CUDA, by the Megatron-LM hooks (``megatron_lm_hooks.install``: the no-patch script and the patch
alike), after ``cpu_compat.apply()`` has covered Megatron-Core. Megatron-LM's files are never
edited; a GPU run never reaches this module (:func:`apply` returns at once when
``torch.cuda.is_available()``).

``pretrain()`` assumes CUDA at a few dozen call sites. Those a CPU run reaches, each with its
stand-in (all checked by ``tests/test_megatron_lm_training.py``):

1. ``initialize.initialize_megatron`` asserts CUDA unless ``allow_no_cuda``: the hook passes it
   (``megatron_lm_hooks._initialize_hook``).
2. ``initialize._initialize_distributed`` builds Megatron-Core's model-parallel groups only when
   ``torch.cuda.device_count() > 0``: :func:`_initialize_distributed` starts the process group
   with ``--distributed-backend`` (gloo on CPU) and builds the same groups with the same
   arguments.
3. ``initialize._set_random_seed`` seeds Megatron's tracked RNG streams (tensor-parallel
   weights, dropout) only with a GPU: :func:`_set_random_seed` seeds them too (on CPU they are
   CPU generator states, ``cpu_compat`` item 3).
4. ``initialize._compile_dependencies`` runs ``make`` for the dataset helpers and compiles the
   legacy fused CUDA kernels: on CPU the megatron-core wheel's prebuilt ``helpers_cpp`` is used
   (compiled only if it does not import), and there are no CUDA kernels to build.
5. ``initialize.set_jit_fusion_options`` warms the fused bias-GeLU/SwiGLU functions up on
   ``device="cuda"`` tensors (``_warmup_jit_function``), drawing from the CPU generator on the
   way: skipped, so a CPU run draws the same random numbers as a reference that never warms up.
6. ``torch.cuda`` memory queries (``max_memory_allocated``, ``memory_allocated``,
   ``memory_reserved``, ``max_memory_reserved``, ``memory_stats``, ``device_memory_used``:
   ``training_log``'s and ``report_memory``'s figures) read 0; ``reset_peak_memory_stats`` and
   ``empty_cache`` do nothing. The CPU build raises on each otherwise.
7. ``torch.cuda.Stream`` / ``current_stream`` / ``stream`` (``get_model`` builds DDP on a side
   stream): one in-order CPU executor (``cpu_compat``'s, as for Megatron-FSDP).
8. ``torch.cuda.get_rng_state`` / ``set_rng_state`` (``checkpointing``'s per-rank RNG state):
   an empty state and a no-op; the CPU generator and the tracked streams are saved beside it.
9. ``utils.get_device_arch_version`` (``validate_args`` with TP or CP > 1): 0, "before Hopper",
   so Megatron-LM keeps asking for ``CUDA_DEVICE_MAX_CONNECTIONS=1`` (harmless on CPU).
10. ``device="cuda"`` literals and ``.cuda()`` moves across ``training.pretrain`` (start-up
    timestamps, loss and grad-norm reductions, data broadcasts): ``cpu_compat``'s
    TorchFunctionMode keeps them on CPU for the whole run.
11. ``training.build_train_valid_test_data_iterators`` runs with torch's CPU generator forked
    (``torch.random.fork_rng(devices=[])``): its state after the call is its state before.
    Every ``iter(DataLoader)`` it makes draws a base seed from the default CPU generator. On a
    GPU that is not the generator dropout draws from; on CPU it is, and ``pretrain()`` builds
    the iterators *after* ``load_checkpoint`` restored the RNG state. So with dropout > 0 a run
    resumed at iteration k drew other dropout masks than the uninterrupted run after k
    (measured on one CPU rank, dropout 0.1: 5.2114 against 5.1945 at k + 1), and with TP > 1,
    where only TP rank 0 builds loaders, the CPU generators of one TP group drifted apart. With
    the fork the resumed losses repeat the uninterrupted run's; with dropout 0 nothing changes.

Flags a CPU run needs beyond Megatron-LM's defaults (its fused kernels are CUDA or Apex
extensions, compiled JIT functions would only slow a tiny CPU model): ``--distributed-backend
gloo --transformer-impl local --no-persist-layer-norm --no-gradient-accumulation-fusion
--no-masked-softmax-fusion --no-bias-gelu-fusion --no-bias-dropout-fusion``, and
``CUDA_DEVICE_MAX_CONNECTIONS=1`` in the environment for TP or CP > 1; stock ``tp`` with TP > 1
also needs no ``--sequence-parallel`` there (Megatron's local norm without Apex refuses it).
``--use-cpu-initialization`` makes the initial weights independent of the TP size, so runs at
different sizes start alike. ``--log-throughput`` prints Megatron-LM's TFLOP/s per GPU (0.0 on
a CPU at these sizes).

What stays GPU-only (refused by Megatron-LM itself or by the plugin's validation): bf16/fp16
mixed precision with fused kernels, Transformer Engine, ``--tp-comm-overlap``, CUDA graphs.
"""

from __future__ import annotations

import contextlib
import functools
import importlib
from datetime import timedelta
from typing import Any, Callable, Optional

import torch

_APPLIED = False
_INIT_POINTS = ("_initialize_distributed", "_set_random_seed", "_compile_dependencies",
                "set_jit_fusion_options")


def _megatron_initialize():
    return importlib.import_module("megatron.training.initialize")


def _initialize_distributed(get_embedding_ranks, get_position_embedding_ranks, store,
                            skip_model_parallel_init=False):
    """Stand-in 2: the process group and Megatron-Core's groups, without a CUDA device.
    ``skip_model_parallel_init`` (core_v0.19: the caller builds the groups) as Megatron-LM's."""
    import torch.distributed as dist
    from megatron.core import parallel_state as mpu
    from megatron.training import get_args

    args = get_args()
    if dist.is_initialized():
        args.rank, args.world_size = dist.get_rank(), dist.get_world_size()
    else:
        dist.init_process_group(
            backend=args.distributed_backend, store=store, world_size=args.world_size,
            rank=args.rank, timeout=timedelta(minutes=args.distributed_timeout_minutes))
    if skip_model_parallel_init or mpu.model_parallel_is_initialized():
        return
    # --disable-gloo-process-groups: args.enable_gloo_process_groups up to core_v0.17,
    # args.use_gloo_process_groups from core_v0.19 (megatron/training/config/common_config.py).
    gloo = getattr(args, "use_gloo_process_groups", None)
    if gloo is None:
        gloo = args.enable_gloo_process_groups
    mpu.initialize_model_parallel(
        args.tensor_model_parallel_size,
        args.pipeline_model_parallel_size,
        args.virtual_pipeline_model_parallel_size,
        context_parallel_size=args.context_parallel_size,
        hierarchical_context_parallel_sizes=args.hierarchical_context_parallel_sizes,
        expert_model_parallel_size=args.expert_model_parallel_size,
        num_distributed_optimizer_instances=args.num_distributed_optimizer_instances,
        expert_tensor_parallel_size=args.expert_tensor_parallel_size,
        distributed_timeout_minutes=args.distributed_timeout_minutes,
        order="tp-cp-ep-dp-pp" if not args.use_tp_pp_dp_mapping else "tp-cp-ep-pp-dp",
        get_embedding_ranks=get_embedding_ranks,
        get_position_embedding_ranks=get_position_embedding_ranks,
        create_gloo_process_groups=gloo,
    )


def _seeded_tracker(original: Callable) -> Callable:
    """Stand-in 3: Megatron-LM's seeding, then the tracked streams it seeds only on a GPU."""

    @functools.wraps(original)
    def _set_random_seed(seed_, data_parallel_random_init=False, te_rng_tracker=False,
                         inference_rng_tracker=False, use_cudagraphable_rng=False,
                         pp_group=None, dp_group=None, **groups):
        # core_v0.19 adds pp_group, dp_group, tp_group, ep_group, etp_group (None: mpu's).
        if pp_group is not None or dp_group is not None or groups:
            groups.update(pp_group=pp_group, dp_group=dp_group)
        original(seed_, data_parallel_random_init, te_rng_tracker, inference_rng_tracker,
                 use_cudagraphable_rng, **groups)
        import torch.distributed as dist
        from megatron.core import parallel_state as mpu
        from megatron.core import tensor_parallel

        pp_rank = (dist.get_rank(pp_group) if pp_group is not None
                   else mpu.get_pipeline_model_parallel_rank())
        seed = seed_ + 100 * pp_rank
        if data_parallel_random_init:
            seed += 10 * (dist.get_rank(dp_group) if dp_group is not None
                          else mpu.get_data_parallel_rank())
        tensor_parallel.model_parallel_cuda_manual_seed(seed, te_rng_tracker,
                                                        inference_rng_tracker)

    return _set_random_seed


def _compile_dependencies() -> None:
    """Stand-in 4: the dataset helpers from the wheel (built here only if missing)."""
    import torch.distributed as dist

    try:
        importlib.import_module("megatron.core.datasets.helpers_cpp")
        return
    except ImportError:
        pass
    from megatron.core.datasets.utils import compile_helpers

    if dist.get_rank() == 0:
        compile_helpers()
    dist.barrier()


def _no_jit_warmup(*_args, **_kwargs) -> None:
    """Stand-in 5: nothing to warm up on CPU (and no random numbers drawn)."""


def _cpu_rng_neutral(original: Callable) -> Callable:
    """Stand-in 11: ``original`` with torch's CPU generator forked around it."""

    @functools.wraps(original)
    def wrapper(*args, **kwargs):
        with torch.random.fork_rng(devices=[]):
            return original(*args, **kwargs)

    return wrapper


def _zero(*_args, **_kwargs) -> int:
    return 0


def _nothing(*_args, **_kwargs) -> None:
    return None


_NAMESPACES: list = []   # extra globals to rebind in (the patched pretrain_gpt.py's)


def _rebind(module: Any, name: str, new: Callable) -> None:
    """Replace ``module.name`` and every by-name import of it in ``megatron.training`` modules
    and in the namespaces given to :func:`apply`."""
    import sys

    old = getattr(module, name)
    spaces = [vars(mod) for mod_name, mod in list(sys.modules.items())
              if mod is not None and mod_name.startswith("megatron.training")]
    for space in spaces + _NAMESPACES:
        for attr, val in list(space.items()):
            if val is old:
                space[attr] = new
    setattr(module, name, new)


def apply(namespace: Optional[dict] = None) -> None:
    """Install the stand-ins if CUDA is absent; a no-op on GPU machines and when repeated.
    ``namespace``: globals that imported Megatron-LM functions by name before this ran (the
    patched ``pretrain_gpt.py``'s ``pretrain``), rebound too."""
    global _APPLIED
    if torch.cuda.is_available() or _APPLIED:
        return
    if namespace is not None:
        _NAMESPACES.append(namespace)
    try:
        init = _megatron_initialize()
        training = importlib.import_module("megatron.training.training")  # by-name imports
        utils = importlib.import_module("megatron.training.utils")
    except ImportError:
        return   # no megatron.training as core_v0.16.1 lays it out (see below)
    needed = [(init, n) for n in _INIT_POINTS] + [(training, "pretrain"),
                                                  (training, "build_train_valid_test_data_iterators"),
                                                  (utils, "get_device_arch_version")]
    if any(not callable(getattr(m, n, None)) for m, n in needed):
        # Not the megatron.training these stand-ins were written against (core_v0.16.1): leave
        # it alone; a CPU run then stops at its first CUDA call, a GPU run is unaffected.
        return
    _rebind(init, "_initialize_distributed", _initialize_distributed)
    _rebind(init, "_set_random_seed", _seeded_tracker(init._set_random_seed))
    _rebind(init, "_compile_dependencies", _compile_dependencies)
    _rebind(init, "set_jit_fusion_options", _no_jit_warmup)
    # validate_args asks the GPU's architecture (utils.get_device_arch_version) for TP / CP > 1;
    # a CPU has none (0: "before Hopper", so Megatron-LM keeps its CUDA_DEVICE_MAX_CONNECTIONS=1
    # requirement, which costs nothing on CPU).
    _rebind(utils, "get_device_arch_version", _zero)
    # device="cuda" literals and .cuda() moves throughout pretrain() (its start-up timestamps,
    # the loss and grad-norm reductions, the data iterators' broadcasts): kept on CPU by
    # cpu_compat's TorchFunctionMode for the whole run.
    from megatron_metp.cpu_compat import _cuda_literals_on_cpu

    _rebind(training, "pretrain", _cuda_literals_on_cpu(training.pretrain))
    _rebind(training, "build_train_valid_test_data_iterators",
            _cpu_rng_neutral(training.build_train_valid_test_data_iterators))
    for name in ("max_memory_allocated", "memory_allocated", "memory_reserved",
                 "max_memory_reserved"):
        setattr(torch.cuda, name, _zero)
    for name in ("reset_peak_memory_stats", "empty_cache"):
        setattr(torch.cuda, name, _nothing)
    torch.cuda.memory_stats = lambda *_a, **_k: {}
    torch.cuda.device_memory_used = _zero
    # Streams (get_model's DDP side stream): one in-order CPU executor, as for Megatron-FSDP.
    from megatron_metp.cpu_compat import _CPU_STREAM, _CpuStream

    torch.cuda.Stream = _CpuStream
    torch.cuda.current_stream = lambda device=None: _CPU_STREAM
    torch.cuda.stream = lambda stream=None: contextlib.nullcontext()
    # checkpointing's per-rank RNG state: no device generator to save or restore (the CPU
    # generator and Megatron's tracked streams are saved beside it).
    torch.cuda.get_rng_state = lambda *_a, **_k: torch.empty(0, dtype=torch.uint8)
    torch.cuda.set_rng_state = _nothing
    _APPLIED = True
