#!/usr/bin/env python
"""Megatron-LM's ``pretrain_gpt.py`` with ``--tensor-parallel-mode {tp,metp,wallfacer}``, no patch.

Usage (a Megatron-LM checkout, core_v0.16.1 to core_v0.19.x; every pretrain_gpt.py flag works)::

    MEGATRON_LM_PATH=/path/to/Megatron-LM torchrun --nproc-per-node 8 \\
        scripts/pretrain_gpt_metp.py --tensor-parallel-mode metp \\
        --tensor-model-parallel-size 8 --sequence-parallel ...

What it does, in order:

1. finds ``pretrain_gpt.py`` under ``$MEGATRON_LM_PATH`` and reads which entry points its
   ``__main__`` uses (``gpt_builder`` or ``gpt_config_from_args``);
2. wraps the hook points for that release (``megatron_metp.megatron_lm_hooks``): argument
   parsing (the plugin's flags, the WallFacer remap and validation, ``--yaml-cfg`` included),
   the layer-spec choice, and the plugin's groups after ``initialize_megatron``; a release
   whose entry points are missing stops here with a message naming it;
3. runs that ``pretrain_gpt.py`` as ``__main__``, unchanged.

Megatron-LM's ``pretrain()`` needs CUDA; the argument path runs anywhere.
"""

from __future__ import annotations

import runpy
import sys


def main() -> None:
    from megatron_metp import megatron_lm_hooks as hooks

    try:
        path = hooks.pretrain_gpt_path()
        with open(path) as f:
            plan = hooks.plan_hooks(hooks.main_names(f.read()), hooks.release_name())
        hooks.install(plan)
    except hooks.MetpConfigError as e:
        raise hooks.refuse(e) from None
    runpy.run_path(path, run_name="__main__")
    # Megatron-LM's pretrain() returns with its process groups alive: end them (a gloo group's
    # threads would meet interpreter shutdown and abort the rank).
    hooks.end_process_groups()


if __name__ == "__main__":
    sys.exit(main())
