"""deadpool-launch: a torchrun-like launcher with warm spare nodes.

    python -m deadpool_ext.launch --standalone --nnodes 2 --spare-nodes 1 \\
        --nproc-per-node 4 pretrain_gpt.py --deadpool ...

``--standalone`` emulates all nnodes + spare-nodes nodes on this host, one
agent process per node. On a real cluster run one launcher per node with
``--node-rank`` (or Slurm's SLURM_NODEID), ``--master-addr`` and
``--master-port``: node 0 also hosts the store and the coordinator. Nodes
``nnodes`` .. ``nnodes + spare-nodes - 1`` start warm spares.

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
import signal
import socket
import subprocess
import sys
import time
from typing import List, Optional

from deadpool_ext.control.coordinator import Coordinator
from deadpool_ext.events import EventLog
from deadpool_ext.policy import abort
from deadpool_ext.protocol import (
    AGENT_ENV,
    COORDINATOR_RANK,
    HEARTBEAT_TIMEOUT_S,
    RECOVERY_TIMEOUT_S,
    SECRET_ENV,
    Command,
)
from deadpool_ext.wire import Channel, connect, new_secret


def build_parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(
        prog="deadpool-launch", description=__doc__.split("\n")[0], allow_abbrev=False
    )
    env = os.environ
    p.add_argument(
        "--nnodes",
        type=int,
        default=int(env.get("DEADPOOL_NNODES", "1")),
        help="Active nodes (training ranks).",
    )
    p.add_argument("--spare-nodes", type=int, default=0, help="Warm spare nodes.")
    p.add_argument(
        "--nproc-per-node", "--nproc_per_node", type=int, default=1, help="Ranks per node."
    )
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
        "--join",
        action="store_true",
        help="Join a running job as a spare node (a repaired or new node); give "
        "--node-rank, --master-addr and --master-port.",
    )
    p.add_argument("script", help="The training script, e.g. pretrain_gpt.py.")
    p.add_argument("script_args", nargs=argparse.REMAINDER)
    return p


def flag_value(args: List[str], name: str) -> Optional[str]:
    """A --flag VALUE of the training script the coordinator also needs."""
    for i, arg in enumerate(args):
        if arg == name and i + 1 < len(args):
            return args[i + 1]
        if arg.startswith(name + "="):
            return arg.split("=", 1)[1]
    return None


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def agent_settings(opts, node: int, store: str) -> dict:
    return {
        "node": node,
        "nproc": opts.nproc_per_node,
        "active": node < opts.nnodes and not opts.join,
        "join": opts.join,
        "world_size": opts.nnodes * opts.nproc_per_node,
        "store": store,
        "command": [sys.executable, "-u", opts.script, *opts.script_args],
    }


def start_agent(opts, node: int, store: str) -> subprocess.Popen:
    env = dict(os.environ, **{AGENT_ENV: json.dumps(agent_settings(opts, node, store))})
    # Its own session: killing a node kills this agent and its workers only.
    return subprocess.Popen(
        [sys.executable, "-m", "deadpool_ext.control.agent"], env=env, start_new_session=True
    )


def check(opts) -> None:
    if opts.nnodes < 1 or opts.nproc_per_node < 1 or opts.spare_nodes < 0:
        raise SystemExit(
            "deadpool-launch: --nnodes and --nproc-per-node must be >= 1, --spare-nodes >= 0"
        )
    if opts.join and (opts.standalone or not opts.master_port or opts.node_rank < 1):
        raise SystemExit(
            "deadpool-launch --join: give the running job's --master-addr and "
            "--master-port, and --node-rank >= 1 (node 0 hosts the coordinator); "
            "not --standalone"
        )
    if not opts.standalone and not os.environ.get(SECRET_ENV):
        raise SystemExit(
            f"deadpool-launch: set {SECRET_ENV} to the same random string on "
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
    """Node 0 (or standalone): host the store, start local agents, decide."""
    store = connect(store_host, port, is_master=True)
    address = f"{opts.master_addr}:{port}"
    events = EventLog(flag_value(opts.script_args, "--deadpool-events"), COORDINATOR_RANK)
    timeout = float(
        flag_value(opts.script_args, "--deadpool-heartbeat-timeout") or HEARTBEAT_TIMEOUT_S
    )
    recovery = flag_value(opts.script_args, "--deadpool-recovery-timeout")
    coordinator = Coordinator(
        Channel(store, os.environ[SECRET_ENV].encode(), address=(store_host, port)),
        opts.nnodes,
        opts.spare_nodes,
        opts.nproc_per_node,
        events,
        heartbeat_timeout=timeout,
        recovery_timeout=float(recovery or RECOVERY_TIMEOUT_S),
    )
    agents = {node: start_agent(opts, node, address) for node in local_nodes}

    def agents_alive() -> bool:
        for node, proc in list(agents.items()):
            if proc.poll() is not None and not coordinator.finished:
                del agents[node]
                coordinator.lose_node(node, f"agent exited with code {proc.returncode}")
        return True

    signal.signal(signal.SIGTERM, lambda *_: on_sigterm(opts, coordinator, agents))
    code = coordinator.run(alive=agents_alive)
    for node in coordinator.nodes():
        coordinator.tell_agent(node, Command.STOP)
    deadline = time.monotonic() + 30
    for proc in agents.values():
        try:
            proc.wait(timeout=max(0.1, deadline - time.monotonic()))
        except subprocess.TimeoutExpired:
            os.killpg(proc.pid, signal.SIGKILL)
    stopped = coordinator.result or coordinator.stopping
    if stopped is not None:
        print(f"deadpool-launch: job stopped: {stopped.reason}", file=sys.stderr, flush=True)
    events.close()
    return code


def main(argv=None) -> int:
    opts = build_parser().parse_args(argv)
    check(opts)
    total = opts.nnodes + opts.spare_nodes
    if opts.standalone:
        os.environ.setdefault(SECRET_ENV, new_secret())
        port = opts.master_port or free_port()
        opts.master_addr = "127.0.0.1"
        return coordinate(opts, "127.0.0.1", port, list(range(total)))
    if not opts.master_port:
        raise SystemExit("deadpool-launch: give --master-port (or MASTER_PORT) on a multi-node run")
    if opts.node_rank == 0:
        return coordinate(opts, opts.master_addr, opts.master_port, [0])
    settings = agent_settings(opts, opts.node_rank, f"{opts.master_addr}:{opts.master_port}")
    os.environ[AGENT_ENV] = json.dumps(settings)
    from deadpool_ext.control import agent

    return agent.main()


if __name__ == "__main__":
    sys.exit(main())
