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
"""

import argparse
import json
import os
import random
import shutil
import signal
import socket
import subprocess
import sys
import tempfile
import time
from typing import List, Optional, Tuple

from megatron.training.arguments import ConfigError

from deadpool_ext.config import coordinator_settings
from deadpool_ext.control.coordinator import Coordinator
from deadpool_ext.control.jobs import UnsafeRunDir, remove_job, write_job
from deadpool_ext.control.metrics import MetricsServer
from deadpool_ext.control.standby import Standby, Verdict
from deadpool_ext.control.zygote import ForkedProcess, forks_workers, preload, rename
from deadpool_ext.events import EventLog
from deadpool_ext.lifetime import die_with_parent
from deadpool_ext.policy import abort
from deadpool_ext.defaults import TAKEOVER_WAIT_S
from deadpool_ext.protocol import (
    AGENT_ENV,
    COORDINATOR_RANK,
    SECRET_ENV,
    STANDBY_PORT_OFFSET,
    Command,
    ExitCode,
)
from deadpool_ext.wire import Channel, PortTaken, connect, new_secret


def build_parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(
        prog="deadpool-launch", description=__doc__.split("\n")[0], allow_abbrev=False
    )
    env = os.environ
    p.add_argument(
        "--nnodes",
        type=node_count,
        default=int(env.get("DEADPOOL_NNODES", "1")),
        help="Active nodes (training ranks).",
    )
    p.add_argument("--spare-nodes", type=int, default=0, help="Warm spare nodes.")
    p.add_argument(
        "--nproc-per-node",
        "--nproc_per_node",
        type=ranks_per_node,
        default=1,
        help="Ranks per node: a number, or as torchrun gpu (the GPUs visible), auto (the "
        "GPUs, else the CPU cores) or cpu (the CPU cores).",
    )
    p.add_argument(
        "-m",
        "--module",
        action="store_true",
        help="The script is a module, run as python -m runs it (torchrun's flag).",
    )
    # torchrun's rendezvous spellings: node 0's store is the rendezvous.
    p.add_argument(
        "--rdzv-endpoint",
        "--rdzv_endpoint",
        help="HOST[:PORT] of node 0 (torchrun's spelling of --master-addr and --master-port).",
    )
    p.add_argument(
        "--rdzv-backend",
        "--rdzv_backend",
        help="c10d only (torchrun's default store): node 0 hosts the job's store.",
    )
    p.add_argument("--rdzv-id", "--rdzv_id", help="Accepted (torchrun's); no effect here.")
    # torchrun's that a job with spares has no use for: refused with the reason.
    for flags in (("--max-restarts", "--max_restarts"), ("--log-dir", "--log_dir"), ("--tee",)):
        p.add_argument(*flags, help=argparse.SUPPRESS)
    p.add_argument("-r", "--redirects", help=argparse.SUPPRESS)
    p.add_argument(
        "--standalone",
        action="store_true",
        help="Emulate every node on this host (one agent process per node).",
    )
    p.add_argument(
        "--node-rank",
        "--node_rank",  # torchrun's spelling too
        type=int,
        default=int(env.get("SLURM_NODEID", "0")),
        help="This node's index (default SLURM_NODEID).",
    )
    p.add_argument(
        "--master-addr",
        "--master_addr",  # torchrun's spelling too
        default=env.get("MASTER_ADDR", "127.0.0.1"),
        help="Host of node 0 (store and coordinator).",
    )
    p.add_argument(
        "--master-port",
        "--master_port",  # torchrun's spelling too
        type=int,
        default=int(env.get("MASTER_PORT", "0")),
        help="Port of the store (0: a free one; standalone only).",
    )
    p.add_argument(
        "--standby-addr",
        default=env.get("DEADPOOL_STANDBY_ADDR"),
        help="Host of node 1, whose launcher then keeps a standby coordinator "
        "(its store at --master-port + 1) that takes over when node 0 dies "
        "(default DEADPOOL_STANDBY_ADDR; none without it).",
    )
    p.add_argument(
        "--takeover-file",
        default=env.get("DEADPOOL_TAKEOVER_FILE"),
        help="With --standby-addr: node 1's launcher writes why it took over "
        "here, so that a batch system knows whose exit status is the job's "
        "(examples/slurm/on_node.sh; default DEADPOOL_TAKEOVER_FILE).",
    )
    p.add_argument(
        "--join",
        action="store_true",
        help="Join a running job as a spare node (a repaired or new node); give "
        "--node-rank, --master-addr and --master-port.",
    )
    p.add_argument("script", help="The training script, e.g. pretrain_gpt.py.")
    p.add_argument("script_args", nargs=argparse.REMAINDER)
    return p


def node_count(text: str) -> int:
    low, _, high = text.partition(":")
    if high and low == high:  # torchrun's fixed size N:N
        return int(low)
    if high:
        raise argparse.ArgumentTypeError(
            f"elastic --nnodes {text}: deadpool-launch keeps the job at its size with warm "
            "spare nodes (--spare-nodes), shrinks it when they run out and grows it back "
            "when nodes join (--join): give the active nodes' count"
        )
    return int(text)


def ranks_per_node(text: str) -> int:
    """torchrun's --nproc-per-node: a number, gpu, auto or cpu."""
    if text == "cpu":
        return os.cpu_count() or 1
    if text in ("gpu", "auto"):
        import torch

        gpus = torch.cuda.device_count()
        if gpus == 0 and text == "gpu":
            raise argparse.ArgumentTypeError("--nproc-per-node gpu: no GPU is visible")
        return gpus or os.cpu_count() or 1
    return int(text)


