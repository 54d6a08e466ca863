#!/usr/bin/env bash
# Create (or reuse) a venv and install megatron-metp into it.
#
#   bash scripts/setup_env.sh            ./.venv: Python 3.11 (python3), torch 2.13.0 (the CPU
#                                         wheel where CUDA is absent), megatron-core 0.16.1
#   bash scripts/setup_env.sh mcore019   ./.venv-mcore019: Python 3.12, torch 2.14.1,
#                                         megatron-core 0.19.2 (the full tier's second environment)
#
# mcore019 pins: megatron-core 0.19.2 is PyPI's newest 0.19 release and the one whose training
# loop ../shared's Megatron-LM core_v0.19.0 drives (same minor release; 0.19.x changed no
# megatron.training entry point the plugin hooks). torch 2.14.1 is the newest release this
# machine's pip constraints allow; PyPI has only its CUDA build for Linux (~850 MB, a 5.5 GB
# venv), which runs on the CPU. On Python 3.11, no install may pull a CUDA build: torch is pinned
# to the CPU wheel first, so that no later requirement can.
# Override the interpreter with PYTHON=..., the venv with METP_VENV=...
set -euo pipefail
cd "$(dirname "$0")/.."
if [ "${1:-}" = mcore019 ]; then
  PY=${PYTHON:-}
  if [ -z "$PY" ]; then
    # (pyenv's python3.12 shim exists but fails when 3.12 is not selected: ask each candidate)
    for cand in python3.12 /root/.pyenv/versions/3.12.1/bin/python3; do
      if "$cand" -c 'import sys; assert sys.version_info[:2] == (3, 12)' >/dev/null 2>&1; then
        PY=$cand; break
      fi
    done
  fi
  if [ -z "$PY" ]; then
    echo "setup_env.sh mcore019: no Python 3.12 found; set PYTHON=/path/to/python3.12" >&2
    exit 2
  fi
  VENV=${METP_VENV:-.venv-mcore019}
  TORCH=torch==2.14.1
  MCORE=megatron-core==0.19.2
else
  PY=${PYTHON:-python3}
  VENV=${METP_VENV:-.venv}
  TORCH=torch==2.13.0
  MCORE=
fi
if [ ! -x "$VENV/bin/python" ]; then
  "$PY" -m venv "$VENV"
fi
PIP="$VENV/bin/python -m pip --disable-pip-version-check -q"
quiet() { { grep -v "is ignored: it is neither a file nor a directory" || true; }; }
if ! "$VENV/bin/python" -c "import torch" 2>/dev/null; then
  if command -v nvidia-smi >/dev/null 2>&1 && [ -z "$MCORE" ]; then
    $PIP install "torch>=2.4" 2>&1 | quiet
  else
    $PIP install "$TORCH" 2>&1 | quiet
  fi
fi
if [ -n "$MCORE" ]; then
  $PIP install "$MCORE" 2>&1 | quiet
fi
# Reinstall only when pyproject.toml changed since the last install (an editable install needs
# nothing else): pip's resolver alone takes 20-50 s.
STAMP="$VENV/.metp-installed"
if [ ! -f "$STAMP" ] || ! cmp -s pyproject.toml "$STAMP"; then
  rm -f "$STAMP"
  $PIP install -e ".[test]" 2>&1 | quiet
  cp pyproject.toml "$STAMP"
fi
# The versions from the installed metadata: importing megatron.core to print them took ~5 s of
# every run_main.sh / run_tests.sh call (torch's import is checked above, the plugin's here).
PYTHONWARNINGS=ignore "$VENV/bin/python" -c "import sys, megatron_metp; from importlib.metadata import version as v; print('$VENV: Python', sys.version.split()[0], '| torch', v('torch'), '| megatron-core', v('megatron-core'))" 2>&1 | quiet
