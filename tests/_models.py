"""Helpers to build, run and compare whole GPT models across modes and parallel sizes.

Run inside a rank of ``tests._harness.run_ranks`` (torch.distributed up, cpu_compat applied).

``setup(tp, mode)``              Megatron + plugin groups, seeded
``build(mode, style)``           a tiny GPTModel, initialised from a fixed seed (TP-independent)
``batch(...)``                   a fixed batch: tokens, position_ids, labels, causal mask
``step(model, batch)``           forward + backward through Megatron's DDP and
                                 ``finalize_model_grads`` (the TP all-reduce of SP norm grads)
``copy_weights(src, dst)``       same names and shapes (``tp`` <-> ``metp``), copied in place
``shard_like`` / ``gather_full`` a full (TP = 1) tensor <-> this rank's TP shard, honouring
                                 Megatron's ``partition_dim`` / ``partition_stride``
``assert_close_dict``            tolerance-checked comparison by parameter name
"""

from __future__ import annotations

import multiprocessing
from contextlib import contextmanager
from typing import Dict, Optional

import torch
import torch.distributed as dist

VOCAB = 64
SEQ = 16
MICRO_BATCH = 2


def setup(tp: int = 1, mode: str = "tp", seed: int = 1234, **kwargs) -> None:
    from megatron_metp.model import initialize_parallel

    initialize_parallel(tensor_model_parallel_size=tp, seed=seed, mode=mode, **kwargs)


def build(
    mode: str = "tp",
    style: str = "gpt",
    *,
    seed: int = 1234,
    vocab_size: int = VOCAB,
    max_sequence_length: int = SEQ,
    share_embeddings_and_output_weights: bool = False,
    **config_overrides,
):
    """A GPTModel of ``style`` ('gpt': LayerNorm/GeLU/learned positions; 'llama': RMSNorm/SwiGLU/
    RoPE/GQA with 2 query groups) for ``mode``. The CPU generator is re-seeded first, so two builds
    with the same seed get the same weights whatever the TP size (use_cpu_initialization)."""
    from megatron_metp.model import build_gpt_model, make_config

    kw = dict(num_layers=2, hidden_size=32, num_attention_heads=4)
    kw.update(config_overrides)
    config = make_config(style=style, **kw)
    torch.manual_seed(seed)
    return build_gpt_model(
        config,
        mode,
        vocab_size=vocab_size,
        max_sequence_length=max_sequence_length,
        position_embedding_type="rope" if style == "llama" else "learned_absolute",
        share_embeddings_and_output_weights=share_embeddings_and_output_weights,
    )


def batch(seed: int = 0, b: int = MICRO_BATCH, s: int = SEQ, vocab: int = VOCAB) -> dict:
    """Tokens / labels [b, s], position ids [b, s], causal mask [1, 1, s, s] (True = masked)."""
    g = torch.Generator().manual_seed(seed)
    tokens = torch.randint(0, vocab, (b, s + 1), generator=g)
    return dict(
        tokens=tokens[:, :-1].contiguous(),
        labels=tokens[:, 1:].contiguous(),
        position_ids=torch.arange(s).expand(b, s).contiguous(),
        attention_mask=torch.triu(torch.ones(s, s, dtype=torch.bool), diagonal=1)[None, None],
    )


def wrap_ddp(model, **ddp_kwargs):
    from megatron.core.distributed import DistributedDataParallel, DistributedDataParallelConfig

    return DistributedDataParallel(model.config, DistributedDataParallelConfig(**ddp_kwargs), model)


def optimizer(ddp_model, lr: float = 1e-3, clip_grad: float = 1.0):
    """Megatron's optimizer with plain (non-distributed) Adam.

    The distributed optimizer (``use_distributed_optimizer=True``) shards state over DP ranks and
    checks for CUDA tensor types, refusing CPU parameters; on CPU the non-distributed optimizer
    with DDP's grad all-reduce is the equivalent. Gloo groups are Megatron's extra CPU groups for
    the distributed optimizer; the main backend is gloo already, so they are not created.
    """
    from megatron.core.optimizer import OptimizerConfig, get_megatron_optimizer

    cfg = OptimizerConfig(
        optimizer="adam", lr=lr, clip_grad=clip_grad, use_distributed_optimizer=False
    )
    return get_megatron_optimizer(cfg, [ddp_model], use_gloo_process_groups=False)


