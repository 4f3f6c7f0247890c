#!/usr/bin/env bash
# shellcheck disable=SC2034  # the settings below are read by common.sh
# The CPU variant of the same script, for any Slurm cluster: no GPU, gloo,
# `make demo`'s recipe (demo in tools/planning/recipes.py: 4 layers, hidden
# 128, TP2 x PP2 x DP2, micro-batch 4, global batch 32, 60 iterations) on 2
# active nodes of 4 ranks with 1 warm spare node. tools/slurm_local.sh makes such a
# cluster on one machine; `make test-slurm` submits this script there, kills a
# node and checks the hot swap.
#   make data                                   # the embedded corpus, once
#   sbatch examples/slurm/cpu_demo.sh [more pretrain_gpt.py flags, e.g. --train-iters 20]
#   bash examples/slurm/cpu_demo.sh --dry-run   # the layout, without Slurm
#SBATCH -J deadpool-cpu-demo
#SBATCH -N 3
#SBATCH -t 00:30:00
#SBATCH --ntasks-per-node=1
#SBATCH --cpus-per-task=4
#SBATCH --no-kill
#SBATCH --signal=TERM@60
# sbatch runs a copy of this file: common.sh is found from where it was submitted.
# shellcheck source=examples/slurm/common.sh
source "${DEADPOOL_REPO:-${SLURM_SUBMIT_DIR:-$(dirname "$0")/../..}}/examples/slurm/common.sh" ||
    { echo "submit from the checkout's root, or set DEADPOOL_REPO" >&2; exit 2; }

CLUSTER=cpu
SPARE_NODES=1
SAVE_INTERVAL=30
deadpool_main demo "$@"
