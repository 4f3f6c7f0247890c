"""Which nodes a cut of the data network has taken: those their peers cannot reach.

A node whose links to its peers are cut, while its line to the store is
not, beats on: the heartbeat rules see nothing, and every rank waits in a
collective until the groups' own timeout (ten minutes by default) ends
the job. Its peers' kernels know sooner: data sent to the node's host stays
unacknowledged. Each training rank's beat names the peer hosts that have
left its data unacknowledged (``silent``, rank/client.py) and its own
address on its groups' connections (``host``).

A wait of the heartbeat timeout between two nodes makes a cut pair. The
nodes taken are as few as cover every cut pair, the one in most pairs
first: one node cut off from all others is in every pair, so it alone is
taken; where two nodes only are cut from each other, the later one (node
0 keeps the coordinator's host). Pure (no I/O): the coordinator's view
holds the beats, a trigger judges.

What it cannot see: a cut that leaves no data waiting (the node's peers
only wait to receive), and connections a group makes after it was built
(gloo's lazy pairs), which a rank does not look at; NCCL over InfiniBand
opens no TCP connection for its data, so there its own timeout still
decides.
"""

from collections import Counter
from typing import Dict, FrozenSet, Iterable, List, Mapping, Set

from deadpool_ext.policy.view import Progress
from deadpool_ext.protocol import parse_slot

Pair = FrozenSet[int]


def nodes_by_host(slots: Iterable[str], progress: Mapping[str, Progress]) -> Dict[str, Set[int]]:
    """Address -> the nodes whose ranks beat it as their own."""
    found: Dict[str, Set[int]] = {}
    for slot in slots:
        host = progress[slot].host if slot in progress else None
        if isinstance(host, str):
            found.setdefault(host, set()).add(parse_slot(slot)[0])
    return found


def cut_pairs(
    slots: Iterable[str], progress: Mapping[str, Progress], timeout_s: float
) -> Set[Pair]:
    """Pairs of nodes between which a connection of one of ``slots`` waited
    ``timeout_s`` for an acknowledgement. An address that several nodes
    share (nodes on one host) names none of them."""
    slots = list(slots)
    hosts = nodes_by_host(slots, progress)
    pairs: Set[Pair] = set()
    for slot in slots:
        silent = progress[slot].silent if slot in progress else {}
        node = parse_slot(slot)[0]
        for host, waited in silent.items() if isinstance(silent, Mapping) else ():
            peers = hosts.get(host, set())
            if len(peers) == 1 and _seconds(waited) >= timeout_s and node not in peers:
                pairs.add(frozenset((node, *peers)))
    return pairs


def cut_off(pairs: Iterable[Pair], suspected: Iterable[Pair] = ()) -> List[int]:
    """The fewest nodes, greedily, that are in every pair: the node in the
    most pairs first, counting the ``suspected`` ones too (the waits not yet
    of the timeout: a cut's pairs cross it one by one), the later node on a
    tie."""
    left = set(pairs)
    hints = set(suspected) | left
    taken: List[int] = []
    while left:
        count = Counter(node for pair in hints for node in pair)
        candidates = {node for pair in left for node in pair}
        node = max(candidates, key=lambda n: (count[n], n))
        taken.append(node)
        left = {pair for pair in left if node not in pair}
        hints = {pair for pair in hints if node not in pair}
    return sorted(taken)


def partners(node: int, pairs: Iterable[Pair]) -> List[int]:
    """The nodes cut from ``node``."""
    return sorted({other for pair in pairs if node in pair for other in pair if other != node})


def _seconds(value) -> float:
    return float(value) if isinstance(value, (int, float)) else 0.0
