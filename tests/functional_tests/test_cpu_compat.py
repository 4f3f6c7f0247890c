"""Tests for megatron/training/cpu_compat.py.

Its patches are process-global, so each scenario runs in a fresh Python
process: a script registers named checks, runs them all and prints one JSON
line {check: null or traceback}; each test below asserts one check. Two
processes in all (importing torch and megatron-core dominates the cost).
"""

import json
import os
import subprocess
import sys
import textwrap

import pytest

# Every test here starts real processes.
pytestmark = pytest.mark.integration

REPO = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

HARNESS = textwrap.dedent("""
    import json, sys, traceback
    CHECKS = {}
    def check(fn):
        CHECKS[fn.__name__] = fn
        return fn
    def run_checks():
        results = {}
        for name, fn in CHECKS.items():
            try:
                fn()
                results[name] = None
            except BaseException:
                results[name] = traceback.format_exc()
        print("RESULTS " + json.dumps(results))
""")

# CUDA "available", enable() without force: nothing may change.
UNFORCED = HARNESS + textwrap.dedent("""
    import torch
    torch.cuda.is_available = lambda: True
    from megatron.core.tensor_parallel import random as mcore_random
    from megatron.training import cpu_compat

    FACTORIES = ["empty", "zeros", "ones", "full", "tensor", "arange", "rand", "randn",
                 "randint", "randperm", "empty_like", "zeros_like", "ones_like", "full_like",
                 "as_tensor", "linspace", "empty_strided"]
    def snapshot():
        s = {("torch", n): getattr(torch, n) for n in FACTORIES}
        for n in ("current_device", "synchronize", "get_rng_state", "set_rng_state",
                  "manual_seed", "manual_seed_all", "empty_cache", "Stream",
                  "current_stream", "stream"):
            s[("torch.cuda", n)] = getattr(torch.cuda, n)
        from megatron.core.transformer.moe import moe_utils, token_dispatcher
        s[("moe_utils", "maybe_move_tensor_to_cpu")] = moe_utils.maybe_move_tensor_to_cpu
        s[("token_dispatcher", "maybe_move_tensor_to_cpu")] = (
            token_dispatcher.maybe_move_tensor_to_cpu)
        for n in ("cuda", "type", "to"):
            s[("Tensor", n)] = getattr(torch.Tensor, n)
        for n in ("_get_cuda_rng_state", "_set_cuda_rng_state"):
            s[("mcore_random", n)] = getattr(mcore_random, n)
        return s

    BEFORE = snapshot()
    ACTIVE_BEFORE = cpu_compat.is_active()
    RETURNED = cpu_compat.enable()
    AFTER = snapshot()

    @check
    def returns_false_and_stays_inactive():
        assert ACTIVE_BEFORE is False
        assert RETURNED is False, RETURNED
        assert cpu_compat.is_active() is False

    @check
    def changes_nothing():
        changed = [k for k in BEFORE if AFTER[k] is not BEFORE[k]]
        assert not changed, changed
        assert torch.ones(2).type() == "torch.FloatTensor"

    @check
    def force_enables_even_with_cuda():
        assert cpu_compat.enable(force=True) is True
        assert cpu_compat.is_active() is True
        assert torch.ones(2).type() == "torch.cuda.FloatTensor"
        assert torch.zeros(2, device="cuda").device.type == "cpu"

    run_checks()
""")

