"""The tokenizer builder (megatron/training/tokenizer.py), in-process: the
byte-level and null tokenizers' round trips, the checks of a tokenizer's
flags and packages, the flags a type does not read, and every
--tokenizer-type with a vocabulary learned from the embedded corpus
(tools/train_tokenizers.py, run by prepare_corpus): Megatron-LM's
vocabulary size and end-of-document id, exact round trips, and GPT-2 BPE
ids checked against a second, independent BPE implementation. Training on
each kind, and what a zygote imports for them, are in
tests/functional_tests/test_tokenizers.py."""

import base64
import importlib.util
import json
import os
import re

import pytest

from megatron.training import tokenizer as tokenizer_module
from megatron.training.config import TokenizerConfig
from megatron.training.gpt2_bpe import GPT2_EOD
from megatron.training.tokenizer import TOKENIZER_TYPES, build_tokenizer, check_tokenizer
from tools.train_tokenizers import byte_of_character

# GPT-2's split pattern (OpenAI's encoder.py; Hugging Face's ByteLevel pre-tokenizer).
GPT2_PATTERN = r"""'(?:[sdmt]|ll|ve|re)| ?\p{L}+| ?\p{N}+| ?[^\s\p{L}\p{N}]+|\s+(?!\S)|\s+"""
SPECIAL = 1000  # --tiktoken-num-special-tokens' default


@pytest.fixture(scope="module")
def corpus(corpus_prefix):
    directory = os.path.dirname(corpus_prefix)
    with open(os.path.join(directory, "corpus.jsonl"), encoding="utf-8") as f:
        texts = [json.loads(line)["text"] for line in f]
    return directory, os.path.join(directory, "tokenizers"), texts


def fields(kind: str, vocabularies: str) -> dict:
    """The flags a user gives for ``kind`` with the corpus's vocabularies."""
    gpt2 = os.path.join(vocabularies, "gpt2")
    spm = os.path.join(vocabularies, "sentencepiece.model")
    tiktoken_json = os.path.join(vocabularies, "tiktoken.json")
    with open(tiktoken_json) as f:
        tiktoken_ids = len(json.load(f)) + SPECIAL
    return {
        "GPT2BPETokenizer": dict(
            vocab_file=os.path.join(gpt2, "vocab.json"), merge_file=os.path.join(gpt2, "merges.txt")
        ),
        "HuggingFaceTokenizer": dict(tokenizer_model=os.path.join(vocabularies, "hf")),
        "SentencePieceTokenizer": dict(tokenizer_model=spm),
        "GPTSentencePieceTokenizer": dict(tokenizer_model=spm),
        "Llama2Tokenizer": dict(tokenizer_model=spm),
        "TikTokenizer": dict(tokenizer_model=tiktoken_json, vocab_size=tiktoken_ids),
    }[kind]


def build(kind, vocabularies):
    return build_tokenizer(TokenizerConfig(tokenizer_type=kind, **fields(kind, vocabularies)))


def gpt2_vocab(vocabularies):
    with open(os.path.join(vocabularies, "gpt2", "vocab.json"), encoding="utf-8") as f:
        return json.load(f)


def test_each_kind_has_megatron_lms_vocabulary_size_and_eod(corpus):
    import sentencepiece

    _, vocabularies, _ = corpus
    vocab = gpt2_vocab(vocabularies)
    spm = sentencepiece.SentencePieceProcessor(
        model_file=fields("Llama2Tokenizer", vocabularies)["tokenizer_model"]
    )
    tiktoken_size = fields("TikTokenizer", vocabularies)["vocab_size"]
    expected = {
        # vocab.json's length and <|endoftext|>'s id (Megatron-LM's _GPT2BPETokenizer)
        "GPT2BPETokenizer": (len(vocab), vocab[GPT2_EOD]),
        "HuggingFaceTokenizer": (len(vocab), vocab[GPT2_EOD]),  # its eos_token
        # the model's pieces and its </s> (_GPTSentencePieceTokenizer, _Llama2Tokenizer)
        "GPTSentencePieceTokenizer": (spm.get_piece_size(), spm.eos_id()),
        "Llama2Tokenizer": (spm.get_piece_size(), spm.eos_id()),
        "SentencePieceTokenizer": (spm.get_piece_size(), spm.eos_id()),
        # --vocab-size, and </s> among the special ids below the ranks
        "TikTokenizer": (tiktoken_size, 2),
    }
    for kind, (size, eod) in expected.items():
        tok = build(kind, vocabularies)
        assert (kind, tok.vocab_size, tok.eod) == (kind, size, eod)


@pytest.mark.parametrize("kind", ["GPT2BPETokenizer", "HuggingFaceTokenizer"])
def test_byte_level_bpe_kinds_give_back_every_document(corpus, kind):
    _, vocabularies, texts = corpus
    tok = build(kind, vocabularies)
    for text in texts:
        ids = tok.tokenize(text)
        assert max(ids) < tok.vocab_size
        assert tok.detokenize(ids) == text


