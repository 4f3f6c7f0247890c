"""The TCP sockets a process has open, found through /proc/self/fd: shut down, or bounded.

Shutting one down is what releases a generation (``rank/generation.py``);
a bound is how long it may wait on a peer that went silent
(``wire.connect``).
"""

import contextlib
import os
import socket
from typing import Dict, Iterable, Optional, Set

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
