"""Activation recompute through pretrain_gpt.py, in processes: recompute
really runs (layers and attention cores run twice per microbatch) and changes
nothing: with dropout on, the curve equals the run without recompute bit for
bit, because megatron-core restores the RNG streams before it recomputes.
The flags are tested in tests/unit_tests/training/flags/test_training.py and
what they set in tests/unit_tests/training/test_model_setup.py; hot swap with
recompute: test_hot_swap.py."""

import json
import sys

import pytest

import forkserver
from dist_utils import REPO, curve, read_metrics, run_pretrain, worker_env
from deadpool_ext.control.ports import free_port
from tests.unit_tests.training.flags.test_training import (
    FULL_BLOCK,
    FULL_UNIFORM,
    RECOMPUTE_BASE as BASE,
    SELECTIVE,
)

pytestmark = pytest.mark.integration

# --- megatron-core really recomputes ------------------------------------------------

# One process: builds pretrain_gpt.py's model for the flags given in argv and
# counts, over one forward and backward, how often layer 0 and its attention
# core run.
PROBE = """
import json, os, sys
import torch
import torch.distributed as dist
from megatron.training import cpu_compat
from megatron.training.arguments import parse_args
from megatron.training.model_setup import transformer_config
import pretrain_gpt

cpu_compat.enable(force=True)
dist.init_process_group("gloo", init_method="tcp://127.0.0.1:" + sys.argv[1], rank=0, world_size=1)
from megatron.core import parallel_state, tensor_parallel
parallel_state.initialize_model_parallel()
tensor_parallel.model_parallel_cuda_manual_seed(1234)
config = parse_args(json.loads(sys.argv[2]), world_size=1)
config.run.padded_vocab_size = 128
model = pretrain_gpt.model_provider(config, transformer_config(config, True), True, True)
layer = model.decoder.layers[0]
calls = {"layer": 0, "core_attention": 0}
def count(name):
    def hook(*_):
        calls[name] += 1
    return hook
layer.register_forward_hook(count("layer"))
layer.self_attention.core_attention.register_forward_hook(count("core_attention"))
tokens = torch.randint(0, 128, (2, 32))
positions = torch.arange(32).unsqueeze(0).expand(2, -1)
mask = torch.tril(torch.ones(1, 1, 32, 32)) < 0.5
model(tokens, positions, mask, labels=tokens).float().mean().backward()
print(json.dumps(calls))
"""


def forward_calls(extra) -> dict:
    command = [sys.executable, "-c", PROBE, str(free_port()), json.dumps(BASE + extra)]
    proc = forkserver.run(command, worker_env(), REPO, timeout=300)
    assert proc.returncode == 0, proc.stderr[-4000:]
    return json.loads(proc.stdout.strip().splitlines()[-1])


def test_megatron_core_recomputes_what_the_flags_say():
    assert forward_calls([]) == {"layer": 1, "core_attention": 1}
    assert forward_calls(FULL_UNIFORM) == {"layer": 2, "core_attention": 2}
    assert forward_calls(FULL_BLOCK) == {"layer": 2, "core_attention": 2}  # layer 0 of 2
    assert forward_calls(SELECTIVE) == {"layer": 1, "core_attention": 2}


# --- the same training, bit for bit --------------------------------------------------

RUN = BASE + ["--use-distributed-optimizer", "--log-interval", "1", "--eval-iters", "0"]
RUN += ["--num-workers", "0", "--tensor-model-parallel-size", "2"]


def curve_of(tmp, *extra) -> list:
    tmp.mkdir(parents=True, exist_ok=True)
    run_pretrain(2, RUN + ["--metrics-file", str(tmp / "metrics.jsonl"), *extra])
    return curve(read_metrics(str(tmp / "metrics.jsonl")))


def test_recompute_with_dropout_trains_the_same_curve_bit_for_bit(tmp_path):
    """Dropout 0.1 on attention and hidden states (the defaults): a recomputed
    forward that drew other masks would change every gradient."""
    plain = curve_of(tmp_path / "plain")
    assert curve_of(tmp_path / "full", *FULL_UNIFORM) == plain
    assert curve_of(tmp_path / "selective", *SELECTIVE) == plain
    distributed = curve_of(
        tmp_path / "distributed", *FULL_UNIFORM, "--distribute-saved-activations"
    )
    assert distributed == plain
    # Negative control: the curve does depend on the dropout masks.
    assert curve_of(tmp_path / "other-seed", "--seed", "4321") != plain
