"""Who may take part: launchers, joining nodes, and the majority a decision needs.

It judges a node's launcher started for another job size, a node that joins
a running job (``deadpool-launch --join``), the majority a decision needs
when a standby coordinator could take over, and which node's launcher is
that standby.

Why a majority: a primary that is only cut off from some nodes keeps
coordinating the others. It stops deciding once it hears from no more than
half of the nodes alive at its last decision, and the standby starts only
with more than half of them (control/standby.py), so the two never both
decide.
"""

from typing import AbstractSet, Optional

from deadpool_ext.defaults import TAKEOVER_WAIT_S
from deadpool_ext.policy.effects import NOTHING, Appoint, Effects, Fence, Majority
from deadpool_ext.policy.view import JobView, Superseded
from deadpool_ext.protocol import JobState


def is_majority(nodes: AbstractSet[int], of: AbstractSet[int]) -> bool:
    """Whether ``nodes`` are more than half of ``of`` (the nodes alive at the
    last decision): the coordinator's rule and the standby's alike."""
    return 2 * len(nodes & of) > len(of)


def why_no_quorum(view: JobView) -> Optional[str]:
    """Why no decision may be made (a majority of the nodes alive at the
    last one is lost), or None."""
    alive = view.alive_nodes & view.quorum_nodes
    if is_majority(alive, view.quorum_nodes):
        return None
    return (
        f"only nodes {sorted(alive)} of {sorted(view.quorum_nodes)} are alive: with a "
        "standby coordinator a decision needs a majority of them (a network partition "
        "looks like this); resume from the last --save checkpoint"
    )


def majority(view: JobView) -> Effects:
    """The first rule. With a standby that could take over, a coordinator
    that hears (agents that beat within half the heartbeat timeout) no
    majority of the nodes alive at the last decision is cut off: it declares
    nobody lost and decides nothing, since the other side may be the
    majority, whose standby takes over. It
    goes on once it hears a majority again (a partition that healed before
    anyone came over to the standby). Its side leaves the job (``Fence``)
    once it learns that the standby took over, or once it was cut off for
    longer than the standby waits for a majority to come over."""
    if view.news_of(Superseded):
        return (Fence("the standby took over while this coordinator was cut off"),)
    if not view.guards_quorum or view.sighting is None:
        return NOTHING
    # Heard lately, not merely not yet silent: across a partition the other
    # nodes' timeouts run out one after another, and the first must not be
    # declared lost while the rest are still within theirs.
    heard = view.alive_nodes & view.sighting.heard
    has = is_majority(heard, view.quorum_nodes)
    cut_off = view.cut_off_s is not None
    if has and cut_off:
        return (Majority(True, f"nodes {sorted(heard)} of {sorted(view.quorum_nodes)} heard"),)
    if not has and not cut_off:
        reason = (
            f"only nodes {sorted(heard)} of {sorted(view.quorum_nodes)} are heard: a network "
            "partition, or the loss of a majority; deciding nothing until they are heard again"
        )
        return (Majority(False, reason),)
    limit = view.settings.heartbeat_timeout + TAKEOVER_WAIT_S
    if cut_off and view.cut_off_s > limit:
        return (Fence(f"cut off from the majority for {limit:.0f} s"),)
    return NOTHING


def standby(view: JobView) -> Effects:
    """With a standby coordinator, one is always appointed while a live node
    other than the coordinator's serves a store for it: node 1 first, then,
    once the standby's node is lost, drained or coordinates, the lowest
    such node not being drained, so that after a takeover, a loss or a
    drain of the standby's node the next failure of the coordinator is
    survived too (``Appoint(None)``: its node is gone and no other serves one)."""
    if not view.guards_quorum or view.finished:
        return NOTHING
    gone = {view.coordinator_node, *view.drains, *view.leaving}
    able = sorted(n for n in view.standby_stores & view.alive_nodes if n not in gone)
    if view.standby_node in able:
        return NOTHING  # no moves while it can serve: one copy written, not one per launcher
    first = min((n for n in view.nodes if n != view.coordinator_node), default=None)
    if view.state == JobState.STARTING and first not in able:
        return NOTHING  # while the job starts, node 1 (--standby-addr) comes first
    if able:
        return (Appoint(able[0]),)
    # The standby's node is gone and none other serves a store: none now.
    return NOTHING if view.standby_node is None else (Appoint(None),)


def why_node_differs(
    view: JobView, node: int, nproc: int, world_size: Optional[int]
) -> Optional[str]:
    """Why a node's launcher, started for another job size, cannot take
    part (its workers would wait for a world that never forms), or None."""
    if (nproc, world_size) == (view.nproc, view.planned_size):
        return None
    return (
        f"node {node}'s launcher was started with --nproc-per-node {nproc} and --nnodes "
        f"{(world_size or 0) // max(1, nproc)}, node 0's with {view.nproc} and "
        f"{view.planned_size // view.nproc}: start every node's launcher with the same --nnodes, "
        "--nproc-per-node and --spare-nodes"
    )


def why_not_join(view: JobView, node: int, nproc: int) -> Optional[str]:
    """Why a node registering with ``deadpool-launch --join`` as ``node``
    is refused, or None. An index is free when no node had it or every
    slot of the node it named was lost."""
    if nproc != view.nproc:
        return f"it runs {nproc} ranks per node, the job {view.nproc}"
    lost = all(slot in view.lost_slots for slot in view.slots_of(node))
    if node in view.nodes and not lost:
        return f"node {node} is still part of the job"
    return None
