#!/usr/bin/env bash
# The test command: create the venv if needed, then run the CPU test suite on gloo.
#
# Under CI (CI=true) or with METP_TEST_SLURM=1, first start a one-node SLURM cluster
# (scripts/slurm/local_cluster.sh: installs Debian's slurm-wlm, root only) so that
# tests/test_slurm.py submits a real sbatch job; if that is impossible the test skips with the
# reason and the rest of the suite runs as usual.
set -euo pipefail
cd "$(dirname "$0")/.."
bash scripts/setup_env.sh
if [ -n "${MEGATRON_LM_PATH:-}" ]; then
  # tests/test_megatron_lm_training.py runs Megatron-LM's own pretrain_gpt.py: the packages its
  # megatron.training imports (pyproject's megatron-lm extra).
  "${METP_VENV:-.venv}/bin/python" -m pip --disable-pip-version-check -q install -e ".[megatron-lm]" \
    2>&1 | grep -v "is ignored: it is neither a file nor a directory" || true
fi
if [ "${CI:-}" = true ] || [ "${METP_TEST_SLURM:-0}" = 1 ]; then
  timeout 300 bash scripts/slurm/local_cluster.sh start \
    || echo "run_tests.sh: no local SLURM cluster; tests/test_slurm.py will skip its real job"
fi
exec "${METP_VENV:-.venv}/bin/python" -m pytest -q -rs --durations=25 "$@"
