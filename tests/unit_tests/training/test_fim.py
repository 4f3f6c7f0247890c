"""Fill-in-the-middle samples (megatron/training/fim.py): each reordered
segment holds its text around the sentinels in Megatron-LM's PSM and SPM
orders, a sample keeps its length and its document ends, fragments are
reordered one by one, and how a sample is reordered depends on the seed and
its index alone. Then megatron-core's samples reordered by the dataset, and
the sentinels looked up as Megatron-LM does. --fim-data's flags are
tests/unit_tests/training/flags/test_data.py's."""

import numpy
import pytest

from dist_utils import gpt2_bpe_data
from megatron.training import data
from megatron.training.arguments import parse_args
from megatron.training.fim import (
    FIMDatasetConfig,
    Reorderer,
    Sentinels,
    fit,
    sample_rng,
    token_id,
)
from megatron.training.tokenizer import build_tokenizer

IDS = Sentinels(prefix=1, middle=2, suffix=3, pad=4, eod=5)
SPLIT = 6  # --fim-split-sample's token


class Characters:
    """A tokenizer whose tokens are characters (ids are code points)."""

    def tokenize(self, text):
        return [ord(c) for c in text]

    def detokenize(self, ids):
        return "".join(chr(i) for i in ids)


def config(**settings) -> FIMDatasetConfig:
    """The reordering's settings alone (the dataset's other fields unused)."""
    c = FIMDatasetConfig.__new__(FIMDatasetConfig)
    defaults = dict(
        fim_rate=1.0,
        fim_spm_rate=0.0,
        fim_fragment_rate=None,
        fim_split_id=None,
        fim_no_prefix=None,
        fim_sentinels=IDS,
    )
    for name, value in {**defaults, **settings}.items():
        setattr(c, name, value)
    return c


def tokens(text: str) -> numpy.ndarray:
    return numpy.array(Characters().tokenize(text), dtype=numpy.int64)


def reorderer(seed: int = 0, index: int = 0, **settings) -> Reorderer:
    return Reorderer(config(**settings), Characters(), sample_rng(seed, index))


def reassembled(out: numpy.ndarray, order: str) -> str:
    """The text one reordered segment holds, read as ``order``: PSM is
    <P> prefix <S> suffix <M> middle, SPM <P><S> suffix <M> prefix middle."""
    text = Characters().detokenize([int(i) for i in out])
    p, m, s = chr(IDS.prefix), chr(IDS.middle), chr(IDS.suffix)
    if order == "spm":
        assert text.startswith(p + s), text
        suffix, head = text[2:].split(m, 1)
        return head + suffix
    assert text.startswith(p), text
    prefix, rest = text[1:].split(s, 1)
    suffix, middle = rest.split(m, 1)
    return prefix + middle + suffix


TEXT = "def area(r):\n    return 3.14159 * r * r\n"


@pytest.mark.parametrize("spm_rate, order", [(0.0, "psm"), (1.0, "spm")])
def test_a_reordered_segment_holds_its_text_around_the_sentinels(spm_rate, order):
    outs = [reorderer(index=i, fim_spm_rate=spm_rate).reorder(tokens(TEXT), 1.0) for i in range(20)]
    assert all(len(out) == len(TEXT) + 3 for out in outs)
    assert all(reassembled(out, order) == TEXT for out in outs)
    # SPM puts the suffix sentinel right after the prefix one; PSM does only
    # when the prefix is empty.
    right_after = [int(out[1]) == IDS.suffix for out in outs]
    assert all(right_after) if order == "spm" else not all(right_after)


def test_a_rate_of_zero_leaves_the_segment_as_it_is():
    out = reorderer().reorder(tokens(TEXT), 0.0)
    assert out.tolist() == tokens(TEXT).tolist()


def test_a_sample_keeps_its_length_and_its_document_ends():
    first, second = "first document text", "second one"
    sample = numpy.concatenate([tokens(first), [IDS.eod], tokens(second), [IDS.eod] * 2])
    out = reorderer().sample(sample)
    assert len(out) == len(sample)
    cut = len(first) + 3  # the first segment, reordered, then its end of document
    assert out[cut] == IDS.eod
    assert reassembled(out[:cut], "psm") == first
    # An empty segment stays empty and keeps its end of document (Megatron-LM
    # drops it: fim.py's docstring).
    ends = numpy.concatenate([[IDS.eod, IDS.eod], tokens(first)])
    assert reorderer().sample(ends)[:2].tolist() == [IDS.eod, IDS.eod]
    long = numpy.concatenate([tokens("x" * 40), [IDS.eod]])
    assert fit(long, 8, IDS.pad).tolist() == long[:8].tolist()
    assert fit(tokens("ab"), 4, IDS.pad).tolist() == [97, 98, IDS.pad, IDS.pad]


