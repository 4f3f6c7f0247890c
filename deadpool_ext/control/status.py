"""The job as others see it: deadpool-ctl status, Prometheus metrics, a decision's log line.

The status and the metrics are one dict read off the coordinator's record,
its current generation and its last look at the heartbeats. Nothing is
judged here."""

import dataclasses
from typing import Dict, List

from deadpool_ext.control.record import JobRecord, Round, Watch
from deadpool_ext.policy.stragglers import node_times
from deadpool_ext.protocol import Decision, parse_slot


def status(record: JobRecord, round_: Round, watch: Watch, seen, rejected: int) -> dict:
    """``seen``: the detector (its last look and each rank's compute times);
    ``rejected``: the requests refused (unsigned, forged or malformed)."""
    m = record.membership
    progress = record.progress()
    members = [s for s in m.members.values() if s not in m.lost_slots]
    times = node_times(seen.compute, members, record.settings.straggler_window)
    return {
        "state": record.state.value,
        "generation": record.gen,
        "iteration": min(progress.values(), default=None),
        "world_size": m.world_size,
        "planned_world_size": m.planned_size,
        "members": {str(r): slot for r, slot in sorted(m.members.items())},
        "spares": {"ready": list(m.spares), "warming": sorted(seen.last.warming)},
        "nodes": nodes(record, round_, times),
        "recoveries": dict(record.recoveries),
        "last_recovery": None
        if record.last_recovery is None
        else dataclasses.asdict(record.last_recovery),
        "stragglers": {str(n): dataclasses.asdict(s) for n, s in sorted(watch.stragglers.items())},
        "drains_pending": {str(n): why for n, why in sorted(record.drains.items())},
        "stop_requested": record.stop_request,
        "rejected_requests": rejected,
        # Which node's launcher coordinates (term: the takeovers so far) and
        # which one is the standby now (None: none).
        "coordinator": {"node": record.coordinator_node, "term": record.term},
        "standby_node": record.standby_node,
    }


def nodes(record: JobRecord, round_: Round, times: Dict) -> Dict[str, dict]:
    """Each node's role, ranks and compute time per iteration."""
    m = record.membership
    by_node: Dict[int, List[int]] = {}
    for rank, slot in sorted(m.members.items()):
        by_node.setdefault(parse_slot(slot)[0], []).append(rank)
    alive, found = m.alive_nodes(), {}
    for node in m.nodes():
        ranks = by_node.get(node, [])
        role = "active" if ranks else "spare"
        if node in round_.leaving or node in record.drains:
            role = "draining"
        elif node in record.drained_nodes:
            role = "drained"
        elif node not in alive:
            role = "lost"
        found[str(node)] = {
            "role": role,
            "ranks": ranks,
            "compute_s": times.get(node, (None, 0))[0],
        }
    return found


def decision_event(decision: Decision, spares_left: int) -> dict:
    """A decision as the event log says it."""
    joined = {str(r): s for r, s in decision.replaced.items()}
    if decision.action.resizes:
        details = dict(
            dp_before=decision.old_dp,
            dp_after=decision.new_dp,
            world_size=decision.world_size,
            released=decision.released,
            joined=joined,
        )
    else:
        details = dict(replaced=joined, from_buddy=decision.from_buddy)
    return dict(
        action=decision.action,
        reason=decision.reason,
        drained=decision.drained,
        stop=decision.stop,
        rollback_to=decision.rollback_to,
        warnings=decision.warnings,
        spares_left=spares_left,
        groups_kept=len(decision.kept),
        gpus=decision.gpus,
        withheld=decision.withheld,
        **details,
    )
