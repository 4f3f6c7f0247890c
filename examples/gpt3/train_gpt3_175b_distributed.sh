#!/bin/bash

# Megatron-LM's examples/gpt3/train_gpt3_175b_distributed.sh (core_v0.16.1),
# scaled down in size so that it runs on 8 CPU ranks: the same flags, smaller
# numbers (layers, hidden, sequence, batch, iterations, parallel sizes), and
# two flags of the schedule in samples: Megatron-LM refuses --rampup-batch-size
# with --train-iters too ("expected no batch-size rampup for iteration-based
# training"), so this copy gives --train-samples and --lr-decay-samples;
# and its --split gives each split of a small corpus documents (949,50,1 leaves
# the embedded corpus's test split none, which megatron-core loops on forever).
# Run it from the repository root as upstream's. For hot swap the launcher
# becomes deadpool-launch with spare nodes, and --deadpool is added:
# LAUNCHER="deadpool-launch --spare-nodes 1" DEADPOOL_ARGS=--deadpool (two nodes
# or more, and --use-distributed-optimizer: docs/recovery.md, "Hot swap").
# Data: `make data` writes the GPT-2 vocabulary and the corpus tokenized with it:
#   bash examples/gpt3/train_gpt3_175b_distributed.sh runs/gpt3/ckpt runs/gpt3/tb \
#     data/tokenizers/gpt2/vocab.json data/tokenizers/gpt2/merges.txt \
#     data/corpus_gpt2_text_document

export CUDA_DEVICE_MAX_CONNECTIONS=1

GPUS_PER_NODE=8
# Change for multinode config
MASTER_ADDR=localhost
MASTER_PORT=${MASTER_PORT:-6000}
NUM_NODES=1
NODE_RANK=0
WORLD_SIZE=$(($GPUS_PER_NODE*$NUM_NODES))

CHECKPOINT_PATH=$1 #<Specify path>
TENSORBOARD_LOGS_PATH=$2 #<Specify path>
VOCAB_FILE=$3 #<Specify path to file>/gpt2-vocab.json
MERGE_FILE=$4 #<Specify path to file>/gpt2-merges.txt
DATA_PATH=$5 #<Specify path and file prefix>_text_document

DISTRIBUTED_ARGS=(
    --nproc_per_node $GPUS_PER_NODE
    --nnodes $NUM_NODES
    --master_addr $MASTER_ADDR
    --master_port $MASTER_PORT
)

GPT_MODEL_ARGS=(
    --num-layers 4
    --hidden-size 64
    --num-attention-heads 4
    --seq-length 64
    --max-position-embeddings 64
    --attention-backend auto # Can use (flash/fused/unfused/local)
)

TRAINING_ARGS=(
    --micro-batch-size 1
    --global-batch-size 16
    --rampup-batch-size 4 4 48
    --train-samples 224
    --weight-decay 0.1
    --adam-beta1 0.9
    --adam-beta2 0.95
    --init-method-std 0.006
    --clip-grad 1.0
    --fp16
    --lr 6.0e-4
    --lr-decay-style cosine
    --min-lr 6.0e-5
    --lr-warmup-fraction .1
    --lr-decay-samples 192
)

MODEL_PARALLEL_ARGS=(
	--tensor-model-parallel-size 2
	--pipeline-model-parallel-size 2
)

DATA_ARGS=(
    --data-path $DATA_PATH
    --vocab-file $VOCAB_FILE
    --merge-file $MERGE_FILE
    --split 98,1,1
)

EVAL_AND_LOGGING_ARGS=(
    --log-interval 1
    --save-interval 10
    --eval-interval 5
    --save $CHECKPOINT_PATH
    --load $CHECKPOINT_PATH
    --eval-iters 2
    --tensorboard-dir $TENSORBOARD_LOGS_PATH
)

${LAUNCHER:-torchrun} ${DISTRIBUTED_ARGS[@]} pretrain_gpt.py \
    ${GPT_MODEL_ARGS[@]} \
    ${TRAINING_ARGS[@]} \
    ${MODEL_PARALLEL_ARGS[@]} \
    ${DATA_ARGS[@]} \
    ${EVAL_AND_LOGGING_ARGS[@]} \
    ${DEADPOOL_ARGS}
