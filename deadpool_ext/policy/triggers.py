"""The coordinator's rules, in the order it runs them: ``TRIGGERS``.

Each trigger is a pure function of the job's view that returns the effects
it asks for (effects.py), or none. The coordinator runs them in order after
every message that brought news (an exit, a launcher, a NaN or a
corruption, a node's agent ended, a takeover) and once more at the end of
each step, with what its heartbeat look saw; it builds a fresh view after
every effect it carries out, so a later trigger sees what an earlier one
did. The order is the priority: what ended or was lost first (every loss of
the pass then opens one generation, or ends the job), then the generation's
own progress, then, while training, the operations asked for and growth.
First of all, whether this coordinator may decide at all (admission.py's
``majority``): one cut off from the majority runs no other rule.

A generation that collects reports is decided by ``Policy.decide``
(decide.py) after the triggers.
"""

from dataclasses import asdict, replace
from typing import Callable, List, Optional, Tuple

from deadpool_ext.defaults import STUCK_KILL_TIMEOUTS
from deadpool_ext.policy.admission import majority, standby, why_node_differs, why_not_join
from deadpool_ext.policy.decide import grow_by, likely_spares, waits_for_spares
from deadpool_ext.policy.effects import (
    NOTHING,
    Admission,
    Advance,
    Caught,
    DropDrain,
    Effects,
    Judged,
    Loss,
    Lost,
    Opening,
    Publish,
    QueueDrain,
    Redone,
    Rendezvous,
    Rollback,
    SendOff,
    StandbyStore,
    Stop,
    note,
)
from deadpool_ext.policy.exits import (
    exit_as_loss,
    hung_computing,
    only_copies,
    stuck,
    why_an_exit_stops_the_job,
)
from deadpool_ext.policy.paths import cut_off, cut_pairs, partners
from deadpool_ext.policy.faults import SdcAction, corruption_verdict, nan_again, redone
from deadpool_ext.policy.stragglers import judge
from deadpool_ext.policy.states import BUILDING, COLLECTING, UNRECOVERABLE
from deadpool_ext.policy.view import (
    AgentEnded,
    Exited,
    JobView,
    TookOver,
)
from deadpool_ext.protocol import (
    JobState,
    NodeUp,
    NumericFault,
    parse_slot,
)

S = JobState
Trigger = Callable[[JobView], Effects]


# ----- what ended or was lost -----
def exits(view: JobView) -> Effects:
    """An agent saw a process end: a loss, or an exit no spare could undo."""
    effects: List = []
    for m in view.news_of(Exited):
        if m.released or parse_slot(m.slot)[0] in view.drained_nodes:
            continue  # released by a shrink, or its node was drained
        if m.slot in view.lost_slots:
            continue  # declared lost before: how it ends is no longer the job's
        if m.rank is not None and m.rank in view.done:
            continue  # finished normally
        fatal = why_an_exit_stops_the_job(m, m.rank)
        if fatal is None:
            effects.append(Loss((m.slot,), exit_as_loss(m.code)))
        elif not view.finished:
            return (*effects, Stop(fatal))
    return tuple(effects)


def node_lost(view: JobView, node: int, reason: str) -> Effects:
    """A node gone: its slots lost, its agent told to kill what is left;
    none where every rank it held finished (its agent ended with them)."""
    slots = view.slots_of(node)
    if all(view.rank_of(s) in view.done for s in slots):
        return NOTHING
    return (Loss(slots, f"node {node} lost: {reason}", kill_nodes=(node,)),)


def agents_ended(view: JobView) -> Effects:
    """A node's agent process ended (its launcher saw it)."""
    effects: List = []
    for m in view.news_of(AgentEnded):
        if not view.finished and m.node not in view.drained_nodes:
            effects.extend(node_lost(view, m.node, f"agent exited with code {m.code}"))
    return tuple(effects)


def launchers(view: JobView) -> Effects:
    """A node's launcher says it is up: one that joins is admitted or
    refused; one started for another job size stops the job."""
    effects: List = []
    for m in view.news_of(NodeUp):
        refused = why_not_join(view, m.node, m.nproc) if m.join else None
        if m.standby_store is not None and refused is None:
            effects.append(StandbyStore(m.node, m.standby_store))
        if m.join:
            effects.append(Admission(m.node, str(m.nonce), refused))
            continue
        differs = why_node_differs(view, m.node, m.nproc, m.world_size)
        if differs is not None and not view.finished:
            return (*effects, Stop(differs))
    return tuple(effects)


