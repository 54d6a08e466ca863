#!/usr/bin/env bash
# The test commands. Each creates the venv it needs (scripts/setup_env.sh).
#
#   bash scripts/run_tests.sh          the default tier: Python 3.11, megatron-core 0.16.1, every
#                                      test not marked `full` (~10 minutes on 2 cores)
#   bash scripts/run_tests.sh --full   the full tier, what CI runs (.ci/run): every test on
#                                      megatron-core 0.16.1 (Megatron-LM's own loop, real SLURM
#                                      jobs, the 8-rank and bisection cases included), then the
#                                      model, checkpoint, packed and Megatron-LM tests again on
#                                      megatron-core 0.19.2 / Python 3.12 (./.venv-mcore019);
#                                      tests/test_megatron_lm_training.py's launches on 0.19.2 only
#
# Extra arguments go to pytest (the first environment's run under --full).
# Megatron-LM's training loop runs where MEGATRON_LM_PATH (core_v0.16.1) and
# MEGATRON_LM_019_PATH (core_v0.19.0) name extracted trees; .ci/run extracts them from
# ../shared/megatron-lm. Without them those tests skip, saying why.
# The full tier first starts a one-node SLURM cluster (scripts/slurm/local_cluster.sh: installs
# Debian's slurm-wlm, root only) so that tests/test_slurm.py submits real sbatch jobs; if that is
# impossible those tests skip with the reason.
set -euo pipefail
cd "$(dirname "$0")/.."
FULL=0
if [ "${1:-}" = --full ]; then FULL=1; shift; fi
bash scripts/setup_env.sh
VENV=${METP_VENV:-.venv}
if [ "$FULL" = 0 ]; then
  exec "$VENV/bin/python" -m pytest -q -rs --durations=15 "$@"
fi

# The packages megatron.training imports (pyproject's megatron-lm extra).
megatron_lm_extra() {
  "$1/bin/python" -m pip --disable-pip-version-check -q install -e ".[megatron-lm]" 2>&1 \
    | { grep -v "is ignored: it is neither a file nor a directory" || true; }
}
T0=$(date +%s)
[ -n "${MEGATRON_LM_PATH:-}" ] && megatron_lm_extra "$VENV"
# The second environment installs (mostly downloads) while the first one's tests run; after
# the first one's installs, so that no two pip builds of this tree overlap.
mkdir -p out
bash scripts/setup_env.sh mcore019 > out/setup_mcore019.log 2>&1 &
SETUP19=$!
# The daemons this run starts are stopped when it ends (a cluster already running is left be).
SLURM_UP=$(timeout 300 bash scripts/slurm/local_cluster.sh start 2>&1) || SLURM_UP+=$'\n'\
"run_tests.sh: no local SLURM cluster; tests/test_slurm.py will skip its real jobs"
echo "$SLURM_UP"
case "$SLURM_UP" in
  *"already running"*) ;;
  *) trap 'bash scripts/slurm/local_cluster.sh stop > /dev/null 2>&1 || true' EXIT ;;
esac
echo "=== full tier, 1 of 2: $VENV, every test (-m '') ==="
RC1=0
# tests/test_megatron_lm_training.py's launches (the GPT and LLaMA runs in every mode, the
# resumes, the checkpoint matrix: 12 launches, ~100 s here) run on 0.19.2 only, the release
# users run. Here Megatron-LM core_v0.16.1's loop runs through the README's pretrain_gpt.py
# blocks (tests/test_docs_commands.py: metp TP 2 x DP 2 through the no-patch route, a tp save
# resumed under metp) and the bad-flag refusals; the patch applies to it (patches/README.md).
MLT=tests/test_megatron_lm_training.py
"$VENV/bin/python" -m pytest -q -rs --durations=25 -m "" \
  --deselect $MLT::test_modes_train_alike_in_megatron_lm_s_loop \
  --deselect $MLT::test_llama_modes_train_alike_in_megatron_lm_s_loop \
  --deselect $MLT::test_resume_from_a_tp_checkpoint_under_metp_and_wallfacer \
  --deselect $MLT::test_checkpoints_move_between_modes_bit_for_bit \
  --deselect $MLT::test_training_log_reports_tflops_in_every_mode \
  "$@" || RC1=$?
T1=$(date +%s)

echo "=== full tier, 2 of 2: megatron-core 0.19.2 on Python 3.12 ==="
RC2=0
wait "$SETUP19" || RC2=$?
cat out/setup_mcore019.log
if [ "$RC2" != 0 ]; then
  echo "run_tests.sh --full: scripts/setup_env.sh mcore019 failed (rc $RC2): see above" >&2
  exit 1
fi
V19=.venv-mcore019
if [ -n "${MEGATRON_LM_019_PATH:-}" ]; then megatron_lm_extra "$V19"; fi
# What 0.19 changes under the plugin: the layer specs' constructor keywords, DDP and the
# optimizer's CUDA calls, get_batch_on_this_cp_rank, Megatron-LM's initialisation and its
# training loop. So: the model-level parity tests (tp / metp / wallfacer against fp64 and against
# Megatron's own layers), checkpoint names and checkpoints across modes and p, packed batches,
# metp train, the CPU stand-ins, and Megatron-LM core_v0.19.0's pretrain_gpt.py.
# metp train on 0.19: the mode comparison (tp / metp / wallfacer with CP, where 0.19's
# get_batch_on_this_cp_rank changed) and the composition (DP, PP, CP); its other tests exercise
# the trainer, not the release. METP's model at p = 8 repeats p = 2 and 4's claim. Checkpoints
# across modes and sizes on 0.19: Megatron-LM's checkpoint matrix (tp TP 1 <-> metp TP 2,
# wallfacer CP 2, bit for bit, through pretrain_gpt.py) and checkpoint keys.
MEGATRON_LM_PATH="${MEGATRON_LM_019_PATH:-}" "$V19/bin/python" -m pytest -q -rs --durations=15 \
  -m "" --deselect "tests/test_metp_model.py::test_metp_model_equals_tp_model[8]" \
  --deselect tests/test_wallfacer_model.py::test_wallfacer_composes_with_tensor_parallelism \
  tests/test_layers.py tests/test_tp_baseline.py tests/test_metp_model.py \
  tests/test_wallfacer_model.py tests/test_checkpoint_keys.py tests/test_checkpoint_damage.py \
  tests/test_packed.py tests/test_cpu_compat.py \
  tests/test_train.py::test_compare_modes_agree \
  tests/test_train.py::test_composition_matches_the_smaller_layout \
  tests/test_megatron_lm_releases.py tests/test_megatron_lm_training.py || RC2=$?
T2=$(date +%s)
echo "run_tests.sh --full: megatron-core 0.16.1 rc $RC1 in $((T1 - T0)) s;" \
     "megatron-core 0.19.2 rc $RC2 in $((T2 - T1)) s (venv included)"
[ "$RC1" = 0 ] && [ "$RC2" = 0 ]
