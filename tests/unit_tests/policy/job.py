"""The small jobs the policy's tests judge, built by hand as frozen views
(no store, no process, no clock).

``JOB``: two nodes of two ranks training (TP1 x PP1 x DP4), each rank's
buddy and owner on the other node, and a spare node whose slots 2.0 and 2.1
are ready; a 3 s heartbeat timeout, no wait for spares, and an abort when
they run out. ``SHRINKING``: two nodes of two ranks laid out PP2 x DP2
(replica d is node d) without a spare node, shrinking when spares run out.
A test changes what its claim needs with ``dataclasses.replace``.
"""

import dataclasses
from typing import Dict, Iterable, Mapping, Optional, Sequence

from deadpool_ext.policy.effects import Loss
from deadpool_ext.policy.triggers import TRIGGERS
from deadpool_ext.policy.view import JobView, Limits
from deadpool_ext.protocol import CoordinatorSettings, JobState, Plan, Report, slot_name
from deadpool_ext.topology import Grid

S = JobState
replace = dataclasses.replace

BUDDY = (2, 3, 0, 1)  # DP peers on the other node
MEMBERS = {0: "0.0", 1: "0.1", 2: "1.0", 3: "1.1"}
SETTINGS = CoordinatorSettings(heartbeat_timeout=3.0, spare_wait=0.0, on_spares_exhausted="abort")


def plan(pp: int, tp_pp_dp: bool, buddy: Optional[Sequence[int]] = BUDDY) -> Plan:
    """Rank 0's layout of a TP1 job."""
    listed = None if buddy is None else list(buddy)
    return Plan(gen=0, buddy=listed, owner=listed, tp=1, pp=pp, tp_pp_dp=tp_pp_dp)


JOB = JobView(
    gen=0,
    members=MEMBERS,
    spares=("2.0", "2.1"),
    buddy=BUDDY,
    owner=BUDDY,
    grid=Grid(tp=1, pp=1, dp=4),
    planned_dp=4,
    limits=Limits(on_spares_exhausted="abort"),
    state=S.TRAINING,
    settings=SETTINGS,
    plan=plan(pp=1, tp_pp_dp=False),
    planned_size=4,
    nproc=2,
    nodes=(0, 1, 2),
    alive_nodes=frozenset({0, 1, 2}),
    quorum_nodes=frozenset({0, 1, 2}),
)

SHRINKING = replace(
    JOB,
    spares=(),
    grid=Grid(tp=1, pp=2, dp=2, tp_pp_dp=True),
    planned_dp=2,
    limits=Limits(on_spares_exhausted="shrink"),
    settings=replace(SETTINGS, on_spares_exhausted="shrink"),
    plan=plan(pp=2, tp_pp_dp=True),
    nodes=(0, 1),
    alive_nodes=frozenset({0, 1}),
    quorum_nodes=frozenset({0, 1}),
)


def reports(
    ranks: Iterable[int],
    own: Sequence[int] = (5, 4),
    held: Optional[Sequence[int]] = None,
    members: Mapping[int, str] = MEMBERS,
) -> Dict[int, Report]:
    """What ``ranks`` report holding: their own snapshots ``own``, and
    ``held`` (the same unless given) of their owners'."""
    kept = list(own if held is None else held)
    return {r: Report(r, members[r], list(own), kept) for r in ranks}


def recovering(view: JobView, lost: Iterable[int], gen: int = 1, **changes) -> JobView:
    """The generation opened after ``lost`` ranks' slots were lost, in which
    the survivors report."""
    ranks = frozenset(lost)
    slots = frozenset(view.members[r] for r in ranks)
    return replace(
        view,
        gen=gen,
        state=S.RECOVERING,
        lost=ranks,
        lost_slots=view.lost_slots | slots,
        spares=tuple(s for s in view.spares if s not in slots),
        **changes,
    )


def lost_nodes(view: JobView, *nodes: int) -> JobView:
    """Every slot of ``nodes`` lost (their agents gone too)."""
    slots = frozenset(slot_name(n, i) for n in nodes for i in range(view.nproc))
    return replace(
        view,
        lost_slots=view.lost_slots | slots,
        spares=tuple(s for s in view.spares if s not in slots),
        alive_nodes=view.alive_nodes - set(nodes),
    )


def with_news(view: JobView, *news) -> JobView:
    return replace(view, news=tuple(news))


def losses(effects) -> tuple:
    """The losses among a trigger's effects, as the later rule reads them."""
    return tuple(e for e in effects if isinstance(e, Loss))


def every_trigger(view: JobView) -> tuple:
    """What every trigger asks for on one view: the coordinator's pass over
    it when none of them asks for anything (it then has nothing to do)."""
    return tuple(effect for trigger in TRIGGERS for effect in trigger(view))
