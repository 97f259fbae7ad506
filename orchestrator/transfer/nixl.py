"""NIXL transport: prefill pulls embeddings straight out of the encoder's registered pool.

Slot layout in the producer's pool: ``nonce | payload | nonce`` (``NONCE_BYTES`` each
side). The nonce is random per stored embedding and zeroed when it is evicted, so a
consumer that reads an evicted or reused slot sees a mismatch instead of someone else's
bytes.

Lifecycle: the consumer's READ carries the handle id as its NIXL notification; the
producer's poll thread unpins the handle when that notification arrives, and unpins
handles that expired unpulled (after ``reclaim_grace_s``). Unpinned embeddings stay
cached until evicted (see ``orchestrator.cache``). Neither side runs NIXL's
progress thread (it spins a core per agent): the producer's poll thread progresses UCX,
the consumer polls its own transfer.

Environment: UCX picks its transports itself (``cma`` + ``tcp`` on one host, ``tcp``
across hosts without RDMA). On hosts that carry Debian's ``ibverbs-providers`` but no
RDMA NIC, export ``UCX_MODULES=^ib`` before starting the process (it is not set here:
it would also switch off InfiniBand where it exists). NIXL is not fork-safe: start
processes that use this module with ``spawn`` or ``subprocess``, never ``fork``.
"""

from __future__ import annotations

import logging
import os
import secrets
import socket
import socketserver
import struct
import threading
import time
from dataclasses import dataclass
from typing import Any

import numpy as np

from orchestrator.protocol import EmbeddingHandle, NixlLocation, TransferError
from orchestrator.transfer.base import (
    ConsumerConfig,
    EmbeddingConsumer,
    EmbeddingProducer,
    ProducerConfig,
    StorageUsage,
    check_not_expired,
    numpy_dtype,
)
from orchestrator.transfer.pool import BlockPool

log = logging.getLogger(__name__)

NONCE_BYTES = 16
_LEN = struct.Struct("!Q")
_MAX_METADATA_BYTES = 16 << 20
_WILDCARDS = ("", "0.0.0.0", "::")


def _new_agent(prefix: str) -> Any:
    """A NIXL agent with the UCX backend and no progress thread, under a unique name."""
    from nixl._api import nixl_agent, nixl_agent_config

    name = f"{prefix}-{socket.gethostname()}-{os.getpid()}-{secrets.token_hex(4)}"
    return nixl_agent(name, nixl_agent_config(enable_prog_thread=False, backends=["UCX"]))


@dataclass(frozen=True)
class _Slot:
    offset: int
    length: int
    nonce: bytes


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


class NixlProducer(EmbeddingProducer):
    """Keeps embeddings in one NIXL-registered DRAM pool and serves its metadata over TCP."""

    kind = "nixl"

    def __init__(self, config: ProducerConfig) -> None:
        super().__init__(config)
        advertise = config.advertise_host or config.host
        if advertise in _WILDCARDS:
            raise ValueError(f"host {config.host!r} is a wildcard: set advertise_host")
        self._pool = BlockPool(config.pool_bytes, config.block_bytes)
        self._buf = np.empty(self._pool.total_bytes, np.uint8)
        self._buf.fill(0)  # fault the pages in now, not on the first puts
        self._base = self._buf.ctypes.data

        self._agent = _new_agent("epd-enc")
        self.agent_name: str = self._agent.name
        self._reg = self._agent.register_memory([(self._base, self._buf.nbytes, 0, "")], "DRAM")
        self._server = _MetadataServer(
            config.host, config.port, self._agent.get_agent_metadata(), send_timeout_s=5.0
        )
        self.metadata_addr = f"{advertise}:{self._server.server_address[1]}"
        self._server_thread = threading.Thread(
            target=self._server.serve_forever, args=(0.2,), name="nixl-metadata", daemon=True
        )
        self._stop = threading.Event()
        self._poller = threading.Thread(target=self._poll, name="nixl-notifs", daemon=True)
        self._server_thread.start()
        self._poller.start()
        log.info(
            "NIXL producer %s: %d MiB pool, metadata at %s",
            self.agent_name,
            self._buf.nbytes >> 20,
            self.metadata_addr,
        )

    def _check_size(self, nbytes: int) -> None:
        if self._pool.blocks_for(nbytes + 2 * NONCE_BYTES) > self._pool.num_blocks:
            raise ValueError(
                f"embedding of {nbytes} bytes exceeds the whole pool "
                f"({self._pool.total_bytes} bytes): raise pool_bytes"
            )

    def _reserve(self, nbytes: int) -> tuple[_Slot, int] | None:
        length = nbytes + 2 * NONCE_BYTES
        offset = self._pool.alloc(length)
        if offset is None:
            return None
        slot = _Slot(offset, length, secrets.token_bytes(NONCE_BYTES))
        return slot, self._pool.blocks_for(length) * self._pool.block_bytes

    def _fill(self, slot: _Slot, embeds: np.ndarray) -> None:
        region = self._buf[slot.offset : slot.offset + slot.length]
        region[NONCE_BYTES:-NONCE_BYTES] = embeds.reshape(-1).view(np.uint8)
        region[:NONCE_BYTES] = np.frombuffer(slot.nonce, np.uint8)
        region[-NONCE_BYTES:] = np.frombuffer(slot.nonce, np.uint8)

    def _discard(self, slot: _Slot) -> None:
        """Zero the nonces (a late reader then fails cleanly) and return the blocks."""
        self._buf[slot.offset : slot.offset + NONCE_BYTES] = 0
        self._buf[slot.offset + slot.length - NONCE_BYTES : slot.offset + slot.length] = 0
        self._pool.free(slot.offset)

    def _location(self, slot: _Slot) -> NixlLocation:
        return NixlLocation(
            agent=self.agent_name,
            metadata_addr=self.metadata_addr,
            addr=self._base + slot.offset,
            length=slot.length,
            nonce=slot.nonce.hex(),
        )

    def _usage(self) -> StorageUsage:
        usage = self._pool.usage()
        return StorageUsage(
            bytes_in_use=usage.bytes_in_use,
            bytes_free=usage.bytes_free,
            pool_bytes=self._pool.total_bytes,
            largest_free=max(0, usage.largest_free - 2 * NONCE_BYTES),
        )

    def _poll(self) -> None:
        """Unpin handles whose READ completed (notification = handle id) or whose TTL passed.

        The only thread that touches the agent after start-up; each call also progresses
        UCX, which reads over the ``tcp`` transport need on this side.
        """
        while not self._stop.wait(self.config.poll_interval_s):
            try:
                notifs = self._agent.get_new_notifs()
            except Exception:
                log.exception("NIXL get_new_notifs failed")
                continue
            with self._lock:
                for messages in notifs.values():
                    for msg in messages:
                        self._unpin(msg.decode("utf-8", "replace"))
                self._expire(time.time())

    def close(self) -> None:
        super().close()
        if self._stop.is_set():
            return
        self._stop.set()
        self._poller.join(timeout=5)
        self._server.shutdown()
        self._server.server_close()
        self._agent.deregister_memory(self._reg)