def refuse_torchrun_flags(opts) -> None:
    """What torchrun offers that this launcher does otherwise, or not."""
    refusals = [
        (
            opts.max_restarts not in (None, "0"),
            f"--max-restarts {opts.max_restarts}: deadpool-launch never restarts the job: a "
            "failed rank is replaced in place by a warm spare (--spare-nodes), or the job "
            "shrinks: drop it",
        ),
        (
            opts.rdzv_backend not in (None, "c10d"),
            f"--rdzv-backend {opts.rdzv_backend}: node 0 hosts the job's store (c10d): "
            "give c10d, or drop it",
        ),
        (
            any(v is not None for v in (opts.log_dir, opts.tee, opts.redirects)),
            "--log-dir, --tee and --redirects: deadpool-launch writes no per-rank log files; "
            "every rank's output comes through the launcher's (its logger's lines marked "
            "[rank N]): redirect that instead",
        ),
    ]
    for refused, why in refusals:
        if refused:
            raise ConfigError(why)


def use_rendezvous_endpoint(opts) -> None:
    """torchrun's --rdzv-endpoint HOST[:PORT] is node 0's address (port 29400
    by default, as torchrun's)."""
    if opts.rdzv_id is not None:
        print(
            f"deadpool-launch: --rdzv-id {opts.rdzv_id} has no effect here: each job has a "
            "store of its own (node 0's), signed with its secret",
            file=sys.stderr,
        )
    if opts.rdzv_endpoint is None:
        return
    endpoint = opts.rdzv_endpoint
    host, _, port = (
        endpoint.rpartition(":")
        if endpoint.rfind(":") > endpoint.rfind("]")
        else (endpoint, "", "")
    )
    opts.master_addr, opts.master_port = host.strip("[]"), int(port or 29400)


def free_port(span: int = 1) -> int:
    """A port P of this host with P to P + span - 1 free (a standby's store
    listens on P + 1), drawn outside the kernel's range of ephemeral ports:
    the source port of every connection made from now until a server binds
    P comes from that range, so a port drawn from it (as bind(0) draws) can
    be taken before the job's store listens on it."""
    low, high = ephemeral_ports()
    outside = ((10000, low - 1), (high + 1, 65535))  # each [first port, last port]
    firsts = [(a, b - span + 1) for a, b in outside if b - span + 1 >= a]
    draw = random.SystemRandom()
    for _ in range(200 if firsts else 0):
        first, last = draw.choice(firsts)
        port = draw.randint(first, last)
        if all(can_bind(p) for p in range(port, port + span)):
            return port
    raise RuntimeError(f"no {span} free port(s) in a row on this host outside {low}-{high}")


