# Quick start on a fresh machine:  make demo   |   make test
PYTHON ?= python3
VENV ?= .venv
PY := $(VENV)/bin/python
# The CPU build of torch lies on these machines' disk; an unpinned torch
# would pull a CUDA build of several GB. On a GPU machine: make TORCH=torch
TORCH ?= torch==2.13.0
NPROC ?= 8
RUN_DIR ?= runs/demo
# The failure-free run whose loss curve the demo's must equal; kept between demos.
REFERENCE_DIR := $(RUN_DIR)-reference

# The demo's recipe (demo in tools/planning/recipes.py: its model, layout,
# batch, schedule and data), then where and how this run keeps its results.
DEMO_ARGS = $(DEMO_RECIPE) --log-throughput \
	--save $(RUN_DIR)/checkpoints --save-interval 30 \
	--metrics-file $(RUN_DIR)/metrics.jsonl
DEMO_RECIPE = $(or $(shell $(PYTHON) -m tools.recipe demo --flags),\
	$(error python -m tools.recipe printed no flags for the demo))
# Buddy mirroring and hot swap across emulated 4-rank nodes (DP peers on
# other nodes); the demo kills node 1 in iteration 25.
DEADPOOL_ARGS = --use-tp-pp-dp-mapping --deadpool --deadpool-events $(RUN_DIR)/events.jsonl
FAULT ?= kill:node=1:iter=25
LAUNCH = $(PY) -m deadpool_ext.launch --standalone --nnodes 2 --spare-nodes 1 --nproc-per-node 4

.PHONY: setup data demo demo-reference lint test test-unit test-hosts test-slurm gpu-wheels gpu-check-dry-run bench bench-mirror bench-recovery bench-shrink bench-checkpoint bench-network clean print-demo-args print-deadpool-args

$(VENV)/.installed: setup.py
	$(PYTHON) -m venv $(VENV)
	$(PY) -m pip install -q --upgrade pip
	$(PY) -m pip install -q $(TORCH)
	$(PY) -m pip install -q -e '.[test]'
	touch $@

setup: $(VENV)/.installed

data: setup
	$(PY) -m tools.prepare_corpus --output-dir data

# 2 active nodes x 4 ranks (TP2 PP2 DP2) + 1 warm spare node; node 1 dies.
# The timeline tool fails the demo unless its loss curve equals the
# failure-free reference's bit for bit.
demo: demo-reference
	rm -rf $(RUN_DIR)
	OMP_NUM_THREADS=1 PYTHONWARNINGS=ignore $(LAUNCH) pretrain_gpt.py $(DEMO_ARGS) \
		$(DEADPOOL_ARGS) --deadpool-inject $(FAULT)
	$(PY) -m tools.recovery_timeline --events $(RUN_DIR)/events.jsonl \
		--metrics $(RUN_DIR)/metrics.jsonl --reference $(REFERENCE_DIR)/metrics.jsonl \
		--output-dir $(RUN_DIR)

# The demo without its fault: same seed, flags and launcher, in REFERENCE_DIR.
# Its command line is stamped in command.txt once it has finished; it runs
# again only when that changes, so a second `make demo` skips it.
demo-reference: override RUN_DIR := $(REFERENCE_DIR)
demo-reference: data
	@if [ "$$(cat $(RUN_DIR)/command.txt 2>/dev/null)" = '$(REFERENCE_KEY)' ]; then \
		echo "failure-free reference: reusing $(RUN_DIR) (same command line and code)"; \
	else \
		echo "failure-free reference run, same seed, in $(RUN_DIR):" && \
		echo '$(REFERENCE_COMMAND)' && rm -rf $(RUN_DIR) && \
		OMP_NUM_THREADS=1 PYTHONWARNINGS=ignore $(REFERENCE_COMMAND) && \
		echo '$(REFERENCE_KEY)' > $(RUN_DIR)/command.txt; \
	fi
REFERENCE_COMMAND = $(LAUNCH) pretrain_gpt.py $(DEMO_ARGS) $(DEADPOOL_ARGS)
# A reference is reused only for the same command line and the same code
# (the commit and any change on top of it): other code may train another curve.
CODE_ID = $(shell (git rev-parse HEAD && git diff HEAD && git ls-files --others \
	--exclude-standard) 2>/dev/null | sha1sum | cut -c1-12)
REFERENCE_KEY = $(REFERENCE_COMMAND) (code $(CODE_ID))

# ruff's settings are in pyproject.toml; .ci/run lints before testing.
lint: setup
	$(VENV)/bin/ruff check .
	$(VENV)/bin/ruff format --check .

# Everything: the unit tests (in-process) and the functional tests, which
# start real processes.
test: setup
	OMP_NUM_THREADS=1 $(PY) -m pytest -q -p no:warnings --durations=30 tests/unit_tests tests/functional_tests

# Unit tests only (in-process, under a minute).
test-unit: setup
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
		$(PY) -m pytest -q -p no:warnings tests/functional_tests/test_slurm_cluster.py

# What the GPU check (tools/gpu_check.sh) installs on a lent GPU machine,
# which has no network and Python 3.12 without megatron-core: their wheels,
# in .whl/ (carried to the machine with the working tree).
gpu-wheels: setup
	$(PY) -m pip download -q --no-deps --only-binary=:all: --python-version 3.12 \
		--implementation cp --abi cp312 --abi abi3 --platform manylinux_2_28_x86_64 \
		--platform manylinux_2_17_x86_64 -d .whl megatron-core==0.16.1 psutil

# The GPU check's every command built and parsed as on the GPU machine.
gpu-check-dry-run: setup
	PYTHON=$(PY) bash tools/gpu_check.sh runs/gpu-check --dry-run

bench: data
	OMP_NUM_THREADS=1 $(PY) -m tools.bench.training

bench-mirror: data
	OMP_NUM_THREADS=1 $(PY) -m tools.bench.mirror

bench-recovery: data
	OMP_NUM_THREADS=1 $(PY) -m tools.bench.recovery

bench-shrink: data
	OMP_NUM_THREADS=1 $(PY) -m tools.bench.shrink

# Across emulated hosts (root and nftables): lost packets, a slow link, detection.
bench-network: data
	OMP_NUM_THREADS=1 $(PY) -m tools.bench.network

bench-checkpoint: data
	OMP_NUM_THREADS=1 $(PY) -m tools.bench.checkpoint --output docs/data/bench_checkpoint.json

clean:
	rm -rf $(VENV) data runs *.egg-info

print-demo-args:
	@echo $(DEMO_ARGS)

print-deadpool-args:
	@echo $(DEADPOOL_ARGS)

# The jobs across emulated hosts (network namespaces: root, iproute2, nftables;
# tools/hosts.py) alone; `make test` runs them too.
test-hosts: setup
	OMP_NUM_THREADS=1 $(PY) -m pytest -q -p no:warnings tests/functional_tests/test_hosts.py
