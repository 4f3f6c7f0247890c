"""Every tuning constant and flag default, each with its reason; the timeouts' order.

The watches rely on one another: a heartbeat timeout that a live process's
beats cannot meet, or a takeover that gives up before the agents can vote,
would turn a healthy job into a lost one. ``check_order`` holds them to the
order their comments state; the --deadpool flags' checks call it before any
process starts (config.py). Pure: imports nothing of the repository.
"""

from dataclasses import dataclass
from typing import List

HEARTBEAT_TIMEOUT_S = 10.0  # --deadpool-heartbeat-timeout
HEARTBEAT_INTERVAL_S = 0.5  # how often workers and agents beat
# A rank's beat names a peer host that has left its data unacknowledged this
# long (the coordinator judges it at the heartbeat timeout); shorter waits
# are a round trip or a retransmission, not worth a beat's bytes.
SILENT_PEER_REPORT_S = 1.0
RECOVERY_TIMEOUT_S = 120.0  # a generation must report, or resume, within this
# --deadpool-mirror-timeout: a mirror send or receive that takes this long
# counts the buddy as lost; no sooner than the heartbeat timeout, which is
# how long the coordinator gives a silent node.
MIRROR_TIMEOUT_S = 300.0
# --deadpool-progress-timeout: a training rank whose iteration does not advance
# this long, its main thread computing all the while and a peer waiting on it,
# is hung even if its heartbeat thread beats (0: no such watch).
PROGRESS_TIMEOUT_S = 300.0
SPARE_WAIT_S = 60.0  # --deadpool-spare-wait
ON_SPARES_EXHAUSTED = "shrink"  # --deadpool-on-spares-exhausted
ON_SDC = "rollback"  # --deadpool-on-sdc
# --check-weight-hash-across-dp-replicas-interval under --deadpool when not given.
WEIGHT_CHECK_INTERVAL = 1
# --deadpool-on-sdc rollback: the same rank caught again within this many
# iterations of its last catch is a failing node, swapped for a spare.
SDC_REPEAT_WINDOW = 1000
# A topic slot claimed and not written this long is passed over (its poster
# died between claiming and writing, or was an outsider).
CLAIMED_SLOT_DEADLINE_S = 2.0
# A process that lost its store connects to a standby within this; a store
# that is gone is known gone after it, not after a connection's 60 s.
STORE_RECONNECT_TIMEOUT_S = 5.0
# A client its live store dropped (a poisoned counter) connects again within
# this. Short: a server that was dying when it was found listening is then
# known gone at once (torch's client tries twice), so the process turns to
# the standby before the successor may have ended the job.
STORE_MEND_TIMEOUT_S = 1.0
# Without a standby, a control-plane request whose data its store's host
# leaves unacknowledged this long fails (TCP_USER_TIMEOUT): a dead host sends
# no reset, and torch's client would wait on it for good. (A request a paused
# server leaves unanswered is not bounded by torch's client: its clients wait
# for it to wake.) Well within TAKEOVER_WAIT_S, so that agents reach the
# standby to vote.
CONTROL_SILENCE_S = 30.0


# With a standby, a control connection whose store's host has acknowledged
# nothing for the heartbeat timeout, neither its data nor, while it waits for
# an answer, a keepalive probe, is cut off (TCP_USER_TIMEOUT: the host's
# kernel acknowledges, not its process, so a paused store is not taken for a
# cut one): the process turns to the standby, and back to the primary
# if that answers again (its own host's partition healed). Node 0's silent
# partition is then found as any node's is, after the heartbeat timeout.
# Without a standby there is nowhere to turn: CONTROL_SILENCE_S.
def control_cut_off_s(heartbeat_timeout_s: float, standby: bool) -> float:
    return min(heartbeat_timeout_s, CONTROL_SILENCE_S) if standby else CONTROL_SILENCE_S


