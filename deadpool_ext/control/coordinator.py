"""The coordinator: it handles the job's messages, moves its state machine,
publishes each generation and carries out what the policy decides.

It runs on the master node, outside the worker processes, in the launcher.
It hears from agents (node up, a worker exited, node heartbeats) and from
workers (their buddy plan, heartbeats, recovery reports, resumed, done),
and answers through signed keys: ``gen`` (the current generation and its
state) and ``decision/{gen}``.

What an exit or a stall means comes from control/watch.py, who is who from
control/membership.py, and what to do about a loss or a spare from the
policy (deadpool_ext/policy.py): a decision or a reasoned wait.

The job's state (``JobState``) moves only along ``NEXT``:

  STARTING -> TRAINING -> RECOVERING (a loss: the survivors report)
                       -> GROWING (spares fill a replica: everyone reports)
                       -> DRAINING (nodes asked to leave, or a stop asked
                          for: everyone reports at its iteration's end)
  RECOVERING / GROWING / DRAINING
                       -> REBUILDING (a swap decided) -> TRAINING
                                     (a stop decided) -> STOPPING
                       -> RESIZING (a shrink or grow decided) -> TRAINING
                                   (a checkpoint decided) -> STOPPING
  any -> ABORTED (no decision can keep the job)

A loss while RECOVERING, GROWING, DRAINING or REBUILDING opens the next
generation (RECOVERING again; a drain or stop asked for waits for the next
TRAINING); while RESIZING or STOPPING it ends the job.

Operations (``operations`` below): deadpool-ctl's requests (status, drain a
node, stop) and an agent's (Slurm marked its node DRAIN) come on their own
topic, signed with the job's secret; the answer goes to a key the request
names. Each rank's compute time per iteration comes with its heartbeats;
``StragglerWatch`` says which node is slow, and --deadpool-on-straggler swap
drains it while a spare node is ready.

Sizes: while spares last a lost rank is swapped; then the job shrinks
(--deadpool-on-spares-exhausted shrink), and it grows back towards its
launched size whenever the ready spares make up a whole replica (a node
that registers with ``deadpool-launch --join`` brings new spares). A loss
while the job is being resized ends it: the survivors' snapshots are of the
old layout, which no decision could combine with the new one.
"""

import dataclasses
import json
import time
from typing import Dict, List, Optional, Set

import torch.distributed as dist

from deadpool_ext import protocol as P
from deadpool_ext.control import watch
from deadpool_ext.control.detector import Detector
from deadpool_ext.control.gpu_health import GpuReading
from deadpool_ext.control.membership import Membership
from deadpool_ext.control.rollbacks import Corruptions, Rollbacks
from deadpool_ext.control.standby import Replica
from deadpool_ext.control.stragglers import StragglerWatch
from deadpool_ext.defaults import (
    ABORT_GRACE_S,
    STATUS_EVERY_S,
    STUCK_KILL_TIMEOUTS,
    TAKEOVER_GRACE_S,
)
from deadpool_ext.events import EventLog
from deadpool_ext.policy import (
    JobView,
    Policy,
    Wait,
    abort,
    as_tuple,
    grid_of,
    grow_by,
    likely_spares,
    limits_of,
)
from deadpool_ext.protocol import (
    COORDINATOR_RANK,
    Action,
    Command,
    Decision,
    ExitCode,
    JobState,
    Report,
    parse_slot,
    slot_name,
)
from deadpool_ext.wire import Channel, control_connect

S = JobState
# The states each state may move to; anything else is a bug of the coordinator.
NEXT = {
    S.STARTING: {S.TRAINING, S.RECOVERING, S.ABORTED},
    S.TRAINING: {S.RECOVERING, S.GROWING, S.DRAINING, S.ABORTED},
    S.RECOVERING: {S.RECOVERING, S.REBUILDING, S.RESIZING, S.ABORTED},
    S.GROWING: {S.RECOVERING, S.REBUILDING, S.RESIZING, S.ABORTED},
    S.DRAINING: {S.RECOVERING, S.REBUILDING, S.RESIZING, S.ABORTED},
    S.REBUILDING: {S.TRAINING, S.RECOVERING, S.STOPPING, S.ABORTED},
    S.RESIZING: {S.TRAINING, S.STOPPING, S.ABORTED},
    S.STOPPING: {S.ABORTED},
    S.ABORTED: set(),
}
COLLECTING = (S.RECOVERING, S.GROWING, S.DRAINING)  # members report for a decision
# Every rank stops at its iteration's end, not within an iteration.
AT_BOUNDARY = (S.GROWING, S.DRAINING)
# Messages a member sends about its own rank.
SPEAKS_FOR_A_RANK = (P.Report, P.Joining, P.Resumed, P.Done, P.NumericFault)
BUILDING = (S.REBUILDING, S.RESIZING)  # a decision is carried out
# A loss now cannot be combined with the decision being carried out.
UNRECOVERABLE = (S.RESIZING, S.STOPPING)


