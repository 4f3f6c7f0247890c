"""What --deadpool-on-sdc decides when a corruption is caught
(deadpool_ext/policy/faults.py), judged on the job's record as the
coordinator's trigger does: a first catch is redone, a repeat within the
window swaps the rank, a pair caught twice stops the job, and the record
survives a takeover. (Flips in running jobs, caught and redone bit for bit:
tests/functional_tests/test_hot_swap.py, scenario "flips", and
``python -m tools.sdc_campaign``.)"""

from deadpool_ext.defaults import SDC_REPEAT_WINDOW
from deadpool_ext import protocol as P
from deadpool_ext.control.record import JobRecord
from deadpool_ext.protocol import CoordinatorSettings
from deadpool_ext.policy.effects import Caught
from deadpool_ext.policy.faults import SdcAction, corruption_verdict


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