def took_over(view: JobView) -> Effects:
    """A successor lost the primary's node; or, if that node's agent came
    over (its launcher alone died), nothing is lost: training goes on in
    the same generation, unless one was being decided or carried out (what
    was reported or joined went to the primary: everyone reports again)."""
    for m in view.news_of(TookOver):
        if not m.node_alive:
            return node_lost(view, m.node, m.reason)
        if view.state in COLLECTING or view.state == S.REBUILDING:
            why = f"{m.reason}: every rank reports again to the new coordinator"
            return (again(view, why, "failure"),)
        if view.state == S.RESIZING:  # its joins went to the primary
            why = f"{m.reason} while the job was being resized"
            return (Stop(f"{why}: resume from the last --save checkpoint"),)
    return NOTHING


def silence(view: JobView) -> str:
    return f"no heartbeat for {view.settings.heartbeat_timeout:.1f} s"


def silent_nodes(view: JobView) -> Effects:
    """Nodes whose heartbeats stopped for the timeout."""
    if view.sighting is None:
        return NOTHING
    effects: List = []
    for node in view.sighting.silent_nodes:
        if f"{node}.0" not in view.lost_slots:
            effects.extend(node_lost(view, node, silence(view)))
    return tuple(effects)


def hung_workers(view: JobView) -> Effects:
    """Workers silent for the timeout on a node that still beats: hung."""
    if view.sighting is None:
        return NOTHING
    reason = f"{silence(view)} (hung)"
    return tuple(Loss((s,), reason, kill=(s,)) for s in view.sighting.hung_slots)


def unreachable_nodes(view: JobView) -> Effects:
    """Training nodes that beat but that their peers cannot reach: data
    sent to them waited the heartbeat timeout unacknowledged (paths.py)."""
    if view.state != S.TRAINING:
        return NOTHING
    timeout = view.settings.heartbeat_timeout
    pairs = cut_pairs(view.members.values(), view.main_threads, timeout)
    if not pairs:
        return NOTHING
    suspected = cut_pairs(view.members.values(), view.main_threads, timeout / 2)
    effects: List = []
    for node in cut_off(pairs, suspected):
        if f"{node}.0" not in view.lost_slots:
            peers = ", ".join(str(n) for n in partners(node, pairs))
            why = (
                f"unreachable from node(s) {peers}: data sent to it was left "
                f"unacknowledged for {timeout:.1f} s, though its heartbeats arrive"
            )
            effects.extend(node_lost(view, node, why))
    return tuple(effects)


def stuck_members(view: JobView) -> Effects:
    """Members that neither reported nor stopped training long after the
    failure was announced are blocked where no release reaches (each wrote
    its threads' stacks to the event log, event 'stuck'): they are killed
    and lost, and their buddies' copies restore them. One that holds the
    only copy of a shard is waited for (the groups' timeout frees it)."""
    waited = view.since_opened_s
    if view.sighting is None or view.state != S.RECOVERING:
        return NOTHING
    if waited < STUCK_KILL_TIMEOUTS * view.settings.heartbeat_timeout:
        return NOTHING
    copies = only_copies(view.members, set(view.lost), view.buddy)
    found, kept = stuck(
        view.members, set(view.lost), set(view.reports), view.sighting.states, copies
    )
    effects: List = []
    if kept:  # killing them would lose state: their wait ends at the groups' timeout
        why = [kept[r] for r in sorted(kept)]
        up_to_s = view.group_timeout_s
        effects.append(
            note("stuck_waited", once=True, ranks=sorted(kept), why=why, up_to_s=up_to_s)
        )
    if found:
        slots = tuple(view.members[r] for r in found)
        reason = (
            f"still training {waited:.0f} s after generation {view.gen} "
            "was announced (stuck; its stacks are in the event log)"
        )
        effects.append(Loss(slots, reason, kill=slots))
    return tuple(effects)


def computing_without_progress(view: JobView) -> Effects:
    """Training members whose main thread computes without finishing an
    iteration for --deadpool-progress-timeout while a peer waits on it."""
    if view.sighting is None or view.state != S.TRAINING:
        return NOTHING
    timeout = view.settings.progress_timeout
    hung = tuple(
        hung_computing(view.members, view.sighting.states, view.main_threads, timeout, view.now)
    )
    if not hung:
        return NOTHING
    reason = (
        f"no progress for {timeout:.0f} s while computing, peers waiting on it "
        "(hung; its heartbeat thread beat on)"
    )
    return (Loss(hung, reason, kill=hung),)


