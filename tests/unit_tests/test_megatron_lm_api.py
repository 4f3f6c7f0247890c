"""Megatron-LM's training API (megatron/training/megatron_lm.py, utils.py):
a script written against it (megatron_lm_script.py, every call of the API
this build offers) runs unchanged on 8 ranks as under torchrun, and with
--deadpool under deadpool-launch, where a node is killed and the curve and
every rank's final state equal the failure-free run's bit for bit."""

import os
import sys

import pytest

from dist_utils import (
    captured,
    assert_same_state,
    checkpoint_state,
    curve,
    forkrun,
    launch_command,
    leftovers,
    read_metrics,
)
from megatron.training import megatron_lm

SCRIPT = os.path.join("tests", "unit_tests", "megatron_lm_script.py")
# TP2 x PP2 x DP2 on 8 ranks (DP peers on different nodes of 4 under deadpool-launch).
FLAGS = [
    *("--num-layers", "4", "--hidden-size", "64", "--num-attention-heads", "4"),
    *("--seq-length", "32", "--micro-batch-size", "2", "--global-batch-size", "8"),
    *("--lr", "1e-3", "--lr-warmup-iters", "2", "--train-iters", "6", "--log-interval", "1"),
    *("--eval-iters", "0", "--split", "98,2,0", "--tokenizer-type", "ByteLevelTokenizer"),
    *("--tensor-model-parallel-size", "2", "--pipeline-model-parallel-size", "2"),
    *("--use-tp-pp-dp-mapping", "--use-distributed-optimizer", "--num-workers", "0"),
]


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


@pytest.mark.integration
def test_a_megatron_lm_script_trains_on_8_ranks_as_under_torchrun(tmp_path, corpus_prefix):
    metrics = tmp_path / "metrics.jsonl"
    flags = FLAGS + ["--data-path", corpus_prefix, "--metrics-file", str(metrics)]
    proc = forkrun(8, flags, script=SCRIPT)
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    assert "building GPT model ..." in proc.stdout  # its print_rank_0, once
    assert proc.stdout.count("building GPT model ...") == 1
    losses = [m["lm_loss"] for m in read_metrics(metrics)]
    assert len(losses) == 6 and losses[-1] < losses[0]


def launch(tmp, corpus, spares, faults):
    args = FLAGS + ["--data-path", corpus, "--save", str(tmp / "ckpt")]
    args += ["--metrics-file", str(tmp / "metrics.jsonl"), "--deadpool"]
    args += ["--deadpool-events", str(tmp / "events.jsonl"), "--deadpool-heartbeat-timeout", "5"]
    args += [f"--deadpool-inject={fault}" for fault in faults]
    launcher = ["--standalone", "--nnodes", "2", "--spare-nodes", str(spares)]
    launcher += ["--nproc-per-node", "4"]
    proc = captured(launch_command(launcher, args, script=SCRIPT), timeout=600)
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-6000:]
    assert not leftovers(tmp)


@pytest.mark.integration
def test_a_megatron_lm_script_recovers_under_deadpool_launch_bit_for_bit(tmp_path, corpus_prefix):
    """Node 1 (the second pipeline stage of both replicas) is killed in
    backward of iteration 3: the spare node's ranks build the script's
    datasets and model through its own providers and take the ranks over."""
    reference, recovered = tmp_path / "reference", tmp_path / "recovered"
    launch(reference, corpus_prefix, 0, [])
    launch(recovered, corpus_prefix, 1, ["kill:node=1:iter=3:phase=backward"])
    got, want = read_metrics(recovered / "metrics.jsonl"), read_metrics(reference / "metrics.jsonl")
    assert [m["iteration"] for m in got] == list(range(1, 7))
    assert curve(got) == curve(want)
    assert_same_state(
        checkpoint_state(str(recovered / "ckpt")), checkpoint_state(str(reference / "ckpt"))
    )
    events = (recovered / "events.jsonl").read_text()
    assert '"event": "recovered"' in events
