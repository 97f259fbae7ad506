"""The embedding handoff, split by role (in the spirit of vLLM's ``ECConnectorBase``).

The encoder holds an :class:`EmbeddingProducer`: ``put`` parks one image's embeddings and
returns a metadata-only :class:`~orchestrator.protocol.EmbeddingHandle`. Prefill holds an
:class:`EmbeddingConsumer`: ``fetch_into`` lands a handle's embeddings in an array the caller
owns (prefill: its slice of the engine input), ``fetch`` in a fresh one. Transports are
looked up by name and imported on first use, so choosing ``inline`` never loads NIXL.
"""

from __future__ import annotations

import importlib
import threading
import time
import uuid
from abc import ABC, abstractmethod
from dataclasses import dataclass
from typing import Any, ClassVar

import numpy as np
from pydantic import BaseModel, ConfigDict, Field

from orchestrator.cache import Entry, EntryTable
from orchestrator.config import TransferKind
from orchestrator.protocol import (
    EmbeddingHandle,
    InlinePayload,
    MooncakeLocation,
    NixlLocation,
    TransferError,
)

DTYPES = ("float32", "float16", "bfloat16")
"""Embedding dtypes a handle can carry (``bfloat16`` is numpy's via ``ml_dtypes``)."""


class PoolFullError(RuntimeError):
    """The producer has no room for this embedding right now (slots not yet pulled)."""


class ProducerConfig(BaseModel):
    """Encoder-side settings; transports ignore the fields they have no use for."""

    model_config = ConfigDict(extra="forbid", use_attribute_docstrings=True)

    pool_bytes: int = Field(default=64 << 20, gt=0)
    """Byte budget of the cache (for NIXL: the DRAM pool registered once at start)."""
    cache: bool = True
    """Keep embeddings after they were pulled, for repeated images (LRU within
    ``pool_bytes``); off: an entry is freed as soon as its last handle is pulled."""
    block_bytes: int = Field(default=64 << 10, gt=0)
    """Allocation unit of the pool; an embedding takes a contiguous run of blocks."""
    ttl_s: float = Field(default=60.0, gt=0)
    """Lifetime of a handle; after it the consumer refuses the handle and (after
    ``reclaim_grace_s``) the entry is unpinned."""
    reclaim_grace_s: float = Field(default=10.0, ge=0)
    """Extra time past expiry before an unpulled handle stops pinning its entry; keep it
    above the consumer's ``xfer_timeout_s`` so a read started just before expiry cannot
    see the slot reused."""
    host: str = "127.0.0.1"
    """Address the metadata side channel binds to."""
    advertise_host: str | None = None
    """Address put into handles for consumers to dial; defaults to ``host`` (required when
    ``host`` is a wildcard such as ``0.0.0.0``)."""
    port: int = Field(default=0, ge=0, le=65535)
    """Side-channel TCP port; 0 picks a free one."""
    poll_interval_s: float = Field(default=0.001, gt=0)
    """Period of the thread that drains NIXL notifications and progresses UCX while handles
    are lent out. A consumer's READ completes only once this side has progressed (its
    notification is acknowledged), so each fetch waits up to one period (1 ms polling costs
    ~3% of a core, 0.2 ms ~11%)."""
    idle_poll_interval_s: float = Field(default=1.0, gt=0)
    """Period of that thread while no handle is lent out (nothing should be pulled then;
    a late READ of an unpinned, cached entry waits up to this long): an idle encoder
    costs next to nothing. Lending a handle wakes the thread at once."""


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
    """Size of Mooncake's registered receive buffer at start (re-registered larger on
    demand); NIXL READs land in the caller's array and need none."""
    host: str = "127.0.0.1"
    """This side's address as producers see it (Mooncake's local hostname)."""


@dataclass(frozen=True)
class ProducerStats:
    """Occupancy and cache activity of a producer, for metrics and tests."""

    entries: int
    """Embeddings held (cached), pinned or not."""
    pinned_handles: int
    """Handles lent out and not yet pulled (or expired)."""
    bytes_in_use: int
    bytes_free: int
    pool_bytes: int
    largest_free: int
    """Largest payload in bytes that one more ``put`` could take without evicting."""
    hits: int
    """``lookup`` calls answered from the cache (since start)."""
    misses: int
    evictions: int
    """Unpinned entries dropped to make room (since start)."""
    expired: int
    """Handles unpinned because nobody pulled them before their TTL (since start)."""


@dataclass(frozen=True)
class StorageUsage:
    bytes_in_use: int
    bytes_free: int
    pool_bytes: int
    largest_free: int


