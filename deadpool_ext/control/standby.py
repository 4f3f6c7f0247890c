"""The standby coordinator: node 1's launcher, which takes over when the primary falls silent.

With ``--standby-addr`` node 1's launcher hosts a second store, where the
primary writes its state before anything it publishes and renews a lease
every heartbeat interval. When the lease has been silent for the heartbeat
timeout and the agents of a majority of the job's live nodes have come over
(each posts ``LostPrimary`` once it lost the primary), the standby takes
over on its own store.

Why a majority: a primary that is only cut off from some nodes keeps
coordinating the others. It stops deciding once it hears from no more than
half of the nodes alive at its last decision (policy/admission.py's
``why_no_quorum``), and the standby starts only with more than half of
them, so the two can never both decide. With fewer than three nodes no
single loss leaves a majority, so ``deadpool-launch`` refuses a standby there.
"""

import enum
import time
from typing import Callable, Optional, Set, Tuple

import torch.distributed as dist

from deadpool_ext import protocol as P
from deadpool_ext.control.awake_clock import AwakeClock
from deadpool_ext.control.record import JobRecord
from deadpool_ext.defaults import (
    HEARTBEAT_INTERVAL_S,
    OWN_PAUSE_SHARE,
    STORE_MEND_TIMEOUT_S,
    TAKEOVER_WAIT_S,
)
from deadpool_ext.policy.admission import is_majority
from deadpool_ext.wire import Channel, control_connect


class Verdict(enum.Enum):
    WAIT = "wait"  # the primary beats, or a majority has not come over yet
    TAKE_OVER = "take over"
    GIVE_UP = "give up"  # silent primary, no majority within TAKEOVER_WAIT_S


class Standby:
    def __init__(
        self,
        channel: Channel,
        node: int,
        heartbeat_timeout: float,
        wait_s: float = TAKEOVER_WAIT_S,
        clock=time.monotonic,
    ):
        self.channel, self.node = channel, node
        self.timeout_s, self.wait_s = heartbeat_timeout, wait_s
        # Its own pause is not the primary's silence (awake_clock.py).
        self.clock = AwakeClock(clock, OWN_PAUSE_SHARE * heartbeat_timeout)
        self.votes = channel.reader(P.STANDBY_TOPIC)
        self.came_over: Set[int] = {node}
        self.lease: tuple = (None, self.clock())  # (version, local time it changed)
        self.record: Optional[JobRecord] = None  # the primary's, once it wrote one
        self.written: Optional[str] = None  # its text

    def poll(self) -> Verdict:
        now = self.clock()
        version = self.channel.version(P.LEASE_KEY)
        if version != self.lease[0]:
            self.lease = (version, now)
        for body in self.votes.poll():
            if body.get("kind") == P.Kind.LOST_PRIMARY:
                self.came_over.add(int(body["node"]))
        written = self.channel.get(P.STATE_KEY)
        if written is not None and written["state"] != self.written:
            self.record, self.written = JobRecord.from_json(written["state"]), written["state"]
        if self.record is not None and self.record.finished:
            # Whoever loses the primary from now on stops instead of waiting.
            self.channel.put(P.ENDED_KEY, why=f"the job ended in generation {self.record.gen}")
            return Verdict.GIVE_UP
        silent = now - self.lease[1]
        if self.lease[0] is None or silent <= self.timeout_s:
            return Verdict.WAIT  # no primary yet, or it beats
        if self.has_majority():
            return Verdict.TAKE_OVER
        return Verdict.GIVE_UP if silent > self.timeout_s + self.wait_s else Verdict.WAIT

    def has_majority(self) -> bool:
        return is_majority(self.came_over, self.record.membership.quorum_nodes)


class Replica:
    """The primary's side of the standby's copy, in the store of the node
    appointed last: the state, written when it changed, and the lease,
    renewed every heartbeat interval. ``connect`` opens a channel to a
    store (host:port). A write that fails raises
    (``torch.distributed.DistError``): the standby is gone."""

    def __init__(self, connect: Callable[[str], Channel], clock=time.monotonic):
        self.connect, self.clock = connect, clock
        self.channel: Optional[Channel] = None
        # The last appointed's, kept once it is lost: where a coordinator
        # cut off looks for a takeover.
        self.address: Optional[str] = None
        self.written: Optional[str] = None
        self.leased_at = float("-inf")

    def appoint(self, address: Optional[str]) -> None:
        """The store at ``address`` holds the copy from now on (None: none does)."""
        self.channel = None if address is None else self.connect(address)
        self.address = address or self.address
        self.written, self.leased_at = None, float("-inf")

    def write(self, state: str, gen: int) -> None:
        if state != self.written:
            self.channel.put(P.STATE_KEY, state=state)
            self.written = state
        if self.clock() - self.leased_at >= HEARTBEAT_INTERVAL_S:
            self.channel.put(P.LEASE_KEY, gen=gen)
            self.leased_at = self.clock()


def took_over(address: Tuple[str, int], secret: bytes) -> bool:
    """Whether the standby at ``address`` has taken over (its coordinator
    published a generation on its store); False if it cannot be reached
    within STORE_MEND_TIMEOUT_S (a partition, or it is gone)."""
    try:
        store = control_connect(*address, timeout_s=STORE_MEND_TIMEOUT_S)
        return Channel(store, secret, address=address).get(P.GEN_KEY) is not None
    except dist.DistError:
        return False