def report_timeout(view: JobView) -> Effects:
    """Live members that did not report in time are killed and lost. The
    time is longer when one that holds the only copy of a shard may be stuck
    until the groups' own timeout frees it (gloo's queued send:
    docs/reliability.md)."""
    waiting = view.waiting
    if view.state not in COLLECTING or not waiting:
        return NOTHING
    timeout = view.settings.recovery_timeout
    copies = only_copies(view.members, set(view.lost), view.buddy)
    limit = view.group_timeout_s
    if limit is not None and set(waiting) & set(copies):
        timeout = max(timeout, limit + 2 * view.settings.heartbeat_timeout)
    if view.since_opened_s <= timeout:
        return NOTHING
    slots = tuple(view.members[r] for r in waiting)
    return (Loss(slots, f"did not report within {timeout:.0f} s", kill=slots),)


def numeric_faults(view: JobView, corruption: bool) -> Tuple[NumericFault, ...]:
    """This generation's NaN reports (or corruption reports) that count: a
    rank that recovers with the others already needs none."""
    if view.state in COLLECTING or view.finished:
        return ()
    kind = [m for m in view.news_of(NumericFault) if m.gen == view.gen]
    return tuple(m for m in kind if (m.check != "nan") == corruption)


def stopped_by_fault(view: JobView, m: NumericFault) -> Optional[Stop]:
    """A fault while the job is resized or saving its checkpoint ends it."""
    if view.state not in UNRECOVERABLE:
        return None
    return Stop(f"rank {m.rank}: {m.error} while the job was {view.state.value}")


def corruptions(view: JobView) -> Effects:
    """--deadpool-on-sdc: roll every rank back to the doubted iteration's
    start, swap the suspect (a repeat, or swap), or stop."""
    for m in numeric_faults(view, corruption=True):
        stop = stopped_by_fault(view, m)
        if stop is not None:
            return (stop,)
        verdict = corruption_verdict(m, view.caught)
        said = note(
            "sdc_detected",
            rank=m.rank,
            check=m.check,
            iteration=m.iteration,
            suspects=m.suspects,
            action=verdict.action,
            error=m.error,
        )
        suspects = tuple(sorted(m.suspects))
        if verdict.action == SdcAction.SWAP:
            slot = view.members[verdict.rank]
            forget = Caught(suspects, m.iteration, forgive=verdict.rank)
            return (said, forget, Loss((slot,), verdict.why, kill=(slot,)))
        # A stop is decided once every rank has reported, so that each stops saying why.
        doomed = verdict.why if verdict.action == SdcAction.STOP else None
        back = again(view, verdict.why, "sdc", iteration=m.iteration - 1, doomed=doomed)
        return (said, Caught(suspects, m.iteration), back)
    return NOTHING


def lost_ranks(view: JobView) -> Effects:
    """Every loss of this pass: its slots count as gone; the ranks lost open
    one generation, in which the survivors report; a lost spare is said; a
    loss that no decision can combine with what is under way ends the job.
    A rank that said it is done is never lost: it has nothing left to lose
    (its node's agent ends with its workers, while others may still save)."""
    if view.finished:
        return NOTHING
    gone, ranks, effects, detected = set(view.lost_slots), set(), [], []
    for loss in view.news_of(Loss):
        slots = tuple(s for s in loss.slots if s not in gone and view.rank_of(s) not in view.done)
        if not slots:
            continue
        gone |= set(slots)
        effects.append(Lost(slots))
        held = sorted(r for r in map(view.rank_of, slots) if r is not None)
        if not held:
            effects.append(note("spare_lost", slots=list(slots), reason=loss.reason))
            continue
        stop = unrecoverable(view, loss.reason, held)
        if stop is not None:
            return (*effects, stop)
        ranks |= set(held)
        fields = dict(ranks=held, slots=list(slots), reason=loss.reason, iteration=view.iteration)
        detected.append((loss.reason, note("failure_detected", **fields)))
    if not ranks:
        return tuple(effects)
    spares = tuple(s for s in view.spares if s not in gone)
    after = replace(view, lost=view.lost | ranks, spares=spares, leaving=())
    opening = Opening(
        S.RECOVERING,
        "failure",
        notes=tuple(n for _, n in detected),
        reasons=tuple(reason for reason, _ in detected),
        lost=tuple(sorted(ranks)),
        assign=likely_spares(after),
    )
    return (*effects, opening)


def unrecoverable(view: JobView, reason: str, ranks: List[int]) -> Optional[Stop]:
    if view.state in UNRECOVERABLE:
        what = "saving its checkpoint" if view.stopping else "being resized"
        return Stop(
            f"{reason} (ranks {ranks}) while the job was {what}: resume from "
            "the last --save checkpoint"
        )
    if view.done:  # finished ranks have left: no generation can gather them again
        return Stop(
            f"{reason} (ranks {ranks}) after ranks {sorted(view.done)} had "
            "finished: the final checkpoint may lack their part; resume from the last "
            "complete --save checkpoint"
        )
    return None