def step(ddp_model, b: dict, *, gather_logits: bool = True) -> dict:
    """Forward + backward of the mean next-token loss; grads finalised as in training.

    Returns ``loss`` (float), ``logits`` [b, s, V] (gathered over TP) and ``grads`` by name
    (this rank's shards, from DDP's ``main_grad``).
    """
    from megatron.core.distributed import finalize_model_grads

    model = ddp_model.module
    ddp_model.zero_grad_buffer()
    logits_bsv = ddp_model(b["tokens"], b["position_ids"], b["attention_mask"])
    loss = model.compute_language_model_loss(b["labels"], logits_bsv.transpose(0, 1).contiguous())
    loss = loss.mean()
    loss.backward()
    finalize_model_grads([ddp_model])
    grads = {n: p.main_grad.detach().clone() for n, p in model.named_parameters()}
    out = dict(loss=loss.item(), grads=grads)
    if gather_logits:
        from megatron.core.tensor_parallel import gather_from_tensor_model_parallel_region

        out["logits"] = gather_from_tensor_model_parallel_region(logits_bsv.detach()).clone()
    return out


def _tp_meta(param) -> Optional[tuple]:
    if getattr(param, "tensor_model_parallel", False):
        return param.partition_dim, getattr(param, "partition_stride", 1)
    return None


def shard_like(full: torch.Tensor, param) -> torch.Tensor:
    """This TP rank's shard of ``full`` as Megatron lays it out for ``param``.

    Megatron splits the partition dim into ``stride * p`` chunks and gives rank r the chunks
    r, r + p, ... (stride 2 for SwiGLU's fc1: rank r holds its slice of both halves).
    """
    from megatron.core import parallel_state as mpu

    meta = _tp_meta(param)
    p = mpu.get_tensor_model_parallel_world_size()
    if meta is None or p == 1:
        return full.clone()
    dim, stride = meta
    r = mpu.get_tensor_model_parallel_rank()
    if getattr(param, "metp_balanced_rows", False):
        # METP's position table in the balanced token layout: chunks r and 2p-1-r of 2p.
        chunks = full.chunk(2 * p, dim=dim)
        return torch.cat([chunks[r], chunks[2 * p - 1 - r]], dim=dim).clone()
    chunks = full.chunk(stride * p, dim=dim)
    return torch.cat(chunks[r::p], dim=dim).clone()


def gather_full(shard: torch.Tensor, param) -> torch.Tensor:
    """Inverse of :func:`shard_like`: the full tensor from every TP rank's shard."""
    from megatron.core import parallel_state as mpu

    meta = _tp_meta(param)
    p = mpu.get_tensor_model_parallel_world_size()
    if meta is None or p == 1:
        return shard.clone()
    dim, stride = meta
    parts = [torch.empty_like(shard) for _ in range(p)]
    dist.all_gather(parts, shard.contiguous(), group=mpu.get_tensor_model_parallel_group())
    if getattr(param, "metp_balanced_rows", False):
        halves = {}
        for r, part in enumerate(parts):
            halves[r], halves[2 * p - 1 - r] = part.chunk(2, dim=dim)
        return torch.cat([halves[c] for c in range(2 * p)], dim=dim)
    # rank r's shard = [chunk r, chunk r + p, ...]: interleave back to chunk order.
    per_rank = [part.chunk(stride, dim=dim) for part in parts]
    ordered = [per_rank[r][k] for k in range(stride) for r in range(p)]
    return torch.cat(ordered, dim=dim)


def full_grads(model, grads: Dict[str, torch.Tensor]) -> Dict[str, torch.Tensor]:
    """``grads`` (this rank's shards, by parameter name) gathered to their full (TP = 1) shapes."""
    params = dict(model.named_parameters())
    return {n: gather_full(g, params[n]) for n, g in grads.items()}


def full_state(model) -> Dict[str, torch.Tensor]:
    """Every parameter gathered to its full (TP = 1) shape, by name."""
    return {n: gather_full(p.detach(), p) for n, p in model.named_parameters()}


def load_full_state(model, full: Dict[str, torch.Tensor]) -> None:
    """Copy full (TP = 1) tensors into this rank's shards; names must match exactly."""
    names = dict(model.named_parameters())
    assert set(names) == set(full), sorted(set(names) ^ set(full))
    with torch.no_grad():
        for n, p in names.items():
            p.copy_(shard_like(full[n], p))


def copy_weights(src, dst) -> None:
    """Copy parameters between two models of the same parallel layout (same names and shapes)."""
    s, d = dict(src.named_parameters()), dict(dst.named_parameters())
    assert set(s) == set(d), f"parameter names differ: {sorted(set(s) ^ set(d))}"
    with torch.no_grad():
        for n, p in d.items():
            assert p.shape == s[n].shape, f"{n}: {tuple(p.shape)} vs {tuple(s[n].shape)}"
            p.copy_(s[n])


