"""Tokenize a JSONL corpus into Megatron indexed datasets (.bin/.idx).

Usage (from the repository root):

    python -m tools.preprocess_data --input corpus.jsonl --output-prefix data/corpus \
        --tokenizer-type ByteLevelTokenizer --append-eod

For every --json-keys key this writes {output_prefix}_{key}_document.bin/.idx.
Documents keep input order regardless of --workers, so the output is deterministic.
"""

import argparse
import json
import multiprocessing
import os
import sys
import time
from typing import Dict, Iterator, List, Optional, Sequence, Tuple

import torch

from megatron.core.datasets.indexed_dataset import DType, IndexedDatasetBuilder
from megatron.training.arguments import add_section_flags
from megatron.training.config import TokenizerConfig
from megatron.training.tokenizer import build_tokenizer, check_tokenizer

# One encoded line: (1-based line number, {key: token ids}).
Encoded = Tuple[int, Dict[str, List[int]]]


def get_args(argv: Optional[Sequence[str]] = None) -> argparse.Namespace:
    """Parse the command line (Megatron's preprocess_data flag names)."""
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--input", required=True, help="JSONL file, one JSON object per line.")
    parser.add_argument("--json-keys", nargs="+", default=["text"], help="Keys to tokenize.")
    parser.add_argument("--output-prefix", required=True, help="Prefix of the output files.")
    parser.add_argument("--workers", type=int, default=1, help="Tokenizer processes.")
    parser.add_argument("--append-eod", action="store_true", help="End documents with eod.")
    parser.add_argument("--log-interval", type=int, default=10000, help="Lines between logs.")
    # The tokenizer's flags and defaults are pretrain_gpt.py's.
    add_section_flags(parser, "tokenizer", TokenizerConfig)
    args = parser.parse_args(argv)
    if args.workers < 1:
        parser.error("--workers must be at least 1")
    if args.tokenizer_type is None:
        parser.error("give --tokenizer-type (as pretrain_gpt.py will read the data)")
    try:
        check_tokenizer(args)
    except ValueError as err:
        parser.error(str(err))
    return args


class Encoder:
    """Turns one JSONL line into token ids for each requested key."""

    def __init__(self, args: argparse.Namespace) -> None:
        self.keys = list(args.json_keys)
        self.append_eod = args.append_eod
        self.tokenizer = build_tokenizer(args)

    def encode(self, numbered_line: Tuple[int, str]) -> Encoded:
        """Tokenize every key of one line; an empty text gives an empty id list."""
        number, line = numbered_line
        record = json.loads(line)
        ids = {key: self._encode_text(_get_text(record, key, number)) for key in self.keys}
        return number, ids

    def _encode_text(self, text: str) -> List[int]:
        ids = list(self.tokenizer.tokenize(text)) if text else []
        # eod only marks the end of a real document; empty ones are skipped later.
        if ids and self.append_eod:
            ids.append(self.tokenizer.eod)
        return ids


def _get_text(record: dict, key: str, number: int) -> str:
    """Fetch record[key], failing loudly (a typo in --json-keys must not pass silently)."""
    if key not in record:
        raise KeyError(f"line {number}: JSON object has no key {key!r} (see --json-keys)")
    text = record[key]
    if not isinstance(text, str):
        raise TypeError(f"line {number}: value of {key!r} is {type(text).__name__}, not str")
    return text


# Per-process encoder for the worker pool, created once by _init_worker.
_WORKER_ENCODER: Optional[Encoder] = None


def _init_worker(args: argparse.Namespace) -> None:
    global _WORKER_ENCODER
    _WORKER_ENCODER = Encoder(args)


def _worker_encode(numbered_line: Tuple[int, str]) -> Encoded:
    return _WORKER_ENCODER.encode(numbered_line)


def read_lines(path: str) -> Iterator[Tuple[int, str]]:
    """Yield (line number, line) for every non-blank line of a JSONL file."""
    with open(path, "r", encoding="utf-8") as f:
        for number, line in enumerate(f, start=1):
            if line.strip():
                yield number, line


def encode_all(args: argparse.Namespace, encoder: Encoder) -> Iterator[Encoded]:
    """Encode every input line, in input order, with one or more processes."""
    lines = read_lines(args.input)
    if args.workers == 1:
        yield from map(encoder.encode, lines)
        return
    # imap (not imap_unordered) keeps input order, so output is deterministic.
    with multiprocessing.Pool(args.workers, _init_worker, (args,)) as pool:
        yield from pool.imap(_worker_encode, lines, chunksize=32)


def output_prefix(args: argparse.Namespace, key: str) -> str:
    """Path prefix (no extension) of the dataset written for one JSON key."""
    return f"{args.output_prefix}_{key}_document"


def write_datasets(args: argparse.Namespace, encoder: Encoder) -> Dict[str, str]:
    """Stream encoded documents into one IndexedDatasetBuilder per key."""
    dtype = DType.optimal_dtype(encoder.tokenizer.vocab_size)
    prefixes = {key: output_prefix(args, key) for key in args.json_keys}
    _make_parent_dir(args.output_prefix)
    builders = {
        key: IndexedDatasetBuilder(prefix + ".bin", dtype=dtype) for key, prefix in prefixes.items()
    }
    progress = _Progress(args.log_interval)
    for number, ids_by_key in encode_all(args, encoder):
        for key, ids in ids_by_key.items():
            if ids:  # empty documents would only add zero-length entries
                builders[key].add_document(torch.IntTensor(ids), [len(ids)])
        progress.update(number, ids_by_key)
    for key, builder in builders.items():
        builder.finalize(prefixes[key] + ".idx")
    progress.done()
    return prefixes


def _make_parent_dir(prefix: str) -> None:
    parent = os.path.dirname(prefix)
    if parent:
        os.makedirs(parent, exist_ok=True)


class _Progress:
    """Periodic throughput log on stderr (stdout stays free for results)."""

    def __init__(self, interval: int) -> None:
        self.interval = max(1, interval)
        self.start = time.monotonic()
        self.lines = 0
        self.tokens = 0

    def update(self, number: int, ids_by_key: Dict[str, List[int]]) -> None:
        self.lines += 1
        self.tokens += sum(len(ids) for ids in ids_by_key.values())
        if self.lines % self.interval == 0:
            self._log(f"read {self.lines} JSON lines (input line {number})")

    def done(self) -> None:
        self._log(f"finished {self.lines} JSON lines")

    def _log(self, what: str) -> None:
        elapsed = max(time.monotonic() - self.start, 1e-9)
        print(
            f"{what}, {self.tokens} tokens, {self.tokens / elapsed:,.0f} tokens/s",
            file=sys.stderr,
        )


def main(argv: Optional[Sequence[str]] = None) -> Dict[str, str]:
    """Run the tool; returns {json key: output path prefix}."""
    args = get_args(argv)
    encoder = Encoder(args)
    prefixes = write_datasets(args, encoder)
    for prefix in prefixes.values():
        print(f"wrote {prefix}.bin and {prefix}.idx")
    return prefixes


if __name__ == "__main__":
    main()
