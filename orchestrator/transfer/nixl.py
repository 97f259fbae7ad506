"""NIXL transport: prefill pulls embeddings straight out of the encoder's registered pool.

Pool layout, nonces and the pin lifecycle are shared with Mooncake
(``orchestrator.transfer.registered``). The producer serves its NIXL agent metadata on a
small TCP side channel; the consumer's READ carries the handle id as its NIXL notification.
Neither side runs NIXL's progress thread (it spins a core per agent): the producer's poll
thread progresses UCX, the consumer polls its own transfer.

Environment: UCX picks its transports itself (``cma`` + ``tcp`` on one host, ``tcp``
across hosts without RDMA). On hosts that carry Debian's ``ibverbs-providers`` but no
RDMA NIC, export ``UCX_MODULES=^ib`` before starting the process (it is not set here:
it would also switch off InfiniBand where it exists). NIXL is not fork-safe: start
processes that use this module with ``spawn`` or ``subprocess``, never ``fork``.
"""

from __future__ import annotations

import contextlib
import logging
import os
import secrets
import socket
import socketserver
import struct
import threading
import time
from collections.abc import Iterator
from typing import Any

import numpy as np

from orchestrator.protocol import EmbeddingHandle, NixlLocation, TransferError
from orchestrator.transfer.base import (
    ConsumerConfig,
    EmbeddingConsumer,
    ProducerConfig,
    destination_bytes,
    location_of,
)
from orchestrator.transfer.registered import (
    NONCE_BYTES,
    PoolProducer,
    ReceiveBuffer,
    Slot,
    check_frame,
    check_nonces,
)

log = logging.getLogger(__name__)

_LEN = struct.Struct("!Q")
_MAX_METADATA_BYTES = 16 << 20


def _new_agent(prefix: str) -> Any:
    """A NIXL agent with the UCX backend and no progress thread, under a unique name."""
    from nixl._api import nixl_agent, nixl_agent_config

    name = f"{prefix}-{socket.gethostname()}-{os.getpid()}-{secrets.token_hex(4)}"
    return nixl_agent(name, nixl_agent_config(enable_prog_thread=False, backends=["UCX"]))


class _MetadataServer(socketserver.TCPServer):
    """Answers every connection with the agent metadata, length-prefixed, then closes."""

    allow_reuse_address = True

    def __init__(self, host: str, port: int, metadata: bytes, send_timeout_s: float) -> None:
        self.payload = _LEN.pack(len(metadata)) + metadata
        self.send_timeout_s = send_timeout_s
        super().__init__((host, port), _MetadataHandler)


class _MetadataHandler(socketserver.BaseRequestHandler):
    server: _MetadataServer

    def handle(self) -> None:
        self.request.settimeout(self.server.send_timeout_s)
        try:
            self.request.sendall(self.server.payload)
        except OSError as exc:
            log.debug("metadata side channel: send to %s failed: %s", self.client_address, exc)


class NixlProducer(PoolProducer):
    """Registers the pool with a NIXL agent and serves the agent's metadata over TCP."""

    kind = "nixl"

    def __init__(self, config: ProducerConfig) -> None:
        super().__init__(config)
        self._agent = _new_agent("epd-enc")
        self.agent_name: str = self._agent.name
        self._reg = self._agent.register_memory([(self.pool_base, self.pool_size, 0, "")], "DRAM")
        self._server = _MetadataServer(
            config.host, config.port, self._agent.get_agent_metadata(), send_timeout_s=5.0
        )
        self.metadata_addr = f"{self.advertise}:{self._server.server_address[1]}"
        self._server_thread = threading.Thread(
            target=self._server.serve_forever, args=(0.2,), name="nixl-metadata", daemon=True
        )
        self._server_thread.start()
        self.start_polling()
        log.info(
            "NIXL producer %s: %d MiB pool, metadata at %s",
            self.agent_name,
            self.pool_size >> 20,
            self.metadata_addr,
        )

    def _location(self, slot: Slot) -> NixlLocation:
        return NixlLocation(
            agent=self.agent_name,
            metadata_addr=self.metadata_addr,
            addr=self.pool_base + slot.offset,
            length=slot.length,
            nonce=slot.nonce.hex(),
        )

    def _notifications(self) -> list[str]:
        notifs = self._agent.get_new_notifs()
        return [msg.decode("utf-8", "replace") for msgs in notifs.values() for msg in msgs]

    def close(self) -> None:
        super().close()
        if self.stop_polling():
            self._server.shutdown()
            self._server.server_close()
            self._agent.deregister_memory(self._reg)


