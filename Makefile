# Quick start on a fresh machine:  make demo   |   make test
PYTHON ?= python3
VENV ?= .venv
PY := $(VENV)/bin/python
# The CPU build of torch lies on these machines' disk; an unpinned torch
# would pull a CUDA build of several GB. On a GPU machine: make TORCH=torch
TORCH ?= torch==2.13.0
NPROC ?= 8
RUN_DIR ?= runs/demo

DEMO_ARGS = \
	--tensor-model-parallel-size 2 --pipeline-model-parallel-size 2 \
	--use-distributed-optimizer \
	--num-layers 4 --hidden-size 128 --num-attention-heads 4 \
	--seq-length 128 --max-position-embeddings 128 \
	--micro-batch-size 4 --global-batch-size 32 \
	--train-iters 60 --lr 3e-3 --min-lr 3e-4 --lr-decay-style cosine --lr-warmup-iters 6 \
	--weight-decay 0.1 --clip-grad 1.0 --seed 1234 \
	--data-path data/corpus_text_document --tokenizer-type ByteLevelTokenizer \
	--split 98,2,0 --num-workers 0 \
	--log-interval 5 --eval-interval 30 --eval-iters 2 --log-throughput \
	--save $(RUN_DIR)/checkpoints --save-interval 30 \
	--metrics-file $(RUN_DIR)/metrics.jsonl
# Buddy mirroring and hot swap across emulated 4-rank nodes (DP peers on
# other nodes); the demo kills node 1 in iteration 25.
DEADPOOL_ARGS = --use-tp-pp-dp-mapping --deadpool --deadpool-events $(RUN_DIR)/events.jsonl
FAULT ?= kill:node=1:iter=25
LAUNCH = $(PY) -m deadpool_ext.launch --standalone --nnodes 2 --spare-nodes 1 --nproc-per-node 4

.PHONY: setup data demo test test-slurm bench bench-mirror bench-recovery bench-shrink clean print-demo-args print-deadpool-args

$(VENV)/.installed: setup.py
	$(PYTHON) -m venv $(VENV)
	$(PY) -m pip install -q --upgrade pip
	$(PY) -m pip install -q $(TORCH)
	$(PY) -m pip install -q -e '.[test]'
	touch $@

setup: $(VENV)/.installed

data: setup
	$(PY) tools/prepare_corpus.py --output-dir data

# 2 active nodes x 4 ranks (TP2 PP2 DP2) + 1 warm spare node; node 1 dies.
demo: data
	rm -rf $(RUN_DIR)
	OMP_NUM_THREADS=1 PYTHONWARNINGS=ignore $(LAUNCH) pretrain_gpt.py $(DEMO_ARGS) \
		$(DEADPOOL_ARGS) --deadpool-inject $(FAULT)
	$(PY) tools/recovery_timeline.py --events $(RUN_DIR)/events.jsonl \
		--metrics $(RUN_DIR)/metrics.jsonl --output-dir $(RUN_DIR)

test: setup
	OMP_NUM_THREADS=1 $(PY) -m pytest -q -p no:warnings tests/unit_tests

# A real Slurm cluster on this machine (root, no systemd; Debian's slurmctld,
# slurmd, munge: tools/slurm_local.sh), then examples/slurm/cpu_demo.sh
# submitted with sbatch: failure-free, with a node killed (its slurmd and
# tasks), and stopped by SIGTERM. Several minutes; not part of `make test`.
SLURM_NODES ?= 4
test-slurm: data
	tools/slurm_local.sh install
	tools/slurm_local.sh start $(SLURM_NODES)
	DEADPOOL_TEST_SLURM=1 DEADPOOL_SLURM_REPORT=runs/slurm-test.log OMP_NUM_THREADS=1 \
		$(PY) -m pytest -q -p no:warnings tests/unit_tests/test_slurm_cluster.py

bench: data
	OMP_NUM_THREADS=1 $(PY) tools/bench_training.py

bench-mirror: data
	OMP_NUM_THREADS=1 $(PY) tools/bench_mirror.py

bench-recovery: data
	OMP_NUM_THREADS=1 $(PY) tools/bench_recovery.py

bench-shrink: data
	OMP_NUM_THREADS=1 $(PY) tools/bench_shrink.py

clean:
	rm -rf $(VENV) data runs *.egg-info

print-demo-args:
	@echo $(DEMO_ARGS)

print-deadpool-args:
	@echo $(DEADPOOL_ARGS)
