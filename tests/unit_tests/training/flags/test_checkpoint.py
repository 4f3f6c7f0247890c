"""The checks of checkpointing (megatron/training/flags/checkpoint.py), parsed
in-process: a --save directory that cannot be written, a pretrained
checkpoint that is not there, non-persistent checkpoints' type, and what
--ckpt-format torch can write."""

import pytest

from megatron.training.arguments import ConfigError
from tests.unit_tests.training.test_checkpointing import config
from tests.unit_tests.training.test_legacy_checkpoint import pp2_config


def test_an_unwritable_save_directory_is_refused_before_anything_starts(tmp_path):
    from megatron.training.arguments import ConfigError

    blocker = tmp_path / "a-file"
    blocker.write_text("")
    with pytest.raises(ConfigError, match="--save .* cannot be written"):
        config("--save", str(blocker / "ckpt"))
    assert config("--save", str(tmp_path / "new" / "ckpt")).checkpoint.save
    assert not (tmp_path / "new").exists()  # checked, not created


def test_a_pretrained_checkpoint_must_exist(tmp_path):
    with pytest.raises(Exception, match="--pretrained-checkpoint .* holds no checkpoint"):
        config("--pretrained-checkpoint", str(tmp_path))


def test_non_persistent_checkpoints_need_their_type_and_global_is_the_one():
    with pytest.raises(Exception, match="needs --non-persistent-ckpt-type global"):
        config("--save", "s", "--non-persistent-save-interval", "2")
    with pytest.raises(Exception, match="local and in_memory need nvidia-resiliency-ext"):
        config("--save", "s", "--non-persistent-ckpt-type", "local")


def test_ckpt_format_torch_saves_in_the_foreground_without_experts(tmp_path):
    save = ["--save", str(tmp_path / "out"), "--ckpt-format", "torch"]
    assert pp2_config(*save).checkpoint.ckpt_format == "torch"
    with pytest.raises(ConfigError, match="--async-save with --ckpt-format torch"):
        pp2_config(*save, "--async-save", "--use-persistent-ckpt-worker")
    with pytest.raises(ConfigError, match="--ckpt-format torch_dcp cannot be written or read"):
        pp2_config("--ckpt-format", "torch_dcp")
