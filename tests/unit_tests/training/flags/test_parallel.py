"""The checks of the parallel layout (megatron/training/flags/parallel.py),
parsed in-process: the world's split, the distributed optimizer's
instances and overlaps, and more ranks than GPUs refused unless they
share one."""

import pytest

from megatron.training.flags import host
from megatron.training.arguments import ConfigError, parse_args
from megatron.training.gpu_sharing import HOSTID, SHARE_ENV
from tests.unit_tests.training.command_line import _config_error, _names_all, argv


def test_partial_distributed_optimizers_follow_megatron_cores_rules():
    two = ["--num-distributed-optimizer-instances", "2"]
    _names_all(_config_error(argv(*two), world_size=2), two[0], "--use-distributed-optimizer")
    message = _config_error(argv(*two, "--use-distributed-optimizer"), world_size=3)
    _names_all(message, two[0], "does not divide the 3 data-parallel ranks")


def test_world_not_divisible_by_tp_times_pp():
    message = _config_error(argv("--tensor-model-parallel-size", "2"), world_size=3)
    _names_all(message, "--tensor-model-parallel-size", "--pipeline-model-parallel-size")
    message = _config_error(
        argv("--tensor-model-parallel-size", "2", "--pipeline-model-parallel-size", "2"),
        world_size=6,
    )
    _names_all(message, "--tensor-model-parallel-size", "--pipeline-model-parallel-size")


def test_overlap_param_gather_without_distributed_optimizer():
    message = _config_error(argv("--overlap-param-gather", "--overlap-grad-reduce"))
    _names_all(message, "--overlap-param-gather", "--use-distributed-optimizer")


def test_overlapping_the_all_gather_with_the_step_takes_megatron_lms_rules():
    flag = "--overlap-param-gather-with-optimizer-step"
    ready = ["--use-distributed-optimizer", "--overlap-grad-reduce", "--overlap-param-gather"]
    interleaved = ["--pipeline-model-parallel-size", "2", "--num-layers-per-virtual-pipeline-stage"]
    interleaved += ["1", "--num-layers", "4", "--global-batch-size", "8"]
    torch_format = ["--ckpt-format", "torch"]
    config = parse_args(argv(flag, *ready, *interleaved, *torch_format), world_size=4)
    assert config.parallel.overlap_param_gather_with_optimizer_step
    for dropped, says in [
        ("--overlap-param-gather", "--overlap-param-gather"),
        ("--num-layers-per-virtual-pipeline-stage", "interleaved"),
        ("--ckpt-format", "torch_dist"),
    ]:
        args = [flag, *ready, *interleaved, *torch_format]
        cut = args.index(dropped)
        args = args[:cut] + args[cut + (1 if dropped.startswith("--overlap") else 2) :]
        _names_all(_config_error(argv(*args), world_size=4), flag, says)


ARGS = [
    *("--num-layers", "2", "--hidden-size", "64", "--num-attention-heads", "4"),
    *("--seq-length", "32", "--micro-batch-size", "2", "--train-iters", "4", "--lr", "1e-3"),
    *("--mock-data", "--tokenizer-type", "NullTokenizer", "--vocab-size", "128"),
]


@pytest.fixture
def gpu_host(monkeypatch):
    monkeypatch.setattr(host, "cuda_available", lambda: True)
    monkeypatch.setattr(host, "gpu_count", lambda: 1)
    monkeypatch.setenv("LOCAL_WORLD_SIZE", "2")
    monkeypatch.delenv(SHARE_ENV, raising=False)


def test_more_ranks_than_gpus_is_refused_at_parse_time(gpu_host, monkeypatch):
    with pytest.raises(ConfigError, match="local rank 1 has no GPU of its own"):
        parse_args(ARGS, world_size=2)
    monkeypatch.setenv(SHARE_ENV, HOSTID)
    assert parse_args(ARGS, world_size=2).parallel.distributed_backend == "nccl"
    monkeypatch.setenv(SHARE_ENV, "yes")
    with pytest.raises(ConfigError, match="choose one of hostid, multi-rank"):
        parse_args(ARGS, world_size=2)
