"""Megatron-LM's example scripts (examples/gpt3, examples/llama: copies scaled
down in size only) run here on 8 CPU ranks with a real tokenizer of their
kind and real .bin/.idx data, and write TensorBoard event files. Their flag
sets are upstream's; a flag refused on CPU is refused with its reason, which
the test reads before it runs the script without that flag.

The launcher is replaced by a stand-in that records what the script hands
it, so the flags are exactly the script's; torchrun's own parser reads the
launch line, and the run has as many ranks as it says, forked as torchrun
would start them (forkrun.py)."""

import json
import math
import os
import stat
import subprocess
import sys
from typing import List, Tuple

import pytest

from dist_utils import REPO, captured, forkrun, tensorboard_scalars, worker_env
from deadpool_ext.control.ports import free_port
from megatron.training.arguments import ConfigError, parse_args
from torch.distributed.run import get_args_parser
from tests.unit_tests.test_flag_parity import GPT3_175B, LLAMA3_8B_FP8, MIXTRAL_8X7B

pytestmark = pytest.mark.integration

GPT3 = os.path.join("examples", "gpt3", "train_gpt3_175b_distributed.sh")
LLAMA3 = os.path.join("examples", "llama", "train_llama3_8b_h100_fp8.sh")
MIXTRAL = os.path.join("examples", "mixtral", "train_mixtral_8x7b_distributed.sh")


def script_argv(tmp_path, script: str, args: List[str], env=None) -> Tuple[List[str], List[str]]:
    """(launcher arguments, pretrain_gpt.py arguments) that ``script`` runs."""
    bin_dir = tmp_path / "recorder"
    bin_dir.mkdir(exist_ok=True)
    recorder = bin_dir / "torchrun"
    recorder.write_text(
        "#!/bin/sh\n"
        f'exec {sys.executable} -c "import json, sys; '
        'json.dump(sys.argv[2:], open(sys.argv[1], \'w\'))" "$ARGV_OUT" "$@"\n'
    )
    recorder.chmod(recorder.stat().st_mode | stat.S_IEXEC)
    out = tmp_path / "argv.json"
    run_env = dict(worker_env(), PATH=f"{bin_dir}{os.pathsep}{os.environ['PATH']}")
    run_env.update(ARGV_OUT=str(out), MASTER_PORT=str(free_port()), **(env or {}))
    subprocess.run(["bash", script, *args], cwd=REPO, env=run_env, check=True)
    with open(out) as f:
        argv = json.load(f)
    at = argv.index("pretrain_gpt.py")
    return argv[:at], argv[at + 1 :]


def flags(argv: List[str]) -> set:
    return {a for a in argv if a.startswith("--")}


def without(argv: List[str], *names: str) -> List[str]:
    """argv with the flags ``names`` and their values taken out."""
    out, skipping = [], False
    for a in argv:
        if a.startswith("--"):
            skipping = a in names
        if not skipping:
            out.append(a)
    return out


def refusals(argv: List[str], expected: dict) -> List[str]:
    """Parse as the 8 ranks would; each refusal must be one of ``expected``
    (flag -> words of its reason, and the flags it takes out with it). Returns
    the arguments left once every refused flag is out."""
    seen = []
    while True:
        try:
            parse_args(argv, world_size=8)
            return argv, seen
        except ConfigError as error:
            message = str(error)
            match = [f for f in expected if f in message and expected[f][0] in message]
            assert len(match) == 1, message
            seen.append(match[0])
            argv = without(argv, *expected[match[0]][1])


def launch(launcher: List[str], argv: List[str]) -> subprocess.CompletedProcess:
    """The script's launch line read by torchrun's own parser (one node),
    its ranks forked as torchrun would start them (forkrun.py)."""
    line = get_args_parser().parse_args([*launcher, "pretrain_gpt.py"])
    assert line.nnodes == "1", line.nnodes
    proc = forkrun(int(line.nproc_per_node), argv, timeout=600)
    assert proc.returncode == 0, f"{proc.stdout[-3000:]}\n{proc.stderr[-5000:]}"
    return proc


def test_the_gpt3_175b_script_scaled_down_trains_with_gpt2_bpe(corpus_prefix, tmp_path):
    data = os.path.dirname(corpus_prefix)
    gpt2 = os.path.join(data, "tokenizers", "gpt2")
    ckpt, tb = tmp_path / "ckpt", tmp_path / "tb"
    args = [str(ckpt), str(tb), os.path.join(gpt2, "vocab.json"), os.path.join(gpt2, "merges.txt")]
    args.append(os.path.join(data, "corpus_gpt2_text_document"))
    launcher, argv = script_argv(tmp_path, GPT3, args)
    # Upstream's flags, but the schedule in samples (see the script's comment) ...
    in_samples = {"--train-samples", "--lr-decay-samples"}
    assert flags(argv) - in_samples == set(GPT3_175B.split()) - {
        "--train-iters",
        "--lr-decay-iters",
    }
    # ... which Megatron-LM asks for as well: the original is refused, with the reason.
    original = without(argv, *in_samples) + ["--train-iters", "18", "--lr-decay-iters", "12"]
    with pytest.raises(ConfigError, match="--rampup-batch-size goes with --train-samples"):
        parse_args(original, world_size=8)

    output = launch(launcher, argv).stdout
    assert "iteration       18/      18 |" in output and "global batch size:    12 |" in output
    scalars = tensorboard_scalars(str(tb))
    assert [step for step, _ in scalars["lm loss"]] == list(range(1, 19))
    assert [size for _, size in scalars["batch-size"]][:8] == [4, 4, 4, 4, 8, 8, 12, 12]
    assert "lm loss validation" in scalars
    assert (ckpt / "latest_checkpointed_iteration.txt").read_text().strip() == "18"