class NixlConsumer(EmbeddingConsumer):
    """One agent; fetches are serialised on it. Payloads land in the caller's array; a
    small registered buffer takes the framing nonces."""

    kind = "nixl"

    def __init__(self, config: ConsumerConfig) -> None:
        super().__init__(config)
        self._lock = threading.Lock()
        self._agent = _new_agent("epd-pre")
        self.agent_name: str = self._agent.name
        self._remotes: set[str] = set()
        self._stuck: list[tuple[Any, np.ndarray | None, Any]] = []  # abandoned READs
        self._closed = False
        with self._lock:
            self._nonces = ReceiveBuffer(
                lambda addr, size: self._agent.register_memory([(addr, size, 0, "")], "DRAM"),
                self._agent.deregister_memory,
                2 * NONCE_BYTES,
            )

    def fetch_into(self, handle: EmbeddingHandle, out: np.ndarray) -> None:
        """One READ of three pieces: the slot's nonces into the nonce buffer, the payload
        straight into ``out``, registered for the READ (microseconds for DRAM)."""
        loc: NixlLocation = location_of(handle, self.kind)
        dest = destination_bytes(handle, out)
        nonce = check_frame(handle, loc.length, loc.nonce)
        size = handle.nbytes
        with self._connected(loc):
            frame = self._nonces.ensure(2 * NONCE_BYTES)
            self._read(
                handle.handle_id,
                loc,
                [
                    (frame.ctypes.data, loc.addr, NONCE_BYTES),
                    (dest.ctypes.data, loc.addr + NONCE_BYTES, size),
                    (frame.ctypes.data + NONCE_BYTES, loc.addr + NONCE_BYTES + size, NONCE_BYTES),
                ],
                dest,
            )
            check_nonces(handle, frame[:NONCE_BYTES], frame[NONCE_BYTES:], nonce, loc.agent)

    def release(self, handle: EmbeddingHandle) -> None:
        """A READ of the slot's leading nonce, carrying the handle id as its notification."""
        loc: NixlLocation = location_of(handle, self.kind)
        with self._connected(loc):
            # A bare send_notif never arrived in testing (this side runs no progress
            # thread); a 16-byte READ with the notification attached does.
            frame = self._nonces.ensure(NONCE_BYTES)
            self._read(handle.handle_id, loc, [(frame.ctypes.data, loc.addr, NONCE_BYTES)])

    @contextlib.contextmanager
    def _connected(self, loc: NixlLocation) -> Iterator[None]:
        """Hold the agent with ``loc``'s producer known to it. The side channel is dialled
        outside the lock, so a slow producer does not stall fetches from others."""
        timeout = self.config.connect_timeout_s
        metadata = None if loc.agent in self._remotes else _fetch_metadata(loc, timeout)
        with self._lock:
            if self._closed:
                raise TransferError("consumer is closed")
            if loc.agent not in self._remotes:
                self._add_remote(loc, metadata or _fetch_metadata(loc, timeout))
            yield

    def _add_remote(self, loc: NixlLocation, metadata: bytes) -> None:
        try:
            name = self._agent.add_remote_agent(metadata)
        except Exception as exc:
            raise TransferError(
                f"producer {loc.agent}: bad metadata from {loc.metadata_addr}: {exc}"
            ) from exc
        name = name.decode() if isinstance(name, bytes) else name
        self._remotes.add(name)
        if name != loc.agent:
            raise TransferError(
                f"producer {loc.agent} is gone: {loc.metadata_addr} now serves agent {name} "
                "(encoder restarted?); the handle is unknown there"
            )

    def _forget(self, agent: str) -> None:
        """Drop a peer after a failed READ so the next fetch re-dials its side channel."""
        self._remotes.discard(agent)
        try:
            self._agent.remove_remote_agent(agent)
        except Exception as exc:
            log.debug("remove_remote_agent(%s): %s", agent, exc)

    def _read(
        self,
        hid: str,
        loc: NixlLocation,
        pieces: list[tuple[int, int, int]],
        dest: np.ndarray | None = None,
    ) -> None:
        """One READ of ``(local address, remote address, length)`` pieces from ``loc``'s
        producer, bounded by ``xfer_timeout_s``, the handle id as its notification.
        ``dest`` (if any) is registered for the READ's duration."""
        agent = self._agent
        landing = None
        if dest is not None:
            landing = agent.register_memory([(dest.ctypes.data, dest.nbytes, 0, "")], "DRAM")
        state = "ERR"
        try:
            xfer = agent.initialize_xfer(
                "READ",
                agent.get_xfer_descs([(local, n, 0) for local, _, n in pieces], "DRAM"),
                agent.get_xfer_descs([(remote, n, 0) for _, remote, n in pieces], "DRAM"),
                loc.agent,
                hid.encode(),
            )
        except Exception as exc:
            if landing is not None:
                agent.deregister_memory(landing)
            self._forget(loc.agent)
            raise TransferError(
                f"NIXL READ of handle {hid} from {loc.agent} could not start "
                f"(producer gone or region not registered): {exc}"
            ) from exc
        deadline = time.monotonic() + self.config.xfer_timeout_s
        try:
            state = agent.transfer(xfer)
            while state == "PROC" and time.monotonic() < deadline:
                time.sleep(self.config.poll_interval_s)
                state = agent.check_xfer_state(xfer)
        except Exception as exc:
            log.debug("NIXL READ of %s: %s", hid, exc)
            state = "ERR"
        if state == "DONE":
            agent.release_xfer_handle(xfer)
            if landing is not None:
                agent.deregister_memory(landing)
            return
        self._forget(loc.agent)
        with contextlib.suppress(Exception):
            agent.release_xfer_handle(xfer)
        # Over UCX's tcp transport a READ given up on can still land later (and
        # deregistering under it corrupted the heap in testing): its buffers stay alive and
        # registered for the life of the consumer.
        self._stuck.append((xfer, dest, landing))
        self._nonces.retire()
        kept = sum(d.nbytes for _, d, _ in self._stuck if d is not None)
        log.warning("NIXL READ of %s abandoned; %d bytes of landing buffers kept", hid, kept)
        what = f"timed out after {self.config.xfer_timeout_s}s" if state == "PROC" else "failed"
        raise TransferError(
            f"NIXL READ of handle {hid} from producer {loc.agent} {what} "
            "(producer dead or unreachable?)"
        )

    def close(self) -> None:
        with self._lock:
            if self._closed:
                return
            self._closed = True
            self._nonces.release()


