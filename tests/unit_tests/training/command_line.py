"""A minimal valid pretrain_gpt.py command line, and reading what its parse
refuses: shared by the tests of the parser and of its checks (and
tests/functional_tests/test_arguments.py)."""

import json

import pytest

from megatron.training.arguments import ConfigError, parse_args

BASE = {
    "--num-layers": "4",
    "--hidden-size": "64",
    "--num-attention-heads": "4",
    "--seq-length": "32",
    "--micro-batch-size": "2",
    "--train-iters": "10",
    "--lr": "1e-3",
    "--mock-data": None,
    "--tokenizer-type": "ByteLevelTokenizer",
}


def argv(*extra, drop=(), **overrides):
    """A minimal valid command line; ``overrides`` replace base values
    (num_layers=8 -> --num-layers 8), ``drop`` removes base flags, ``extra``
    is appended verbatim."""
    base = dict(BASE)
    for flag in drop:
        del base[flag]
    for name, value in overrides.items():
        base["--" + name.replace("_", "-")] = str(value)
    out = []
    for flag, value in base.items():
        out.append(flag)
        if value is not None:
            out.append(value)
    return out + list(extra)


def _write_dataset(directory, texts):
    from tools import preprocess_data

    directory.mkdir(parents=True, exist_ok=True)
    src = directory / "in.jsonl"
    src.write_text("".join(json.dumps({"text": t}) + "\n" for t in texts), encoding="utf-8")
    prefixes = preprocess_data.main(
        ["--input", str(src), "--output-prefix", str(directory / "tiny"), "--append-eod"]
        + ["--tokenizer-type", "ByteLevelTokenizer"]
    )
    return prefixes["text"]


def _config_error(args, world_size=1):
    with pytest.raises(ConfigError) as info:
        parse_args(args, world_size=world_size)
    return str(info.value)


def _names_all(message, *flags):
    missing = [f for f in flags if f not in message]
    assert not missing, f"message does not name {missing}: {message!r}"


# name -> (values after the flag, expected parsed value, companion argv, drop, world size)
# PP 2 with 2 microbatches per replica (world 2), and two virtual stages.
PP2 = ["--pipeline-model-parallel-size", "2", "--global-batch-size", "4"]
VPP2 = ["--num-virtual-stages-per-pipeline-rank", "2"]
# Batched sends and receives need PP > 2: PP 3, 6 layers, 3 microbatches.
PP3 = ["--pipeline-model-parallel-size", "3", "--num-layers", "6", "--global-batch-size", "6"]
