"""tools/preprocess_data.py, in-process: each JSON key's documents written
as the tokenizer's ids with eod, and a missing key named. (Its worker
processes are tested in tests/functional_tests/test_data_tools.py.)"""

import json

import pytest

from megatron.core.datasets.indexed_dataset import IndexedDataset
from tools import preprocess_data
from tests.unit_tests.training.test_tokenizer import TEXTS, tokenizer


def _read_documents(prefix):
    """All documents of an indexed dataset as lists of ints."""
    dataset = IndexedDataset(prefix)
    # .tolist() copies out of the mmap before `dataset` (and its mapping) goes away.
    return [dataset[i].tolist() for i in range(len(dataset))]


def _write_jsonl(path, records):
    path.write_text("".join(json.dumps(r) + "\n" for r in records), encoding="utf-8")
    return str(path)


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
