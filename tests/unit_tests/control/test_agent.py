"""A node's agent (deadpool_ext/control/agent.py), in-process: it announces
its node before any worker starts, gives its workers NCCL error handling
that lets them recover, reads its GPUs (against the fake NVML of
tests/common/fake_nvml) and tells the coordinator when a verdict changes,
and asks once per Slurm DRAIN marking to drain its node (scontrol's text is
given, never run)."""

import time
import types

import pytest

from deadpool_ext import protocol as P
from deadpool_ext.control import slurm_state
from deadpool_ext.control.agent import Agent
from deadpool_ext.control.gpu_health import GpuReading, NvmlReader
from deadpool_ext.protocol import GpuHealth, WorkerEnv
from tests.unit_tests.control.test_slurm_state import (
    DRAINED_IDLE,
    DRAINING_ALLOCATED,
    DRAINING_MIXED,
    IDLE,
)


def test_an_agent_announces_its_node_before_any_worker_starts():
    """A joining node's spares, forked from a warm zygote, can say they are
    ready within milliseconds; the coordinator reads its topic in order and
    ignores readiness from a slot it still counts as lost, so the node's
    announcement must come first (a grow once waited forever for a spare)."""
    import types

    from deadpool_ext.control.agent import Agent

    order = []
    agent = types.SimpleNamespace(
        node=1, active=False, nproc=2, join=True, nonce="n1", world_size=4, standby_store=None
    )
    agent.channel = types.SimpleNamespace(
        post=lambda topic, message: order.append(message.KIND),
        put=lambda key, **body: order.append((key, body)),
    )
    agent.start_worker = lambda local, active: order.append(f"worker {local}")
    agent.check_gpus = lambda now: order.append("gpus")
    Agent.start(agent)
    # Its GPUs' health too: a spare whose GPU fails is never counted ready;
    # and a word that it stopped, left by its predecessor, no longer counts.
    unsaid = (P.stopping_key(1), {"pending": True})
    assert order == [unsaid, "node", "gpus", "worker 0", "worker 1"]


def test_workers_get_nccl_error_handling_that_lets_them_recover(monkeypatch, tmp_path):
    """torch's default ends a process whose NCCL communicator failed; a
    worker's environment says otherwise unless the user set it."""
    from deadpool_ext.control.agent import Agent

    agent = Agent.__new__(Agent)
    agent.node, agent.nproc, agent.world_size, agent.store_addr = 1, 2, 4, "h:1"
    agent.standby, agent.takeover_wait_s, agent.error_dir = None, 0.0, str(tmp_path)
    agent.first_standby = None
    agent.channel = types.SimpleNamespace(cut_off_s=3.0)
    monkeypatch.delenv("TORCH_NCCL_ASYNC_ERROR_HANDLING", raising=False)
    env = agent.worker_env(1, active=True)
    assert env["TORCH_NCCL_ASYNC_ERROR_HANDLING"] == "2" and env["RANK"] == "3"
    assert WorkerEnv.read(env).cut_off_s == 3.0  # its own lines are cut off as the agent's
    monkeypatch.setenv("TORCH_NCCL_ASYNC_ERROR_HANDLING", "1")
    assert agent.worker_env(1, active=True)["TORCH_NCCL_ASYNC_ERROR_HANDLING"] == "1"


def test_workers_started_before_a_generation_named_the_standby_know_node_1s(tmp_path):
    """A spare started at once (before the agent's first beat read a
    generation) that connects only after node 0 died must still find the
    standby: node 1's store, the one appointed first. Once a generation
    names the standby, that one is theirs."""
    from deadpool_ext.control.agent import Agent
    from deadpool_ext.protocol import WorkerEnv

    agent = Agent.__new__(Agent)
    agent.node, agent.nproc, agent.world_size, agent.store_addr = 2, 2, 4, "h0:1"
    agent.takeover_wait_s, agent.error_dir = 13.0, str(tmp_path)
    agent.standby, agent.first_standby = None, "h1:2"
    agent.channel = types.SimpleNamespace(cut_off_s=3.0)
    told = lambda: WorkerEnv.read(agent.worker_env(0, active=False))  # noqa: E731
    assert told().standby == "h1:2" and told().takeover_wait_s == 13.0
    agent.standby = "h3:7"  # appointed after node 1 was lost
    assert told().standby == "h3:7"


