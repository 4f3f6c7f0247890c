"""Who mirrors whom: pure rank arithmetic, tested without processes.

Megatron numbers ranks with tensor parallelism fastest, then data
parallelism, then pipeline stages: ``rank = tp + TP * (dp + DP * pp)``; with
``--use-tp-pp-dp-mapping`` pipeline stages come before data parallelism:
``rank = tp + TP * (pp + PP * dp)``, so each DP replica fills whole nodes.
The data-parallel ranks that share a (tp, pp) position hold the same model
shard and differently placed optimizer shards, so they form a ring, and
each rank mirrors its optimizer shard to a ring peer on another node: its
*buddy*. ``Grid`` holds the order; megatron-core's ``RankGenerator`` makes
the same one (tests/unit_tests/test_topology.py checks it).

The buddy map is one uniform shift along every ring: rank i of a ring sends
to rank (i + s) mod DP, with s the smallest shift that puts every buddy on
another node. A uniform shift is a permutation, so each rank also holds
exactly one peer's mirror, and memory per rank stays one shard.

An MoE model's expert parameters are sharded over the expert-data-parallel
group instead (the ranks holding the same experts: megatron-core's expert
grid orders ranks expert-TP fastest, then EP, then expert-DP and PP), a
part of each DP ring. Buddies are kept within that group where it has a
member on another node (a shift that is a multiple of EP in Megatron's
default order): a shrink drops whole expert-parallel blocks, and the buddy
of a lost rank is then in a block that stays. Otherwise (expert-DP 1) any
DP peer holds the snapshot, which a hot swap restores as it is.
"""

import math
from dataclasses import dataclass
from typing import Dict, List, Optional, Sequence, Tuple


class BuddyError(ValueError):
    """No valid buddy layout; the message says what to change."""


def rank_of(
    tp: int, dp: int, pp: int, tp_size: int, dp_size: int, pp_size: int, tp_pp_dp: bool = False
) -> int:
    if tp_pp_dp:
        return tp + tp_size * (pp + pp_size * dp)
    return tp + tp_size * (dp + dp_size * pp)


def dp_rings(
    world_size: int, tp_size: int, pp_size: int, tp_pp_dp: bool = False
) -> List[List[int]]:
    """The data-parallel groups, each in DP-rank order, ordered by (pp, tp)."""
    if world_size % (tp_size * pp_size):
        raise BuddyError(f"world size {world_size} is not divisible by TP {tp_size} x PP {pp_size}")
    dp_size = world_size // (tp_size * pp_size)
    return [
        [rank_of(tp, dp, pp, tp_size, dp_size, pp_size, tp_pp_dp) for dp in range(dp_size)]
        for pp in range(pp_size)
        for tp in range(tp_size)
    ]


@dataclass(frozen=True)
class Experts:
    """An MoE job's expert layout: expert-tensor- and expert-parallel sizes."""

    etp: int
    ep: int


def expert_dp_groups(
    world_size: int, experts: Experts, pp_size: int, tp_pp_dp: bool = False
) -> List[Tuple[int, int, int]]:
    """Per rank, which expert-data-parallel group it is in, as its (expert
    TP, EP, PP) coordinates: megatron-core's expert rank order (the dense
    order with EP inserted after TP)."""
    etp, ep = experts.etp, experts.ep
    edp = world_size // (etp * ep * pp_size)
    groups = []
    for rank in range(world_size):
        t, rest = rank % etp, rank // etp
        e, rest = rest % ep, rest // ep
        p = rest // edp if not tp_pp_dp else rest % pp_size
        groups.append((t, e, p))
    return groups


def shrink_unit(tp_size: int, experts: Experts) -> int:
    """How many consecutive DP replicas one expert-parallel block (expert TP
    x EP ranks holding each expert once) spans: a shrink that drops them
    together leaves every kept rank its experts."""
    return math.lcm(tp_size, experts.etp * experts.ep) // tp_size