def ephemeral_ports() -> Tuple[int, int]:
    try:
        with open("/proc/sys/net/ipv4/ip_local_port_range") as f:
            low, high = map(int, f.read().split())
    except (OSError, ValueError):
        return 32768, 60999  # Linux's default
    return low, high


def can_bind(port: int) -> bool:
    with socket.socket() as s:
        try:
            s.bind(("127.0.0.1", port))
        except OSError:
            return False
    return True


def standby_address(opts) -> Optional[str]:
    if not opts.standby_addr:
        return None
    return f"{opts.standby_addr}:{opts.master_port + STANDBY_PORT_OFFSET}"


def agent_settings(opts, node: int, store: str, scratch: Optional[str] = None) -> dict:
    return {
        "scratch": scratch,
        "standby": standby_address(opts),
        "takeover_wait": opts.settings.heartbeat_timeout + TAKEOVER_WAIT_S,
        "node": node,
        "nproc": opts.nproc_per_node,
        "active": node < opts.nnodes and not opts.join,
        "join": opts.join,
        "world_size": opts.nnodes * opts.nproc_per_node,
        "store": store,
    }


def worker_command(opts) -> List[str]:
    module = ["-m"] if opts.module else []
    return [sys.executable, "-u", *module, opts.script, *opts.script_args]


def agent_command(opts) -> List[str]:
    command = json.dumps(worker_command(opts))
    return [sys.executable, "-m", "deadpool_ext.control.agent", "--command", command]


def start_agent(opts, node: int, store: str, scratch: Optional[str] = None) -> subprocess.Popen:
    settings = agent_settings(opts, node, store, scratch)
    env = dict(os.environ, **{AGENT_ENV: json.dumps(settings)})
    # Standalone, an emulated node is its agent's session: killing the node
    # kills the agent and its workers only. A node launcher's agent stays in
    # its process group, which is then the whole node. The agent outlives
    # its launcher: losing the coordinator (or the standby) alone, the node
    # goes on training under the standby (or the coordinator).
    return subprocess.Popen(agent_command(opts), env=env, start_new_session=opts.standalone)


def start_agents(opts, nodes: List[int], store: str, scratch: str) -> Optional[dict]:
    """This host's agents, by node. Standalone where workers are forked,
    the agents are forked from this launcher once it has imported what a
    rank imports: the emulated nodes' zygotes share one import instead of
    each making its own (about 8 s of CPU per node on a 2-core machine).
    None returns in a forked agent's process once the agent's ``main``
    returned (see ``fork_agent``)."""
    if not (opts.standalone and forks_workers()):
        return {node: start_agent(opts, node, store, scratch) for node in nodes}
    command = worker_command(opts)
    path = list(sys.path)
    preload(command)
    sys.path[:] = path  # the launcher's own; the agents' zygotes set the script's
    agents = {}
    for node in nodes:
        agent = fork_agent(opts, node, store, scratch)
        if agent is None:
            return None
        agents[node] = agent
    return agents


def fork_agent(opts, node: int, store: str, scratch: str) -> Optional[ForkedProcess]:
    """Fork node ``node``'s agent from this launcher, before the launcher
    has a thread or a connection (the store comes after). In the child,
    the agent's ``main`` runs; it returns only in the agent's zygote and in
    a worker whose script returned, and None then returns up to the
    launcher's ``main``, which ends the process. The agent is its emulated
    node's session, as ``start_agent``'s, and dies with the launcher, which
    is the whole control plane of a standalone job."""
    sys.stdout.flush()
    sys.stderr.flush()
    launcher = os.getpid()
    pid = os.fork()
    if pid:
        return ForkedProcess(pid)
    os.setsid()
    if die_with_parent(launcher):
        from deadpool_ext.control import agent

        os.environ[AGENT_ENV] = json.dumps(agent_settings(opts, node, store, scratch))
        rename(agent_command(opts))
        agent.main(worker_command(opts))
    return None


