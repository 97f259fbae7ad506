"""Content-addressed bookkeeping of the embeddings an encoder holds.

An *entry* is one image's embeddings in the producer's storage, keyed by its content hash
(decoded pixels + preprocessing + encoder identity). A *handle* lent out for an entry pins
it until the consumer has pulled it (or its TTL has passed); unpinned entries stay cached
and are evicted least-recently-used first when room is needed. This module is pure
bookkeeping with no locking: the producer that owns it serialises calls, and frees the
storage of whatever entries it hands back.
"""

from __future__ import annotations

import heapq
import threading
from collections import OrderedDict
from dataclasses import dataclass, field
from typing import Any

import numpy as np


@dataclass(eq=False)
class Entry:
    """One cached embedding."""

    key: str
    """Content hash; unique per entry while caching is on."""
    slot: Any
    """Where the producer stored it (transport-specific)."""
    meta: Any
    """What handles to it describe (shape, dtype, grid)."""
    nbytes: int
    """Bytes of storage it occupies."""
    pins: set[str] = field(default_factory=set)
    """Handles lent out and not yet pulled or expired."""


@dataclass
class CacheCounters:
    hits: int = 0
    misses: int = 0
    evictions: int = 0
    """Unpinned entries dropped to make room."""
    expired: int = 0
    """Handles unpinned because nobody pulled them before their TTL (+ grace)."""


class EntryTable:
    """Entries by key in LRU order, the handles pinning them, and the handles' expiry.

    With ``keep_unpinned=False`` (cache off) an entry is dropped as soon as its last pin
    goes and ``find`` never hits: every put is a fresh, private entry.
    """

    def __init__(self, keep_unpinned: bool = True) -> None:
        self.keep_unpinned = keep_unpinned
        self._entries: OrderedDict[str, Entry] = OrderedDict()
        self._handles: dict[str, Entry] = {}
        self._expiry: list[tuple[float, str]] = []  # (unpin_at, handle_id), lazily pruned
        self.counters = CacheCounters()

    def __len__(self) -> int:
        return len(self._entries)

    @property
    def pinned_handles(self) -> int:
        return len(self._handles)

    def find(self, key: str) -> Entry | None:
        """The cached entry for ``key`` (now most recently used), counting a hit or a miss."""
        entry = self.peek(key)
        if entry is None:
            self.counters.misses += 1
        else:
            self.counters.hits += 1
            self._entries.move_to_end(entry.key)
        return entry

    def peek(self, key: str) -> Entry | None:
        """The cached entry for ``key`` without touching counters or LRU order."""
        return self._entries.get(key) if self.keep_unpinned else None

    def add(self, key: str, slot: Any, meta: Any, nbytes: int, private_id: str) -> Entry:
        """A new entry; ``private_id`` keys it instead when caching is off (never shared)."""
        if key in self._entries and self.keep_unpinned:
            raise KeyError(f"entry {key} already cached")
        entry = Entry(key if self.keep_unpinned else private_id, slot, meta, nbytes)
        self._entries[entry.key] = entry
        return entry

    def pin(self, entry: Entry, handle_id: str, unpin_at: float) -> None:
        entry.pins.add(handle_id)
        self._handles[handle_id] = entry
        heapq.heappush(self._expiry, (unpin_at, handle_id))

    def unpin(self, handle_id: str) -> tuple[bool, Entry | None]:
        """Drop a handle's pin: (whether it was pinned, the entry if it must be freed now)."""
        entry = self._handles.pop(handle_id, None)
        if entry is None:
            return False, None
        entry.pins.discard(handle_id)
        return True, entry if self.drop_if_unpinned(entry) else None

    def drop_if_unpinned(self, entry: Entry) -> bool:
        """With caching off, remove an entry nobody pins; True if the caller must free it."""
        if entry.pins or self.keep_unpinned:
            return False
        del self._entries[entry.key]
        return True

    def expire(self, now: float) -> list[Entry]:
        """Unpin every handle whose time has come; returns entries to free (cache off)."""
        freed = []
        while self._expiry and self._expiry[0][0] <= now:
            _, handle_id = heapq.heappop(self._expiry)
            pinned, entry = self.unpin(handle_id)
            self.counters.expired += pinned
            if entry is not None:
                freed.append(entry)
        return freed

    def evict_lru(self) -> Entry | None:
        """Remove and return the least recently used unpinned entry, if any."""
        for key, entry in self._entries.items():
            if not entry.pins:
                del self._entries[key]
                self.counters.evictions += 1
                return entry
        return None

    def drain(self) -> list[Entry]:
        """Remove every entry (the producer is closing)."""
        entries = list(self._entries.values())
        self._entries.clear()
        self._handles.clear()
        self._expiry.clear()
        return entries


class LocalEmbeddingCache:
    """Prefill's own LRU of pulled embeddings by content hash, within ``max_bytes``, so a
    hot image does not cross the network again. Thread-safe; ``put`` keeps a copy (the
    caller's array is a slice of an engine input), ``get`` returns it read-only."""

    def __init__(self, max_bytes: int) -> None:
        self.max_bytes = max_bytes
        self._arrays: OrderedDict[str, np.ndarray] = OrderedDict()
        self._bytes = 0
        self._lock = threading.Lock()
        self.hits = 0

    def get(self, key: str) -> np.ndarray | None:
        with self._lock:
            found = self._arrays.get(key)
            if found is not None:
                self._arrays.move_to_end(key)
                self.hits += 1
            return found

    def put(self, key: str, array: np.ndarray) -> None:
        if array.nbytes > self.max_bytes:
            return
        with self._lock:
            if key in self._arrays:
                return
            array = array.copy()
            array.setflags(write=False)
            self._arrays[key] = array
            self._bytes += array.nbytes
            while self._bytes > self.max_bytes:
                _, old = self._arrays.popitem(last=False)
                self._bytes -= old.nbytes