def test_a_coordinator_lost_while_workers_start_is_left_for_the_standby(tmp_path):
    """Node 0 dies while this node's zygote is still importing (its first
    worker not forked yet): the beat made while waiting fails. The agent
    turns to the standby as it does when serving, and starts the rest of
    its workers; with no standby it ends with COORDINATOR_LOST (no
    traceback, no orphan)."""
    import torch.distributed as dist

    from deadpool_ext.protocol import ExitCode

    def agent_losing_its_coordinator(standby_takes_over: bool):
        agent = Agent.__new__(Agent)
        agent.stopping, agent.workers, agent.error_dir = False, {}, str(tmp_path / "e")
        tried = []
        agent.said_stopping, agent.say_stopping = False, lambda: tried.append("said stopping")

        def beat_when_due():
            if not tried:
                raise dist.DistNetworkError("Connection reset by peer")

        def fail_over():
            tried.append("standby")
            return standby_takes_over

        def start_worker(local, active):
            agent.beat_or_fail_over()  # as the zygote's spawn calls it while waiting
            agent.workers[local] = types.SimpleNamespace(kill=lambda: tried.append("killed"))

        agent.beat_when_due, agent.fail_over, agent.start_worker = (
            beat_when_due,
            fail_over,
            start_worker,
        )
        agent.start = lambda: [agent.start_worker(local, False) for local in range(2)]
        agent.serve = lambda: agent.workers.clear()  # the workers end
        agent.declared_lost, agent.refused, agent.exit_codes = False, None, {}
        return agent, tried

    agent, tried = agent_losing_its_coordinator(standby_takes_over=True)
    assert agent.run_workers() == ExitCode.OK and tried == ["standby", "said stopping"]
    agent, tried = agent_losing_its_coordinator(standby_takes_over=False)
    assert agent.run_workers() == ExitCode.COORDINATOR_LOST and tried == ["standby"]


@pytest.mark.parametrize(
    "codes, ends", [((10, 10), P.ExitCode.FENCED), ((10, 0), P.ExitCode.OK)], ids=["all", "one"]
)
def test_workers_that_find_their_node_declared_lost_fence_their_agent(tmp_path, codes, ends):
    """A node cut off, declared lost and healed: its workers read a decision
    with no place for their slots and leave FENCED, maybe before the agent
    reads its KILL_ALL. The agent leaves FENCED too (its launcher stands
    down), saying why. The control: one worker fenced (a hung one declared
    lost on its own) while the other finished: the node was not."""
    posted = []
    agent = Agent.__new__(Agent)
    agent.node, agent.stopping, agent.leaving_by, agent.nonce = 2, False, None, None
    agent.declared_lost, agent.refused, agent.exit_codes = False, None, {}
    agent.error_dir, agent.said_stopping = str(tmp_path / "e"), False
    agent.commands = types.SimpleNamespace(poll=lambda: [])
    agent.channel = types.SimpleNamespace(
        post=lambda topic, message: posted.append(message),
        put=lambda key, **body: posted.append(key),
    )
    agent.written_reason = lambda slot: "no place for its slot"
    agent.start = lambda: None
    agent.workers = {
        f"2.{i}": types.SimpleNamespace(poll=lambda code=code: code) for i, code in enumerate(codes)
    }
    agent.serve = agent.watch_once
    assert agent.run_workers() == ends
    # Their exits, then that the agent is done with the store.
    assert [m.code for m in posted[:-1]] == list(codes) and posted[-1] == P.stopping_key(2)


