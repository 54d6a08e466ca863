"""The ``metp train`` loop on one rank: Megatron-Core's GPTModel, DDP, optimizer and schedules.

Per mode (one mode, or each of ``--compare``'s in turn inside the same processes)::

    namespace (flags over config) -> apply_mode_remap -> validate_args     before any group
    initialize_parallel(TP, PP, CP, seed, mode)                            Megatron + plugin groups
    GPTModel (this pipeline stage, the mode's spec) -> DDP -> get_megatron_optimizer
    for it in iterations: get_forward_backward_func()(...) -> optimizer.step -> lr step -> log
    destroy_parallel (every group of this mode ended before the next mode builds its own)

Data x tensor/context x pipeline parallel come from Megatron's own groups; every rank computes
its micro-batches from the iteration number (``GPTSamples``), so no data broadcast is needed.
``--use-distributed-optimizer`` (Megatron-LM's flag, off by default as there) shards the
optimizer state over the data-parallel x context-parallel ranks with Megatron-Core's
``DistributedOptimizer`` (on CPU through ``cpu_compat`` item 8); its checkpoints take
Megatron-LM's ``dp_reshardable`` form, or ``fully_reshardable`` with
``--dist-ckpt-optim-fully-reshardable`` (any mode and size), and a ``--load`` this run's
optimizer cannot read is refused at start-up (``train_checkpoint.check_loadable``). The GPU
paths (NCCL, bf16, MFU) are written but were not run in this project's CI, which has no GPU.
"""

from __future__ import annotations

import contextlib
import datetime
import functools
import gc
import json
import os
import resource
import signal
import sys
import time
from argparse import Namespace
from dataclasses import dataclass
from typing import Any, Dict, List, Optional

import torch
import torch.distributed as dist
import torch.nn.functional as F

from megatron_metp.launch import INTERRUPT_FILE, INTERRUPTED
from megatron_metp.models.config import ModelConfig, load_config
from megatron_metp.training.data import GPTSamples, load_tokens, padded_vocab_size
from megatron_metp.training.data.tokenizer import ByteTokenizer
from megatron_metp.models.flops import FlopModel, gpu_peak_tflops, throughput, training_flops
from megatron_metp.training.train_report import Reporter

# Hard defaults, used when neither a flag nor the config gives a value (Megatron-LM's where it
# has one: dropout 0.1, seed 1234, timeout 10 min, vocab padding 128).
DEFAULTS = dict(
    tensor_parallel_mode="tp", tensor_model_parallel_size=1, context_parallel_size=1,
    pipeline_model_parallel_size=1, seq_length=64, micro_batch_size=4, global_batch_size=None,
    lr=3e-3, min_lr=None, lr_warmup_iters=0, train_iters=50, weight_decay=0.01, clip_grad=1.0,
    hidden_dropout=0.1, attention_dropout=0.1, seed=1234, wallfacer_team_size="1",
    wallfacer_placement=None, save_interval=None, distributed_timeout_minutes=10,
    make_vocab_size_divisible_by=128, lr_decay_iters=None, lr_decay_style="cosine",
    exit_interval=None, exit_duration_in_mins=None,
)
PROGRESS = "metp_progress.json"  # beside the checkpoints: how far the run got, and why it stopped


def resolve_namespace(args: Namespace, cfg: ModelConfig, mode: str,
                      world_size: Optional[int] = None) -> Namespace:
    """Flags over the config's training defaults over :data:`DEFAULTS`, as Megatron-LM names."""
    ns = Namespace(**cfg.megatron_args())
    for key, default in DEFAULTS.items():
        flag = getattr(args, key, None)
        setattr(ns, key, flag if flag is not None else cfg.train.get(key, default))
    ns.tensor_parallel_mode = mode
    ns.world_size = world_size or int(os.environ["WORLD_SIZE"])
    decay = ns.lr_decay_iters or ns.train_iters
    if args.lr_warmup_iters is None and decay and ns.lr_warmup_iters >= decay:
        # The config's warm-up does not stop a short run (`--train-iters 2`): it ends one
        # iteration before the decay does. A --lr-warmup-iters given is checked as given.
        ns.lr_warmup_iters = decay - 1
    if args.compare:  # same numerics in every mode: dropout off
        ns.hidden_dropout = ns.attention_dropout = 0.0
    if ns.max_position_embeddings is None:
        ns.max_position_embeddings = ns.seq_length
    ns.sequence_parallel = (args.sequence_parallel if args.sequence_parallel is not None
                            else ns.tensor_model_parallel_size > 1)
    ns.cp_comm_type = args.cp_comm_type
    ns.bf16 = bool(args.bf16)
    ns.vocab_size = next(v for v in (args.vocab_size, cfg.vocab_size, 258) if v is not None)
    ns.data_path = args.data_path
    ns.recompute_granularity = args.recompute_granularity
    ns.recompute_modules = args.recompute_modules
    ns.recompute_method = args.recompute_method
    ns.recompute_num_layers = args.recompute_num_layers
    ns.metp_ring_pass = getattr(args, "metp_ring_pass", None) or "auto"
    ns.metp_qkv_backward = getattr(args, "metp_qkv_backward", None) or "auto"
    ns.metp_mlp_pass = getattr(args, "metp_mlp_pass", None) or "auto"
    return ns


