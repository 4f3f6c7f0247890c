"""The checks of the batch (megatron/training/flags/batch.py), parsed
in-process: a global batch that micro batch x DP does not divide, and a
ramp megatron-core would reject, refused before training."""

import pytest

from megatron.training.arguments import ConfigError, parse_args
from tests.unit_tests.training.command_line import _config_error, _names_all, argv
from tests.unit_tests.training.test_schedule import RAMP, ramp_config


def test_global_batch_not_divisible_by_micro_batch_times_dp():
    message = _config_error(argv("--global-batch-size", "6", micro_batch_size=2), world_size=2)
    _names_all(message, "--global-batch-size", "--micro-batch-size")
    # Divisible by the micro batch, not by micro batch x DP.
    message = _config_error(argv("--global-batch-size", "10", micro_batch_size=2), world_size=2)
    _names_all(message, "--global-batch-size", "--micro-batch-size")
    # The same with DP 1 is fine.
    assert (
        parse_args(
            argv("--global-batch-size", "10", micro_batch_size=2), world_size=1
        ).batch.global_batch_size
        == 10
    )


@pytest.mark.parametrize(
    "flags, message",
    [
        (
            ["--train-iters", "10"] + RAMP[2:],
            "--rampup-batch-size goes with --train-samples",
        ),
        (RAMP[:-3] + ["16", "4", "40"], "give a start between 0 and --global-batch-size 16"),
        (RAMP[:-3] + ["4", "5", "40"], "increment 5 must be positive and divide"),
        (RAMP[:-3] + ["4", "4", "0"], "ramp of 0 samples must be positive"),
        # 6 is not a multiple of micro-batch 2 x DP 2
        (RAMP[:-3] + ["6", "2", "40"], r"reaches batch sizes \[6, 10, 14\]"),
    ],
)
def test_a_ramp_megatron_core_would_reject_is_refused_before_training(flags, message):
    with pytest.raises(ConfigError, match=message):
        ramp_config(*flags)
