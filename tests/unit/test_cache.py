"""The encoder cache's policy: pins, LRU eviction within a byte budget, TTL, cache off.

``EntryTable`` is pure bookkeeping; the inline producer runs the whole policy in-process
(NIXL's storage is exercised by tests/integration/test_transfer.py).
"""

import numpy as np
import pytest

from orchestrator.cache import EntryTable
from orchestrator.metrics import Histogram
from orchestrator.transfer import PoolFullError, make_producer


def _embeds(seed: int, rows: int = 4) -> np.ndarray:
    return np.random.default_rng(seed).standard_normal((rows, 6)).astype(np.float32)


def test_pinned_entries_are_never_evicted_and_unpinned_go_lru_first():
    table = EntryTable()
    a = table.add("a", "slot-a", None, 10, "x")
    b = table.add("b", "slot-b", None, 10, "y")
    table.pin(a, "h1", unpin_at=100)
    assert table.evict_lru() is b  # a is older but pinned
    assert table.evict_lru() is None
    assert table.unpin("h1") == (True, None)  # cache on: stays, now evictable
    assert table.unpin("h1") == (False, None)
    assert table.find("a") is a and table.evict_lru() is a
    assert (table.counters.hits, table.counters.evictions) == (1, 2)


def test_find_refreshes_recency():
    table = EntryTable()
    a = table.add("a", 1, None, 1, "x")
    table.add("b", 2, None, 1, "y")
    table.find("a")
    assert table.evict_lru().key == "b" and table.evict_lru() is a


def test_expiry_unpins_once_and_counts():
    table = EntryTable()
    entry = table.add("a", 1, None, 1, "x")
    table.pin(entry, "h1", unpin_at=5.0)
    table.pin(entry, "h2", unpin_at=9.0)
    assert table.expire(4.9) == [] and table.pinned_handles == 2
    assert table.expire(5.0) == [] and entry.pins == {"h2"}
    table.unpin("h2")  # pulled before its expiry
    assert table.expire(10.0) == [] and table.counters.expired == 1


def test_cache_off_frees_at_last_unpin_and_never_hits():
    table = EntryTable(keep_unpinned=False)
    entry = table.add("a", 1, None, 1, "private")
    table.pin(entry, "h1", unpin_at=1.0)
    assert table.find("a") is None and table.peek("a") is None
    assert table.unpin("h1") == (True, entry) and len(table) == 0


def test_producer_answers_repeats_from_cache_and_evicts_within_budget():
    size = -(-4 * 6 * 4 // 3) * 4  # base64 of 4x6 float32
    producer = make_producer("inline", pool_bytes=2 * size)
    first = producer.put(_embeds(1), content_hash="one")
    hit = producer.lookup("one")
    assert hit is not None and hit.handle_id != first.handle_id
    assert hit.location == first.location and hit.content_hash == "one"
    producer.put(_embeds(2), content_hash="two")
    producer.lookup("one")  # "two" is now least recently used
    producer.put(_embeds(3), content_hash="three")
    assert producer.lookup("two") is None and producer.lookup("one") is not None
    stats = producer.stats()
    assert (stats.entries, stats.evictions, stats.hits, stats.misses) == (2, 1, 3, 1)
    assert stats.bytes_in_use == stats.pool_bytes == 2 * size


def test_producer_put_of_a_cached_image_reuses_the_entry():
    producer = make_producer("inline")
    a = producer.put(_embeds(1), content_hash="same")
    b = producer.put(_embeds(1), content_hash="same")
    assert a.location == b.location and producer.stats().entries == 1


def test_producer_refuses_an_embedding_bigger_than_the_budget():
    producer = make_producer("inline", pool_bytes=64)
    with pytest.raises(ValueError, match="exceeds the cache budget"):
        producer.put(_embeds(1, rows=8), content_hash="big")


def test_producer_with_cache_off_keeps_nothing():
    producer = make_producer("inline", cache=False)
    handle = producer.put(_embeds(1), content_hash="x")
    assert handle.location.data_b64
    assert producer.lookup("x") is None
    stats = producer.stats()
    assert (stats.entries, stats.bytes_in_use) == (0, 0)


def test_pool_full_error_is_the_promised_message():
    assert issubclass(PoolFullError, RuntimeError)
    table = EntryTable()
    table.pin(table.add("a", 1, None, 1, "x"), "h", unpin_at=1.0)
    assert table.evict_lru() is None  # what makes the producer raise "encoder cache is full"


def test_histogram_is_cumulative():
    hist = Histogram(buckets=(0.1, 1.0))
    for value in (0.05, 0.1, 0.5, 3.0):
        hist.observe(value)
    cumulative, total, count = hist.snapshot()
    assert cumulative == [2, 3, 4] and count == 4 and total == pytest.approx(3.65)


def test_prefill_cache_keeps_recent_arrays_within_budget():
    from orchestrator.cache import LocalEmbeddingCache

    cache = LocalEmbeddingCache(max_bytes=2 * 96)  # two 4x6 float32 arrays
    a, b, c = (_embeds(i) for i in range(3))
    cache.put("a", a)
    cache.put("b", b)
    held = cache.get("a")  # a is now the most recent
    assert held is not a and np.array_equal(held, a)  # a copy: a is an engine input slice
    a[:] = -1
    assert np.array_equal(cache.get("a"), _embeds(0))  # later writes to a do not reach it
    cache.put("c", c)
    assert cache.get("b") is None and np.array_equal(cache.get("c"), c) and cache.hits == 3
    assert not held.flags.writeable  # shared: nobody may change it in place
    LocalEmbeddingCache(max_bytes=0).put("x", _embeds(5))  # off: keeps nothing, no error
