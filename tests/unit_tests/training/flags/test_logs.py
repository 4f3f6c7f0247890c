"""The checks of logging (megatron/training/flags/logs.py), parsed
in-process: the logging level is Megatron-LM's, a variable that is no
number refused before anything starts."""

from megatron.training.arguments import parse_args
from tests.unit_tests.training.command_line import _config_error, _names_all, argv


def test_the_logging_level_is_megatron_lms(monkeypatch):
    """--logging-level, else MEGATRON_LOGGING_LEVEL, sets the root logger's
    level (megatron-core's loggers follow it); a variable that is no number
    is refused before anything starts."""
    from megatron.training.initialize import logging_level

    monkeypatch.setenv("MEGATRON_LOGGING_LEVEL", "30")
    assert logging_level(parse_args(argv(), world_size=1)) == 30
    assert logging_level(parse_args(argv("--logging-level", "40"), world_size=1)) == 40
    monkeypatch.setenv("MEGATRON_LOGGING_LEVEL", "loud")
    _names_all(_config_error(argv()), "MEGATRON_LOGGING_LEVEL=loud")
    assert logging_level(parse_args(argv("--logging-level", "10"), world_size=1)) == 10
    monkeypatch.delenv("MEGATRON_LOGGING_LEVEL")
    assert logging_level(parse_args(argv(), world_size=1)) is None
