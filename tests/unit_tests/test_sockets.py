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