def max_errors(actual: torch.Tensor, expected: torch.Tensor) -> tuple:
    err = (actual.double() - expected.double()).abs()
    return err.max().item(), err.mean().item()


def assert_close_dict(
    actual: Dict[str, torch.Tensor],
    expected: Dict[str, torch.Tensor],
    *,
    rtol: float,
    atol_scale: float,
    what: str = "",
) -> float:
    """``assert_close`` per name with ``atol = atol_scale * max|expected|`` (per tensor), so that
    tensors whose entries are all tiny are still compared relative to their own scale. Returns
    the largest absolute error seen."""
    assert set(actual) == set(expected), f"{what}: names differ {sorted(set(actual) ^ set(expected))}"
    worst = 0.0
    for n in sorted(expected):
        a, e = actual[n], expected[n]
        assert a.shape == e.shape, f"{what} {n}: {tuple(a.shape)} vs {tuple(e.shape)}"
        atol = atol_scale * max(e.abs().max().item(), 1e-30)
        torch.testing.assert_close(a, e, rtol=rtol, atol=atol, msg=lambda m: f"{what} {n}: {m}")
        worst = max(worst, max_errors(a, e)[0])
    return worst


@contextmanager
def child_processes_allowed():
    """Let this (daemonic) harness rank start child processes, as dist-checkpointing's save does.

    ``dist_checkpointing.save`` writes through ``FileSystemWriterAsync``, which starts a spawn
    ``Manager`` for its results queue and forks one writer process per bucket; Python refuses
    children in daemonic processes, and the harness ranks are daemonic so that a hung test cannot
    outlive pytest. In a real launcher (torchrun) the ranks are not daemonic, and the only
    requirement is the usual ``if __name__ == "__main__":`` guard in the script, because the spawn
    Manager re-imports ``__main__``.
    """
    proc = multiprocessing.current_process()
    was = proc.daemon
    proc.daemon = False
    try:
        yield
    finally:
        proc.daemon = was


def train_args(base, *argv):
    """``metp train`` arguments (``base`` then ``argv``) parsed as the CLI parses them."""
    from megatron_metp.training import cli

    parser, _ = cli.build_parser()
    full = ["train", *base, *argv]
    return parser.parse_args(full), cli.explicit_flags(full)


def train_capturing(base, argv, capture):
    """Run ``metp train`` (one mode) in this rank through ``training.train.run``, calling
    ``capture(run)`` after every step while its groups are alive; returns the losses and the
    last step's capture."""
    from megatron_metp.training import train

    held = {}
    orig = train._train_step

    def step(run, it, *args, **kwargs):
        result = orig(run, it, *args, **kwargs)
        held["last"] = capture(run)
        return result

    train._train_step = step
    try:
        (res,) = train.run(*train_args(base, *argv)).values()
    finally:
        train._train_step = orig
    return res["losses"], held.get("last")


@contextmanager
def large_layers(on: bool = True):
    """With ``on``, METP layers take a large layer's paths: above ``wgrad_accum.
    WGRADS_TOGETHER_MAX_VALUES`` (at p = 8 every paper model's layer but BERT-Large's up to
    8k) each weight gradient is reduce-scattered as soon as its GEMM has run and a first layer
    gathers its ``W_qkv`` in two parts; above ``gathered_mlp.KEEP_ACT_MAX_VALUES`` (all but
    BERT-Large's up to 16k and LLaMA-7B's at 4k) a fused activation's output is not kept but
    recomputed in backward. The test models are far below both limits, so without it they
    take the small layers' paths (one call per sublayer's gradients, the next attention's
    handed to the MLP before it, the whole ``W_qkv``, a fused activation's output kept).
    Read where the plan and the MLP's forward decide, outside autograd."""
    from megatron_metp.metp import gathered_mlp, wgrad_accum

    old = wgrad_accum.WGRADS_TOGETHER_MAX_VALUES, gathered_mlp.KEEP_ACT_MAX_VALUES
    if on:
        wgrad_accum.WGRADS_TOGETHER_MAX_VALUES = gathered_mlp.KEEP_ACT_MAX_VALUES = -1
    try:
        yield
    finally:
        wgrad_accum.WGRADS_TOGETHER_MAX_VALUES, gathered_mlp.KEEP_ACT_MAX_VALUES = old


@contextmanager
def unlinked():
    """METP layers without their ``SublayerLink`` (``metp.layer_schedule.open_link`` returns
    None): each sublayer gathers and reduces its own weights, as before the layer schedule."""
    from megatron_metp.metp import layer_schedule as L

    orig = L.open_link
    L.open_link = lambda *a, **k: None
    try:
        yield
    finally:
        L.open_link = orig
