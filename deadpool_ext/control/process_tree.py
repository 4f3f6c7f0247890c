"""The launcher's process tree: the agents this launcher runs, how each starts and is killed.

One agent per node this launcher runs (its workers below it), started as a
process or, standalone where workers are forked, forked from the launcher
itself.
"""

import json
import os
import signal
import subprocess
import sys
from typing import List, Optional

from deadpool_ext.control.ports import node_1_standby_port
from deadpool_ext.control.zygote import ForkedProcess, forks_workers, preload, rename
from deadpool_ext.defaults import TAKEOVER_WAIT_S, control_cut_off_s
from deadpool_ext.lifetime import die_with_parent
from deadpool_ext.protocol import AGENT_ENV


def agent_settings(
    opts, node: int, store: str, scratch: Optional[str] = None, standby_store: Optional[str] = None
) -> dict:
    """``standby_store``: host:port of the store this node's launcher serves
    for a standby coordinator, which the agent announces."""
    waits = opts.settings.heartbeat_timeout + TAKEOVER_WAIT_S if opts.standby_addr else 0.0
    cut_off = control_cut_off_s(opts.settings.heartbeat_timeout, bool(opts.standby_addr))
    return {
        "scratch": scratch,
        "standby_store": standby_store,
        "first_standby": first_standby(opts),
        "takeover_wait": waits,
        "cut_off": cut_off,
        "node": node,
        "nproc": opts.nproc_per_node,
        "active": node < opts.nnodes and not opts.join,
        "join": opts.join,
        "world_size": opts.nnodes * opts.nproc_per_node,
        "store": store,
    }


def first_standby(opts) -> Optional[str]:
    """Node 1's standby store, which is appointed first (policy/admission.py's
    ``standby``): where a worker started before any generation was read
    turns when the primary is gone."""
    if not opts.standby_addr:
        return None
    return f"{opts.standby_addr}:{node_1_standby_port(opts.master_port)}"


def worker_command(opts) -> List[str]:
    module = ["-m"] if opts.module else []
    return [sys.executable, "-u", *module, opts.script, *opts.script_args]


def agent_command(opts) -> List[str]:
    command = json.dumps(worker_command(opts))
    return [sys.executable, "-m", "deadpool_ext.control.agent", "--command", command]


def start_agent(opts, node: int, store: str, **settings) -> subprocess.Popen:
    settings = agent_settings(opts, node, store, **settings)
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
        return {node: start_agent(opts, node, store, scratch=scratch) for node in nodes}
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


def kill_agent(opts, proc) -> None:
    """An emulated node's agent (--standalone) with its node's session;
    another, alone: its workers die with it (parent-death signal)."""
    if opts.standalone:
        os.killpg(proc.pid, signal.SIGKILL)
    else:
        proc.kill()
