"""What the end of the job says: its exit code, and what is said once no rank trains any more.

That is the drains it never reached, the NaN redos every rank finished, a
stop or a checkpoint carried out."""

from typing import List, Tuple

from deadpool_ext.policy.effects import DropDrain, Effects, note
from deadpool_ext.policy.triggers import redos_finished
from deadpool_ext.policy.view import JobView
from deadpool_ext.protocol import ExitCode


def at_end(view: JobView) -> Tuple[int, Effects]:
    """The launcher's exit code and the last effects."""
    why = "the job ended before an iteration boundary was reached"
    effects: List = [DropDrain(node, why) for node in sorted(set(view.drains) | set(view.leaving))]
    if view.fenced is not None:  # its side of a partition left: the other side decides
        return ExitCode.FENCED, ()
    if len(view.done) < view.world_size:
        return ExitCode.FAILED, tuple(effects)
    effects += redos_finished(view, view.train_iters or 0)
    stopping = view.stopping
    if stopping is None:
        return ExitCode.OK, tuple(effects)
    effects.append(note("stopped", reason=stopping.reason, iteration=stopping.rollback_to))
    # Asked for (deadpool-ctl stop): the job ended as it should.
    return (ExitCode.OK if stopping.stop else ExitCode.STOPPED_WITH_CHECKPOINT), tuple(effects)
