"""The recovery policy: what a generation that collected its reports
decides, as pure rank arithmetic (tested without processes).

The coordinator hands ``Policy.decide`` a frozen ``JobView`` (view.py: the
generation, members, lost ranks, what every live rank reported holding: the
iterations of its own verified snapshots and of the verified copies it holds
for its owner; the ready and warming spares, the buddy map, the grid, the
job's ``Limits`` and the time since the generation opened) and gets back one
``Decision``, or a ``Wait`` with its reason. A decision is never changed
after it is made. Its parts share one rule for the rollback,
``newest_common``: the newest iteration every shard can be restored at, from
the snapshot of the rank that contributes it.

  * hot swap (``swap``): a spare at each lost rank's id, the lost ranks'
    state from their buddies (after DeadPool);
  * wait for spares (``waits_for_spares``): too few spares are ready but
    enough are starting: wait for them, up to --deadpool-spare-wait, and
    swap once rather than shrink now and grow back soon;
  * shrink (``shrink``), when spares run out: every data-parallel
    replica that lost a rank leaves; the kept replicas are renumbered, in
    order, into a world of TP x PP x DP' ranks, each rank keeping its (tp,
    pp) position so its model shard stays valid. When ranks were lost from
    every replica, the survivors of the broken replicas still make up whole
    replicas if every position kept a rank: DP replicas hold the same
    weights, so a replica assembled from ranks of several is as good. Every
    old shard, the dropped ones included, comes from a kept rank (after
    ReCoVer). The global batch does not change: its microbatches are spread
    over the DP' replicas (``data.microbatches_per_iteration``). A job on
    the interleaved schedule runs only at the DP sizes whose shares its
    microbatch groups allow: more replicas leave, whole blocks last first,
    each only if its shards stay held by a kept rank;
  * checkpoint and stop (``shrink(view, stop=True)``): the survivors gather
    every shard as a shrink does, save it and stop;
  * drain (``drain``), planned: the ranks of named nodes leave at an
    iteration boundary, nobody lost. With ready spares on other nodes it is
    a hot swap whose rollback is the boundary itself (every rank stopped
    there, and each leaving rank's snapshot of it reached its buddy first):
    nothing is redone. Without, the job shrinks as if they were lost. A
    drain nothing can carry out is refused: the job goes on as it was;
  * stop (``stop_here``), planned: every rank saves the boundary's state
    and the job ends (deadpool-ctl stop);
  * grow (``grow``), when the ready spares make up whole replicas
    again, at an iteration boundary and never past the launched size. The
    running replicas keep their order and positions; the new ones come
    after them, each taking spare slots in node order, so its
    tensor-parallel group stays on one node where the slots allow. Nobody
    was lost: every shard comes from its owner's own snapshot.
"""

from dataclasses import replace
from typing import Dict, List, Optional, Sequence, Set, Tuple, Union

from deadpool_ext.defaults import TAKEOVER_GRACE_S
from deadpool_ext.policy.admission import why_no_quorum
from deadpool_ext.policy.effects import Wait, note
from deadpool_ext.policy.view import JobView
from deadpool_ext.protocol import (
    Action,
    Decision,
    JobState,
    Report,
    Source,
    group_members,
    parse_slot,
)

from deadpool_ext.topology import Grid

abort = Decision.abort


def newest_common(sources: Dict[int, List], reports: Dict[int, Report]) -> Optional[int]:
    """The one rollback rule: the newest iteration at which every shard can
    be restored, each from its contributor's snapshots of the kind named
    (``sources``: rank -> [contributor, Source])."""
    candidates: Optional[Set[int]] = None
    for contributor, kind in sources.values():
        held = set(getattr(reports[contributor], Source(kind).value))
        candidates = held if candidates is None else candidates & held
    return max(candidates) if candidates else None


def choose_spares(
    lost: Sequence[int],
    spares: Sequence[str],
    members: Dict[int, str],
    buddy: Sequence[int],
    owner: Sequence[int],
) -> tuple:
    """A spare slot for each lost rank, avoiding the nodes of its buddy and its
    owner (so that one node never holds a rank and its only copy). Spares
    are taken node by node, so a lost node is replaced by one spare node."""
    free = sorted(spares, key=parse_slot)
    chosen: Dict[int, str] = {}
    warnings: List[str] = []
    for rank in sorted(lost):
        avoid = {
            parse_slot(members[r])[0]
            for r in (buddy[rank], owner[rank])
            if r not in lost and r in members
        }
        good = [s for s in free if parse_slot(s)[0] not in avoid]
        used = {parse_slot(s)[0] for s in chosen.values()}
        # Fill a spare node already taken in this decision before another.
        pick = sorted(good or free, key=lambda s: (parse_slot(s)[0] not in used, parse_slot(s)))[0]
        if not good:
            warnings.append(f"rank {rank}'s spare shares a node with its buddy or owner")
        free.remove(pick)
        chosen[rank] = pick
    return chosen, warnings


