#!/usr/bin/env bash
# The README's main job: create ./.venv if needed, then train the default tiny GPT
# (configs/tiny-gpt.yaml: METP, TP 2 x DP 2) on 4 CPU ranks with gloo (NCCL and every GPU
# when CUDA is present). Extra arguments go to `metp train`, e.g. `--compare tp,metp,wallfacer`.
set -euo pipefail
cd "$(dirname "$0")/.."
bash scripts/setup_env.sh
exec .venv/bin/metp train "$@"