def test_tiktoken_ids_hold_every_document(corpus):
    """Their bytes give the text back. (megatron-core's detokenize decodes
    token by token, so a character split between two tokens comes back as
    U+FFFD: its behaviour, Megatron-LM's too.)"""
    _, vocabularies, texts = corpus
    tok = build("TikTokenizer", vocabularies)
    encoding = tok._tokenizer.tokenizer
    for text in texts:
        ids = tok.tokenize(text)
        assert max(ids) < tok.vocab_size
        pieces = b"".join(encoding.decode_single_token_bytes(i) for i in ids)
        assert pieces.decode("utf-8") == text


def tiktoken_encoding(vocabularies, pattern):
    import tiktoken

    with open(os.path.join(vocabularies, "tiktoken.json")) as f:
        ranks = {base64.b64decode(e["token_bytes"]): e["rank"] for e in json.load(f)}
    return tiktoken.Encoding(
        "corpus-gpt2", pat_str=pattern, mergeable_ranks=ranks, special_tokens={}
    )


def ids_through_tiktoken(encoding, vocab, text):
    """The GPT-2 vocabulary's ids of tiktoken's tokens of ``text``."""
    to_character = {b: c for c, b in byte_of_character().items()}
    pieces = (encoding.decode_single_token_bytes(i) for i in encoding.encode_ordinary(text))
    return [vocab["".join(to_character[b] for b in piece)] for piece in pieces]


def test_gpt2_bpe_ids_equal_an_independent_bpe_implementation(corpus):
    """tiktoken (OpenAI's BPE, ranks in merge order) splits every document
    into the same tokens as GPT2BPETokenizer; with another split pattern (a
    control) it does not."""
    from megatron.core.tokenizers.text.libraries.tiktoken_tokenizer import _PATTERN_TIKTOKEN_V2

    _, vocabularies, texts = corpus
    tok, vocab = build("GPT2BPETokenizer", vocabularies), gpt2_vocab(vocabularies)
    gpt2 = tiktoken_encoding(vocabularies, GPT2_PATTERN)
    assert all(tok.tokenize(text) == ids_through_tiktoken(gpt2, vocab, text) for text in texts)
    other = tiktoken_encoding(vocabularies, _PATTERN_TIKTOKEN_V2)
    assert any(tok.tokenize(text) != ids_through_tiktoken(other, vocab, text) for text in texts)


def test_hugging_face_directory_loads_offline_with_the_same_ids(corpus):
    _, vocabularies, texts = corpus
    hf, gpt2 = build("HuggingFaceTokenizer", vocabularies), build("GPT2BPETokenizer", vocabularies)
    assert os.environ.get("HF_HUB_OFFLINE") == "1"
    assert all(hf.tokenize(text) == gpt2.tokenize(text) for text in texts[:50])


def test_vocab_size_with_hugging_face_is_checked_against_its_own(corpus):
    """Megatron-LM's Llama-3 script gives --vocab-size with HuggingFaceTokenizer."""
    _, vocabularies, _ = corpus
    own = build("HuggingFaceTokenizer", vocabularies).vocab_size
    given = dict(
        fields("HuggingFaceTokenizer", vocabularies), tokenizer_type="HuggingFaceTokenizer"
    )
    assert build_tokenizer(TokenizerConfig(vocab_size=own, **given)).vocab_size == own
    with pytest.raises(ValueError, match=f"--vocab-size {own + 1}, but .* has {own} ids"):
        build_tokenizer(TokenizerConfig(vocab_size=own + 1, **given))


@pytest.mark.parametrize("kind", ["SentencePieceTokenizer", "Llama2Tokenizer"])
def test_sentencepiece_kinds_give_back_the_text(corpus, kind):
    """SentencePiece folds runs of whitespace (its normalizer), so the text
    given back is the document with whitespace folded."""
    _, vocabularies, texts = corpus
    tok = build(kind, vocabularies)
    for text in texts[:50]:
        ids = tok.tokenize(text)
        assert max(ids) < tok.vocab_size
        assert tok.detokenize(ids).split() == text.split()


TEXTS = ["Hello world.", "", "Ünïcødé text: naïve café ☕", "a\nmulti-line\ndocument"]


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


def test_a_tokenizer_flag_the_type_does_not_read_is_named_with_who_reads_it():
    """Megatron-LM ignores them; parsing warns (training/flags/test_data.py)."""
    from megatron.training.tokenizer import unused_tokenizer_flags

    null = TokenizerConfig(tokenizer_type="NullTokenizer", vocab_size=9, merge_file="m.txt")
    assert unused_tokenizer_flags(null) == [
        ("--merge-file", ("GPT2BPETokenizer", "HuggingFaceTokenizer"))
    ]
    byte = TokenizerConfig(tokenizer_type="ByteLevelTokenizer", tiktoken_num_special_tokens=10)
    assert [flag for flag, _ in unused_tokenizer_flags(byte)] == ["--tiktoken-num-special-tokens"]
    assert unused_tokenizer_flags(TokenizerConfig(tokenizer_type="NullTokenizer")) == []