# No CUDA (this CPU build), enable(force=True): every mapping megatron-core needs.
FORCED = HARNESS + textwrap.dedent("""
    import logging
    import torch
    from megatron.training import cpu_compat

    ACTIVE_BEFORE = cpu_compat.is_active()
    RETURNED = cpu_compat.enable(force=True)

    def is_cpu(t):
        return isinstance(t, torch.Tensor) and t.device.type == "cpu"

    def mask(n=4096):
        return torch.nn.functional.dropout(torch.ones(n), p=0.5, training=True)

    @check
    def enable_returns_true_and_is_active():
        assert ACTIVE_BEFORE is False
        assert RETURNED is True
        assert cpu_compat.is_active() is True

    @check
    def idempotent():
        zeros, type_, to = torch.zeros, torch.Tensor.type, torch.Tensor.to
        assert cpu_compat.enable(force=True) is True
        assert cpu_compat.enable() is True
        # Not wrapped twice.
        assert torch.zeros is zeros and torch.Tensor.type is type_ and torch.Tensor.to is to
        assert torch.ones(2).type() == "torch.cuda.FloatTensor"
        assert torch.ones(2).to("cuda").device.type == "cpu"

    @check
    def current_device():
        device = torch.cuda.current_device()
        assert is_cpu(torch.empty(3, device=device))
        assert torch.device(device).type == "cpu"
        torch.cuda.synchronize()
        torch.cuda.empty_cache()

    @check
    def factories_with_cuda_device():
        made = {
            "zeros": torch.zeros(2, device="cuda"),
            "zeros_dev": torch.zeros(2, device=torch.device("cuda")),
            "empty_current": torch.empty(3, device=torch.cuda.current_device()),
            "ones_idx": torch.ones(2, device="cuda:0"),
            "ones_int": torch.ones(2, device=0),
            "full": torch.full((2,), 7.0, device="cuda"),
            "tensor": torch.tensor([1.0, 2.0], device="cuda"),
            "arange": torch.arange(4, device="cuda"),
            "rand": torch.rand(2, device="cuda"),
            "randn": torch.randn(2, device="cuda"),
            "randint": torch.randint(0, 5, (3,), device="cuda"),
            "zeros_like": torch.zeros_like(torch.ones(2), device="cuda"),
            "empty_like": torch.empty_like(torch.ones(2), device="cuda"),
            "as_tensor": torch.as_tensor([1, 2], device="cuda"),
            "linspace": torch.linspace(0, 1, 5, device="cuda"),
        }
        bad = {k: str(v.device) for k, v in made.items() if not is_cpu(v)}
        assert not bad, bad
        assert made["zeros"].tolist() == [0.0, 0.0]
        assert made["full"].tolist() == [7.0, 7.0]
        assert made["tensor"].tolist() == [1.0, 2.0]
        assert made["arange"].tolist() == [0, 1, 2, 3]
        assert made["zeros"].dtype == torch.float32
        # Factories without a device still work, and keep their dtype arguments.
        assert torch.zeros(2, dtype=torch.bfloat16, device="cuda").dtype == torch.bfloat16

    @check
    def one_host_stream():
        # megatron-core's all-to-all MoE dispatcher: a side stream that is the
        # current one (so no CPU tensor is asked to record a stream).
        side = torch.cuda.Stream()
        assert side is torch.cuda.current_stream()
        with torch.cuda.stream(side):
            side.wait_stream(torch.cuda.current_stream())
        side.record_event().synchronize()

    @check
    def moe_split_sizes_reach_the_host_as_numpy():
        import numpy as np
        from megatron.core.transformer.moe import moe_utils, token_dispatcher
        sizes = torch.tensor([3, 1])
        for module in (moe_utils, token_dispatcher):
            copied = module.maybe_move_tensor_to_cpu(sizes, as_numpy=True)
            assert isinstance(copied, np.ndarray) and copied.tolist() == [3, 1]
            assert module.maybe_move_tensor_to_cpu(sizes) is sizes

    @check
    def tensor_cuda_is_identity():
        t = torch.arange(3.0)
        assert t.cuda() is t
        assert is_cpu(t.cuda(0)) and is_cpu(t.cuda(non_blocking=True))
        assert t.cuda().tolist() == [0.0, 1.0, 2.0]

    @check
    def type_names_are_cuda():
        expected = {torch.float32: "torch.cuda.FloatTensor",
                    torch.float16: "torch.cuda.HalfTensor",
                    torch.bfloat16: "torch.cuda.BFloat16Tensor",
                    torch.float64: "torch.cuda.DoubleTensor",
                    torch.int64: "torch.cuda.LongTensor"}
        got = {str(d): torch.ones(2, dtype=d).type() for d in expected}
        assert got == {str(d): n for d, n in expected.items()}, got
        assert torch.ones(2).type() == "torch.cuda.FloatTensor"
        assert torch.ones(2, dtype=torch.bfloat16).type() == "torch.cuda.BFloat16Tensor"

    @check
    def type_still_converts():
        t = torch.tensor([1.5, 2.25])
        half = t.type(torch.float16)
        assert half.dtype == torch.float16 and is_cpu(half)
        assert half.tolist() == [1.5, 2.25]
        assert t.type(torch.int64).tolist() == [1, 2]
        assert t.type(dtype=torch.float64).dtype == torch.float64
        by_name = t.type("torch.cuda.HalfTensor")
        assert by_name.dtype == torch.float16 and is_cpu(by_name)
        assert t.type("torch.DoubleTensor").dtype == torch.float64
        # The original tensor is untouched.
        assert t.dtype == torch.float32

    @check
    def to_cuda_stays_on_cpu():
        t = torch.arange(3.0)
        for moved in (t.to("cuda"), t.to("cuda:0"), t.to(torch.device("cuda")),
                      t.to(device="cuda"), t.to(device=torch.cuda.current_device()),
                      t.to("cuda", non_blocking=True)):
            assert is_cpu(moved) and moved.tolist() == [0.0, 1.0, 2.0]
        both = t.to("cuda", torch.float16)
        assert is_cpu(both) and both.dtype == torch.float16
        assert t.to(torch.float64).dtype == torch.float64
        assert t.to(torch.ones(1, dtype=torch.int32)).dtype == torch.int32

    @check
    def cuda_manual_seed_seeds_the_cpu_stream():
        torch.cuda.manual_seed(7)
        a, ma = torch.rand(8), mask()
        torch.manual_seed(7)
        b, mb = torch.rand(8), mask()
        assert torch.equal(a, b) and torch.equal(ma, mb)
        torch.cuda.manual_seed_all(11)
        c = torch.rand(8)
        torch.manual_seed(11)
        assert torch.equal(c, torch.rand(8))
        # get/set_rng_state are the CPU generator's.
        state = torch.cuda.get_rng_state()
        assert torch.equal(state, torch.get_rng_state())
        x = torch.rand(4)
        torch.cuda.set_rng_state(state)
        assert torch.equal(x, torch.rand(4))

    def seeded_tracker(seed, tp_rank=0):
        from megatron.core import tensor_parallel
        tensor_parallel.model_parallel_cuda_manual_seed(seed, tp_rank=tp_rank, ep_rank=0,
                                                        etp_rank=0)
        return tensor_parallel.get_cuda_rng_tracker()

    @check
    def tracker_switches_streams():
        tracker = seeded_tracker(123)
        start = torch.get_rng_state()
        default_mask = mask()
        torch.set_rng_state(start)
        with tracker.fork():
            fork1 = mask()
        with tracker.fork():
            fork2 = mask()
        # The forks drew from their own stream: the default stream did not move.
        assert torch.equal(mask(), default_mask)
        assert not torch.equal(fork1, default_mask)
        # The tracker's state advanced: the second fork continues the stream.
        assert not torch.equal(fork1, fork2)
        # Exactly megatron's streams: default seeded with the seed, the
        # model-parallel one with seed + 2718 + tp_rank.
        torch.manual_seed(123)
        assert torch.equal(mask(), default_mask)
        torch.manual_seed(123 + 2718)
        assert torch.equal(mask(), fork1) and torch.equal(mask(), fork2)

    @check
    def tracker_streams_differ_per_tp_rank():
        tracker = seeded_tracker(5, tp_rank=0)
        with tracker.fork():
            rank0 = mask()
        tracker = seeded_tracker(5, tp_rank=1)
        with tracker.fork():
            rank1 = mask()
        assert not torch.equal(rank0, rank1)
        from megatron.core.tensor_parallel.random import get_data_parallel_rng_tracker_name
        with tracker.fork(get_data_parallel_rng_tracker_name()):
            dp = mask()
        torch.manual_seed(5)
        assert torch.equal(dp, mask())

    @check
    def tracker_states_round_trip():
        tracker = seeded_tracker(321)
        with tracker.fork():
            mask()  # move the stream away from its seed
        saved = {k: v.clone() for k, v in tracker.get_states().items()}
        with tracker.fork():
            first = mask()
        with tracker.fork():
            mask()
        tracker.set_states({k: v.clone() for k, v in saved.items()})
        with tracker.fork():
            again = mask()
        assert torch.equal(first, again)
        # And without the restore, the stream would have given something else.
        with tracker.fork():
            assert not torch.equal(mask(), first)

    @check
    def no_spurious_rng_warning():
        records = []
        class Grab(logging.Handler):
            def emit(self, record):
                records.append(record.getMessage())
        logger = logging.getLogger("megatron.core.tensor_parallel.random")
        handler = Grab()
        logger.addHandler(handler)
        try:
            tracker = seeded_tracker(9)
            with tracker.fork():
                mask()
        finally:
            logger.removeHandler(handler)
        assert not [r for r in records if "CPU RNG state changed" in r], records

    run_checks()
""")


