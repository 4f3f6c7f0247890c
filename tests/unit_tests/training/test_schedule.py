"""The schedule in samples and the global batch (megatron/training/schedule.py),
as Megatron-LM, in-process: --train-samples in whole global batches and the
schedule's lengths in samples, and --rampup-batch-size's batch growing from
START by INCREMENT over SAMPLES samples as megatron-core's calculator
grows it, the run's iterations counted as Megatron-LM counts them. The real
runs are in tests/functional_tests/test_schedule.py and test_batch_rampup.py."""

from megatron.core import num_microbatches_calculator as calculator
from megatron.training.arguments import parse_args
from megatron.training.schedule import GlobalBatch, schedule_in_samples

BASE = ["--num-layers", "2", "--hidden-size", "16", "--num-attention-heads", "2"]
BASE += ["--seq-length", "8", "--micro-batch-size", "2", "--global-batch-size", "8"]
BASE += ["--lr", "1e-3", "--mock-data", "--tokenizer-type", "ByteLevelTokenizer"]


def config(*flags):
    return parse_args(BASE + list(flags), world_size=2)


def test_train_samples_are_whole_global_batches_and_the_schedule_is_in_samples():
    c = config("--train-samples", "100", "--lr-warmup-samples", "12", "--lr-decay-samples", "90")
    assert c.training.train_iters == 12  # 100 // 8: the partial last batch is dropped
    steps = schedule_in_samples(c)
    assert (steps["warmup"], steps["decay"], steps["total"]) == (12, 90, 100)
    assert schedule_in_samples(config("--train-samples", "100"))["decay"] == 100
    fraction = schedule_in_samples(config("--train-samples", "100", "--lr-warmup-fraction", "0.05"))
    assert fraction["warmup"] == 0.05 * 100  # not rounded, as Megatron-LM
    iters = schedule_in_samples(config("--train-iters", "12", "--lr-warmup-iters", "2"))
    assert (iters["warmup"], iters["decay"], iters["total"]) == (16, 96, 96)


RAMP_BASE = ["--num-layers", "2", "--hidden-size", "16", "--num-attention-heads", "2"]
RAMP_BASE += ["--seq-length", "8", "--micro-batch-size", "2", "--lr", "1e-3", "--mock-data"]
RAMP_BASE += ["--tokenizer-type", "ByteLevelTokenizer"]
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


def ramp_config(*flags, world_size=2):
    return parse_args(RAMP_BASE + list(flags), world_size=world_size)


def test_the_ramp_and_the_iteration_count_are_megatron_lms():
    c = ramp_config(*RAMP)
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
    assert GlobalBatch(ramp_config("--train-iters", "5", "--global-batch-size", "8")).steps() == [8]
