"""Random draws that follow the sample (--deadpool-sample-rng,
deadpool_ext/rank/sample_rng.py): a microbatch's seed depends on its
sample, stage and chunk only, and the draws after the reseed follow the
sample, not the rank. Where each microbatch's samples are is
tests/unit_tests/training/test_training.py's; a shrink, a grow and a resume
at another data-parallel size are run with real processes in
tests/functional_tests/test_chaos.py."""

import types

import pytest
import torch

from megatron.training import cpu_compat

cpu_compat.import_megatron_core_without_cuda()  # import-time only

from megatron.core import parallel_state, tensor_parallel  # noqa: E402
from megatron.core.tensor_parallel import random as mcore_random  # noqa: E402

from deadpool_ext.rank import sample_rng  # noqa: E402
from deadpool_ext.rank.sample_rng import SEED_BITS, SampleRngHook, sample_seed  # noqa: E402
from megatron.training.training import MicrobatchPosition  # noqa: E402


def test_a_microbatch_seed_depends_on_its_sample_stage_and_chunk_only():
    seeds = {
        sample_seed(seed, first, stage, chunk)
        for seed in (1234, 1235)
        for first in (0, 4, 8)
        for stage in (0, 1)
        for chunk in (0, 1)
    }
    assert len(seeds) == 2 * 3 * 2 * 2
    assert all(0 <= s < 2**SEED_BITS for s in seeds)
    assert sample_seed(1234, 8, 1, 0) == sample_seed(1234, 8, 1, 0)


@pytest.fixture
def one_rank(monkeypatch):
    """One rank of pipeline stage 1, its "CUDA" streams the host's generator
    as cpu_compat maps them in a run (here for this test only: cpu_compat's
    patches are process-wide)."""
    monkeypatch.setattr(torch.cuda, "get_rng_state", lambda device="cuda": torch.get_rng_state())
    monkeypatch.setattr(torch.cuda, "manual_seed", lambda seed: torch.manual_seed(int(seed)))
    monkeypatch.setattr(mcore_random, "_get_cuda_rng_state", lambda **kw: torch.get_rng_state())
    monkeypatch.setattr(mcore_random, "_set_cuda_rng_state", lambda s, **kw: torch.set_rng_state(s))
    for name in ("tensor_model", "expert_model", "expert_tensor"):
        monkeypatch.setattr(mcore_random, f"get_{name}_parallel_rank", lambda: 0)
    monkeypatch.setattr(parallel_state, "get_pipeline_model_parallel_rank", lambda: 1)
    monkeypatch.setattr(sample_rng.parallel_state, "get_pipeline_model_parallel_rank", lambda: 1)


def _draws(hook, first_sample, before):
    """What dropout draws after the hook reseeded for ``first_sample``, from
    whatever state the streams were in (``before``)."""
    torch.manual_seed(before)
    torch.rand(7)  # what ran before moves the streams on
    trainer = types.SimpleNamespace(microbatch=MicrobatchPosition(0, 3, first_sample))
    hook.before_microbatch(trainer)
    plain = torch.rand(4)  # e.g. hidden dropout outside tensor-parallel regions
    with tensor_parallel.get_cuda_rng_tracker().fork():  # e.g. attention dropout
        parallel = torch.rand(4)
    return torch.cat([plain, parallel])


def test_the_draws_after_the_reseed_follow_the_sample_not_the_rank(one_rank):
    config = types.SimpleNamespace(
        training=types.SimpleNamespace(seed=1234),
        gpu=types.SimpleNamespace(te_rng_tracker=False, cuda_graph_impl="none"),
    )
    hook = SampleRngHook(config)
    assert torch.equal(_draws(hook, 16, before=1), _draws(hook, 16, before=2))
    # Control: another microbatch draws other masks.
    assert not torch.equal(_draws(hook, 16, before=1), _draws(hook, 18, before=1))
    # Validation (no position): the streams are left as they are.
    torch.manual_seed(5)
    hook.before_microbatch(types.SimpleNamespace(microbatch=None))
    after = torch.rand(3)
    torch.manual_seed(5)
    assert torch.equal(after, torch.rand(3))
