"""Separate "hosts" on one machine: one Linux network namespace per host, all on one bridge.

Each host gets its own address on a private /24 that exists only on this bridge, and knows
the others by name; the test process reaches them through the bridge's own address.
Everything is deleted afterwards, also when the test fails.
"""

from __future__ import annotations

import contextlib
import os
import shutil
import subprocess
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path


@dataclass(frozen=True)
class Host:
    netns: str
    ip: str


def _ip(*args: str, netns: str | None = None) -> None:
    cmd = ["ip", "netns", "exec", netns, "ip", *args] if netns else ["ip", *args]
    proc = subprocess.run(cmd, capture_output=True, text=True, timeout=30)
    if proc.returncode:
        raise RuntimeError(f"{' '.join(cmd)}: {proc.stderr.strip()}")


def can_create_namespaces() -> str | None:
    """``None`` if this process may create namespaces, else why not."""
    if os.geteuid() != 0:
        return "network namespaces need root"
    try:
        subprocess.run(["ip", "-V"], capture_output=True, check=True, timeout=10)
    except (OSError, subprocess.CalledProcessError) as exc:
        return f"iproute2 is not usable: {exc}"
    return None


@contextlib.contextmanager
def isolated_hosts(names: list[str]) -> Iterator[dict[str, Host]]:
    """One namespace per name, bridged together and to this process; yields them by name."""
    tag = os.getpid() % 100000
    subnet = f"10.213.{os.getpid() % 250}"
    bridge = f"epdbr{tag}"
    namespaces: list[str] = []
    try:
        _ip("link", "add", bridge, "type", "bridge")
        _ip("addr", "add", f"{subnet}.1/24", "dev", bridge)
        _ip("link", "set", bridge, "up")
        hosts = {}
        for i, name in enumerate(names):
            netns, outside, inside = f"epd{tag}-{name}", f"epd{tag}v{i}", f"epd{tag}p{i}"
            _ip("netns", "add", netns)
            namespaces.append(netns)
            _ip("link", "add", outside, "type", "veth", "peer", "name", inside)
            _ip("link", "set", inside, "netns", netns)
            _ip("link", "set", outside, "master", bridge, "up")
            ip = f"{subnet}.{10 + i}"
            _ip("addr", "add", f"{ip}/24", "dev", inside, netns=netns)
            _ip("link", "set", inside, "up", netns=netns)
            _ip("link", "set", "lo", "up", netns=netns)
            hosts[name] = Host(netns, ip)
        # `ip netns exec` mounts /etc/netns/NS/hosts over /etc/hosts: the hosts know each
        # other by name, as containers or pods on one network do.
        table = "127.0.0.1 localhost\n" + "".join(f"{h.ip} {n}\n" for n, h in hosts.items())
        for host in hosts.values():
            etc = Path("/etc/netns") / host.netns
            etc.mkdir(parents=True, exist_ok=True)
            (etc / "hosts").write_text(table)
        yield hosts
    finally:
        for netns in namespaces:  # deleting a namespace deletes its end of the veth pair
            shutil.rmtree(Path("/etc/netns") / netns, ignore_errors=True)
            with contextlib.suppress(RuntimeError):
                _ip("netns", "del", netns)
        with contextlib.suppress(RuntimeError):
            _ip("link", "del", bridge)
