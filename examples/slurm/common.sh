# shellcheck shell=bash
# The shared body of the sbatch scripts in examples/slurm/. A model file sets
# its cluster and spare nodes, sources this file and calls deadpool_main with
# the name of its recipe, which reads the recipe, checks the settings, sets
# up the cluster's environment and starts one deadpool-launch per node with
# srun: the active nodes run the training ranks, the spare nodes warm spares,
# and the first node also the coordinator. SIGTERM from `#SBATCH --signal` before the time
# limit makes every rank save a checkpoint and stop (--exit-signal-handler);
# resubmitting the same script resumes from it (--load).
#
# A model file sets:
#   CLUSTER         perlmutter | vista | cpu
#   SPARE_NODES     warm spare nodes in the same job (its #SBATCH -N must be
#                   NODES + SPARE_NODES)
# and calls deadpool_main RECIPE "$@", RECIPE being one of
# tools/planning/recipes.py (python -m tools.recipe RECIPE prints it), which
# sets the rest; any of these that the model file sets wins over the
# recipe's:
#   NODES           active nodes
#   RANKS_PER_NODE  GPUs per node (processes per node on cpu)
#   TP, PP          tensor- and pipeline-parallel sizes (DP is what is left)
#   MICRO_BATCH, GLOBAL_BATCH, TRAIN_ITERS
#   MODEL_ARGS      array: the model's shape flags
#   TRAIN_ARGS      array: optimizer, schedule and logging flags
#   DATA_ARGS       array: data and tokenizer flags
#   MODEL           the planner's name for the shape
#                   (tools/planning/scale.py MODELS), which
#                   the dry run checks the flags against
# and SAVE_INTERVAL, the iterations between checkpoints, is 500 unless set.
# A shell's own variables of these names are not the job's: common.sh
# forgets them when it is sourced, so only the model file's count. At
# submission, through the environment (sbatch passes it on): RUN_DIR
# (checkpoints, metrics, events; default
# $SCRATCH/deadpool/<job name>, or runs/ without $SCRATCH), DATA (replaces
# DATA_ARGS, as one string: "--data-path PREFIX --tokenizer-type ..."), PYTHON
# (default .venv/bin/python, else python3), MODULES, HARDWARE (the dry run's
# node type, e.g. perlmutter-a100-80 for -C "gpu&hbm80g"), MASTER_PORT.
#
# Arguments of the script: --dry-run [--json] prints the layout (no Slurm, no
# GPU) and exits; any other argument goes to pretrain_gpt.py, after ours (so
# --global-batch-size 1024, say, wins over the recipe's).
set -euo pipefail
RECIPE_SETTINGS=(MODEL NODES RANKS_PER_NODE TP PP MICRO_BATCH GLOBAL_BATCH TRAIN_ITERS
    SAVE_INTERVAL MODEL_ARGS TRAIN_ARGS DATA_ARGS)
unset "${RECIPE_SETTINGS[@]}"

DEADPOOL_REPO=$(cd "$(dirname "${BASH_SOURCE[0]}")/../.." && pwd)
JOB_NAME=${SLURM_JOB_NAME:-$(basename "$0" .sh)}

die() {
    echo "$JOB_NAME: $*" >&2
    exit 2
}

require_int() {  # NAME MIN: the variable NAME is an integer >= MIN
    local value=${!1:-}
    [[ $value =~ ^[0-9]+$ ]] || die "$1 must be a whole number, not '$value'"
    ((value >= $2)) || die "$1 must be at least $2 (got $value)"
}

require_array() {
    [[ $(declare -p "$1" 2>/dev/null) == "declare -a"* ]] ||
        die "$1 must be set as an array, e.g. $1=(--flag value)"
}