def swap(view: JobView) -> Decision:
    """A spare in each lost rank's place, its state from the buddy's copy."""
    gen, members, lost, reports = view.gen, view.members, view.lost, view.reports
    spares, buddy, owner = view.spares, view.buddy, view.owner
    if buddy is None:
        return abort(
            gen,
            f"ranks {sorted(lost)} were lost and no copy of their state exists (the job "
            "runs without a mirror)",
            members,
        )
    for rank in sorted(lost):
        if buddy[rank] in lost:
            return abort(
                gen,
                f"rank {rank} and its buddy rank {buddy[rank]} were both lost: "
                f"no copy of rank {rank}'s optimizer shard is left",
                members,
            )
    if len(spares) < len(lost):
        return abort(
            gen,
            f"spares exhausted: {len(lost)} rank(s) lost "
            f"({', '.join(map(str, sorted(lost)))}), {len(spares)} spare process(es) "
            "left",
            members,
        )
    missing = [r for r in members if r not in lost and r not in reports]
    if missing:
        raise ValueError(f"no report from ranks {missing}")
    # A rank whose process is new (a spare assigned in an interrupted
    # recovery) reports no own snapshot: it also needs its buddy's copy.
    needs_buddy = set(lost) | {r for r, rep in reports.items() if not rep.own}
    for rank in sorted(needs_buddy - set(lost)):
        if buddy[rank] in needs_buddy:
            return abort(
                gen,
                f"rank {rank} and its buddy rank {buddy[rank]} both lost their "
                "state in consecutive failures",
                members,
            )
    sources = {
        rank: [buddy[rank], Source.HELD] if rank in needs_buddy else [rank, Source.OWN]
        for rank in members
    }
    iteration = newest_common(sources, reports)
    if iteration is None:
        return abort(
            gen,
            "no iteration that every rank can restore: own snapshots "
            f"{ {r: rep.own for r, rep in sorted(reports.items())} }, held copies "
            f"{ {buddy[r]: reports[buddy[r]].held for r in sorted(needs_buddy)} }",
            members,
        )
    replaced, warnings = choose_spares(sorted(lost), spares, members, buddy, owner)
    new_members = dict(members)
    new_members.update(replaced)
    return Decision(
        gen=gen,
        action=Action.RECOVER,
        rollback_to=iteration,
        members=new_members,
        replaced=replaced,
        from_buddy=sorted(needs_buddy),
        warnings=warnings,
        kept=kept_groups(reports, needs_buddy),
    )


def kept_groups(reports: Dict[int, Report], changed: Set[int]) -> List[str]:
    """The groups a hot swap keeps: every member reported it with its
    connections open and the same count of issued operations (none is in
    the middle of one the others are not), and no member changed process
    or restores from its buddy."""
    counts: Dict[str, Dict[int, int]] = {}
    for rank, report in reports.items():
        for key, issued in report.groups.items():
            counts.setdefault(key, {})[rank] = issued
    return sorted(
        key
        for key, issued in counts.items()
        if set(issued) == set(group_members(key))
        and len(set(issued.values())) == 1
        and not set(issued) & changed
    )


# ----- shrink -----
Position = Tuple[int, int]  # (tp, pp)


def positions(grid: Grid) -> List[Position]:
    return [(tp, pp) for pp in range(grid.pp) for tp in range(grid.tp)]


def whole_replica(grid: Grid, dp: int) -> Dict[Position, int]:
    return {(tp, pp): grid.rank(tp, dp, pp) for tp, pp in positions(grid)}


