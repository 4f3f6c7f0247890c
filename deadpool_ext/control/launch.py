"""deadpool-launch: a torchrun-like launcher with warm spare nodes.

    python -m deadpool_ext.launch --standalone --nnodes 2 --spare-nodes 1 \\
        --nproc-per-node 4 pretrain_gpt.py --deadpool ...

``--standalone`` emulates all nnodes + spare-nodes nodes on this host, one
agent process per node. Where the workers are forked from a zygote (no
CUDA, control/zygote.py), the launcher imports megatron-core once and
forks every emulated node's agent: their zygotes then find it imported.
On a real cluster run one launcher per node with ``--node-rank`` (or
Slurm's SLURM_NODEID), ``--master-addr`` and ``--master-port``: node 0
also hosts the store and the coordinator. Nodes
``nnodes`` .. ``nnodes + spare-nodes - 1`` start warm spares.

With ``--standby-addr`` (node 1's address; at least 3 nodes in all) node
1's launcher hosts a standby store at ``--master-port`` + 1 and takes over
as the coordinator when node 0 dies (``control/standby.py``): the job goes
on without node 0, its ranks swapped in from spares like any lost node's.

A repaired or new node joins a running job as a spare node with the job's
own launcher flags plus ``--join --node-rank K`` (K not a live node's
index; a repaired node may take its old one); a job that shrank grows back
once the spares make up a whole data-parallel replica::

    DEADPOOL_SECRET=... python -m deadpool_ext.launch --join --node-rank 3 \
        --nnodes 2 --nproc-per-node 4 --master-addr HOST --master-port PORT \
        pretrain_gpt.py --deadpool ...

Here: ``main``, each node's part (``run_node``) and the coordinator's
hosting (node 0's store, the standby's, the metrics endpoint). The command
line is ``command_line.py``'s, the ports ``ports.py``'s, the agents this
launcher starts ``process_tree.py``'s, a standalone job's file ``jobs.py``'s.
"""

import json
import os
import shutil
import signal
import subprocess
import sys
import tempfile
import time
from typing import List, Optional

import torch.distributed as dist
from megatron.training.arguments import ConfigError

from deadpool_ext.control.command_line import checked_options
from deadpool_ext.control.coordinator import Coordinator
from deadpool_ext.control.jobs import job_file, remove_job
from deadpool_ext.control.metrics import MetricsServer
from deadpool_ext.control.ports import free_port, node_1_standby_port, same_host, standby_host
from deadpool_ext.control.process_tree import (
    agent_settings,
    kill_agent,
    start_agent,
    start_agents,
    worker_command,
)
from deadpool_ext.control import run_loop
from deadpool_ext.control.standby import Standby, Verdict, took_over
from deadpool_ext import protocol as P
from deadpool_ext.defaults import STORE_MEND_TIMEOUT_S
from deadpool_ext.events import EventLog
from deadpool_ext.policy.effects import Stop
from deadpool_ext.protocol import (
    AGENT_ENV,
    COORDINATOR_RANK,
    SECRET_ENV,
    STANDBY_PORT_OFFSET,
    Command,
    ExitCode,
)
from deadpool_ext.wire import Channel, PortTaken, connect, new_secret


def on_sigterm(opts, coordinator: Coordinator, agents: dict) -> None:
    """With --exit-signal-handler the ranks save a checkpoint at the end of
    this iteration and finish: pass SIGTERM on to this host's agents (which
    stop their workers with it; Slurm's --signal reaches them anyway) and
    keep coordinating until every rank is done. Otherwise end the job."""
    if "--exit-signal-handler" not in opts.script_args:
        coordinator.carry_out(Stop("the launcher got SIGTERM"))
        return
    for proc in agents.values():
        proc.send_signal(signal.SIGTERM)


def coordinate(opts, store_host: str, port: int, local_nodes: List[int]) -> int:
    """Node 0 (or standalone): start local agents, host the store, decide."""
    address = f"{opts.master_addr}:{port}"
    # A killed emulated node leaves its agent no time to clean up: its
    # scratch folder lies in this launcher's, removed when the job ends.
    # The agents start first: forked ones must not inherit the store's
    # server (its threads); they wait for it as other nodes' agents do. No
    # try or with around them: in a forked agent's process nothing of the
    # launcher's may run on its way out.
    scratch = tempfile.mkdtemp(prefix="deadpool-job-")
    agents = start_agents(opts, local_nodes, address, scratch)
    if agents is None:
        return ExitCode.OK  # a forked agent's process, ended (see fork_agent)
    job = job_file(store_host, port) if opts.standalone else None
    try:
        try:
            store = node_0_store(store_host, port, opts.standalone)
        except PortTaken:
            for proc in agents.values():  # nothing may outlive a usage error
                kill_agent(opts, proc)
            raise
        secret = os.environ[SECRET_ENV].encode()
        channel = Channel(store, secret, address=(store_host, port))
        coordinator = new_coordinator(opts, channel, standbys=standby_opener(opts))
        return run_coordinator(opts, coordinator, agents)
    finally:
        shutil.rmtree(scratch, ignore_errors=True)
        if job is not None:
            remove_job(job)


