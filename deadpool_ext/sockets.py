"""The TCP sockets a process has open, found through /proc/self/fd: shut
one down (what releases a generation, ``rank/generation.py``) or bound how
long it may wait on a peer that went silent (``wire.connect``).
"""

import contextlib
import os
import socket
from typing import Dict, Optional

# /proc/self/fd links of sockets read "socket:[INODE]".
_SOCKET_PREFIX = "socket:["


def socket_descriptors() -> dict:
    """Inode -> a descriptor of it, for every socket this process has open."""
    found = {}
    fd_dir = "/proc/self/fd"
    for name in os.listdir(fd_dir):
        try:
            target = os.readlink(os.path.join(fd_dir, name))
        except OSError:  # closed since the listing
            continue
        if target.startswith(_SOCKET_PREFIX):
            found.setdefault(int(target[len(_SOCKET_PREFIX) : -1]), int(name))
    return found


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


def give_up_on_silence(fd: int, seconds: float) -> None:
    """Fail the connection when data it sent stays unacknowledged this long
    (TCP_USER_TIMEOUT): a host that died sends no reset, and without this a
    request to it waits for the kernel's retransmissions (about 15 minutes)."""
    with _connected_tcp(fd) as (sock, _):
        if sock is not None:
            sock.setsockopt(socket.IPPROTO_TCP, socket.TCP_USER_TIMEOUT, int(seconds * 1000))
