"""The training loop (megatron/training/training.py), in-process: each
training microbatch's place in the run (MicrobatchPosition) is the place of
the samples the data pipeline gives it, whatever the data-parallel layout,
and each model chunk counts its own microbatches; skipped and NaN
iterations are counted per log interval; --exit-on-missing-checkpoint acts
only with a load folder; FIM sentinels without an id are refused before
training."""

import types

import pytest

from megatron.training import cpu_compat
from megatron.training.arguments import ConfigError, parse_args
from tests.unit_tests.training.test_checkpointing import config
from tests.unit_tests.training.test_fim import flags

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


def test_exit_on_missing_checkpoint_acts_only_with_a_load_folder(tmp_path):
    """With --load naming an empty folder the run ends before its first
    iteration (exit 0, as Megatron-LM); without --load the flag has no
    effect (the parser says so) and the run starts from scratch."""
    import types

    from megatron.training import cpu_compat

    cpu_compat.import_megatron_core_without_cuda()
    from megatron.training.training import NothingToResume, Trainer

    def trainer(*flags):
        quiet = types.SimpleNamespace(info=lambda *args: None)
        return types.SimpleNamespace(config=config(*flags), state=None, logger=quiet)

    Trainer.load(trainer("--exit-on-missing-checkpoint"))  # starts from scratch
    empty = str(tmp_path / "empty")
    with pytest.raises(NothingToResume, match="--exit-on-missing-checkpoint"):
        Trainer.load(trainer("--exit-on-missing-checkpoint", "--load", empty))


class NoUnknown:
    """A vocabulary without the sentinels, and a tokenizer without an
    unknown token (Hugging Face's gives None then)."""

    vocab = ["a", "b"]
    eod = 0

    class _tokenizer:
        @staticmethod
        def tokens_to_ids(tokens):
            return [None for _ in tokens]


def test_sentinels_without_an_id_are_refused_before_training(corpus_prefix, tmp_path):
    from megatron.training.training import _check_sentinels

    config = parse_args(flags(corpus_prefix, tmp_path, "--fim-data"), world_size=1)
    with pytest.raises(ConfigError, match="no unknown token to stand for it"):
        _check_sentinels(config, NoUnknown(), say=False)


def test_skipped_and_nan_iterations_are_counted_per_log_interval():
    from megatron.training.training import _LogWindow

    window = _LogWindow()
    window.add(1.0, {"lm loss": float("nan")}, skipped=True)
    window.add(1.0, {"lm loss": 2.0}, skipped=True)
    assert (window.iterations, window.skipped, window.nans) == (2, 2, 1)
    window.__init__()  # what the log line does after printing
    window.add(1.0, {"lm loss": 2.0}, skipped=False)
    assert (window.skipped, window.nans) == (0, 0)