def again(
    view: JobView,
    reason: str,
    cause: str,
    iteration: Optional[int] = None,
    doomed: Optional[str] = None,
) -> Opening:
    """A new generation in which every rank goes back to a snapshot all
    hold (nobody lost)."""
    detected = dict(
        ranks=[],
        slots=[],
        reason=reason,
        iteration=view.iteration if iteration is None else iteration,
    )
    after = replace(view, leaving=())
    return Opening(
        S.RECOVERING,
        cause,
        notes=(note("failure_detected", **detected),),
        reasons=(reason,),
        assign=likely_spares(after),
        doomed=doomed,
    )


def nans(view: JobView) -> Effects:
    """--deadpool-on-nan rollback: nobody is lost; every rank goes back to
    the failed iteration's start and redoes it. A second NaN or Inf in the
    same iteration is no transient fault: the job stops, decided once every
    rank has reported, so that each stops saying why."""
    for m in numeric_faults(view, corruption=False):
        stop = stopped_by_fault(view, m)
        if stop is not None:
            return (stop,)
        said = note("nan_detected", rank=m.rank, iteration=m.iteration, error=m.error)
        why = (
            f"rank {m.rank}: {m.error}: rolling every rank back to iteration {m.iteration}'s start"
        )
        doomed = nan_again(m, view.rolled_back)
        back = again(view, why, "nan", iteration=m.iteration - 1, doomed=doomed)
        return (said, Rollback(m.iteration, m.rank), back)
    return NOTHING


# ----- a generation's own progress -----
def build_timeout(view: JobView) -> Effects:
    timeout = view.settings.recovery_timeout
    if view.state in BUILDING and view.since_decided_s > timeout:
        return (Stop(f"generation {view.gen} did not resume within {timeout:.0f} s"),)
    return NOTHING


def rendezvous(view: JobView) -> Effects:
    """Everyone enters the new groups' rendezvous together, so that a
    failure before it is seen by polling, not by a gloo timeout."""
    if view.state in BUILDING and not view.rendezvous and len(view.joining) == view.world_size:
        return (Rendezvous(),)
    return NOTHING


def resumed(view: JobView) -> Effects:
    """Every member resumed: training goes on (after a checkpoint or a stop
    decided, the ranks save and stop)."""
    if view.state in BUILDING and len(view.resumed) == view.world_size:
        return (Advance(S.STOPPING if view.stopping else S.TRAINING, recovered=True),)
    return NOTHING


def first_iterations(view: JobView) -> Effects:
    """Every active rank has finished an iteration: spares may build data."""
    progress = view.progress
    started = len(progress) == view.world_size and min(progress.values(), default=0) >= 1
    if view.state == S.STARTING and started:
        return (Advance(S.TRAINING),)
    return NOTHING


def clean_redos(view: JobView) -> Effects:
    """Every rank finished a rolled-back iteration again without a NaN
    (their heartbeats say so, or a decision rolls back past it): the fault
    was transient, and where it showed is said once."""
    if view.state == S.TRAINING:
        done = min(view.progress.values(), default=0)
    elif view.state in BUILDING and view.decision is not None:
        done = view.decision.rollback_to or 0
    else:
        return NOTHING
    return redos_finished(view, done)


def redos_finished(view: JobView, done: int) -> Effects:
    why = "redone cleanly after rolling back: the first result was transient"
    effects: List = []
    for iteration, rank in redone(view.redoing, done):
        effects += [
            Redone(iteration, rank),
            note("nan_transient", iteration=iteration, rank=rank, why=why),
        ]
    return tuple(effects)


def spares_arrived(view: JobView) -> Effects:
    """Spares that became ready while survivors report may build now."""
    if view.state != S.RECOVERING or view.spares == view.published_spares:
        return NOTHING
    assign = likely_spares(view)
    return (Publish(assign, view.spares),)


# ----- while training: operations, then growth -----
def training(view: JobView) -> bool:
    """Planned changes start only while training, with the layout known."""
    return view.state == S.TRAINING and view.plan is not None and not view.finished