# After a takeover, how long a process may take to come over to the standby
# (to notice the primary is gone, then to connect) before its silence counts.
TAKEOVER_GRACE_S = CONTROL_SILENCE_S + STORE_RECONNECT_TIMEOUT_S
# A rank still training this many heartbeat timeouts after a failure was
# announced is blocked where no release reaches: it writes every thread's
# stack (event 'stuck'); one timeout later the coordinator has it killed,
# and it is restored from its buddy like any lost rank.
STUCK_REPORT_TIMEOUTS = 2
STUCK_KILL_TIMEOUTS = 3
# How long after a failure is announced the heartbeat thread shuts the old
# groups' connections down. Live peers finish the transfers they are in the
# middle of first: gloo never fails a send it queued on a socket the peer
# then closed, so a release mid-transfer would block the sender until the
# groups' timeout (docs/reliability.md). Ranks blocked on a lost peer wait
# this much longer; a rank that notices the failure itself releases at once.
RELEASE_GRACE_S = 1.0
# Under --deadpool-rebuild-groups changed the grace's release spares the
# groups a hot swap may keep (only groups with a lost member are shut down:
# a main thread blocked in one is freed); a main thread still not stopped
# this long after the announcement, and found waiting on a peer (its stack
# in a collective, a send, a receive or a checkpoint: rank/whereabouts.py),
# is blocked in a group that could be kept, and everything is released then.
RELEASE_ALL_AFTER_S = 2 * RELEASE_GRACE_S
# A main thread that still computes then (the rest of its iteration on a
# loaded host) is let go on: it stops at its next collective or reaches its
# own tear-down, and keeps its groups. This long after the announcement it
# is released whatever its stack shows (a wait no Python frame shows, as a
# spin on a GPU stream, reads as computing); the coordinator's stuck watch
# comes later (STUCK_REPORT_TIMEOUTS).
RELEASE_ALL_COMPUTING_AFTER_S = 10 * RELEASE_GRACE_S
# How often an agent reads its workers' GPUs through NVML (and at once when a
# failure is announced): a spare whose GPU went bad is taken out of the ready
# spares within this (control/gpu_health.py).
GPU_HEALTH_INTERVAL_S = 10.0
# How often an agent inside a Slurm job reads its node's state (scontrol,
# control/slurm_state.py): a node the administrators mark DRAIN is drained
# from the job at the next iteration boundary after the reading that saw it.
# Each reading asks slurmctld once per node: every few seconds is cheap for
# it and quick enough next to a maintenance window's hours.
SLURM_STATE_INTERVAL_S = 5.0
# After an abort, how long the ranks that reported may take to read it and
# stop on their own before their agents are told to stop them.
ABORT_GRACE_S = 10.0
# The standby coordinator (node 1's launcher, with --standby-addr) takes over
# once the primary's lease has been silent for the heartbeat timeout and the
# agents of a majority of the job's live nodes came to it; it gives up this
# long after that, and agents and workers that lost the primary wait this long
# beyond the heartbeat timeout for the takeover before they count the
# coordinator lost.
TAKEOVER_WAIT_S = 60.0
# A round of the coordinator's or the standby's loop that comes this share of
# the heartbeat timeout late means that process did not run in between (a
# SIGSTOP, a paused VM): the time is not counted as anyone's silence. Below
# it, at least three quarters of the timeout are left for a live beat to show.
OWN_PAUSE_SHARE = 0.25
# A coordinator cut off from the majority asks the standby's store this often
# whether it took over (each ask may wait STORE_MEND_TIMEOUT_S for an answer).
STANDBY_PROBE_S = 2.0
# --deadpool-straggler-factor / -window: a node whose compute time per
# iteration (forward and backward, without waits) is this many times the
# other nodes' median, over the last ``window`` iterations each, is a
# straggler; --deadpool-on-straggler says what then happens. Twice as slow:
# on the 2-core test machine, where 8 ranks share the cores, healthy nodes
# differed by up to 1.57 times (docs/operations.md); a GPU's noise is less.
STRAGGLER_FACTOR = 2.0
STRAGGLER_WINDOW = 5
ON_STRAGGLER = "report"
# How often the coordinator hands its status to the metrics endpoint (a
# scrape every few seconds needs no fresher figures, and a status walks
# every member).
STATUS_EVERY_S = 1.0
# A drained node's workers that have not ended this long after its agent
# was told to leave (a spare, a member that has not read its release) are
# stopped with SIGTERM.
LEAVE_GRACE_S = 10.0
# deadpool-ctl: how long it waits for the coordinator's answer.
CONTROL_REPLY_WAIT_S = 15.0
# --deadpool-metrics-addr: where the Prometheus endpoint listens (with
# --deadpool-metrics-port); loopback unless asked.
METRICS_ADDR = "127.0.0.1"
# What a worker's environment holds unless the user set it. torch's NCCL
# watchdog ends the process when a communicator fails (its default, 3):
# a survivor of a lost peer would die with it, its buddy copies too. With 2
# it aborts the communicator and the error reaches the rank, which recovers
# (the heartbeat thread's abort frees a rank blocked in NCCL either way).
WORKER_ENV_DEFAULTS = {"TORCH_NCCL_ASYNC_ERROR_HANDLING": "2"}


# ----- the order of the timeouts -----
HERE = "deadpool_ext/defaults.py"  # where a constant out of order is mended


class OrderError(ValueError):
    """Two timeouts out of the order the watches rely on."""


