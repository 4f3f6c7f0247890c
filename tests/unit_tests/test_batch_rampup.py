"""--rampup-batch-size as Megatron-LM, in-process: the global batch grows
from START by INCREMENT over SAMPLES samples (megatron-core's calculator),
the run's iterations are counted as Megatron-LM counts them, and the batch
is a function of the samples consumed, so a resumed run and a shrunk one
(fewer replicas, uneven quotas) read the failure-free run's samples; a ramp
megatron-core would reject is refused before training. The real runs are
in tests/functional_tests/test_batch_rampup.py."""

import pytest

from megatron.core import num_microbatches_calculator as calculator
from megatron.training.arguments import ConfigError, parse_args
from megatron.training.data import MicrobatchSampler
from megatron.training.schedule import GlobalBatch

BASE = ["--num-layers", "2", "--hidden-size", "16", "--num-attention-heads", "2"]
BASE += ["--seq-length", "8", "--micro-batch-size", "2", "--lr", "1e-3", "--mock-data"]
BASE += ["--tokenizer-type", "ByteLevelTokenizer"]
# 4 -> 16 by 4 over 40 samples (13.3 a step), 120 samples in all.
RAMP = [
    "--train-samples",
    "120",
    "--global-batch-size",
    "16",
    "--rampup-batch-size",
    "4",
    "4",
    "40",
]
RAMP_SIZES = [4, 4, 4, 4, 8, 8, 12, 16, 16, 16, 16]


def config(*flags, world_size=2):
    return parse_args(BASE + list(flags), world_size=world_size)


def test_the_ramp_and_the_iteration_count_are_megatron_lms():
    c = config(*RAMP)
    # Megatron-LM's loop: ramp iterations while at most 40 samples are
    # consumed (the last one passes them: 32 + 12 = 44), then (120 - 44) // 16.
    assert c.training.train_iters == 7 + 4
    batch, consumed, sizes = GlobalBatch(c), 0, []
    calculator.unset_num_microbatches_calculator()
    calculator.init_num_microbatches_calculator(0, [4, 4, 40], 16, 2, 2)
    try:
        for _ in range(c.training.train_iters):
            calculator.update_num_microbatches(consumed, consistency_check=True)
            assert batch.at(consumed) == calculator.get_current_global_batch_size()
            sizes.append(batch.at(consumed))
            consumed += sizes[-1]
    finally:
        calculator.unset_num_microbatches_calculator()
    assert sizes == RAMP_SIZES
    assert GlobalBatch(c).steps() == [4, 8, 12, 16]
    assert GlobalBatch(config("--train-iters", "5", "--global-batch-size", "8")).steps() == [8]


def test_a_shrunk_replica_set_takes_every_sample_of_each_ramped_iteration_once():
    c = config(*RAMP)
    batch_at = GlobalBatch(c).at
    for dp in (1, 2, 3):  # 3: uneven quotas of 2, 4, 6 and 8 microbatches
        seen = sorted(
            i for r in range(dp) for mb in MicrobatchSampler(120, 0, 2, r, dp, batch_at) for i in mb
        )
        assert seen == list(range(sum(RAMP_SIZES)))  # 108: a 12th batch would pass 120
    # Resumed at the start of any iteration, a rank reads what it would have.
    starts = [sum(RAMP_SIZES[:k]) for k in range(len(RAMP_SIZES))]
    for start in starts[:8]:
        full = [mb for mb in MicrobatchSampler(120, 0, 2, 1, 3, batch_at) if mb[0] >= start]
        assert list(MicrobatchSampler(120, start, 2, 1, 3, batch_at)) == full
    # With even quotas the order is Megatron-LM's sequential one.
    for r in range(2):
        assert list(MicrobatchSampler(108, 0, 2, r, 2, batch_at)) == list(
            MicrobatchSampler(108, 0, 2, r, 2)
        )


@pytest.mark.parametrize(
    "flags, message",
    [
        (
            ["--train-iters", "10"] + RAMP[2:],
            "--rampup-batch-size goes with --train-samples",
        ),
        (RAMP[:-3] + ["16", "4", "40"], "give a start between 0 and --global-batch-size 16"),
        (RAMP[:-3] + ["4", "5", "40"], "increment 5 must be positive and divide"),
        (RAMP[:-3] + ["4", "4", "0"], "ramp of 0 samples must be positive"),
        # 6 is not a multiple of micro-batch 2 x DP 2
        (RAMP[:-3] + ["6", "2", "40"], r"reaches batch sizes \[6, 10, 14\]"),
    ],
)
def test_a_ramp_megatron_core_would_reject_is_refused_before_training(flags, message):
    with pytest.raises(ConfigError, match=message):
        config(*flags)
