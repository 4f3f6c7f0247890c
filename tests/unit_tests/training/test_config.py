"""The training configuration's dataclasses (megatron/training/config.py):
Megatron-LM's flag names and defaults."""

from tests.unit_tests.training.test_checkpointing import config


def test_megatron_lm_flag_names_and_defaults():
    c = config().checkpoint
    assert c.ckpt_format == "torch_dist" and c.ckpt_fully_parallel_save is True
    assert c.dist_ckpt_strictness == "assume_ok_unexpected"
    assert config("--no-ckpt-fully-parallel-save").checkpoint.ckpt_fully_parallel_save is False
