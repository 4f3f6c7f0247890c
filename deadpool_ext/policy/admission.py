"""Who may take part: launchers, joining nodes, and the majority a decision needs.

It judges a node's launcher started for another job size, a node that joins
a running job (``deadpool-launch --join``), and the majority a decision
needs when a standby coordinator could take over.

Why a majority: a primary that is only cut off from some nodes keeps
coordinating the others. It stops deciding once it hears from no more than
half of the nodes alive at its last decision, and the standby starts only
with more than half of them (control/standby.py), so the two never both
decide.
"""

from typing import AbstractSet, Optional

from deadpool_ext.defaults import TAKEOVER_WAIT_S
from deadpool_ext.policy.effects import NOTHING, Effects, Fence, Majority
from deadpool_ext.policy.view import JobView, Superseded


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
    that hears (heartbeats not silent) no majority of the nodes alive at the
    last decision is cut off: it declares nobody lost and decides nothing,
    since the other side may be the majority, whose standby takes over. It
    goes on once it hears a majority again (a partition that healed before
    anyone came over to the standby). Its side leaves the job (``Fence``)
    once it learns that the standby took over, or once it was cut off for
    longer than the standby waits for a majority to come over."""
    if view.news_of(Superseded):
        return (Fence("the standby took over while this coordinator was cut off"),)
    if not view.guards_quorum or view.sighting is None:
        return NOTHING
    heard = view.alive_nodes - set(view.sighting.silent_nodes)
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
