#!/usr/bin/env bash
# shellcheck disable=SC2034  # the settings below are read by common.sh
# GPT 13B (40 layers, hidden 5120, 40 heads, sequence 2048)
# on 128 TACC Vista nodes (one GH200 each) as TP1 x PP2 x DP64: with one GPU per
# node tensor parallelism would cross nodes, so TP is 1 and every rank is its own
# failure domain,
# micro-batch 1, global batch 2048, 50000 iterations: the recipe vista-gpt-13b of
# tools/planning/recipes.py (python -m tools.recipe vista-gpt-13b prints it),
# with 2 warm spare nodes in the same job. Mock data by default; for yours:
#   DATA="--data-path PREFIX --tokenizer-type ..." sbatch -A <project> \
#       examples/slurm/vista_gpt_13b.sh
#   sbatch -A <project> examples/slurm/vista_gpt_13b.sh [more pretrain_gpt.py flags]
#       # they win over the recipe's: --train-iters 100, say
#   bash examples/slurm/vista_gpt_13b.sh --dry-run     # layout, buddies, memory: no GPU, no Slurm
# The #SBATCH lines must stay in this file (sbatch reads no other); -N is
# NODES + SPARE_NODES, and the dry run checks that.
#SBATCH -J deadpool-vista-gpt-13b
#SBATCH -p gh
#SBATCH -N 130
#SBATCH -t 12:00:00
#SBATCH --ntasks-per-node=1
#SBATCH --no-kill
#SBATCH --signal=TERM@300
# sbatch runs a copy of this file: common.sh is found from where it was submitted.
# shellcheck source=examples/slurm/common.sh
source "${DEADPOOL_REPO:-${SLURM_SUBMIT_DIR:-$(dirname "$0")/../..}}/examples/slurm/common.sh" ||
    { echo "submit from the checkout's root, or set DEADPOOL_REPO" >&2; exit 2; }

CLUSTER=vista
SPARE_NODES=2
deadpool_main vista-gpt-13b "$@"
