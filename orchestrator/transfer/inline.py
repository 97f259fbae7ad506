"""The A/B baseline: embedding bytes travel base64-encoded inside the handle itself."""

from __future__ import annotations

import base64
import binascii
from dataclasses import dataclass

import numpy as np

from orchestrator.protocol import EmbeddingHandle, InlinePayload, TransferError
from orchestrator.transfer.base import (
    EmbeddingConsumer,
    EmbeddingProducer,
    ProducerConfig,
    StorageUsage,
    destination_bytes,
    location_of,
)


class InlineProducer(EmbeddingProducer):
    """Keeps the base64 text of each embedding; a handle carries a copy of it, so handles
    pin nothing and the cache only saves re-encoding repeated images."""

    kind = "inline"
    pins_until_pulled = False

    def __init__(self, config: ProducerConfig) -> None:
        super().__init__(config)
        self._bytes_in_use = 0

    def _check_size(self, nbytes: int) -> None:
        if _b64_size(nbytes) > self.config.pool_bytes:
            raise ValueError(
                f"embedding of {nbytes} bytes exceeds the cache budget "
                f"({self.config.pool_bytes} bytes): raise pool_bytes"
            )

    def _reserve(self, nbytes: int) -> tuple[_Slot, int] | None:
        size = _b64_size(nbytes)
        if self._bytes_in_use + size > self.config.pool_bytes:
            return None
        self._bytes_in_use += size
        return _Slot(size), size

    def _fill(self, slot: _Slot, embeds: np.ndarray) -> None:
        slot.data_b64 = base64.b64encode(embeds.reshape(-1).view(np.uint8).data).decode("ascii")

    def _discard(self, slot: _Slot) -> None:
        self._bytes_in_use -= slot.size

    def _location(self, slot: _Slot) -> InlinePayload:
        return InlinePayload(data_b64=slot.data_b64)

    def _usage(self) -> StorageUsage:
        free = self.config.pool_bytes - self._bytes_in_use
        return StorageUsage(self._bytes_in_use, free, self.config.pool_bytes, free * 3 // 4)


@dataclass
class _Slot:
    size: int
    data_b64: str = ""


def _b64_size(nbytes: int) -> int:
    return -(-nbytes // 3) * 4


class InlineConsumer(EmbeddingConsumer):
    """Decodes the payload, checking it against the handle's shape and dtype."""

    kind = "inline"

    def fetch_into(self, handle: EmbeddingHandle, out: np.ndarray) -> None:
        loc: InlinePayload = location_of(handle, self.kind)
        dest = destination_bytes(handle, out)
        hid = handle.handle_id
        try:
            raw = base64.b64decode(loc.data_b64, validate=True)
        except binascii.Error as exc:
            raise TransferError(f"handle {hid}: payload is not base64: {exc}") from None
        if len(raw) != handle.nbytes:
            raise TransferError(
                f"handle {hid}: payload has {len(raw)} bytes, shape {handle.shape} "
                f"of {handle.dtype} needs {handle.nbytes}"
            )
        dest[:] = np.frombuffer(raw, np.uint8)