# Every setting the model file leaves unset, from the
# recipe RECIPE: tools.recipe prints one "NAME VALUE..." line a setting, and
# the *_ARGS settings are arrays.
read_recipe() {
    local lines name values
    lines=$("$PYTHON" -m tools.recipe "$1") || exit 2
    while read -r name values; do
        if [[ -v $name ]]; then continue; fi
        if [[ $name == *_ARGS ]]; then
            read -ra "${name?}" <<<"$values"
        else
            printf -v "$name" %s "$values"
        fi
    done <<<"$lines"
}

check_settings() {
    case ${CLUSTER:-} in
        perlmutter | vista | cpu) ;;
        *) die "CLUSTER must be perlmutter, vista or cpu, not '${CLUSTER:-}'" ;;
    esac
    require_int NODES 1
    require_int SPARE_NODES 0
    require_int RANKS_PER_NODE 1
    local name
    for name in TP PP MICRO_BATCH GLOBAL_BATCH TRAIN_ITERS SAVE_INTERVAL; do
        require_int "$name" 1
    done
    for name in MODEL_ARGS TRAIN_ARGS DATA_ARGS; do require_array "$name"; done
    # One GPU per node and TP > 1 would put a tensor-parallel group across
    # nodes; the dry run says so too, but this is the cheap place to stop.
    ((RANKS_PER_NODE % TP == 0)) ||
        die "TP $TP does not divide RANKS_PER_NODE $RANKS_PER_NODE:" \
            "tensor parallelism must stay inside a node"
}

# The pretrain_gpt.py flags of the job, into the array TRAINING.
training_args() {
    local run_dir=$1
    shift
    TRAINING=("${MODEL_ARGS[@]}"
        --tensor-model-parallel-size "$TP" --pipeline-model-parallel-size "$PP"
        # A data-parallel replica fills whole nodes, so each rank's buddy
        # (a DP peer) is on another node.
        --use-tp-pp-dp-mapping --use-distributed-optimizer
        --micro-batch-size "$MICRO_BATCH" --global-batch-size "$GLOBAL_BATCH"
        --train-iters "$TRAIN_ITERS" "${TRAIN_ARGS[@]}" "${DATA_ARGS[@]}"
        --save "$run_dir/checkpoints" --load "$run_dir/checkpoints"
        --save-interval "$SAVE_INTERVAL" --exit-signal-handler
        --metrics-file "$run_dir/metrics.jsonl"
        --deadpool --deadpool-events "$run_dir/events.jsonl")
    if [[ $CLUSTER == cpu ]]; then
        TRAINING+=(--cpu)
    else
        TRAINING+=(--bf16)
        # Sequence parallelism splits the activations that TP leaves whole.
        if ((TP > 1)); then TRAINING+=(--sequence-parallel); fi
    fi
    TRAINING+=("$@")
}

default_python() {
    if [[ -x $DEADPOOL_REPO/.venv/bin/python ]]; then
        echo "$DEADPOOL_REPO/.venv/bin/python"
    else
        echo python3
    fi
}

hardware() {
    case $CLUSTER in
        perlmutter) echo "${HARDWARE:-perlmutter-a100-40}" ;;
        vista) echo "${HARDWARE:-vista-gh200}" ;;
        cpu) echo "" ;;
    esac
}

dry_run() {
    local json=$1 hw
    hw=$(hardware)
    local plan=(--nodes "$NODES" --spare-nodes "$SPARE_NODES" --ranks-per-node "$RANKS_PER_NODE"
        --script "$0")
    if [[ -n $hw ]]; then plan+=(--hardware "$hw"); fi
    if [[ -n ${MODEL:-} ]]; then plan+=(--model "$MODEL"); fi
    if [[ -n ${SLURM_JOB_NODELIST:-} ]]; then
        # shellcheck disable=SC2207  # host names have no spaces
        plan+=(--hosts $(scontrol show hostnames "$SLURM_JOB_NODELIST"))
    fi
    if [[ $json == 1 ]]; then plan+=(--json); fi
    # A module run from the checkout (deadpool_main has cd'ed there): tools/
    # is not installed, and -m puts the working directory on the path.
    PYTHONWARNINGS=ignore exec "$PYTHON" -m tools.slurm_plan "${plan[@]}" -- "${TRAINING[@]}"
}

