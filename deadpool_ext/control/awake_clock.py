"""A clock that stands still while its own process is not running.

The coordinator and the standby judge others by silence: a heartbeat or a
lease unchanged for the heartbeat timeout. Time in which the judge itself
did not run (SIGSTOP, a hypervisor pausing its VM, a host swapping) is
nobody else's silence: node 0's launcher also serves the store, so while it
is paused nobody can beat at all, and on waking every beat looks as old as
the pause. Its loop ticks this clock once a round; a round that comes
``pause_after_s`` or more late is a pause, and the clock skips it, so every
silence, deadline and wait measured on it resumes where it stood.
"""

import time
from typing import Callable


class AwakeClock:
    def __init__(self, clock: Callable[[], float] = time.monotonic, pause_after_s: float = 2.5):
        self.clock, self.pause_after_s = clock, pause_after_s
        self.skipped_s = 0.0
        self.ticked_at = None  # the underlying clock at the last tick

    def __call__(self) -> float:
        return self.clock() - self.skipped_s

    def rebase(self) -> None:
        """The time since the last tick was spent on purpose (a call that
        may block): the next round is late by nothing."""
        self.ticked_at = self.clock()

    def tick(self) -> float:
        """Once per round of the loop: the pause that ended now (0.0: none)."""
        now, last = self.clock(), self.ticked_at
        self.ticked_at = now
        if last is None or now - last < self.pause_after_s:
            return 0.0
        self.skipped_s += now - last
        return now - last