def node_0_store(host: str, port: int, standalone: bool):
    hint = (
        "choose another --master-port"
        if standalone
        else "--master-addr must be an address of node 0 and --master-port free there"
    )
    return served_store(host, port, "the job's store", hint)


def served_store(host: str, port: int, which: str, hint: str):
    """A store this launcher serves; a port taken says which and what to change."""
    try:
        return connect(host, port, is_master=True)
    except PortTaken as error:
        raise PortTaken(f"{which} {error}: {hint}") from None


def new_coordinator(opts, channel: Channel, **standby) -> Coordinator:
    """``standby``: the primary's ``replica``, or the ``record`` taken over."""
    return Coordinator(
        channel,
        opts.nnodes,
        opts.spare_nodes,
        opts.nproc_per_node,
        EventLog(opts.settings.events, COORDINATOR_RANK),
        settings=opts.settings,
        **standby,
    )


def standby_opener(opts):
    """How a coordinator opens its line to an appointed standby's store
    (host:port), or None without a standby. A standby that does not answer
    within the heartbeat timeout is as lost as a silent node: the
    coordinator must not stall on it."""
    if not opts.standby_addr:
        return None
    secret = os.environ[SECRET_ENV].encode()

    def open_standby(address: str) -> Channel:
        host, port = P.host_port(address)
        silent_s = opts.settings.heartbeat_timeout
        store = connect(host, port, timeout_s=STORE_MEND_TIMEOUT_S, silent_after_s=silent_s)
        return Channel(store, secret, address=(host, port))

    return open_standby


def takeover_probe(coordinator: Coordinator):
    """Whether the standby appointed last took over (asked by a coordinator
    cut off from the majority: run_loop.py)."""
    secret = os.environ[SECRET_ENV].encode()
    replica = coordinator.replica
    if replica is None:
        return None
    return lambda: replica.address is not None and took_over(P.host_port(replica.address), secret)


def run_coordinator(opts, coordinator: Coordinator, agents: dict) -> int:
    """Coordinate until the job ends, then stop every agent."""

    def agents_alive() -> bool:
        for node, proc in list(agents.items()):
            if proc.poll() is not None and not coordinator.finished:
                del agents[node]
                coordinator.agent_ended(node, proc.returncode)
        return True

    signal.signal(signal.SIGTERM, lambda *_: on_sigterm(opts, coordinator, agents))
    metrics = serve_metrics(opts.settings)
    try:
        code = run_loop.run(
            coordinator,
            alive=agents_alive,
            taken_over=takeover_probe(coordinator),
            status_to=None if metrics is None else metrics.update,
        )
    finally:
        if metrics is not None:
            metrics.stop()
    for node in coordinator.record.membership.nodes():
        coordinator.tell_agent(node, Command.STOP)
    await_stopping(coordinator)
    deadline = time.monotonic() + 30
    for proc in agents.values():
        try:
            proc.wait(timeout=max(0.1, deadline - time.monotonic()))
        except subprocess.TimeoutExpired:
            kill_agent(opts, proc)
    stopped = coordinator.record.result or coordinator.record.stopping
    if coordinator.watch.fenced is not None:
        why = coordinator.watch.fenced
        say = f"deadpool-launch: this side of a partition left the job: {why}"
        print(say, file=sys.stderr, flush=True)
    elif stopped is not None:
        print(f"deadpool-launch: job stopped: {stopped.reason}", file=sys.stderr, flush=True)
    coordinator.events.close()
    return code


def await_stopping(coordinator: Coordinator) -> None:
    """Keep the store up until every node whose agent beat at the last look
    has read its stop, for at most a heartbeat timeout. An agent that had
    not read it when the store closed would take the end for the
    coordinator's loss (a slow or lossy link to this host delays its reads),
    and its node's processes would wait for a takeover that never comes."""
    waiting = set(coordinator.detector.last.beating) & coordinator.record.membership.alive_nodes()
    deadline = time.monotonic() + coordinator.record.settings.heartbeat_timeout
    while waiting and time.monotonic() < deadline:
        try:
            waiting = {n for n in waiting if not has_stopped(coordinator, n)}
        except dist.DistError:
            return  # this store's server is gone: nobody reads it any more
        time.sleep(0.02)


def has_stopped(coordinator: Coordinator, node: int) -> bool:
    """Whether a node's agent said it is done with the store, or fell silent
    (a killed agent says nothing: its silence counts from its last beat)."""
    said = coordinator.channel.get(P.stopping_key(node))
    if said is not None and not said.get("pending"):
        return True
    detector = coordinator.detector
    return detector.heartbeat(P.node_heartbeat_key(node), coordinator.clock())[1]


def serve_metrics(settings) -> Optional[MetricsServer]:
    """--deadpool-metrics-port: the coordinator's status for Prometheus,
    refreshed every second. A port that cannot be bound costs the metrics,
    never the job (the standby starts it again after a takeover, maybe where
    the port is taken)."""
    if settings.metrics_port is None:
        return None
    server = MetricsServer()
    try:
        port = server.start(settings.metrics_port, settings.metrics_addr)
    except OSError as error:
        where = f"{settings.metrics_addr}:{settings.metrics_port}"
        print(f"deadpool-launch: no metrics: cannot listen on {where} ({error})", file=sys.stderr)
        return None
    print(
        f"deadpool-launch: metrics at http://{settings.metrics_addr}:{port}/metrics",
        file=sys.stderr,
        flush=True,
    )
    return server


