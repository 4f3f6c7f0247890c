"""Which node is slow: each rank's compute time per iteration (forward and
backward, without the waits for peers: rank/hooks.py's ``ComputeClock``)
comes with its heartbeats as the median over its last iterations; a node
whose ranks' median takes ``factor`` times the other nodes' median is a
straggler (the median, not the slowest rank: one rank's noise must not make
a node slow, and a rank that is really slow holds up its tensor-parallel
peers on the same node inside its layers, whose times then count too).
Pure (no I/O): the coordinator feeds it and acts on what it says.

Why a node's *compute* time and not its step time: a slow rank holds up
every data-parallel peer at the gradient reduction, so every rank's step
takes as long as the slowest's; only the time before the waits tells the
slow one apart (as Megatron-LM's --log-straggler and NVIDIA's straggler
detector also time the compute of each rank)."""

import statistics
from dataclasses import dataclass
from typing import Dict, List, Optional, Tuple


@dataclass(frozen=True)
class Straggler:
    node: int
    compute_s: float  # its ranks' median compute time per iteration
    others_s: float  # the other nodes' median of the same
    ratio: float
    iteration: int  # the last iteration its figures include


class StragglerWatch:
    def __init__(self, factor: float, window: int):
        """``factor`` 0: no watch."""
        self.factor, self.window = factor, window
        self.times: Dict[str, Tuple[int, float, int]] = {}  # slot -> (node, seconds, iteration)
        self.found: Dict[int, Straggler] = {}  # the stragglers of the last judgement

    def observe(self, slot: str, node: int, compute: dict) -> None:
        """A rank's beat: its median over ``compute["count"]`` iterations,
        taken once it covers the whole window."""
        if compute.get("count", 0) >= self.window and compute.get("seconds") is not None:
            self.times[slot] = (node, float(compute["seconds"]), int(compute["iteration"]))

    def node_times(self) -> Dict[int, Tuple[float, int]]:
        """node -> the median of its ranks' times and the last iteration they
        count, for the nodes with a rank's window (in one pass: the
        coordinator judges every heartbeat look)."""
        by_node: Dict[int, List[Tuple[float, int]]] = {}
        for node, seconds, iteration in self.times.values():
            by_node.setdefault(node, []).append((seconds, iteration))
        return {
            node: (statistics.median(s for s, _ in ranks), max(i for _, i in ranks))
            for node, ranks in by_node.items()
        }

    def node_time(self, node: int) -> Optional[float]:
        """The median of the node's ranks' times (None before one has a window)."""
        return self.node_times().get(node, (None, 0))[0]

    def judge(self) -> Dict[int, Straggler]:
        """The stragglers now: each node against the median of the others."""
        per_node = self.node_times()
        found = {}
        for node, (seconds, last) in per_node.items():
            others = [t for n, (t, _) in per_node.items() if n != node]
            if self.factor == 0 or not others:
                continue
            typical = statistics.median(others)
            if typical > 0 and seconds > self.factor * typical:
                found[node] = Straggler(node, seconds, typical, round(seconds / typical, 2), last)
        return found

    def newly_found(self) -> List[Straggler]:
        """The stragglers not found at the last judgement (a node that
        recovers and slows again is said again)."""
        found = self.judge()
        new = [s for n, s in sorted(found.items()) if n not in self.found]
        self.found = found
        return new

    def keep_only(self, slots) -> None:
        """Forget the times of processes that hold no rank any more (lost,
        drained, or a spare that took a rank elsewhere)."""
        self.times = {slot: t for slot, t in self.times.items() if slot in slots}
