"""What a failure inside a worker means, and so what the worker does.

  * PEER: another process, node or the network failed: a collective or the
    mirror broke, the coordinator announced a new generation, a copy that
    came over the network does not verify. The worker recovers.
  * LOCAL: this process cannot go on (its device ran out of memory or
    failed). It exits with ``ExitCode.LOCAL_FAILURE``; the coordinator
    replaces it like any lost rank, from its buddy's copy.
  * NUMERIC: its loss or local gradient norm went NaN or Inf (megatron-core's
    validation under --check-for-nan-in-loss-and-grad). With --deadpool-on-nan
    rollback every rank goes back to the iteration's start and redoes it;
    with stop the job stops (``ExitCode.NUMERIC``), as Megatron-LM's check.
    So is a silent data corruption (``SilentCorruption``: copies that must
    agree differ); the coordinator decides by --deadpool-on-sdc.
  * USAGE: a check of the flags that needs the running job (the buddies
    planned from the real hostnames): the flags must change, so the job
    stops with ``ExitCode.USAGE``, as for flags refused before it started.
  * BUG: anything else. Recovering would only meet it again (a spare runs
    the same code), so the job stops with the full traceback and exit code
    ``ExitCode.BUG``.

Only text leaves an ``except`` block that caught a failure: the traceback's
frames hold references to the old process groups, which must be freed.
"""

import traceback
from enum import Enum

import torch
import torch.distributed as dist
from megatron.training.arguments import ConfigError

from deadpool_ext.protocol import ExitCode
from deadpool_ext.rank.generation import FailureAnnounced
from deadpool_ext.state.digest import SilentCorruption
from deadpool_ext.state.mirror import MirrorError
from deadpool_ext.state.snapshot import SnapshotError


class WorkerExit(Exception):
    """This process leaves the job with ``code``; only the worker's main
    (``rank/main.py:run``) exits, once the event log is closed."""

    def __init__(self, code: ExitCode, reason: str):
        super().__init__(reason)
        self.code = code


class Failure(str, Enum):
    PEER = "peer"
    LOCAL = "local"
    NUMERIC = "numeric"
    USAGE = "usage"
    BUG = "bug"


PEER_TYPES = (
    FailureAnnounced,
    MirrorError,
    SnapshotError,
    ConnectionError,
    TimeoutError,
    dist.DistError,
)
# torch raises a broken transport as a plain RuntimeError: gloo's pair
# (what every failure_seen event of the fault campaign showed) and NCCL's.
PEER_MESSAGES = (
    "gloo/transport",
    "Connection closed by peer",
    "Connection reset by peer",
    "Broken pipe",
    "NCCL communicator was aborted",
    "NCCL error",
)
LOCAL_TYPES = (torch.OutOfMemoryError, MemoryError)
LOCAL_MESSAGES = (
    "CUDA error",
    "out of memory",
    "uncorrectable ECC error",
    "unhandled cuda error",  # NCCL's word for a CUDA call of its own that failed
)
# NCCL refusing how it is called (two ranks on one GPU, mismatched calls):
# raised as a DistBackendError like a broken peer, but a spare would meet it
# again, so it is a bug, not a failure to recover from.
BUG_MESSAGES = ("ncclInvalidUsage",)


# megatron-core's rerun state machine rejecting a result (disabled mode).
NUMERIC_MESSAGES = ("message='found NaN in ", "message='found Inf in ")


def classify(error: BaseException) -> Failure:
    text = str(error)
    if isinstance(error, ConfigError):
        return Failure.USAGE
    if isinstance(error, LOCAL_TYPES) or any(m in text for m in LOCAL_MESSAGES):
        return Failure.LOCAL
    if any(m in text for m in BUG_MESSAGES):
        return Failure.BUG
    if isinstance(error, SilentCorruption):
        return Failure.NUMERIC
    if isinstance(error, RuntimeError) and any(m in text for m in NUMERIC_MESSAGES):
        return Failure.NUMERIC
    if isinstance(error, PEER_TYPES):
        return Failure.PEER
    if isinstance(error, RuntimeError) and any(m in text for m in PEER_MESSAGES):
        return Failure.PEER
    return Failure.BUG


def summary(error: BaseException) -> str:
    """One line for logs and events: the type and the whole message."""
    return f"{type(error).__name__}: {error}"


def traceback_text(error: BaseException) -> str:
    return "".join(traceback.format_exception(error))