def _fetch_metadata(loc: NixlLocation, timeout_s: float) -> bytes:
    """Read a producer's agent metadata from its side channel, within ``timeout_s`` overall."""
    host, _, port = loc.metadata_addr.rpartition(":")
    deadline = time.monotonic() + timeout_s
    try:
        with socket.create_connection((host.strip("[]"), int(port)), timeout=timeout_s) as sock:
            header = _recv_exact(sock, _LEN.size, deadline)
            (size,) = _LEN.unpack(header)
            if size > _MAX_METADATA_BYTES:
                raise TransferError(f"producer {loc.agent}: metadata of {size} bytes announced")
            return _recv_exact(sock, size, deadline)
    except (OSError, ValueError) as exc:
        raise TransferError(
            f"producer {loc.agent} unreachable at {loc.metadata_addr}: {exc or type(exc).__name__}"
        ) from exc


def _recv_exact(sock: socket.socket, n: int, deadline: float) -> bytes:
    chunks = bytearray()
    while len(chunks) < n:
        remaining = deadline - time.monotonic()
        if remaining <= 0:
            raise TimeoutError("timed out reading metadata")
        sock.settimeout(remaining)
        chunk = sock.recv(n - len(chunks))
        if not chunk:
            raise ConnectionError(f"connection closed after {len(chunks)} of {n} bytes")
        chunks += chunk
    return bytes(chunks)
