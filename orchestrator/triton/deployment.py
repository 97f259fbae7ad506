"""Bring up every server of a topology, wait for all to be ready, take them all down.

Used by ``epd serve`` and by the integration tests, so what the tests run is what users run.
"""

from __future__ import annotations

import contextlib
import fcntl
import os
import socket
import time
from collections.abc import Callable, Iterator, Mapping
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

from orchestrator.auth import SECRET_ENV, DeploymentKey, new_secret
from orchestrator.config import PUBLIC_STAGES, Topology
from orchestrator.families import ModelFamily
from orchestrator.openai_server.launch import OpenAIFront
from orchestrator.ports import free_ports
from orchestrator.triton.repository import render
from orchestrator.triton.server import TritonInstall, TritonServer


def preflight(topology: Topology) -> ModelFamily:
    """Check the checkpoint, its family and the embedding pool size; raise ``ValueError``."""
    from orchestrator.families import family_for
    from orchestrator.transfer import pool_bytes_for

    family = family_for(topology.model)
    if topology.servers_of("encode"):
        pool_bytes_for(topology.transfer.pool_bytes, family.max_image_bytes())
    return family


def triton_installs(
    topology: Topology,
    servers: list[str],
    find: Callable[[Path | None], TritonInstall] = TritonInstall.find,
) -> dict[str, TritonInstall]:
    """The Triton each of ``servers`` runs (``find`` picks it from the server's
    ``triton``), checked against what it hosts: a TensorRT vision encoder needs an install
    with the TensorRT backend (``ValueError`` otherwise)."""
    installs = {}
    for name in servers:
        spec = topology.servers[name]
        install = find(spec.triton)
        if "encode" in spec.stages and topology.encoder.runtime == "tensorrt":
            install.require_backend("tensorrt", f"server {name!r} (encoder.runtime tensorrt)")
        installs[name] = install
    return installs


def deployment_secret(shared: bool, env: Mapping[str, str] = os.environ) -> str:
    """The deployment's secret: ``EPD_DEPLOYMENT_SECRET`` when set; else a new one, unless
    it must be ``shared`` with servers this process does not start (internal stages on
    other hosts): then ``ValueError`` saying how to set it."""
    secret = env.get(SECRET_ENV)
    if secret:
        DeploymentKey(secret)  # long enough
        return secret
    if not shared:
        return new_secret()
    raise ValueError(
        f"set {SECRET_ENV} to the same secret on every host of this deployment "
        "(`python -c 'import secrets; print(secrets.token_hex(32))'`)"
    )


class DeploymentBusy(RuntimeError):
    """Another deployment holds the work directory or a port this one needs."""


def _port_in_use(host: str, port: int) -> bool:
    with socket.socket() as sock:
        sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        try:
            sock.bind((host, port))
        except OSError:
            return True
    return False


def on_free_ports(topology: Topology) -> Topology:
    """``topology`` with every server moved to free loopback ports, so a benchmark never
    collides with an ``epd serve`` on the default ports."""
    ports = iter(free_ports(4 * len(topology.servers)))
    data = topology.model_dump()
    for server in data["servers"].values():
        server.update(
            host="127.0.0.1",
            bind=None,
            http_port=next(ports),
            grpc_port=next(ports),
            metrics_port=next(ports),
            openai_port=next(ports) if server["openai_port"] else None,
        )
    return Topology.model_validate(data)


