"""The ``metp`` command: ``metp train``, ``metp bench`` and ``metp plan``.

Adding a subcommand is one function decorated with :func:`subcommand`: it receives its
``argparse`` sub-parser, adds its flags, and returns the function that runs it::

    @subcommand("bench", "measure memory, communication and time per mode")
    def _bench(parser):
        parser.add_argument(...)
        return run_bench            # run_bench(args, explicit_flags) -> exit code

Distributed subcommands (``train``, ``bench``) start their ranks with
``megatron_metp.launch.launch_or_run``: in place under torchrun/srun, else through torchrun.
"""

from __future__ import annotations

import argparse
import os
import sys
from typing import Callable, Dict, List, Optional, Tuple

from megatron_metp.launch import launch_or_run, mode_list

_SUBCOMMANDS: Dict[str, Tuple[str, Callable]] = {}


def subcommand(name: str, help: str):
    """Register ``fn(parser) -> runner`` as ``metp NAME``."""

    def deco(fn: Callable) -> Callable:
        _SUBCOMMANDS[name] = (help, fn)
        return fn

    return deco


# ------------------------------------------------------------------------------------------
# metp train

MODES = ("tp", "metp", "wallfacer")
LR_DECAY_STYLES = ("constant", "linear", "cosine", "inverse-square-root")
EXIT_SIGNALS = ("SIGTERM", "SIGINT", "SIGUSR1", "SIGUSR2")


def _replace_auto(argv: List[str], args: argparse.Namespace) -> None:
    """``--tensor-parallel-mode auto`` -> the chosen configuration's flags, in place in
    ``argv`` (``measure.auto.rewrite_argv``): the ranks start with them."""
    from megatron_metp.measure.auto import rewrite_argv

    argv[:] = rewrite_argv(argv, args.auto_choice)


@subcommand("train", "train a GPT model with Megatron-Core under tp, metp or wallfacer")
def _train_parser(p: argparse.ArgumentParser) -> Callable:
    # Every default is None so that the model config's training defaults apply unless a flag is
    # given (megatron_metp.training.train.DEFAULTS holds the rest).
    a = p.add_argument
    for add in (_train_mode_flags, _train_schedule_flags, _train_memory_flags,
                _train_sharding_flags, _train_run_flags):
        add(a)
    return _train_run


def _train_mode_flags(a: Callable) -> None:
    """The model config, the mode and the parallel layout."""
    a("--config", default="tiny-gpt",
      help="configs/<name>.yaml or a path (default tiny-gpt)")
    a("--tensor-parallel-mode", choices=MODES + ("auto",), default=None,
      help="tp (Megatron TP+SP), metp (METP weight rings), wallfacer (multi-ring attention), "
           "auto (the planner picks, among what fits --auto-memory-gib, the fastest by estimate "
           "and prints the table it decided from)")
    a("--auto-memory-gib", type=float, default=None,
      help="auto: memory per GPU (default: the GPU's, else 80)")
    a("--auto-gpu", choices=("H100", "A100"), default=None,
      help="auto: the GPU whose estimated step times decide (default: this GPU, else H100)")
    a("--compare", type=mode_list("--compare", MODES), default=None, metavar="MODES",
      help="e.g. tp,metp,wallfacer: same seed and data under each mode, dropout 0; prints the "
           "loss curves side by side and the largest difference")
    a("--tensor-model-parallel-size", type=int, default=None)
    a("--context-parallel-size", type=int, default=None)
    a("--pipeline-model-parallel-size", type=int, default=None)
    a("--sequence-parallel", action=argparse.BooleanOptionalAction, default=None,
      help="default: on when --tensor-model-parallel-size > 1 (metp needs it)")
    a("--wallfacer-team-size", default=None, help="C (C^2 divides P) or 'auto'")
    a("--wallfacer-placement", default=None,
      choices=("team-consecutive", "ring-consecutive", "collective_intra", "p2p_intra"),
      help="team-consecutive (team collectives inside a node) or ring-consecutive (sub-ring "
           "P2P inside a node)")
    a("--cp-comm-type", default=None, choices=("p2p", "a2a", "allgather", "a2a+p2p", "wallfacer"),
      help="Megatron's context-parallel communication (tp mode with CP > 1); wallfacer mode "
           "sets 'wallfacer'")


