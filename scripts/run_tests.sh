#!/usr/bin/env bash
# The test command: create the venv if needed, then run the CPU test suite on gloo.
set -euo pipefail
cd "$(dirname "$0")/.."
bash scripts/setup_env.sh
exec .venv/bin/python -m pytest -q -rs "$@"
