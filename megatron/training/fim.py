"""Fill-in-the-middle samples (``--fim-data``), as Megatron-LM's FIM dataset makes them.

Each sample is cut at its end-of-document tokens, and each segment, with
probability ``--fim-rate``, is cut at two random points of its text into
prefix, middle and suffix and reordered around sentinel tokens,
prefix-suffix-middle (PSM) or, with probability ``--fim-spm-rate``,
suffix-prefix-middle (SPM); the sample keeps its length (cut, or padded with
the pad sentinel). With ``--fim-split-sample`` a segment is first cut at
that token into fragments, each reordered with ``--fim-fragment-rate``.

Where it differs from Megatron-LM: there every decision comes from one
generator per dataset, in the order a rank reads its samples, so how a
sample is reordered depends on the data-parallel layout and on restarts;
here it depends on the seed and the sample's index alone, so a resumed,
recovered, shrunk or grown run reads the very samples the failure-free one
reads (a hot swap's bit-for-bit curve needs that). And an empty segment
or fragment (two end-of-document or split tokens in a row, or one that
ends the sample) stays empty and keeps its token, where Megatron-LM drops
a repeated end-of-document token and may put three bare sentinels there.

megatron-core 0.16 does not ship this dataset (Megatron-LM keeps it in its
training package): the sample is megatron-core's ``GPTDataset``'s, the
reordering is ours.
"""

from dataclasses import dataclass
from typing import List, Optional, Sequence, Tuple

import numpy
from megatron.core.datasets.gpt_dataset import GPTDataset, GPTDatasetConfig


@dataclass(frozen=True)
class Sentinels:
    prefix: int
    middle: int
    suffix: int
    pad: int
    eod: int


@dataclass
class FIMDatasetConfig(GPTDatasetConfig):
    """megatron-core's GPT dataset config with the reordering's settings."""

    fim_rate: float = 0.5
    fim_spm_rate: float = 0.5
    fim_fragment_rate: Optional[float] = None
    fim_split_id: Optional[int] = None  # the --fim-split-sample token's id
    fim_no_prefix: Optional[str] = None
    fim_sentinels: Optional[Sentinels] = None


def token_id(tokenizer, token: str) -> Tuple[int, bool]:
    """(id, whether the vocabulary has the token). A token it lacks gets the
    id the tokenizer gives an unknown token, as in Megatron-LM (GPT-2's is
    its end of text; Hugging Face's and SentencePiece's, their unknown)."""
    known = token in tokenizer.vocab
    try:
        return tokenizer._tokenizer.tokens_to_ids([token])[0], known
    except KeyError:  # our GPT-2 BPE tokenizer looks tokens up strictly
        return tokenizer.eod, known


def sentinel_ids(tokenizer, data) -> Tuple[Sentinels, List[str]]:
    """The sentinels' ids from ``data`` (a DataConfig), and the tokens the
    vocabulary lacks."""
    tokens = [
        data.fim_prefix_token,
        data.fim_middle_token,
        data.fim_suffix_token,
        data.fim_pad_token,
        data.fim_eod_token,
    ]
    found = [token_id(tokenizer, token) for token in tokens]
    missing = [token for token, (_, known) in zip(tokens, found) if not known]
    return Sentinels(*(i for i, _ in found)), missing


def fim_settings(data, tokenizer) -> dict:
    """FIMDatasetConfig's own fields from ``data`` (a DataConfig)."""
    split = token_id(tokenizer, data.fim_split_sample)[0] if data.fim_split_sample else None
    return dict(
        fim_rate=data.fim_rate,
        fim_spm_rate=data.fim_spm_rate,
        fim_fragment_rate=data.fim_fragment_rate,
        fim_split_id=split,
        fim_no_prefix=data.fim_no_prefix,
        fim_sentinels=sentinel_ids(tokenizer, data)[0],
    )


def sample_rng(seed: int, index: int) -> numpy.random.RandomState:
    """The generator of sample ``index``'s decisions: a function of the two alone."""
    return numpy.random.RandomState([seed % 2**32, index])


class Reorderer:
    """The reordering of one sample's tokens, its decisions drawn from ``rng``."""

    def __init__(self, config: FIMDatasetConfig, tokenizer, rng: numpy.random.RandomState):
        self.config, self.tokenizer, self.rng = config, tokenizer, rng
        self.ids = config.fim_sentinels

    def sample(self, tokens: numpy.ndarray) -> numpy.ndarray:
        """Every segment between end-of-document tokens reordered; the
        length kept."""
        pieces: List[Sequence[int]] = []
        start = 0
        for end in numpy.flatnonzero(tokens == self.ids.eod):
            if end > start:
                pieces.append(self.segment(tokens[start:end]))
            pieces.append([self.ids.eod])
            start = end + 1
        pieces.append(self.segment(tokens[start:]))
        out = numpy.concatenate([numpy.asarray(p, dtype=numpy.int64) for p in pieces])
        return fit(out, len(tokens), self.ids.pad)

    def segment(self, tokens: numpy.ndarray) -> numpy.ndarray:
        c, split = self.config, self.config.fim_split_id
        if split is None or not (tokens == split).any():
            return self.reorder(tokens, c.fim_rate)
        if not self.rng.binomial(1, c.fim_rate):
            return tokens
        pieces: List[Sequence[int]] = []
        start = 0
        for end in numpy.flatnonzero(tokens == split):
            if end > start:
                pieces += [self.reorder(tokens[start:end], c.fim_fragment_rate), [split]]
            start = end + 1
        pieces.append(self.reorder(tokens[start:], c.fim_fragment_rate))
        return numpy.concatenate([numpy.asarray(p, dtype=numpy.int64) for p in pieces])

    def reorder(self, tokens: numpy.ndarray, rate: float) -> numpy.ndarray:
        """PSM or SPM with probability ``rate``, cut at two points of the text."""
        if len(tokens) == 0 or not self.rng.binomial(1, rate):
            return tokens
        text = self.tokenizer.detokenize(tokens.tolist())
        if self.config.fim_no_prefix is not None and text.startswith(self.config.fim_no_prefix):
            return tokens
        low, high = sorted(self.rng.randint(low=0, high=len(text) + 1, size=2))
        prefix, middle, suffix = (
            self.tokenizer.tokenize(part) for part in (text[:low], text[low:high], text[high:])
        )
        i = self.ids
        if self.rng.binomial(1, self.config.fim_spm_rate):
            order = [[i.prefix, i.suffix], suffix, [i.middle], prefix, middle]
        else:
            order = [[i.prefix], prefix, [i.suffix], suffix, [i.middle], middle]
        return numpy.concatenate([numpy.asarray(p, dtype=numpy.int64) for p in order])


def fit(tokens: numpy.ndarray, length: int, pad: int) -> numpy.ndarray:
    """``tokens`` cut or padded to ``length``."""
    if len(tokens) >= length:
        return tokens[:length]
    return numpy.concatenate([tokens, numpy.full(length - len(tokens), pad, dtype=numpy.int64)])


class FIMDataset(GPTDataset):
    """megatron-core's GPT samples, reordered for fill-in-the-middle."""

    def _query_document_sample_shuffle_indices(
        self, idx: int
    ) -> Tuple[numpy.ndarray, numpy.ndarray]:
        tokens, documents = super()._query_document_sample_shuffle_indices(idx)
        rng = sample_rng(self.config.random_seed, int(idx))
        return Reorderer(self.config, self.config.tokenizer, rng).sample(tokens), documents