def _train_schedule_flags(a: Callable) -> None:
    """Sequence, batch, learning-rate schedule and dropout."""
    a("--seq-length", type=int, default=None)
    a("--micro-batch-size", type=int, default=None)
    a("--global-batch-size", type=int, default=None)
    a("--lr", type=float, default=None)
    a("--min-lr", type=float, default=None)
    a("--lr-warmup-iters", type=int, default=None)
    a("--lr-decay-iters", type=int, default=None,
      help="iterations of the lr decay (default --train-iters): give the full run's length to "
           "a run cut short so that its schedule is the full run's")
    a("--lr-decay-style", choices=LR_DECAY_STYLES, default=None,
      help="lr decay after warm-up (default cosine; Megatron-LM's default is linear)")
    a("--train-iters", type=int, default=None)
    a("--weight-decay", type=float, default=None)
    a("--clip-grad", type=float, default=None)
    a("--hidden-dropout", type=float, default=None)
    a("--attention-dropout", type=float, default=None)


def _train_memory_flags(a: Callable) -> None:
    """METP's attention and MLP passes, recompute and precision."""
    a("--metp-ring-pass", choices=("auto", "whole", "head-group", "a2a"), default=None,
      help="METP attention: every head group in one K/V ring pass (whole), one per head group "
           "(head-group: least memory), the whole pass with all-to-alls in place of its ring "
           "(a2a), or auto (default: the planner's choice from memory headroom, a2a then whole "
           "wherever the run fits --auto-memory-gib with it)")
    a("--metp-qkv-backward",
      choices=("auto", "recompute", "save", "save+fc1", "save+fc1+weights"), default=None,
      help="METP's one ring pass: keep Q/K/V for backward (save: one GEMM less per layer, "
           "more memory) or recompute them (recompute: the paper's Alg. 6); save+fc1: keep "
           "the MLP's fc1 output too (no fc1 GEMM in backward, F' more values per token); "
           "save+fc1+weights: keep the weights the forward gathered too (the backward gathers "
           "none; the layer's weights held from forward to backward); auto (default): the "
           "first of save+fc1, save, recompute (never save+fc1+weights) with which the planner "
           "finds the run still fits --auto-memory-gib")
    a("--metp-mlp-pass", choices=("auto", "ring", "gathered"), default=None,
      help="METP MLP: its weight ring (ring: least memory), its weights all-gathered once "
           "(gathered: the same bytes in a constant number of operations, this rank's whole "
           "fc1 output at once), or auto (default: gathered while that output is at most "
           "512 MiB, i.e. short sequences)")
    a("--recompute-granularity", choices=("selective", "full"), default=None,
      help="Megatron's activation recompute: selective (with --recompute-modules) or full "
           "(whole layers, in every mode: only each chunk's input is kept and the backward runs "
           "the forward again, METP's rings included)")
    a("--recompute-method", choices=("uniform", "block"), default=None,
      help="full recompute: uniform (chunks of --recompute-num-layers layers, default) or block "
           "(only the first --recompute-num-layers layers of each stage)")
    a("--recompute-num-layers", type=int, default=None,
      help="full recompute: layers per chunk (uniform) or checkpointed layers (block); "
           "default 1")
    a("--recompute-modules", nargs="+", choices=("layernorm", "mlp", "core_attn"), default=None,
      help="what selective recompute recomputes in backward (Megatron-LM's flag; default "
           "core_attn); layernorm: the norm outputs, 2 bsh/p less per layer in every mode")
    a("--bf16", action="store_true", help="bf16 parameters and compute (GPU only)")


