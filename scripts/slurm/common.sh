# Shared by metp_train.sbatch and pretrain_gpt.sbatch (sourced, not run).
#
# One node = one `srun` task running one `torchrun`, which starts NPROC_PER_NODE ranks and finds
# the other nodes through a c10d rendezvous on the first node of the allocation. Every setting is
# an environment variable with a default; pass them on the sbatch line (`MODE=wallfacer TP=8
# sbatch ...`; sbatch exports the submitting environment) or export them first.
#
# Parallel layout (Megatron-LM flag names in brackets)
#   MODE        tp | metp | wallfacer                      [--tensor-parallel-mode]
#   TP          tensor-parallel size; for wallfacer with CP=1 the WallFacer size P
#                                                          [--tensor-model-parallel-size]
#   CP          context-parallel size                      [--context-parallel-size]
#   PP          pipeline-parallel size                     [--pipeline-model-parallel-size]
#   SP          1 = --sequence-parallel (default: 1 for tp/metp when TP > 1, 0 for wallfacer)
#   TEAM_SIZE   WallFacer team size C or auto              [--wallfacer-team-size]
#   PLACEMENT   team-consecutive | ring-consecutive        [--wallfacer-placement]
#   (data parallelism is what is left: nodes x NPROC_PER_NODE / (TP x CP x PP))
# Model and training
#   CONFIG      configs/<model>.yaml or a model name (relative to METP_ROOT)
#   SEQ_LENGTH MICRO_BATCH_SIZE GLOBAL_BATCH_SIZE TRAIN_ITERS LR   (empty = the config's value)
#   BF16=1  SAVE  LOAD  SAVE_INTERVAL  TIMEOUT_MINUTES  EXTRA_ARGS (appended verbatim)
# Time limit (see "time limit" below)
#   REQUEUE     1 = requeue the job when it stops for its time limit (default: 1 when SAVE is set)
#   EXIT_MARGIN_MINUTES  metp train saves and exits this long before the limit (default 5)
#   MAX_REQUEUES         requeue at most this many times (default 20)
# Machine
#   CLUSTER     h100 | a100 | cpu   NCCL settings and ranks per node (NPROC_PER_NODE overrides)
#   PYTHON      the Python with megatron_metp installed, on every node (default: METP_ROOT's
#               .venv/bin/python, made by scripts/setup_env.sh, else python on PATH)
#   METP_ROOT   this repository (default: the sbatch submit directory)
#   MASTER_PORT rendezvous port on the first node (default 29500)
#   DRY_RUN=1   print the environment and the command instead of running it (after the same
#               checks; NODES=N stands for sbatch's --nodes there)

set -euo pipefail

MODE=${MODE:-metp}
TP=${TP:-8}
CP=${CP:-1}
PP=${PP:-1}
if [ -z "${SP:-}" ]; then
    if [ "$MODE" != wallfacer ] && [ "$TP" -gt 1 ]; then SP=1; else SP=0; fi
fi
TEAM_SIZE=${TEAM_SIZE:-1}
PLACEMENT=${PLACEMENT:-team-consecutive}
CONFIG=${CONFIG:-llama-7b}
BF16=${BF16:-$([ "${CLUSTER:-h100}" = cpu ] && echo 0 || echo 1)}
TIMEOUT_MINUTES=${TIMEOUT_MINUTES:-10}
CLUSTER=${CLUSTER:-h100}
if [ -z "${PYTHON:-}" ]; then
    if [ -x "$METP_ROOT/.venv/bin/python" ]; then PYTHON=$METP_ROOT/.venv/bin/python; else PYTHON=python; fi
fi
DRY_RUN=${DRY_RUN:-0}
EXTRA_ARGS=${EXTRA_ARGS:-}
cd "$METP_ROOT"

# --- cluster profiles ---------------------------------------------------------------------------
case "$CLUSTER" in
    h100|a100)
        NPROC_PER_NODE=${NPROC_PER_NODE:-8}
        # Megatron-LM asserts this when TP or CP > 1 on pre-Blackwell GPUs: one hardware queue
        # keeps its communication kernels ordered ahead of the GEMMs they overlap with.
        export CUDA_DEVICE_MAX_CONNECTIONS=1
        # A rank that fails or is killed tears the job down instead of leaving the rest blocked
        # in a collective until the (long) NCCL timeout.
        export TORCH_NCCL_ASYNC_ERROR_HANDLING=1
        export NCCL_DEBUG=${NCCL_DEBUG:-WARN}
        if [ "$CLUSTER" = h100 ]; then
            # NVLink SHARP: in-switch reductions on NVSwitch HGX H100 (NCCL >= 2.17).
            export NCCL_NVLS_ENABLE=${NCCL_NVLS_ENABLE:-1}
        else
            # A100 NVSwitch has no NVLS; skip its probe.
            export NCCL_NVLS_ENABLE=0
        fi
        # Site-specific (no default): export NCCL_SOCKET_IFNAME / NCCL_IB_HCA before sbatch.
        ;;
    cpu)
        NPROC_PER_NODE=${NPROC_PER_NODE:-2}
        export OMP_NUM_THREADS=${OMP_NUM_THREADS:-1}
        # Megatron-LM's argument check asserts it whenever TP or CP > 1, on a CPU too.
        export CUDA_DEVICE_MAX_CONNECTIONS=1
        ;;
    *) echo "CLUSTER=$CLUSTER: choose h100, a100 or cpu" >&2; exit 2 ;;
