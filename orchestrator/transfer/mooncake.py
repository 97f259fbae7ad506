"""Mooncake TransferEngine transport: the same one-sided pull as NIXL, another engine.

Both sides run a TransferEngine in ``P2PHANDSHAKE`` mode (no etcd or metadata server: a
handle names the producer's session ``host:rpc_port``, and the engines exchange segment
descriptors on first contact). The producer registers its pool once; the consumer READs a
slot with the handle id attached as a Mooncake notification, which the producer's poll
thread turns into an unpin -- the same lifecycle as NIXL (``registered.py``).

Install: ``mooncake-transfer-engine-non-cuda`` (CPU hosts; the CUDA build elsewhere) needs
``libibverbs.so.1`` (Debian ``libibverbs1``, without recommends), ``libnuma1`` and
``libcurl4``. Traps measured here: the engine listens on all interfaces (its port range is
``MC_MIN_RPC_PORT``/``MC_MAX_RPC_PORT``) with no authentication, so registered memory is
readable by whoever reaches those ports -- keep it on a private network; the first contact
with a peer that hangs (alive but not answering) blocks that engine for ~60 s whatever the
timeouts; a synchronous transfer spins its calling thread. Not fork-safe.
"""

from __future__ import annotations

import logging
import math
import os
import threading
from typing import Any

import numpy as np

from orchestrator.protocol import EmbeddingHandle, MooncakeLocation, TransferError
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


def _engine(host: str) -> Any:
    from mooncake.engine import TransferEngine

    engine = TransferEngine()
    if engine.initialize(host, "P2PHANDSHAKE", "tcp", "") != 0:
        raise RuntimeError(f"Mooncake TransferEngine failed to initialize on {host}")
    return engine


def _register(engine: Any, addr: int, size: int) -> int:
    if engine.register_memory(addr, size) != 0:
        raise RuntimeError(f"Mooncake could not register {size} bytes")
    return addr


class MooncakeProducer(PoolProducer):
    """Registers the pool with a TransferEngine; handles name its P2P session."""

    kind = "mooncake"

    def __init__(self, config: ProducerConfig) -> None:
        super().__init__(config)
        self._engine = _engine(self.advertise)
        _register(self._engine, self.pool_base, self.pool_size)
        self.session = f"{self.advertise}:{self._engine.get_rpc_port()}"
        self.start_polling()
        log.info("Mooncake producer %s: %d MiB pool", self.session, self.pool_size >> 20)

    def _location(self, slot: Slot) -> MooncakeLocation:
        return MooncakeLocation(
            session=self.session,
            addr=self.pool_base + slot.offset,
            length=slot.length,
            nonce=slot.nonce.hex(),
        )

    def _notifications(self) -> list[str]:
        return [notify.msg for notify in self._engine.get_notifies()]

    def close(self) -> None:
        super().close()
        if self.stop_polling():
            self._engine.unregister_memory(self.pool_base)


class MooncakeConsumer(EmbeddingConsumer):
    """One engine and one registered receive buffer; fetches are serialised on them."""

    kind = "mooncake"

    def __init__(self, config: ConsumerConfig) -> None:
        super().__init__(config)
        self._lock = threading.Lock()
        # The engine reads its transfer deadline (whole seconds, at least 5) at construction.
        os.environ.setdefault("MC_TRANSFER_TIMEOUT", str(max(5, math.ceil(config.xfer_timeout_s))))
        self._engine = _engine(config.host)
        self._recv = ReceiveBuffer(
            lambda addr, size: _register(self._engine, addr, size),
            self._engine.unregister_memory,
            config.initial_buffer_bytes,
        )
        self._closed = False

    def fetch_into(self, handle: EmbeddingHandle, out: np.ndarray) -> None:
        """READ the framed slot into the receive buffer, then copy the payload to ``out``
        (over Mooncake's TCP path the copy is a small part of the cost)."""
        from mooncake.engine import TransferNotify, TransferOpcode

        loc: MooncakeLocation = location_of(handle, self.kind)
        dest = destination_bytes(handle, out)
        nonce = check_frame(handle, loc.length, loc.nonce)
        notify = TransferNotify()
        notify.name, notify.msg = "epd", handle.handle_id
        with self._lock:
            if self._closed:
                raise TransferError("consumer is closed")
            buf = self._recv.ensure(loc.length)
            rc = self._engine.transfer_sync(
                loc.session, buf.ctypes.data, loc.addr, loc.length, TransferOpcode.Read, notify
            )
            if rc != 0:
                raise TransferError(
                    f"Mooncake READ of handle {handle.handle_id} from {loc.session} failed "
                    f"(rc {rc}: producer dead or unreachable?)"
                )
            region = buf[: loc.length]
            check_nonces(handle, region[:NONCE_BYTES], region[-NONCE_BYTES:], nonce, loc.session)
            dest[:] = region[NONCE_BYTES:-NONCE_BYTES]

    def release(self, handle: EmbeddingHandle) -> None:
        """A READ of the slot's leading nonce, carrying the handle id as its notification."""
        from mooncake.engine import TransferNotify, TransferOpcode

        loc: MooncakeLocation = location_of(handle, self.kind)
        notify = TransferNotify()
        notify.name, notify.msg = "epd", handle.handle_id
        with self._lock:
            buf = self._recv.ensure(NONCE_BYTES)
            self._engine.transfer_sync(
                loc.session, buf.ctypes.data, loc.addr, NONCE_BYTES, TransferOpcode.Read, notify
            )

    def close(self) -> None:
        with self._lock:
            if not self._closed:
                self._closed = True
                self._recv.release()
