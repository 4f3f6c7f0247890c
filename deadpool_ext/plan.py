"""The coordinator's decision after a failure, as pure rank arithmetic.

Input: who is lost, what every other rank reported holding (the iterations
of its own verified snapshots and of the verified copies it holds for its
owner), the buddy map and the spare slots. Output: a new generation with a
spare at each lost rank's id, the iteration everyone rolls back to, and where
each rank's state comes from; or the reason the job must stop.
"""

from dataclasses import dataclass, field
from typing import Dict, List, Optional, Sequence, Set

from deadpool_ext.control import parse_slot


@dataclass
class Report:
    """What a live rank can restore from, sent during a recovery."""

    rank: int
    slot: str
    own: List[int]   # iterations of its own verified snapshots
    held: List[int]  # iterations of its owner's verified snapshots it holds


@dataclass
class Decision:
    gen: int
    action: str                      # "recover" or "abort"
    reason: str = ""
    rollback_to: Optional[int] = None  # the iteration everyone restarts (0-based start)
    members: Dict[int, str] = field(default_factory=dict)   # rank -> slot
    replaced: Dict[int, str] = field(default_factory=dict)  # rank -> spare slot taking it
    from_buddy: List[int] = field(default_factory=list)     # ranks restored from the buddy
    warnings: List[str] = field(default_factory=list)
    # A shrink ("shrink") renumbers the survivors of the kept replicas into a
    # smaller world; every old shard comes from one contributor.
    renumber: Dict[int, int] = field(default_factory=dict)  # old rank -> new rank
    sources: Dict[int, List] = field(default_factory=dict)  # old rank -> [old rank, own|held]
    released: List[str] = field(default_factory=list)       # live slots that leave
    old_dp: int = 0
    new_dp: int = 0

    @property
    def world_size(self) -> int:
        return len(self.members)

    def rank_of(self, slot: str) -> Optional[int]:
        return next((r for r, s in self.members.items() if s == slot), None)

    def to_message(self) -> dict:
        return {"gen": self.gen, "action": self.action, "reason": self.reason,
                "rollback_to": self.rollback_to,
                "members": {str(r): s for r, s in self.members.items()},
                "replaced": {str(r): s for r, s in self.replaced.items()},
                "from_buddy": self.from_buddy, "warnings": self.warnings,
                "renumber": {str(o): n for o, n in self.renumber.items()},
                "sources": {str(o): src for o, src in self.sources.items()},
                "released": self.released, "old_dp": self.old_dp, "new_dp": self.new_dp}

    @classmethod
    def from_message(cls, body: dict) -> "Decision":
        return cls(gen=body["gen"], action=body["action"], reason=body["reason"],
                   rollback_to=body["rollback_to"],
                   members={int(r): s for r, s in body["members"].items()},
                   replaced={int(r): s for r, s in body["replaced"].items()},
                   from_buddy=list(body["from_buddy"]), warnings=list(body["warnings"]),
                   renumber={int(o): int(n) for o, n in body.get("renumber", {}).items()},
                   sources={int(o): list(src) for o, src in body.get("sources", {}).items()},
                   released=list(body.get("released", [])),
                   old_dp=body.get("old_dp", 0), new_dp=body.get("new_dp", 0))


def abort(gen: int, reason: str, members: Dict[int, str]) -> Decision:
    return Decision(gen=gen, action="abort", reason=reason, members=dict(members))


def choose_spares(lost: Sequence[int], spares: Sequence[str], members: Dict[int, str],
                  buddy: Sequence[int], owner: Sequence[int]) -> tuple:
    """A spare slot for each lost rank, avoiding the nodes of its buddy and its
    owner (so that one node never holds a rank and its only copy). Spares
    are taken node by node, so a lost node is replaced by one spare node."""
    free = sorted(spares, key=parse_slot)
    chosen: Dict[int, str] = {}
    warnings: List[str] = []
    for rank in sorted(lost):
        avoid = {parse_slot(members[r])[0] for r in (buddy[rank], owner[rank])
                 if r not in lost and r in members}
        good = [s for s in free if parse_slot(s)[0] not in avoid]
        used = {parse_slot(s)[0] for s in chosen.values()}
        # Fill a spare node already taken in this decision before another.
        pick = sorted(good or free, key=lambda s: (parse_slot(s)[0] not in used,
                                                   parse_slot(s)))[0]
        if not good:
            warnings.append(f"rank {rank}'s spare shares a node with its buddy or owner")
        free.remove(pick)
        chosen[rank] = pick
    return chosen, warnings


def rollback_iteration(reports: Dict[int, Report], needs_buddy: Set[int],
                       buddy: Sequence[int]) -> Optional[int]:
    """The newest iteration every rank can restore: from its own snapshot, or
    (for the ranks in ``needs_buddy``) from the copy its buddy holds."""
    candidates: Optional[Set[int]] = None
    for rank, report in reports.items():
        if rank in needs_buddy:
            continue
        candidates = set(report.own) if candidates is None else candidates & set(report.own)
    for rank in needs_buddy:
        held = set(reports[buddy[rank]].held)
        candidates = held if candidates is None else candidates & held
    return max(candidates) if candidates else None


def decide(gen: int, members: Dict[int, str], lost: Set[int], reports: Dict[int, Report],
           spares: Sequence[str], buddy: Sequence[int], owner: Sequence[int]) -> Decision:
    """members: rank -> slot before the failure; lost: ranks without a live
    process; reports: from every other rank."""
    for rank in sorted(lost):
        if buddy[rank] in lost:
            return abort(gen, f"rank {rank} and its buddy rank {buddy[rank]} were both lost: "
                         f"no copy of rank {rank}'s optimizer shard is left", members)
    if len(spares) < len(lost):
        return abort(gen, f"spares exhausted: {len(lost)} rank(s) lost "
                     f"({', '.join(map(str, sorted(lost)))}), {len(spares)} spare process(es) "
                     "left", members)
    missing = [r for r in members if r not in lost and r not in reports]
    if missing:
        raise ValueError(f"no report from ranks {missing}")
    # A rank whose process is new (a spare assigned in an interrupted
    # recovery) reports no own snapshot: it also needs its buddy's copy.
    needs_buddy = set(lost) | {r for r, rep in reports.items() if not rep.own}
    for rank in sorted(needs_buddy - set(lost)):
        if buddy[rank] in needs_buddy:
            return abort(gen, f"rank {rank} and its buddy rank {buddy[rank]} both lost their "
                         "state in consecutive failures", members)
    iteration = rollback_iteration(reports, needs_buddy, buddy)
    if iteration is None:
        return abort(gen, "no iteration that every rank can restore: own snapshots "
                     f"{ {r: rep.own for r, rep in sorted(reports.items())} }, held copies "
                     f"{ {buddy[r]: reports[buddy[r]].held for r in sorted(needs_buddy)} }",
                     members)
    replaced, warnings = choose_spares(sorted(lost), spares, members, buddy, owner)
    new_members = dict(members)
    new_members.update(replaced)
    return Decision(gen=gen, action="recover", rollback_to=iteration, members=new_members,
                    replaced=replaced, from_buddy=sorted(needs_buddy), warnings=warnings)
