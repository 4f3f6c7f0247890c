"""The flip fault's bit arithmetic (deadpool_ext/rank/flips.py): one bit of
one element flips, the sign bit too."""

import pytest
import torch

from deadpool_ext.rank.flips import flip_bit


def test_flip_bit_flips_exactly_one_bit_the_sign_bit_too():
    tensor = torch.tensor([1.5, -2.0, 3.0])
    flip_bit(tensor, 1, 31)
    assert tensor.tolist() == [1.5, 2.0, 3.0]
    flip_bit(tensor, 0, 0)
    assert tensor[0].item() == pytest.approx(1.5 + 2**-23)
