"""The launcher's ports (deadpool_ext/control/ports.py): a free port and the
next lie outside the kernel's ephemeral ports."""

from deadpool_ext.control.ports import can_bind, ephemeral_ports, free_port


def test_a_free_port_and_the_next_lie_outside_the_ephemeral_ports():
    """No connection made before the job's stores listen can take them."""
    low, high = ephemeral_ports()
    for _ in range(20):
        port = free_port(span=2)
        assert not (low <= port <= high or low <= port + 1 <= high), port
        assert can_bind(port) and can_bind(port + 1)
