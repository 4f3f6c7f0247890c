"""The job that the store-driven coordinator tests drive by hand.

test_coordinator.py, test_standby.py and test_operations.py build it: a
coordinator on a real store with a fake clock, looking at the heartbeats at
every step, and a worker's channel on the same store that posts rank 0's
plan, the spares' readiness and the ranks' reports.

By default: two nodes of two ranks (TP1 x PP1 x DP4, each rank's buddy and
owner on the other node), a spare node whose slots 2.0 and 2.1 are ready, a
3 s heartbeat timeout, no wait for spares and an abort when they run out.
"""

import math
from typing import Sequence

from deadpool_ext.control.coordinator import Coordinator
from deadpool_ext.control.ports import free_port
from deadpool_ext.protocol import CoordinatorSettings
from deadpool_ext.wire import Channel, connect

SECRET = b"test-secret"
BUDDY = [2, 3, 0, 1]  # 2 nodes x 2 ranks, DP peers on the other node
SPARES = ("2.0", "2.1")


class Clock:
    def __init__(self):
        self.now = 100.0

    def __call__(self):
        return self.now


def settings(on_spares_exhausted="abort", spare_wait=0.0, heartbeat_timeout=3.0, **more):
    """The coordinator's --deadpool settings in these tests."""
    return CoordinatorSettings(
        heartbeat_timeout=heartbeat_timeout,
        spare_wait=spare_wait,
        on_spares_exhausted=on_spares_exhausted,
        **more,
    )


def new_store():
    return connect("127.0.0.1", free_port(), timeout_s=10, is_master=True)


def coordinator_on(store, clock, job_settings=None, spare_nodes=1, nproc=2, **kwargs):
    """A coordinator of two nodes on ``store`` that looks at every step."""
    coordinator = Coordinator(
        Channel(store, SECRET),
        nnodes=2,
        spare_nodes=spare_nodes,
        nproc=nproc,
        settings=job_settings or settings(),
        clock=clock,
        **kwargs,
    )
    coordinator.detector.every_s = 0.0
    # These tests move the clock by hand between steps: no step is late
    # because the coordinator was paused, unless a test says so.
    coordinator.clock.pause_after_s = math.inf
    return coordinator


def start(worker: Channel, coordinator: Coordinator, spares=SPARES, pp=1, tp_pp_dp=False):
    """Rank 0's plan (TP1, PP ``pp``) and the spares' readiness, taken in."""
    post_plan(worker, pp, tp_pp_dp)
    for slot in spares:
        worker.post("coordinator", kind="spare_ready", slot=slot)
    coordinator.step()


def post_plan(worker: Channel, pp: int, tp_pp_dp: bool) -> None:
    plan = dict(gen=0, buddy=BUDDY, owner=BUDDY, tp=1, pp=pp, tp_pp_dp=tp_pp_dp)
    worker.post("coordinator", kind="plan", **plan)


def reports(worker: Channel, gen: int, ranks: Sequence[int], own=(5, 4), held=None, members=None):
    """Each rank's report of generation ``gen``, from its slot in
    ``members`` (by default its first one), holding ``held`` (``own``)."""
    for rank in ranks:
        worker.post(
            "coordinator",
            kind="report",
            gen=gen,
            rank=rank,
            slot=members[rank] if members else f"{rank // 2}.{rank % 2}",
            own=list(own),
            held=list(own if held is None else held),
        )