esac

# --- rendezvous -----------------------------------------------------------------------------------
# Outside an allocation (DRY_RUN), NODES stands for sbatch's --nodes.
NNODES=${SLURM_JOB_NUM_NODES:-${SLURM_NNODES:-${NODES:-1}}}
if [ -n "${SLURM_JOB_NODELIST:-}" ]; then
    MASTER_ADDR=$(scontrol show hostnames "$SLURM_JOB_NODELIST" | head -n1)
else
    MASTER_ADDR=$(hostname)
fi
MASTER_PORT=${MASTER_PORT:-29500}
RDZV_ID=${SLURM_JOB_ID:-metp-dry-run}${SLURM_RESTART_COUNT:+-r$SLURM_RESTART_COUNT}

# --- time limit ------------------------------------------------------------------------------------
# Under SLURM this shell does not exec the step: it waits for it, so that the USR1 of
# `#SBATCH --signal=B:USR1@300` (five minutes before the limit) reaches its trap, which sends
# SIGTERM to the step; srun passes it to torchrun, torchrun to the ranks, and the ranks
# (--exit-signal-handler) finish the iteration, save and exit. metp train also gets
# --exit-duration-in-mins (the time left minus EXIT_MARGIN_MINUTES) and stops by itself first.
# Then, with REQUEUE=1, a run that stopped for time (and did not finish) goes back to the queue
# (`scontrol requeue`, `#SBATCH --requeue`) and resumes from SAVE.
REQUEUE=${REQUEUE:-$([ -n "${SAVE:-}" ] && echo 1 || echo 0)}
EXIT_MARGIN_MINUTES=${EXIT_MARGIN_MINUTES:-5}
MAX_REQUEUES=${MAX_REQUEUES:-20}
STOP_REQUESTED=0
STEP_PID=