def ring_shift(
    rings: Sequence[Sequence[int]],
    node_of: Optional[Sequence[str]],
    group_of: Optional[Sequence[object]] = None,
) -> Optional[int]:
    """Smallest shift s in 1..DP-1 with every ring[i] and ring[i+s] on
    different nodes (unless ``node_of`` is None) and in the same group
    (given ``group_of``), or None if there is none."""
    dp_size = len(rings[0])
    for shift in range(1, dp_size):
        pairs = [(ring[i], ring[(i + shift) % dp_size]) for ring in rings for i in range(dp_size)]
        if (node_of is None or all(node_of[a] != node_of[b] for a, b in pairs)) and (
            group_of is None or all(group_of[a] == group_of[b] for a, b in pairs)
        ):
            return shift
    return None


@dataclass(frozen=True)
class BuddyMap:
    """buddy[r]: who holds r's mirror; owner[r]: whose mirror r holds."""

    buddy: Dict[int, int]
    owner: Dict[int, int]
    shift: int
    same_node: bool  # True when some buddy shares its owner's node
    # MoE: some buddy holds other experts than its owner (no peer with the
    # same experts on another node): a hot swap restores the snapshot as it
    # is, but a shrink cannot re-cut those experts from it.
    experts_apart: bool = False


def buddy_map(
    world_size: int,
    tp_size: int,
    pp_size: int,
    node_of: Sequence[str],
    allow_same_node: bool = False,
    tp_pp_dp: bool = False,
    experts: Optional[Experts] = None,
) -> BuddyMap:
    """The mirror layout of a job, or BuddyError saying why there is none."""
    if len(node_of) != world_size:
        raise BuddyError(f"{len(node_of)} node names for {world_size} ranks")
    rings = dp_rings(world_size, tp_size, pp_size, tp_pp_dp)
    dp_size = len(rings[0])
    if dp_size < 2:
        raise BuddyError(
            "--deadpool needs data-parallel size >= 2 (a buddy holds a DP peer's optimizer "
            f"shard), but TP {tp_size} x PP {pp_size} uses all {world_size} ranks: launch "
            "more ranks or lower --tensor-model-parallel-size / --pipeline-model-parallel-size"
        )
    group_of = None if experts is None else expert_dp_groups(world_size, experts, pp_size, tp_pp_dp)
    shift = ring_shift(rings, node_of, group_of) if group_of else None
    if shift is None:  # no peer holding the same experts on another node
        shift = ring_shift(rings, node_of)
    same_node = shift is None
    if same_node:
        if not allow_same_node:
            raise BuddyError(
                f"--deadpool found no buddy on another node for every rank (nodes: "
                f"{', '.join(sorted(set(node_of)))}; data-parallel peers of some rank all "
                "share its node): use --use-tp-pp-dp-mapping so DP replicas fill whole "
                "nodes, run on more nodes so each DP ring spans two, or accept same-node "
                "buddies with --deadpool-allow-same-node-buddy (a node failure then loses state)"
            )
        shift = (ring_shift(rings, None, group_of) if group_of else None) or 1
    buddy = {ring[i]: ring[(i + shift) % dp_size] for ring in rings for i in range(dp_size)}
    owner = {b: r for r, b in buddy.items()}
    apart = group_of is not None and any(group_of[r] != group_of[b] for r, b in buddy.items())
    return BuddyMap(buddy, owner, shift, same_node, experts_apart=apart)


def nodes_by_block(world_size: int, ranks_per_node: int) -> List[str]:
    """Node names when each node hosts a contiguous block of ranks (torchrun,
    srun with one task per GPU, and the launcher's emulated nodes)."""
    return [f"node{r // ranks_per_node}" for r in range(world_size)]


@dataclass(frozen=True)
class Grid:
    """A job's TP x PP x DP layout and Megatron's rank order."""

    tp: int
    pp: int
    dp: int
    tp_pp_dp: bool = False

    @property
    def world_size(self) -> int:
        return self.tp * self.pp * self.dp

    def rank(self, tp: int, dp: int, pp: int) -> int:
        return rank_of(tp, dp, pp, self.tp, self.dp, self.pp, self.tp_pp_dp)

    def coords(self, rank: int) -> Tuple[int, int, int]:
        """(tp, dp, pp) of a rank."""
        tp, rest = rank % self.tp, rank // self.tp
        if self.tp_pp_dp:
            return tp, rest // self.pp, rest % self.pp
        return tp, rest % self.dp, rest // self.dp

    def replica(self, rank: int) -> int:
        return self.coords(rank)[1]

    def with_dp(self, dp: int) -> "Grid":
        return Grid(self.tp, self.pp, dp, self.tp_pp_dp)