def _parallel_setup(ns: Namespace, explicit: set, quiet: bool = False) -> Namespace:
    """The WallFacer remap, then the whole configuration validated (nothing built yet)."""
    from megatron_metp.megatron_lm import apply_mode_remap
    from megatron_metp.validation import validate_args

    # The vocabulary is padded for the requested TP size before the WallFacer remap turns TP
    # into CP, so that tp, metp and wallfacer build the same embedding (same initial weights,
    # same losses, interchangeable checkpoints).
    ns.vocab_padding_tp = ns.tensor_model_parallel_size
    apply_mode_remap(ns, explicit=explicit,
                     log=(lambda m: None) if quiet else (lambda m: _print0(f"[metp] {m}")))
    dp = ns.world_size // (ns.tensor_model_parallel_size * ns.context_parallel_size
                           * ns.pipeline_model_parallel_size or 1)
    if ns.global_batch_size is None:
        ns.global_batch_size = ns.micro_batch_size * max(dp, 1)
    validate_args(ns)
    return ns


def modes_of(args: Namespace, cfg: ModelConfig) -> List[str]:
    return args.compare or [args.tensor_parallel_mode or cfg.train.get(
        "tensor_parallel_mode", DEFAULTS["tensor_parallel_mode"])]


def resolve_auto(args: Namespace, cfg: ModelConfig, world_size: int, *,
                 announce: bool) -> None:
    """``--tensor-parallel-mode auto``: the planner's choice (``measure.auto``) replaces it in
    ``args`` (mode, and for WallFacer its team size and placement). No fit: a ValueError that
    names the longest sequence that would fit. ``announce``: print the table decided from."""
    if modes_of(args, cfg) != ["auto"]:
        return
    from megatron_metp.measure import auto

    ns = resolve_namespace(args, cfg, "tp", world_size)
    p, cp = ns.tensor_model_parallel_size, ns.context_parallel_size
    if cp > 1 or ns.pipeline_model_parallel_size > 1:
        raise ValueError("--tensor-parallel-mode auto chooses for --context-parallel-size 1 and "
                         "--pipeline-model-parallel-size 1: name the mode to compose them")
    chosen, text = auto.decide(
        cfg, p, ns.seq_length, micro_batch=ns.micro_batch_size, memory_gib=args.auto_memory_gib,
        gpu=args.auto_gpu, gpus_per_node=auto.local_world_size(world_size),
        distributed_optimizer=bool(args.use_distributed_optimizer),
        megatron_fsdp=bool(args.use_megatron_fsdp),  # no --tp-comm-overlap in metp train
        world_size=world_size, global_batch_size=ns.global_batch_size)
    if announce:
        print("[metp] " + text.replace("\nauto chose", "\n[metp] auto chose"), flush=True)
    args.tensor_model_parallel_size = p
    auto.apply(args, chosen, team_size_type=str)  # metp train's flag holds a string
    args.auto_choice = chosen


def resolve_metp_attention(args: Namespace, cfg: ModelConfig, world_size: int, *,
                           announce: bool) -> None:
    """``--metp-ring-pass auto`` and ``--metp-qkv-backward auto`` for a metp run: the
    planner's choice from memory headroom (``measure.planner.resolve_metp_attention``: the one
    ring pass over every head group, with its Q/K/V and the MLP's fc1 output saved, or Q/K/V
    alone, when the run still fits
    --auto-memory-gib or the GPU's memory; one pass per head group only where nothing coarser
    fits) replaces them in ``args``. The planner plans context- and pipeline-parallel size 1:
    other layouts keep the model's own rule (``metp.attention.whole_pass``) and recompute."""
    ring = getattr(args, "metp_ring_pass", None) or "auto"
    qkv = getattr(args, "metp_qkv_backward", None) or "auto"
    if "auto" not in (ring, qkv) or "metp" not in modes_of(args, cfg):
        return
    from megatron_metp.measure.planner import recompute_settings
    from megatron_metp.measure.planner import resolve_metp_attention as plan_attention

    ns = resolve_namespace(args, cfg, "metp", world_size)
    p = ns.tensor_model_parallel_size
    if ns.context_parallel_size > 1 or ns.pipeline_model_parallel_size > 1:
        qkv = "recompute" if qkv == "auto" else qkv
        why = f"{ring}, {qkv} (planned for context and pipeline size 1 only)"
    else:
        ring, qkv, why = plan_attention(
            cfg, p, ns.seq_length, micro_batch=ns.micro_batch_size,
            memory_gib=args.auto_memory_gib,
            distributed_optimizer=bool(args.use_distributed_optimizer),
            megatron_fsdp=bool(args.use_megatron_fsdp), ring_pass=ring, qkv_backward=qkv,
            recompute=recompute_settings(ns))
    if announce:
        print(f"[metp] METP attention (--metp-ring-pass {ring} --metp-qkv-backward {qkv}): "
              f"{why}", flush=True)
    args.metp_ring_pass, args.metp_qkv_backward = ring, qkv


def check_model_config(args: Namespace) -> ModelConfig:
    cfg = load_config(args.config)
    if not cfg.causal or cfg.architecture != "gpt":
        raise ValueError(f"--config {args.config}: a {cfg.architecture} model with "
                         f"{'causal' if cfg.causal else 'bidirectional'} attention; metp train "
                         f"trains causal GPT models only (use it with metp bench / metp plan)")
    if args.bf16 and not torch.cuda.is_available():
        raise ValueError("--bf16 needs a GPU: Megatron-Core's mixed-precision optimizer "
                         "(Float16OptimizerWithFloat16Params) refuses CPU tensors; drop --bf16 "
                         "on CPU")
    check_sharding_flags(args)
    return cfg


