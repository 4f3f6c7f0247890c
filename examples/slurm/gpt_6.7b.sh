#!/usr/bin/env bash
# shellcheck disable=SC2034  # the settings below are read by common.sh
# GPT 6.7B (32 layers, hidden 4096, 32 heads, sequence 2048)
# on 128 Perlmutter nodes (512 A100-40GB) as TP2 x PP1 x DP256,
# with 2 warm spare nodes in the same job. Mock data by default; for yours:
#   DATA="--data-path PREFIX --tokenizer-type ..." sbatch -A <project> \
#       examples/slurm/gpt_6.7b.sh
#   sbatch -A <project> examples/slurm/gpt_6.7b.sh [more pretrain_gpt.py flags]
#   bash examples/slurm/gpt_6.7b.sh --dry-run     # layout, buddies, memory: no GPU, no Slurm
# The #SBATCH lines must stay in this file (sbatch reads no other); -N is
# NODES + SPARE_NODES, and the dry run checks that.
#SBATCH -J deadpool-gpt-6.7b
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
set -euo pipefail
# sbatch runs a copy of this file: common.sh is found from where it was submitted.
# shellcheck source=examples/slurm/common.sh
source "${DEADPOOL_REPO:-${SLURM_SUBMIT_DIR:-$(dirname "$0")/../..}}/examples/slurm/common.sh" ||
    { echo "submit from the checkout's root, or set DEADPOOL_REPO" >&2; exit 2; }

MODEL=gpt-6.7b
CLUSTER=perlmutter
NODES=128
SPARE_NODES=2
RANKS_PER_NODE=4
TP=2
PP=1
MICRO_BATCH=1
GLOBAL_BATCH=2048
TRAIN_ITERS=50000
SAVE_INTERVAL=500
MODEL_ARGS=(--num-layers 32 --hidden-size 4096 --num-attention-heads 32 --seq-length 2048)
TRAIN_ARGS=("${GPU_SCHEDULE[@]}" --lr 1.2e-4 --min-lr 1.2e-5)
DATA_ARGS=(--mock-data --tokenizer-type NullTokenizer --vocab-size 50256)  # GPT-2's 50257 ids

deadpool_main "$@"
