"""Who is alive, from heartbeats: the agents' (one per node) and the workers'.

The detector only observes: each ``look`` reads the heartbeat keys and says
which nodes fell silent, which workers hang on a node that still beats, what
state every watched worker last gave, and which slots are still starting.
The coordinator decides what a silence means for the job.
"""

from typing import Dict, Iterable, List, Optional, Set, Tuple

from deadpool_ext import protocol as P
from deadpool_ext.policy.view import Progress, Sighting
from deadpool_ext.protocol import parse_slot
from deadpool_ext.wire import Channel


class Detector:
    def __init__(
        self,
        channel: Channel,
        timeout_s: float,
        iterations: Dict[str, int],
        every_s: float = 0.25,
    ):
        """``iterations``: where each slot's last iteration goes (the
        job's record keeps it). ``every_s``: how often ``due`` lets a look
        happen. Heartbeats change slowly; reading every key on every poll
        would slow the coordinator's reaction to exits, which matter more."""
        self.channel, self.timeout_s = channel, timeout_s
        self.every_s, self.looked_at = every_s, float("-inf")
        self.seen: Dict[str, tuple] = {}  # key -> (seq, local time seen)
        self.iterations = iterations  # slot -> the iteration it last beat in
        self.progress: Dict[str, Progress] = {}  # slot -> its main thread's progress
        # slot -> its compute time per iteration as its last beat gave it
        # (median seconds over its recent iterations, how many, up to which).
        self.compute: Dict[str, dict] = {}
        self.last = Sighting()  # the last look's

    def due(self, now: float) -> bool:
        return now - self.looked_at >= self.every_s

    def look(
        self, nodes: Iterable[int], watched: Iterable[str], idle: Iterable[str], now: float
    ) -> Sighting:
        """``nodes``: every node of the job; ``watched``: the live members'
        and spares' slots; ``idle``: the slots nothing is known to run in."""
        silent: List[int] = []
        beating: Set[int] = set()
        for node in nodes:
            body, stale = self.heartbeat(P.node_heartbeat_key(node), now)
            if stale:
                silent.append(node)
            elif body is not None:
                beating.add(node)
        hung: List[str] = []
        states: Dict[str, Optional[str]] = {}
        for slot in watched:
            body, stale = self.worker(slot, now)
            states[slot] = (body or {}).get("state")
            if stale and self.node_beats(parse_slot(slot)[0], now):
                hung.append(slot)
        warming = tuple(slot for slot in idle if self.starting(slot, beating, now))
        heard = frozenset(node for node in nodes if self.node_beats(node, now))
        sighting = Sighting(tuple(silent), tuple(hung), states, warming, frozenset(beating), heard)
        self.last, self.looked_at = sighting, now
        return sighting

    def starting(self, slot: str, beating_nodes: Set[int], now: float) -> bool:
        """A process that will report ready (imports, device, data): beating
        in the state "starting", or not beating yet on a node whose agent
        beats (the agent started it; early in a job a spare may still be
        importing when a failure comes)."""
        body, stale = self.worker(slot, now)
        if body is None:
            return parse_slot(slot)[0] in beating_nodes
        return not stale and body.get("state") == P.WorkerState.STARTING

    def node_beats(self, node: int, now: float) -> bool:
        """Whether a node's agent beat within half the timeout. On a cluster a
        dead node is seen only through heartbeats, its agent's and its
        workers' stopping together: a silent worker on a silent node is not
        hung, and the node's own timeout (due within the other half) takes
        all its ranks in one generation instead of one per worker."""
        last = self.seen.get(P.node_heartbeat_key(node))
        return last is None or now - last[1] <= self.timeout_s / 2

    def worker(self, slot: str, now: float) -> Tuple[Optional[dict], bool]:
        """``heartbeat`` of a worker; records the iteration it beat in."""
        body, stale = self.heartbeat(P.worker_heartbeat_key(slot), now)
        if body is not None and body.get("iteration") is not None:
            self.iterations[slot] = body["iteration"]
        if body is not None:
            self.progress.setdefault(slot, Progress()).observe(body, now)
            if body.get("compute") is not None:
                self.compute[slot] = body["compute"]
        return body, stale

    def heartbeat(self, key: str, now: float) -> Tuple[Optional[dict], bool]:
        """A key's last beat (None before the first), and whether it has
        stopped beating for the timeout. Only an authentic value newer than
        the last is a beat (the channel keeps replayed and forged values
        out), so a node whose beats are replayed or overwritten is as
        silent as a dead one."""
        body, version = self.channel.get(key), self.channel.version(key)
        last = self.seen.get(key)
        if body is None:  # expected since ``expect``, or not yet
            return None, last is not None and now - last[1] > self.timeout_s
        if last is None or last[0] != version:
            self.seen[key] = (version, now)
            return body, False
        if body.get("state") == P.WorkerState.DONE:
            return body, False
        return body, now - last[1] > self.timeout_s

    def restart(self, now: float) -> None:
        """Every beat seen counts as seen ``now``: whoever has not beaten
        since is silent only a whole timeout from now."""
        for key, (version, _) in self.seen.items():
            self.seen[key] = (version, now)

    def expect(self, nodes: Iterable[int], slots: Iterable[str], since: float) -> None:
        """A coordinator that took over expects every process to beat on its
        store: one that has not beaten the timeout after ``since`` is silent."""
        keys = [P.node_heartbeat_key(n) for n in nodes] + [P.worker_heartbeat_key(s) for s in slots]
        for key in keys:
            self.seen.setdefault(key, (None, since))

    def forget(self, node: int, slots: List[str]) -> None:
        """A node that joins again: its old beats are stale, and the new
        processes' sequence starts again."""
        for key in [P.node_heartbeat_key(node)] + [P.worker_heartbeat_key(s) for s in slots]:
            self.seen.pop(key, None)
            self.channel.forget(key)
        for slot in slots:
            self.progress.pop(slot, None)
            self.compute.pop(slot, None)
