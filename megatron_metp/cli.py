"""The ``metp`` command: ``metp train``, ``metp bench`` and ``metp plan``.

Adding a subcommand is one function decorated with :func:`subcommand`: it receives its
``argparse`` sub-parser, adds its flags, and returns the function that runs it::

    @subcommand("bench", "measure memory, communication and time per mode")
    def _bench(parser):
        parser.add_argument(...)
        return run_bench            # run_bench(args, explicit_flags) -> exit code

Distributed subcommands call :func:`launch_or_run`: under an existing launcher (``torchrun``
sets RANK/WORLD_SIZE; ``srun`` sets SLURM_PROCID/SLURM_NTASKS) the command runs in place;
otherwise it starts ``python -m torch.distributed.run --standalone`` with ``--nproc-per-node``
ranks (default: 4 on CPU with gloo, every visible GPU with NCCL) running the same command.
"""

from __future__ import annotations

import argparse
import os
import subprocess
import sys
from typing import Callable, Dict, List, Optional, Tuple

_SUBCOMMANDS: Dict[str, Tuple[str, Callable]] = {}


def subcommand(name: str, help: str):
    """Register ``fn(parser) -> runner`` as ``metp NAME``."""

    def deco(fn: Callable) -> Callable:
        _SUBCOMMANDS[name] = (help, fn)
        return fn

    return deco


# ------------------------------------------------------------------------------------------
# launching


def _slurm_env() -> bool:
    """Under ``srun`` with several tasks and no torchrun: take the ranks from SLURM."""
    if "SLURM_PROCID" not in os.environ or int(os.environ.get("SLURM_NTASKS", "1")) <= 1:
        return False
    if "MASTER_ADDR" not in os.environ or "MASTER_PORT" not in os.environ:
        raise ValueError("running under srun with several tasks: export MASTER_ADDR (the first "
                         "node's host name) and MASTER_PORT before srun, or run one task per "
                         "node that starts torchrun (see scripts/slurm/)")
    os.environ.setdefault("RANK", os.environ["SLURM_PROCID"])
    os.environ.setdefault("WORLD_SIZE", os.environ["SLURM_NTASKS"])
    os.environ.setdefault("LOCAL_RANK", os.environ.get("SLURM_LOCALID", "0"))
    return True


def under_launcher() -> bool:
    if "RANK" in os.environ and "WORLD_SIZE" in os.environ:
        return True
    return _slurm_env()


def default_nproc() -> int:
    import torch

    return torch.cuda.device_count() if torch.cuda.is_available() else 4


def launch_or_run(argv: List[str], nproc: Optional[int], run: Callable[[], int],
                  preflight: Optional[Callable[[int], None]] = None) -> int:
    """Run in place under a launcher; otherwise start ``nproc`` ranks of ``metp ARGV``.

    ``preflight(world_size)`` runs first in the launching process: a configuration error then
    fails once, before any rank starts.
    """
    if under_launcher():
        return run()
    n = default_nproc() if nproc is None else nproc
    if n < 1:
        raise ValueError(f"--nproc-per-node {n}: must be >= 1 (ranks to launch on this node)")
    if preflight is not None:
        preflight(n)
    cmd = [sys.executable, "-m", "torch.distributed.run", "--standalone",
           f"--nproc-per-node={n}", "-m", "megatron_metp.cli", *argv]
    env = dict(os.environ)
    # Several CPU ranks share the cores: one intra-op thread each avoids oversubscription.
    env.setdefault("OMP_NUM_THREADS", "1")
    print(f"[metp] launching {n} ranks: {' '.join(cmd[1:])}", flush=True)
    return run_process_group(cmd, env)


def run_process_group(cmd: List[str], env: dict, grace_s: float = 30.0) -> int:
    """Run ``cmd`` in a process group of its own and return its exit status; when it ends, for
    whatever reason, end every process left in that group.

    torchrun stops its ranks when one fails, but not what the ranks started: helper processes
    of a SIGKILLed or SIGTERMed rank (Megatron's checkpoint-writer Manager, multiprocessing's
    resource tracker) would live on with PPID 1. They stay in torchrun's process group, so a
    SIGKILL to the group takes them. SIGINT / SIGTERM / SIGHUP / SIGUSR1 sent to this launcher
    (Ctrl-C, ``scancel``, SLURM's ``--signal``) are passed to the whole group first, and the
    group has ``grace_s`` seconds to exit on its own.
    """
    import signal
    import time

    proc = subprocess.Popen(cmd, env=env, start_new_session=True)
    forwarded = (signal.SIGINT, signal.SIGTERM, signal.SIGHUP, signal.SIGUSR1)

    def forward(signum, _frame):
        try:
            os.killpg(proc.pid, signum)
        except ProcessLookupError:
            pass

    old = {sig: signal.signal(sig, forward) for sig in forwarded}
    try:
        while True:
            try:
                return proc.wait()
            except KeyboardInterrupt:  # pragma: no cover - SIGINT is forwarded above
                forward(signal.SIGINT, None)
    finally:
        for sig, handler in old.items():
            signal.signal(sig, handler)
        if proc.poll() is None:  # this launcher is leaving first (an exception): stop torchrun
            forward(signal.SIGTERM, None)
            deadline = time.monotonic() + grace_s
            while proc.poll() is None and time.monotonic() < deadline:
                time.sleep(0.1)
        try:
            os.killpg(proc.pid, signal.SIGKILL)  # whatever the run left behind
        except ProcessLookupError:
            pass
        if proc.poll() is None:
            proc.wait()


