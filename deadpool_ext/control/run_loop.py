"""The coordinator's run: its steps until the job ends, then what the end says.

Node 0's launcher runs it, and node 1's once its standby took over
(launch.py). Between steps it asks ``alive`` (the launcher's watch of the
agents it started) and, while the coordinator is cut off from the majority,
``taken_over`` (whether the standby's store shows that it took over: a
connection across the network, so asked every STANDBY_PROBE_S at most).
"""

import time
from typing import Callable, Optional

from deadpool_ext.control.coordinator import Coordinator
from deadpool_ext.defaults import ABORT_GRACE_S, STANDBY_PROBE_S, STATUS_EVERY_S
from deadpool_ext.policy.ending import at_end


def run(
    coordinator: Coordinator,
    poll_s: float = 0.01,
    alive: Callable[[], bool] = lambda: True,
    abort_grace_s: float = ABORT_GRACE_S,
    taken_over: Optional[Callable[[], bool]] = None,
    status_to: Optional[Callable[[dict], None]] = None,
) -> int:
    """The launcher's exit code once the job ended (or this coordinator's
    side of a partition left it). ``status_to``: gets the coordinator's
    status every STATUS_EVERY_S (the metrics endpoint)."""
    probed_at = told_at = float("-inf")
    while not coordinator.finished and coordinator.watch.fenced is None and alive():
        coordinator.step()
        if status_to is not None and time.monotonic() - told_at >= STATUS_EVERY_S:
            told_at = time.monotonic()
            status_to(coordinator.status())
        cut_off = coordinator.watch.cut_off_at is not None
        if cut_off and taken_over is not None and time.monotonic() - probed_at >= STANDBY_PROBE_S:
            probed_at = time.monotonic()
            if taken_over():
                coordinator.superseded()
            coordinator.clock.rebase()  # the wait for an answer was no pause
        time.sleep(poll_s)
    if coordinator.record.result is not None:
        let_reporters_stop(coordinator, poll_s, alive, abort_grace_s)
    code, last = at_end(coordinator.view())
    for effect in last:
        coordinator.carry_out(effect)
    return code


def let_reporters_stop(coordinator: Coordinator, poll_s: float, alive, grace_s: float) -> None:
    """The ranks that reported wait for the decision: after an abort they
    log why and exit by themselves (the reason then reaches each rank's log
    and the events), unless the grace runs out."""
    m = coordinator.record.membership
    waiting = {m.members[r] for r in coordinator.round.reports if r in m.members}
    deadline = time.monotonic() + grace_s
    while waiting - m.exited and time.monotonic() < deadline and alive():
        for message in coordinator.inbox.poll():
            coordinator.take(message)
        time.sleep(poll_s)
