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

from typing import Optional

from deadpool_ext.policy.view import JobView


def why_no_quorum(view: JobView) -> Optional[str]:
    """Why no decision may be made (a majority of the nodes alive at the
    last one is lost), or None."""
    alive = view.alive_nodes & view.quorum_nodes
    if 2 * len(alive) > len(view.quorum_nodes):
        return None
    return (
        f"only nodes {sorted(alive)} of {sorted(view.quorum_nodes)} are alive: with a "
        "standby coordinator a decision needs a majority of them (a network partition "
        "looks like this); resume from the last --save checkpoint"
    )


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
