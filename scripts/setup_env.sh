#!/usr/bin/env bash
# Create (or reuse) ./.venv and install megatron-metp into it.
# On a machine without CUDA, torch is pinned to the CPU wheel 2.13.0 first, so that no
# later requirement can pull a multi-GB CUDA build. Override the interpreter with PYTHON=...
set -euo pipefail
cd "$(dirname "$0")/.."
PY=${PYTHON:-python3}
VENV=${METP_VENV:-.venv}
if [ ! -x "$VENV/bin/python" ]; then
  "$PY" -m venv "$VENV"
fi
PIP="$VENV/bin/python -m pip --disable-pip-version-check -q"
if ! "$VENV/bin/python" -c "import torch" 2>/dev/null; then
  if command -v nvidia-smi >/dev/null 2>&1; then
    $PIP install "torch>=2.4"
  else
    $PIP install "torch==2.13.0"
  fi
fi
$PIP install -e ".[test]" 2>&1 | grep -v "is ignored: it is neither a file nor a directory" || true
"$VENV/bin/python" -c "import torch, megatron.core, megatron_metp; print('torch', torch.__version__, '| megatron-core', megatron.core.__version__)"