load_modules() {
    [[ -n ${MODULES:-} ]] || return 0
    command -v module >/dev/null ||
        die "MODULES='$MODULES' but this shell has no 'module' command: set MODULES= and PYTHON"
    # shellcheck disable=SC2086  # a list of module names
    module load $MODULES
}

# A job's first steps, before the recipe is read: inside Slurm, with the
# cluster's modules, which bring the job's Python.
enter_job() {
    [[ -n ${SLURM_JOB_ID:-} ]] ||
        die "not inside a Slurm job: submit with sbatch, or use --dry-run to see the layout"
    case ${CLUSTER:-} in
        perlmutter)
            # NERSC's PyTorch module, unless MODULES says otherwise (empty: none).
            MODULES=${MODULES-pytorch}
            load_modules
            ;;
        vista) load_modules ;;
    esac
}

cluster_env() {
    case $CLUSTER in
        perlmutter)
            export CUDA_DEVICE_MAX_CONNECTIONS=1
            # NCCL over Slingshot through the aws-ofi-nccl plugin, with HPE's
            # settings (without the plugin NCCL falls back to TCP, 2-3x slower).
            export FI_MR_CACHE_MONITOR=userfaultfd FI_CXI_DISABLE_HOST_REGISTER=1
            export FI_CXI_DEFAULT_CQ_SIZE=131072 FI_CXI_RDZV_PROTO=alt_read
            export NCCL_CROSS_NIC=1 NCCL_NET_GDR_LEVEL=PHB
            export NCCL_SOCKET_IFNAME=hsn0,hsn1,hsn2,hsn3
            # Only across nodes: on one node NCCL must not be forced onto the NIC.
            if ((NODES + SPARE_NODES > 1)); then export NCCL_NET="AWS Libfabric"; fi
            ;;
        vista) export CUDA_DEVICE_MAX_CONNECTIONS=1 ;;
        cpu)
            # One thread per rank: the ranks of a node share its CPUs.
            export OMP_NUM_THREADS=${OMP_NUM_THREADS:-1}
            ;;
    esac
}

check_allocation() {
    local total=$((NODES + SPARE_NODES))
    [[ ${SLURM_JOB_NUM_NODES:-} == "$total" ]] ||
        die "the job has ${SLURM_JOB_NUM_NODES:-?} nodes, but NODES + SPARE_NODES =" \
            "$total: fix #SBATCH -N"
}

# The address of the job's Nth node (1: the first, whose launcher hosts the
# store and the coordinator; 2: the second, the standby's). Slurm node names
# need not resolve (one-machine test clusters), NodeAddr does.
node_address() {
    local host
    host=$(scontrol show hostnames "$SLURM_JOB_NODELIST" | sed -n "$1p")
    scontrol show node "$host" | grep -o 'NodeAddr=[^ ]*' | cut -d= -f2
}

# The control plane's HMAC key: made once here; srun hands the environment
# to every node, and it never appears on a command line.
new_secret() {
    od -An -N32 -tx1 /dev/urandom | tr -d ' \n'
}

