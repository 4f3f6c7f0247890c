"""Every --tokenizer-type in real processes: pretrain_gpt.py trains on data
written with each kind (the embedding table is the vocabulary padded as
Megatron-LM pads it), and a node's zygote imports transformers only where a
rank may build Hugging Face's tokenizer. (The tokenizers themselves,
in-process, are in tests/unit_tests/training/test_tokenizer.py.)"""

import json
import os

import pytest

from tests.unit_tests.training.test_tokenizer import build, corpus, fields  # noqa: F401  (a fixture)

pytestmark = pytest.mark.integration

TRAINED_KINDS = [
    "GPT2BPETokenizer",
    "HuggingFaceTokenizer",
    "SentencePieceTokenizer",
    "GPTSentencePieceTokenizer",
    "Llama2Tokenizer",
    "TikTokenizer",
]


@pytest.mark.parametrize("kind", TRAINED_KINDS)
def test_pretrain_gpt_trains_on_data_of_each_kind(corpus, kind, tmp_path):  # noqa: F811  (the fixture)
    """preprocess_data writes the corpus with ``kind``, pretrain_gpt.py
    trains on it with the same flags: the embedding table is the
    tokenizer's vocabulary padded as Megatron-LM pads it, and the first loss
    is that of uniform guesses over it (small initial weights)."""
    import math

    from dist_utils import TINY_GPT, read_metrics, run_pretrain
    from tools import preprocess_data

    directory, vocabularies, texts = corpus
    source = tmp_path / "part.jsonl"
    source.write_text("".join(json.dumps({"text": t}) + "\n" for t in texts[:120]))
    flags = ["--tokenizer-type", kind]
    for name, value in fields(kind, vocabularies).items():
        flags += ["--" + name.replace("_", "-"), str(value)]
    prefix = preprocess_data.main(
        ["--input", str(source), "--output-prefix", str(tmp_path / "part"), "--append-eod", *flags]
    )["text"]
    size = build(kind, vocabularies).vocab_size
    metrics = tmp_path / "metrics.jsonl"
    out = run_pretrain(
        1,
        TINY_GPT
        + flags
        + ["--data-path", prefix, "--split", "98,2,0", "--train-iters", "3"]
        + ["--global-batch-size", "4", "--metrics-file", str(metrics)],
    )
    padded = -(-size // 128) * 128
    assert (
        f"padded vocab (size: {size}) with {padded - size} dummy tokens (new size: {padded})" in out
    )
    first = read_metrics(metrics)[0]["lm_loss"]
    assert abs(first - math.log(padded)) < 0.1, (first, math.log(padded))


@pytest.mark.parametrize(
    "flags, with_transformers",
    [
        (["--tokenizer-type", "ByteLevelTokenizer"], False),
        (["--tokenizer-type=HuggingFaceTokenizer"], True),
        (["--tokenizer-type", "NullTokenizer", "--use-checkpoint-args"], True),
    ],
)
def test_a_zygote_imports_transformers_only_for_ranks_that_may_need_it(flags, with_transformers):
    """A node's zygote imports the tokenizers for all its ranks: transformers
    (about 1.3 s of CPU) only where a rank may build Hugging Face's, and then
    offline, as build_tokenizer would."""
    import subprocess
    import sys

    probe = (
        "import sys, os; from megatron.training import cpu_compat; "
        "cpu_compat.import_megatron_core_without_cuda(); "  # as the zygote
        "from megatron.training.tokenizer import import_for_script_args; "
        f"import_for_script_args({['--lr', '1e-3', *flags]!r}); "
        "print(sys.modules.get('transformers') is not None, "
        "'megatron.core.tokenizers.text' in sys.modules, os.environ.get('HF_HUB_OFFLINE'))"
    )
    env = {k: v for k, v in os.environ.items() if not k.startswith(("HF_", "TRANSFORMERS_"))}
    out = subprocess.run(
        [sys.executable, "-W", "ignore", "-c", probe], env=env, capture_output=True, text=True
    )
    assert out.returncode == 0, out.stderr
    imported, package, offline = out.stdout.split()
    assert (imported, package) == (str(with_transformers), "True")
    assert offline == ("1" if with_transformers else "None")
