"""Tests for the tokenizer builder, tools/preprocess_data.py and
tools/prepare_corpus.py, in-process. (preprocess_data.py's worker
processes are tested in tests/functional_tests/test_data_tools.py.)"""

import importlib.util
import json
import re

import pytest

from megatron.core.datasets.indexed_dataset import IndexedDataset
from megatron.training import tokenizer as tokenizer_module
from megatron.training.config import TokenizerConfig
from megatron.training.tokenizer import TOKENIZER_TYPES, build_tokenizer, check_tokenizer
from tools import prepare_corpus, preprocess_data

TEXTS = ["Hello world.", "", "Ünïcødé text: naïve café ☕", "a\nmulti-line\ndocument"]


def _read_documents(prefix):
    """All documents of an indexed dataset as lists of ints."""
    dataset = IndexedDataset(prefix)
    # .tolist() copies out of the mmap before `dataset` (and its mapping) goes away.
    return [dataset[i].tolist() for i in range(len(dataset))]


def _write_jsonl(path, records):
    path.write_text("".join(json.dumps(r) + "\n" for r in records), encoding="utf-8")
    return str(path)


def _file_bytes(prefix):
    return [open(prefix + ext, "rb").read() for ext in (".bin", ".idx")]


# --- tokenizer -----------------------------------------------------------------------


def tokenizer(**fields):
    return build_tokenizer(TokenizerConfig(**fields))


def test_byte_level_round_trip():
    tok = tokenizer(tokenizer_type="ByteLevelTokenizer")
    assert (tok.vocab_size, tok.eod) == (512, 0)
    ids = tok.tokenize(TEXTS[2])
    assert ids == list(TEXTS[2].encode("utf-8"))
    assert tok.detokenize(ids) == TEXTS[2]


def test_null_round_trip():
    tok = tokenizer(tokenizer_type="NullTokenizer", vocab_size=100)
    # Megatron convention: eod is appended after the --vocab-size ids.
    assert (tok.vocab_size, tok.eod) == (101, 100)
    assert tok.tokenize("5 17 99") == [5, 17, 99]
    assert tok.detokenize([5, 17, 99]) == "5 17 99"


def check(**fields):
    return check_tokenizer(TokenizerConfig(**fields))


def test_check_tokenizer_accepts_valid():
    assert check(tokenizer_type="ByteLevelTokenizer") is None
    assert check(tokenizer_type="NullTokenizer", vocab_size=32) is None


@pytest.mark.parametrize(
    "fields, expected",
    [
        (dict(tokenizer_type="GPT2BPETokenizer"), "GPT2BPETokenizer needs --vocab-file"),
        (
            dict(tokenizer_type="GPT2BPETokenizer", vocab_file=__file__),
            "GPT2BPETokenizer needs --merge-file",
        ),
        (
            dict(tokenizer_type="GPT2BPETokenizer", vocab_file="/no/vocab.json"),
            "--vocab-file '/no/vocab.json' is no file",
        ),
        (dict(tokenizer_type="NullTokenizer"), "NullTokenizer needs --vocab-size"),
        (dict(tokenizer_type="NullTokenizer", vocab_size=0), "--vocab-size must be positive"),
        (dict(tokenizer_type="ByteLevelTokenizer", vocab_size=100), "--vocab-size 100 is too"),
        (dict(tokenizer_type="HuggingFaceTokenizer"), "needs --tokenizer-model"),
        (dict(tokenizer_type="Llama2Tokenizer"), "needs --tokenizer-model"),
        (dict(tokenizer_type="TikTokenizer"), "needs --tokenizer-model"),
        (
            dict(tokenizer_type="HuggingFaceTokenizer", tokenizer_model="/no/such/dir"),
            "is no directory",
        ),
        (
            dict(tokenizer_type="SentencePieceTokenizer", tokenizer_model="/no/such.model"),
            "is no file",
        ),
        (dict(tokenizer_type="BertWordPieceCase"), "not available here: BERT"),
        (dict(tokenizer_type="SFTTokenizer"), "not available here: it belongs"),
        (dict(tokenizer_type="SomethingElse"), "supported: " + ", ".join(TOKENIZER_TYPES)),
    ],
)
def test_check_tokenizer_refuses(fields, expected):
    with pytest.raises(ValueError, match=re.escape(expected)):
        check(**fields)


