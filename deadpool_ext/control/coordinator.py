"""The coordinator: the I/O around the job's record and its rules.

It runs in node 0's launcher, outside the worker processes. It reads what
agents (node up, a worker exited, GPU health) and workers (their layout,
reports, joining, resumed, done, a NaN or a corruption) post, deadpool-ctl's
requests and the heartbeats into its record (record.py); runs the rules on
a frozen view of it (policy/triggers.py's ``TRIGGERS``, then
``Policy.decide`` while a generation collects reports); and carries out the
effects they return: the record changed, then what processes read (``gen``,
``decision/{gen}``, an answer), what an agent is told, an event said. The
record goes to the standby before anything processes read. The job's
states and their moves are policy/states.py's.
"""

import functools
import time
from typing import Callable, Dict, List, Optional

import torch.distributed as dist

from deadpool_ext import protocol as P
from deadpool_ext.control import operations
from deadpool_ext.control.awake_clock import AwakeClock
from deadpool_ext.control.detector import Detector
from deadpool_ext.control.gpu_health import GpuReading
from deadpool_ext.control.record import JobRecord, Round, Watch, view_of
from deadpool_ext.control.standby import Replica
from deadpool_ext.control.status import decision_event, status
from deadpool_ext.defaults import OWN_PAUSE_SHARE, TAKEOVER_GRACE_S
from deadpool_ext.events import EventLog
from deadpool_ext.policy import effects as E
from deadpool_ext.policy.decide import Policy
from deadpool_ext.policy.states import COLLECTING, NEXT
from deadpool_ext.policy.triggers import TRIGGERS
from deadpool_ext.policy.view import AgentEnded, Exited, JobView, Superseded, TookOver
from deadpool_ext.protocol import COORDINATOR_RANK, Command, Decision, JobState, parse_slot
from deadpool_ext.wire import Channel

