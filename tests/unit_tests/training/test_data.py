"""The data pipeline's sample order (megatron/training/data.py), in-process:
each data-parallel rank's quota of an iteration's samples, Megatron-LM's
sampler order where the quotas are even."""

import pytest

from megatron.training.data import MicrobatchSampler, microbatches_per_iteration


@pytest.mark.parametrize("gbs, mbs, dp", [(8, 2, 3), (32, 4, 3), (24, 2, 5), (8, 2, 4), (6, 1, 4)])
def test_quotas_cover_every_sample_of_every_iteration_once(gbs, mbs, dp):
    quotas = [microbatches_per_iteration(gbs, mbs, r, dp) for r in range(dp)]
    assert sum(quotas) == gbs // mbs and max(quotas) - min(quotas) <= 1
    total = 5 * gbs
    samplers = [list(MicrobatchSampler(total, gbs, mbs, r, dp, gbs)) for r in range(dp)]
    for it in range(4):
        seen = sorted(
            i
            for r in range(dp)
            for mb in samplers[r][it * quotas[r] : (it + 1) * quotas[r]]
            for i in mb
        )
        assert seen == list(range(gbs * (it + 1), gbs * (it + 2)))


def test_sampler_with_global_batch_is_megatrons_order_when_dp_divides():
    for r in range(2):
        assert list(MicrobatchSampler(64, 16, 2, r, 2, 16)) == list(
            MicrobatchSampler(64, 16, 2, r, 2)
        )