class Coordinator:
    def __init__(
        self,
        channel: Channel,
        nnodes: int,
        spare_nodes: int,
        nproc: int,
        events: Optional[EventLog] = None,
        settings: P.CoordinatorSettings = P.CoordinatorSettings(),
        clock=time.monotonic,
        replica: Optional[Channel] = None,
        snapshot: Optional[dict] = None,
    ):
        """``replica``: a channel to the standby coordinator's store, where
        the state goes before anything is published; ``snapshot``: the state
        a standby took over (then nothing is published until ``take_over``)."""
        self.channel, self.clock = channel, clock
        self.events = events or EventLog(None, COORDINATOR_RANK)
        self.settings = settings
        self.detector = Detector(channel, settings.heartbeat_timeout)
        self.view = Membership.launched(nnodes, spare_nodes, nproc)
        self.inbox = channel.reader(P.COORDINATOR_TOPIC)
        self.gen, self.state = 0, S.STARTING
        self.lost: Set[int] = set()
        self.reports: Dict[int, Report] = {}
        self.resumed: Set[int] = set()
        self.joining: Set[int] = set()
        self.done: Set[int] = set()
        self.rollbacks = Rollbacks()  # iterations redone after a NaN or Inf
        # Why the generations since the last decision opened: the decision
        # says so (the dashboards' recovery line names the rank and the check).
        self.reasons: List[str] = []
        self.corruptions = Corruptions()  # silent data corruption caught (--deadpool-on-sdc)
        self.doomed: Optional[str] = None  # why the next decision stops the job
        self.abort_grace_s = ABORT_GRACE_S
        self.policy = Policy()
        self.plan: Optional[P.Plan] = None  # layout and buddies from rank 0, per world
        self.train_iters: Optional[int] = None
        self.result: Optional[Decision] = None  # set when the job ends by abort
        self.stopping: Optional[Decision] = None  # a checkpoint-and-stop decision
        self.started_recovery = 0.0
        self.decided_at = 0.0  # when the current generation's decision was made
        self.took_over_at: Optional[float] = None
        # The groups' own timeout (--distributed-timeout-minutes, from rank
        # 0's plan): what finally frees a rank stuck on gloo's queued send.
        self.group_timeout_s: Optional[float] = None
        self.said: Set[tuple] = set()  # (event, generation) said once per generation
        self.replica = None if replica is None else Replica(replica, clock)
        self.last_decision: Optional[dict] = None  # the current generation's, as published
        # With a standby that could take over, decisions need a majority of
        # the nodes alive at the last one: a partition leaves one side deciding.
        self.guards_quorum = replica is not None
        # Operations: requests come on their own topic through a channel of
        # their own, whose count of rejected (unsigned or forged) values is
        # the requests refused; nodes asked to drain (node -> why), a stop
        # asked for, what each recovery was for, and the straggler watch.
        self.requests = self.requests_channel(channel).reader(P.CONTROL_TOPIC)
        self.malformed_requests = 0
        self.drains: Dict[int, str] = {}
        self.drain_asked_at: Optional[float] = None  # the oldest drain asked for
        self.drained_nodes: Set[int] = set()  # left by a drain (until one joins again)
        self.straggler_swaps: Set[int] = set()  # stragglers whose drain was asked for
        self.draining: List[int] = []  # the nodes of the DRAINING generation
        self.stop_request: Optional[str] = None
        self.recoveries: Dict[str, int] = {}  # by cause
        self.cause: Optional[str] = None  # what opened the current generation
        self.last_recovery: Optional[dict] = None
        self.stragglers = StragglerWatch(settings.straggler_factor, settings.straggler_window)
        self.status_listeners: List = []  # called with status() every STATUS_EVERY_S
        self.status_sent_at = float("-inf")
        if snapshot is None:
            self.publish()
        else:
            self.load(snapshot)

    @staticmethod
    def requests_channel(channel: Channel) -> Channel:
        """A connection of its own: anyone who reaches the store can break
        the requests' topic counter, and the server then drops the
        connection that adds to it (the channel mends its own; a shared one
        would leave the coordinator's broken)."""
        store = channel.store if channel.address is None else control_connect(*channel.address)
        return Channel(store, channel.secret, address=channel.address)

    @property
    def heartbeat_timeout(self) -> float:
        return self.detector.timeout_s

    @property
    def recovery_timeout(self) -> float:
        return self.settings.recovery_timeout

    @property
    def progress(self) -> Dict[int, int]:
        """rank -> the iteration its last heartbeat gave."""
        seen = self.detector.iterations
        return {rank: seen[slot] for rank, slot in self.view.members.items() if slot in seen}

    def enter(self, state: JobState) -> None:
        if state not in NEXT[self.state]:
            raise AssertionError(f"coordinator bug: {self.state.value} -> {state.value}")
        self.state = state

    # ----- outputs -----
    def publish(self, assign: Optional[Dict[int, str]] = None) -> None:
        """``assign``: the spares a decision will most likely pick, so that
        they can build their model while the survivors tear down.
        ``boundary`` tells workers to stop at their next iteration boundary,
        not within an iteration (a grow, a drain, a stop)."""
        self.put(
            P.GEN_KEY,
            gen=self.gen,
            state=self.state,
            lost=sorted(self.lost),
            assign={str(r): s for r, s in (assign or {}).items()},
            world=self.view.world,
            boundary=self.state in AT_BOUNDARY,
        )

    def put(self, key: str, **body) -> None:
        """Every value processes read goes out here, after the state went to
        the standby: whatever a process can have seen, a takeover knows. The
        generation says whether a standby holds that copy: processes turn to
        the standby only while it does."""
        self.replicate()
        if key == P.GEN_KEY:
            body["standby"] = self.replica is not None
        self.channel.put(key, **body)

    def tell_agent(self, node: int, command: Command, slot: Optional[str] = None) -> None:
        self.replicate()
        self.channel.post(P.agent_topic(node), kind=command, slot=slot)

    @property
    def finished(self) -> bool:
        return self.result is not None or len(self.done) == self.view.world_size

    # ----- one poll -----
    def step(self) -> None:
        self.read_inbox()
        for request in self.requests.poll():
            self.on_request(request)
        self.replicate()  # what the messages changed, and the lease
        if self.detector.due(self.clock()):
            self.check_heartbeats()
            self.watch_stragglers()
        if self.state in COLLECTING:
            self.maybe_decide()
        elif self.state == S.TRAINING:
            self.maybe_plan() or self.maybe_grow()
            self.note_clean_redos()
        elif self.state in BUILDING and self.clock() - self.decided_at > self.recovery_timeout:
            self.stop(f"generation {self.gen} did not resume within {self.recovery_timeout:.0f} s")
        if self.status_listeners and self.clock() - self.status_sent_at >= STATUS_EVERY_S:
            self.status_sent_at = self.clock()
            status = self.status()
            for listener in self.status_listeners:
                listener(status)

    def read_inbox(self) -> None:
        for message in self.inbox.poll():
            self.handle(message)

    def agent_ended(self, node: int, code: int) -> None:
        """A node's agent process ended (seen by the launcher that started
        it). Whatever it and its workers posted was in the store before:
        read first, so that a node whose ranks all finished is no loss."""
        self.read_inbox()
        if not self.finished and node not in self.drained_nodes:
            self.lose_node(node, f"agent exited with code {code}")

    def handle(self, body: dict) -> None:
        try:
            message = P.parse_message(body)
        except P.ProtocolError as error:
            # Signed, so from a process of this job: another version, or a bug.
            self.events.emit("message_dropped", gen=self.gen, error=str(error))
            return
        if isinstance(message, SPEAKS_FOR_A_RANK) and not self.view.holds(
            message.rank, message.slot
        ):
            # A process of a lost slot (an orphan, a node back from a partition)
            # must not speak for a rank that is, or will be, someone else's.
            self.events.emit(
                "message_dropped",
                gen=self.gen,
                error=f"{message.KIND.value} for rank {message.rank} from slot {message.slot}, "
                f"which does not hold it",
            )
            return
        handler = getattr(self, f"on_{message.KIND.value}")
        handler(message)

    def on_plan(self, m: P.Plan) -> None:
        if self.plan is not None:
            return  # a spare that took rank 0 repeats it; only the first counts
        self.plan = m
        if m.distributed_timeout_minutes is not None:
            self.group_timeout_s = 60.0 * float(m.distributed_timeout_minutes)
        self.train_iters = m.train_iters

    def on_exit(self, m: P.WorkerExited) -> None:
        if self.view.note_exit(m.slot) or parse_slot(m.slot)[0] in self.drained_nodes:
            return  # released by a shrink, or its node was drained
        rank = self.view.rank_of(m.slot)
        if rank is not None and rank in self.done:
            return  # finished normally
        fatal = watch.why_an_exit_stops_the_job(m, rank)
        if fatal is not None and not self.finished:
            self.stop(fatal)
        elif fatal is None:
            self.lose_slots([m.slot], watch.exit_as_loss(m.code))

    def on_node(self, m: P.NodeUp) -> None:
        if m.join:
            self.register_node(m.node, m.nproc, str(m.nonce))
            return
        differs = self.view.why_node_differs(m.node, m.nproc, m.world_size)
        if differs is not None and not self.finished:
            self.stop(differs)

    def on_spare_ready(self, m: P.SpareReady) -> None:
        slot = m.slot
        if not self.view.is_new_spare(slot):
            return
        if self.view.gpu_problems(slot):
            self.withhold(slot)
            return
        self.view.spares.append(slot)
        self.events.emit("spare_ready", gen=self.gen, slot=slot, spares=len(self.view.spares))
        if self.state == S.RECOVERING:
            self.publish(self.likely_spares())  # it may build while we wait

    def on_gpu_health(self, m: P.GpuHealth) -> None:
        """An agent read its workers' GPUs: a spare whose GPU has a problem
        is kept out of the ready spares until a later reading is clean."""
        for slot, body in m.readings.items():
            reading = GpuReading.from_dict(body)
            if self.view.read_gpu(slot, reading):
                problems, gpu = reading.problems(), reading.summary()
                self.events.emit(
                    "gpu_health", gen=self.gen, slot=slot, gpu=gpu, problems=problems, reading=body
                )
            if reading.problems() and slot in self.view.spares:
                self.view.spares.remove(slot)
                self.withhold(slot)
            elif not reading.problems() and slot in self.view.withheld:
                self.view.withheld.discard(slot)
                self.on_spare_ready(P.SpareReady(slot=slot))

    def withhold(self, slot: str) -> None:
        self.view.withheld.add(slot)
        self.events.emit(
            "spare_withheld", gen=self.gen, slot=slot, problems=self.view.gpu_problems(slot)
        )

    def on_report(self, m: P.Report) -> None:
        if m.gen == self.gen and self.state in COLLECTING:
            self.reports[m.rank] = m

    def on_joining(self, m: P.Joining) -> None:
        """Everyone enters the new groups' rendezvous together, so that a
        failure before it is seen by polling, not by a gloo timeout."""
        if m.gen != self.gen or self.state not in BUILDING:
            return
        self.joining.add(m.rank)
        if len(self.joining) == self.view.world_size:
            self.put(P.join_key(self.gen), gen=self.gen)

    def on_resumed(self, m: P.Resumed) -> None:
        if m.gen != self.gen or self.state not in BUILDING:
            return
        self.resumed.add(m.rank)
        if len(self.resumed) == self.view.world_size:
            # After a checkpoint decision the ranks save and stop.
            self.enter(S.STOPPING if self.stopping else S.TRAINING)
            seconds = round(self.clock() - self.started_recovery, 3)
            self.events.emit("recovered", gen=self.gen, seconds=seconds)
            self.note_recovered(seconds)
            self.publish()

    def on_done(self, m: P.Done) -> None:
        self.done.add(m.rank)

    def note_clean_redos(self, done: Optional[int] = None) -> None:
        """Every rank finished a rolled-back iteration again without a NaN
        (their heartbeats say so, or the job's end, or a later rollback
        past it): the fault was transient, and where it showed is said once."""
        done = min(self.progress.values(), default=0) if done is None else done
        for iteration, rank in self.rollbacks.redone(done):
            why = "redone cleanly after rolling back: the first result was transient"
            self.events.emit("nan_transient", gen=self.gen, iteration=iteration, rank=rank, why=why)

    def on_numeric(self, m: P.NumericFault) -> None:
        """--deadpool-on-nan rollback: nobody is lost; every rank goes back to
        the failed iteration's start and redoes it. A second NaN or Inf in
        the same iteration is no transient fault: the job stops."""
        if m.gen != self.gen or self.state in COLLECTING or self.finished:
            return  # the rank recovers with the others already
        if self.state in UNRECOVERABLE:
            reason = f"rank {m.rank}: {m.error} while the job was {self.state.value}"
            self.stop(reason)
            return
        if m.check != "nan":
            self.on_corruption(m)
            return
        self.events.emit(
            "nan_detected", gen=self.gen, rank=m.rank, iteration=m.iteration, error=m.error
        )
        # A second NaN is decided once every rank has reported, so that each stops saying why.
        self.doomed = self.rollbacks.roll_back(m) or self.doomed
        self.report_again(
            f"rank {m.rank}: {m.error}: rolling every rank back to iteration {m.iteration}'s start",
            iteration=m.iteration - 1,
            cause="nan",
        )

    def on_corruption(self, m: P.NumericFault) -> None:
        """--deadpool-on-sdc: roll every rank back to the doubted iteration's
        start, swap the suspect (a repeat, or swap), or stop."""
        verdict = self.corruptions.decide(m)
        self.events.emit(
            "sdc_detected",
            gen=self.gen,
            rank=m.rank,
            check=m.check,
            iteration=m.iteration,
            suspects=m.suspects,
            action=verdict.action,
            error=m.error,
        )
        if verdict.action == "swap":
            self.corruptions.forget(verdict.rank)
            self.kill_and_lose([self.view.members[verdict.rank]], verdict.why)
            return
        if verdict.action == "stop":  # decided once every rank has reported, to say why
            self.doomed = verdict.why
        self.report_again(verdict.why, iteration=m.iteration - 1, cause="sdc")

    # ----- operations: requests, drains, stop, stragglers -----
    def on_request(self, body: dict) -> None:
        """A signed request (deadpool-ctl's, or an agent's): answered at the
        key it names. Unsigned or forged ones never get here (the channel
        drops and counts them); a signed one of the wrong shape is counted."""
        try:
            m = P.parse_message(body)
            if not isinstance(m, P.ControlRequest):
                raise P.ProtocolError(f"{m.KIND.value} is no request")
            request = P.Request(m.request)
        except (P.ProtocolError, ValueError) as error:
            self.malformed_requests += 1
            self.events.emit("request_refused", gen=self.gen, error=str(error))
            return
        if request == P.Request.STATUS:
            answer = {"ok": True, "status": self.status()}
        else:
            refused = self.request_drain(m) if request == P.Request.DRAIN else self.request_stop(m)
            answer = {"ok": refused is None, "message": refused or self.accepted(request, m)}
        self.put(P.control_reply_key(m.nonce), **answer)

    def accepted(self, request: P.Request, m: P.ControlRequest) -> str:
        if request == P.Request.DRAIN:
            return f"node {m.node} leaves the job at the next iteration boundary"
        if self.plan is not None and not self.plan.saves:
            return "the job ends at the next iteration boundary; it has no --save: nothing is saved"
        return "the job saves a checkpoint at the next iteration boundary and ends"

    def request_drain(self, m: P.ControlRequest) -> Optional[str]:
        """Why node ``m.node`` cannot be drained, or None: it will be."""
        view = self.view
        if self.finished or self.state in (S.STOPPING, S.ABORTED) or self.stop_request:
            return "the job is ending"
        if m.node not in view.nodes():
            return f"no node {m.node} in this job (its nodes: {view.nodes()})"
        if m.node not in view.alive_nodes():
            return f"node {m.node} is no longer part of the job"
        self.queue_drain(m.node, m.reason or f"asked by {m.by}", m.by)
        return None

    def queue_drain(self, node: int, reason: str, by: str) -> None:
        """Drained at the next boundary while training (asking again is harmless)."""
        if node in self.drains or node in self.draining:
            return
        if not self.drains:
            self.drain_asked_at = self.clock()
        self.drains[node] = reason
        self.events.emit("drain_requested", gen=self.gen, node=node, reason=reason, by=by)

    def request_stop(self, m: P.ControlRequest) -> Optional[str]:
        if self.finished or self.state in (S.STOPPING, S.ABORTED):
            return "the job is ending already"
        if self.stop_request is None:
            self.stop_request = m.reason or f"stopped by {m.by}"
            self.events.emit("stop_requested", gen=self.gen, reason=self.stop_request, by=m.by)
        return None

    def maybe_plan(self) -> bool:
        """While training: start the stop or the drains asked for (a node
        with no rank leaves at once); whether a generation opened."""
        if self.plan is None or self.finished:
            return False
        if self.stop_request is not None:
            self.open_generation(S.DRAINING, "stop")
        else:
            for node in [n for n in self.drains if n not in self.view.alive_nodes()]:
                self.drains.pop(node)
                why = "the node was lost before it could be drained"
                self.events.emit("drain_refused", gen=self.gen, node=node, reason=why)
            for node in [n for n in self.drains if not self.ranks_on(n)]:
                self.send_off(node, self.drains.pop(node))
            if not self.drains or self.spares_warm_for_drains():
                return False
            self.open_generation(S.DRAINING, "drain")
            self.draining = sorted(self.drains)
        self.events.emit(
            "planned",
            gen=self.gen,
            cause=self.cause,
            nodes=self.draining,
            reason=self.stop_request or "; ".join(self.drains[n] for n in self.draining),
            iteration=max(self.progress.values(), default=0),
        )
        self.publish(self.likely_spares())
        return True

    def spares_warm_for_drains(self) -> bool:
        """Too few spares are ready for the drains asked for but enough are
        starting: train on while they warm up (up to --deadpool-spare-wait
        after the first request), then drain, to spares or by a shrink."""
        leaving = set(self.drains)
        needed = sum(len(self.ranks_on(n)) for n in leaving)
        ready = [s for s in self.view.spares if parse_slot(s)[0] not in leaving]
        warming = [s for s in self.detector.last.warming if parse_slot(s)[0] not in leaving]
        waited = self.clock() - (self.drain_asked_at or self.clock())
        if len(ready) >= needed or len(ready) + len(warming) < needed:
            return False
        if waited >= self.settings.spare_wait:
            return False
        self.say_once(
            "drain_waits_for_spares",
            nodes=sorted(leaving),
            ready=len(ready),
            warming=sorted(warming),
            up_to_s=self.settings.spare_wait,
        )
        return True

    def ranks_on(self, node: int) -> List[int]:
        return sorted(r for r, slot in self.view.members.items() if parse_slot(slot)[0] == node)

    def settle_drains(self, decision: Decision) -> None:
        """The nodes a decision drained leave (their agents end once their
        workers are gone); those it could not drain stay, and are no longer asked for."""
        for node in self.draining:
            why = self.drains.pop(node, "")
            if node in decision.drained:
                self.send_off(node, why)
            else:
                warnings = "; ".join(decision.warnings)
                self.events.emit("drain_refused", gen=self.gen, node=node, reason=warnings)
        self.draining = []

    def send_off(self, node: int, why: str) -> None:
        """A drained node: its slots count as gone (it may join again with
        deadpool-launch --join), and its agent stops its workers and ends."""
        slots = self.view.slots_of(node)
        self.view.lose(slots)
        self.drained_nodes.add(node)
        self.tell_agent(node, Command.LEAVE)
        self.events.emit("node_drained", gen=self.gen, node=node, slots=slots, reason=why)

    def note_recovered(self, seconds: float) -> None:
        """What the generation that resumed was for, and how long it took."""
        cause = self.cause or "failure"
        self.recoveries[cause] = self.recoveries.get(cause, 0) + 1
        decision = self.last_decision or {}
        report_s = max(0.0, self.decided_at - self.started_recovery)
        self.last_recovery = {
            "generation": self.gen,
            "cause": cause,
            "action": decision.get("action"),
            "reason": decision.get("reason", ""),
            "seconds": seconds,
            "rollback_to": decision.get("rollback_to"),
            "stages": {"report": round(report_s, 3), "rebuild": round(seconds - report_s, 3)},
        }

    def watch_stragglers(self) -> None:
        """Feed the members' compute times to the watch; a straggler found is
        said once, and with --deadpool-on-straggler swap its node is drained
        while a spare node is ready for it."""
        if self.settings.straggler_factor == 0 or self.state != S.TRAINING:
            return
        members = {s for s in self.view.members.values() if s not in self.view.lost_slots}
        self.stragglers.keep_only(members)
        for slot, body in self.detector.compute.items():
            if slot in members:
                self.stragglers.observe(slot, parse_slot(slot)[0], body)
        for straggler in self.stragglers.newly_found():
            self.events.emit("straggler", gen=self.gen, **dataclasses.asdict(straggler))
        self.straggler_swaps &= set(self.stragglers.found)  # those no longer slow may be again
        if self.settings.on_straggler == "swap":
            for node in sorted(set(self.stragglers.found) - self.straggler_swaps):
                self.swap_straggler(node)

    def swap_straggler(self, node: int) -> None:
        """Drained once enough spares are ready on other nodes (a straggler
        is not worth a shrink: the job would lose a replica's throughput)."""
        ranks = self.ranks_on(node)
        free = [s for s in self.view.spares if parse_slot(s)[0] != node]
        if len(free) < len(ranks):
            why = f"{len(free)} ready spare(s) for its {len(ranks)} rank(s)"
            self.say_once("straggler_kept", node=node, reason=why)
            return
        # Asked once while it stays a straggler: a drain the policy refuses
        # must not be tried again at every look, each a pause of the job.
        self.straggler_swaps.add(node)
        ratio = self.stragglers.found[node].ratio
        reason = f"straggler: {ratio:.1f}x the other nodes' compute time"
        self.queue_drain(node, reason, by="straggler watch")

    def status(self) -> dict:
        """The job as deadpool-ctl status and the metrics show it."""
        view = self.view
        by_node: Dict[int, List[int]] = {}
        for rank, slot in sorted(view.members.items()):
            by_node.setdefault(parse_slot(slot)[0], []).append(rank)
        alive, times, nodes = view.alive_nodes(), self.stragglers.node_times(), {}
        for node in view.nodes():
            ranks = by_node.get(node, [])
            role = "active" if ranks else "spare"
            if node in self.draining or node in self.drains:
                role = "draining"
            elif node in self.drained_nodes:
                role = "drained"
            elif node not in alive:
                role = "lost"
            nodes[str(node)] = {
                "role": role,
                "ranks": ranks,
                "compute_s": times.get(node, (None, 0))[0],
            }
        return {
            "state": self.state.value,
            "generation": self.gen,
            "iteration": min(self.progress.values(), default=None),
            "world_size": view.world_size,
            "planned_world_size": view.planned_size,
            "members": {str(r): slot for r, slot in sorted(view.members.items())},
            "spares": {"ready": list(view.spares), "warming": sorted(self.detector.last.warming)},
            "nodes": nodes,
            "recoveries": dict(self.recoveries),
            "last_recovery": self.last_recovery,
            "stragglers": {
                str(n): dataclasses.asdict(s) for n, s in sorted(self.stragglers.found.items())
            },
            "drains_pending": {str(n): why for n, why in sorted(self.drains.items())},
            "stop_requested": self.stop_request,
            "rejected_requests": self.requests.channel.rejected + self.malformed_requests,
        }

    # ----- failures -----
    def lose_node(self, node: int, reason: str) -> None:
        slots = self.view.slots_of(node)
        if slots and all(self.view.rank_of(s) in self.done for s in slots):
            return  # its ranks all finished: its agent ended with them
        self.lose_slots(slots, f"node {node} lost: {reason}")
        self.tell_agent(node, Command.KILL_ALL)

    def unfinished(self, slots: List[str]) -> List[str]:
        """Those not lost yet and not holding a rank that said it is done: a
        finished rank has nothing left to lose (its node's agent ends with
        its workers, while other nodes may still be saving)."""
        lost, done = self.view.lost_slots, self.done
        return [s for s in slots if s not in lost and self.view.rank_of(s) not in done]

    def kill_and_lose(self, slots: List[str], reason: str) -> None:
        """Processes that live but cannot go on: their agents SIGKILL them."""
        for slot in slots:
            self.tell_agent(parse_slot(slot)[0], Command.KILL, slot)
        self.lose_slots(slots, reason)

    def lose_slots(self, slots: List[str], reason: str) -> None:
        slots = self.unfinished(slots)
        if not slots or self.finished:
            return
        ranks = self.view.lose(slots)
        if not ranks:
            self.events.emit("spare_lost", gen=self.gen, slots=slots, reason=reason)
            return
        if self.state in UNRECOVERABLE:
            what = "saving its checkpoint" if self.stopping else "being resized"
            self.stop(
                f"{reason} (ranks {sorted(ranks)}) while the job was {what}: resume from "
                "the last --save checkpoint"
            )
            return
        if self.done:
            # Finished ranks have left: no generation can gather them again.
            self.stop(
                f"{reason} (ranks {sorted(ranks)}) after ranks {sorted(self.done)} had "
                "finished: the final checkpoint may lack their part; resume from the last "
                "complete --save checkpoint"
            )
            return
        self.lost |= ranks
        iteration = max(self.progress.values(), default=0)
        self.report_again(reason, iteration, sorted(ranks), slots)  # a grow becomes a recovery

    def report_again(
        self, reason: str, iteration: int, ranks=(), slots=(), cause: str = "failure"
    ) -> None:
        """A new generation in which every member reports: ``ranks`` (on
        ``slots``) are lost, or none (all go back to a snapshot all hold)."""
        self.open_generation(S.RECOVERING, cause)
        self.reasons.append(reason)
        self.events.emit(
            "failure_detected",
            gen=self.gen,
            ranks=list(ranks),
            slots=list(slots),
            reason=reason,
            iteration=iteration,
        )
        self.publish(self.likely_spares())

    def open_generation(self, state: JobState, cause: str) -> None:
        """A failure, a grow, a drain or a stop: the next generation starts
        collecting reports."""
        self.enter(state)
        self.cause = cause
        self.draining = []  # a drain's generation names its nodes after this
        if self.stopping is not None and self.stopping.stop:
            # A stop decided and interrupted by a failure before every rank
            # resumed: the recovery comes first, the stop (still asked for) after.
            self.stopping = None
        self.gen += 1
        self.reports, self.resumed, self.joining = {}, set(), set()
        self.started_recovery = self.clock()

    def likely_spares(self) -> Dict[int, str]:
        """The spares told to start building now: those a swap will take."""
        return likely_spares(self.job_view())

    def register_node(self, node: int, nproc: int, nonce: str) -> None:
        """A repaired or new node (``deadpool-launch --join``): its workers
        start as spares and count once they report ready. The answer goes
        to the joining agent alone (``admit/{nonce}``): the index's command
        topic may belong to a live agent."""
        why = self.view.why_not_join(node, nproc)
        if why is not None:
            self.events.emit("join_refused", gen=self.gen, node=node, reason=why)
            self.put(P.admission_key(nonce), accepted=False, reason=why)
            return
        self.put(P.admission_key(nonce), accepted=True)
        self.drained_nodes.discard(node)
        slots = self.view.admit(node)
        # Its old heartbeats are stale; the new processes' sequence starts again.
        self.detector.forget(node, slots)
        self.events.emit("node_joined", gen=self.gen, node=node, slots=slots)

    def check_heartbeats(self) -> None:
        now, view = self.clock(), self.view
        watched = list(view.members.values()) + list(view.spares)
        busy = set(watched) | view.lost_slots | view.released
        sighting = self.detector.look(
            view.nodes(),
            [slot for slot in watched if slot not in view.lost_slots],
            [slot for slot in view.every_slot() if slot not in busy],
            now,
        )
        silence = f"no heartbeat for {self.heartbeat_timeout:.1f} s"
        for node in sighting.silent_nodes:
            if slot_name(node, 0) not in view.lost_slots:
                self.lose_node(node, silence)
        for slot in sighting.hung_slots:
            self.kill_and_lose([slot], f"{silence} (hung)")
        if self.state == S.RECOVERING:
            self.kill_stuck(now, sighting.states)
        elif self.state == S.TRAINING:
            timeout = self.settings.progress_timeout
            hung = watch.hung_computing(
                view.members, sighting.states, self.detector.progress, timeout, now
            )
            self.kill_and_lose(
                hung,
                f"no progress for {timeout:.0f} s while computing, peers waiting on it "
                "(hung; its heartbeat thread beat on)",
            )

    def kill_stuck(self, now: float, states: Dict[str, Optional[str]]) -> None:
        """Members that neither reported nor stopped training long after the
        failure was announced are blocked where no release reaches (each
        wrote its threads' stacks to the event log, event 'stuck'): they are
        killed and lost, and their buddies' copies restore them."""
        waited = now - self.started_recovery
        if waited < STUCK_KILL_TIMEOUTS * self.heartbeat_timeout:
            return
        members = self.view.members
        stuck, kept = watch.stuck(members, self.lost, set(self.reports), states, self.only_copies())
        if kept:  # killing them would lose state: their wait ends at the groups' timeout
            why = [kept[r] for r in sorted(kept)]
            self.say_once("stuck_waited", ranks=sorted(kept), why=why, up_to_s=self.group_timeout_s)
        self.kill_and_lose(
            [members[rank] for rank in stuck],
            f"still training {waited:.0f} s after generation {self.gen} "
            "was announced (stuck; its stacks are in the event log)",
        )

    def only_copies(self) -> Dict[int, str]:
        buddy = None if self.plan is None else self.plan.buddy
        return watch.only_copies(self.view.members, self.lost, buddy)

    # ----- the standby's copy, and a takeover -----
    def replicate(self) -> None:
        """Write the state to the standby's store when it changed, and renew
        the lease every heartbeat interval. A standby that cannot be reached
        is gone: the job goes on without one (event ``standby_lost``), and
        since its copy is stale from then on, nobody may turn to it."""
        if self.replica is None:
            return
        try:
            self.replica.write(json.dumps(self.snapshot(), sort_keys=True), self.gen)
        except dist.DistError as error:
            # From now on its copy falls behind: before anything else is
            # published, every process hears that there is no standby.
            self.replica = None
            self.events.emit("standby_lost", gen=self.gen, error=str(error))
            self.publish()

    def snapshot(self) -> dict:
        """Everything a takeover needs (not the timers, nor the reports of a
        generation: a takeover opens a new one)."""
        return {
            "view": self.view.to_dict(),
            "settings": dataclasses.asdict(self.settings),
            "gen": self.gen,
            "state": self.state.value,
            "lost": sorted(self.lost),
            "done": sorted(self.done),
            "rollbacks": self.rollbacks.to_dict(),
            "corruptions": self.corruptions.to_dict(),
            "doomed": self.doomed,
            "plan": None if self.plan is None else self.plan.body(),
            "train_iters": self.train_iters,
            "stopping": None if self.stopping is None else self.stopping.to_message(),
            "finished": self.finished,
            "group_timeout_s": self.group_timeout_s,
            "decision": self.last_decision,
            "iterations": self.detector.iterations,
            "drains": {str(n): why for n, why in self.drains.items()},
            "drained_nodes": sorted(self.drained_nodes),
            "stop_request": self.stop_request,
            "recoveries": self.recoveries,
            "last_recovery": self.last_recovery,
        }

    def load(self, snap: dict) -> None:
        self.view = Membership.from_dict(snap["view"])
        self.settings = P.CoordinatorSettings(**snap["settings"])
        self.detector.timeout_s = self.settings.heartbeat_timeout
        self.gen, self.state = snap["gen"], JobState(snap["state"])
        self.lost, self.done = set(snap["lost"]), set(snap["done"])
        self.rollbacks = Rollbacks.from_dict(snap["rollbacks"])
        self.corruptions = Corruptions.from_dict(snap["corruptions"])
        self.doomed, self.train_iters = snap["doomed"], snap["train_iters"]
        if snap["plan"] is not None:
            self.on_plan(P.parse_message(snap["plan"]))
        if snap["stopping"] is not None:
            self.stopping = Decision.from_message(snap["stopping"])
        self.group_timeout_s = snap["group_timeout_s"]
        self.last_decision = snap["decision"]
        self.detector.iterations.update(snap["iterations"])
        self.drains = {int(n): why for n, why in snap.get("drains", {}).items()}
        self.drained_nodes = set(snap.get("drained_nodes", []))
        self.stop_request = snap.get("stop_request")
        self.recoveries = dict(snap.get("recoveries", {}))
        self.last_recovery = snap.get("last_recovery")

    def take_over(self, node: int, reason: str, node_alive: bool = False) -> None:
        """The standby's first act as the coordinator, on its own store: put
        back the current decision (a spare may not have read it yet), repeat
        the kills the primary may not have delivered, expect a heartbeat
        from every process, and lose the primary's node: a new generation,
        which every survivor reports to here. If that node's agent came over
        (its launcher alone died), nothing is lost: training goes on in the
        same generation, unless one was being decided or carried out (what
        was reported or joined went to the primary: everyone reports again)."""
        now = self.clock()
        self.events.emit(
            "takeover", gen=self.gen, state=self.state, node=node, reason=reason, alive=node_alive
        )
        if self.last_decision is not None:
            self.channel.put(P.decision_key(self.last_decision["gen"]), **self.last_decision)
        self.started_recovery = self.decided_at = self.took_over_at = now
        # A process may notice late that node 0 is gone (its host silent).
        self.detector.expect(
            self.view.nodes(), self.view.every_slot(), since=now + TAKEOVER_GRACE_S
        )
        for slot in sorted(self.view.lost_slots):
            self.tell_agent(parse_slot(slot)[0], Command.KILL, slot)
        gen = self.gen
        if not node_alive:
            self.lose_node(node, reason)
        elif self.state in COLLECTING or self.state == S.REBUILDING:
            self.report_again(
                f"{reason}: every rank reports again to the new coordinator",
                iteration=max(self.progress.values(), default=0),
            )
        elif self.state == S.RESIZING:  # its joins went to the primary
            why = f"{reason} while the job was being resized"
            self.stop(f"{why}: resume from the last --save checkpoint")
        if self.gen == gen and self.result is None:
            self.publish()  # training goes on, or nothing of the job's was on that node

    def settling(self) -> bool:
        """Just after a takeover no agent has beaten on this store yet, so no
        spare is known to be warming: decide once every live node's agent
        beat here (or was declared silent), not shrink at once."""
        if self.took_over_at is None:
            return False
        waited = self.clock() - self.took_over_at
        limit = self.heartbeat_timeout + TAKEOVER_GRACE_S
        if waited <= limit and not self.view.alive_nodes() <= self.detector.last.beating:
            return True
        self.took_over_at = None
        return False

    # ----- decisions -----
    def maybe_decide(self) -> None:
        waiting = [r for r in self.view.members if r not in self.lost and r not in self.reports]
        if waiting:
            timeout = self.report_timeout(waiting)
            if self.clock() - self.started_recovery > timeout:
                slots = [self.view.members[r] for r in waiting]
                self.kill_and_lose(slots, f"did not report within {timeout:.0f} s")
            return
        if self.plan is None:
            self.stop("no buddy plan was received from rank 0")
            return
        no_quorum = self.view.why_no_quorum() if self.guards_quorum else None
        if no_quorum is not None:
            self.stop(no_quorum)
            return
        if self.settling():
            return
        decision = self.policy.decide(self.job_view())
        if isinstance(decision, Wait):
            self.note_wait(decision)
            return
        self.decided_at = self.clock()
        if decision.action == Action.ABORT:
            self.end(decision)
            return
        if not decision.reason and self.reasons:
            decision = dataclasses.replace(decision, reason="; ".join(self.reasons))
        self.reasons = []
        if decision.action.resizes:
            self.apply_resize(decision)
            return
        self.commit(
            decision,
            S.REBUILDING,
            replaced={str(r): s for r, s in decision.replaced.items()},
            from_buddy=decision.from_buddy,
        )

    def report_timeout(self, waiting: List[int]) -> float:
        """How long the survivors may take to report: longer when one that
        holds the only copy of a shard may be stuck until the groups' own
        timeout frees it (gloo's queued send: docs/reliability.md)."""
        if self.group_timeout_s is None or not set(waiting) & set(self.only_copies()):
            return self.recovery_timeout
        return max(self.recovery_timeout, self.group_timeout_s + 2 * self.heartbeat_timeout)

    def note_wait(self, wait: Wait) -> None:
        """The event log shows what is awaited."""
        self.say_once(
            "waiting_for_spares",
            lost=len(self.lost),
            ready=len(self.view.spares),
            warming=sorted(self.detector.last.warming),
            up_to_s=self.settings.spare_wait,
            reason=wait.reason,
        )

    def job_view(self) -> JobView:
        """What the policy decides from: this generation's state, frozen."""
        plan, view = self.plan, self.view
        return JobView(
            gen=self.gen,
            members=dict(view.members),
            lost=frozenset(self.lost),
            reports=dict(self.reports),
            spares=tuple(view.spares),
            buddy=None if plan is None else as_tuple(plan.buddy),
            owner=None if plan is None else as_tuple(plan.owner),
            grid=None if plan is None else grid_of(plan, view.world_size),
            planned_dp=0 if plan is None else grid_of(plan, view.planned_size).dp,
            limits=limits_of(plan, self.settings.on_spares_exhausted),
            growing=self.state == S.GROWING,
            doomed=self.doomed,
            drained_nodes=tuple(self.draining),
            stop_requested=self.stop_request if self.state == S.DRAINING else None,
            warming=len(self.detector.last.warming),
            since_failure_s=self.clock() - self.started_recovery,
            spare_wait_s=self.settings.spare_wait,
        )

    def maybe_grow(self) -> None:
        """Announce a grow once the ready spares fill a whole replica."""
        if (
            self.plan is None
            or self.view.world_size >= self.view.planned_size
            or self.finished
            or self.stopping
            or self.drains
            or self.stop_request
        ):
            return
        add = grow_by(self.job_view())
        if add == 0:
            return
        grid = grid_of(self.plan, self.view.world_size)
        self.open_generation(S.GROWING, "grow")
        self.events.emit(
            "grow_announced",
            gen=self.gen,
            dp_before=grid.dp,
            dp_after=grid.dp + add,
            spares=list(self.view.spares),
            iteration=max(self.progress.values(), default=0),
        )
        self.publish()

    def apply_resize(self, decision: Decision) -> None:
        """The decision's members form the new world. A shrink's dropped
        replicas' live ranks exit and come back as spares; a grow's spares
        join. Rank 0 of the new world then sends the new layout."""
        self.view.released |= set(decision.released)
        self.view.world_size = decision.world_size
        self.view.world = decision.world()
        self.plan = None
        self.detector.iterations.clear()  # the old ranks' progress
        if decision.action == Action.CHECKPOINT:
            self.stopping = decision
        self.commit(
            decision,
            S.RESIZING,
            dp_before=decision.old_dp,
            dp_after=decision.new_dp,
            world_size=decision.world_size,
            released=decision.released,
            joined={str(r): s for r, s in decision.replaced.items()},
        )

    def commit(self, decision: Decision, state: JobState, **details) -> None:
        """The decision's members form the generation: publish it and rebuild."""
        self.note_clean_redos(done=decision.rollback_to)
        taken = decision.replaced.values()
        # The decision with what the coordinator saw of its spares' GPUs: a copy.
        decision = dataclasses.replace(
            decision,
            gpus={s: self.view.gpus[s].summary() for s in taken if s in self.view.gpus},
            withheld=sorted(self.view.withheld),
        )
        self.view.members = decision.members
        self.view.spares = [s for s in self.view.spares if s not in decision.replaced.values()]
        self.lost = set()
        self.view.released |= set(decision.released)
        self.settle_drains(decision)
        if decision.stop:
            self.stopping = decision
        self.view.quorum_nodes = self.view.alive_nodes()
        self.enter(state)
        self.last_decision = decision.to_message()
        self.put(P.decision_key(self.gen), **self.last_decision)
        self.events.emit(
            "decision",
            gen=self.gen,
            action=decision.action,
            reason=decision.reason,
            drained=decision.drained,
            stop=decision.stop,
            rollback_to=decision.rollback_to,
            warnings=decision.warnings,
            spares_left=len(self.view.spares),
            groups_kept=len(decision.kept),
            gpus=decision.gpus,
            withheld=decision.withheld,
            **details,
        )
        self.publish()

    def say_once(self, event: str, **fields) -> None:
        """An event said once per generation."""
        if (event, self.gen) not in self.said:
            self.said.add((event, self.gen))
            self.events.emit(event, gen=self.gen, **fields)

    def stop(self, reason: str) -> None:
        self.end(abort(self.gen, reason, self.view.members))

    def end(self, decision: Decision) -> None:
        self.result = decision
        self.enter(S.ABORTED)
        self.put(P.decision_key(decision.gen), **decision.to_message())
        self.events.emit("abort", gen=decision.gen, reason=decision.reason)
        self.publish()

    def let_reporters_stop(self, poll_s: float, alive) -> None:
        """The ranks that reported in this generation wait for its decision:
        after an abort they log why and exit by themselves (the reason then
        reaches each rank's log and the events), unless the grace runs out."""
        waiting = {self.view.members[r] for r in self.reports if r in self.view.members}
        deadline = time.monotonic() + self.abort_grace_s
        while waiting - self.view.exited and time.monotonic() < deadline and alive():
            for message in self.inbox.poll():
                self.handle(message)
            time.sleep(poll_s)

    def mark_training(self) -> None:
        """Every active rank has finished an iteration: spares may build data."""
        if (
            self.state == S.STARTING
            and len(self.progress) == self.view.world_size
            and min(self.progress.values()) >= 1
        ):
            self.enter(S.TRAINING)
            self.publish()

    def run(self, poll_s: float = 0.01, alive=lambda: True) -> int:
        while not self.finished and alive():
            self.step()
            self.mark_training()
            time.sleep(poll_s)
        if self.result is not None:
            self.let_reporters_stop(poll_s, alive)
        for node in sorted(set(self.drains) | set(self.draining)):
            why = "the job ended before an iteration boundary was reached"
            self.events.emit("drain_refused", gen=self.gen, node=node, reason=why)
        if len(self.done) < self.view.world_size:
            return 1
        self.note_clean_redos(done=self.train_iters or 0)
        if self.stopping is not None:
            self.events.emit(
                "stopped",
                gen=self.gen,
                reason=self.stopping.reason,
                iteration=self.stopping.rollback_to,
            )
            # Asked for (deadpool-ctl stop): the job ended as it should.
            return ExitCode.OK if self.stopping.stop else ExitCode.STOPPED_WITH_CHECKPOINT
        return 0