# Messages a member sends about its own rank.
SPEAKS_FOR_A_RANK = (P.Report, P.Joining, P.Resumed, P.Done, P.NumericFault)
# Messages that are news for the rules as they are; they, and exits, are
# judged before the next message is read (a joining node's admission comes
# before its spares say they are ready).
NEWS = (P.NodeUp, P.NumericFault)


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
        standbys: Optional[Callable[[str], Channel]] = None,
        record: Optional[JobRecord] = None,
    ):
        """``standbys``: opens a channel to the store (host:port) of a node
        appointed standby coordinator, where the record goes before anything
        is published (None: no standby); ``record``: the one a standby took
        over (then nothing is published until ``take_over``)."""
        self.events = events or EventLog(None, COORDINATOR_RANK)
        self.record = record or JobRecord.launched(settings, nnodes, spare_nodes, nproc)
        timeout = self.record.settings.heartbeat_timeout
        self.channel, self.clock = channel, AwakeClock(clock, OWN_PAUSE_SHARE * timeout)
        self.round = Round()
        # With a standby that could take over, decisions need a majority of
        # the nodes alive at the last one: a partition leaves one side deciding.
        self.watch = Watch(guards_quorum=standbys is not None)
        self.detector = Detector(channel, timeout, self.record.iterations)
        self.inbox = channel.reader(P.COORDINATOR_TOPIC)
        self.requests = operations.requests_reader(channel)
        self.replica = None if standbys is None else Replica(standbys, self.clock)
        self.news: List = []  # what happened since the rules last ran
        if record is None:
            self.publish()

    # ----- what it knows -----
    @property
    def gen(self) -> int:
        return self.record.gen

    @property
    def state(self) -> JobState:
        return self.record.state

    @property
    def finished(self) -> bool:
        return self.record.finished

    def view(self, sighting=None) -> JobView:
        d, news = self.detector, tuple(self.news)
        look = (sighting, d.last, d.progress, d.compute)
        return view_of(self.record, self.round, self.watch, look, news, self.clock())

    def status(self) -> dict:
        rejected = self.requests.channel.rejected + self.watch.malformed_requests
        return status(self.record, self.round, self.watch, self.detector, rejected)

    def enter(self, state: JobState) -> None:
        if state not in NEXT[self.record.state]:
            raise AssertionError(f"coordinator bug: {self.record.state.value} -> {state.value}")
        self.record.state = state

    # ----- outputs -----
    def publish(self, assign: Optional[Dict[int, str]] = None) -> None:
        """``assign``: the spares a decision will most likely pick, so that
        they can build their model while the survivors tear down."""
        self.replicate()  # first: the generation names the standby holding the copy
        self.put(P.GEN_KEY, **self.record.generation(assign or {}))

    def put(self, key: str, **body) -> None:
        """Every value processes read goes out here, after the record went
        to the standby: whatever a process can have seen, a takeover knows."""
        self.replicate()
        self.channel.put(key, **body)

    def tell_agent(self, node: int, command: Command, slot: Optional[str] = None) -> None:
        self.replicate()
        self.channel.post(P.agent_topic(node), kind=command, slot=slot)

    def say(self, event: str, **fields) -> None:
        self.events.emit(event, gen=self.record.gen, term=self.record.term, **fields)

    def replicate(self) -> None:
        """Write the record to the standby's store when it changed, and
        renew the lease every heartbeat interval. A standby that cannot be
        written is gone (event ``standby_lost``; the rules appoint another):
        its copy is stale from then on, so every process hears that none
        holds one before anything else is published."""
        rec = self.record
        if self.replica is None or rec.standby_node is None:
            return
        try:
            self.replica.write(rec.to_json(), rec.gen)
        except dist.DistError as error:
            self.say("standby_lost", node=rec.drop_store(rec.standby_node), error=str(error))
            self.publish()

    # ----- one poll -----
    def step(self) -> None:
        self.read_inbox()
        for request in self.requests.poll():
            self.answer(request)
        self.replicate()  # what the messages changed, and the lease
        if paused := self.clock.tick():  # nobody's silence (awake_clock.py)
            self.say("coordinator_paused", seconds=round(paused, 3))
        now = self.clock()
        self.judge(self.look(now) if self.detector.due(now) else None)
        if self.record.state in COLLECTING:  # once every message of the step is in
            self.carry_out(Policy().decide(self.view()))

    def read_inbox(self) -> None:
        for message in self.inbox.poll():
            if self.take(message):
                self.judge()
        if due := self.watch.read_past(self.inbox.cursor):
            self.news.extend(due)
            self.judge()

    def look(self, now: float):
        return self.detector.look(*self.record.membership.to_watch(), now)

    def judge(self, sighting=None) -> None:
        """The rules, in order, each on a view with what the ones before
        it did."""
        view = self.view(sighting)
        for trigger in TRIGGERS:
            done = trigger(view)
            for effect in done:
                self.carry_out(effect)
            if self.record.result is not None or self.watch.cut_off_at is not None:
                break  # the job ended, or it is cut off: nothing more is decided
            if any(isinstance(effect, E.Majority) for effect in done):
                break  # heard again: this look's silences are the partition's
            if done:
                view = self.view(sighting)
        self.news.clear()

    # ----- what comes in -----
    def take(self, body: dict) -> bool:
        """One message into the record; whether it brought news to judge."""
        try:
            message = P.parse_message(body)
        except P.ProtocolError as error:
            # Signed, so from a process of this job: another version, or a bug.
            self.say("message_dropped", error=str(error))
            return False
        m = self.record.membership
        if isinstance(message, SPEAKS_FOR_A_RANK) and not m.holds(message.rank, message.slot):
            # A process of a lost slot (an orphan, a node back from a partition)
            # must not speak for a rank that is, or will be, someone else's.
            what = f"{message.KIND.value} for rank {message.rank} from slot {message.slot}"
            self.say("message_dropped", error=f"{what}, which does not hold it")
            return False
        if isinstance(message, NEWS):
            self.news.append(message)  # judged as it is: a launcher, a NaN, a corruption
        else:
            getattr(self, f"on_{message.KIND.value}")(message)
        return isinstance(message, (P.WorkerExited, *NEWS))

    def on_plan(self, m: P.Plan) -> None:
        self.record.take_plan(m)

    def on_exit(self, m: P.WorkerExited) -> None:
        members = self.record.membership
        released = members.note_exit(m.slot)
        self.news.append(Exited(m.slot, m.code, m.reason, members.rank_of(m.slot), released))

    def on_spare_ready(self, m: P.SpareReady) -> None:
        for said in self.record.membership.spare_ready(m.slot):
            self.note(said)

    def on_gpu_health(self, m: P.GpuHealth) -> None:
        readings = {slot: GpuReading.from_dict(body) for slot, body in m.readings.items()}
        for said in self.record.membership.read_gpus(readings):
            self.note(said)

    def on_report(self, m) -> None:  # a report, joining or resumption
        self.round.collect(m, self.record.gen, self.record.state)

    on_joining = on_resumed = on_report

    def on_done(self, m: P.Done) -> None:
        self.record.done.add(m.rank)

    def answer(self, body: dict) -> None:
        """A signed request (deadpool-ctl's, or an agent's), answered at the
        key it names. Unsigned or forged ones never get here (the channel
        drops and counts them); a signed one of the wrong shape is counted."""
        try:
            request = operations.parse(body)
        except operations.Refused as error:
            self.watch.malformed_requests += 1
            self.say("request_refused", error=str(error))
            return
        reply, effects = operations.answer(request, self.view(), self.status)
        for effect in effects:
            self.carry_out(effect)
        self.put(P.control_reply_key(request.nonce), **reply)

    def agent_ended(self, node: int, code: int) -> None:
        """A node's agent ended (its launcher saw it): judged once what it and its workers
        claimed before is read, so that a node whose ranks all finished is no loss."""
        self.watch.agent_ends.append((AgentEnded(node, code), self.inbox.claimed()))
        self.read_inbox()

    def superseded(self) -> None:
        """The standby took over while this coordinator was cut off."""
        self.news.append(Superseded())
        self.judge()

    def take_over(self, successor: int, reason: str, node_alive: bool = False) -> None:
        """The standby's first act, on its own store (node ``successor``'s):
        put back the current decision (a spare may not have read it), repeat
        the primary's kills, expect a beat from every process, and judge the
        primary's node lost (only its launcher if its agent came over:
        triggers.py's took_over). The rules appoint the next standby."""
        rec, now = self.record, self.clock()
        node, rec.coordinator_node, rec.standby_node = rec.coordinator_node, successor, None
        rec.term += 1
        self.say("takeover", state=rec.state, node=node, reason=reason, alive=node_alive)
        if rec.decision is not None:
            self.channel.put(P.decision_key(rec.decision.gen), **rec.decision.to_message())
        self.round, self.watch.took_over_at = Round(opened_at=now, decided_at=now), now
        # A process may notice late that node 0 is gone (its host silent).
        m = rec.membership
        self.detector.expect(m.nodes(), m.every_slot(), since=now + TAKEOVER_GRACE_S)
        for slot in sorted(m.lost_slots):
            self.tell_agent(parse_slot(slot)[0], Command.KILL, slot)
        gen = rec.gen
        self.news.append(TookOver(node, reason, node_alive))
        self.judge()
        if rec.gen == gen and rec.result is None:
            self.publish()  # training goes on, or nothing of the job's was on that node

    # ----- each effect carried out -----
    @functools.singledispatchmethod
    def carry_out(self, effect) -> None:
        raise AssertionError(f"coordinator bug: no way to carry out {effect!r}")

    @carry_out.register
    def note(self, n: E.Note) -> None:
        said = (n.event, self.record.gen)
        if not n.once or said not in self.watch.said:
            self.watch.said.add(said)
            self.say(n.event, **n.fields)

    @carry_out.register
    def lose(self, loss: E.Loss) -> None:
        """Kill what lives but cannot go on; a later rule takes the loss."""
        for slot in loss.kill:
            self.tell_agent(parse_slot(slot)[0], Command.KILL, slot)
        self.news.append(loss)
        for node in loss.kill_nodes:
            self.tell_agent(node, Command.KILL_ALL)

    @carry_out.register
    def open_generation(self, o: E.Opening) -> None:
        self.enter(o.state)
        self.record.open(o)
        self.round = self.round.next(self.clock(), o, self.record.membership.spares)
        for said in o.notes:
            self.note(said)
        self.publish(o.assign)

    @carry_out.register
    def republish(self, p: E.Publish) -> None:
        self.round.published_spares = p.ready
        self.publish(p.assign)

    @carry_out.register
    def stop(self, s: E.Stop) -> None:
        self.end(Decision.abort(self.record.gen, s.reason, self.record.membership.members))

    def end(self, decision: Decision) -> None:
        self.record.result = decision
        self.enter(JobState.ABORTED)
        self.put(P.decision_key(decision.gen), **decision.to_message())
        self.say("abort", reason=decision.reason)
        self.publish()

    @carry_out.register
    def advance(self, a: E.Advance) -> None:
        self.enter(a.state)
        if a.recovered:
            seconds = round(self.clock() - self.round.opened_at, 3)
            self.say("recovered", seconds=seconds)
            self.record.note_recovered(self.round, seconds)
        self.publish()

    @carry_out.register
    def let_in(self, _: E.Rendezvous) -> None:
        self.round.rendezvous = True
        self.put(P.join_key(self.record.gen), gen=self.record.gen)

    @carry_out.register
    def admit(self, a: E.Admission) -> None:
        """The answer goes to the joining agent alone (``admit/{nonce}``):
        the index's command topic may belong to a live agent."""
        if a.refused is not None:
            self.say("join_refused", node=a.node, reason=a.refused)
            self.put(P.admission_key(a.nonce), accepted=False, reason=a.refused)
            return
        self.put(P.admission_key(a.nonce), accepted=True)
        slots = self.record.admit(a.node)
        self.detector.forget(a.node, slots)
        self.say("node_joined", node=a.node, slots=slots)

    @carry_out.register
    def queue_drain(self, q: E.QueueDrain) -> None:
        """Drained at the next boundary while training (asking again is harmless)."""
        if q.node in self.record.drains or q.node in self.round.leaving:
            return
        if not self.record.drains:
            self.watch.drain_asked_at = self.clock()
        self.record.drains[q.node] = q.reason
        self.say("drain_requested", node=q.node, reason=q.reason, by=q.by)

    @carry_out.register
    def ask_stop(self, s: E.StopAsked) -> None:
        if self.record.stop_request is None:
            self.record.stop_request = s.reason
            self.say("stop_requested", reason=s.reason, by=s.by)

    @carry_out.register
    def send_off(self, s: E.SendOff) -> None:
        self.see_off(s.node, s.reason, self.record.send_off(s.node))

    def see_off(self, node: int, why: str, slots: List[str]) -> None:
        """A drained node leaves: its agent stops its workers and ends."""
        self.tell_agent(node, Command.LEAVE)
        self.say("node_drained", node=node, slots=slots, reason=why)

    @carry_out.register
    def drop_drain(self, d: E.DropDrain) -> None:
        self.record.drains.pop(d.node, None)
        self.say("drain_refused", node=d.node, reason=d.reason)

    @carry_out.register
    def appoint(self, a: E.Appoint) -> None:
        """A copy of the record, then the generation naming its store."""
        address = self.record.standby_stores.get(a.node)
        try:
            self.replica.appoint(address)
        except dist.DistError as error:
            self.say("standby_refused", node=self.record.drop_store(a.node), error=str(error))
            return
        self.record.standby_node = a.node
        self.say("standby_appointed", node=a.node, address=address)
        self.publish()

    @carry_out.register(E.StandbyStore)
    @carry_out.register(E.Lost)
    @carry_out.register(E.Rollback)
    @carry_out.register(E.Redone)
    @carry_out.register(E.Caught)
    def change_record(self, effect) -> None:
        self.record.change(effect)

    @carry_out.register
    def majority(self, m: E.Majority) -> None:
        """Heard again, the nodes not yet heard get a whole timeout: a healed
        partition's beats come back one by one, none of them a loss."""
        self.watch.cut_off_at = None if m.heard else self.clock()
        if m.heard:
            self.detector.restart(self.clock())
        self.say("majority_heard" if m.heard else "majority_lost", reason=m.reason)

    @carry_out.register
    def fence(self, f: E.Fence) -> None:
        """Its side leaves; what it says reaches that side alone."""
        self.watch.fenced = f.reason
        self.say("fenced", reason=f.reason)
        for node in self.record.membership.nodes():
            self.tell_agent(node, Command.KILL_ALL)

    @carry_out.register
    def judged(self, j: E.Judged) -> None:
        self.watch.stragglers, self.watch.straggler_drains = dict(j.stragglers), set(j.drains_asked)

    @carry_out.register
    def wait(self, w: E.Wait) -> None:
        if w.note is not None:
            self.note(w.note)

    @carry_out.register
    def decided(self, decision: Decision) -> None:
        """The decision's members form the generation: publish it, and the
        members rebuild (a swap) or form another world (a resize). The
        nodes it drained leave; those it could not drain stay."""
        self.round.decided_at, self.watch.took_over_at = self.clock(), None
        if decision.action == P.Action.ABORT:
            self.end(decision)
            return
        self.round.reasons = []
        drained = self.record.adopt(decision, self.round.leaving)
        for node in self.round.leaving:
            if node in drained:
                self.see_off(node, *drained[node])
            else:
                self.say("drain_refused", node=node, reason="; ".join(decision.warnings))
        self.round.leaving = []
        self.enter(JobState.RESIZING if decision.action.resizes else JobState.REBUILDING)
        self.put(P.decision_key(self.record.gen), **decision.to_message())
        self.say("decision", **decision_event(decision, len(self.record.membership.spares)))
        self.publish()
