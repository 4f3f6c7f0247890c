"""A real 3-document dataset (.bin/.idx) made by tools/preprocess_data.py,
for the tests that parse --data-path."""

import pytest

from tests.unit_tests.training.command_line import _write_dataset


@pytest.fixture(scope="module")
def tiny_prefix(tmp_path_factory):
    """A real 3-document dataset (.bin/.idx) made by tools/preprocess_data.py."""
    texts = [
        "The first document, about cats.",
        "A second one, about dogs.",
        "And a third about neither.",
    ]
    return _write_dataset(tmp_path_factory.mktemp("tiny"), texts)