class EmbeddingProducer(ABC):
    """Encoder side: a content-addressed cache of embeddings that lends out handles.

    The cache policy lives here, once (:class:`~orchestrator.cache.EntryTable`): ``lookup``
    answers a handle for a cached image, ``put`` stores a new one, evicting unpinned entries
    least-recently-used first, or raises :class:`PoolFullError` when everything left is
    pinned. Transports supply the storage (``_reserve`` / ``_fill`` / ``_discard``) and what
    a handle says about where the bytes are (``_location``). Safe to call from many threads.
    """

    kind: ClassVar[TransferKind]
    pins_until_pulled: ClassVar[bool] = True
    """Whether a handle pins its entry until the consumer says it pulled it; False when the
    handle carries the bytes itself."""

    def __init__(self, config: ProducerConfig) -> None:
        self.config = config
        self._lock = threading.Lock()
        self._table = EntryTable(keep_unpinned=config.cache)
        self._closed = False

    # The storage a transport provides; all but ``_fill`` are called with the lock held.

    @abstractmethod
    def _reserve(self, nbytes: int) -> tuple[Any, int] | None:
        """Room for ``nbytes`` of payload: (slot, bytes charged), or None if none is free."""

    @abstractmethod
    def _fill(self, slot: Any, embeds: np.ndarray) -> None:
        """Copy the payload into a reserved slot (called without the lock)."""

    @abstractmethod
    def _discard(self, slot: Any) -> None:
        """Return a slot's storage; readers of it must fail from now on."""

    @abstractmethod
    def _location(self, slot: Any) -> NixlLocation | MooncakeLocation | InlinePayload:
        """What a handle for this slot tells the consumer."""

    @abstractmethod
    def _usage(self) -> StorageUsage: ...

    def _check_size(self, nbytes: int) -> None:  # noqa: B027 - storage without a hard cap
        """Raise ``ValueError`` when ``nbytes`` could never fit, even in an empty store."""

    # The policy.

    def lookup(self, content_hash: str) -> EmbeddingHandle | None:
        """A fresh handle for an embedding already held, or None (a miss)."""
        with self._lock:
            self._check_open()
            entry = self._table.find(content_hash) if self.config.cache else None
            return None if entry is None else self._lend(entry)

    def put(
        self,
        embeds: np.ndarray,
        *,
        content_hash: str,
        grid_thw: tuple[int, int, int] | None = None,
    ) -> EmbeddingHandle:
        """Store ``embeds`` (2-D: tokens x hidden) under ``content_hash``; a handle to it.
        ``grid_thw`` is the image's patch grid for families that have one (Qwen).

        Raises :class:`PoolFullError` when no room can be made (all of it is pinned).
        """
        arr, _ = as_embedding(embeds)
        self._check_size(arr.nbytes)
        with self._lock:
            self._check_open()
            entry = self._table.peek(content_hash)
            if entry is None:
                reserved = self._reserve_evicting(arr.nbytes)
        if entry is None:
            slot, charged = reserved
            self._fill(slot, arr)  # not in the table yet: nothing else can see the slot
            with self._lock:
                entry = self._table.peek(content_hash)
                if entry is None:  # a concurrent put of the same image may have won
                    grid = tuple(grid_thw) if grid_thw is not None else None
                    meta = _Meta(arr.shape, arr.dtype.name, grid, content_hash)
                    entry = self._table.add(content_hash, slot, meta, charged, new_handle_id())
                else:
                    self._discard(slot)
                return self._lend(entry)
        with self._lock:
            return self._lend(entry)

    def _reserve_evicting(self, nbytes: int) -> tuple[Any, int]:
        while (reserved := self._reserve(nbytes)) is None:
            victim = self._table.evict_lru()
            if victim is None:
                usage = self._usage()
                raise PoolFullError(
                    f"encoder cache is full: {nbytes} bytes needed, {usage.bytes_free} of "
                    f"{usage.pool_bytes} free (largest run {usage.largest_free}), "
                    f"{self._table.pinned_handles} handles pinned and not yet pulled"
                )
            self._discard(victim.slot)
        return reserved

    def _lend(self, entry: Entry) -> EmbeddingHandle:
        """A new handle for ``entry``; locked."""
        slot, meta = entry.slot, entry.meta
        handle_id = new_handle_id()
        location = self._location(slot)
        if self.pins_until_pulled:
            deadline = time.monotonic() + self.config.ttl_s + self.config.reclaim_grace_s
            self._table.pin(entry, handle_id, deadline)
        elif self._table.drop_if_unpinned(entry):  # cache off: the handle is the only copy
            self._discard(slot)
        return EmbeddingHandle(
            handle_id=handle_id,
            location=location,
            shape=meta.shape,
            dtype=meta.dtype,
            grid_thw=meta.grid_thw,
            content_hash=meta.content_hash,
            ttl_s=self.config.ttl_s,
        )

    def release(self, handle_id: str) -> bool:
        """Unpin a handle (its consumer pulled it, or its request failed); False if unknown."""
        with self._lock:
            return self._unpin(handle_id)

    def _unpin(self, handle_id: str) -> bool:
        """Locked. Frees the entry's storage when the cache is off and it was the last pin."""
        known, freed = self._table.unpin(handle_id)
        if freed is not None:
            self._discard(freed.slot)
        return known

    def _expire(self, now: float) -> None:
        """Unpin handles past their TTL + grace; locked (transports call it periodically)."""
        for entry in self._table.expire(now):
            self._discard(entry.slot)

    def stats(self) -> ProducerStats:
        with self._lock:
            self._expire(time.monotonic())
            usage, c = self._usage(), self._table.counters
            return ProducerStats(
                entries=len(self._table),
                pinned_handles=self._table.pinned_handles,
                bytes_in_use=usage.bytes_in_use,
                bytes_free=usage.bytes_free,
                pool_bytes=usage.pool_bytes,
                largest_free=usage.largest_free,
                hits=c.hits,
                misses=c.misses,
                evictions=c.evictions,
                expired=c.expired,
            )

    def _check_open(self) -> None:
        if self._closed:
            raise RuntimeError("producer is closed")

    def close(self) -> None:
        """Drop every entry and stop background work; idempotent."""
        with self._lock:
            if self._closed:
                return
            self._closed = True
            for entry in self._table.drain():
                self._discard(entry.slot)

    def __enter__(self) -> EmbeddingProducer:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()


