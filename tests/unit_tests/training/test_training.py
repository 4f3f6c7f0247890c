"""The training loop (megatron/training/training.py), in-process: each
training microbatch's place in the run (MicrobatchPosition) is the place of
the samples the data pipeline gives it, whatever the data-parallel layout,
and each model chunk counts its own microbatches."""

import types

import pytest

from megatron.training import cpu_compat

cpu_compat.import_megatron_core_without_cuda()  # import-time only

from megatron.training.data import MicrobatchSampler, microbatches_per_iteration  # noqa: E402
from megatron.training.training import MicrobatchPosition, Trainer  # noqa: E402


def _trainer(consumed, micro_batch, dp_rank, dp_size, chunks=1):
    model = [types.SimpleNamespace(module=object()) for _ in range(chunks)]
    trainer = types.SimpleNamespace(
        _microbatches_started=[0] * chunks,
        state=types.SimpleNamespace(model=model),
        config=types.SimpleNamespace(
            data_parallel_size=dp_size, batch=types.SimpleNamespace(micro_batch_size=micro_batch)
        ),
        runtime=types.SimpleNamespace(dp_rank=dp_rank),
        progress=types.SimpleNamespace(consumed_samples=consumed),
    )
    trainer._chunk_index = Trainer._chunk_index.__get__(trainer)
    return trainer


@pytest.mark.parametrize("dp_size", [1, 2, 3, 4])
def test_a_microbatch_position_is_where_its_samples_are_at_any_data_parallel_size(dp_size):
    """Against the data pipeline's own order (MicrobatchSampler): each
    rank's k-th microbatch of the iteration starts at the sample its
    position names, also with the uneven quotas of a shrunk job (DP 3 of
    12 microbatch slots and of 10); together the ranks cover the
    iteration's samples once, the same set at every size."""
    mbs, consumed = 2, 40
    for global_batch in (24, 20):
        firsts = []
        for rank in range(dp_size):
            quota = microbatches_per_iteration(global_batch, mbs, rank, dp_size)
            sampler = iter(MicrobatchSampler(1000, consumed, mbs, rank, dp_size, global_batch))
            trainer = _trainer(consumed, mbs, rank, dp_size)
            for number in range(quota):
                position = Trainer._next_position(trainer, trainer.state.model[0])
                assert position == MicrobatchPosition(0, number, next(sampler)[0])
                firsts.append(position.first_sample)
        assert sorted(firsts) == list(range(consumed, consumed + global_batch, mbs))


def test_each_model_chunk_counts_its_own_microbatches():
    """The interleaved schedule runs chunk 1's first microbatch after
    chunk 0's first ones: it is still microbatch 0 there."""
    trainer = _trainer(consumed=0, micro_batch=1, dp_rank=0, dp_size=2, chunks=2)
    first, second = trainer.state.model
    order = [first, first, second, first, second]
    got = [Trainer._next_position(trainer, chunk) for chunk in order]
    assert [(p.chunk, p.number, p.first_sample) for p in got] == [
        (0, 0, 0),
        (0, 1, 2),
        (1, 0, 0),
        (0, 2, 4),
        (1, 1, 2),
    ]
    # The model inside a chunk's wrappers is that chunk (the combined 1F1B
    # schedule passes it); a model of no chunk is a bug, said.
    assert Trainer._next_position(trainer, second.module).chunk == 1
    with pytest.raises(ValueError):
        Trainer._next_position(trainer, object())
