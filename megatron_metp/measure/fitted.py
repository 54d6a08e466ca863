"""The GPU model's fitted inputs: the defaults of every ESTIMATE (``timeline.py`` states how each
is used; ``docs/calibration/README.md`` holds the measurement they come from: one H200, LLaMA-7B's
layer as rank 7 of 8 at 4k, 32k and 128k, stock tp and METP, communication stubbed).

A module of constants only, so that the planner's settings and the simulator share them without
importing each other.
"""

GEMM_EFFICIENCY = 0.75        # fraction of bf16 peak for GEMMs and other FLOP-counted ops
ATTENTION_EFFICIENCY = 0.66   # fraction of bf16 peak for fused attention kernels (cuDNN's)
HOST_OP_US = 30.0             # host microseconds to issue one traced op

# How much faster than stock's fastest fitting configuration a plugin family must be ESTIMATED
# before ``--tensor-parallel-mode auto`` leaves stock for it (``measure.auto``). Not a fitted
# input of the model but its measured error: on the third calibration (an H100, with the op
# trace's view fix and the fake process group's copies left out; docs/calibration/README.md)
# the model favoured METP by 6 % on the frontier's own 128k and 256k configurations and by 8 %
# at 32k, per rank; on the fourth (H100s, after METP's non-GEMM cuts of 9a825ed) by 5 % and 6 %
# at 128k and 256k (the second, on an H200 without those fixes: 6-7 %, and 8-16 % on the
# default layers). A lead inside that is not a lead; 10 % covers the configurations auto
# chooses between.
AUTO_LEAD_MARGIN = 1.10