def _train_sharding_flags(a: Callable) -> None:
    """The distributed optimizer, DDP's overlap and Megatron-FSDP."""
    a("--use-distributed-optimizer", action="store_true",
      help="Megatron-Core's DistributedOptimizer: shard the optimizer state over the "
           "data-parallel x context-parallel ranks (WallFacer's whole CP group)")
    a("--overlap-grad-reduce", action="store_true",
      help="Megatron-Core DDP's bucketed gradient reduce during the backward (Megatron-LM's "
           "flag)")
    a("--overlap-param-gather", action="store_true",
      help="the distributed optimizer's parameter all-gather overlapped with the next forward "
           "(Megatron-LM's flag; needs --use-distributed-optimizer and --overlap-grad-reduce)")
    a("--use-megatron-fsdp", action="store_true",
      help="Megatron-Core's Megatron-FSDP (megatron.core.distributed.fsdp) instead of DDP; "
           "with --data-parallel-sharding-strategy optim_grads_params it shards parameters, "
           "gradients and optimizer state over the data-parallel x context-parallel ranks")
    a("--data-parallel-sharding-strategy", default=None,
      choices=("no_shard", "optim", "optim_grads", "optim_grads_params"),
      help="what Megatron-FSDP shards (Megatron-LM's flag; its default no_shard fails in "
           "megatron-core 0.16.1 and is refused: pass optim_grads_params)")
    a("--dist-ckpt-optim-fully-reshardable", action="store_true",
      help="with --use-distributed-optimizer, save its state per parameter (Megatron-LM's "
           "flag) so the checkpoint loads in another mode and TP/CP/DP split (with "
           "--use-distributed-optimizer); without it only the same layout can load it")


def _train_run_flags(a: Callable) -> None:
    """Data, checkpoints, exits, logging and the launch."""
    a("--seed", type=int, default=None)
    a("--data-path", default=None,
      help="Megatron indexed dataset PREFIX (PREFIX.bin/.idx); default: the shipped corpus")
    a("--vocab-size", type=int, default=None,
      help="tokenizer vocabulary of --data-path (default: the config's, else 258 bytes)")
    a("--make-vocab-size-divisible-by", type=int, default=None)
    a("--save", default=None, help="checkpoint directory (Megatron-Core dist_checkpointing)")
    a("--load", default=None, help="resume from the newest checkpoint in this directory")
    a("--exit-on-missing-checkpoint", action="store_true",
      help="with --load: stop (exit code 2) when it holds no checkpoint, instead of warning "
           "and training from scratch (Megatron-LM's flag)")
    a("--save-interval", type=int, default=None)
    a("--exit-interval", type=int, default=None,
      help="save (with --save) and exit cleanly when the iteration is a multiple of this")
    a("--exit-duration-in-mins", type=float, default=None,
      help="save and exit cleanly once this many minutes have passed since the run started "
           "(set it below the SLURM time limit; scripts/slurm/metp_train.sbatch does)")
    a("--exit-signal-handler", action="store_true",
      help="on --exit-signal, finish the iteration, save and exit cleanly (as Megatron-LM)")
    a("--exit-signal", choices=EXIT_SIGNALS, default="SIGTERM",
      help="the signal --exit-signal-handler takes (default SIGTERM, what SLURM and torchrun "
           "send before killing)")
    a("--distributed-timeout-minutes", type=float, default=None,
      help="minutes a collective waits for a peer before the run fails (default 10; "
           "fractions allowed, where Megatron-LM takes whole minutes)")
    a("--log-json", default=None, metavar="PATH",
      help="write one JSON object per iteration (iteration, loss, tokens/s, ...)")
    a("--no-progress", action="store_true", help="plain lines instead of a progress bar")
    a("--nproc-per-node", type=int, default=None,
      help="ranks to launch when not already under torchrun/srun (default: 4 on CPU, #GPUs)")


def _train_run(args: argparse.Namespace, explicit: set, argv: List[str]) -> int:
    """``metp train``: its flag values checked, then the ranks launched (or run in place)."""
    # Flag values first: standard library only, so a bad value fails in well under a second.
    from megatron_metp.validation import check_paths, check_values

    check_values(args, trainer=True)
    check_paths(args)

    def in_rank() -> int:
        from megatron_metp.training import train

        train.run(args, explicit)
        return 0

    def check(world_size: int) -> None:
        from megatron_metp.training import train

        was_auto = args.tensor_parallel_mode == "auto"
        train.preflight(args, explicit, world_size)
        if was_auto:  # resolved once, here: the ranks start with the chosen mode
            _replace_auto(argv, args)

    return launch_or_run(argv, args.nproc_per_node, in_rank, check,
                         lambda progress: interrupted_line(args.save, progress))