def _run(code):
    env = dict(os.environ, PYTHONPATH=REPO, OMP_NUM_THREADS="1")
    proc = subprocess.run(
        [sys.executable, "-c", code], cwd=REPO, env=env, capture_output=True, text=True, timeout=120
    )
    lines = [line for line in proc.stdout.splitlines() if line.startswith("RESULTS ")]
    assert proc.returncode == 0 and lines, (
        f"check process failed (rc {proc.returncode}):\n{proc.stdout[-3000:]}\n"
        f"{proc.stderr[-3000:]}"
    )
    return json.loads(lines[-1][len("RESULTS ") :])


@pytest.fixture(scope="module")
def unforced():
    return _run(UNFORCED)


@pytest.fixture(scope="module")
def forced():
    return _run(FORCED)


def _passed(results, name):
    assert name in results, f"check {name} did not run: {sorted(results)}"
    assert results[name] is None, results[name]


@pytest.mark.parametrize(
    "name", ["returns_false_and_stays_inactive", "changes_nothing", "force_enables_even_with_cuda"]
)
def test_with_cuda_available(unforced, name):
    _passed(unforced, name)


@pytest.mark.parametrize(
    "name",
    [
        "enable_returns_true_and_is_active",
        "idempotent",
        "current_device",
        "factories_with_cuda_device",
        "tensor_cuda_is_identity",
        "type_names_are_cuda",
        "type_still_converts",
        "to_cuda_stays_on_cpu",
        "one_host_stream",
        "moe_split_sizes_reach_the_host_as_numpy",
        "cuda_manual_seed_seeds_the_cpu_stream",
        "tracker_switches_streams",
        "tracker_streams_differ_per_tp_rank",
        "tracker_states_round_trip",
        "no_spurious_rng_warning",
    ],
)
def test_forced_on_cpu(forced, name):
    _passed(forced, name)


def test_every_check_is_asserted(unforced, forced):
    """A check added to a script but not to the lists above would pass unseen."""
    for results, test in ((unforced, test_with_cuda_available), (forced, test_forced_on_cpu)):
        names = next(m.args[1] for m in test.pytestmark if m.name == "parametrize")
        assert sorted(results) == sorted(names)
