"""The embedding handoff, split by role (in the spirit of vLLM's ``ECConnectorBase``).

The encoder holds an :class:`EmbeddingProducer`: ``put`` parks one image's embeddings and
returns a metadata-only :class:`~orchestrator.protocol.EmbeddingHandle`. Prefill holds an
:class:`EmbeddingConsumer`: ``fetch`` turns a handle back into the array. Transports are
looked up by name and imported on first use, so choosing ``inline`` never loads NIXL.
"""

from __future__ import annotations

import importlib
import time
import uuid
from abc import ABC, abstractmethod
from dataclasses import dataclass
from typing import Any, ClassVar

import numpy as np
from pydantic import BaseModel, ConfigDict, Field

from orchestrator.config import TransferKind
from orchestrator.protocol import EmbeddingHandle, TransferError

DTYPES = ("float32", "float16", "bfloat16")
"""Embedding dtypes a handle can carry (``bfloat16`` is numpy's via ``ml_dtypes``)."""


class PoolFullError(RuntimeError):
    """The producer has no room for this embedding right now (slots not yet pulled)."""


class ProducerConfig(BaseModel):
    """Encoder-side settings; transports ignore the fields they have no use for."""

    model_config = ConfigDict(extra="forbid", use_attribute_docstrings=True)

    pool_bytes: int = Field(default=64 << 20, gt=0)
    """Size of the DRAM pool registered with NIXL once at start; ``put`` fails when full."""
    block_bytes: int = Field(default=64 << 10, gt=0)
    """Allocation unit of the pool; an embedding takes a contiguous run of blocks."""
    ttl_s: float = Field(default=60.0, gt=0)
    """Lifetime of a handle; after it the consumer refuses the handle."""
    reclaim_grace_s: float = Field(default=10.0, ge=0)
    """Extra time past expiry before the producer reuses an unpulled slot; keep it above the
    consumer's ``xfer_timeout_s`` so a read started just before expiry cannot see reuse."""
    host: str = "127.0.0.1"
    """Address the metadata side channel binds to."""
    advertise_host: str | None = None
    """Address put into handles for consumers to dial; defaults to ``host`` (required when
    ``host`` is a wildcard such as ``0.0.0.0``)."""
    port: int = Field(default=0, ge=0, le=65535)
    """Side-channel TCP port; 0 picks a free one."""
    poll_interval_s: float = Field(default=0.001, gt=0)
    """Period of the thread that drains NIXL notifications and progresses UCX. A consumer's
    READ completes only once this side has progressed (its notification is acknowledged), so
    each fetch waits up to one period: 1 ms costs ~3% of a core idle, 0.2 ms ~11%."""


class ConsumerConfig(BaseModel):
    """Prefill-side settings; transports ignore the fields they have no use for."""

    model_config = ConfigDict(extra="forbid", use_attribute_docstrings=True)

    connect_timeout_s: float = Field(default=2.0, gt=0)
    """Limit on connecting to a producer's side channel and reading its metadata."""
    xfer_timeout_s: float = Field(default=5.0, gt=0)
    """Limit on one NIXL READ; past it the fetch fails instead of waiting on a stuck peer."""
    poll_interval_s: float = Field(default=50e-6, gt=0)
    """Sleep between checks of an in-flight READ (short: it sits on the request path)."""
    initial_buffer_bytes: int = Field(default=16 << 20, gt=0)
    """Size of the registered receive buffer at start; it is re-registered larger on demand."""


@dataclass(frozen=True)
class ProducerStats:
    """Occupancy of a producer, for metrics and tests (all zero for ``inline``)."""

    slots_in_use: int
    bytes_in_use: int
    bytes_free: int
    pool_bytes: int
    largest_free: int
    """Largest payload in bytes that one more ``put`` could take right now."""
    reclaimed_expired: int
    """Slots freed because their handle expired unpulled (since start)."""


