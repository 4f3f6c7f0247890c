"""Every --tokenizer-type with a vocabulary learned from the embedded corpus
(tools/train_tokenizers.py, run by prepare_corpus), in-process: Megatron-LM's
vocabulary size and end-of-document id, exact round trips, GPT-2 BPE ids
checked against a second, independent BPE implementation, and the .bin/.idx
data written. Training on each kind, and what a zygote imports for them,
are in tests/functional_tests/test_tokenizers.py."""

import base64
import json
import os

import pytest

from megatron.core.datasets.indexed_dataset import IndexedDataset
from megatron.training.config import TokenizerConfig
from megatron.training.gpt2_bpe import GPT2_EOD
from megatron.training.tokenizer import build_tokenizer
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


def test_the_corpus_is_written_with_gpt2_bpe_ids(corpus):
    """prepare_corpus's GPT-2 dataset holds each document's ids and eod,
    as preprocess_data writes them for pretrain_gpt.py."""
    directory, vocabularies, texts = corpus
    tok = build("GPT2BPETokenizer", vocabularies)
    dataset = IndexedDataset(os.path.join(directory, "corpus_gpt2_text_document"))
    documents = [dataset[i].tolist() for i in range(len(dataset))]
    assert documents == [tok.tokenize(text) + [tok.eod] for text in texts if text]


def test_the_slurm_planner_knows_the_gpt2_vocabulary_without_building_it(corpus):
    from tools.planning.slurm import vocabulary
    from megatron.training.arguments import parse_args

    _, vocabularies, _ = corpus
    files = fields("GPT2BPETokenizer", vocabularies)
    argv = ["--num-layers", "2", "--hidden-size", "16", "--num-attention-heads", "2"]
    argv += ["--seq-length", "8", "--micro-batch-size", "1", "--train-iters", "2", "--lr", "1"]
    argv += [
        "--mock-data",
        "--vocab-file",
        files["vocab_file"],
        "--merge-file",
        files["merge_file"],
    ]
    config = parse_args(argv, world_size=1)
    assert vocabulary(config) == build("GPT2BPETokenizer", vocabularies).vocab_size
