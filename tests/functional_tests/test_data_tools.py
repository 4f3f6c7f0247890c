"""Tests for tools/preprocess_data.py with worker processes: its output
is the same, byte for byte, with one worker and with two. (The tokenizer
builder, preprocess_data.py in-process and tools/prepare_corpus.py are
tested in tests/unit_tests/training/test_tokenizer.py and
tests/unit_tests/tools/test_preprocess_data.py and test_prepare_corpus.py.)"""

import pytest

from tests.unit_tests.tools.test_prepare_corpus import _file_bytes
from tests.unit_tests.tools.test_preprocess_data import _preprocess

pytestmark = pytest.mark.integration


def test_preprocess_workers_deterministic(tmp_path):
    one = _preprocess(tmp_path, "w1", "--workers", "1")["text"]
    two = _preprocess(tmp_path, "w2", "--workers", "2")["text"]
    assert _file_bytes(one) == _file_bytes(two)
