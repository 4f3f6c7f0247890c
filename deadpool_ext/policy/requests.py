"""What an operator may ask of a running job (deadpool-ctl drain and stop,
or an agent whose node Slurm marked DRAIN), and why a request is refused."""

from typing import Optional

from deadpool_ext.policy.view import JobView
from deadpool_ext.protocol import JobState

ENDING = (JobState.STOPPING, JobState.ABORTED)


def why_no_drain(view: JobView, node: Optional[int]) -> Optional[str]:
    """Why ``node`` cannot be drained, or None: it will be."""
    if view.finished or view.state in ENDING or view.stop_request:
        return "the job is ending"
    if node not in view.nodes:
        return f"no node {node} in this job (its nodes: {list(view.nodes)})"
    if node not in view.alive_nodes:
        return f"node {node} is no longer part of the job"
    return None


def why_no_stop(view: JobView) -> Optional[str]:
    if view.finished or view.state in ENDING:
        return "the job is ending already"
    return None


def drain_accepted(node: int) -> str:
    return f"node {node} leaves the job at the next iteration boundary"


def stop_accepted(view: JobView) -> str:
    if view.plan is not None and not view.plan.saves:
        return "the job ends at the next iteration boundary; it has no --save: nothing is saved"
    return "the job saves a checkpoint at the next iteration boundary and ends"