class Deployment:
    """The Triton servers of one topology, rendered under ``workdir``."""

    def __init__(
        self,
        topology: Topology,
        workdir: Path,
        only: list[str] | None = None,
        progress: Callable[[str], None] | None = None,
    ) -> None:
        """``only`` names the servers to start here (one host of a multi-host topology);
        by default all of them. ``progress`` receives a line per step while servers come up
        (and the encoder export draws its bar).

        The checkpoint and what depends on it are checked here, before anything starts:
        raises ``ValueError`` (a ``CheckpointError`` naming the file, an unsupported family
        listing the supported ones, a pool too small for one image)."""
        unknown = set(only or ()) - set(topology.servers)
        if unknown:
            raise ValueError(f"no such server(s) in the topology: {sorted(unknown)}")
        self.family = preflight(topology)
        internal = any(set(spec.stages) - PUBLIC_STAGES for spec in topology.servers.values())
        self.secret = deployment_secret(
            shared=internal and bool(only) and set(only) != set(topology.servers)
        )
        self.progress = progress
        self.topology = topology
        self.local = {n: s for n, s in topology.servers.items() if not only or n in only}
        self.installs = triton_installs(topology, list(self.local))
        self.workdir = workdir.resolve()
        self.servers: dict[str, TritonServer] = {}
        self.openai: dict[str, OpenAIFront] = {}
        """The OpenAI front of each local server with an ``openai_port``, by server name."""
        self._lock: int | None = None

    def _acquire(self) -> None:
        self.workdir.mkdir(parents=True, exist_ok=True)
        fd = os.open(self.workdir / "serve.lock", os.O_RDWR | os.O_CREAT, 0o644)
        try:
            fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
        except BlockingIOError:
            owner = os.read(fd, 32).decode(errors="replace").strip() or "?"
            os.close(fd)
            raise DeploymentBusy(
                f"another `epd serve` (pid {owner}) is running from {self.workdir}; "
                "stop it first (Ctrl-C) or use another --workdir"
            ) from None
        os.ftruncate(fd, 0)
        os.write(fd, str(os.getpid()).encode())
        self._lock = fd
        busy = [
            f"{name} {spec.host}:{port}"
            for name, spec in self.local.items()
            for port in spec.ports
            if spec.netns is None and _port_in_use(spec.bind_address, port)
        ]
        if busy:
            self._release()
            raise DeploymentBusy(f"ports already in use: {', '.join(busy)}")

    def _release(self) -> None:
        if self._lock is not None:
            os.close(self._lock)
            self._lock = None

    def start(self, timeout_s: float = 300) -> None:
        """Render, start all servers at once (vLLM engines build in parallel), wait ready."""
        self._acquire()
        say = self.progress or (lambda line: None)
        try:
            repos = render(self.topology, self.workdir / "repos", progress=bool(self.progress))
            started = time.monotonic()
            for name, spec in self.local.items():
                server = TritonServer(
                    model_repository=repos[name],
                    host=spec.bind_address,
                    probe_host=spec.host,
                    http_port=spec.http_port,
                    grpc_port=spec.grpc_port,
                    metrics_port=spec.metrics_port,
                    log_path=self.workdir / "logs" / f"{name}.log",
                    env={**spec.env, SECRET_ENV: self.secret},
                    edge_token=DeploymentKey(self.secret).edge_token,
                    internal_only=not PUBLIC_STAGES & set(spec.stages),
                    install=self.installs[name],
                    netns=spec.netns,
                    cpus=spec.cpus,
                )
                self.servers[name] = server
                server.start()
                say(
                    f"  {name}: starting ({', '.join(spec.stages)}) on "
                    f"{self.installs[name].describe()}, log {server.log_path}"
                )
            for name, server in self.servers.items():
                server.wait_ready(timeout_s)
                say(f"  {name}: ready after {time.monotonic() - started:.1f} s")
            for name, spec in self.local.items():
                if spec.openai_port is None:
                    continue
                front = OpenAIFront(
                    topology_file=self.workdir / "repos" / "topology.json",
                    server=name,
                    spec=spec,
                    log_path=self.workdir / "logs" / f"{name}-openai.log",
                    env={SECRET_ENV: self.secret},
                )
                self.openai[name] = front
                front.start()
            for name, front in self.openai.items():
                front.wait_ready(timeout_s)
                say(f"  {name}: OpenAI API at {front.url}/v1")
        except BaseException:
            self.stop()
            raise

    def stop(self) -> None:
        """Stop the OpenAI fronts, then all servers in parallel (each may wait out
        Triton's exit timeout)."""
        for front in self.openai.values():
            front.stop()
        self.openai.clear()
        with ThreadPoolExecutor(max(1, len(self.servers))) as pool:
            list(pool.map(TritonServer.stop, self.servers.values()))
        self.servers.clear()
        self._release()

    @contextlib.contextmanager
    def running(self, timeout_s: float = 300) -> Iterator[Deployment]:
        self.start(timeout_s)
        try:
            yield self
        finally:
            self.stop()
