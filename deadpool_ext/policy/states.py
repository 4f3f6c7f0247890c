"""The job's states (``JobState``, published in ``gen``) and the only moves
between them (``NEXT``): the coordinator refuses any other as its own bug.

  STARTING -> TRAINING -> RECOVERING (a loss: the survivors report)
                       -> GROWING (spares fill a replica: everyone reports)
                       -> DRAINING (nodes asked to leave, or a stop asked
                          for: everyone reports at its iteration's end)
  RECOVERING / GROWING / DRAINING
                       -> REBUILDING (a swap decided) -> TRAINING
                                     (a stop decided) -> STOPPING
                       -> RESIZING (a shrink or grow decided) -> TRAINING
                                   (a checkpoint decided) -> STOPPING
  any -> ABORTED (no decision can keep the job)

A loss while RECOVERING, GROWING, DRAINING or REBUILDING opens the next
generation (RECOVERING again; a drain or stop asked for waits for the next
TRAINING); while RESIZING or STOPPING it ends the job: the survivors'
snapshots are of the old layout, which no decision could combine with the
new one.
"""

from deadpool_ext.protocol import JobState

S = JobState
NEXT = {
    S.STARTING: {S.TRAINING, S.RECOVERING, S.ABORTED},
    S.TRAINING: {S.RECOVERING, S.GROWING, S.DRAINING, S.ABORTED},
    S.RECOVERING: {S.RECOVERING, S.REBUILDING, S.RESIZING, S.ABORTED},
    S.GROWING: {S.RECOVERING, S.REBUILDING, S.RESIZING, S.ABORTED},
    S.DRAINING: {S.RECOVERING, S.REBUILDING, S.RESIZING, S.ABORTED},
    S.REBUILDING: {S.TRAINING, S.RECOVERING, S.STOPPING, S.ABORTED},
    S.RESIZING: {S.TRAINING, S.STOPPING, S.ABORTED},
    S.STOPPING: {S.ABORTED},
    S.ABORTED: set(),
}
COLLECTING = (S.RECOVERING, S.GROWING, S.DRAINING)  # members report for a decision
BUILDING = (S.REBUILDING, S.RESIZING)  # a decision is carried out
# Every rank stops at its iteration's end, not within an iteration.
AT_BOUNDARY = (S.GROWING, S.DRAINING)
# A loss now cannot be combined with the decision being carried out.
UNRECOVERABLE = (S.RESIZING, S.STOPPING)
