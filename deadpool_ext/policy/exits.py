"""What an exit, a silence or a stall means for the job: what stops it, whom to kill, whom not.

Pure functions of its state that say which exits stop it, which members to
kill (from the heartbeats the detector read), and which must not be killed
because they hold the only copy of a shard.

Failure detection, fastest first:
  1. an agent sees its worker exit and reports it at once;
  2. the launcher sees an emulated node's agent exit (standalone);
  3. a node's heartbeats stop for --deadpool-heartbeat-timeout (node lost);
  4. a worker's heartbeats stop for the same timeout (a hang: its agent is
     told to SIGKILL it, which turns it into case 1 for its peers);
  5. a member still training STUCK_KILL_TIMEOUTS heartbeat timeouts after a
     failure was announced (stuck where no release reached it): killed too
     (``stuck``);
  6. a training member computing for --deadpool-progress-timeout without
     finishing its iteration while a peer waits on it (``hung_computing``).
Survivors blocked in a collective are released by their own heartbeat
thread, which shuts the old generation's connections down as soon as it
reads a newer generation (rank/generation.py, Generation.release_if_older);
case 5 is the bound behind it.
"""

from typing import Dict, List, Mapping, Optional, Sequence, Set, Tuple

from deadpool_ext import protocol as P
from deadpool_ext.policy.view import Exited, Progress
from deadpool_ext.protocol import ExitCode


def why_an_exit_stops_the_job(m: Exited, rank: Optional[int]) -> Optional[str]:
    """An exit no spare could undo, said with what to do; None for a loss."""
    who = f"slot {m.slot} (rank {rank})"
    if m.code == ExitCode.USAGE:  # every process runs the same flags
        return f"{who} refused its flags: " + (m.reason or "see its 'error:' line above").strip()
    if m.code == ExitCode.BUG:  # a spare runs the same code and would meet it again
        return (
            f"{who} stopped on a programming error"
            + (f" ({m.reason})" if m.reason else "")
            + "; its traceback is in its log. Fix it and resume from the last --save checkpoint"
        )
    if m.code == ExitCode.NUMERIC:
        return f"rank {rank}'s loss or gradients went NaN or Inf (--deadpool-on-nan stop): " + (
            m.reason or "see its log"
        )
    return None


def exit_as_loss(code: int) -> str:
    known = code in ExitCode._value2member_map_
    return f"process exited with code {code}" + (f" ({ExitCode(code).name})" if known else "")


def only_copies(
    members: Mapping[int, str], lost: Set[int], buddy: Optional[Sequence[int]]
) -> Dict[int, str]:
    """Live members whose loss would leave an optimizer shard with no copy
    (a lost rank's, held by its buddy; or their own, when their buddy is
    lost): rank -> why."""
    if buddy is None:
        return {}
    found = {}
    for rank in sorted(members):
        mirror = buddy[rank]
        if rank in lost and mirror not in lost:
            found[mirror] = f"holds the only copy of lost rank {rank}'s optimizer shard"
        elif rank not in lost and mirror in lost:
            found.setdefault(rank, f"its optimizer shard's copy was lost with rank {mirror}")
    return found


def hung_computing(
    members: Mapping[int, str],
    states: Mapping[str, Optional[str]],
    progress: Mapping[str, Progress],
    timeout_s: float,
    now: float,
) -> List[str]:
    """Training members whose main thread has computed for ``timeout_s``
    without finishing its iteration while a peer waits on it in
    communication: blocked where their own heartbeat thread cannot tell (a
    driver call, a kernel that never ends)."""
    training = [
        slot
        for slot in members.values()
        if states.get(slot) == P.WorkerState.TRAINING and slot in progress
    ]
    if not timeout_s or not any(progress[s].waiting(now) >= timeout_s / 2 for s in training):
        return []
    return [s for s in training if progress[s].computing_without_progress(now) >= timeout_s]


def stuck(
    members: Mapping[int, str],
    lost: Set[int],
    reported: Set[int],
    states: Mapping[str, Optional[str]],
    copies: Mapping[int, str],
) -> Tuple[List[int], Dict[int, str]]:
    """Members still training after a failure was announced, that neither
    reported nor stopped: (those to kill, those kept because killing them
    would lose state: rank -> why; their wait ends at the groups' timeout)."""
    found = [
        rank
        for rank, slot in sorted(members.items())
        if rank not in lost and rank not in reported and states.get(slot) == P.WorkerState.TRAINING
    ]
    kept = {rank: copies[rank] for rank in found if rank in copies}
    return [rank for rank in found if rank not in kept], kept
