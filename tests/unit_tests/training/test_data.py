"""The data pipeline (megatron/training/data.py), in-process: Megatron-LM's
sample order (each iteration's samples once, a resumed sampler the tail),
each data-parallel rank's quota of an iteration's samples (uneven after a
shrink, and with a ramped batch), the documents of each split as
megatron-core cuts them, and the samples drawn from each split."""

import pytest

from megatron.training import data
from megatron.training.arguments import parse_args
from megatron.training.data import (
    MicrobatchSampler,
    documents_per_split,
    microbatch_indices,
    microbatches_per_iteration,
)
from megatron.training.schedule import GlobalBatch
from tests.unit_tests.training.command_line import _write_dataset, argv
from tests.unit_tests.training.test_schedule import RAMP, RAMP_SIZES, ramp_config


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


@pytest.mark.parametrize(
    "eval_iters, split, drawn",
    [(0, "969,30,1", [(0, 0.969), None, None]), (2, "'99,1,0'", [(0, 0.99), (0.99, 1.0), None])],
)
def test_each_split_owns_megatron_lms_documents_and_unused_ones_are_not_built(
    eval_iters, split, drawn, tmp_path
):
    """--split's boundaries are Megatron-LM's whether a split is drawn from
    or not (zeroing an unused weight would move the train split's end: 969/999
    of the documents instead of 969/1000), and a split nothing is drawn from
    (test here; valid with --eval-iters 0) is not built."""
    from megatron.training import data
    from megatron.training.tokenizer import build_tokenizer

    prefix = _write_dataset(tmp_path, [f"document {i}" for i in range(200)])
    extra = ("--eval-iters", str(eval_iters), "--split", split, "--data-path", prefix)
    config = parse_args(argv(*extra, drop=("--mock-data",)), world_size=1)
    matrix = data.gpt_dataset_config(config, build_tokenizer(config.tokenizer)).split_matrix
    assert [b if b is None else tuple(round(x, 9) for x in b) for b in matrix] == drawn


