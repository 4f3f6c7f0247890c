#!/usr/bin/env bash
# Run by srun once on every node of a job (examples/slurm/common.sh): the
# command is this node's deadpool-launch, which takes its node rank from
# SLURM_NODEID. The first node's launcher runs the coordinator, whose exit
# status is the job's outcome: it goes to $DEADPOOL_STATUS_FILE, because
# srun's own status also counts the nodes that died and were replaced.
set -euo pipefail

# `#SBATCH --signal=TERM@T` reaches every process of the step, this shell
# included. A trapped signal waits for the running command, so the launcher
# and its ranks finish their checkpoint (--exit-signal-handler) while this
# shell stays, and Slurm does not end the step under them.
trap ':' TERM

status=0
"$@" || status=$?
if [[ ${SLURM_NODEID:-} == 0 ]]; then
    echo "$status" >"${DEADPOOL_STATUS_FILE:?set by common.sh}"
fi
exit "$status"