def check_missing_load(args: Namespace) -> None:
    """``--exit-on-missing-checkpoint``: a ``--load`` that holds no checkpoint is refused (a
    resumed job should not silently restart); without it the run warns once and starts from
    ``--seed`` (:func:`_resume`), as Megatron-LM does."""
    from megatron_metp.training.train_checkpoint import has_checkpoint

    if args.load and getattr(args, "exit_on_missing_checkpoint", False) and \
            not has_checkpoint(args.load):
        raise ValueError(f"--load {args.load}: no checkpoint there (no "
                         f"latest_checkpointed_iteration.txt) and --exit-on-missing-checkpoint "
                         f"is set: pass the directory given to --save, or drop the flag to "
                         f"train from scratch")


def check_sharding_layout(args: Namespace, ns: Namespace, world_size: int) -> None:
    """What needs the resolved layout: the ``--load`` this optimizer can read, and Megatron-FSDP
    without pipeline parallelism. Run by :func:`preflight` in the launching process and again
    in every rank (under an outside launcher, torchrun or srun, preflight does not run)."""
    from megatron_metp.training.train_checkpoint import check_loadable

    check_missing_load(args)
    check_loadable(args.load, bool(args.use_distributed_optimizer), _layout_tag(ns, world_size))
    if args.use_megatron_fsdp and ns.pipeline_model_parallel_size > 1:
        raise ValueError(f"--use-megatron-fsdp with --pipeline-model-parallel-size "
                         f"{ns.pipeline_model_parallel_size}: Megatron-Core 0.16.1's "
                         f"Megatron-FSDP builds its mesh over the data, context and tensor "
                         f"parallel ranks only; drop one of them")


def check_sharding_flags(args: Namespace) -> None:
    """The distributed optimizer's and Megatron-FSDP's flags, alone and together."""
    if getattr(args, "overlap_param_gather", False):
        if not (args.use_distributed_optimizer or args.use_megatron_fsdp):
            raise ValueError("--overlap-param-gather overlaps the distributed optimizer's "
                             "parameter all-gather: add --use-distributed-optimizer, or drop it")
        if not getattr(args, "overlap_grad_reduce", False):
            raise ValueError("--overlap-param-gather needs --overlap-grad-reduce (Megatron-LM's "
                             "rule): add it, or drop --overlap-param-gather")
    if args.dist_ckpt_optim_fully_reshardable and not args.use_distributed_optimizer:
        raise ValueError("--dist-ckpt-optim-fully-reshardable sets the distributed optimizer's "
                         "checkpoint form: add --use-distributed-optimizer, or drop it")
    strategy = args.data_parallel_sharding_strategy
    if not args.use_megatron_fsdp:
        if strategy not in (None, "no_shard"):
            raise ValueError(f"--data-parallel-sharding-strategy {strategy} sets what "
                             f"Megatron-FSDP shards: add --use-megatron-fsdp, or drop it")
        return
    if strategy in (None, "no_shard"):
        raise ValueError("--use-megatron-fsdp with --data-parallel-sharding-strategy no_shard "
                         "(Megatron-LM's default): megatron-core 0.16.1's Megatron-FSDP fails at "
                         "its first parameter sync with it (no weight buffer to gather); pass "
                         "--data-parallel-sharding-strategy optim_grads_params (or optim, "
                         "optim_grads)")
    if args.save or args.load:
        raise ValueError("--use-megatron-fsdp with --save/--load: Megatron-FSDP checkpoints "
                         "in its own fsdp_dtensor format (Megatron-LM's --ckpt-format "
                         "fsdp_dtensor), which metp train does not write or read; drop "
                         "--save/--load or --use-megatron-fsdp")
    import importlib.util

    if importlib.util.find_spec("einops") is None:  # Megatron-FSDP's adapter imports it
        raise ValueError("--use-megatron-fsdp needs einops, which Megatron-Core's Megatron-FSDP "
                         "adapter imports: pip install einops (scripts/setup_env.sh does)")


def preflight(args: Namespace, explicit: set, world_size: int) -> None:
    """Everything :func:`run` checks before building groups, run once in the launching process
    so that a bad configuration fails in one line instead of once per rank under torchrun."""
    cfg = check_model_config(args)
    resolve_auto(args, cfg, world_size, announce=True)
    for mode in modes_of(args, cfg):
        ns = _parallel_setup(resolve_namespace(args, cfg, mode, world_size), explicit,
                             quiet=True)
        check_sharding_layout(args, ns, world_size)
    if ns.data_path is not None:  # missing, truncated or out-of-vocabulary data fails here
        GPTSamples(load_tokens(ns.data_path, ns.vocab_size), ns.seq_length, ns.seed)
    elif ns.vocab_size < ByteTokenizer().vocab_size:
        raise ValueError(f"--vocab-size {ns.vocab_size} is below the shipped corpus's "
                         f"{ByteTokenizer().vocab_size} byte-tokenizer ids: drop --vocab-size, "
                         f"or pass --data-path with a dataset of that vocabulary")


def _print0(msg: str) -> None:
    if not dist.is_initialized() or dist.get_rank() == 0:
        print(msg, flush=True)