def test_samples_drawn_from_each_split_are_megatron_lms():
    """Train: the run; valid: --eval-iters batches per validation, one more
    at the end; test: --eval-iters batches once, after training."""
    from megatron.training.data import dataset_sizes

    args = ["--train-iters", "10", "--eval-interval", "4", "--eval-iters", "3"]
    config = parse_args(argv(*args, "--global-batch-size", "2"), world_size=1)
    assert dataset_sizes(config) == [20, (10 // 4 + 1) * 3 * 2, 3 * 2]


def test_a_shrunk_replica_set_takes_every_sample_of_each_ramped_iteration_once():
    c = ramp_config(*RAMP)
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


# --- sample order --------------------------------------------------------------------


def megatron_pretraining_sampler(
    total_samples, consumed_samples, micro_batch_size, data_parallel_rank, data_parallel_size
):
    """Megatron-LM's MegatronPretrainingSampler (drop_last=True), as a reference."""
    step = micro_batch_size * data_parallel_size
    batch = []
    for idx in range(consumed_samples, total_samples):
        batch.append(idx)
        if len(batch) == step:
            start = data_parallel_rank * micro_batch_size
            yield batch[start : start + micro_batch_size]
            batch = []


LAYOUTS = [(1, 1, 1), (2, 1, 3), (1, 4, 2), (2, 2, 2), (3, 2, 4), (4, 8, 1)]  # mbs, dp, n_micro


@pytest.mark.parametrize("mbs, dp, n_micro", LAYOUTS)
@pytest.mark.parametrize("iteration", [0, 1, 5])
def test_iteration_covers_its_samples_exactly_once(mbs, dp, n_micro, iteration):
    gbs = mbs * dp * n_micro
    consumed = iteration * gbs
    seen = [
        i
        for k in range(n_micro)
        for r in range(dp)
        for i in microbatch_indices(consumed, k, mbs, r, dp)
    ]
    assert sorted(seen) == list(range(consumed, consumed + gbs))
    assert len(set(seen)) == len(seen)


@pytest.mark.parametrize("mbs, dp, n_micro", LAYOUTS)
def test_microbatch_indices_follow_megatron_order(mbs, dp, n_micro):
    gbs = mbs * dp * n_micro
    for r in range(dp):
        reference = list(megatron_pretraining_sampler(3 * gbs, 0, mbs, r, dp))
        ours = [
            microbatch_indices(it * gbs, k, mbs, r, dp) for it in range(3) for k in range(n_micro)
        ]
        assert ours == reference


def test_microbatch_indices_example():
    # mbs 2, DP 2: chunk k is samples [4k, 4k+4), rank 0 takes the first half.
    assert microbatch_indices(0, 0, 2, 0, 2) == [0, 1]
    assert microbatch_indices(0, 0, 2, 1, 2) == [2, 3]
    assert microbatch_indices(0, 1, 2, 0, 2) == [4, 5]
    assert microbatch_indices(8, 1, 2, 1, 2) == [14, 15]


@pytest.mark.parametrize(
    "total, mbs, dp", [(40, 2, 2), (37, 3, 2), (16, 1, 4), (10, 4, 1), (5, 3, 2)]
)
@pytest.mark.parametrize("consumed", [0, 6, 12])
def test_sampler_matches_megatron(total, mbs, dp, consumed):
    for r in range(dp):
        sampler = MicrobatchSampler(total, consumed, mbs, r, dp)
        reference = list(megatron_pretraining_sampler(total, consumed, mbs, r, dp))
        assert list(sampler) == reference
        assert len(sampler) == len(reference)


@pytest.mark.parametrize("mbs, dp", [(2, 2), (1, 3), (4, 1)])
def test_sampler_resumed_is_the_tail(mbs, dp):
    step = mbs * dp
    total = 25 * step + 1  # a ragged end is dropped either way
    for r in range(dp):
        full = list(MicrobatchSampler(total, 0, mbs, r, dp))
        assert len(full) == 25
        for k in (0, 1, 7, 24, 25):
            resumed = MicrobatchSampler(total, k * step, mbs, r, dp)
            assert list(resumed) == full[k:]
            assert len(resumed) == len(full) - k


# --- document splits -----------------------------------------------------------------


def megatron_core_documents_per_split(num_documents, split):
    """How megatron-core's builder actually cuts a low-level dataset."""
    from megatron.core.datasets.blended_megatron_dataset_config import (
        convert_split_vector_to_split_matrix,
        parse_and_normalize_split,
    )

    matrix = convert_split_vector_to_split_matrix(parse_and_normalize_split(split))
    return [
        0
        if b is None
        else int(round(b[1] * float(num_documents))) - int(round(b[0] * float(num_documents)))
        for b in matrix
    ]


SPLITS = [
    "969,30,1",
    "98,2,0",
    "1,1,1",
    "99,1",
    "949,50,1",
    "1,0,0",
    "0,1,0",
    "2,1,1",
    "8,1,1",
    "0.5,0.3,0.2",
    "100,0,0",
    "3/1/1",
]


@pytest.mark.parametrize("split", SPLITS)
def test_documents_per_split_sums_to_documents(split):
    weights = data.split_weights(split)
    for n in list(range(0, 50)) + [999, 1000, 12345]:
        counts = documents_per_split(n, weights)
        assert len(counts) == 3
        assert sum(counts) == n, (n, split, counts)
        assert all(c >= 0 for c in counts)
        # A zero weight gets no document.
        assert all(c == 0 for c, w in zip(counts, weights) if w == 0)


def test_documents_per_split_examples():
    assert documents_per_split(3, [98, 1, 1]) == [3, 0, 0]
    assert documents_per_split(3, [1, 1, 1]) == [1, 1, 1]
    assert documents_per_split(1000, [969, 30, 1]) == [969, 30, 1]
    assert documents_per_split(100, [969, 30, 1]) == [97, 3, 0]


@pytest.mark.parametrize("split", SPLITS)
def test_documents_per_split_matches_megatron_core_common_splits(split):
    for n in (1, 2, 3, 4, 5, 7, 10, 20, 100, 1000):
        assert documents_per_split(
            n, data.split_weights(split)
        ) == megatron_core_documents_per_split(n, split), (n, split)


@pytest.mark.parametrize(
    "n, split", [(11, "15,7,0"), (173, "0.9,0.9,0"), (30, "90,5,5"), (10, "47,8,45")]
)
def test_documents_per_split_matches_megatron_core_at_rounding_boundaries(n, split):
    assert documents_per_split(n, data.split_weights(split)) == megatron_core_documents_per_split(
        n, split
    )
