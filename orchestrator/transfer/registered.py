"""What the one-sided transports (NIXL, Mooncake) share: a registered DRAM pool on the
encoder that consumers READ from, and a registered buffer on prefill (Mooncake lands whole
slots in it, NIXL only their nonces: its payload READs land in the caller's array).

Slot layout in the producer's pool: ``nonce | payload | nonce`` (``NONCE_BYTES`` each
side). The nonce is random per stored embedding and zeroed when it is evicted, so a
consumer that reads an evicted or reused slot sees a mismatch instead of someone else's
bytes. Each READ carries the handle id as a notification; the producer's poll thread
unpins the handle when it arrives, and unpins handles that expired unpulled (after
``reclaim_grace_s``). Unpinned embeddings stay cached until evicted (``orchestrator.cache``).
"""

from __future__ import annotations

import logging
import secrets
import threading
import time
from abc import abstractmethod
from dataclasses import dataclass

import numpy as np

from orchestrator.protocol import EmbeddingHandle, TransferError
from orchestrator.transfer.base import (
    EmbeddingProducer,
    ProducerConfig,
    StorageUsage,
)
from orchestrator.transfer.pool import BlockPool

log = logging.getLogger(__name__)

NONCE_BYTES = 16
WILDCARDS = ("", "0.0.0.0", "::")


@dataclass(frozen=True)
class Slot:
    offset: int
    length: int
    nonce: bytes


class PoolProducer(EmbeddingProducer):
    """Keeps embeddings in one DRAM pool that a transport registers once at start.

    Subclasses register ``self.pool_base`` / ``self.pool_size`` with their engine, say what
    a handle's location is, and hand over the handle ids their READ notifications carried.
    """

    def __init__(self, config: ProducerConfig) -> None:
        super().__init__(config)
        self.advertise = config.advertise_host or config.host
        if self.advertise in WILDCARDS:
            raise ValueError(f"host {config.host!r} is a wildcard: set advertise_host")
        self._pool = BlockPool(config.pool_bytes, config.block_bytes)
        self._buf = np.empty(self._pool.total_bytes, np.uint8)
        self._buf.fill(0)  # fault the pages in now, not on the first puts
        self.pool_base: int = self._buf.ctypes.data
        self.pool_size: int = self._buf.nbytes
        self._stop = threading.Event()
        self._lent = threading.Event()  # a handle was lent since the poller last looked
        self._poller = threading.Thread(target=self._poll, name="epd-notifs", daemon=True)

    def start_polling(self) -> None:
        """Start the notification thread (once the transport is set up)."""
        self._poller.start()

    @abstractmethod
    def _notifications(self) -> list[str]:
        """Handle ids from READ notifications received since the last call."""

    def _check_size(self, nbytes: int) -> None:
        if self._pool.blocks_for(nbytes + 2 * NONCE_BYTES) > self._pool.num_blocks:
            raise ValueError(
                f"embedding of {nbytes} bytes exceeds the whole pool "
                f"({self._pool.total_bytes} bytes): raise pool_bytes"
            )

    def _reserve(self, nbytes: int) -> tuple[Slot, int] | None:
        length = nbytes + 2 * NONCE_BYTES
        offset = self._pool.alloc(length)
        if offset is None:
            return None
        slot = Slot(offset, length, secrets.token_bytes(NONCE_BYTES))
        return slot, self._pool.blocks_for(length) * self._pool.block_bytes

    def _fill(self, slot: Slot, embeds: np.ndarray) -> None:
        region = self._buf[slot.offset : slot.offset + slot.length]
        region[NONCE_BYTES:-NONCE_BYTES] = embeds.reshape(-1).view(np.uint8)
        region[:NONCE_BYTES] = np.frombuffer(slot.nonce, np.uint8)
        region[-NONCE_BYTES:] = np.frombuffer(slot.nonce, np.uint8)

    def _discard(self, slot: Slot) -> None:
        """Zero the nonces (a late reader then fails cleanly) and return the blocks."""
        self._buf[slot.offset : slot.offset + NONCE_BYTES] = 0
        self._buf[slot.offset + slot.length - NONCE_BYTES : slot.offset + slot.length] = 0
        self._pool.free(slot.offset)

    def _usage(self) -> StorageUsage:
        usage = self._pool.usage()
        return StorageUsage(
            bytes_in_use=usage.bytes_in_use,
            bytes_free=usage.bytes_free,
            pool_bytes=self._pool.total_bytes,
            largest_free=max(0, usage.largest_free - 2 * NONCE_BYTES),
        )

    def lookup(self, content_hash: str) -> EmbeddingHandle | None:
        handle = super().lookup(content_hash)
        if handle is not None:
            self._lent.set()
        return handle

    def put(self, embeds: np.ndarray, **kwargs) -> EmbeddingHandle:  # noqa: ANN003
        handle = super().put(embeds, **kwargs)
        self._lent.set()
        return handle

    def _poll(self) -> None:
        """Unpin handles whose READ completed or whose TTL passed: every ``poll_interval_s``
        while handles are lent out, every ``idle_poll_interval_s`` (or as soon as one is
        lent) while none is.

        The only thread that asks the engine for notifications after start-up (for NIXL
        over UCX's ``tcp`` this also progresses the transfers consumers are waiting on).
        """
        while not self._stop.is_set():
            if self._table.pinned_handles:  # an int read: no lock needed to decide a sleep
                self._stop.wait(self.config.poll_interval_s)
            else:
                self._lent.wait(self.config.idle_poll_interval_s)
            self._lent.clear()
            if self._stop.is_set():
                return
            try:
                handle_ids = self._notifications()
            except Exception:
                log.exception("reading transfer notifications failed")
                continue
            with self._lock:
                for handle_id in handle_ids:
                    self._unpin(handle_id)
                self._expire(time.monotonic())

    def stop_polling(self) -> bool:
        """Stop the poll thread; False if it was already stopped (close is idempotent)."""
        if self._stop.is_set():
            return False
        self._stop.set()
        self._lent.set()
        if self._poller.is_alive():
            self._poller.join(timeout=5)
        return True


