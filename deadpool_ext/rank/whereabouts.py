"""Where this process's main thread is, read from its Python stack by the
heartbeat thread: computing, communicating (in a collective, a send, a
receive or a wait on one) or checkpointing. The coordinator's progress
watch tells a hung rank (it computes and never finishes its iteration) from
the peers that wait for it (they communicate)."""

import linecache
import sys
from typing import Iterator, Optional

from deadpool_ext.protocol import Where

# Files whose frames are a checkpoint (its collectives included).
CHECKPOINT_FILES = (
    "/megatron/core/dist_checkpointing/",
    "/torch/distributed/checkpoint/",
    "/megatron/training/checkpointing.py",
    "/megatron/training/saving.py",
    "/megatron/training/legacy_checkpoint.py",
)
# Files whose innermost frame is communication.
COMMUNICATION_FILES = (
    "/torch/distributed/",
    "/megatron/core/pipeline_parallel/p2p_communication.py",
    "/megatron/core/tensor_parallel/mappings.py",
    "/megatron/core/distributed/",
    "/deadpool_ext/state/mirror.py",
)


def frames(frame) -> Iterator:
    """A stack from its innermost frame outwards."""
    while frame is not None:
        yield frame
        frame = frame.f_back


def where(thread_id: int) -> Optional[Where]:
    """Where thread ``thread_id`` is now (None: it has no Python frame)."""
    top = sys._current_frames().get(thread_id)
    if top is None:
        return None
    stack = list(frames(top))
    if any(_in(f, CHECKPOINT_FILES) for f in stack):
        return Where.CHECKPOINT
    if _in(top, COMMUNICATION_FILES) or ".wait(" in _line(top):
        # megatron-core waits on an asynchronous collective's handle from
        # its own layers (handle.wait()): that too is waiting on a peer.
        return Where.COMMUNICATION
    return Where.COMPUTE


def _in(frame, files) -> bool:
    name = frame.f_code.co_filename
    return any(part in name for part in files)


def _line(frame) -> str:
    # The thread runs on while it is read: a frame between two lines has no
    # line number (f_lineno None), which linecache refuses.
    lineno = frame.f_lineno
    return "" if lineno is None else linecache.getline(frame.f_code.co_filename, lineno)