# Whole minutes this job has left ("" without a time limit or outside SLURM).
minutes_left() {
    [ -n "${SLURM_JOB_ID:-}" ] || return 0
    local left d=0 h=0 m=0
    left=$(squeue -h -j "$SLURM_JOB_ID" -o %L 2>/dev/null) || return 0
    case "$left" in *[!0-9:-]*|"") return 0 ;; esac       # UNLIMITED, NOT_SET, INVALID
    if [[ $left == *-* ]]; then d=${left%%-*}; left=${left#*-}; fi
    IFS=: read -r -a f <<<"$left"
    case ${#f[@]} in
        3) h=${f[0]}; m=${f[1]} ;;
        2) m=${f[0]} ;;
    esac
    echo $(( 10#$d * 1440 + 10#$h * 60 + 10#$m ))
}

_on_time_limit() {
    STOP_REQUESTED=1
    echo "[metp-slurm] SIGUSR1: the time limit is near; asking the ranks to save and stop"
    # SIGTERM to the step's tasks (torchrun, which passes it to the ranks). Not to srun: srun
    # answers a SIGTERM by cancelling the step, which kills the ranks before they save.
    local step
    for step in $(squeue -h -s -j "$SLURM_JOB_ID" -o %i 2>/dev/null | grep -E '\.[0-9]+$'); do
        scancel --signal=TERM "$step" 2>/dev/null || true
    done
    return 0
}

# After the step: requeue when it stopped for time without finishing (REQUEUE=1).
_after_step() {
    local rc=$1 progress="${SAVE:-/nonexistent}/metp_progress.json" for_time=$STOP_REQUESTED
    grep -qE '"exit": "(duration|signal)"' "$progress" 2>/dev/null && for_time=1
    if grep -q '"finished": true' "$progress" 2>/dev/null; then for_time=0; fi
    if [ "$for_time" = 1 ] && [ "$REQUEUE" = 1 ]; then
        if [ "${SLURM_RESTART_COUNT:-0}" -ge "$MAX_REQUEUES" ]; then
            echo "[metp-slurm] stopped for time, but requeued $MAX_REQUEUES times already:" \
                 "not again (raise MAX_REQUEUES)" >&2
            return 1
        fi
        echo "[metp-slurm] stopped for time at $(cat "$progress" 2>/dev/null || echo '?');" \
             "requeueing job $SLURM_JOB_ID (restart $(( ${SLURM_RESTART_COUNT:-0} + 1 )))"
        scontrol requeue "$SLURM_JOB_ID"
        return 0
    fi
    return "$rc"
}

# Flags shared by both entry points (Megatron-LM names).
parallel_flags() {
    PARALLEL_FLAGS=(--tensor-parallel-mode "$MODE" --tensor-model-parallel-size "$TP"
                    --context-parallel-size "$CP" --pipeline-model-parallel-size "$PP")
    [ "$SP" = 1 ] && PARALLEL_FLAGS+=(--sequence-parallel)
    if [ "$MODE" = wallfacer ]; then
        PARALLEL_FLAGS+=(--wallfacer-team-size "$TEAM_SIZE" --wallfacer-placement "$PLACEMENT")
    fi
    [ -n "${SEQ_LENGTH:-}" ] && PARALLEL_FLAGS+=(--seq-length "$SEQ_LENGTH")
    [ -n "${MICRO_BATCH_SIZE:-}" ] && PARALLEL_FLAGS+=(--micro-batch-size "$MICRO_BATCH_SIZE")
    [ -n "${GLOBAL_BATCH_SIZE:-}" ] && PARALLEL_FLAGS+=(--global-batch-size "$GLOBAL_BATCH_SIZE")
    [ -n "${TRAIN_ITERS:-}" ] && PARALLEL_FLAGS+=(--train-iters "$TRAIN_ITERS")
    [ -n "${LR:-}" ] && PARALLEL_FLAGS+=(--lr "$LR")
    [ "$BF16" = 1 ] && PARALLEL_FLAGS+=(--bf16)
    [ -n "${SAVE:-}" ] && PARALLEL_FLAGS+=(--save "$SAVE")
    # A requeued job resumes from its own newest checkpoint.
    if [ -z "${LOAD:-}" ] && [ "$REQUEUE" = 1 ]; then LOAD=${SAVE:-}; fi
    [ -n "${LOAD:-}" ] && PARALLEL_FLAGS+=(--load "$LOAD")
    # Both trainers (metp train, Megatron-LM) take SIGTERM as "finish the iteration, save, exit".
    PARALLEL_FLAGS+=(--exit-signal-handler)
    [ -n "${SAVE_INTERVAL:-}" ] && PARALLEL_FLAGS+=(--save-interval "$SAVE_INTERVAL")
    PARALLEL_FLAGS+=(--distributed-timeout-minutes "$TIMEOUT_MINUTES")
    return 0
}

# check_flags FLAGS...: the plugin's start-up checks (the messages of metp train and the
# Megatron-LM route) on this job's flags and world size, before srun, DRY_RUN included.
check_flags() {
    PYTHONWARNINGS=ignore "$PYTHON" -m megatron_metp.megatron_lm check "$CONFIG" \
        --world-size $(( NNODES * NPROC_PER_NODE )) -- "$@" >/dev/null || exit 2
}

# launch PROGRAM [ARGS...]: srun -> one torchrun per node -> NPROC_PER_NODE ranks of PROGRAM.
launch() {
    local cmd=(srun --nodes="$NNODES" --ntasks-per-node=1 --kill-on-bad-exit=1
               "$PYTHON" -m torch.distributed.run
               --nnodes="$NNODES" --nproc-per-node="$NPROC_PER_NODE"
               --rdzv-backend=c10d --rdzv-endpoint="$MASTER_ADDR:$MASTER_PORT"
               --rdzv-id="$RDZV_ID" --max-restarts=0 "$@")
    # shellcheck disable=SC2206  # EXTRA_ARGS is a flag list, split on purpose
    [ -n "$EXTRA_ARGS" ] && cmd+=($EXTRA_ARGS)
    echo "[metp-slurm] nodes=$NNODES ranks/node=$NPROC_PER_NODE mode=$MODE TP=$TP CP=$CP PP=$PP" \
         "SP=$SP cluster=$CLUSTER rendezvous=$MASTER_ADDR:$MASTER_PORT python=$PYTHON"
    if [ "$DRY_RUN" = 1 ]; then
        env | grep -E '^(NCCL_|TORCH_NCCL_|CUDA_DEVICE_MAX|OMP_NUM_THREADS|MEGATRON_LM_PATH)' \
            | sort | sed 's/^/export /'
        printf '%q ' "${cmd[@]}"; echo
    elif [ -n "${SLURM_JOB_ID:-}" ]; then
        trap _on_time_limit USR1
        "${cmd[@]}" &
        STEP_PID=$!
        local rc=0
        # A trapped signal interrupts `wait` (status > 128) while the step runs on: wait again.
        while :; do
            wait "$STEP_PID" && rc=0 || rc=$?
            [ "$rc" -gt 128 ] && kill -0 "$STEP_PID" 2>/dev/null && continue
            break
        done
        _after_step "$rc"
    else
        exec "${cmd[@]}"
    fi
}