@dataclass(frozen=True)
class Order:
    """``shorter`` must end before ``longer`` (or with it, where ``may_equal``);
    ``fix`` says what to change, and why, when it does not."""

    shorter: str  # a flag as the user gives it, or a constant of this module
    shorter_s: float
    longer: str
    longer_s: float
    fix: str
    may_equal: bool = False

    def holds(self) -> bool:
        return self.shorter_s <= self.longer_s if self.may_equal else self.shorter_s < self.longer_s

    def broken(self) -> str:
        bound = "at most" if self.may_equal else "below"
        return (
            f"{self.shorter} ({self.shorter_s:g} s) must be {bound} "
            f"{self.longer} ({self.longer_s:g} s): {self.fix}"
        )


def flag_orders(
    heartbeat_timeout_s: float, mirror_timeout_s: float, recovery_timeout_s: float
) -> List[Order]:
    """The orders the --deadpool flags' values must keep: heartbeat interval
    < heartbeat timeout < the stuck watch's kill < recovery timeout, and a
    buddy counted lost no sooner than the coordinator counts it. The
    releases' against the stuck report are the defaults' alone
    (constant_orders): a job may give a short heartbeat timeout."""
    heartbeat, mirror = "--deadpool-heartbeat-timeout", "--deadpool-mirror-timeout"
    recovery = "--deadpool-recovery-timeout"
    return [
        Order(
            "HEARTBEAT_INTERVAL_S",
            HEARTBEAT_INTERVAL_S,
            heartbeat,
            heartbeat_timeout_s,
            f"a live process beats every {HEARTBEAT_INTERVAL_S:g} s, so it would count as "
            f"lost between two beats: raise {heartbeat}",
        ),
        Order(
            heartbeat,
            heartbeat_timeout_s,
            mirror,
            mirror_timeout_s,
            f"a rank would count its buddy lost while the coordinator still counts it "
            f"alive: raise {mirror} or lower {heartbeat}",
            may_equal=True,
        ),
        Order(
            f"STUCK_REPORT_TIMEOUTS x {heartbeat}",
            STUCK_REPORT_TIMEOUTS * heartbeat_timeout_s,
            f"STUCK_KILL_TIMEOUTS x {heartbeat}",
            STUCK_KILL_TIMEOUTS * heartbeat_timeout_s,
            f"a stuck rank writes its stacks before it is killed: change {HERE}",
        ),
        Order(
            f"STUCK_KILL_TIMEOUTS x {heartbeat}",
            STUCK_KILL_TIMEOUTS * heartbeat_timeout_s,
            recovery,
            recovery_timeout_s,
            f"a survivor stuck where no release reaches is killed, its stacks written, "
            f"before the reports' deadline takes it: raise {recovery} or lower {heartbeat}",
        ),
    ]


def constant_orders() -> List[Order]:
    """The orders the constants' comments state, at the default heartbeat timeout."""
    return [
        Order(
            "STORE_MEND_TIMEOUT_S",
            STORE_MEND_TIMEOUT_S,
            "STORE_RECONNECT_TIMEOUT_S",
            STORE_RECONNECT_TIMEOUT_S,
            f"a dying store must be known gone before the standby's successor may end "
            f"the job: change {HERE}",
        ),
        Order(
            "CONTROL_SILENCE_S",
            CONTROL_SILENCE_S,
            "TAKEOVER_WAIT_S",
            TAKEOVER_WAIT_S,
            f"agents must notice the primary is gone and reach the standby to vote before "
            f"it gives up: change {HERE}",
        ),
        Order(
            "RELEASE_GRACE_S",
            RELEASE_GRACE_S,
            "RELEASE_ALL_AFTER_S",
            RELEASE_ALL_AFTER_S,
            f"the groups a hot swap may keep are released after the others: change {HERE}",
        ),
        Order(
            "RELEASE_ALL_AFTER_S",
            RELEASE_ALL_AFTER_S,
            "RELEASE_ALL_COMPUTING_AFTER_S",
            RELEASE_ALL_COMPUTING_AFTER_S,
            f"a main thread still computing is let go on longer than one that waits: change {HERE}",
        ),
        Order(
            "RELEASE_ALL_COMPUTING_AFTER_S",
            RELEASE_ALL_COMPUTING_AFTER_S,
            "STUCK_REPORT_TIMEOUTS x HEARTBEAT_TIMEOUT_S",
            STUCK_REPORT_TIMEOUTS * HEARTBEAT_TIMEOUT_S,
            f"the coordinator's stuck watch comes after the last release: change {HERE}",
        ),
    ]


def check_order(
    heartbeat_timeout_s: float = HEARTBEAT_TIMEOUT_S,
    mirror_timeout_s: float = MIRROR_TIMEOUT_S,
    recovery_timeout_s: float = RECOVERY_TIMEOUT_S,
) -> None:
    """Raises OrderError, naming both ends and what to change, for the first
    order these values or the constants break."""
    flags = flag_orders(heartbeat_timeout_s, mirror_timeout_s, recovery_timeout_s)
    for order in flags + constant_orders():
        if not order.holds():
            raise OrderError(order.broken())
