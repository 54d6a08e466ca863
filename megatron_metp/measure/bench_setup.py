"""What ``metp bench`` runs: each mode's process groups and config, and one training step.

``setup(mode, args, p)`` builds Megatron's and the plugin's groups (tp/metp: TP = p; wallfacer
and ring: CP = p with WallFacer's teams and sub-rings) and returns the spec mode, the
``TransformerConfig`` and a label; ``teardown()`` forgets them. ``layer_step`` / ``model_step``
return a closure running one forward + backward, the tensors and modules that exist before it
(tracked from the start by ``PeakMemory``), and for a layer its two sublayers as steps of their
own (communication per sublayer).
"""

from __future__ import annotations

from typing import Optional

import torch


def team_size(args, p: int) -> Optional[int]:
    """C for the wallfacer mode: ``--wallfacer-team-size``, else the largest valid C > 1."""
    from megatron_metp.wallfacer.config_generator import valid_team_sizes

    if args.wallfacer_team_size is not None:
        return args.wallfacer_team_size
    bigger = [c for c in valid_team_sizes(p) if c > 1]
    return max(bigger) if bigger else None


def setup(mode: str, args, p: int):
    """Megatron's and the plugin's groups for ``mode``; returns (spec mode, config, label)."""
    from megatron_metp.model import initialize_parallel, make_config

    dtype = torch.bfloat16 if args.bf16 else torch.float32
    mode, _, extra = mode.partition("+")
    # "+full": Megatron's full recompute of every layer; "+a2a": --metp-ring-pass a2a;
    # "+ring-mlp": --metp-mlp-pass ring (the paper's weight ring at any length); "+save" /
    # "+keep": the a2a pass with --metp-qkv-backward save+fc1 / save+fc1+weights.
    variant = dict(recompute_granularity="full", recompute_method="uniform",
                   recompute_num_layers=1) if extra == "full" else \
        dict(metp_ring_pass="a2a") if extra == "a2a" else \
        dict(metp_mlp_pass="ring") if extra == "ring-mlp" else \
        dict(metp_ring_pass="a2a", metp_qkv_backward="save+fc1") if extra == "save" else \
        dict(metp_ring_pass="a2a", metp_qkv_backward="save+fc1+weights") if extra == "keep" \
        else {}
    kw = dict(num_layers=args.num_layers if args.scope == "model" else 1, **variant,
              hidden_size=args.hidden_size, num_attention_heads=args.num_attention_heads,
              params_dtype=dtype, bf16=args.bf16,
              stock=True)  # Megatron-LM's default fusions: tp is the stock baseline
    if args.ffn_hidden_size:
        kw["ffn_hidden_size"] = args.ffn_hidden_size
    if args.style == "llama":
        kw["num_query_groups"] = args.num_query_groups or args.num_attention_heads
    if mode in ("tp", "metp"):
        initialize_parallel(tensor_model_parallel_size=p, mode=mode)
        return mode, make_config(args.style, **kw), mode + (f"+{extra}" if extra else "")
    from megatron_metp.wallfacer.scheduler import initialize_wallfacer

    c = 1 if mode == "ring" else team_size(args, p)
    initialize_parallel(tensor_model_parallel_size=1, context_parallel_size=p, mode="wallfacer")
    initialize_wallfacer(c, "collective_intra")
    label = "ring (C=1)" if mode == "ring" else f"wallfacer (C={c})"
    return "wallfacer", make_config(args.style, cp_comm_type="wallfacer", **kw), label


def teardown() -> None:
    from megatron_metp.model import destroy_parallel

    destroy_parallel()


def layer_step(config, spec_mode: str, s: int, b: int, device):
    """One TransformerLayer on ``x_shard_s [s/p, b, h]``; also its two sublayers alone."""
    from megatron_metp.measure.layer_probe import build_layer, give_main_grads

    p = config.tensor_model_parallel_size * config.context_parallel_size
    torch.manual_seed(0)
    # A causal layer as the models train it (METP: the balanced token layout).
    layer = build_layer(config, spec_mode).to(device)
    give_main_grads(layer)  # what DDP provides; the fused weight-gradient GEMM writes there
    x_shard_s = torch.randn(s // p, b, config.hidden_size, dtype=config.params_dtype,
                            device=device, requires_grad=True)
    grad_shard_s = torch.randn_like(x_shard_s)

    def run(module, call):
        def step():
            for prm in module.parameters():
                prm.grad = None
            x_shard_s.grad = None
            call(module).backward(grad_shard_s)
        return step

    if config.recompute_granularity == "full":
        # As TransformerBlock._checkpointed_forward runs one layer per chunk: Megatron's own
        # CheckpointFunction keeps the input and runs the forward again in backward.
        from megatron.core import tensor_parallel

        step = run(layer, lambda m: tensor_parallel.checkpoint(
            lambda x: m(x, attention_mask=None)[0], False, x_shard_s))
    else:
        step = run(layer, lambda m: m(x_shard_s, attention_mask=None)[0])
    sublayers = {
        "attention": run(layer.self_attention, lambda m: m(x_shard_s, attention_mask=None)[0]),
        "mlp": run(layer.mlp, lambda m: m(x_shard_s)[0]),
    }
    return step, (layer, x_shard_s, grad_shard_s), sublayers


def model_step(config, spec_mode: str, s: int, b: int, vocab: int, device, style: str):
    """A GPTModel forward (per-token loss) + backward on this rank's tokens."""
    from megatron_metp.measure.layer_probe import give_main_grads
    from megatron_metp.model import build_gpt_model
    from megatron_metp.wallfacer import zigzag

    tp, cp = config.tensor_model_parallel_size, config.context_parallel_size
    vocab = -(-vocab // max(tp, 1)) * max(tp, 1)
    torch.manual_seed(0)
    model = build_gpt_model(config, spec_mode, vocab_size=vocab, max_sequence_length=s,
                            position_embedding_type="rope" if style == "llama"
                            else "learned_absolute").to(device)
    give_main_grads(model)
    g = torch.Generator().manual_seed(1)
    tokens = torch.randint(0, vocab, (b, s + 1), generator=g)
    inp, labels = tokens[:, :-1], tokens[:, 1:]
    pos = torch.arange(s).expand(b, s)
    if cp > 1:
        from megatron.core import parallel_state as mpu

        idx = mpu.get_context_parallel_rank()
        inp, labels, pos = (zigzag.shard_sequence(t, idx, cp, dim=1) for t in (inp, labels, pos))
    inp, labels, pos = (t.contiguous().to(device) for t in (inp, labels, pos))

    def step():
        model.zero_grad(set_to_none=True)
        model(inp, pos, None, labels=labels).float().sum().backward()

    return step, (model, inp, labels, pos), {}, vocab



def model_flops(config, args, s: int, vocab: int) -> float:
    from megatron_metp.models.flops import FlopModel, training_flops

    m = FlopModel(num_layers=config.num_layers, hidden_size=config.hidden_size,
                  num_attention_heads=config.num_attention_heads,
                  num_query_groups=config.num_query_groups or config.num_attention_heads,
                  kv_channels=config.kv_channels, ffn_hidden_size=config.ffn_hidden_size,
                  padded_vocab_size=vocab, swiglu=bool(config.gated_linear_unit))
    return training_flops(m, args.micro_batch_size, s)
