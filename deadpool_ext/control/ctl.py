"""deadpool-ctl: an operator's line to a running job's coordinator.

    deadpool-ctl status [--json]      members, spares, generation, iteration,
                                      each node's compute time, the last recovery
    deadpool-ctl drain NODE           NODE's ranks hand their state over at the next
                                      iteration boundary (to spares, or the job
                                      shrinks) and the node leaves; nothing is redone
    deadpool-ctl stop                 save a checkpoint at the next iteration
                                      boundary and end the job (exit 0)

It finds the job from what the launchers read (--master-addr/--master-port
or MASTER_ADDR/MASTER_PORT, and DEADPOOL_SECRET), or else the job that
``deadpool-launch --standalone`` runs on this host (control/jobs.py). The
request is signed with the job's secret: the coordinator drops and counts
anything else, and acts on nothing it cannot verify.
"""

import argparse
import json
import os
import secrets
import sys
import time
from typing import List, Optional, Tuple

import torch.distributed as dist

from deadpool_ext import protocol as P
from deadpool_ext.control.jobs import run_dir, running_jobs
from deadpool_ext.control.ports import node_1_standby_port
from deadpool_ext.defaults import CONTROL_REPLY_WAIT_S
from deadpool_ext.protocol import ExitCode, Request
from deadpool_ext.wire import Channel, connect


class UsageError(Exception):
    """What to change in the command line or the environment."""


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(
        prog="deadpool-ctl", description="Look at or act on a running deadpool-launch job."
    )
    parser.add_argument("--master-addr", "--master_addr", default=os.environ.get("MASTER_ADDR"))
    parser.add_argument(
        "--master-port",
        "--master_port",
        type=int,
        # As the launchers: MASTER_PORT, with MASTER_ADDR; a lone address is refused.
        default=int(os.environ.get("MASTER_PORT", "0")) or None,
        help="The job's store (node 0's launcher), with DEADPOOL_SECRET in the environment; "
        "none: the job deadpool-launch --standalone runs on this host.",
    )
    parser.add_argument(
        "--standby-addr",
        help="The standby coordinator's host (the launchers' --standby-addr): asked when node "
        "0's store does not answer, as after a takeover.",
    )
    parser.add_argument("--job", type=int, help="Which standalone job (its launcher's pid).")
    parser.add_argument("--timeout", type=float, default=CONTROL_REPLY_WAIT_S)
    commands = parser.add_subparsers(dest="request", required=True)
    status = commands.add_parser("status", help="The job as its coordinator sees it.")
    status.add_argument("--json", action="store_true", help="The whole status as JSON.")
    drain = commands.add_parser("drain", help="Take NODE out at the next iteration boundary.")
    drain.add_argument("node", type=int)
    drain.add_argument("--reason", default="")
    stop = commands.add_parser("stop", help="Save a checkpoint and end the job.")
    stop.add_argument("--reason", default="")
    return parser


def find_job(opts, environ=os.environ) -> Tuple[str, int, bytes]:
    """(host, port, secret) of the job to talk to."""
    if opts.master_addr and not opts.master_port:
        raise UsageError("give --master-port with --master-addr (the job's store, node 0's)")
    if opts.master_port:
        secret = environ.get(P.SECRET_ENV)
        if not secret:
            raise UsageError(f"set {P.SECRET_ENV} to the job's secret (the launchers' own)")
        return opts.master_addr or "127.0.0.1", opts.master_port, secret.encode()
    jobs = running_jobs(environ)
    if opts.job is not None:
        jobs = [job for job in jobs if job["pid"] == opts.job]
    if len(jobs) == 1:
        job = jobs[0]
        return job["address"], int(job["port"]), job["secret"].encode()
    if not jobs:
        raise UsageError(
            f"no deadpool-launch --standalone job of yours runs on this host ({run_dir(environ)}): "
            f"give --master-addr, --master-port and {P.SECRET_ENV} for a multi-node job"
        )
    pids = ", ".join(str(job["pid"]) for job in jobs)
    raise UsageError(f"{len(jobs)} standalone jobs run here (launcher pids {pids}): give --job PID")


def ask(host: str, port: int, secret: bytes, request: P.ControlRequest, timeout_s: float) -> dict:
    """Post the request and wait for the coordinator's answer."""
    try:
        channel = Channel(connect(host, port, timeout_s=min(timeout_s, 10.0)), secret)
    except (dist.DistError, RuntimeError) as error:
        raise ConnectionError(f"no job answers at {host}:{port} ({error})") from None
    channel.post(P.CONTROL_TOPIC, request)
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        answer = channel.get(P.control_reply_key(request.nonce))
        if answer is not None:
            return answer
        time.sleep(0.05)
    raise TimeoutError(
        f"the coordinator at {host}:{port} did not answer within {timeout_s:g} s "
        "(a wrong secret gets no answer: it is dropped and counted)"
    )


