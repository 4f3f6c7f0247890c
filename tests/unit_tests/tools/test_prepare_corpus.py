"""tools/prepare_corpus.py, in-process: the corpus is real English prose
within its byte budget, written byte-level and with GPT-2 BPE ids, built
the same twice and not again when up to date."""

import json
import os

from megatron.core.datasets.indexed_dataset import IndexedDataset
from tools import prepare_corpus
from tests.unit_tests.tools.test_preprocess_data import _read_documents
from tests.unit_tests.training.test_tokenizer import build, corpus  # noqa: F401  (a fixture)


def _file_bytes(prefix):
    return [open(prefix + ext, "rb").read() for ext in (".bin", ".idx")]


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


def test_the_corpus_is_written_with_gpt2_bpe_ids(corpus):  # noqa: F811
    """prepare_corpus's GPT-2 dataset holds each document's ids and eod,
    as preprocess_data writes them for pretrain_gpt.py."""
    directory, vocabularies, texts = corpus
    tok = build("GPT2BPETokenizer", vocabularies)
    dataset = IndexedDataset(os.path.join(directory, "corpus_gpt2_text_document"))
    documents = [dataset[i].tolist() for i in range(len(dataset))]
    assert documents == [tok.tokenize(text) + [tok.eod] for text in texts if text]