def test_fragments_are_reordered_one_by_one_around_the_split_token():
    fragments = ["import os", "print(os.sep)", "x = 1"]
    sample = numpy.concatenate(
        [numpy.concatenate([tokens(f), [SPLIT]]) for f in fragments[:-1]] + [tokens(fragments[-1])]
    )
    out = reorderer(fim_split_id=SPLIT, fim_fragment_rate=1.0).segment(sample)
    pieces = numpy.split(out, numpy.flatnonzero(out == SPLIT))
    pieces = [p[1:] if p[0] == SPLIT else p for p in pieces]
    assert [reassembled(p, "psm") for p in pieces] == fragments
    untouched = reorderer(fim_split_id=SPLIT, fim_fragment_rate=0.0).segment(sample)
    assert untouched.tolist() == sample.tolist()


def test_no_prefix_leaves_a_fragment_that_starts_with_it():
    out = reorderer(fim_no_prefix="def ").reorder(tokens(TEXT), 1.0)
    assert out.tolist() == tokens(TEXT).tolist()
    other = reorderer(fim_no_prefix="class ").reorder(tokens(TEXT), 1.0)
    assert len(other) == len(TEXT) + 3


def test_a_samples_reordering_is_drawn_from_the_seed_and_its_index():
    sample = numpy.concatenate([tokens(TEXT), [IDS.eod], tokens(TEXT[::-1])])
    half = dict(fim_rate=0.5, fim_spm_rate=0.5)

    def read(seed=1234):
        return [reorderer(seed, i, **half).sample(sample).tolist() for i in range(40)]

    assert read() == read()
    assert read(seed=99) != read()  # the seed decides
    assert len({tuple(v) for v in read()}) > 10  # and so does the index


# ----- the dataset on megatron-core's samples, with a real GPT-2 BPE vocabulary -----
def flags(corpus_prefix, tmp_path, *extra):
    corpus, tokenizer_files = gpt2_bpe_data(corpus_prefix)
    return [
        *("--num-layers", "2", "--hidden-size", "64", "--num-attention-heads", "4"),
        *("--seq-length", "64", "--max-position-embeddings", "64"),
        *("--micro-batch-size", "1", "--global-batch-size", "8", "--lr", "1e-3"),
        *("--train-iters", "4", "--eval-iters", "0"),
        *("--data-path", corpus, *tokenizer_files),
        *("--data-cache-path", str(tmp_path / "cache")),
        *extra,
    ]


def test_the_dataset_reorders_megatron_cores_samples(corpus_prefix, tmp_path):
    fim = parse_args(flags(corpus_prefix, tmp_path, "--fim-data"), world_size=1)
    plain = parse_args(flags(corpus_prefix, tmp_path), world_size=1)
    tokenizer = build_tokenizer(fim.tokenizer)
    reordered = data.build_datasets(fim, tokenizer)[0]
    original = data.build_datasets(plain, tokenizer)[0]
    assert len(reordered) == len(original)
    forward = {i: reordered[i]["tokens"].tolist() for i in range(32)}
    # Read backwards, as another rank or a recovered one may: the same samples.
    assert {i: reordered[i]["tokens"].tolist() for i in reversed(range(32))} == forward
    changed = 0
    for i in range(32):
        want = original[i]["tokens"].tolist()
        assert len(forward[i]) == len(want)
        changed += forward[i] != want
    assert 8 < changed < 32  # --fim-rate 0.5


def test_sentinels_missing_from_the_vocabulary_take_the_unknown_id_as_in_megatron_lm(
    corpus_prefix, tmp_path
):
    config = parse_args(flags(corpus_prefix, tmp_path, "--fim-data"), world_size=1)
    tokenizer = build_tokenizer(config.tokenizer)
    # GPT-2's unknown token is its end of text (Hugging Face's GPT-2 tokenizer too).
    assert token_id(tokenizer, "<fim_prefix>") == (tokenizer.eod, False)
    assert token_id(tokenizer, "<|endoftext|>") == (tokenizer.eod, True)
