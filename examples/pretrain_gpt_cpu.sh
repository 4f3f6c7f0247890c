#!/usr/bin/env bash
# A plain (no hot-swap) CPU run under torchrun: 8 gloo ranks as TP2 x PP2 x DP2
# on the embedded corpus. Prepare the data first: python -m tools.prepare_corpus
set -euo pipefail
cd "$(dirname "$0")/.."
export OMP_NUM_THREADS=1
exec torchrun --standalone --nproc-per-node 8 pretrain_gpt.py \
    --tensor-model-parallel-size 2 --pipeline-model-parallel-size 2 --use-distributed-optimizer \
    --num-layers 4 --hidden-size 128 --num-attention-heads 4 --seq-length 128 \
    --micro-batch-size 4 --global-batch-size 32 --train-iters 100 \
    --lr 1e-3 --min-lr 1e-4 --lr-decay-style cosine --lr-warmup-iters 10 \
    --data-path data/corpus_text_document --tokenizer-type ByteLevelTokenizer --split 98,2,0 \
    --num-workers 0 --log-interval 10 --eval-interval 50 --eval-iters 2 \
    --save runs/example/checkpoints --save-interval 50 --exit-signal-handler "$@"
