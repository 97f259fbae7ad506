"""Picking TCP ports for servers we start ourselves."""

from __future__ import annotations

import random
import socket
from pathlib import Path


def _ephemeral_floor() -> int:
    try:
        return int(Path("/proc/sys/net/ipv4/ip_local_port_range").read_text().split()[0])
    except (OSError, ValueError, IndexError):
        return 32768


def free_ports(n: int, host: str = "127.0.0.1") -> list[int]:
    """``n`` distinct ports free on ``host`` now, chosen *below* the kernel's ephemeral range.

    Triton binds its ports only after loading every model (tens of seconds); a port taken
    from the ephemeral range could meanwhile be handed to any outgoing connection or
    port-0 listener (NIXL, zmq), and the server would fail to start.
    """
    rng = random.Random()
    top = _ephemeral_floor()
    ports: list[int] = []
    for _ in range(1000 * n):
        port = rng.randrange(10000, top)
        if port in ports:
            continue
        with socket.socket() as sock:
            sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
            try:
                sock.bind((host, port))
            except OSError:
                continue
        ports.append(port)
        if len(ports) == n:
            return ports
    raise RuntimeError(f"could not find {n} free ports on {host} below {top}")