def standby_store(opts):
    """The store this node's launcher serves for a standby coordinator:
    (host, port, store). Node 1's listens on --standby-addr at --master-port
    + 1; another node's at the same port of its own host, or at a free one
    where that port is node 1's (nodes sharing its host) or taken."""
    host, port = standby_host(opts), node_1_standby_port(opts.master_port)
    node_1 = opts.node_rank == 1 and not opts.join
    if not node_1 and same_host(host, opts.standby_addr):
        port = free_port()  # that port is node 1's, which may start later
    hint = (
        f"it listens on --master-port + {STANDBY_PORT_OFFSET}, which must be free on "
        "--standby-addr too: choose another --master-port"
    )
    try:
        return host, port, served_store(host, port, "the standby's store", hint)
    except PortTaken:
        if node_1:
            raise
    port = free_port()
    return host, port, served_store(host, port, "the standby's store", hint)


def stand_by(opts) -> int:
    """A node other than 0 with a standby: serve a store for one, run this
    node's agent, and take over as the coordinator if the coordinator is
    lost while this store holds its copy (the coordinator appoints the
    node: policy/admission.py's ``standby``). Otherwise this launcher ends
    with its agent, as any node's."""
    host, port, store = standby_store(opts)
    secret = os.environ[SECRET_ENV].encode()
    channel = Channel(store, secret, address=(host, port))
    master = f"{opts.master_addr}:{opts.master_port}"
    agent = start_agent(opts, opts.node_rank, master, standby_store=f"{host}:{port}")
    signal.signal(signal.SIGTERM, lambda *_: agent.send_signal(signal.SIGTERM))
    standby = Standby(channel, opts.node_rank, opts.settings.heartbeat_timeout)
    verdict = Verdict.WAIT
    while verdict == Verdict.WAIT and not stands_down(agent.poll(), standby):
        standby.clock.tick()
        verdict = standby.poll()
        time.sleep(0.05)
    if verdict == Verdict.TAKE_OVER:
        return take_over(opts, channel, standby, agent)
    return agent.wait()


def stands_down(agent_code: Optional[int], standby: Standby) -> bool:
    """Whether a standby whose agent ended has nothing left to do: the agent
    ended with the job, or was told its node was declared lost, or no copy
    of the coordinator's ever reached this store. One that was killed, on
    a node whose store holds the copy, leaves the launcher standing by (the
    coordinator may still be lost)."""
    if agent_code is None:
        return False
    return agent_code in (ExitCode.OK, ExitCode.FENCED) or standby.record is None


def take_over(opts, channel: Channel, standby: Standby, agent: subprocess.Popen) -> int:
    record = standby.record
    coordinator = new_coordinator(opts, channel, record=record, standbys=standby_opener(opts))
    lost = record.coordinator_node
    print(
        f"deadpool-launch: node {lost}'s coordinator fell silent; node {opts.node_rank} takes "
        f"over (nodes {sorted(standby.came_over)} came over)",
        file=sys.stderr,
        flush=True,
    )
    reason = f"the coordinator's node went silent for {standby.timeout_s:.1f} s"
    if opts.takeover_file:
        with open(opts.takeover_file, "w") as f:
            f.write(f"node {opts.node_rank} took over as the coordinator: {reason}\n")
    coordinator.take_over(opts.node_rank, reason, node_alive=lost in standby.came_over)
    agents = {} if agent.poll() is not None else {opts.node_rank: agent}
    return run_coordinator(opts, coordinator, agents)


def main(argv=None) -> int:
    try:
        opts = checked_options(argv)
    except ConfigError as error:
        print(f"deadpool-launch: error: {error}", file=sys.stderr, flush=True)
        return ExitCode.USAGE
    try:
        return run_node(opts)
    except PortTaken as error:
        print(f"deadpool-launch: error: {error}", file=sys.stderr, flush=True)
        return ExitCode.USAGE


def run_node(opts) -> int:
    """This launcher's part: every emulated node (--standalone), node 0's
    store and coordinator, node 1's standby, or another node's agent."""
    total = opts.nnodes + opts.spare_nodes
    if opts.standalone:
        os.environ.setdefault(SECRET_ENV, new_secret())
        port = opts.master_port or free_port()
        opts.master_addr = "127.0.0.1"
        return coordinate(opts, "127.0.0.1", port, list(range(total)))
    if opts.node_rank == 0:
        return coordinate(opts, opts.master_addr, opts.master_port, [0])
    if opts.standby_addr:
        return stand_by(opts)
    settings = agent_settings(opts, opts.node_rank, f"{opts.master_addr}:{opts.master_port}")
    os.environ[AGENT_ENV] = json.dumps(settings)
    from deadpool_ext.control import agent

    return agent.main(worker_command(opts))


if __name__ == "__main__":
    sys.exit(main())
