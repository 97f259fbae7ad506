"""The A/B baseline: embedding bytes travel base64-encoded inside the handle itself."""

from __future__ import annotations

import base64
import binascii
import time

import numpy as np

from orchestrator.protocol import EmbeddingHandle, InlinePayload, TransferError
from orchestrator.transfer.base import (
    EmbeddingConsumer,
    EmbeddingProducer,
    ProducerStats,
    as_embedding,
    check_not_expired,
    new_handle_id,
    numpy_dtype,
)


class InlineProducer(EmbeddingProducer):
    """Holds nothing: the handle is the data, so release is a no-op and stats are zero."""

    kind = "inline"

    def put(
        self, embeds: np.ndarray, *, image_grid_thw: tuple[int, int, int], content_hash: str
    ) -> EmbeddingHandle:
        arr, dtype = as_embedding(embeds)
        data_b64 = base64.b64encode(arr.view(np.uint8).data).decode("ascii")
        return EmbeddingHandle(
            handle_id=new_handle_id(),
            location=InlinePayload(data_b64=data_b64),
            shape=arr.shape,
            dtype=dtype,
            image_grid_thw=image_grid_thw,
            content_hash=content_hash,
            expires_at=time.time() + self.config.ttl_s,
        )

    def release(self, handle_id: str) -> bool:
        return False

    def stats(self) -> ProducerStats:
        return ProducerStats(0, 0, 0, 0, 0, 0)


class InlineConsumer(EmbeddingConsumer):
    """Decodes the payload, checking it against the handle's shape and dtype."""

    kind = "inline"

    def fetch(self, handle: EmbeddingHandle) -> np.ndarray:
        loc, hid = handle.location, handle.handle_id
        if not isinstance(loc, InlinePayload):
            raise TransferError(
                f"handle {hid} is a {loc.kind} handle, this consumer is inline "
                "(encoder and prefill disagree on transfer.kind)"
            )
        check_not_expired(handle)
        try:
            raw = base64.b64decode(loc.data_b64, validate=True)
        except binascii.Error as exc:
            raise TransferError(f"handle {hid}: payload is not base64: {exc}") from None
        if len(raw) != handle.nbytes:
            raise TransferError(
                f"handle {hid}: payload has {len(raw)} bytes, shape {handle.shape} "
                f"of {handle.dtype} needs {handle.nbytes}"
            )
        out = np.empty(handle.shape, numpy_dtype(handle.dtype))
        out.reshape(-1).view(np.uint8)[:] = np.frombuffer(raw, np.uint8)
        return out
