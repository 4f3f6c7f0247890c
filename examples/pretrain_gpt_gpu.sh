#!/usr/bin/env bash
# One node of GPUs with NCCL: a GPT-3 1.3B shape in bf16 (24 layers, hidden 2048,
# 16 heads, seq 2048). Transformer Engine's layers are used when it is installed.
# Usage: examples/pretrain_gpt_gpu.sh [NGPUS] [extra pretrain_gpt.py flags]
set -euo pipefail
cd "$(dirname "$0")/.."
NGPUS=${1:-1}; shift || true
export CUDA_DEVICE_MAX_CONNECTIONS=1
exec torchrun --standalone --nproc-per-node "$NGPUS" pretrain_gpt.py \
    --num-layers 24 --hidden-size 2048 --num-attention-heads 16 --seq-length 2048 \
    --micro-batch-size 4 --global-batch-size $((16 * NGPUS)) --train-iters 100 --bf16 \
    --use-distributed-optimizer --lr 2e-4 --min-lr 2e-5 --lr-decay-style cosine \
    --lr-warmup-iters 10 --mock-data --tokenizer-type NullTokenizer --vocab-size 50256 \
    --num-workers 2 --log-interval 10 --log-throughput \
    --eval-iters 0 "$@"
