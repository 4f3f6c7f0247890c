"""The TCP sockets a process has open, found through /proc/self/fd: shut down, or bounded.

Shutting one down is what releases a generation (``rank/generation.py``);
a bound is how long it may wait on a peer that went silent
(``wire.connect``); the kernel's count of what a peer left unacknowledged
is how a rank tells which peer's host its connections cannot reach
(``silent_peers``).
"""

import contextlib
import os
import socket
import struct
from typing import Dict, Iterable, Mapping, Optional, Set

# /proc/self/fd links of sockets read "socket:[INODE]".
_SOCKET_PREFIX = "socket:["


_FD_DIR = "/proc/self/fd"


def socket_descriptors(names: Optional[Iterable[str]] = None) -> dict:
    """Inode -> a descriptor of it, for every socket this process has open
    (among the descriptors ``names``, if given: reading each link is what
    costs, about 0.1 ms)."""
    found = {}
    for name in os.listdir(_FD_DIR) if names is None else names:
        try:
            target = os.readlink(os.path.join(_FD_DIR, name))
        except OSError:  # closed since the listing
            continue
        if target.startswith(_SOCKET_PREFIX):
            found.setdefault(int(target[len(_SOCKET_PREFIX) : -1]), int(name))
    return found


def open_descriptors() -> Set[str]:
    """The descriptors open now, by name: a cheap listing to diff against."""
    return set(os.listdir(_FD_DIR))


def sockets_opened_since(before: Set[str]) -> Set[int]:
    """The inodes of the sockets on descriptors opened since ``before``
    (``open_descriptors``), e.g. the connections one group made."""
    return set(socket_descriptors(open_descriptors() - before))


@contextlib.contextmanager
def _connected_tcp(fd: int):
    """(a duplicate of ``fd`` as a socket, its peer's host:port) if ``fd`` is
    a connected TCP socket, else (None, None); only the duplicate is closed
    on exit."""
    try:
        sock = socket.socket(fileno=os.dup(fd))
    except OSError:
        yield None, None
        return
    try:
        peer = None
        if sock.family in (socket.AF_INET, socket.AF_INET6) and sock.type == socket.SOCK_STREAM:
            with contextlib.suppress(OSError):  # a listener or an unconnected socket
                host, port = sock.getpeername()[:2]
                peer = f"{host}:{port}"
        yield (sock, peer) if peer else (None, None)
    finally:
        sock.close()


def shut_down(fd: int) -> bool:
    """Shut a connected TCP socket down in both directions; False for
    anything else (a listener, a unix socket) or a socket already gone."""
    with _connected_tcp(fd) as (sock, _):
        if sock is None:
            return False
        try:
            sock.shutdown(socket.SHUT_RDWR)
            return True
        except OSError:
            return False


def peer_of(fd: int) -> Optional[str]:
    """host:port of a connected TCP socket's peer; None for anything else."""
    with _connected_tcp(fd) as (_, peer):
        return peer


def connected_to(port: int, inodes: set) -> Dict[int, int]:
    """Inode -> descriptor of the connected TCP sockets among ``inodes``
    whose peer listens on ``port``."""
    found = {}
    for inode, fd in socket_descriptors().items():
        peer = peer_of(fd) if inode in inodes else None
        if peer is not None and int(peer.rsplit(":", 1)[1]) == port:
            found[inode] = fd
    return found


# Keepalive probes per cut-off: an idle line is probed this often within
# it, so a cut is found within about a third of the cut-off after it.
_PROBES_PER_CUT_OFF = 3


def give_up_on_silence(fd: int, seconds: float) -> None:
    """Fail the connection once its peer's host has acknowledged nothing for
    ``seconds``: data it sent stays unacknowledged (TCP_USER_TIMEOUT), or,
    while it waits for an answer with nothing unacknowledged, the keepalive
    probes do. A host that died or was cut off sends no reset; without this
    a request to it waits for the kernel's retransmissions (about 15
    minutes), and a request it acknowledged before the cut waits for good
    (torch's client does not keep its own timeout while it waits for an
    answer). The peer's kernel answers the probes, not its process, so a
    paused server is still waited for. A probe is a bare segment, sent only
    on an idle line: the cost is nothing beside the control plane's own
    traffic."""
    interval_s = max(1, int(seconds / _PROBES_PER_CUT_OFF))
    with _connected_tcp(fd) as (sock, _):
        if sock is not None:
            sock.setsockopt(socket.IPPROTO_TCP, socket.TCP_USER_TIMEOUT, int(seconds * 1000))
            sock.setsockopt(socket.SOL_SOCKET, socket.SO_KEEPALIVE, 1)
            sock.setsockopt(socket.IPPROTO_TCP, socket.TCP_KEEPIDLE, interval_s)
            sock.setsockopt(socket.IPPROTO_TCP, socket.TCP_KEEPINTVL, interval_s)


# struct tcp_info (linux/tcp.h): eight one-byte fields, then 32-bit ones;
# tcpi_unacked is the 5th of those, tcpi_last_data_sent the 10th and
# tcpi_last_ack_recv the 13th (both in milliseconds). Stable kernel ABI.
_TCP_INFO_SIZE = 104
_UNACKED, _LAST_DATA_SENT, _LAST_ACK_RECV = 24, 44, 56


def unacknowledged_s(sock: socket.socket) -> float:
    """Seconds this connection has waited on its peer's host to acknowledge
    data it sent: since the last acknowledgement, or since the data was
    sent if later (a line idle for long has an old last acknowledgement);
    0 when nothing waits. A live peer's kernel acknowledges whatever its
    process does (busy, paused, its buffer full), so only a host that is
    cut off or gone makes this grow."""
    info = sock.getsockopt(socket.IPPROTO_TCP, socket.TCP_INFO, _TCP_INFO_SIZE)
    (unacked,) = struct.unpack_from("I", info, _UNACKED)
    if not unacked:
        return 0.0
    (sent_ms,) = struct.unpack_from("I", info, _LAST_DATA_SENT)
    (acked_ms,) = struct.unpack_from("I", info, _LAST_ACK_RECV)
    return min(sent_ms, acked_ms) / 1000


def silent_peers(connections: Mapping[int, int], at_least_s: float) -> Dict[str, float]:
    """Peer host -> the longest any of ``connections`` (inode -> descriptor)
    has waited on it to acknowledge, for the waits of ``at_least_s`` or
    more. A descriptor that no longer holds its inode (closed, reused) is
    passed over."""
    found: Dict[str, float] = {}
    for inode, fd in connections.items():
        with contextlib.suppress(OSError):
            if os.fstat(fd).st_ino != inode:
                continue
        with _connected_tcp(fd) as (sock, peer):
            if sock is None:
                continue
            with contextlib.suppress(OSError):
                waited = unacknowledged_s(sock)
                host = peer.rsplit(":", 1)[0]
                if waited >= at_least_s and waited > found.get(host, 0.0):
                    found[host] = round(waited, 1)
    return found


def local_host(connections: Mapping[int, int]) -> Optional[str]:
    """This end's address of the first of ``connections`` still connected:
    how its peers name this host (the interface its groups use)."""
    for fd in connections.values():
        with _connected_tcp(fd) as (sock, _):
            if sock is not None:
                with contextlib.suppress(OSError):
                    return sock.getsockname()[0]
    return None