launch() {
    local run_dir=$1 total=$((NODES + SPARE_NODES)) status_file srun_status=0
    status_file=$run_dir/launcher-status.$SLURM_JOB_ID
    mkdir -p "$run_dir"
    rm -f "$status_file"
    MASTER_ADDR=$(node_address 1)
    # One port per job (jobs may share a node), it and the next (the
    # standby's store) below Linux's ephemeral ports (32768 and up), which
    # any connection made before the stores listen could take.
    MASTER_PORT=${MASTER_PORT:-$((20000 + SLURM_JOB_ID % 6000 * 2))}
    DEADPOOL_SECRET=${DEADPOOL_SECRET:-$(new_secret)}
    export MASTER_ADDR MASTER_PORT DEADPOOL_SECRET
    # A standby coordinator on the second node takes over if the first dies
    # (--standby-addr); it needs a majority of nodes to survive a loss: 3+.
    if ((total >= 3)); then
        DEADPOOL_STANDBY_ADDR=${DEADPOOL_STANDBY_ADDR-$(node_address 2)}
        export DEADPOOL_STANDBY_ADDR
    fi
    export DEADPOOL_STATUS_FILE=$status_file
    export PYTHONPATH=$DEADPOOL_REPO${PYTHONPATH:+:$PYTHONPATH}
    # The launcher's code for "node 0 and its coordinator are gone" (on_node.sh).
    DEADPOOL_COORDINATOR_LOST=$("$PYTHON" -c \
        'from deadpool_ext.protocol import ExitCode; print(ExitCode.COORDINATOR_LOST.value)')
    export DEADPOOL_COORDINATOR_LOST
    # One task per node. --no-kill: a node that dies takes only its own
    # task; --kill-on-bad-exit=0: a task that fails does not end the others.
    local step=(--nodes="$total" --ntasks="$total" --ntasks-per-node=1 --no-kill
        --kill-on-bad-exit=0)
    if [[ -n ${SLURM_CPUS_PER_TASK:-} ]]; then step+=(--cpus-per-task="$SLURM_CPUS_PER_TASK"); fi
    # Every GPU of the node visible to its launcher (CUDA IPC inside the node).
    if [[ $CLUSTER != cpu ]]; then step+=(--gpu-bind=none); fi
    echo "$JOB_NAME: $NODES active + $SPARE_NODES spare nodes, coordinator at" \
        "$MASTER_ADDR:$MASTER_PORT, standby at ${DEADPOOL_STANDBY_ADDR:-none}," \
        "run directory $run_dir"
    srun "${step[@]}" bash "$DEADPOOL_REPO/examples/slurm/on_node.sh" \
        "$PYTHON" -m deadpool_ext.launch --nnodes "$NODES" --spare-nodes "$SPARE_NODES" \
        --nproc-per-node "$RANKS_PER_NODE" --master-addr "$MASTER_ADDR" \
        --master-port "$MASTER_PORT" "$DEADPOOL_REPO/pretrain_gpt.py" "${TRAINING[@]}" ||
        srun_status=$?
    # srun's status also counts nodes that died and were replaced; the job's
    # outcome is the coordinator's.
    [[ -s $status_file ]] ||
        die "the first node's launcher left no exit status (srun: $srun_status)"
    local status
    status=$(<"$status_file")
    echo "$JOB_NAME: deadpool-launch on the first node exited with $status (srun: $srun_status)"
    exit "$status"
}

deadpool_main() {  # RECIPE [--dry-run [--json]] [pretrain_gpt.py flags]
    local recipe=${1:?"deadpool_main RECIPE: a recipe of tools/planning/recipes.py"}
    local dry=0 json=0 extra=()
    shift
    while (($#)); do
        case $1 in
            --dry-run) dry=1 ;;
            --json) json=1 ;;
            *) extra+=("$1") ;;
        esac
        shift
    done
    PYTHON=${PYTHON:-$(default_python)}
    local run_dir
    run_dir=$(realpath -m "${RUN_DIR:-${SCRATCH:-$DEADPOOL_REPO/runs}/deadpool/$JOB_NAME}")
    # Relative paths (tools.recipe, the data in the flags) are relative to
    # the checkout.
    cd "$DEADPOOL_REPO"
    if [[ $dry == 0 ]]; then enter_job; fi
    read_recipe "$recipe"
    SAVE_INTERVAL=${SAVE_INTERVAL:-500}
    check_settings
    if [[ -n ${DATA:-} ]]; then read -ra DATA_ARGS <<<"$DATA"; fi
    training_args "$run_dir" "${extra[@]}"
    if [[ $dry == 1 ]]; then dry_run "$json"; fi
    check_allocation
    cluster_env
    launch "$run_dir"
}