def ask_where_it_runs(opts, host: str, port: int, secret: bytes) -> dict:
    """Node 0's store, else (with --standby-addr) the standby's, which
    serves the job after a takeover on the next port."""
    request = request_of(opts)
    try:
        return ask(host, port, secret, request, opts.timeout)
    except ConnectionError:
        if not opts.standby_addr:
            raise
    return ask(opts.standby_addr, node_1_standby_port(port), secret, request, opts.timeout)


def describe(status: dict) -> str:
    """The status as lines for a person."""
    it = status.get("iteration")
    lines = [
        f"job: {status['state']}, generation {status['generation']}, "
        f"iteration {'-' if it is None else it}, "
        f"{status['world_size']} of {status['planned_world_size']} ranks"
    ]
    for node, info in sorted(status["nodes"].items(), key=lambda kv: int(kv[0])):
        compute = info.get("compute_s")
        line = f"  node {node}: {info['role']}"
        line += f", ranks {ranks_text(info['ranks'])}" if info["ranks"] else ""
        line += f", compute {compute:.3f} s/iteration" if compute is not None else ""
        straggler = status.get("stragglers", {}).get(node)
        line += f" (straggler: {straggler['ratio']}x the others)" if straggler else ""
        lines.append(line)
    spares = status["spares"]
    lines.append(
        f"spares: {len(spares['ready'])} ready {spares['ready']}, "
        f"{len(spares['warming'])} warming {spares['warming']}"
    )
    last = status.get("last_recovery")
    if last:
        order = ("report", "rebuild")  # the stages as they come (JSON sorts the keys)
        stages = ", ".join(f"{k} {last['stages'][k]:.2f} s" for k in order if k in last["stages"])
        lines.append(
            f"last recovery: generation {last['generation']} ({last['cause']}): {last['action']}"
            + (f" ({last['reason']})" if last.get("reason") else "")
            + f", {last['seconds']:.2f} s ({stages}), went on after iteration {last['rollback_to']}"
        )
    counts = ", ".join(f"{k} {v}" for k, v in sorted(status["recoveries"].items()))
    lines.append(f"recoveries: {counts or 'none'}")
    for node, why in status.get("drains_pending", {}).items():
        lines.append(f"drain pending: node {node} ({why})")
    if status.get("stop_requested"):
        lines.append(f"stop pending: {status['stop_requested']}")
    lines.append(f"requests refused: {status['rejected_requests']}")
    standby, coordinator = status["standby_node"], status["coordinator"]
    lines.append(
        f"coordinator: node {coordinator['node']} (term {coordinator['term']}), standby: "
        + ("none" if standby is None else f"node {standby}")
    )
    return "\n".join(lines)


def ranks_text(ranks: List[int]) -> str:
    if ranks == list(range(ranks[0], ranks[-1] + 1)) and len(ranks) > 1:
        return f"{ranks[0]}-{ranks[-1]}"
    return ",".join(map(str, ranks))


def request_of(opts) -> P.ControlRequest:
    return P.ControlRequest(
        request=Request(opts.request).value,
        nonce=secrets.token_hex(8),
        node=getattr(opts, "node", None),
        reason=getattr(opts, "reason", ""),
        by=f"deadpool-ctl (pid {os.getpid()})",
    )


def main(argv: Optional[List[str]] = None) -> int:
    opts = build_parser().parse_args(argv)
    try:
        host, port, secret = find_job(opts)
    except UsageError as error:
        print(f"deadpool-ctl: error: {error}", file=sys.stderr)
        return ExitCode.USAGE
    try:
        answer = ask_where_it_runs(opts, host, port, secret)
    except (ConnectionError, TimeoutError) as error:
        print(f"deadpool-ctl: {error}", file=sys.stderr)
        return ExitCode.FAILED
    if opts.request == "status":
        status = answer["status"]
        print(json.dumps(status, indent=2, sort_keys=True) if opts.json else describe(status))
        return ExitCode.OK
    print(f"deadpool-ctl: {'' if answer['ok'] else 'refused: '}{answer['message']}")
    return ExitCode.OK if answer["ok"] else ExitCode.FAILED