class NixlConsumer(EmbeddingConsumer):
    """One agent and one registered receive buffer; fetches are serialised on them."""

    kind = "nixl"

    def __init__(self, config: ConsumerConfig) -> None:
        super().__init__(config)
        self._lock = threading.Lock()
        self._agent = _new_agent("epd-pre")
        self.agent_name: str = self._agent.name
        self._remotes: set[str] = set()
        self._buf = np.empty(0, np.uint8)
        self._reg: Any = None
        self._stuck: list[tuple[Any, np.ndarray]] = []  # un-cancellable READs and their buffer
        self._closed = False
        with self._lock:
            self._ensure_buffer(config.initial_buffer_bytes)

    def fetch(self, handle: EmbeddingHandle) -> np.ndarray:
        loc = handle.location
        hid = handle.handle_id
        if not isinstance(loc, NixlLocation):
            raise TransferError(
                f"handle {hid} is a {loc.kind} handle, this consumer is nixl "
                "(encoder and prefill disagree on transfer.kind)"
            )
        check_not_expired(handle)
        if loc.length != handle.nbytes + 2 * NONCE_BYTES:
            raise TransferError(
                f"handle {hid}: region of {loc.length} bytes does not frame "
                f"{handle.nbytes} payload bytes"
            )
        try:
            nonce = np.frombuffer(bytes.fromhex(loc.nonce), np.uint8)
        except ValueError:
            raise TransferError(f"handle {hid}: nonce {loc.nonce!r} is not hex") from None
        timeout = self.config.connect_timeout_s
        # Dial outside the lock so a slow producer does not stall fetches from others.
        metadata = None if loc.agent in self._remotes else _fetch_metadata(loc, timeout)
        with self._lock:
            if self._closed:
                raise TransferError("consumer is closed")
            if loc.agent not in self._remotes:
                self._add_remote(loc, metadata or _fetch_metadata(loc, timeout))
            region = self._read(hid, loc)
            if not (
                np.array_equal(region[:NONCE_BYTES], nonce)
                and np.array_equal(region[-NONCE_BYTES:], nonce)
            ):
                raise TransferError(
                    f"handle {hid} is unknown or was released: its slot in {loc.agent} no "
                    "longer holds it (evicted, or pulled or released with the cache off)"
                )
            out = np.empty(handle.shape, numpy_dtype(handle.dtype))
            out.reshape(-1).view(np.uint8)[:] = region[NONCE_BYTES:-NONCE_BYTES]
        return out

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

    def _ensure_buffer(self, nbytes: int) -> None:
        """(Re-)register the receive buffer when it is smaller than ``nbytes``; locked."""
        if self._buf.nbytes >= nbytes:
            return
        size = max(nbytes, 2 * self._buf.nbytes)
        if self._reg is not None:
            self._agent.deregister_memory(self._reg)
            self._reg = None
        self._buf = np.empty(size, np.uint8)
        self._buf.fill(0)  # fault the pages in now, not during the READ
        self._reg = self._agent.register_memory([(self._buf.ctypes.data, size, 0, "")], "DRAM")

    def _read(self, hid: str, loc: NixlLocation) -> np.ndarray:
        """READ the remote region into the receive buffer, bounded by ``xfer_timeout_s``."""
        self._ensure_buffer(loc.length)
        agent = self._agent
        state = "ERR"
        try:
            xfer = agent.initialize_xfer(
                "READ",
                agent.get_xfer_descs([(self._buf.ctypes.data, loc.length, 0)], "DRAM"),
                agent.get_xfer_descs([(loc.addr, loc.length, 0)], "DRAM"),
                loc.agent,
                hid.encode(),
            )
        except Exception as exc:
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
            return self._buf[: loc.length]
        self._forget(loc.agent)
        try:
            agent.release_xfer_handle(xfer)
        except Exception:
            # NIXL could not cancel it: the READ may still land, so retire the buffer.
            self._stuck.append((xfer, self._buf))
            self._buf = np.empty(0, np.uint8)
            self._reg = None
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
            if self._reg is not None:
                self._agent.deregister_memory(self._reg)
                self._reg = None


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