LLAMA3_REFUSED_ON_CPU = {
    # flag: (words of its reason, the flags that go out with it)
    "--fp8-format": (
        "Transformer Engine's FP8",
        ("--fp8-format", "--fp8-amax-history-len", "--fp8-amax-compute-algo", "--fp8-param-gather"),
    ),
    "--attention-backend": ("fused is torch's memory-efficient", ("--attention-backend",)),
    "--apply-layernorm-1p": ("zero-centred", ("--apply-layernorm-1p",)),
    "--profile": ("nsys", ("--profile", "--profile-step-start", "--profile-step-end")),
}


def tokenized_corpus(corpus_prefix, tmp_path, tokenizer_type: str, model: str) -> str:
    """The embedded corpus as .bin/.idx with a tokenizer of ``make data``."""
    data = os.path.dirname(corpus_prefix)
    prefix = str(tmp_path / f"corpus_{tokenizer_type}")
    proc = captured(
        [sys.executable, "tools/preprocess_data.py", "--input", os.path.join(data, "corpus.jsonl")]
        + ["--output-prefix", prefix, "--tokenizer-type", tokenizer_type]
        + ["--tokenizer-model", model, "--append-eod"],
        timeout=300,
    )
    assert proc.returncode == 0, proc.stderr[-3000:]
    return prefix


def test_the_llama3_8b_fp8_script_scaled_down_trains_with_hugging_face(
    corpus_prefix, tmp_path, capsys
):
    data = os.path.dirname(corpus_prefix)
    tokenizer = os.path.join(data, "tokenizers", "hf")
    prefix = tokenized_corpus(corpus_prefix, tmp_path, "HuggingFaceTokenizer", tokenizer)
    ckpt, tb = tmp_path / "ckpt", tmp_path / "tb"
    args = [str(ckpt), str(tb), tokenizer, prefix + "_text_document"]
    cache = {"DATA_CACHE_PATH": str(tmp_path / "cache")}
    launcher, argv = script_argv(tmp_path, LLAMA3, args, env=cache)
    _, mock = script_argv(tmp_path, LLAMA3, [str(ckpt), str(tb)], env=cache)
    # Every flag of upstream's script, over its two data branches (its
    # --pipeline-model-parallel-size is in a comment).
    assert flags(argv) | flags(mock) | {"--pipeline-model-parallel-size"} == set(
        LLAMA3_8B_FP8.split()
    )
    left, refused = refusals(argv, LLAMA3_REFUSED_ON_CPU)
    assert sorted(refused) == sorted(LLAMA3_REFUSED_ON_CPU)
    # Megatron-LM's own switch (DTYPE) takes the FP8 flags out as well.
    _, bf16 = script_argv(tmp_path, LLAMA3, args, env=dict(cache, DTYPE="bf16"))
    assert bf16 == without(argv, *LLAMA3_REFUSED_ON_CPU["--fp8-format"][1])
    # Its mock-data branch gives --tiktoken-pattern to NullTokenizer, which
    # Megatron-LM ignores: taken here, with a warning naming it.
    parse_args(
        without(mock, *(f for _, fs in LLAMA3_REFUSED_ON_CPU.values() for f in fs)),
        world_size=8,
    )
    assert "--tiktoken-pattern has no effect" in capsys.readouterr().out

    output = launch(launcher, left).stdout
    assert (
        "iteration       10/      10 |" in output and "throughput per GPU (TFLOP/s/GPU)" in output
    )
    scalars = tensorboard_scalars(str(tb))
    assert [step for step, _ in scalars["lm loss"]] == list(range(1, 11))
    assert (ckpt / "latest_checkpointed_iteration.txt").read_text().strip() == "10"


def test_the_mixtral_8x7b_script_scaled_down_trains_its_moe_with_sentencepiece(
    corpus_prefix, tmp_path
):
    """Eight experts, top-2, all-to-all over EP 4 with PP 2, Llama-2's
    SentencePiece tokenizer; the grouped GEMM refused on CPU first."""
    model = os.path.join(os.path.dirname(corpus_prefix), "tokenizers", "sentencepiece.model")
    prefix = tokenized_corpus(corpus_prefix, tmp_path, "Llama2Tokenizer", model)
    ckpt = tmp_path / "ckpt"
    args = [str(ckpt), model, prefix + "_text_document"]
    launcher, argv = script_argv(tmp_path, MIXTRAL, args)
    # Upstream's W&B flags come with a W&B key (recorded only: the run has none).
    _, with_wandb = script_argv(tmp_path, MIXTRAL, args, env={"WANDB_API_KEY": "recorded"})
    assert flags(argv) | flags(with_wandb) == set(MIXTRAL_8X7B.split())
    left, refused = refusals(argv, {"--moe-grouped-gemm": ("GPU kernel", ("--moe-grouped-gemm",))})
    assert refused == ["--moe-grouped-gemm"]

    output = launch(launcher, left).stdout
    lines = [line for line in output.splitlines() if "consumed samples:" in line]
    assert len(lines) == 8 and all("load_balancing_loss:" in line for line in lines)
    assert "validation loss at iteration 8 on test set" in output
    scalars = tensorboard_scalars(str(ckpt / "tensorboard"))
    losses = [value for _, value in scalars["lm loss"]]
    # Upstream's learning rate barely moves it in 8 iterations: from ln(1024 ids).
    assert len(losses) == 8 and abs(losses[0] - math.log(1024)) < 0.1
    assert [step for step, _ in scalars["load_balancing_loss"]] == list(range(1, 9))
    assert (ckpt / "latest_checkpointed_iteration.txt").read_text().strip() == "8"
