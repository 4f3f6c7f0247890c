"""The checks of the numeric precision (megatron/training/flags/precision.py),
parsed in-process: bf16 and fp16 are one or the other."""

from tests.unit_tests.training.command_line import _config_error, _names_all, argv


def test_bf16_with_fp16():
    _names_all(_config_error(argv("--bf16", "--fp16")), "--bf16", "--fp16")
