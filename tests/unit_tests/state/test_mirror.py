"""The mirror (deadpool_ext/state/mirror.py) without processes: halt()
abandons a worker stuck in an exchange, and the next one goes on."""

import pytest

from deadpool_ext.state import snapshot as snap


def test_halt_abandons_a_worker_stuck_in_an_exchange(tmp_path):
    """A worker waiting on a send that gloo never fails (test_generation.py)
    is abandoned by halt(); when its wait ends at last, it leaves the
    mirror's state alone, and the next worker goes on."""
    import threading
    import time

    from deadpool_ext.events import EventLog, read_events
    from deadpool_ext.state.mirror import Mirror, MirrorError, MirrorGroups

    layout = snap.ShardLayout(segments=[], numel=4, sidecar_capacity=64)
    mirror = Mirror(
        None,
        layout,
        rank=0,
        buddy=1,
        owner=1,
        groups=MirrorGroups(None, None),
        events=EventLog(str(tmp_path / "events.jsonl"), 0),
    )
    stuck, ran = threading.Event(), []

    def run(iteration, *job):
        ran.append(iteration)
        if iteration == 1:
            stuck.wait()  # the queued send, until the group's timeout
            raise RuntimeError("Timed out waiting for the send")

    mirror._run = run
    mirror.allocate()
    mirror.start(1, {})
    time.sleep(0.1)
    with pytest.raises(MirrorError, match="abandoned"):
        mirror.halt(timeout_s=0.2)
    mirror.wait_idle()  # nothing is pending any more
    mirror.resume(0)
    mirror.start(2, {})
    mirror.wait_idle()
    stuck.set()  # the abandoned wait ends with its error
    time.sleep(0.3)
    assert mirror.error is None and mirror._pending == 0
    assert not read_events(str(tmp_path / "events.jsonl"))  # no mirror_failed
    mirror.start(3, {})
    mirror.wait_idle()
    assert ran == [1, 2, 3]
    mirror.close()
