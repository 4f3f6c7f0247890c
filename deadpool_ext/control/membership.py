"""Who is who in a job: each rank's slot, the spares, the slots lost,
released or exited, the nodes that joined. Pure bookkeeping (no I/O): the
coordinator changes it as messages come, the policy reads a frozen view of
it, and the standby holds its copy as one dict (``to_dict``)."""

from dataclasses import dataclass, field
from typing import Dict, List, Optional, Set

from deadpool_ext.control.gpu_health import GpuReading
from deadpool_ext.protocol import slot_name


@dataclass
class Membership:
    nnodes: int  # as launched
    spare_nodes: int
    nproc: int  # ranks per node
    members: Dict[int, str]  # rank -> slot
    world_size: int
    world: Optional[dict] = None  # size and rank nodes after a shrink
    spares: List[str] = field(default_factory=list)  # ready spare slots, in order
    lost_slots: Set[str] = field(default_factory=set)
    # Each slot's GPU as its agent last read it, and the ready spares kept
    # out of ``spares`` because their GPU has a problem (gpu_health.py).
    gpus: Dict[str, GpuReading] = field(default_factory=dict)
    withheld: Set[str] = field(default_factory=set)
    released: Set[str] = field(default_factory=set)  # slots whose replica a shrink dropped
    exited: Set[str] = field(default_factory=set)  # slots whose process exit an agent reported
    joined_nodes: Set[int] = field(default_factory=set)  # came with deadpool-launch --join
    # The nodes alive at the last decision: with a standby coordinator, a
    # decision needs a majority of them (standby.py says why).
    quorum_nodes: Set[int] = field(default_factory=set)

    @classmethod
    def launched(cls, nnodes: int, spare_nodes: int, nproc: int) -> "Membership":
        """Rank r on node r // nproc; the spare nodes' slots come as spares once ready."""
        world_size = nnodes * nproc
        members = {r: slot_name(r // nproc, r % nproc) for r in range(world_size)}
        view = cls(nnodes, spare_nodes, nproc, members, world_size)
        view.quorum_nodes = set(view.nodes())
        return view

    @property
    def planned_size(self) -> int:
        """The launched world, which a shrunk job grows back towards."""
        return self.nnodes * self.nproc

    def gpu_problems(self, slot: str) -> List[str]:
        reading = self.gpus.get(slot)
        return reading.problems() if reading is not None else []

    def rank_of(self, slot: str) -> Optional[int]:
        return next((r for r, s in self.members.items() if s == slot), None)

    def holds(self, rank: int, slot: str) -> bool:
        return self.members.get(rank) == slot and slot not in self.lost_slots

    def nodes(self) -> List[int]:
        return sorted(set(range(self.nnodes + self.spare_nodes)) | self.joined_nodes)

    def slots_of(self, node: int) -> List[str]:
        return [slot_name(node, i) for i in range(self.nproc)]

    def every_slot(self) -> List[str]:
        return [slot for node in self.nodes() for slot in self.slots_of(node)]

    def alive_nodes(self) -> Set[int]:
        lost = self.lost_slots
        return {n for n in self.nodes() if not all(s in lost for s in self.slots_of(n))}

    def why_no_quorum(self) -> Optional[str]:
        """Why no decision may be made (a majority of the nodes alive at the
        last one is lost), or None."""
        alive = self.alive_nodes() & self.quorum_nodes
        if 2 * len(alive) > len(self.quorum_nodes):
            return None
        return (
            f"only nodes {sorted(alive)} of {sorted(self.quorum_nodes)} are alive: with a "
            "standby coordinator a decision needs a majority of them (a network partition "
            "looks like this); resume from the last --save checkpoint"
        )

    def why_node_differs(self, node: int, nproc: int, world_size: Optional[int]) -> Optional[str]:
        """Why a node's launcher, started for another job size, cannot take
        part (its workers would wait for a world that never forms), or None."""
        if (nproc, world_size) == (self.nproc, self.planned_size):
            return None
        return (
            f"node {node}'s launcher was started with --nproc-per-node {nproc} and --nnodes "
            f"{(world_size or 0) // max(1, nproc)}, node 0's with {self.nproc} and "
            f"{self.nnodes}: start every node's launcher with the same --nnodes, "
            "--nproc-per-node and --spare-nodes"
        )

    def is_new_spare(self, slot: str) -> bool:
        """Neither lost, nor a spare already, nor a member."""
        known = slot in self.lost_slots or slot in self.spares
        return not known and self.rank_of(slot) is None

    def lose(self, slots: List[str]) -> Set[int]:
        """Mark ``slots`` lost (those not lost already): the ranks they held."""
        self.lost_slots.update(slots)
        self.spares = [s for s in self.spares if s not in slots]
        self.withheld -= set(slots)
        return {r for r in map(self.rank_of, slots) if r is not None}

    def note_exit(self, slot: str) -> bool:
        """An agent saw ``slot``'s process end: whether it was released (left
        on a shrink; its agent starts a spare there)."""
        self.exited.add(slot)
        if slot in self.released:
            self.released.discard(slot)
            return True
        if self.rank_of(slot) is None and slot in self.spares:
            self.spares.remove(slot)
        self.withheld.discard(slot)
        return False

    def why_not_join(self, node: int, nproc: int) -> Optional[str]:
        """Why a node registering with ``deadpool-launch --join`` as ``node``
        is refused, or None. An index is free when no node had it or every
        slot of the node it named was lost."""
        if nproc != self.nproc:
            return f"it runs {nproc} ranks per node, the job {self.nproc}"
        slots = self.slots_of(node)
        if node in self.nodes() and not all(s in self.lost_slots for s in slots):
            return f"node {node} is still part of the job"
        return None

    def admit(self, node: int) -> List[str]:
        """A joining node's slots, no longer lost (their workers start as spares)."""
        slots = self.slots_of(node)
        self.lost_slots.difference_update(slots)
        self.joined_nodes.add(node)
        self.quorum_nodes.add(node)
        return slots

    def read_gpu(self, slot: str, reading: GpuReading) -> bool:
        """Keep ``slot``'s GPU reading: whether its problems changed."""
        before = self.gpus.get(slot)
        self.gpus[slot] = reading
        return before is None or before.problems() != reading.problems()

    def to_dict(self) -> dict:
        return {
            "nnodes": self.nnodes,
            "spare_nodes": self.spare_nodes,
            "nproc": self.nproc,
            "members": {str(r): slot for r, slot in self.members.items()},
            "world_size": self.world_size,
            "world": self.world,
            "spares": list(self.spares),
            "lost_slots": sorted(self.lost_slots),
            "gpus": {slot: reading.to_dict() for slot, reading in self.gpus.items()},
            "withheld": sorted(self.withheld),
            "released": sorted(self.released),
            "exited": sorted(self.exited),
            "joined_nodes": sorted(self.joined_nodes),
            "quorum_nodes": sorted(self.quorum_nodes),
        }

    @classmethod
    def from_dict(cls, d: dict) -> "Membership":
        return cls(
            d["nnodes"],
            d["spare_nodes"],
            d["nproc"],
            {int(r): slot for r, slot in d["members"].items()},
            d["world_size"],
            d["world"],
            list(d["spares"]),
            set(d["lost_slots"]),
            {slot: GpuReading.from_dict(body) for slot, body in d["gpus"].items()},
            set(d["withheld"]),
            set(d["released"]),
            set(d["exited"]),
            set(d["joined_nodes"]),
            set(d["quorum_nodes"]),
        )