class EmbeddingProducer(ABC):
    """Encoder side: parks embeddings and hands out handles. Safe to call from many threads."""

    kind: ClassVar[TransferKind]

    def __init__(self, config: ProducerConfig) -> None:
        self.config = config

    @abstractmethod
    def put(
        self, embeds: np.ndarray, *, image_grid_thw: tuple[int, int, int], content_hash: str
    ) -> EmbeddingHandle:
        """Park ``embeds`` (2-D: tokens x hidden) and return a handle valid for ``ttl_s``."""

    @abstractmethod
    def release(self, handle_id: str) -> bool:
        """Free a handle's slot early (e.g. its request was cancelled); False if not held."""

    @abstractmethod
    def stats(self) -> ProducerStats: ...

    def close(self) -> None:  # noqa: B027 - a no-op for transports that hold nothing
        """Stop background work and free resources; idempotent."""

    def __enter__(self) -> EmbeddingProducer:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()


class EmbeddingConsumer(ABC):
    """Prefill side: resolves handles into arrays. Safe to call from many threads."""

    kind: ClassVar[TransferKind]

    def __init__(self, config: ConsumerConfig) -> None:
        self.config = config

    @abstractmethod
    def fetch(self, handle: EmbeddingHandle) -> np.ndarray:
        """The handle's embeddings as a fresh array; consumes the handle.

        Raises :class:`TransferError` saying why when the handle cannot be resolved.
        """

    def close(self) -> None:  # noqa: B027 - a no-op for transports that hold nothing
        """Free resources; idempotent."""

    def __enter__(self) -> EmbeddingConsumer:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()


_TRANSPORTS: dict[str, tuple[str, str]] = {
    "nixl": ("orchestrator.transfer.nixl:NixlProducer", "orchestrator.transfer.nixl:NixlConsumer"),
    "inline": (
        "orchestrator.transfer.inline:InlineProducer",
        "orchestrator.transfer.inline:InlineConsumer",
    ),
}
"""Transport name -> ("module:Class" of the producer, of the consumer); imported lazily."""


def _load(kind: str, role: int) -> Any:
    try:
        spec = _TRANSPORTS[kind][role]
    except KeyError:
        raise ValueError(f"unknown transport {kind!r}; known: {sorted(_TRANSPORTS)}") from None
    module, _, name = spec.partition(":")
    return getattr(importlib.import_module(module), name)


def make_producer(kind: TransferKind, **cfg: Any) -> EmbeddingProducer:
    """Build the encoder side of transport ``kind`` from :class:`ProducerConfig` fields."""
    return _load(kind, 0)(ProducerConfig(**cfg))


def make_consumer(kind: TransferKind, **cfg: Any) -> EmbeddingConsumer:
    """Build the prefill side of transport ``kind`` from :class:`ConsumerConfig` fields."""
    return _load(kind, 1)(ConsumerConfig(**cfg))


# Helpers shared by the transports.


def numpy_dtype(name: str) -> np.dtype:
    """The numpy dtype for a handle's dtype name (``bfloat16`` comes from ``ml_dtypes``)."""
    if name == "bfloat16":
        import ml_dtypes

        return np.dtype(ml_dtypes.bfloat16)
    return np.dtype(name)


def as_embedding(embeds: np.ndarray) -> tuple[np.ndarray, str]:
    """Validate ``embeds`` as a 2-D array of a supported dtype; C-contiguous and its dtype name."""
    if not isinstance(embeds, np.ndarray) or embeds.ndim != 2:
        raise ValueError(
            f"embeddings must be a 2-D numpy array, got {type(embeds).__name__} "
            f"with shape {getattr(embeds, 'shape', None)}"
        )
    if embeds.dtype.name not in DTYPES:
        raise ValueError(f"embeddings dtype {embeds.dtype.name} not in {DTYPES}")
    return np.ascontiguousarray(embeds), embeds.dtype.name


def new_handle_id() -> str:
    return uuid.uuid4().hex


def check_not_expired(handle: EmbeddingHandle) -> None:
    """Refuse an expired handle up front: its slot may already be reclaimed and reused."""
    now = time.time()
    if handle.expired(now):
        raise TransferError(
            f"handle {handle.handle_id} expired {now - handle.expires_at:.3f}s ago "
            "(not fetched within the producer's ttl); re-encode the image"
        )
