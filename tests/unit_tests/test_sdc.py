"""Silent data corruption, in-process: what a digest sees, which replica
the majority names, what --deadpool-on-sdc decides, the flip fault's specs
and its bit arithmetic. (Flips in running jobs, caught and redone bit for
bit: tests/functional_tests/test_hot_swap.py, scenario "flips", and
``python -m tools.sdc_campaign``.)"""

from types import SimpleNamespace

import pytest
import torch

from megatron.training.replica_check import ReplicaHashCheck, replica_check_hooks

from deadpool_ext.defaults import SDC_REPEAT_WINDOW
from deadpool_ext import protocol as P
from deadpool_ext.control.record import JobRecord
from deadpool_ext.protocol import CoordinatorSettings
from deadpool_ext.policy.effects import Caught
from deadpool_ext.policy.faults import SdcAction, corruption_verdict
from deadpool_ext.inject import InjectError, parse_fault
from deadpool_ext.rank.flips import flip_bit
from deadpool_ext.rank.sdc import ReplicaDigestCheck
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


def test_flip_bit_flips_exactly_one_bit_the_sign_bit_too():
    tensor = torch.tensor([1.5, -2.0, 3.0])
    flip_bit(tensor, 1, 31)
    assert tensor.tolist() == [1.5, 2.0, 3.0]
    flip_bit(tensor, 0, 0)
    assert tensor[0].item() == pytest.approx(1.5 + 2**-23)


def test_the_majority_names_the_odd_replica_and_two_cannot_tell():
    assert odd_ones_out([7, 7, 7]) is None
    assert odd_ones_out([7, 7, 9, 7]) == [2]
    assert odd_ones_out([7, 9]) == [0, 1]  # two replicas: either may be wrong
    assert odd_ones_out([7, 7, 9, 9]) == [0, 1, 2, 3]  # a tie names everyone
    assert odd_ones_out([1, 2, 3]) == [0, 1, 2]


def fault(iteration, suspects, on_sdc="rollback", check="weight-hash"):
    return P.NumericFault(
        gen=0,
        rank=0,
        slot="0.0",
        iteration=iteration,
        error="x",
        check=check,
        suspects=suspects,
        on_sdc=on_sdc,
    )


class Book:
    """The job's record of corruptions caught, judged as the coordinator's
    trigger does: a verdict from what was caught before, then the catch
    kept (a swapped rank's record starts afresh)."""

    def __init__(self, window=SDC_REPEAT_WINDOW):
        self.record, self.window = JobRecord.launched(CoordinatorSettings(), 2, 1, 2), window

    def decide(self, m):
        verdict = corruption_verdict(m, dict(self.record.caught), self.window)
        swapped = verdict.rank if verdict.action == SdcAction.SWAP else None
        self.record.change(Caught(tuple(sorted(m.suspects)), m.iteration, swapped))
        return verdict


def test_a_first_catch_is_redone_and_a_repeat_within_the_window_swaps_the_rank():
    book = Book(window=100)
    assert book.decide(fault(10, [3])).action == "rollback"
    assert book.decide(fault(500, [5])).action == "rollback"  # another rank
    again = book.decide(fault(60, [3]))
    assert (again.action, again.rank) == ("swap", 3)
    assert "caught again within 100 iterations" in again.why
    assert book.decide(fault(400, [3])).action == "rollback"  # outside the window


def test_a_swapped_rank_starts_afresh():
    book = Book(window=100)
    book.decide(fault(10, [3]))
    assert book.decide(fault(11, [3])).action == "swap"
    assert book.decide(fault(12, [3])).action == "rollback"


def test_a_pair_caught_twice_stops_the_job_rather_than_keep_the_bad_copy():
    book = Book(window=100)
    assert book.decide(fault(10, [1, 3])).action == "rollback"
    verdict = book.decide(fault(12, [1, 3]))
    assert verdict.action == "stop" and "cannot tell which" in verdict.why


def test_swap_and_stop_policies():
    book = Book()
    swap = book.decide(fault(5, [2], on_sdc="swap", check="mirror-replay"))
    assert (swap.action, swap.rank) == ("swap", 2) and "--deadpool-on-sdc swap" in swap.why
    # Two suspects: nobody to swap, so the iteration is redone.
    assert book.decide(fault(5, [0, 2], on_sdc="swap")).action == "rollback"
    stop = book.decide(fault(5, [2], on_sdc="stop"))
    assert stop.action == "stop" and "mirror" not in stop.why and "weight-hash" in stop.why


def test_the_record_survives_a_takeover():
    book = Book()
    book.decide(fault(10, [1, 3]))
    book.record = JobRecord.from_json(book.record.to_json())
    assert book.decide(fault(11, [1, 3])).action == "stop"


def test_a_corruption_travels_with_its_check_and_suspects():
    message = fault(4, [2], check="mirror-replay")
    parsed = P.parse_message(message.body())
    assert (parsed.check, parsed.suspects, parsed.on_sdc) == ("mirror-replay", [2], "rollback")
    nan = P.parse_message(
        {k: v for k, v in message.body().items() if k not in ("check", "suspects")}
    )
    assert nan.check == "nan" and nan.suspects == []


def test_the_error_names_the_check_the_iteration_and_the_suspects():
    error = SilentCorruption("weight-hash", 7, [1, 3], "digests differ")
    assert str(error).startswith(
        "silent data corruption (weight-hash) in iteration 7, suspect rank(s) 1, 3: "
    )


@pytest.mark.parametrize(
    "spec,where",
    [
        ("flip:rank=2:iter=5:target=param:bit=30", ("after-step", 30)),
        ("flip:rank=0:iter=1:target=grad", ("grad-reduce", None)),
        ("flip:rank=0:iter=3:target=optimizer:seed=9", ("optimizer", None)),
        ("flip:rank=1:iter=3:target=mirror", ("forward", None)),
    ],
)
def test_flip_specs(spec, where):
    parsed = parse_fault(spec)
    assert (parsed.point, parsed.bit) == where and parsed.action == "flip"


@pytest.mark.parametrize(
    "spec,message",
    [
        ("flip:rank=2:iter=5", "flip takes rank=N, iter=N and target=NAME"),
        ("flip:rank=2:iter=5:target=activation", "target must be one of param, grad"),
        ("flip:node=1:iter=5:target=param", "'node=1' is not rank=N"),
        ("flip:rank=2:iter=0:target=param", "iter=0 never comes"),
        ("flip:rank=2:iter=5:target=param:bit=x", "integers >= 0"),
    ],
)
def test_bad_flip_specs_say_what_to_write(spec, message):
    with pytest.raises(InjectError, match=message):
        parse_fault(spec)


def test_megatron_lms_check_is_added_unless_an_extension_checks_instead():
    config = SimpleNamespace(
        training=SimpleNamespace(check_weight_hash_across_dp_replicas_interval=None)
    )
    assert replica_check_hooks(config, []) == []
    config.training.check_weight_hash_across_dp_replicas_interval = 5
    (hook,) = replica_check_hooks(config, [])
    assert type(hook) is ReplicaHashCheck and hook.interval == 5
    assert replica_check_hooks(config, [ReplicaDigestCheck(1)]) == []


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
