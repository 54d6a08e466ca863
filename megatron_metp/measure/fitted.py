"""The GPU model's fitted inputs: the defaults of every ESTIMATE (``timeline.py`` states how each
is used; ``docs/calibration/README.md`` holds the measurements they come from: LLaMA-7B's layer
as rank 7 of 8, stock tp and METP, communication stubbed; one H200 at 4k, 32k and 128k, then
H100s at 32k-256k).

A module of constants only, so that the planner's settings and the simulator share them without
importing each other.
"""

# Fraction of bf16 peak for GEMMs and other FLOP-counted ops, fitted to the two H100
# measurements' GEMM classes at 128k (0.84-0.88: stock 0.876 / 0.872, METP 0.861 / 0.840; mean
# 0.862). METP's GEMMs are whole-token GEMMs, as fast as stock's, so one figure serves both.
GEMM_EFFICIENCY = 0.86
ATTENTION_EFFICIENCY = 0.66   # fraction of bf16 peak for fused attention kernels (cuDNN's)
HOST_OP_US = 30.0             # host microseconds to issue one traced op
MEM_EFFICIENCY = 0.8          # fraction of HBM bandwidth for the other ops (dense copies: 0.80)
# Fraction of HBM bandwidth for element-wise ops on strided or broadcast operands
# (``op_trace.is_strided``: TensorIterator's unvectorised kernel): fitted to the fourth
# measurement's 128k profiles, stock's and METP's, by op and shapes: the 20 such
# op groups that both the trace and the profile hold, 10.41 ms ESTIMATED at 0.8 against 13.80
# ms measured (0.8 / 1.326 = 0.60). METP's online-softmax merges and ring accumulators are such
# ops, and RoPE's products in both families.
STRIDED_MEM_EFFICIENCY = 0.60

# How much faster than stock's fastest fitting configuration a plugin family must be ESTIMATED
# before ``--tensor-parallel-mode auto`` leaves stock for it (``measure.auto``). Not a fitted
# input of the model but its measured error: on the third calibration (an H100, with the op
# trace's view fix and the fake process group's copies left out; docs/calibration/README.md)
# the model favoured METP by 6 % on the frontier's own 128k and 256k configurations and by 8 %
# at 32k, per rank; on the fourth (H100s, after METP's non-GEMM cuts of 9a825ed) by 5 % and 6 %
# at 128k and 256k (the second, on an H200 without those fixes: 6-7 %, and 8-16 % on the
# default layers). Refitted to those H100 measurements (GEMM_EFFICIENCY, STRIDED_MEM_EFFICIENCY
# above), the model still favours METP by 2.9 % and 4.9 % on the same layers, and the
# measured devices ran no Transformer Engine. A lead inside that is not a lead; 10 % covers
# the configurations auto chooses between, and is kept until a GPU measures the refit.
AUTO_LEAD_MARGIN = 1.10