# ------------------------------------------------------------------------------------------
# metp train

MODES = ("tp", "metp", "wallfacer")


def mode_list(flag: str, allowed: Tuple[str, ...]) -> Callable[[str], List[str]]:
    """An argparse ``type`` for a comma-separated list of modes, naming ``flag`` on error."""

    def parse(value: str) -> List[str]:
        modes = [m.strip() for m in value.split(",") if m.strip()]
        if not modes or any(m not in allowed for m in modes):
            raise argparse.ArgumentTypeError(
                f"{flag} {value!r}: give a comma-separated list of {', '.join(allowed)}")
        return modes

    return parse


@subcommand("train", "train a GPT model with Megatron-Core under tp, metp or wallfacer")
def _train_parser(p: argparse.ArgumentParser) -> Callable:
    # Every default is None so that the model config's training defaults apply unless a flag is
    # given (megatron_metp.train.DEFAULTS holds the rest).
    a = p.add_argument
    a("--config", default="tiny-gpt",
      help="configs/<name>.yaml or a path (default tiny-gpt)")
    a("--tensor-parallel-mode", choices=MODES, default=None,
      help="tp (Megatron TP+SP), metp (METP weight rings), wallfacer (multi-ring attention)")
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
    a("--seq-length", type=int, default=None)
    a("--micro-batch-size", type=int, default=None)
    a("--global-batch-size", type=int, default=None)
    a("--lr", type=float, default=None)
    a("--min-lr", type=float, default=None)
    a("--lr-warmup-iters", type=int, default=None)
    a("--train-iters", type=int, default=None)
    a("--weight-decay", type=float, default=None)
    a("--clip-grad", type=float, default=None)
    a("--hidden-dropout", type=float, default=None)
    a("--attention-dropout", type=float, default=None)
    a("--recompute-granularity", choices=("selective",), default=None,
      help="Megatron's selective activation recompute (with --recompute-modules)")
    a("--recompute-modules", nargs="+", choices=("layernorm", "mlp", "core_attn"), default=None,
      help="what selective recompute recomputes in backward (Megatron-LM's flag; default "
           "core_attn); layernorm: the norm outputs, 2 bsh/p less per layer in every mode")
    a("--bf16", action="store_true", help="bf16 parameters and compute (GPU only)")
    a("--use-distributed-optimizer", action="store_true",
      help="shard optimizer state over data-parallel ranks (GPU only)")
    a("--seed", type=int, default=None)
    a("--data-path", default=None,
      help="Megatron indexed dataset PREFIX (PREFIX.bin/.idx); default: the shipped corpus")
    a("--vocab-size", type=int, default=None,
      help="tokenizer vocabulary of --data-path (default: the config's, else 258 bytes)")
    a("--make-vocab-size-divisible-by", type=int, default=None)
    a("--save", default=None, help="checkpoint directory (Megatron-Core dist_checkpointing)")
    a("--load", default=None, help="resume from the newest checkpoint in this directory")
    a("--save-interval", type=int, default=None)
    a("--distributed-timeout-minutes", type=int, default=None)
    a("--log-json", default=None, metavar="PATH",
      help="write one JSON object per iteration (iteration, loss, tokens/s, ...)")
    a("--no-progress", action="store_true", help="plain lines instead of a progress bar")
    a("--nproc-per-node", type=int, default=None,
      help="ranks to launch when not already under torchrun/srun (default: 4 on CPU, #GPUs)")

    def run(args: argparse.Namespace, explicit: set, argv: List[str]) -> int:
        # Flag values first: standard library only, so a bad value fails in well under a second.
        from megatron_metp.validation import check_paths, check_values

        check_values(args, trainer=True)
        check_paths(args)

        def in_rank() -> int:
            from megatron_metp import train

            train.run(args, explicit)
            return 0

        def check(world_size: int) -> None:
            from megatron_metp import train

            train.preflight(args, explicit, world_size)

        return launch_or_run(argv, args.nproc_per_node, in_rank, check)

    return run


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
    import measurement code that a training run, or its error message, does not need)."""
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
    from megatron_metp.config import ALL_KEYS

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
    parser, runners = build_parser(command if command in _SUBCOMMANDS else None)
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
