"""Where a worker's main thread is, as its heartbeats tell the coordinator's
progress watch (deadpool_ext/rank/whereabouts.py)."""

import linecache
import threading
import time

import pytest

from deadpool_ext.protocol import Where
from deadpool_ext.rank import whereabouts


def blocked_in(source: str, filename: str):
    """A thread blocked in ``source``'s ``block(event)``, as if it lived in ``filename``."""
    scope = {"time": time}
    exec(compile(source, filename, "exec"), scope)
    # Its lines, as Python would read them from the file.
    linecache.cache[filename] = (len(source), None, source.splitlines(True), filename)
    event = threading.Event()
    thread = threading.Thread(target=scope["block"], args=(event,), daemon=True)
    thread.start()
    time.sleep(0.1)
    return thread, event


@pytest.mark.parametrize(
    "filename, source, expected",
    [
        # A kernel or driver call that never returns: computing.
        ("/x/megatron/core/transformer/mlp.py", "def block(e):\n    e.wait()\n", Where.COMPUTE),
        # In torch.distributed's wrapper of a collective: communicating.
        (
            "/x/torch/distributed/distributed_c10d.py",
            "def block(e):\n    while not e.is_set(): time.sleep(0.01)\n",
            Where.COMMUNICATION,
        ),
        # megatron-core waiting on an asynchronous collective from its own layer.
        (
            "/x/megatron/core/tensor_parallel/layers.py",
            "class H:\n    wait = staticmethod(time.sleep)\n"
            "def block(e):\n    handle = H()\n    handle.wait(0.5)\n",
            Where.COMMUNICATION,
        ),
        # Anything under a save counts as the checkpoint, its collectives too.
        (
            "/x/megatron/training/saving.py",
            "def block(e):\n    while not e.is_set(): time.sleep(0.01)\n",
            Where.CHECKPOINT,
        ),
    ],
)
def test_a_thread_is_placed_by_its_stack(filename, source, expected):
    thread, event = blocked_in(source, filename)
    try:
        assert whereabouts.where(thread.ident) == expected
    finally:
        event.set()
        thread.join()
    assert whereabouts.where(thread.ident) is None  # gone


def test_a_frame_between_two_lines_is_read_without_failing():
    """A live frame can have no line number (f_lineno None) when the heartbeat
    thread reads it: that killed the heartbeat thread in a CI run."""

    class Code:
        co_filename = "/x/megatron/core/transformer/mlp.py"

    class Frame:
        f_code, f_lineno, f_back = Code(), None, None

    assert whereabouts._line(Frame()) == ""
