#!/usr/bin/env bash
# Run by srun once on every node of a job (examples/slurm/common.sh): the
# command is this node's deadpool-launch, which takes its node rank from
# SLURM_NODEID. The first node's launcher runs the coordinator, whose exit
# status is the job's outcome: it goes to $DEADPOOL_STATUS_FILE, because
# srun's own status also counts the nodes that died and were replaced. When
# the first node dies, the second node's launcher (the standby, with
# DEADPOOL_STANDBY_ADDR) takes over as the coordinator: its status is then
# the job's, and this script ends the job, whose batch script died with the
# first node.
set -euo pipefail

# `#SBATCH --signal=TERM@T` reaches every process of the step, this shell
# included. A trapped signal waits for the running command, so the launcher
# and its ranks finish their checkpoint (--exit-signal-handler) while this
# shell stays, and Slurm does not end the step under them.
trap ':' TERM

# The first node died (its launcher held the store and the coordinator, its
# shell the batch script). With --no-kill Slurm keeps the job, and every
# other node, RUNNING until the time limit (docs/slurm.md). Once Slurm has
# dropped that node from the job, record the outcome and end the job; if
# the node lives after all, its batch script ends the job first.
end_orphaned_job() {
    local job=$SLURM_JOB_ID batch_host nodes
    batch_host=$(scontrol show job -o "$job" | grep -o 'BatchHost=[^ ]*' | cut -d= -f2)
    while :; do
        nodes=$(scontrol show job -o "$job" | grep -o ' NodeList=[^ ]*' | cut -d= -f2)
        if ! scontrol show hostnames "$nodes" | grep -qx "$batch_host"; then break; fi
        sleep "${DEADPOOL_ORPHAN_POLL_S:-5}"
    done
    echo "$1" >"$DEADPOOL_STATUS_FILE"
    echo "on_node.sh: node $SLURM_NODEID: the first node ($batch_host) and its coordinator" \
        "are gone; ending job $job (resubmit to resume from the last checkpoint)" >&2
    scancel "$job"
}

# The standby took over and the job has ended: its outcome is the job's.
# The first node is gone (or its launcher is: its shell may have recorded
# that), so nobody else would end the job.
end_taken_over_job() {
    echo "$1" >"$DEADPOOL_STATUS_FILE"
    echo "on_node.sh: node $SLURM_NODEID: $(<"$DEADPOOL_TAKEOVER_FILE");" \
        "the job ended with status $1; ending job $SLURM_JOB_ID" >&2
    scancel "$SLURM_JOB_ID"
}

DEADPOOL_TAKEOVER_FILE=$(mktemp)
export DEADPOOL_TAKEOVER_FILE
status=0
"$@" || status=$?
if [[ -s $DEADPOOL_TAKEOVER_FILE ]]; then
    end_taken_over_job "$status"
elif [[ ${SLURM_NODEID:-} == 0 ]]; then
    echo "$status" >"${DEADPOOL_STATUS_FILE:?set by common.sh}"
elif [[ $status == "${DEADPOOL_COORDINATOR_LOST:?set by common.sh}" ]]; then
    end_orphaned_job "$status"
fi
rm -f "$DEADPOOL_TAKEOVER_FILE"
exit "$status"