def interrupted_line(save: Optional[str], progress: Optional[dict]) -> str:
    """The one line Ctrl-C leaves: the iteration the run stopped after (rank 0's ``progress``)
    and the newest whole checkpoint under ``save``, or none."""
    from megatron_metp.checkpoint_keys import damage, latest_checkpoint_dir

    where = (f"after iteration {progress['iteration']} of {progress['train_iters']}"
             if progress else "with no finished iteration recorded by rank 0")
    ckpt = latest_checkpoint_dir(save) if save and os.path.isdir(save) else None
    if ckpt is not None and damage(ckpt) is None:
        saved = f"last checkpoint {ckpt} (resume with --load {save})"
    else:
        saved = "last checkpoint: none" + ("" if save else " (no --save)")
    return f"[metp] interrupted (Ctrl-C) {where}; {saved}"


# ------------------------------------------------------------------------------------------
# metp plan (one process, fake tensors and the fake process group: no launcher)


@subcommand("plan", "per-rank memory, communication and estimated step time at full scale")
def _plan_parser(p: argparse.ArgumentParser) -> Callable:
    from megatron_metp.measure import plan_report

    plan_report.add_arguments(p)
    return lambda args, explicit, argv: plan_report.run(args)


# ------------------------------------------------------------------------------------------
# metp bench (real backend; launches its ranks like train)


@subcommand("bench", "memory, communication and overlapped/serialised step time per mode")
def _bench_parser(p: argparse.ArgumentParser) -> Callable:
    from megatron_metp.measure import bench

    bench.add_arguments(p)
    return lambda args, explicit, argv: bench.main(args, argv)


# ------------------------------------------------------------------------------------------


class _OneLineParser(argparse.ArgumentParser):
    """argparse with its errors on one line (the flag and the fix), exit status 2."""

    def error(self, message: str):
        self.exit(2, f"{self.prog}: error: {message} (see {self.prog} --help)\n")


def build_parser(command: Optional[str] = None
                 ) -> Tuple[argparse.ArgumentParser, Dict[str, Callable]]:
    """The ``metp`` parser. With ``command``, only that subcommand's flags are built (the others
    import measurement code that a training run, or its error message, does not need); with
    ``""`` (``metp --help``, no subcommand named), none: the names and one-line help need no
    imports; with None, every subcommand's."""
    parser = _OneLineParser(prog="metp", description=__doc__.split("\n")[0])
    subs = parser.add_subparsers(dest="command", required=True)
    runners = {}
    for name, (help_text, fn) in _SUBCOMMANDS.items():
        sub = subs.add_parser(name, help=help_text)
        if command is None or command == name:
            runners[name] = fn(sub)
    return parser, runners


def _config_hint(command: str, unknown: List[str]) -> str:
    """Model-shape flags of Megatron-LM are config keys in ``metp train``: say so."""
    if command != "train":
        return ""
    from megatron_metp.models.config import ALL_KEYS

    keys = [k for k in (u.split("=", 1)[0].lstrip("-").replace("-", "_") for u in unknown
                        if u.startswith("--")) if k in ALL_KEYS]
    if not keys:
        return ""
    one = len(keys) == 1
    return (f"; {', '.join(keys)} {'is a model setting' if one else 'are model settings'}: set "
            f"{'it' if one else 'them'} in a --config YAML (configs/*.yaml)")


def explicit_flags(argv: List[str]) -> set:
    """The ``--flags`` given on the command line (tells a user's value from a default)."""
    return {tok.split("=", 1)[0] for tok in argv if tok.startswith("--")}


def main(argv: Optional[List[str]] = None) -> int:
    argv = list(sys.argv[1:] if argv is None else argv)
    command = next((a for a in argv if not a.startswith("-")), None)
    parser, runners = build_parser(command if command in _SUBCOMMANDS else "")
    args, unknown = parser.parse_known_args(argv)
    if unknown:
        print(f"metp {args.command}: error: unrecognized arguments: {' '.join(unknown)}"
              f"{_config_hint(args.command, unknown)} (see metp {args.command} --help)",
              file=sys.stderr)
        return 2
    try:
        return runners[args.command](args, explicit_flags(argv), argv) or 0
    except ValueError as e:  # configuration errors: one clear line, no traceback
        rank = os.environ.get("RANK", "0")
        if rank == "0":
            print(f"metp {args.command}: error: {e}", file=sys.stderr, flush=True)
        return 2


if __name__ == "__main__":
    sys.exit(main())
