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
if [ "${CI:-}" = true ] || [ "${METP_TEST_SLURM:-0}" = 1 ]; then
  timeout 300 bash scripts/slurm/local_cluster.sh start \
    || echo "run_tests.sh: no local SLURM cluster; tests/test_slurm.py will skip its real job"
fi
exec "${METP_VENV:-.venv}/bin/python" -m pytest -q -rs "$@"