def check(opts) -> None:
    refuse_torchrun_flags(opts)
    use_rendezvous_endpoint(opts)
    if opts.nnodes < 1 or opts.nproc_per_node < 1 or opts.spare_nodes < 0:
        raise ConfigError("--nnodes and --nproc-per-node must be >= 1, --spare-nodes >= 0")
    if opts.join and (opts.standalone or not opts.master_port or opts.node_rank < 1):
        raise ConfigError(
            "--join: give the running job's --master-addr and "
            "--master-port, and --node-rank >= 1 (node 0 hosts the coordinator); "
            "not --standalone"
        )
    if opts.standby_addr and (opts.standalone or opts.nnodes + opts.spare_nodes < 3):
        raise ConfigError(
            "--standby-addr: a standby coordinator needs a multi-node run "
            "(not --standalone, whose launcher is no node) of at least 3 nodes in all "
            "(--nnodes + --spare-nodes): with 2 no single loss leaves a majority"
        )
    if not opts.standalone and not os.environ.get(SECRET_ENV):
        raise ConfigError(
            f"set {SECRET_ENV} to the same random string on "
            "every node (e.g. export DEADPOOL_SECRET=$(openssl rand -hex 32) "
            "in the sbatch script)"
        )


def on_sigterm(opts, coordinator: Coordinator, agents: dict) -> None:
    """With --exit-signal-handler the ranks save a checkpoint at the end of
    this iteration and finish: pass SIGTERM on to this host's agents (which
    stop their workers with it; Slurm's --signal reaches them anyway) and
    keep coordinating until every rank is done. Otherwise end the job."""
    if "--exit-signal-handler" not in opts.script_args:
        coordinator.end(
            abort(coordinator.gen, "the launcher got SIGTERM", coordinator.view.members)
        )
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
        channel = Channel(store, os.environ[SECRET_ENV].encode(), address=(store_host, port))
        coordinator = new_coordinator(opts, channel, replica=replica_channel(opts))
        return run_coordinator(opts, coordinator, agents)
    finally:
        shutil.rmtree(scratch, ignore_errors=True)
        if job is not None:
            remove_job(job)


def kill_agent(opts, proc) -> None:
    """An emulated node's agent (--standalone) with its node's session;
    another, alone: its workers die with it (parent-death signal)."""
    if opts.standalone:
        os.killpg(proc.pid, signal.SIGKILL)
    else:
        proc.kill()


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
    """``standby``: the primary's ``replica``, or the ``snapshot`` taken over."""
    return Coordinator(
        channel,
        opts.nnodes,
        opts.spare_nodes,
        opts.nproc_per_node,
        EventLog(opts.settings.events, COORDINATOR_RANK),
        settings=opts.settings,
        **standby,
    )


def replica_channel(opts) -> Optional[Channel]:
    """The primary's line to the standby's store (node 1's launcher may
    start later: its client waits for it as agents wait for node 0)."""
    address = standby_address(opts)
    if address is None:
        return None
    host, port = address.rsplit(":", 1)
    # A standby that does not answer within the heartbeat timeout is as lost
    # as a silent node: the coordinator must not stall on it.
    store = connect(host, int(port), timeout_s=120, silent_after_s=opts.settings.heartbeat_timeout)
    return Channel(store, os.environ[SECRET_ENV].encode(), address=(host, int(port)))


def run_coordinator(opts, coordinator: Coordinator, agents: dict) -> int:
    """Coordinate until the job ends, then stop every agent."""

    def agents_alive() -> bool:
        for node, proc in list(agents.items()):
            if proc.poll() is not None and not coordinator.finished:
                del agents[node]
                coordinator.agent_ended(node, proc.returncode)
        return True

    signal.signal(signal.SIGTERM, lambda *_: on_sigterm(opts, coordinator, agents))
    metrics = serve_metrics(opts.settings, coordinator)
    try:
        code = coordinator.run(alive=agents_alive)
    finally:
        if metrics is not None:
            metrics.stop()
    for node in coordinator.view.nodes():
        coordinator.tell_agent(node, Command.STOP)
    deadline = time.monotonic() + 30
    for proc in agents.values():
        try:
            proc.wait(timeout=max(0.1, deadline - time.monotonic()))
        except subprocess.TimeoutExpired:
            kill_agent(opts, proc)
    stopped = coordinator.result or coordinator.stopping
    if stopped is not None:
        print(f"deadpool-launch: job stopped: {stopped.reason}", file=sys.stderr, flush=True)
    coordinator.events.close()
    return code


