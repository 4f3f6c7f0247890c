"""Who is who in a job: each rank's slot, the spares, the slots lost,
released or exited, the nodes that joined. Pure bookkeeping (no I/O and no
rules): the coordinator changes it as messages come, the rules read it
through the job's view, and the standby holds it as part of the job's
record (record.py)."""

from dataclasses import dataclass, field
from typing import Any, Dict, List, Optional, Set, Tuple

from deadpool_ext.control.gpu_health import GpuReading
from deadpool_ext.policy.effects import Note, note
from deadpool_ext.protocol import slot_name


@dataclass
class Membership:
    nnodes: int  # as launched
    spare_nodes: int
    nproc: int  # ranks per node
    members: Dict[int, str]  # rank -> slot
    world_size: int
    world: Optional[Dict[str, Any]] = None  # size and rank nodes after a shrink
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
    # decision needs a majority of them (policy/admission.py says why).
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

    def to_watch(self) -> Tuple[List[int], List[str], List[str]]:
        """Whose heartbeats a look reads: every node; the live members and
        spares; and the slots nothing is known to run in (warming spares)."""
        watched = list(self.members.values()) + list(self.spares)
        busy = set(watched) | self.lost_slots | self.released
        alive = [slot for slot in watched if slot not in self.lost_slots]
        return self.nodes(), alive, [slot for slot in self.every_slot() if slot not in busy]

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

    def admit(self, node: int) -> List[str]:
        """A joining node's slots, no longer lost (their workers start as spares)."""
        slots = self.slots_of(node)
        self.lost_slots.difference_update(slots)
        self.joined_nodes.add(node)
        self.quorum_nodes.add(node)
        return slots

    def spare_ready(self, slot: str) -> Tuple[Note, ...]:
        """A spare says it is ready: one whose GPU has a problem is kept out
        of the ready spares (withheld) until a later reading is clean."""
        if not self.is_new_spare(slot):
            return ()
        problems = self.gpu_problems(slot)
        if problems:
            self.withheld.add(slot)
            return (note("spare_withheld", slot=slot, problems=problems),)
        self.spares.append(slot)
        return (note("spare_ready", slot=slot, spares=len(self.spares)),)

    def read_gpus(self, readings: Dict[str, GpuReading]) -> Tuple[Note, ...]:
        """An agent read its workers' GPUs (gpu_health.py): a reading whose
        problems changed is said; a spare with a problem is withheld, and a
        withheld one reading clean is ready again."""
        said: List[Note] = []
        for slot, reading in readings.items():
            before = self.gpus.get(slot)
            self.gpus[slot] = reading
            problems = reading.problems()
            if before is None or before.problems() != problems:
                body = reading.to_dict()
                said.append(
                    note(
                        "gpu_health",
                        slot=slot,
                        gpu=reading.summary(),
                        problems=problems,
                        reading=body,
                    )
                )
            if problems and slot in self.spares:
                self.spares.remove(slot)
                self.withheld.add(slot)
                said.append(note("spare_withheld", slot=slot, problems=problems))
            elif not problems and slot in self.withheld:
                self.withheld.discard(slot)
                said += self.spare_ready(slot)
        return tuple(said)
