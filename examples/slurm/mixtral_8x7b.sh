#!/usr/bin/env bash
# shellcheck disable=SC2034  # the settings below are read by common.sh
# Mixtral 8x7B (32 layers, hidden 4096, 32 heads, 8 KV heads, 8 experts of FFN 14336,
# top-2), the MoE model of docs/scale.md,
# on 128 Perlmutter nodes (512 A100-40GB) as TP4 x PP1 x DP128 with EP8 (expert-DP 16),
# with 2 warm spare nodes in the same job. Mock data by default; for yours:
#   DATA="--data-path PREFIX --tokenizer-type ..." sbatch -A <project> \
#       examples/slurm/mixtral_8x7b.sh
#   sbatch -A <project> examples/slurm/mixtral_8x7b.sh [more pretrain_gpt.py flags]
#   bash examples/slurm/mixtral_8x7b.sh --dry-run     # layout, buddies, memory: no GPU, no Slurm
# The #SBATCH lines must stay in this file (sbatch reads no other); -N is
# NODES + SPARE_NODES, and the dry run checks that.
#SBATCH -J deadpool-mixtral-8x7b
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

MODEL=mixtral-8x7b
CLUSTER=perlmutter
NODES=128
SPARE_NODES=2
RANKS_PER_NODE=4
TP=4
PP=1
MICRO_BATCH=1
GLOBAL_BATCH=1024
TRAIN_ITERS=50000
SAVE_INTERVAL=500
MODEL_ARGS=(--num-layers 32 --hidden-size 4096 --num-attention-heads 32
    --group-query-attention --num-query-groups 8 --ffn-hidden-size 14336 --seq-length 4096
    --swiglu --normalization RMSNorm --position-embedding-type rope
    --disable-bias-linear --untie-embeddings-and-output-weights
    --hidden-dropout 0 --attention-dropout 0
    --num-experts 8 --moe-router-topk 2 --expert-model-parallel-size 8
    --moe-router-load-balancing-type aux_loss --moe-aux-loss-coeff 0.01
    --moe-token-dispatcher-type alltoall)
TRAIN_ARGS=("${GPU_SCHEDULE[@]}" --lr 1.5e-4 --min-lr 1.5e-5)
DATA_ARGS=(--mock-data --tokenizer-type NullTokenizer --vocab-size 31999)  # LLaMA's 32000 ids

deadpool_main "$@"
