"""A process's TCP sockets (deadpool_ext/sockets.py), in-process: shutting
down touches only connected TCP sockets. Its loopback pair is shared with
the generation's tests."""

import socket

import pytest

from deadpool_ext.sockets import shut_down, socket_descriptors


@pytest.fixture()
def listener():
    sock = socket.socket()
    sock.bind(("127.0.0.1", 0))
    sock.listen()
    yield sock
    sock.close()


def connected(listener):
    """Both ends of a new loopback TCP connection."""
    client = socket.create_connection(listener.getsockname())
    return client, listener.accept()[0]


def test_shut_down_touches_only_connected_tcp_sockets(listener):
    client, server = connected(listener)
    left, right = socket.socketpair()  # a unix socket
    try:
        assert not shut_down(listener.fileno())
        assert not shut_down(left.fileno())
        assert shut_down(client.fileno())
        assert server.recv(1) == b""  # the peer sees the end of the stream
        assert client.fileno() in socket_descriptors().values()  # still open here
    finally:
        for s in (client, server, left, right):
            s.close()


def test_a_connection_its_peer_acknowledged_names_no_silent_peer(listener):
    """What the peer's kernel acknowledged waits on nobody; a descriptor
    that no longer holds the inode it was recorded with is passed over."""
    import os
    import time

    from deadpool_ext.sockets import local_host, silent_peers, unacknowledged_s

    client, server = connected(listener)
    try:
        client.sendall(b"x" * 4096)
        assert server.recv(4096)
        time.sleep(0.05)  # the acknowledgement is in
        assert unacknowledged_s(client) == 0.0
        connections = {os.fstat(client.fileno()).st_ino: client.fileno()}
        assert silent_peers(connections, at_least_s=0.0) == {}
        assert local_host(connections) == "127.0.0.1"
        stale = {os.fstat(client.fileno()).st_ino + 1: client.fileno()}
        assert silent_peers(stale, at_least_s=0.0) == {}
    finally:
        client.close()
        server.close()
