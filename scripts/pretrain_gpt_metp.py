#!/usr/bin/env python
"""Megatron-LM's ``pretrain_gpt.py`` with ``--tensor-parallel-mode {tp,metp,wallfacer}``, no patch.

Usage (a Megatron-LM checkout at tag core_v0.16.1; every pretrain_gpt.py flag works)::

    MEGATRON_LM_PATH=/path/to/Megatron-LM torchrun --nproc-per-node 8 \\
        scripts/pretrain_gpt_metp.py --tensor-parallel-mode metp \\
        --tensor-model-parallel-size 8 --sequence-parallel ...

What it does, in order:

1. imports Megatron-LM's ``pretrain_gpt`` module (its ``__main__`` block is guarded, so nothing
   runs) and reuses its dataset provider, ``forward_step``, ``model_provider``,
   ``gpt_builder`` and ``get_embedding_ranks``;
2. chains the plugin's ``extra_args_provider`` with the one pretrain_gpt.py would pass
   (ModelOpt's, when installed);
3. before Megatron initialises: parses the command line with Megatron-LM's own parser,
   applies the WallFacer mode remap, validates the whole configuration
   (``megatron_metp.validation``), and writes the remapped sizes into ``sys.argv``;
4. calls ``pretrain(...)`` exactly as pretrain_gpt.py's ``__main__`` does, with the plugin's
   model builder, which falls through to Megatron-LM's ``gpt_builder`` for ``tp``.

Megatron-LM's ``pretrain()`` needs CUDA; the argument path (steps 1-3) runs anywhere.
"""

from __future__ import annotations

import os
import sys
import time

_PROGRAM_START_TIME = time.time()


def import_pretrain_gpt():
    """Megatron-LM's ``pretrain_gpt`` module, from ``$MEGATRON_LM_PATH`` or ``sys.path``."""
    root = os.environ.get("MEGATRON_LM_PATH")
    if root:
        sys.path.insert(0, os.path.abspath(root))
    try:
        import pretrain_gpt
    except ImportError as e:
        raise SystemExit(
            f"cannot import Megatron-LM's pretrain_gpt ({e}): set MEGATRON_LM_PATH to a "
            f"Megatron-LM checkout at tag core_v0.16.1 (the directory holding pretrain_gpt.py)"
        ) from e
    return pretrain_gpt


def main(pretrain_gpt=None, parse=None) -> None:
    """``pretrain_gpt`` and ``parse`` replace Megatron-LM's module and argument parser in tests."""
    from functools import partial

    from megatron_metp import megatron_lm as metp_lm

    pg = pretrain_gpt or import_pretrain_gpt()
    provider = metp_lm.chain_providers(
        pg.add_modelopt_args if getattr(pg, "has_nvidia_modelopt", False) else None)
    try:
        if parse is None:
            metp_lm.prepare_argv(extra_args_provider=provider)
        else:
            metp_lm.prepare_argv(extra_args_provider=provider, parse=parse)
    except metp_lm.MetpConfigError as e:
        raise SystemExit(f"megatron-metp: {e}") from None

    pg.set_startup_timestamps(program_start=_PROGRAM_START_TIME, main_entry=time.time())
    # pretrain_gpt.py's __main__ sets this before pretrain() ("transition to core datasets").
    pg.train_valid_test_datasets_provider.is_distributed = True
    pretrain, store = pg.inprocess_restart.maybe_wrap_for_inprocess_restart(pg.pretrain)
    pretrain(
        pg.train_valid_test_datasets_provider,
        partial(pg.model_provider, metp_lm.make_gpt_builder(pg.gpt_builder)),
        pg.ModelType.encoder_or_decoder,
        pg.forward_step,
        args_defaults={"tokenizer_type": "GPT2BPETokenizer"},
        extra_args_provider=provider,
        store=store,
        get_embedding_ranks=pg.get_embedding_ranks,
    )


if __name__ == "__main__":
    main()