# ----- its GPUs (the fake NVML) -----
def agent_on(nvml, node=2, nproc=2):
    posted = []
    agent = Agent.__new__(Agent)
    agent.node, agent.nproc = node, nproc
    agent.gpus, agent.gpu_verdicts, agent.next_gpu_check = NvmlReader(nvml), None, 0.0
    agent.channel = types.SimpleNamespace(post=lambda topic, message: posted.append(message))
    return agent, posted


def test_the_agent_tells_the_coordinator_when_a_verdict_changes(nvml):
    nvml.gpus([{}, {}])
    agent, posted = agent_on(nvml)
    agent.check_gpus(now=True)
    assert len(posted) == 1 and isinstance(posted[0], GpuHealth)
    assert sorted(posted[0].readings) == ["2.0", "2.1"]
    agent.check_gpus(now=True)  # nothing changed: nothing sent
    agent.check_gpus()  # not due yet
    assert len(posted) == 1
    nvml.gpus([{}, {"ecc_uncorrected": 5}])
    agent.check_gpus(now=True)
    assert len(posted) == 2
    assert GpuReading.from_dict(posted[1].readings["2.1"]).problems()


def test_a_check_that_breaks_stops_the_checks_not_the_agent(nvml, capsys):
    nvml.gpus([{}, {}])
    agent, posted = agent_on(nvml)

    def broken(handle):
        raise RuntimeError("the binding broke")

    nvml.nvmlDeviceGetHandleByIndex = broken
    agent.check_gpus(now=True)
    assert posted == [] and agent.gpus is None
    assert "GPU health checks stop: RuntimeError: the binding broke" in capsys.readouterr().err
    agent.check_gpus(now=True)  # and nothing more is read


def test_the_agent_reads_its_gpus_again_when_a_failure_is_announced(nvml):
    agent, posted = agent_on(nvml)
    agent.checked_failure_gen = None
    generations = iter([{"gen": 0, "state": "training"}, {"gen": 1, "state": "recovering"}])
    agent.channel.put = lambda *args, **kwargs: None
    agent.channel.get = lambda key: next(generations)
    agent.beat()
    assert posted == []
    agent.next_gpu_check = float("inf")  # not due: only the announcement reads
    agent.beat()
    assert len(posted) == 1


# ----- Slurm's DRAIN marking of its node -----
class FakeChannel:
    def __init__(self):
        self.posted = []

    def reader(self, topic):
        return None

    def post(self, topic, message):
        self.posted.append((topic, message))


def agent(tmp_path, slurm_node="node2"):
    return Agent(
        FakeChannel(),
        1,
        4,
        True,
        8,
        ["true"],
        "127.0.0.1:1",
        scratch=str(tmp_path),
        slurm_node=slurm_node,
    )


def drain_requests(a):
    return [m for topic, m in a.channel.posted if topic == P.CONTROL_TOPIC]


def test_the_agent_asks_once_per_drain_marking_for_its_own_node(tmp_path, capsys):
    a = agent(tmp_path)
    a.on_slurm_state(IDLE)
    assert drain_requests(a) == []
    a.on_slurm_state(DRAINING_MIXED)
    a.on_slurm_state(DRAINING_MIXED)
    a.on_slurm_state(None)  # scontrol failed: still marked as far as we know
    a.on_slurm_state(DRAINED_IDLE)
    (request,) = drain_requests(a)
    assert isinstance(request, P.ControlRequest)
    assert (request.request, request.node, request.by) == ("drain", 1, "slurm")
    assert request.reason == "Slurm marked node2 MIXED+DRAIN: admin check"
    assert request.nonce
    lines = capsys.readouterr().err.splitlines()
    assert lines == [
        "deadpool agent 1: Slurm marked node2 MIXED+DRAIN: admin check; asking to drain this node"
    ]
    # Resumed, then marked again: a new request.
    a.on_slurm_state(IDLE)
    a.on_slurm_state(DRAINING_ALLOCATED)
    assert [r.reason.split(": ", 1)[0] for r in drain_requests(a)] == [
        "Slurm marked node2 MIXED+DRAIN",
        "Slurm marked node2 ALLOCATED+DRAIN",
    ]
    assert len({r.nonce for r in drain_requests(a)}) == 2


