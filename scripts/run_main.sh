#!/usr/bin/env bash
# The README's main job: create ./.venv if needed (scripts/setup_env.sh; METP_VENV overrides the
# location), then train the default tiny GPT (configs/tiny-gpt.yaml: METP, TP 2 x DP 2, 60
# iterations) on 4 CPU ranks with gloo, or on every GPU with NCCL when CUDA is present.
# Extra arguments go to `metp train`, e.g. `--compare tp,metp,wallfacer`.
set -euo pipefail
cd "$(dirname "$0")/.."
bash scripts/setup_env.sh
exec "${METP_VENV:-.venv}/bin/metp" train "$@"