def stragglers(view: JobView) -> Effects:
    """After a look at the heartbeats: a straggler found is said once, and
    with --deadpool-on-straggler swap its node is drained while spares on
    other nodes are ready for its ranks (a straggler is not worth a shrink:
    the job would lose a replica's throughput). Asked once while it stays a
    straggler: a drain the policy refuses must not be tried again at every
    look, each a pause of the job."""
    factor = view.settings.straggler_factor
    if view.sighting is None or factor == 0 or view.state != S.TRAINING:
        return NOTHING
    found = judge(view.node_times, factor)
    effects: List = [
        note("straggler", **asdict(found[n])) for n in sorted(found) if n not in view.stragglers
    ]
    asked = set(view.straggler_drains) & set(found)  # those no longer slow may be again
    for node in sorted(set(found) - asked) if view.settings.on_straggler == "swap" else ():
        ranks = view.ranks_on(node)
        free = [s for s in view.spares if parse_slot(s)[0] != node]
        if len(free) < len(ranks):
            why = f"{len(free)} ready spare(s) for its {len(ranks)} rank(s)"
            effects.append(note("straggler_kept", once=True, node=node, reason=why))
            continue
        asked.add(node)
        reason = f"straggler: {found[node].ratio:.1f}x the other nodes' compute time"
        effects.append(QueueDrain(node, reason, by="straggler watch"))
    return (Judged(found, tuple(sorted(asked))), *effects)


def stop_requested(view: JobView) -> Effects:
    """A stop asked for: every rank stops at its iteration's end and saves."""
    if not training(view) or view.stop_request is None:
        return NOTHING
    return (planned(view, "stop", (), view.stop_request),)


def planned(view: JobView, cause: str, leaving: Tuple[int, ...], reason: str) -> Opening:
    said = note(
        "planned", cause=cause, nodes=list(leaving), reason=reason, iteration=view.iteration
    )
    after = replace(view, state=S.DRAINING, leaving=leaving, lost=frozenset())
    return Opening(S.DRAINING, cause, notes=(said,), leaving=leaving, assign=likely_spares(after))


def drains_of_lost_nodes(view: JobView) -> Effects:
    if not training(view) or view.stop_request is not None:
        return NOTHING
    why = "the node was lost before it could be drained"
    return tuple(DropDrain(n, why) for n in view.drains if n not in view.alive_nodes)


def drains_of_idle_nodes(view: JobView) -> Effects:
    """A node with no rank leaves at once."""
    if not training(view) or view.stop_request is not None:
        return NOTHING
    return tuple(SendOff(n, why) for n, why in view.drains.items() if not view.ranks_on(n))


def drains_due(view: JobView) -> Effects:
    """The drains asked for start at the next boundary, unless too few
    spares are ready for them but enough are starting: training goes on
    while they warm up (up to --deadpool-spare-wait after the first
    request), then the nodes drain, to spares or by a shrink."""
    if not training(view) or view.stop_request is not None or not view.drains:
        return NOTHING
    leaving = set(view.drains)
    needed = sum(len(view.ranks_on(n)) for n in leaving)
    ready = [s for s in view.spares if parse_slot(s)[0] not in leaving]
    warming = [s for s in view.warming if parse_slot(s)[0] not in leaving]
    limit = view.settings.spare_wait
    if waits_for_spares(needed, len(ready), len(warming), view.since_drain_asked_s, limit):
        fields = dict(
            nodes=sorted(leaving), ready=len(ready), warming=sorted(warming), up_to_s=limit
        )
        return (note("drain_waits_for_spares", once=True, **fields),)
    nodes = tuple(sorted(view.drains))
    return (planned(view, "drain", nodes, "; ".join(view.drains[n] for n in nodes)),)


def grow(view: JobView) -> Effects:
    """Announce a grow once the ready spares fill a whole replica."""
    busy = view.stopping or view.drains or view.stop_request
    if not training(view) or view.world_size >= view.planned_size or busy:
        return NOTHING
    add = grow_by(view)
    if add == 0:
        return NOTHING
    said = note(
        "grow_announced",
        dp_before=view.grid.dp,
        dp_after=view.grid.dp + add,
        spares=list(view.spares),
        iteration=view.iteration,
    )
    return (Opening(S.GROWING, "grow", notes=(said,)),)


TRIGGERS: Tuple[Trigger, ...] = (
    majority,
    exits,
    agents_ended,
    launchers,
    took_over,
    silent_nodes,
    hung_workers,
    unreachable_nodes,
    stuck_members,
    computing_without_progress,
    report_timeout,
    corruptions,
    lost_ranks,
    nans,
    build_timeout,
    rendezvous,
    resumed,
    first_iterations,
    clean_redos,
    spares_arrived,
    stragglers,
    stop_requested,
    drains_of_lost_nodes,
    drains_of_idle_nodes,
    drains_due,
    grow,
    standby,
)
