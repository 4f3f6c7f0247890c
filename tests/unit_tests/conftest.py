"""Shared fixtures: the repository on sys.path, a small real corpus, and
quiet, single-threaded worker processes."""

import os
import sys

import pytest

REPO = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
if REPO not in sys.path:
    sys.path.insert(0, REPO)


@pytest.fixture(scope="session")
def corpus_prefix(tmp_path_factory) -> str:
    """The embedded corpus (stdlib docstrings), capped to stay fast."""
    from tools.prepare_corpus import main as prepare_corpus

    out = tmp_path_factory.mktemp("corpus")
    return prepare_corpus(["--output-dir", str(out), "--max-bytes", "2000000"])
