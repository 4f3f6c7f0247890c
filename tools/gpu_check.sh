#!/bin/bash
# The GPU check of pretrain_gpt.py on one GPU (docs/benchmarks.md "GPU"): a small bf16 run
# twice (bit-for-bit equal?) and a 1.3B GPT's throughput. Where megatron-core is not
# installed, its wheels in .whl/ are (the device machine of a session: see its README).
# Writes to $OUT (default runs/gpu-check).
set -x
OUT=${OUT:-runs/gpu-check}; mkdir -p $OUT
if ls .whl/*.whl >/dev/null 2>&1; then
  python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --target /tmp/site .whl/*.whl || exit 1
fi
export OUT PYTHONPATH=/tmp/site:$PWD PYTHONWARNINGS=ignore
nvidia-smi --query-gpu=name,memory.total,driver_version --format=csv
python3 -c "import torch, megatron.core; print('torch', torch.__version__, 'cuda', torch.version.cuda, 'mcore', megatron.core.__version__)"
python3 -c "from deadpool_ext.control.zygote import forks_workers; print('forks_workers on GPU:', forks_workers())"
COMMON="--mock-data --tokenizer-type NullTokenizer --vocab-size 50256 --lr 1e-4 --min-lr 1e-5 --lr-warmup-iters 2 --eval-iters 0 --num-workers 0 --use-distributed-optimizer --seed 1234"
# Determinism: the same small bf16 run twice, every iteration's metrics compared.
for r in a b; do
  timeout 150 torchrun --standalone --nproc-per-node 1 pretrain_gpt.py $COMMON --num-layers 4 --hidden-size 256 --num-attention-heads 8 \
    --seq-length 512 --max-position-embeddings 512 --micro-batch-size 4 --global-batch-size 16 --train-iters 10 --bf16 \
    --log-interval 5 --metrics-file $OUT/small_$r.jsonl > $OUT/small_$r.log 2>&1; echo "small $r rc=$?"
done
python3 - <<'PY'
import json, os
runs = [[json.loads(l) for l in open(f"{os.environ['OUT']}/small_{r}.jsonl")] for r in "ab"]
strip = lambda run: [{k: v for k, v in m.items() if k != "seconds"} for m in run]
same = strip(runs[0]) == strip(runs[1]) and len(runs[0]) == 10
print("small runs: every iteration's metrics equal" if same else "small runs DIFFER")
PY
tail -3 $OUT/small_a.log
# Throughput: a 1.3B GPT (24 layers, hidden 2048, seq 2048), bf16, one GPU.
timeout 300 torchrun --standalone --nproc-per-node 1 pretrain_gpt.py $COMMON --num-layers 24 --hidden-size 2048 --num-attention-heads 16 \
  --seq-length 2048 --max-position-embeddings 2048 --micro-batch-size 4 --global-batch-size 32 --train-iters 12 --bf16 \
  --log-interval 1 --log-throughput --metrics-file $OUT/gpt1p3b.jsonl > $OUT/gpt1p3b.log 2>&1; echo "1.3B rc=$?"
grep "iteration" $OUT/gpt1p3b.log | tail -4
tail -15 $OUT/gpt1p3b.log | grep -v "iteration " 
nvidia-smi --query-gpu=memory.used --format=csv