def job_file(host: str, port: int) -> Optional[str]:
    """For deadpool-ctl on this host: a standalone job's secret and port are
    made up here, so they go to a file only this user can read (none, with
    a line saying why, where that cannot be made sure of)."""
    try:
        return write_job(host, port, os.environ[SECRET_ENV], os.getpid())
    except (UnsafeRunDir, OSError) as error:
        print(f"deadpool-launch: deadpool-ctl will not find this job: {error}", file=sys.stderr)
        return None


def serve_metrics(settings, coordinator: Coordinator) -> Optional[MetricsServer]:
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
    coordinator.status_listeners.append(server.update)
    print(
        f"deadpool-launch: metrics at http://{settings.metrics_addr}:{port}/metrics",
        file=sys.stderr,
        flush=True,
    )
    return server


def stand_by(opts) -> int:
    """Node 1 with a standby: host the standby store, run this node's agent,
    and take over as the coordinator if node 0 dies. Otherwise this
    launcher ends with its agent, as any node's."""
    port = opts.master_port + STANDBY_PORT_OFFSET
    secret = os.environ[SECRET_ENV].encode()
    hint = (
        f"it listens on --master-port + {STANDBY_PORT_OFFSET}, which must be free on "
        "--standby-addr too: choose another --master-port"
    )
    store = served_store(opts.standby_addr, port, "the standby's store", hint)
    channel = Channel(store, secret, address=(opts.standby_addr, port))
    agent = start_agent(opts, opts.node_rank, f"{opts.master_addr}:{opts.master_port}")
    signal.signal(signal.SIGTERM, lambda *_: agent.send_signal(signal.SIGTERM))
    standby = Standby(channel, opts.node_rank, opts.settings.heartbeat_timeout)
    # An agent that ended well ended with the job; one that was killed
    # leaves the launcher standing by (node 0 may still die).
    verdict = Verdict.WAIT
    while verdict == Verdict.WAIT and agent.poll() != ExitCode.OK:
        verdict = standby.poll()
        time.sleep(0.05)
    if verdict == Verdict.TAKE_OVER:
        return take_over(opts, channel, standby, agent)
    return agent.wait()


def take_over(opts, channel: Channel, standby: Standby, agent: subprocess.Popen) -> int:
    coordinator = new_coordinator(opts, channel, snapshot=standby.state)
    print(
        f"deadpool-launch: node 0's coordinator fell silent; node {opts.node_rank} takes over "
        f"(nodes {sorted(standby.came_over)} came over)",
        file=sys.stderr,
        flush=True,
    )
    reason = f"the coordinator's node went silent for {standby.timeout_s:.1f} s"
    if opts.takeover_file:
        with open(opts.takeover_file, "w") as f:
            f.write(f"node {opts.node_rank} took over as the coordinator: {reason}\n")
    coordinator.take_over(0, reason, node_alive=0 in standby.came_over)
    agents = {} if agent.poll() is not None else {opts.node_rank: agent}
    return run_coordinator(opts, coordinator, agents)


def checked_options(argv) -> argparse.Namespace:
    """The launcher's options, checked, with the coordinator's settings
    read from the script's --deadpool* flags; ConfigError says what to change."""
    opts = build_parser().parse_args(argv)
    check(opts)
    # As the workers will read them.
    opts.settings = coordinator_settings(opts.script_args, opts.nnodes + opts.spare_nodes)
    if not opts.standalone and not opts.master_port:
        raise ConfigError("give --master-port (or MASTER_PORT) on a multi-node run")
    return opts


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
    if opts.node_rank == 1 and opts.standby_addr and not opts.join:
        return stand_by(opts)
    settings = agent_settings(opts, opts.node_rank, f"{opts.master_addr}:{opts.master_port}")
    os.environ[AGENT_ENV] = json.dumps(settings)
    from deadpool_ext.control import agent

    return agent.main(worker_command(opts))


if __name__ == "__main__":
    sys.exit(main())
