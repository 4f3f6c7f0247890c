#!/bin/bash

# Megatron-LM's examples/mixtral/train_mixtral_8x7b_distributed.sh (core_v0.16.1),
# scaled down in size so that it runs on 8 CPU ranks: the same flags, smaller
# numbers (layers, hidden, heads, query groups, sequence, batch, iterations,
# intervals), parallel sizes that fit 8 ranks (PP 2 and EP 4 for PP 4 and EP 8,
# which need 32), and a split that gives each split documents of a small corpus
# (99990,8,2 gives the embedded corpus's valid and test splits none). On a CPU
# --moe-grouped-gemm is refused with its reason (a GPU kernel):
# tests/functional_tests/test_example_scripts.py reads the refusal, then runs the script
# without it. --sequence-parallel at TP 1 is turned off with a warning, as upstream.
# Run it from the repository root as upstream's. Hot swap does not cover MoE
# models yet: --deadpool refuses --num-experts with the reason.
# Data: `make data` writes the SentencePiece model; tokenize the corpus with it
# (tools/preprocess_data.py --tokenizer-type Llama2Tokenizer --tokenizer-model ...):
#   bash examples/mixtral/train_mixtral_8x7b_distributed.sh runs/mixtral/ckpt \
#     data/tokenizers/sentencepiece.model runs/mixtral/corpus_spm_text_document

export CUDA_DEVICE_MAX_CONNECTIONS=1

GPUS_PER_NODE=8
# Change for multinode config
MASTER_ADDR=${MASTER_ADDR:-"localhost"}
MASTER_PORT=${MASTER_PORT:-"6000"}
NNODES=${SLURM_NNODES:-"1"}
NODE_RANK=${RANK:-"0"}
WORLD_SIZE=$(($GPUS_PER_NODE*$NNODES))

CHECKPOINT_PATH=$1
TOKENIZER_MODEL=$2
DATA_PATH=$3

DISTRIBUTED_ARGS=(
    --nproc_per_node $GPUS_PER_NODE
    --nnodes $NNODES
    --node_rank $NODE_RANK
    --master_addr $MASTER_ADDR
    --master_port $MASTER_PORT
)

MODEL_ARGS=(
    --use-mcore-models
    --disable-bias-linear
    --seq-length 64
    --max-position-embeddings 256
    --num-layers 4
    --hidden-size 64
    --ffn-hidden-size 224
    --num-attention-heads 4
    --init-method-std 0.01
    --attention-dropout 0.0
    --hidden-dropout 0.0
    --normalization RMSNorm
    --position-embedding-type rope
    --swiglu
    --untie-embeddings-and-output-weights
    --group-query-attention
    --num-query-groups 2
    --no-masked-softmax-fusion
    --no-position-embedding
    --rotary-base 1000000
)

MOE_ARGS=(
    --num-experts 8
    --moe-router-topk 2
    --moe-router-load-balancing-type aux_loss
    --moe-aux-loss-coeff 1e-2
    --moe-grouped-gemm
    --moe-token-dispatcher-type alltoall
    --overlap-param-gather
    --overlap-grad-reduce
)

DATA_ARGS=(
    --tokenizer-type Llama2Tokenizer
    --tokenizer-model ${TOKENIZER_MODEL}
    --data-path $DATA_PATH
    --split 98,1,1
)

TRAINING_ARGS=(
    --micro-batch-size 1
    --global-batch-size 8
    --lr 1e-4
    --train-iters 8
    --lr-decay-iters 6
    --lr-decay-style cosine
    --min-lr 1.0e-5
    --weight-decay 0.1
    --lr-warmup-iters 2
    --clip-grad 1.0
    --bf16
)

MODEL_PARALLEL_ARGS=(
    --tensor-model-parallel-size 1
    --pipeline-model-parallel-size 2
    --expert-model-parallel-size 4
    --use-distributed-optimizer
    --sequence-parallel
)

LOGGING_ARGS=(
    --log-interval 1 \
    --save-interval 4 \
    --eval-interval 4 \
    --eval-iters 2 \
    --save $CHECKPOINT_PATH \
    --load $CHECKPOINT_PATH \
    --tensorboard-dir "${CHECKPOINT_PATH}/tensorboard" \
    --no-load-optim \
    --no-load-rng
)

if [ -n "${WANDB_API_KEY}" ]; then
    LOGGING_ARGS+=(
        --wandb-project ${WANDB_PROJECT:-"Mixtral"}
        --wandb-exp-name ${WANDB_NAME:-"Mixtral_8x7B"}
    )
fi


${LAUNCHER:-torchrun} ${DISTRIBUTED_ARGS[@]} pretrain_gpt.py \
    ${MODEL_ARGS[@]} \
    ${MOE_ARGS[@]} \
    ${DATA_ARGS[@]} \
    ${TRAINING_ARGS[@]} \
    ${MODEL_PARALLEL_ARGS[@]} \
    ${LOGGING_ARGS[@]}
