"""Megatron-LM's training API (megatron/training/megatron_lm.py, utils.py),
in-process: the names a Megatron-LM script imports are here, bad flags and
args_defaults end a script as Megatron-LM's, args_defaults fill only the
flags left unset, and what a script's callbacks cannot do here is said. The
scripts that run on ranks are in tests/functional_tests/test_megatron_lm_api.py."""

import sys

import pytest

from megatron.training import megatron_lm


def test_the_api_names_megatron_lm_scripts_import_are_here():
    import megatron.training as training
    from megatron.training import arguments, utils

    for name in ("pretrain", "get_args", "get_timers", "get_tokenizer", "print_rank_0"):
        assert callable(getattr(training, name))
    assert callable(arguments.core_transformer_config_from_args)
    for name in ("get_batch_on_this_tp_rank", "get_batch_on_this_cp_rank"):
        assert callable(getattr(utils, name))
    with pytest.raises(AttributeError):
        training.no_such_name


def test_bad_flags_end_a_script_with_exit_code_2(monkeypatch, capsys):
    from megatron.core.enums import ModelType

    monkeypatch.setattr(sys, "argv", ["script.py", "--num-layer", "4"])
    with pytest.raises(SystemExit) as ended:
        megatron_lm.pretrain(None, None, ModelType.encoder_or_decoder, None)
    assert ended.value.code == 2
    assert "did you mean --num-layers?" in capsys.readouterr().err
    monkeypatch.setattr(sys, "argv", ["script.py"])
    with pytest.raises(SystemExit):
        megatron_lm.pretrain(None, None, ModelType.encoder_or_decoder, None, args_defaults={"x": 1})
    assert "args_defaults names x" in capsys.readouterr().err


PARSED = [
    *("--num-layers", "4", "--hidden-size", "64", "--num-attention-heads", "4"),
    *("--seq-length", "32", "--micro-batch-size", "2", "--train-iters", "4", "--lr", "1e-3"),
    *("--mock-data", "--tokenizer-type", "NullTokenizer", "--vocab-size", "128"),
]


def test_args_defaults_fill_only_the_flags_left_unset(capsys):
    """As Megatron-LM: a script's default where the value is still None; a
    value given wins, with a warning where it differs."""
    from megatron.training.arguments import parse_args

    defaults = {"ffn_hidden_size": 96, "tokenizer_type": "GPT2BPETokenizer"}
    config = parse_args(PARSED, world_size=1, defaults=defaults)
    assert config.model.ffn_hidden_size == 96
    assert config.tokenizer.tokenizer_type == "NullTokenizer"
    assert "args_defaults tokenizer_type='GPT2BPETokenizer' not applied" in capsys.readouterr().out


def test_what_a_scripts_callbacks_cannot_do_here_is_said(monkeypatch, capsys):
    from megatron.core.enums import ModelType

    vpp = PARSED + ["--pipeline-model-parallel-size", "2"]
    vpp += ["--num-layers-per-virtual-pipeline-stage", "1", "--global-batch-size", "4"]
    monkeypatch.setattr(sys, "argv", ["script.py", *vpp])
    monkeypatch.setenv("WORLD_SIZE", "2")
    with pytest.raises(SystemExit) as ended:
        megatron_lm.pretrain(None, None, ModelType.encoder_or_decoder, None)
    assert ended.value.code == 2
    assert "virtual pipeline stages with a script's datasets provider" in capsys.readouterr().err
