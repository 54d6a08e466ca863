"""megatron-metp: METP and WallFacer long-sequence parallelism for Megatron-Core.

Sub-packages
    comm/        ring communicators (post / commit / wait), double buffers
    metp/        weight-ring MLP (Alg. 1-2), ring attention (Alg. 3-4), two-level MHA (Alg. 5-6)
    wallfacer/   multi-ring attention, configuration generator, topology scheduler, zigzag
    measure/     memory tracker, communication counter, analytic formulas, planner, timeline
    training/    the ``metp`` command and its trainer (not imported by the plugin)
"""

__version__ = "0.2.0"
