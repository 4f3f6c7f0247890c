#!/usr/bin/env bash
# shellcheck disable=SC2034  # the settings below are read by common.sh
# GPT 1.3B (24 layers, hidden 2048, 16 heads, sequence 2048)
# on 128 Perlmutter nodes (512 A100-40GB) as TP1 x PP1 x DP512,
# micro-batch 1, global batch 2048, 50000 iterations: the recipe gpt-1.3b of
# tools/planning/recipes.py (python -m tools.recipe gpt-1.3b prints it),
# with 2 warm spare nodes in the same job. Mock data by default; for yours:
#   DATA="--data-path PREFIX --tokenizer-type ..." sbatch -A <project> \
#       examples/slurm/gpt_1.3b.sh
#   sbatch -A <project> examples/slurm/gpt_1.3b.sh [more pretrain_gpt.py flags]
#       # they win over the recipe's: --train-iters 100, say
#   bash examples/slurm/gpt_1.3b.sh --dry-run     # layout, buddies, memory: no GPU, no Slurm
# The #SBATCH lines must stay in this file (sbatch reads no other); -N is
# NODES + SPARE_NODES, and the dry run checks that.
#SBATCH -J deadpool-gpt-1.3b
#SBATCH -N 130
#SBATCH -t 12:00:00
#SBATCH -C gpu
#SBATCH -q regular
#SBATCH --ntasks-per-node=1
#SBATCH --gpus-per-node=4
#SBATCH --cpus-per-task=128
#SBATCH --gpu-bind=none
#SBATCH --no-kill
#SBATCH --signal=TERM@300
# sbatch runs a copy of this file: common.sh is found from where it was submitted.
# shellcheck source=examples/slurm/common.sh
source "${DEADPOOL_REPO:-${SLURM_SUBMIT_DIR:-$(dirname "$0")/../..}}/examples/slurm/common.sh" ||
    { echo "submit from the checkout's root, or set DEADPOOL_REPO" >&2; exit 2; }

CLUSTER=perlmutter
SPARE_NODES=2
deadpool_main gpt-1.3b "$@"
