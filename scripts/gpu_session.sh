#!/usr/bin/env bash
# A lent GPU's checks as one prepared run (docs/calibration/README.md), using what it finds:
#   every machine   the GPU tier (kernels against fp64, GQA at s in {1, 7, 100, 4095} with
#                   d = 128, the no-sync training step), the elementwise bandwidth, and the
#                   calibration layer (`metp bench --calibrate`, LLaMA-7B rank 7 of p = 8);
#   2+ GPUs         the GPU tier's NCCL rings in bf16 against fp64 and METP / WallFacer layers
#                   (tests/test_gpu.py), a 20-step `metp train --compare tp,metp,wallfacer`
#                   with the distributed optimizer and both overlap flags, and `metp bench`
#                   of METP against stock.
# Everything lands in $OUT (default out/gpu): run.log and the JSON files.
#
#   bash scripts/gpu_session.sh
#
# It uses the python3 that holds a CUDA torch, as found, and installs nothing from the network:
# wheels in .whl/ are installed into /tmp/site first, e.g. megatron-core for a Python 3.12
# machine without network, fetched beforehand on one with it:
#   python3 -m pip download --no-deps --only-binary=:all: --python-version 3.12 \
#     --platform manylinux_2_28_x86_64 -d .whl megatron-core==0.19.2
# Each step has its own time limit, most informative first, and the whole run stops at
# DEADLINE_S (default 480 s): a step that would pass it gets what is left, or is skipped with
# a line saying so, so a run cut short still reports what it finished.
set -u
cd "$(dirname "$0")/.."
OUT=${OUT:-out/gpu}
mkdir -p "$OUT"
export PYTHONUNBUFFERED=1 PYTHONWARNINGS=ignore
if ls .whl/*.whl >/dev/null 2>&1; then
  python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade \
    --target /tmp/site .whl/*.whl || exit 1
  export PYTHONPATH=/tmp/site:$PWD
else
  export PYTHONPATH=$PWD
fi
exec > >(tee "$OUT/run.log") 2>&1
T0=$(date +%s)
DEADLINE_S=${DEADLINE_S:-480}
step() {
  local limit=$1 t rc left
  shift
  t=$(date +%s)
  left=$(( DEADLINE_S - (t - T0) ))
  if [ "$left" -lt 15 ]; then
    echo "=== [$(( t - T0 )) s] skipped (the run's ${DEADLINE_S} s are spent): $*"
    return
  fi
  [ "$limit" -gt "$left" ] && limit=$left
  echo "=== [$(( t - T0 )) s] $* (limit ${limit} s)"
  timeout "$limit" "$@"
  rc=$?
  echo "=== rc $rc in $(( $(date +%s) - t )) s"
}
nvidia-smi --query-gpu=name,memory.total,driver_version --format=csv,noheader
step 60 python3 -c "import sys, torch, megatron.core as m; print('Python', sys.version.split()[0], '| torch', torch.__version__, '| megatron-core', m.__version__, '|', torch.cuda.get_device_name(), '| cuDNN', torch.backends.cudnn.version())"
step 200 python3 -m pytest -q -rs --durations=8 tests/test_gpu.py tests/test_kernels.py tests/test_host_reads.py
N_GPU=$(python3 -c "import torch; print(torch.cuda.device_count())" 2>/dev/null || echo 0)
METP="python3 -m megatron_metp.training.cli"
if [ "$N_GPU" -ge 2 ]; then
  # Each mode 20 steps on 2 GPUs (tp / metp TP 2, wallfacer P 2), the same seed and data, with
  # Megatron-Core's distributed optimizer and DDP's overlapped reduce and gather.
  step 150 $METP train --nproc-per-node 2 --tensor-model-parallel-size 2 --compare tp,metp,wallfacer --train-iters 20 --bf16 --use-distributed-optimizer --overlap-grad-reduce --overlap-param-gather --no-progress --log-json "$OUT/train_compare.jsonl"
  step 90 $METP bench --nproc-per-node 2 --modes tp,metp --seq-lengths 4096,16384 --bf16 --iters 3 --json "$OUT/bench_2gpu.json"
fi
step 45 python3 scripts/elementwise_bandwidth.py --json "$OUT/elementwise.json"
CAL="$METP bench --calibrate --calibrate-model llama-7b"
# METP's all-to-all attention (--metp-ring-pass a2a, auto's first choice), which no GPU has
# run yet: its layer at 32k and 128k, Q/K/V and fc1 saved (the exchanges are
# stubbed, as every calibration's communication is: compute only).
step 70 $CAL --calibrate-mode metp --calibrate-metp-ring-pass a2a --calibrate-metp-qkv-backward save+fc1 --seq-lengths 32768,131072 --iters 3 --calibrate-profile --json "$OUT/prof_metp_a2a.json"
# The short band: at 4k and 16k METP's MLP all-gathers its weights once
# (--metp-mlp-pass auto), 139 launches per layer instead of 301: the host time the model charges.
step 50 $CAL --calibrate-mode metp --calibrate-metp-ring-pass a2a --calibrate-metp-qkv-backward save+fc1 --seq-lengths 4096,16384 --iters 3 --json "$OUT/short_metp_a2a.json"
step 40 $CAL --calibrate-mode tp --seq-lengths 4096,16384 --iters 3 --json "$OUT/short_tp.json"
# 128k: the frontier's METP (whole pass, save+fc1) and stock's fastest fitting (TP 8 + SP with
# layernorm and mlp recompute), then each family's default; 32k beside them (stock fits there).
step 70 $CAL --calibrate-mode metp --calibrate-metp-ring-pass whole --calibrate-metp-qkv-backward save+fc1 --seq-lengths 32768,131072 --iters 3 --calibrate-profile --json "$OUT/prof_metp_save_fc1.json"
step 70 $CAL --calibrate-mode tp --calibrate-recompute-modules layernorm mlp --seq-lengths 131072 --iters 3 --calibrate-profile --json "$OUT/prof_tp_ln_mlp.json"
step 70 $CAL --calibrate-mode metp --seq-lengths 32768,131072 --iters 3 --calibrate-profile --json "$OUT/prof_metp.json"
# stock's plain layer: 32k (fits without recompute) and 256k (the 9 of 32 layers stock does not
# recompute there)
step 70 $CAL --calibrate-mode tp --seq-lengths 32768,262144 --iters 3 --calibrate-profile --json "$OUT/prof_tp.json"
# 256k: the frontier's METP (whole pass, save, layernorm recompute) and stock's full recompute
# (the per-layer cost of the 23 of 32 layers stock recomputes there).
step 60 $CAL --calibrate-mode metp --calibrate-metp-ring-pass whole --calibrate-metp-qkv-backward save --calibrate-recompute-modules layernorm --seq-lengths 262144 --iters 3 --json "$OUT/fr_metp_256k.json"
step 60 $CAL --calibrate-mode tp --calibrate-recompute-full --seq-lengths 262144 --iters 3 --json "$OUT/fr_tp_full_256k.json"
echo "=== done in $(( $(date +%s) - T0 )) s"
