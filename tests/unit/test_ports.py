"""Server ports come from below the ephemeral range, so nothing else is handed them while
a Triton server loads its models (it binds only afterwards)."""

import socket

from orchestrator.ports import _ephemeral_floor, free_ports


def test_free_ports_are_distinct_bindable_and_not_ephemeral():
    ports = free_ports(12)
    assert len(set(ports)) == 12
    assert all(10000 <= p < _ephemeral_floor() for p in ports)
    for port in ports:
        with socket.socket() as sock:
            sock.bind(("127.0.0.1", port))
