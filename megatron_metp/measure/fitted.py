"""The GPU model's fitted inputs: the defaults of every ESTIMATE (``timeline.py`` states how each
is used; ``docs/calibration/README.md`` holds the measurement they come from: one H200, LLaMA-7B's
layer as rank 7 of 8 at 4k, 32k and 128k, stock tp and METP, communication stubbed).

A module of constants only, so that the planner's settings and the simulator share them without
importing each other.
"""

GEMM_EFFICIENCY = 0.75        # fraction of bf16 peak for GEMMs and other FLOP-counted ops
ATTENTION_EFFICIENCY = 0.66   # fraction of bf16 peak for fused attention kernels (cuDNN's)
HOST_OP_US = 30.0             # host microseconds to issue one traced op