@pytest.mark.parametrize(
    "tokenizer_type, module",
    [
        ("HuggingFaceTokenizer", "transformers"),
        ("SentencePieceTokenizer", "sentencepiece"),
        ("GPT2BPETokenizer", "tokenizers"),
    ],
)
def test_check_tokenizer_missing_package(tmp_path, monkeypatch, tokenizer_type, module):
    model = tmp_path / "tok.model"
    model.write_bytes(b"")
    paths = {
        "HuggingFaceTokenizer": dict(tokenizer_model=str(tmp_path)),
        "SentencePieceTokenizer": dict(tokenizer_model=str(model)),
        "GPT2BPETokenizer": dict(vocab_file=str(model), merge_file=str(model)),
    }
    real_find_spec = importlib.util.find_spec
    # Pretend the package is absent even where it happens to be installed.
    monkeypatch.setattr(
        tokenizer_module.importlib.util,
        "find_spec",
        lambda name, *a: None if name == module else real_find_spec(name, *a),
    )
    with pytest.raises(ValueError, match=f"pip install {module}"):
        check(tokenizer_type=tokenizer_type, **paths[tokenizer_type])


# --- preprocess_data -----------------------------------------------------------------


def _preprocess(tmp_path, name, *extra):
    src = _write_jsonl(tmp_path / "in.jsonl", [{"text": t, "title": t[:5]} for t in TEXTS])
    prefix = str(tmp_path / name)
    argv = ["--input", src, "--output-prefix", prefix, "--append-eod", "--log-interval", "1"]
    argv += ["--tokenizer-type", "ByteLevelTokenizer"]
    return preprocess_data.main(argv + list(extra))


def test_preprocess_matches_tokenizer(tmp_path):
    prefixes = _preprocess(tmp_path, "out", "--json-keys", "text", "title")
    assert prefixes == {key: str(tmp_path / f"out_{key}_document") for key in ("text", "title")}
    tok = tokenizer(tokenizer_type="ByteLevelTokenizer")
    for key, prefix in prefixes.items():
        texts = [t if key == "text" else t[:5] for t in TEXTS]
        # Empty documents are skipped; the others end with eod.
        expected = [tok.tokenize(t) + [tok.eod] for t in texts if t]
        assert _read_documents(prefix) == expected


def test_preprocess_missing_key_is_an_error(tmp_path):
    with pytest.raises(KeyError, match="no key 'body'"):
        _preprocess(tmp_path, "bad", "--json-keys", "body")


# --- prepare_corpus ------------------------------------------------------------------

MAX_BYTES = 40_000


def _prepare(out_dir, *extra):
    argv = ["--output-dir", str(out_dir), "--max-bytes", str(MAX_BYTES), *extra]
    return prepare_corpus.main(argv)


def test_prepare_corpus(tmp_path, capsys):
    prefix = _prepare(tmp_path / "a")
    assert prefix == str(tmp_path / "a" / "corpus_text_document")
    records = [json.loads(line) for line in open(tmp_path / "a" / "corpus.jsonl", encoding="utf-8")]
    texts = [r["text"] for r in records]
    assert texts and sum(len(t.encode("utf-8")) for t in texts) <= MAX_BYTES
    # Real English prose, not code.
    joined = " ".join(texts)
    assert all(word in joined for word in (" the ", " of ", " is "))
    # The dataset is the byte-level encoding of the JSONL texts, each ending with eod (0).
    assert _read_documents(prefix) == [list(t.encode("utf-8")) + [0] for t in texts]
    meta = json.loads((tmp_path / "a" / "corpus_meta.json").read_text())
    assert meta["documents"] == len(texts)


def test_prepare_corpus_deterministic_and_cached(tmp_path, capsys):
    first, second = _prepare(tmp_path / "a"), _prepare(tmp_path / "b")
    assert _file_bytes(first) == _file_bytes(second)
    capsys.readouterr()
    _prepare(tmp_path / "a")
    assert "up to date" in capsys.readouterr().out
    _prepare(tmp_path / "a", "--force")
    assert "built" in capsys.readouterr().out
    assert _file_bytes(first) == _file_bytes(second)


def test_a_tokenizer_flag_the_type_does_not_read_is_named_with_who_reads_it():
    """Megatron-LM ignores them; parsing warns (test_arguments.py)."""
    from megatron.training.tokenizer import unused_tokenizer_flags

    null = TokenizerConfig(tokenizer_type="NullTokenizer", vocab_size=9, merge_file="m.txt")
    assert unused_tokenizer_flags(null) == [
        ("--merge-file", ("GPT2BPETokenizer", "HuggingFaceTokenizer"))
    ]
    byte = TokenizerConfig(tokenizer_type="ByteLevelTokenizer", tiktoken_num_special_tokens=10)
    assert [flag for flag, _ in unused_tokenizer_flags(byte)] == ["--tiktoken-num-special-tokens"]
    assert unused_tokenizer_flags(TokenizerConfig(tokenizer_type="NullTokenizer")) == []