def _transformer_config(ns: Namespace, cfg: ModelConfig):
    from megatron_metp.model import make_config

    dtype = torch.bfloat16 if ns.bf16 else torch.float32
    kw = dict(
        num_layers=ns.num_layers, hidden_size=ns.hidden_size,
        num_attention_heads=ns.num_attention_heads, num_query_groups=ns.num_query_groups,
        ffn_hidden_size=ns.ffn_hidden_size, kv_channels=ns.kv_channels,
        normalization=cfg.normalization, layernorm_epsilon=cfg.norm_epsilon,
        activation_func=F.silu if cfg.swiglu else F.gelu, gated_linear_unit=cfg.swiglu,
        add_bias_linear=cfg.add_bias_linear, hidden_dropout=ns.hidden_dropout,
        attention_dropout=ns.attention_dropout,
        tensor_model_parallel_size=ns.tensor_model_parallel_size,
        pipeline_model_parallel_size=ns.pipeline_model_parallel_size,
        context_parallel_size=ns.context_parallel_size, sequence_parallel=ns.sequence_parallel,
        bf16=ns.bf16, params_dtype=dtype,
        stock=True,  # Megatron-LM's default fusions, in every mode
    )
    if getattr(ns, "recompute_granularity", None) == "full":
        # Megatron's TransformerBlock checkpoints chunks of layers (its _checkpointed_forward):
        # only each chunk's input is kept; METP's rings run again in backward.
        kw.update(recompute_granularity="full",
                  recompute_method=getattr(ns, "recompute_method", None) or "uniform",
                  recompute_num_layers=getattr(ns, "recompute_num_layers", None) or 1)
    elif getattr(ns, "recompute_granularity", None):
        kw.update(recompute_granularity=ns.recompute_granularity,
                  recompute_modules=list(ns.recompute_modules or ["core_attn"]))
    if ns.pipeline_model_parallel_size > 1:
        kw["pipeline_dtype"] = dtype
    if getattr(ns, "cp_comm_type", None):
        kw["cp_comm_type"] = ns.cp_comm_type
    kw["metp_ring_pass"] = getattr(ns, "metp_ring_pass", None) or "auto"
    kw["metp_qkv_backward"] = getattr(ns, "metp_qkv_backward", None) or "auto"
    kw["metp_mlp_pass"] = getattr(ns, "metp_mlp_pass", None) or "auto"
    return make_config(style="llama" if cfg.swiglu else "gpt", **kw)