def check_frame(handle: EmbeddingHandle, length: int, nonce_hex: str) -> np.ndarray:
    """Validate a handle before reading: the region frames the payload; the nonce. (Expiry
    is the producer's business: a slot it reclaimed fails the nonce check after the READ.)"""
    hid = handle.handle_id
    if length != handle.nbytes + 2 * NONCE_BYTES:
        raise TransferError(
            f"handle {hid}: region of {length} bytes does not frame {handle.nbytes} payload bytes"
        )
    try:
        return np.frombuffer(bytes.fromhex(nonce_hex), np.uint8)
    except ValueError:
        raise TransferError(f"handle {hid}: nonce {nonce_hex!r} is not hex") from None


def check_nonces(
    handle: EmbeddingHandle, head: np.ndarray, tail: np.ndarray, nonce: np.ndarray, peer: str
) -> None:
    """Refuse a READ whose framing nonces are no longer the handle's."""
    if not (np.array_equal(head, nonce) and np.array_equal(tail, nonce)):
        raise TransferError(
            f"handle {handle.handle_id} is unknown or was released: its slot in {peer} no "
            "longer holds it (evicted, or pulled or released with the cache off)"
        )


class ReceiveBuffer:
    """A consumer's registered landing buffer, re-registered larger on demand.

    ``register(addr, size)`` returns whatever ``deregister`` needs to undo it. A READ that
    timed out and could not be cancelled may still land, so its buffer is retired (kept
    alive and registered) instead of reused.
    """

    def __init__(self, register, deregister, initial_bytes: int) -> None:  # noqa: ANN001
        self._register = register
        self._deregister = deregister
        self._buf = np.empty(0, np.uint8)
        self._reg: object = None
        self._retired: list[tuple[np.ndarray, object]] = []
        self.ensure(initial_bytes)

    @property
    def address(self) -> int:
        return self._buf.ctypes.data

    def ensure(self, nbytes: int) -> np.ndarray:
        if self._buf.nbytes < nbytes:
            size = max(nbytes, 2 * self._buf.nbytes)
            self.release()
            self._buf = np.empty(size, np.uint8)
            self._buf.fill(0)  # fault the pages in now, not during the READ
            self._reg = self._register(self._buf.ctypes.data, size)
        return self._buf

    def retire(self) -> None:
        self._retired.append((self._buf, self._reg))
        self._buf, self._reg = np.empty(0, np.uint8), None

    def release(self) -> None:
        if self._reg is not None:
            self._deregister(self._reg)
            self._reg = None