def test_the_agent_reads_in_the_background_every_interval(tmp_path, monkeypatch):
    reads = []

    def read_node(name, timeout_s):
        reads.append(name)
        return DRAINED_IDLE

    monkeypatch.setattr(slurm_state, "read_node", read_node)
    a = agent(tmp_path)
    a.check_slurm()  # starts the first reading
    wait_until(lambda: a.slurm_reading.done())
    a.check_slurm()  # acts on it
    assert reads == ["node2"] and len(drain_requests(a)) == 1
    a.check_slurm()  # not due before the interval
    assert a.slurm_reading is None and reads == ["node2"]
    a.next_slurm_check = time.monotonic()
    a.check_slurm()
    wait_until(lambda: a.slurm_reading.done())
    a.check_slurm()
    assert reads == ["node2", "node2"] and len(drain_requests(a)) == 1


def test_an_agent_outside_slurm_reads_nothing(tmp_path, monkeypatch):
    monkeypatch.setattr(slurm_state, "read_node", lambda *args: pytest.fail("read"))
    a = agent(tmp_path, slurm_node=None)
    a.check_slurm()
    assert a.slurm_reading is None


def wait_until(done, timeout_s=5.0):
    deadline = time.monotonic() + timeout_s
    while not done():
        assert time.monotonic() < deadline, "the reading did not end"
        time.sleep(0.01)


def test_an_agent_whose_primary_answers_again_keeps_it_and_its_commands(monkeypatch):
    """Its line to the primary cut, it votes for the standby (next_coordinator
    casts the vote only where the standby can be reached, and a voter never
    goes back); a primary that answers again first keeps the agent, its
    commands read where they were."""
    from deadpool_ext.control import agent as agent_module

    asked = []

    def next_coordinator(lost, standby, wait_s, vote=None):
        asked.append((standby, vote))
        return lost  # the primary answers again

    monkeypatch.setattr(agent_module, "next_coordinator", next_coordinator)
    agent = Agent.__new__(Agent)
    agent.node, agent.store_addr, agent.takeover_wait_s = 2, "h0:1", 13.0
    agent.standby = "h1:2"
    agent.channel = types.SimpleNamespace(address=("h0", 1), secret=b"s")
    agent.commands = commands = object()
    assert agent.fail_over() and agent.channel.address == ("h0", 1)
    assert agent.commands is commands and agent.store_addr == "h0:1"
    assert asked == [(("h1", 2), P.LostPrimary(node=2))]


def test_an_agent_says_it_stops_once_it_read_its_stop_command():
    """What node 0's launcher waits for before it closes the store
    (launch.await_stopping); said from the watch, once, never from the
    SIGTERM handler, which may run in the middle of another request."""
    from deadpool_ext.control.ports import free_port
    from deadpool_ext.wire import Channel, connect

    store = connect("127.0.0.1", free_port(), timeout_s=10, is_master=True)
    agent = Agent.__new__(Agent)
    agent.node, agent.channel, agent.workers, agent.nonce = 2, Channel(store, b"s"), {}, None
    agent.stopping, agent.said_stopping, agent.leaving_by = False, False, None
    commands = [[], [{"kind": P.Command.STOP}], []]
    agent.commands = types.SimpleNamespace(poll=lambda: commands.pop(0))
    agent.watch_once()
    assert agent.channel.get(P.stopping_key(2)) is None
    agent.obey({"kind": P.Command.STOP})  # as SIGTERM's handler: nothing put yet
    assert agent.stopping and agent.channel.get(P.stopping_key(2)) is None
    agent.watch_once()  # the watch after it says so (the stop command too)
    assert agent.channel.get(P.stopping_key(2)) is not None
    agent.watch_once()
    assert agent.channel.version(P.stopping_key(2))[1] == 1  # said once