def _initialize(ns: Namespace) -> None:
    from megatron_metp.model import initialize_parallel
    from megatron_metp.validation import PLACEMENT_ALIASES, team_size

    wallfacer = {}
    if ns.tensor_parallel_mode == "wallfacer":
        c = team_size(ns)
        placement = ns.wallfacer_placement
        placement = PLACEMENT_ALIASES.get(placement, placement) if placement else None
        wallfacer = dict(wallfacer_team_size="auto" if c is None else c,
                         wallfacer_placement=placement)
        if c is None:  # --wallfacer-team-size auto: the topology scheduler profiles this shape
            tp = ns.tensor_model_parallel_size
            local = os.environ.get("LOCAL_WORLD_SIZE")
            wallfacer.update(
                wallfacer_shape=dict(b=ns.micro_batch_size, s=ns.seq_length,
                                     n=ns.num_attention_heads // tp,
                                     n_kv=max(ns.num_query_groups // tp, 1), d=ns.kv_channels),
                gpus_per_node=int(local) if local else None)
    initialize_parallel(
        tensor_model_parallel_size=ns.tensor_model_parallel_size,
        pipeline_model_parallel_size=ns.pipeline_model_parallel_size,
        context_parallel_size=ns.context_parallel_size, seed=ns.seed,
        mode=ns.tensor_parallel_mode,
        # Megatron's subgroups take their own timeout (new_group does not inherit the world's).
        distributed_timeout_minutes=ns.distributed_timeout_minutes, **wallfacer)


def _loss_func(loss_mask: torch.Tensor, cp_size: int, output_tensor: torch.Tensor):
    """Mean loss over this micro-batch's tokens of the whole context-parallel group.

    ``output_tensor`` [b, s/CP] per-token losses. The token count is summed over the CP group
    (detached); the local sum is scaled by CP because DDP averages gradients over DP x CP ranks,
    so the CP ranks' gradients add up to the gradient of the global mean.
    """
    from megatron.core import parallel_state as mpu

    losses = output_tensor.float().reshape(-1)
    mask = loss_mask.reshape(-1).float()
    stats = torch.stack([(losses * mask).sum().detach(), mask.sum()])
    if cp_size > 1:
        dist.all_reduce(stats, group=mpu.get_context_parallel_group())
    loss = (losses * mask).sum() / stats[1].clamp(min=1)
    return loss * cp_size, {"lm loss": stats[0] / stats[1].clamp(min=1)}


def _forward_step(cp_size: int, device: torch.device, data_iterator, model):
    from megatron.core.utils import get_batch_on_this_cp_rank

    batch = {k: v.to(device) for k, v in next(data_iterator).items()}
    if cp_size > 1:  # Megatron's load-balanced layout: chunks r and 2CP-1-r of 2CP
        # The CP group explicitly: core 0.19's split reads cp_group=None as the WORLD group
        # (0.16.1: mpu's CP group), and 0.19 requires is_hybrid_cp (False: same zigzag split).
        import inspect

        from megatron.core import parallel_state as mpu

        kw = {"cp_group": mpu.get_context_parallel_group()}
        if "is_hybrid_cp" in inspect.signature(get_batch_on_this_cp_rank).parameters:
            kw["is_hybrid_cp"] = False
        batch = get_batch_on_this_cp_rank(batch, **kw)
    output = model(batch["tokens"], batch["position_ids"], None, labels=batch["labels"])
    return output, functools.partial(_loss_func, batch["loss_mask"], cp_size)


def _peak_memory_bytes(device: torch.device) -> int:
    if device.type == "cuda":
        return int(torch.cuda.max_memory_allocated(device))
    # CPU: the process's peak resident set (KiB on Linux), all allocations included.
    return int(resource.getrusage(resource.RUSAGE_SELF).ru_maxrss) * 1024


@dataclass
class _ModeRun:
    """What one mode's training holds between its steps (built by :func:`_build`)."""
    ns: Namespace
    cfg: ModelConfig
    device: torch.device
    ddp: Any
    optimizer: Any
    scheduler: Any
    vocab: int


def _build_model(ns: Namespace, cfg: ModelConfig, mode: str, device: torch.device):
    """Megatron-Core's GPTModel for this pipeline stage and mode, (Float16Module,) DDP."""
    from megatron.core import parallel_state as mpu
    from megatron.core.distributed import DistributedDataParallel, DistributedDataParallelConfig

    from megatron_metp.model import build_gpt_model

    vocab = padded_vocab_size(ns.vocab_size, ns.vocab_padding_tp, ns.make_vocab_size_divisible_by)
    tconf = _transformer_config(ns, cfg)
    if getattr(ns, "use_megatron_fsdp", False):
        # One of Megatron-FSDP's required settings (its user guide): --no-gradient-accumulation-
        # fusion (the fused weight-gradient GEMM writes straight into main_grad). With it on, a
        # tied embedding's gradient came out wrong here (tiny-gpt, DP 4: first-step gradient
        # norm 3.017 against DDP's 3.127); untied models agreed either way.
        tconf.gradient_accumulation_fusion = False
    model = build_gpt_model(
        tconf, mode, vocab_size=vocab, max_sequence_length=ns.max_position_embeddings,
        seq_length=ns.seq_length, position_embedding_type=cfg.position_embedding_type,
        pre_process=mpu.is_pipeline_first_stage(), post_process=mpu.is_pipeline_last_stage(),
        share_embeddings_and_output_weights=not cfg.untie_embeddings_and_output_weights,
    ).to(device)
    if ns.bf16:  # as Megatron-LM: bf16 parameters, fp32 loss, inputs cast at the boundary
        from megatron.core.transformer.module import Float16Module

        model = Float16Module(tconf, model)
    if ns.use_megatron_fsdp:
        # Megatron-LM's --use-megatron-fsdp: its adapter in place of DDP, with the distributed
        # optimizer. Its default pre-multiplied gradient sum is an NCCL-only reduce op; under
        # gloo the gradients are scaled by 1/d before a plain sum (the same average).
        from megatron.core.distributed.fsdp.mcore_fsdp_adapter import FullyShardedDataParallel

        from megatron_metp import cpu_compat

        cpu_compat.apply_megatron_fsdp()  # its CPU stand-ins, only where it runs (no-op on GPU)

        ddp_config = DistributedDataParallelConfig(
            grad_reduce_in_fp32=True, use_distributed_optimizer=True, use_megatron_fsdp=True,
            data_parallel_sharding_strategy=ns.data_parallel_sharding_strategy,
            gradient_reduce_div_fusion=dist.get_backend() == "nccl", **_overlap(ns))
        ddp = FullyShardedDataParallel(config=tconf, ddp_config=ddp_config, module=model,
                                       device=device)
    else:
        ddp = DistributedDataParallel(
            config=tconf, module=model,
            ddp_config=DistributedDataParallelConfig(
                grad_reduce_in_fp32=True, use_distributed_optimizer=ns.use_distributed_optimizer,
                **_overlap(ns)))
    return tconf, ddp, vocab


def _overlap(ns: Namespace) -> dict:
    """DDP's overlap settings from ``--overlap-grad-reduce`` / ``--overlap-param-gather``."""
    return dict(overlap_grad_reduce=bool(getattr(ns, "overlap_grad_reduce", False)),
                overlap_param_gather=bool(getattr(ns, "overlap_param_gather", False)))


def _build_optimizer(ns: Namespace, tconf, ddp):
    """Megatron's optimizer and its lr / weight-decay scheduler; wires them into ``tconf``."""
    from megatron.core.distributed.finalize_model_grads import finalize_model_grads
    from megatron.core.optimizer import OptimizerConfig, get_megatron_optimizer
    from megatron.core.optimizer_param_scheduler import OptimizerParamScheduler

    opt_config = OptimizerConfig(
        optimizer="adam", lr=ns.lr, min_lr=ns.min_lr if ns.min_lr is not None else ns.lr / 10,
        weight_decay=ns.weight_decay, adam_beta1=0.9, adam_beta2=0.95,
        clip_grad=ns.clip_grad, bf16=ns.bf16, params_dtype=tconf.params_dtype,
        use_distributed_optimizer=ns.use_distributed_optimizer)
    # gloo copies of the DP groups are not built (initialize_parallel passes
    # create_gloo_process_groups=False); neither optimizer needs them here (the distributed
    # one would only for its memory-efficient fully reshardable checkpoints, not offered).
    optimizer = get_megatron_optimizer(opt_config, [ddp], use_gloo_process_groups=False)
    scheduler = OptimizerParamScheduler(
        optimizer, init_lr=0.0, max_lr=ns.lr, min_lr=opt_config.min_lr,
        lr_warmup_steps=ns.lr_warmup_iters,
        lr_decay_steps=max(ns.lr_decay_iters or ns.train_iters, ns.lr_warmup_iters + 1),
        lr_decay_style=ns.lr_decay_style, start_wd=ns.weight_decay, end_wd=ns.weight_decay,
        wd_incr_steps=max(ns.train_iters, 1), wd_incr_style="constant",
        # On --load the schedule comes from this command line and only the step count from
        # the checkpoint (Megatron-LM's --override-opt_param-scheduler).
        use_checkpoint_opt_param_scheduler=False, override_opt_param_scheduler=True)
    tconf.finalize_model_grads_func = finalize_model_grads
    tconf.grad_scale_func = optimizer.scale_loss
    tconf.no_sync_func = ddp.no_sync
    if getattr(ns, "overlap_grad_reduce", False):
        # As Megatron-LM's training loop (align_grad_reduce, its default): the schedule starts
        # the bucketed reduce itself; the next forward's pre-hooks wait for the parameters.
        tconf.grad_sync_func = ddp.start_grad_sync
    return optimizer, scheduler


def _build(args: Namespace, ns: Namespace, cfg: ModelConfig, mode: str,
           device: torch.device) -> _ModeRun:
    ns.use_megatron_fsdp = bool(args.use_megatron_fsdp)
    ns.data_parallel_sharding_strategy = args.data_parallel_sharding_strategy
    # Megatron-FSDP's optimizer is the distributed one (Megatron-LM passes both flags).
    ns.use_distributed_optimizer = bool(args.use_distributed_optimizer or args.use_megatron_fsdp)
    ns.overlap_grad_reduce = bool(getattr(args, "overlap_grad_reduce", False))
    ns.overlap_param_gather = bool(getattr(args, "overlap_param_gather", False))
    tconf, ddp, vocab = _build_model(ns, cfg, mode, device)
    optimizer, scheduler = _build_optimizer(ns, tconf, ddp)
    return _ModeRun(ns, cfg, device, ddp, optimizer, scheduler, vocab)


def _resume(args: Namespace, run: _ModeRun) -> int:
    """The iteration to start from: a complete checkpoint under ``--load``, else 0."""
    from megatron_metp.training import train_checkpoint as checkpoint_io

    if args.load and checkpoint_io.has_checkpoint(args.load):
        start = checkpoint_io.load(args.load, [run.ddp], run.optimizer, run.scheduler)
        _print0(f"[metp] resumed from {args.load} at iteration {start}")
        return start
    if args.load:
        # As Megatron-LM does (--load and --save often name the same directory): no complete
        # checkpoint there yet means a fresh start, said once.
        _print0(f"[metp] warning: --load {args.load} holds no complete checkpoint "
                f"(no {checkpoint_io.TRACKER}); training starts from scratch (--seed); "
                f"--exit-on-missing-checkpoint stops instead")
    return 0


def _flops_per_iteration(run: _ModeRun) -> float:
    ns, cfg = run.ns, run.cfg
    flop_model = FlopModel(
        num_layers=ns.num_layers, hidden_size=ns.hidden_size,
        num_attention_heads=ns.num_attention_heads, num_query_groups=ns.num_query_groups,
        kv_channels=ns.kv_channels, ffn_hidden_size=ns.ffn_hidden_size,
        padded_vocab_size=run.vocab, swiglu=cfg.swiglu, causal=cfg.causal)
    return training_flops(flop_model, ns.global_batch_size, ns.seq_length)


def _train_step(run: _ModeRun, it: int, samples: GPTSamples, is_reporter: bool):
    """One iteration: forward-backward over the micro-batches, optimizer and lr step.

    Returns (data-parallel mean loss, lr used, grad norm, peak memory of the slowest rank).
    """
    from megatron.core import parallel_state as mpu
    from megatron.core.pipeline_parallel import get_forward_backward_func

    ns, device = run.ns, run.device
    dp = mpu.get_data_parallel_world_size()
    num_micro = ns.global_batch_size // (ns.micro_batch_size * dp)
    run.ddp.zero_grad_buffer()
    run.optimizer.zero_grad()
    data = samples.iterate(it, num_micro, global_batch_size=ns.global_batch_size,
                           micro_batch_size=ns.micro_batch_size,
                           dp_rank=mpu.get_data_parallel_rank(), dp_size=dp)
    out = get_forward_backward_func()(
        forward_step_func=functools.partial(_forward_step, ns.context_parallel_size, device),
        data_iterator=data, model=[run.ddp], num_microbatches=num_micro,
        seq_length=ns.seq_length, micro_batch_size=ns.micro_batch_size, forward_only=False)
    lr_used = float(run.optimizer.param_groups[0]["lr"])  # set by the last scheduler step
    _, grad_norm, _ = run.optimizer.step()
    run.scheduler.step(increment=1)
    # One world all-reduce brings the data-parallel mean loss to rank 0 (and syncs).
    local = (torch.stack([d["lm loss"].float() for d in out]).mean()
             if is_reporter and out else torch.zeros((), device=device))
    stat = torch.stack([local.to(device), torch.tensor(float(is_reporter), device=device)])
    dist.all_reduce(stat)
    mem = torch.tensor([_peak_memory_bytes(device)], dtype=torch.float64, device=device)
    dist.all_reduce(mem, op=dist.ReduceOp.MAX)
    return (float(stat[0] / stat[1]), lr_used, None if grad_norm is None else float(grad_norm),
            int(mem.item()))


def _save(args: Namespace, run: _ModeRun, iteration: int) -> None:
    from megatron_metp.training import train_checkpoint as checkpoint_io

    # With --overlap-param-gather the updated parameters may still be on their way (their
    # all-gather is waited for by the next forward's pre-hooks): finish it before saving, as
    # Megatron-LM does, and hand the hooks back after.
    gathering = bool(getattr(run.ns, "overlap_param_gather", False)) and hasattr(
        run.ddp, "disable_forward_pre_hook")
    if gathering:
        run.ddp.disable_forward_pre_hook()
    try:
        checkpoint_io.save(args.save, iteration, [run.ddp], run.optimizer, run.scheduler,
                           fully_reshardable=bool(args.dist_ckpt_optim_fully_reshardable),
                           layout=_layout_tag(run.ns, dist.get_world_size()))
    finally:
        if gathering:
            run.ddp.enable_forward_pre_hook()
    _print0(f"[metp] saved checkpoint at iteration {iteration} to {args.save}")


def _layout_tag(ns: Namespace, world_size: int) -> str:
    from megatron_metp.training.train_checkpoint import layout_tag

    tp, cp, pp = (ns.tensor_model_parallel_size, ns.context_parallel_size,
                  ns.pipeline_model_parallel_size)
    return layout_tag(ns.tensor_parallel_mode, tp, cp, pp, world_size // (tp * cp * pp))


class ExitSignal:
    """``--exit-signal-handler``: the signal sets a flag; the loop stops after the iteration.

    Installed for one ``run`` (the previous handler comes back at its end); nothing reads it
    inside autograd or communication, only the loop between iterations."""

    def __init__(self, signame: Optional[str]):
        self.received = False
        self._sig = getattr(signal, signame) if signame else None
        self._previous = None

    def __enter__(self) -> "ExitSignal":
        if self._sig is not None:
            self._previous = signal.signal(self._sig, self._on_signal)
        return self

    @property
    def armed(self) -> bool:
        return self._sig is not None

    def _on_signal(self, signum, frame) -> None:
        self.received = True

    def __exit__(self, *exc) -> None:
        if self._sig is not None:
            signal.signal(self._sig, self._previous)


class CtrlC:
    """Ctrl-C on a run the plugin's launcher started (``$METP_INTERRUPT_FILE`` set): every
    rank leaves at once and quietly, exit code 130, rank 0 first writing how far the run got to
    that file (the launcher's one line reads it). A checkpoint being written is finished first,
    so none is left half-written. Not installed where ``--exit-signal-handler`` takes SIGINT
    (that stops after the iteration and saves), nor under another launcher."""

    def __init__(self):
        self.path = os.environ.get(INTERRUPT_FILE)
        self.done, self.total = None, None
        self._saving = self._pending = False
        self._previous = None

    def __enter__(self) -> "CtrlC":
        if self.path:
            self._previous = signal.signal(signal.SIGINT, self._on_signal)
        return self

    def __exit__(self, *exc) -> None:
        if self._previous is not None:
            signal.signal(signal.SIGINT, self._previous)

    def _on_signal(self, signum, frame) -> None:
        if self._saving:
            self._pending = True
        else:
            self._leave()

    @contextlib.contextmanager
    def saving(self):
        """While open, a Ctrl-C waits for the block to end (the checkpoint is written whole)."""
        self._saving = True
        try:
            yield
        finally:
            self._saving = False
            if self._pending:
                self._leave()

    def _leave(self) -> None:
        if dist.is_initialized() and dist.get_rank() == 0 and self.done is not None:
            with open(self.path + ".tmp", "w") as f:
                json.dump(dict(iteration=self.done, train_iters=self.total), f)
            os.replace(self.path + ".tmp", self.path)
        sys.stdout.flush()
        os._exit(INTERRUPTED)


_CTRL_C = CtrlC()   # the running loop's progress, read by Ctrl-C's handler


def _exit_reason(ns: Namespace, iteration: int, started: float, stop: ExitSignal,
                 device: torch.device) -> Optional[str]:
    """Why to stop after ``iteration`` (None: go on), agreed by every rank: the clocks and the
    signal's arrival differ between ranks, so one all-reduce (MAX) decides, as in Megatron-LM."""
    if iteration >= ns.train_iters:
        return None
    if ns.exit_interval and iteration % ns.exit_interval == 0:
        return "interval"
    if not ns.exit_duration_in_mins and not stop.armed:
        return None
    late = bool(ns.exit_duration_in_mins) and (
        time.time() - started) / 60 > ns.exit_duration_in_mins
    flags = torch.tensor([float(late), float(stop.received)], device=device)
    dist.all_reduce(flags, op=dist.ReduceOp.MAX)
    return "duration" if flags[0] else "signal" if flags[1] else None


def _write_progress(root: str, iteration: int, train_iters: int, reason: Optional[str]) -> None:
    """Rank 0 records how far the run got (read by the sbatch script to decide on a requeue);
    written to a temporary name and renamed, so a reader never sees half of it."""
    if dist.get_rank() != 0:
        return
    path = os.path.join(root, PROGRESS)
    with open(path + ".tmp", "w") as f:
        json.dump(dict(iteration=iteration, train_iters=train_iters,
                       finished=iteration >= train_iters, exit=reason), f)
    os.replace(path + ".tmp", path)


def _train_loop(args: Namespace, run: _ModeRun, mode: str, start: int, reporter: Reporter,
                started: float, stop: ExitSignal) -> None:
    from megatron.core import parallel_state as mpu

    ns, device = run.ns, run.device
    samples = GPTSamples(load_tokens(ns.data_path, ns.vocab_size), ns.seq_length, ns.seed)
    flops = _flops_per_iteration(run)
    peak = gpu_peak_tflops() if device.type == "cuda" else None
    is_reporter = (mpu.is_pipeline_last_stage() and mpu.get_tensor_model_parallel_rank() == 0
                   and mpu.get_context_parallel_rank() == 0)
    world = dist.get_world_size()
    saved_at, reason, it = None, None, start
    for it in range(start, ns.train_iters):
        t0 = time.perf_counter()
        loss, lr_used, grad_norm, mem = _train_step(run, it, samples, is_reporter)
        seconds = time.perf_counter() - t0
        tflops, mfu = throughput(flops, seconds, world, peak)
        reporter.iteration(dict(
            mode=mode, iteration=it + 1, loss=loss, lr=lr_used, grad_norm=grad_norm,
            iter_time_s=seconds, tokens_per_s=ns.global_batch_size * ns.seq_length / seconds,
            tflops_per_device=tflops, mfu=mfu, peak_mem_bytes=mem,
            peak_mem_kind="allocated" if device.type == "cuda" else "rss"))
        _CTRL_C.done, _CTRL_C.total = it + 1, ns.train_iters
        if args.save and ns.save_interval and (it + 1) % ns.save_interval == 0:
            with _CTRL_C.saving():
                _save(args, run, it + 1)
            saved_at = it + 1
        reason = _exit_reason(ns, it + 1, started, stop, device)
        if reason is not None:
            it += 1
            break
    else:
        it = ns.train_iters
    if args.save and saved_at != it:
        with _CTRL_C.saving():
            _save(args, run, it)
    if args.save:
        _write_progress(args.save, it, ns.train_iters, reason)
    if reason is not None:
        _print0(f"[metp] exit ({reason}) after iteration {it} of {ns.train_iters}"
                + (f": saved to {args.save}, resume with --load {args.save}" if args.save
                   else " (no --save: nothing saved)"))


def train_one_mode(args: Namespace, cfg: ModelConfig, mode: str, explicit: set,
                   device: torch.device, reporter: Reporter, started: Optional[float] = None,
                   stop: Optional[ExitSignal] = None) -> Dict:
    """Train ``cfg`` under ``mode``; return {'losses': [...], 'summary': {...}} (rank 0 prints).

    Steps: resolve the namespace, initialise the groups, build model and optimizer, resume,
    loop over iterations (:func:`_train_step`), save; the groups are destroyed whatever happens.
    """
    from megatron.core import parallel_state as mpu

    from megatron_metp.model import destroy_parallel

    if device.type == "cuda":  # each mode's peak is its own (--compare runs modes in turn)
        gc.collect()
        torch.cuda.empty_cache()
        torch.cuda.reset_peak_memory_stats(device)

    ns = _parallel_setup(resolve_namespace(args, cfg, mode), explicit)
    check_sharding_layout(args, ns, dist.get_world_size())
    _initialize(ns)
    try:
        run = _build(args, ns, cfg, mode, device)
        start = _resume(args, run)
        reporter.start_mode(mode, ns, total=ns.train_iters, start=start, layout=dict(
            dp=mpu.get_data_parallel_world_size(), tp=ns.tensor_model_parallel_size,
            cp=ns.context_parallel_size, pp=ns.pipeline_model_parallel_size))
        _train_loop(args, run, mode, start, reporter,
                    time.time() if started is None else started, stop or ExitSignal(None))
        return reporter.end_mode()
    finally:
        destroy_parallel()


def run(args: Namespace, explicit: set) -> Dict[str, Dict]:
    """Entry point on every rank (under torchrun / srun, or a test harness that has already
    initialised ``torch.distributed``); returns {mode: {'losses', 'summary'}}."""
    import warnings

    from megatron_metp import cpu_compat

    started = time.time()  # --exit-duration-in-mins counts from here (Megatron-LM: pretrain's start)
    cfg = check_model_config(args)
    gc.collect()  # what an earlier run in this process left (e.g. one that raised)
    # Under an outside launcher (torchrun, srun) every rank plans the same choice (deterministic,
    # fake tensors, before any real group exists); rank 0 prints it. `metp train`'s own launcher
    # resolves it once and starts the ranks with the chosen mode instead.
    if modes_of(args, cfg) == ["auto"] and dist.is_initialized():
        raise ValueError("--tensor-parallel-mode auto plans with the fake process group: "
                         "resolve it before torch.distributed is initialised")
    resolve_auto(args, cfg, int(os.environ.get("WORLD_SIZE", 1)),
                 announce=int(os.environ.get("RANK", "0")) == 0)
    if not dist.is_initialized():
        # Planned with the fake process group, so only before torch.distributed starts; a
        # caller that brings its own group keeps "auto", which recomputes.
        resolve_metp_attention(args, cfg, int(os.environ.get("WORLD_SIZE", 1)),
                               announce=int(os.environ.get("RANK", "0")) == 0)
    use_cuda = torch.cuda.is_available()
    own_group = not dist.is_initialized()
    if use_cuda:
        local_rank = int(os.environ.get("LOCAL_RANK", 0))
        torch.cuda.set_device(local_rank)
        device = torch.device("cuda", local_rank)
    else:
        device = torch.device("cpu")
    if own_group:
        minutes = args.distributed_timeout_minutes or DEFAULTS["distributed_timeout_minutes"]
        dist.init_process_group("nccl" if use_cuda else "gloo",
                                timeout=datetime.timedelta(minutes=minutes))
    try:
        # Megatron-Core's deprecation notices and CPU-irrelevant hints, once per rank, bury the
        # training log; errors are not affected.
        for cat in (UserWarning, FutureWarning, DeprecationWarning):
            warnings.filterwarnings("ignore", category=cat)
        cpu_compat.apply()
        reporter = Reporter(rank=dist.get_rank(), log_json=args.log_json,
                            interactive=sys.stdout.isatty() and not args.no_progress)
        results = {}
        signame = args.exit_signal if getattr(args, "exit_signal_handler", False) else None
        global _CTRL_C
        _CTRL_C = CtrlC()
        with _CTRL_C, ExitSignal(signame) as stop:
            for mode in modes_of(args, cfg):
                try:
                    results[mode] = train_one_mode(args, cfg, mode, explicit, device, reporter,
                                                   started, stop)
                finally:
                    # The mode's model, DDP and optimizer hold its (now destroyed) process
                    # groups in reference cycles; a group's threads and sockets end only when
                    # it is freed.
                    gc.collect()
        reporter.final(results, compare=bool(args.compare))
        return results
    finally:
        if own_group:
            dist.destroy_process_group()
