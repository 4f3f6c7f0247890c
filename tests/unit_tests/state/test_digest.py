"""Digests of tensors (deadpool_ext/state/digest.py), in-process: one flipped
bit anywhere changes a tensor's digest and the device's word sum, the
majority names the odd replica, and the error names the check, the
iteration and the suspects."""

import pytest
import torch

from deadpool_ext.rank.flips import flip_bit
from deadpool_ext.state.digest import SilentCorruption, odd_ones_out, tensor_digest


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16, torch.float16])
def test_one_flipped_bit_anywhere_changes_the_digest(dtype):
    tensor = torch.randn(4099).to(dtype)
    before = tensor_digest(tensor)
    assert tensor_digest(tensor.clone()) == before
    for index in (0, 2048, 4098):
        for bit in range(tensor.element_size() * 8):
            flip_bit(tensor, index, bit)
            assert tensor_digest(tensor) != before, (index, bit)
            flip_bit(tensor, index, bit)
    assert tensor_digest(tensor) == before


def test_the_majority_names_the_odd_replica_and_two_cannot_tell():
    assert odd_ones_out([7, 7, 7]) is None
    assert odd_ones_out([7, 7, 9, 7]) == [2]
    assert odd_ones_out([7, 9]) == [0, 1]  # two replicas: either may be wrong
    assert odd_ones_out([7, 7, 9, 9]) == [0, 1, 2, 3]  # a tie names everyone
    assert odd_ones_out([1, 2, 3]) == [0, 1, 2]


def test_the_error_names_the_check_the_iteration_and_the_suspects():
    error = SilentCorruption("weight-hash", 7, [1, 3], "digests differ")
    assert str(error).startswith(
        "silent data corruption (weight-hash) in iteration 7, suspect rank(s) 1, 3: "
    )


def test_the_device_digest_sees_every_flipped_bit_of_a_word():
    """The weighted word sum (what a GPU computes in place of XXH3), run
    here on the host's words: any one bit of any word changes it."""
    from deadpool_ext.state.digest import weighted_word_sum

    words = torch.randint(-(2**62), 2**62, (513,), dtype=torch.int64)
    before = weighted_word_sum(words)
    for index in (0, 256, 512):
        for bit in range(64):
            flip_bit(words, index, bit)
            assert weighted_word_sum(words) != before, (index, bit)
            flip_bit(words, index, bit)
    assert weighted_word_sum(words) == before
