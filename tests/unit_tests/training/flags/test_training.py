"""The checks of the training loop (megatron/training/flags/training.py),
parsed in-process: activation recompute's settings refused where they
cannot run or ignored with a warning, the learning-rate schedule's warmup
and its units (iterations or samples, not both), deterministic mode, and
the schedule's source. That recompute really runs and changes nothing is in
tests/functional_tests/test_recompute.py."""

import pytest

from dist_utils import MOCK_GPT
from megatron.training.arguments import ConfigError, parse_args
from megatron.training.flags import host
from tests.unit_tests.training.command_line import _config_error, _names_all, argv
from tests.unit_tests.training.test_schedule import config

RECOMPUTE_BASE = MOCK_GPT + ["--num-layers", "4"]
FULL_UNIFORM = ["--recompute-granularity", "full", "--recompute-method", "uniform"]
FULL_UNIFORM += ["--recompute-num-layers", "1"]
FULL_BLOCK = ["--recompute-granularity", "full", "--recompute-method", "block"]
FULL_BLOCK += ["--recompute-num-layers", "2"]
SELECTIVE = ["--recompute-granularity", "selective"]


def _error(extra, world_size=1) -> str:
    with pytest.raises(ConfigError) as info:
        parse_args(RECOMPUTE_BASE + extra, world_size=world_size)
    return str(info.value)


@pytest.mark.parametrize(
    "extra, world, words",
    [
        (SELECTIVE + ["--recompute-method", "block"], 1, "goes with --recompute-granularity full"),
        (["--recompute-granularity", "full"], 1, "megatron-core refuses these settings"),
        (FULL_UNIFORM + ["--distribute-saved-activations"], 1, "needs --recompute-granularity"),
        (SELECTIVE + ["--recompute-modules", "everything"], 1, "megatron-core refuses"),
    ],
)
def test_settings_that_cannot_run_are_refused(extra, world, words):
    assert words in _error(extra, world)


def test_recompute_settings_without_a_granularity_are_ignored_with_a_warning(capsys):
    """As Megatron-LM (megatron-core reads them only with a granularity);
    one of its CI configs passes --recompute-num-layers alone."""
    config = parse_args(
        RECOMPUTE_BASE + ["--recompute-method", "uniform", "--recompute-num-layers", "2"],
        world_size=1,
    )
    printed = capsys.readouterr().out
    assert (
        "--recompute-method, --recompute-num-layers have no effect without --recompute-granularity"
        in printed
    )
    assert config.training.recompute_granularity is None


@pytest.mark.parametrize(
    "extra",
    [
        ["--lr-warmup-iters", "10"],  # == train_iters
        ["--lr-warmup-iters", "50"],
        ["--lr-warmup-iters", "8", "--lr-decay-iters", "5"],
    ],
)
def test_warmup_not_shorter_than_decay(extra):
    message = _config_error(argv(*extra, train_iters=10))
    _names_all(message, "--lr-warmup-iters", "--lr-decay-iters")


def test_warmup_fraction_not_below_one_names_the_fraction():
    message = _config_error(argv("--lr-warmup-fraction", "1.0"))
    _names_all(message, "--lr-warmup-fraction")


def test_deterministic_mode_refuses_what_megatron_lm_refuses(monkeypatch):
    _names_all(
        _config_error(argv("--deterministic-mode", "--cross-entropy-loss-fusion")),
        "--cross-entropy-loss-fusion",
    )
    monkeypatch.setattr(host, "cuda_available", lambda: True)
    monkeypatch.setattr(host, "gpu_count", lambda: 1)
    monkeypatch.delenv("NCCL_ALGO", raising=False)
    _names_all(_config_error(argv("--deterministic-mode")), "NCCL_ALGO", "Ring")
    monkeypatch.setenv("NCCL_ALGO", "Ring")
    assert parse_args(argv("--deterministic-mode"), world_size=1).training.deterministic_mode


def test_the_schedules_source_is_one_or_the_other():
    both = argv("--use-checkpoint-opt_param-scheduler", "--override-opt_param-scheduler")
    _names_all(_config_error(both), "--override-opt_param-scheduler")


@pytest.mark.parametrize(
    "flags, message",
    [
        (
            ["--train-samples", "100", "--lr-warmup-iters", "2"],
            "--lr-warmup-iters goes with --train-iters",
        ),
        (
            ["--train-samples", "100", "--lr-decay-iters", "9"],
            "--lr-decay-iters goes with --train-iters",
        ),
        (
            ["--train-iters", "10", "--lr-decay-samples", "9"],
            "--lr-decay-samples goes with --train-samples",
        ),
        (
            ["--train-iters", "10", "--train-samples", "80"],
            "exactly one of --train-iters and --train-samples",
        ),
        (["--train-samples", "7"], "less than one global batch"),
        (
            ["--train-samples", "100", "--lr-warmup-samples", "200"],
            "lower --lr-warmup-samples or raise --lr-decay-samples",
        ),
    ],
)
def test_the_two_units_do_not_mix(flags, message):
    with pytest.raises(ConfigError, match=message):
        config(*flags)
