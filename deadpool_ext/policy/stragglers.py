"""Which node is slow: one whose ranks compute ``factor`` times slower than the other nodes'.

Each rank's compute time per iteration (forward and backward, without the
waits for peers: rank/hooks.py's ``ComputeClock``) comes with its heartbeats
as the median over its last iterations; a node whose ranks' median takes
``factor`` times the other nodes' median is a straggler (the median, not the
slowest rank: one rank's noise must not make a node slow, and a rank that is
really slow holds up its tensor-parallel peers on the same node inside its
layers, whose times then count too).
Pure (no I/O): the coordinator's view holds the times, a trigger judges.

Why a node's *compute* time and not its step time: a slow rank holds up
every data-parallel peer at the gradient reduction, so every rank's step
takes as long as the slowest's; only the time before the waits tells the
slow one apart (as Megatron-LM's --log-straggler and NVIDIA's straggler
detector also time the compute of each rank)."""

import bisect
import statistics
from typing import Dict, Iterable, List, Mapping, Tuple

from deadpool_ext.policy.view import Straggler
from deadpool_ext.protocol import parse_slot

NodeTimes = Dict[int, Tuple[float, int]]  # node -> (its ranks' median seconds, last iteration)


def node_times(compute: Mapping[str, dict], slots: Iterable[str], window: int) -> NodeTimes:
    """Each node's time from its ranks' last beats (``compute``: slot -> the
    median seconds over ``count`` iterations, up to ``iteration``), counting
    only ``slots`` (the live members) whose median covers the whole window."""
    by_node: Dict[int, List[Tuple[float, int]]] = {}
    for slot in slots:
        beat = compute.get(slot)
        if beat and beat.get("count", 0) >= window and beat.get("seconds") is not None:
            entry = (float(beat["seconds"]), int(beat["iteration"]))
            by_node.setdefault(parse_slot(slot)[0], []).append(entry)
    return {
        node: (statistics.median(s for s, _ in ranks), max(i for _, i in ranks))
        for node, ranks in by_node.items()
    }


def judge(times: NodeTimes, factor: float) -> Dict[int, Straggler]:
    """The stragglers now: each node against the median of the others
    (``factor`` 0: no watch). The nodes' times are sorted once; each node's
    "others" median is then read off that order without it."""
    if factor == 0 or len(times) < 2:
        return {}
    ordered = sorted(seconds for seconds, _ in times.values())
    found = {}
    for node, (seconds, last) in times.items():
        typical = median_without(ordered, seconds)
        if typical > 0 and seconds > factor * typical:
            found[node] = Straggler(node, seconds, typical, round(seconds / typical, 2), last)
    return found


def median_without(ordered: List[float], value: float) -> float:
    """The median of ``ordered`` (sorted, two or more) with one ``value``
    taken out, as ``statistics.median`` gives it."""
    gone = bisect.bisect_left(ordered, value)

    def rest(k: int) -> float:
        return ordered[k] if k < gone else ordered[k + 1]

    size = len(ordered) - 1
    if size % 2:
        return rest(size // 2)
    return (rest(size // 2 - 1) + rest(size // 2)) / 2