@dataclass(frozen=True)
class _Meta:
    shape: tuple[int, int]
    dtype: str
    grid_thw: tuple[int, int, int] | None
    content_hash: str


class EmbeddingConsumer(ABC):
    """Prefill side: resolves handles into arrays. Safe to call from many threads."""

    kind: ClassVar[TransferKind]

    def __init__(self, config: ConsumerConfig) -> None:
        self.config = config

    def fetch(self, handle: EmbeddingHandle) -> np.ndarray:
        """The handle's embeddings as a fresh array; consumes the handle."""
        out = np.empty(handle.shape, numpy_dtype(handle.dtype))
        self.fetch_into(handle, out)
        return out

    @abstractmethod
    def fetch_into(self, handle: EmbeddingHandle, out: np.ndarray) -> None:
        """Write the handle's embeddings into ``out`` (C-contiguous, the handle's shape and
        dtype, e.g. rows of a larger array); consumes the handle. One-sided transports READ
        straight into it, so prefill's concatenated input costs no copy per image.

        Raises :class:`TransferError` saying why when the handle cannot be resolved (``out``
        then holds garbage) and ``ValueError`` when ``out`` does not fit the handle.
        """

    def release(self, handle: EmbeddingHandle) -> None:  # noqa: B027 - nothing pinned
        """Tell the producer this handle will not be pulled (its embeddings are already
        here). Best effort: a lost release costs the pin until the handle's TTL."""

    def close(self) -> None:  # noqa: B027 - a no-op for transports that hold nothing
        """Free resources; idempotent."""

    def __enter__(self) -> EmbeddingConsumer:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()


_TRANSPORTS: dict[str, tuple[str, str]] = {
    "nixl": ("orchestrator.transfer.nixl:NixlProducer", "orchestrator.transfer.nixl:NixlConsumer"),
    "mooncake": (
        "orchestrator.transfer.mooncake:MooncakeProducer",
        "orchestrator.transfer.mooncake:MooncakeConsumer",
    ),
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


DEFAULT_POOL_BYTES = 64 << 20
"""Floor of the model-sized default pool (small models get room for many images)."""
POOL_IMAGES = 8
"""Largest images the model-sized default pool holds at once."""
SLOT_OVERHEAD = 32
"""Bytes a slot adds around its payload (two 16-byte nonces in the registered pool)."""


def pool_bytes_for(configured: int | None, max_image_bytes: int) -> int:
    """The encoder pool's size: ``configured``, or sized from the model — ``POOL_IMAGES``
    of its largest images, at least ``DEFAULT_POOL_BYTES``. A configured pool that cannot
    hold one largest image is a ``ValueError`` (raised at start-up, not at the first big
    image)."""
    block = ProducerConfig.model_fields["block_bytes"].default
    one = -(-(max_image_bytes + SLOT_OVERHEAD) // block) * block
    if configured is None:
        return max(DEFAULT_POOL_BYTES, POOL_IMAGES * one)
    if configured < one:
        raise ValueError(
            f"transfer.pool_bytes={configured} cannot hold one image's embeddings: the "
            f"model's largest image needs {max_image_bytes} bytes ({one} with the pool's "
            f"{block}-byte blocks); raise pool_bytes or leave it unset (sized from the model)"
        )
    return configured


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


def destination_bytes(handle: EmbeddingHandle, out: np.ndarray) -> np.ndarray:
    """``out`` as a flat byte view, once it is checked to fit the handle exactly."""
    dtype = numpy_dtype(handle.dtype)
    if out.shape != tuple(handle.shape) or out.dtype != dtype:
        raise ValueError(
            f"handle {handle.handle_id} holds {handle.dtype}{list(handle.shape)}, the "
            f"destination is {out.dtype.name}{list(out.shape)}"
        )
    if not out.flags.c_contiguous or not out.flags.writeable:
        raise ValueError(f"destination for handle {handle.handle_id} is not writable C order")
    return out.reshape(-1).view(np.uint8)


def location_of(handle: EmbeddingHandle, kind: str) -> Any:
    """The handle's location, refusing one another transport made."""
    if handle.location.kind != kind:
        raise TransferError(
            f"handle {handle.handle_id} is a {handle.location.kind} handle, this consumer is "
            f"{kind} (encoder and prefill disagree on transfer.kind)"
        )
    return handle.location


def new_handle_id() -> str:
    return uuid.uuid4().hex
