"""The launcher's ports: a free one for a standalone job's store; a standby store's host.

The free port (and the standby's, next to it) is drawn where no
connection's source port can take it first.
"""

import random
import socket
from typing import Tuple

from deadpool_ext.protocol import STANDBY_PORT_OFFSET


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


def same_host(a: str, b: str) -> bool:
    """Whether two host names or addresses are one host's (False if either
    does not resolve)."""
    try:
        return socket.gethostbyname(a) == socket.gethostbyname(b)
    except OSError:
        return False


def node_1_standby_port(master_port: int) -> int:
    """The port of node 1's standby store, the one appointed first: next to
    node 0's (--master-port), on --standby-addr."""
    return master_port + STANDBY_PORT_OFFSET


def standby_host(opts) -> str:
    """The host at which this node's launcher serves a standby's store:
    node 1's is ``--standby-addr``; another node's (or a node that joins)
    is its own address on the way to node 0, which every node reaches."""
    if opts.node_rank == 1 and not opts.join:
        return opts.standby_addr
    with socket.socket(socket.AF_INET, socket.SOCK_DGRAM) as s:
        s.connect((opts.master_addr, opts.master_port))  # a route; nothing is sent
        return s.getsockname()[0]