def kept_replicas(grid: Grid, lost: Set[int], unit: int = 1) -> List[Dict[Position, int]]:
    """The replicas of the smaller job, each a rank per position: the intact
    old replicas in order, then as many as the broken replicas' survivors
    make up, taking at each position its survivors in replica order. With
    ``unit`` > 1 (an MoE model whose expert-parallel groups span ``unit``
    replicas) replicas leave in aligned blocks of ``unit``, so every kept
    rank keeps its experts, and none are made up."""
    broken = sorted({grid.replica(r) for r in lost})
    if unit > 1:
        gone = {d // unit for d in broken}
        return [whole_replica(grid, d) for d in range(grid.dp) if d // unit not in gone]
    kept = [whole_replica(grid, d) for d in range(grid.dp) if d not in broken]
    left = {
        pos: [r for r in (grid.rank(pos[0], d, pos[1]) for d in broken) if r not in lost]
        for pos in positions(grid)
    }
    assembled = min(len(ranks) for ranks in left.values())
    return kept + [{pos: left[pos][i] for pos in left} for i in range(assembled)]


def runnable_size(limit: int, sizes: Optional[Sequence[int]], unit: int = 1) -> int:
    """The largest data-parallel size up to ``limit``, a multiple of
    ``unit``, that the job can run at (``sizes``; None: any); 0 if none."""
    fits = [d for d in (range(1, limit + 1) if sizes is None else sizes) if d <= limit]
    return max((d for d in fits if d % unit == 0), default=0)


def fit_runnable_size(
    replicas: List[Dict[Position, int]],
    grid: Grid,
    reports: Dict[int, Report],
    buddy: Sequence[int],
    unit: int,
    sizes: Optional[Sequence[int]],
) -> Tuple[List[Dict[Position, int]], Optional[str]]:
    """The kept replicas cut to the largest size the job can run at: whole
    blocks of ``unit`` leave, the last first, each only if no shard loses
    its last copy on a kept rank by it. Returns (replicas, why not)."""
    target = runnable_size(len(replicas), sizes, unit)
    if target == 0:
        return [], (
            f"the interleaved schedule runs this job at data-parallel sizes {list(sizes)} "
            f"only, and {len(replicas)} replica(s) are left"
        )
    blocks = [replicas[i : i + unit] for i in range(0, len(replicas), unit)]

    def problems(kept_blocks) -> int:
        kept = [r for block in kept_blocks for r in block]
        return len(shard_sources(grid, set(renumber(grid, kept)), reports, buddy)[1])

    while len(blocks) * unit > target:
        before = problems(blocks)
        for i in reversed(range(len(blocks))):
            rest = blocks[:i] + blocks[i + 1 :]
            if problems(rest) <= before:
                blocks = rest
                break
        else:
            return [], (
                f"the interleaved schedule runs this job at data-parallel sizes {list(sizes)} "
                f"only, and no {target} of the {len(replicas)} replicas left hold every "
                "optimizer shard"
            )
    return [r for block in blocks for r in block], None


def renumber(grid: Grid, replicas: Sequence[Dict[Position, int]]) -> Dict[int, int]:
    """Old rank -> new rank for the ranks of the kept replicas (in order)."""
    new_grid = grid.with_dp(len(replicas))
    return {
        old: new_grid.rank(tp, new_dp, pp)
        for new_dp, replica in enumerate(replicas)
        for (tp, pp), old in replica.items()
    }


def shard_sources(
    grid: Grid, kept: Set[int], reports: Dict[int, Report], buddy: Sequence[int]
) -> Tuple[Dict[int, List], List[str]]:
    """For every old rank, who contributes its shard: itself from its own
    snapshot if it stays (is in ``kept``), else its buddy from the held copy
    if the buddy stays. Returns (sources, problems)."""
    sources: Dict[int, List] = {}
    problems: List[str] = []
    for rank in range(grid.world_size):
        report = reports.get(rank)
        if rank in kept and report and report.own:
            sources[rank] = [rank, Source.OWN]
        elif buddy[rank] in kept:
            sources[rank] = [buddy[rank], Source.HELD]
        else:
            problems.append(
                f"rank {rank}'s optimizer shard has no copy on a kept rank "
                f"(its buddy rank {buddy[rank]} is lost or leaves too)"
            )
    return sources, problems


def shrink(view: JobView, stop: bool = False) -> Decision:
    """Drop every replica that lost a rank (every block of the limits'
    shrink unit that did, see kept_replicas); the rest, and the replicas its
    survivors make up, go on as a smaller job, at one of the data-parallel
    sizes the job can run at. With ``stop`` they save that state instead
    and the job stops (checkpoint and stop)."""
    gen, members, lost, reports = view.gen, view.members, view.lost, view.reports
    buddy, grid = view.buddy, view.grid
    unit, sizes = view.limits.shrink_unit, view.limits.data_parallel_sizes
    broken = {grid.replica(r) for r in lost}
    broken = {d for d in range(grid.dp) if d // unit in {b // unit for b in broken}}
    replicas = kept_replicas(grid, lost, unit)
    if not replicas:
        return abort(
            gen,
            f"no complete data-parallel replica is left: ranks "
            f"{sorted(lost)} were lost from all {grid.dp} replicas, and some "
            "(tp, pp) position has no rank left",
            members,
        )
    if buddy is None:
        return abort(
            gen,
            f"ranks {sorted(lost)} were lost and no copy of their optimizer "
            "shards exists (the job runs without a mirror)",
            members,
        )
    made_up = len(replicas)
    replicas, why = fit_runnable_size(replicas, grid, reports, buddy, unit, sizes)
    if why:
        return abort(gen, f"cannot shrink: {why}", members)
    mapping = renumber(grid, replicas)
    sources, problems = shard_sources(grid, set(mapping), reports, buddy)
    if problems:
        return abort(gen, "cannot shrink: " + "; ".join(problems), members)
    iteration = newest_common(sources, reports)
    if iteration is None:
        return abort(
            gen, "cannot shrink: no iteration that every kept rank holds for every shard", members
        )
    released = sorted(members[r] for r in members if r not in lost and r not in mapping)
    assembled = made_up - (grid.dp - len(broken))
    fitted = (
        f"; {made_up - len(replicas)} more left for a size the interleaved schedule runs at"
        if made_up > len(replicas)
        else ""
    )
    return Decision(
        gen=gen,
        action=Action.CHECKPOINT if stop else Action.SHRINK,
        reason=(
            f"spares exhausted ({len(lost)} rank(s) lost): saved iteration {iteration} and "
            "stopped (--deadpool-on-spares-exhausted checkpoint); resubmit with --load when "
            "nodes are back"
            if stop
            else ""
        ),
        rollback_to=iteration,
        members={new: members[old] for old, new in mapping.items()},
        renumber=mapping,
        sources=sources,
        released=released,
        old_dp=grid.dp,
        new_dp=len(replicas),
        warnings=[
            f"shrinking from {grid.dp} to {len(replicas)} data-parallel "
            f"replicas: dropped replica(s) {sorted(broken)}"
            + (f", {assembled} made up of their surviving ranks" if assembled else "")
            + fitted
        ],
    )


# ----- grow -----
def replicas_to_add(
    grid: Grid, planned_dp: int, spares: Sequence[str], sizes: Optional[Sequence[int]] = None
) -> int:
    """Whole replicas the spares can fill, up to the planned size, landing
    on a size the job can run at (``sizes``; None: any)."""
    room = max(0, min(planned_dp - grid.dp, len(spares) // (grid.tp * grid.pp)))
    return max(0, runnable_size(grid.dp + room, sizes) - grid.dp)


def place_new_replicas(grid: Grid, new_grid: Grid, spares: Sequence[str]) -> Dict[int, str]:
    """New rank -> spare slot for the replicas grid.dp .. new_grid.dp - 1.
    TP is innermost in the rank order, so consecutive slots of a node make
    up a TP group."""
    free = iter(sorted(spares, key=parse_slot))
    return {
        new_grid.rank(tp, dp, pp): next(free)
        for dp in range(grid.dp, new_grid.dp)
        for pp in range(grid.pp)
        for tp in range(grid.tp)
    }


def grow(view: JobView) -> Decision:
    """The ready spares join as whole replicas after the running ones; no
    one was lost, so every shard comes from its owner's own snapshot."""
    gen, members, reports, spares, grid = (
        view.gen,
        view.members,
        view.reports,
        view.spares,
        view.grid,
    )
    planned_dp, sizes = view.planned_dp, view.limits.data_parallel_sizes
    sources = {rank: [rank, Source.OWN] for rank in members}
    iteration = newest_common(sources, reports)
    if iteration is None:
        return abort(
            gen,
            "cannot grow: no snapshot iteration every rank holds: "
            f"{ {r: rep.own for r, rep in sorted(reports.items())} }",
            members,
        )
    add = replicas_to_add(grid, planned_dp, spares, sizes)
    if add == 0:
        # The spares left between the announcement and now: go on as before.
        return Decision(
            gen=gen,
            action=Action.RECOVER,
            rollback_to=iteration,
            members=dict(members),
            warnings=[
                "the spares for the grow are gone; the job goes on at "
                f"{grid.dp} data-parallel replicas"
            ],
        )
    new_grid = grid.with_dp(grid.dp + add)
    mapping = {rank: new_grid.rank(*grid.coords(rank)) for rank in members}
    joined = place_new_replicas(grid, new_grid, spares)
    new_members = {mapping[rank]: slot for rank, slot in members.items()}
    new_members.update(joined)
    return Decision(
        gen=gen,
        action=Action.GROW,
        rollback_to=iteration,
        members=new_members,
        replaced=joined,
        renumber=mapping,
        sources=sources,
        old_dp=grid.dp,
        new_dp=new_grid.dp,
        warnings=[
            f"growing from {grid.dp} to {new_grid.dp} data-parallel "
            f"replicas with spare slots {sorted(joined.values())}"
        ],
    )


# ----- planned: drain and stop -----
def drain(view: JobView) -> Decision:
    """The draining nodes' ranks leave at the boundary every rank stopped
    at: to spares on other nodes while enough are ready (their state from
    the boundary's snapshot, which reached the buddies before the
    reports), else by a shrink (--deadpool-on-spares-exhausted shrink or
    checkpoint). A drain nothing can carry out is refused, never a reason
    to stop the job."""
    nodes = set(view.leaving)
    leaving = view.draining
    usable = tuple(s for s in view.spares if parse_slot(s)[0] not in nodes)
    as_lost = replace(view, lost=leaving, spares=usable, state=JobState.RECOVERING)
    on_exhausted = view.limits.on_spares_exhausted
    if len(usable) >= len(leaving) and view.buddy is not None:
        decision = swap(as_lost)
    elif on_exhausted == "shrink" and not view.limits.cannot_resize:
        decision = shrink(as_lost)
    else:
        why = view.limits.cannot_resize or f"--deadpool-on-spares-exhausted is {on_exhausted}"
        return go_on(view, f"{len(usable)} ready spare(s) for {len(leaving)} rank(s), and {why}")
    if decision.action == Action.ABORT:
        return go_on(view, decision.reason)
    released = sorted(set(decision.released) | {view.members[r] for r in leaving})
    warnings = list(decision.warnings)
    boundary = max((max(rep.own, default=0) for rep in view.reports.values()), default=0)
    if decision.rollback_to is not None and decision.rollback_to < boundary:
        warnings.append(
            f"the leaving ranks' state of iteration {boundary} did not reach their buddies: "
            f"iterations {decision.rollback_to + 1}..{boundary} are redone"
        )
    return replace(
        decision,
        reason=f"node(s) {sorted(nodes)} drained",
        released=released,
        drained=sorted(nodes),
        warnings=warnings,
    )


def go_on(view: JobView, why: str) -> Decision:
    """Nothing changes: every rank resumes from its own snapshot of the
    boundary (a drain that could not be carried out, or spares that left)."""
    sources = {rank: [rank, Source.OWN] for rank in view.members}
    iteration = newest_common(sources, dict(view.reports))
    if iteration is None:
        return abort(view.gen, f"{why}; and no snapshot iteration every rank holds", view.members)
    return Decision(
        gen=view.gen,
        action=Action.RECOVER,
        rollback_to=iteration,
        members=dict(view.members),
        warnings=[f"not drained: {why}"] if view.draining else [why],
    )


def stop_here(view: JobView) -> Decision:
    """Every rank saves the boundary's state, and the job ends."""
    decision = go_on(view, "")
    if decision.action == Action.ABORT:
        return decision
    return replace(decision, reason=view.stop_request or "", warnings=[], stop=True)


# ----- waiting for spares: the one rule, for failures and drains -----
def waits_for_spares(
    needed: int, ready: int, warming: int, waited_s: float, limit_s: float
) -> bool:
    """Too few spares are ready but enough are starting: wait for them, up
    to --deadpool-spare-wait, rather than shrink now and grow back soon."""
    return ready < needed <= ready + warming and waited_s < limit_s


def wait_for_lost_ranks(view: JobView) -> Optional[Wait]:
    """A failure's generation waits for warming spares (not a grow's)."""
    lost, ready, warming = len(view.lost), len(view.spares), len(view.warming)
    limit = view.settings.spare_wait
    if view.growing or not waits_for_spares(lost, ready, warming, view.since_opened_s, limit):
        return None
    reason = (
        f"{lost} rank(s) lost, {ready} spare(s) ready, {warming} starting: "
        f"waiting up to {limit:g} s"
    )
    fields = dict(lost=lost, ready=ready, warming=sorted(view.warming), up_to_s=limit)
    return Wait(reason, note("waiting_for_spares", once=True, reason=reason, **fields))


def likely_spares(view: JobView) -> Dict[int, str]:
    """The spares a swap will take if nothing else fails (those told to
    start building now), for the lost ranks or those of draining nodes;
    none where no swap is possible."""
    movers = view.lost or view.draining
    spares = [s for s in view.spares if parse_slot(s)[0] not in view.leaving]
    if (
        view.buddy is None
        or len(spares) < len(movers)
        or any(view.buddy[r] in movers for r in movers)
    ):
        return {}
    return choose_spares(sorted(movers), spares, view.members, view.buddy, view.owner)[0]


def grow_by(view: JobView) -> int:
    """How many replicas a grow would add now (0: none)."""
    if view.limits.cannot_grow or view.grid is None:
        return 0
    return replicas_to_add(view.grid, view.planned_dp, view.spares, view.limits.data_parallel_sizes)


def settling(view: JobView) -> bool:
    """Just after a takeover no agent has beaten on this store yet, so no
    spare is known to be warming: decide once every live node's agent beat
    here (or was declared silent), not shrink at once."""
    if view.settling_s is None:
        return False
    limit = view.settings.heartbeat_timeout + TAKEOVER_GRACE_S
    return view.settling_s <= limit and not view.alive_nodes <= view.last_sighting.beating


# ----- the policy -----
class Policy:
    """Once every live member reported: hot swap while spares last (waiting
    a bounded time for spares that are starting); then
    --deadpool-on-spares-exhausted: shrink, checkpoint and stop, or abort; a
    grow, a drain or a stop when the generation was opened for one."""

    def decide(self, view: JobView) -> Union[Decision, Wait]:
        if view.waiting:
            return Wait(f"ranks {list(view.waiting)} have not reported")
        if view.plan is None:
            return abort(view.gen, "no buddy plan was received from rank 0", view.members)
        if view.cut_off_s is not None or view.fenced is not None:
            return Wait("cut off from the majority: deciding nothing")
        no_quorum = why_no_quorum(view) if view.guards_quorum else None
        if no_quorum is not None:
            return abort(view.gen, no_quorum, view.members)
        if settling(view):
            return Wait("waiting for every live node's agent to beat on this store")
        decision = self.choose(view)
        if isinstance(decision, Wait) or decision.action == Action.ABORT:
            return decision
        return told(view, decision)

    def choose(self, view: JobView) -> Union[Decision, Wait]:
        if view.doomed is not None:
            return abort(view.gen, view.doomed, view.members)
        planned = view.state == JobState.DRAINING and not view.lost
        if planned and view.stop_request is not None:
            return stop_here(view)
        if planned and view.draining:
            return drain(view)
        if view.growing:
            return grow(view)
        wait = wait_for_lost_ranks(view)
        if wait is not None:
            return wait
        on_exhausted = view.limits.on_spares_exhausted
        resizes = on_exhausted in ("shrink", "checkpoint")
        if not resizes or (len(view.spares) >= len(view.lost) and view.buddy is not None):
            return swap(view)
        if view.limits.cannot_resize:
            return abort(
                view.gen,
                f"ranks {sorted(view.lost)} were lost and no spare is left; the job "
                f"cannot {on_exhausted} ({view.limits.cannot_resize}): resume from the "
                "last --save checkpoint",
                view.members,
            )
        return shrink(view, stop=on_exhausted == "checkpoint")


def told(view: JobView, decision: Decision) -> Decision:
    """The decision with what the coordinator knows beside it: why the
    generations since the last one opened, the GPUs of the spares it takes,
    and the ready spares it left out for their GPUs' problems."""
    reason = decision.reason or "; ".join(view.reasons)
    taken = decision.replaced.values()
    gpus = {slot: view.gpus[slot] for slot in taken if slot in view.gpus}
    return replace(decision, reason=reason, gpus=gpus, withheld=sorted(view.withheld))
