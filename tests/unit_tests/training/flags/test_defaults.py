"""Megatron's derived defaults (megatron/training/flags/defaults.py), parsed
in-process: what a command line leaves unset is filled as Megatron-LM
fills it, what it gives is kept, and what it cannot leave unset is
refused."""

import pytest

from megatron.training.flags import host
from megatron.training.arguments import parse_args
from tests.unit_tests.training.command_line import _config_error, _names_all, argv
from tests.unit_tests.training.flags.test_training import RECOMPUTE_BASE


@pytest.mark.parametrize(
    "hidden, heads, swiglu, expected",
    [
        (64, 4, False, 256),
        (96, 4, False, 384),
        (64, 4, True, 128),  # int(8*64/3/64)*64 = int(2.67)*64
        (100, 4, True, 256),  # int(266.7/64)*64
        (192, 4, True, 512),  # exact: 8*192/3 = 512
    ],
)
def test_ffn_hidden_size_default(hidden, heads, swiglu, expected):
    extra = ["--swiglu"] if swiglu else []
    config = parse_args(argv(*extra, hidden_size=hidden, num_attention_heads=heads), world_size=1)
    assert config.model.ffn_hidden_size == expected


def test_explicit_ffn_hidden_size_is_kept():
    config = parse_args(argv("--swiglu", "--ffn-hidden-size", "200"), world_size=1)
    assert config.model.ffn_hidden_size == 200


def test_max_position_embeddings_defaults_to_seq_length():
    config = parse_args(argv(seq_length=48), world_size=1)
    assert config.model.max_position_embeddings == 48
    config = parse_args(argv("--max-position-embeddings", "128", seq_length=48), world_size=1)
    assert config.model.max_position_embeddings == 128


@pytest.mark.parametrize(
    "world, tp, pp, mbs, dp",
    [
        (1, 1, 1, 2, 1),
        (4, 1, 1, 3, 4),
        (4, 2, 1, 2, 2),
        (8, 2, 2, 2, 2),
        (8, 1, 2, 1, 4),
    ],
)
def test_global_batch_defaults_to_micro_batch_times_dp(world, tp, pp, mbs, dp):
    config = parse_args(
        argv(
            "--tensor-model-parallel-size",
            str(tp),
            "--pipeline-model-parallel-size",
            str(pp),
            micro_batch_size=mbs,
        ),
        world_size=world,
    )
    assert config.data_parallel_size == dp
    assert config.batch.global_batch_size == mbs * dp


def test_explicit_global_batch_is_kept():
    config = parse_args(argv("--global-batch-size", "16"), world_size=2)
    assert config.batch.global_batch_size == 16


def test_lr_decay_iters_defaults_to_train_iters():
    assert parse_args(argv(train_iters=37), world_size=1).training.lr_decay_iters == 37
    config = parse_args(argv("--lr-decay-iters", "20", train_iters=37), world_size=1)
    assert config.training.lr_decay_iters == 20


def test_num_query_groups_follow_heads_without_gqa():
    config = parse_args(argv(num_attention_heads=8, hidden_size=64), world_size=1)
    assert config.model.num_query_groups == 8
    config = parse_args(
        argv("--group-query-attention", "--num-query-groups", "2", num_attention_heads=8),
        world_size=1,
    )
    assert config.model.num_query_groups == 2


def test_backend_is_gloo_without_cuda(monkeypatch):
    monkeypatch.setattr(host, "cuda_available", lambda: False)
    assert parse_args(argv(), world_size=1).parallel.distributed_backend == "gloo"
    # Even when nccl is asked for explicitly: there is no GPU to run it on.
    config = parse_args(argv("--distributed-backend", "nccl"), world_size=1)
    assert config.parallel.distributed_backend == "gloo"


def test_backend_is_nccl_with_cuda_unless_cpu(monkeypatch):
    monkeypatch.setattr(host, "cuda_available", lambda: True)
    monkeypatch.setattr(host, "gpu_count", lambda: 1)
    assert parse_args(argv(), world_size=1).parallel.distributed_backend == "nccl"
    assert parse_args(argv("--cpu"), world_size=1).parallel.distributed_backend == "gloo"


def test_both_train_iters_and_train_samples():
    message = _config_error(argv("--train-samples", "100"))
    _names_all(message, "--train-iters", "--train-samples")


def test_neither_train_iters_nor_train_samples():
    message = _config_error(argv(drop=("--train-iters",)))
    _names_all(message, "--train-iters", "--train-samples")


def test_sequence_parallel_without_tp_is_turned_off_with_a_warning(capsys):
    """As Megatron-LM (its LLaMA-3 example passes it at TP 1)."""
    assert parse_args(argv("--sequence-parallel"), world_size=2).parallel.sequence_parallel is False
    assert "disabling --sequence-parallel" in capsys.readouterr().out


def test_dynamic_loss_scaling_turns_the_nan_check_off_as_megatron_lm(capsys):
    assert parse_args(argv(), world_size=1).training.check_for_nan_in_loss_and_grad
    assert not parse_args(argv("--fp16"), world_size=1).training.check_for_nan_in_loss_and_grad
    assert "dynamic loss scaling" in capsys.readouterr().out
    static = parse_args(argv("--fp16", "--loss-scale", "1024"), world_size=1)
    assert static.training.check_for_nan_in_loss_and_grad


def test_the_deprecated_rotary_flag_selects_rope(capsys):
    config = parse_args(argv("--use-rotary-position-embeddings"), world_size=1)
    assert config.model.position_embedding_type == "rope"
    _names_all(capsys.readouterr().out, "WARNING:", "--position-embedding-type rope")


def test_recompute_activations_is_selective_recompute_as_megatron_lm():
    assert parse_args(RECOMPUTE_BASE, world_size=1).training.recompute_granularity is None
    t = parse_args(RECOMPUTE_BASE + ["--recompute-activations"], world_size=1).training
    assert t.recompute_granularity == "selective" and t.recompute_method is None
