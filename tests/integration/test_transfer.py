"""Embedding handoff across real processes: producer and consumer each run
``transfer_peer.py`` (NIXL is not fork-safe, and this keeps NIXL out of pytest itself).
"""

from __future__ import annotations

import json
import os
import selectors
import signal
import socket
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import pytest

from tests.conftest import mooncake_unavailable

PEER = Path(__file__).with_name("transfer_peer.py")
_MOONCAKE = pytest.param(
    "mooncake",
    marks=pytest.mark.skipif(bool(mooncake_unavailable()), reason=str(mooncake_unavailable())),
)
KINDS = ["nixl", _MOONCAKE, "inline"]
POOLED = ["nixl", _MOONCAKE]
"""Transports that pull from a registered pool on the producer (one-sided READs)."""
MIB = 1 << 20


class Peer:
    """A ``transfer_peer.py`` process driven over stdin/stdout, every wait bounded."""

    def __init__(self, role: str, kind: str, env: dict[str, str] | None = None, **cfg) -> None:
        self.role = role
        self.stderr = tempfile.TemporaryFile()
        self.proc = subprocess.Popen(
            [sys.executable, str(PEER), role, kind, json.dumps(cfg)],
            stdin=subprocess.PIPE,
            stdout=subprocess.PIPE,
            stderr=self.stderr,
            env={**os.environ, "UCX_MODULES": "^ib", **(env or {})},
            start_new_session=True,
        )
        self._buf = bytearray()
        self._reply(timeout=60)  # ready

    def request(self, op: str, timeout: float = 60, **args) -> dict:
        self.proc.stdin.write((json.dumps({"op": op, **args}) + "\n").encode())
        self.proc.stdin.flush()
        return self._reply(timeout)

    def _reply(self, timeout: float) -> dict:
        deadline = time.monotonic() + timeout
        with selectors.DefaultSelector() as sel:
            sel.register(self.proc.stdout, selectors.EVENT_READ)
            while True:
                end = self._buf.find(b"\n")
                if end >= 0:
                    line = bytes(self._buf[:end])
                    del self._buf[: end + 1]
                    if line.startswith(b"@@ "):
                        return json.loads(line[3:])
                    continue
                remaining = deadline - time.monotonic()
                if remaining <= 0 or not sel.select(remaining):
                    self.fail(f"no reply within {timeout}s")
                chunk = os.read(self.proc.stdout.fileno(), 1 << 20)
                if not chunk:
                    self.fail(f"exited with {self.proc.wait(5)}")
                self._buf += chunk

    def fail(self, why: str) -> None:
        self.kill()
        self.stderr.seek(0)
        tail = self.stderr.read()[-4000:].decode(errors="replace")
        pytest.fail(f"{self.role} peer {why}; stderr tail:\n{tail}")

    def kill(self) -> None:
        if self.proc.poll() is None:
            os.killpg(self.proc.pid, signal.SIGKILL)
        self.proc.wait(10)

    def close(self) -> None:
        """Ask for an orderly close; NIXL may still crash in teardown at exit, so no rc check."""
        if self.proc.poll() is None:
            try:
                self.request("close", timeout=20)
            finally:
                self.kill()

    # Shortcuts for the commands of transfer_peer.py.

    def put(self, shapes, dtype="float32", threads=1, seed=0) -> list[dict]:
        return self.request("put", specs=specs(shapes, dtype, seed), threads=threads)["results"]

    def lookup(self, shapes, dtype="float32", seed=0) -> list[dict]:
        return self.request("lookup", specs=specs(shapes, dtype, seed))["results"]

    def fetch(self, handles, threads=1, timeout=60) -> list[dict]:
        return self.request("fetch", handles=handles, threads=threads, timeout=timeout)["results"]


@pytest.fixture(scope="module", params=KINDS)
def kind(request) -> str:
    return request.param


@pytest.fixture(scope="module")
def producer(kind):
    peer = Peer("producer", kind, pool_bytes=128 * MIB)
    yield peer
    peer.close()


@pytest.fixture(scope="module")
def consumer(kind):
    peer = Peer("consumer", kind, xfer_timeout_s=5)
    yield peer
    peer.close()


def specs(shapes, dtype: str, seed: int) -> list[dict]:
    return [
        {"seed": seed + i, "rows": r, "cols": c, "dtype": dtype} for i, (r, c) in enumerate(shapes)
    ]


def wait_unpinned(producer: Peer, timeout: float = 5) -> dict:
    """Handles unpin asynchronously (on the READ's notification): poll the stats, bounded."""
    deadline = time.monotonic() + timeout
    while True:
        stats = producer.request("stats")
        if stats["pinned_handles"] == 0 or time.monotonic() > deadline:
            return stats
        time.sleep(0.02)


def assert_fetched(puts: list[dict], fetched: list[dict]) -> None:
    for put, got in zip(puts, fetched, strict=True):
        assert "handle" in put, put
        assert "error" not in got, got["error"]
        assert got["sha256"] == put["sha256"]
        assert tuple(got["shape"]) == tuple(put["handle"]["shape"])
        assert got["dtype"] == put["handle"]["dtype"]


def test_inline_does_not_import_nixl():
    code = (
        "import sys, numpy as np; from orchestrator.transfer import make_producer as m;"
        "m('inline').put(np.zeros((2, 2), 'float32'), content_hash='');"
        "assert not [n for n in sys.modules if 'nixl' in n]"
    )
    subprocess.run([sys.executable, "-c", code], check=True, timeout=60)


@pytest.mark.server
@pytest.mark.timeout(180)
def test_round_trip_is_byte_exact(producer, consumer):
    # 1 KiB, 64 KiB, 1 MiB, 16 MiB of float32, plus odd shapes.
    shapes = [(1, 256), (16, 1024), (256, 1024), (4096, 1024), (7, 3), (1000, 1536)]
    puts = producer.put(shapes)
    fetched = consumer.fetch([p["handle"] for p in puts])
    assert_fetched(puts, fetched)
    for dtype in ("float16", "bfloat16"):
        puts = producer.put([(64, 128), (3, 5)], dtype=dtype, seed=100)
        assert_fetched(puts, consumer.fetch([p["handle"] for p in puts]))
    assert wait_unpinned(producer)["pinned_handles"] == 0


@pytest.mark.server
@pytest.mark.timeout(120)
def test_fetch_into_lands_each_image_in_its_rows(producer, consumer):
    """Prefill's path: several images' embeddings pulled straight into consecutive rows of
    one engine input; nothing outside them is written, a misfit destination is refused."""
    puts = producer.put([(3, 1536), (4096, 1536), (1, 1536)], seed=500)
    got = consumer.request("fetch_rows", handles=[p["handle"] for p in puts])
    assert got["sha256"] == [p["sha256"] for p in puts]
    assert got["guards_intact"]
    assert "holds float32[3, 1536], the destination is float32[4, 1536]" in got["wrong_shape"]
    assert wait_unpinned(producer)["pinned_handles"] == 0


@pytest.mark.server
@pytest.mark.timeout(180)
def test_concurrent_batch_unpins_everything(kind, producer, consumer):
    puts = producer.put([(16 + 16 * i, 256) for i in range(48)], threads=4, seed=1000)
    assert_fetched(puts, consumer.fetch([p["handle"] for p in puts], threads=4))
    assert wait_unpinned(producer)["pinned_handles"] == 0


@pytest.mark.server
@pytest.mark.timeout(120)
def test_cached_embedding_outlives_its_pull(kind, producer, consumer):
    """A pulled embedding stays cached: a lookup of the same content lends a new handle to
    the same bytes (no second put), counted as a hit; unknown content is a miss."""
    [put] = producer.put([(32, 64)], seed=3000)
    assert_fetched([put], consumer.fetch([put["handle"]]))
    before = wait_unpinned(producer)
    [hit], [miss] = producer.lookup([(32, 64)], seed=3000), producer.lookup([(32, 64)], seed=3999)
    assert miss == {"miss": True}
    assert hit["handle"]["handle_id"] != put["handle"]["handle_id"]
    assert_fetched([{**put, "handle": hit["handle"]}], consumer.fetch([hit["handle"]]))
    after = wait_unpinned(producer)
    assert (after["hits"] - before["hits"], after["misses"] - before["misses"]) == (1, 1)
    assert after["entries"] == before["entries"]


@pytest.mark.server
@pytest.mark.timeout(120)
def test_consumer_release_unpins_without_a_pull(kind, producer, consumer):
    """What prefill does for a handle whose embeddings it already holds."""
    [put] = producer.put([(16, 64)], seed=4000)
    assert producer.request("stats")["pinned_handles"] >= (kind != "inline")
    assert consumer.request("release", handle=put["handle"])["released"]
    assert wait_unpinned(producer)["pinned_handles"] == 0


@pytest.mark.server
@pytest.mark.timeout(120)
@pytest.mark.parametrize("pooled", POOLED)
def test_lru_eviction_under_a_small_budget(pooled):
    """Room for three: a fourth evicts the least recently used unpinned entry, whose old
    handles then fail cleanly; the recently used one survives."""
    producer = Peer("producer", pooled, pool_bytes=MIB, block_bytes=64 << 10)
    consumer = Peer("consumer", pooled)
    try:
        shape = [(256, 256)]  # 256 KiB + framing = 5 blocks; 16 blocks in the pool
        puts = [producer.put(shape, seed=s)[0] for s in (1, 2, 3)]
        assert_fetched(puts, consumer.fetch([p["handle"] for p in puts]))
        wait_unpinned(producer)
        [touched] = producer.lookup(shape, seed=1)  # 1 is now the most recently used
        assert_fetched(
            [{**puts[0], "handle": touched["handle"]}], consumer.fetch([touched["handle"]])
        )
        wait_unpinned(producer)
        [fourth] = producer.put(shape, seed=4)
        stats = producer.request("stats")
        assert (stats["entries"], stats["evictions"]) == (3, 1), stats
        assert producer.lookup(shape, seed=2) == [{"miss": True}]  # the LRU one went
        assert "handle" in producer.lookup(shape, seed=1)[0]
        [stale] = consumer.fetch([puts[1]["handle"]])
        assert "unknown or was released" in stale["error"]
        assert_fetched([fourth], consumer.fetch([fourth["handle"]]))
    finally:
        producer.close()
        consumer.close()


@pytest.mark.server
@pytest.mark.timeout(120)
@pytest.mark.parametrize("pooled", POOLED)
def test_cache_off_frees_on_pull_and_release(pooled):
    producer = Peer("producer", pooled, cache=False)
    consumer = Peer("consumer", pooled)
    try:
        [first] = producer.put([(8, 64)], seed=2000)
        assert_fetched([first], consumer.fetch([first["handle"]]))
        stats = wait_unpinned(producer)  # the READ's notification freed it
        assert (stats["entries"], stats["bytes_in_use"]) == (0, 0)
        assert producer.lookup([(8, 64)], seed=2000) == [{"miss": True}]
        [second] = producer.put([(8, 64)], seed=2001)
        [again] = consumer.fetch([first["handle"]])
        assert "unknown or was released" in again["error"]
        assert producer.request("release", handle_id=second["handle"]["handle_id"])["released"]
        [released] = consumer.fetch([second["handle"]])
        assert "unknown or was released" in released["error"]
    finally:
        producer.close()
        consumer.close()


@pytest.mark.server
@pytest.mark.timeout(120)
def test_handle_of_other_transport_is_refused(kind, consumer):
    other = "inline" if kind == "nixl" else "nixl"
    peer = Peer("producer", other, pool_bytes=MIB)
    try:
        [put] = peer.put([(2, 2)])
        [got] = consumer.fetch([put["handle"]])
        assert f"is a {other} handle, this consumer is {kind}" in got["error"]
    finally:
        peer.close()


@pytest.mark.server
@pytest.mark.timeout(120)
@pytest.mark.parametrize("pooled", POOLED)
def test_unpulled_handle_expires_by_the_producers_clock(pooled):
    """Expiry is the producer's alone (its monotonic clock, ``ttl_s`` from issue): once
    ttl + grace pass it unpins and frees the slot, and a late READ fails the nonce check."""
    peer = Peer("producer", pooled, cache=False, ttl_s=0.3, reclaim_grace_s=0.2, pool_bytes=MIB)
    consumer = Peer("consumer", pooled)
    try:
        [put] = peer.put([(16, 64)])
        assert put["handle"]["ttl_s"] == 0.3
        stats = wait_unpinned(peer)
        assert (stats["pinned_handles"], stats["expired"]) == (0, 1)
        [got] = consumer.fetch([put["handle"]])
        assert "unknown or was released" in got["error"], got
    finally:
        peer.close()
        consumer.close()


@pytest.mark.server
@pytest.mark.timeout(120)
@pytest.mark.parametrize("pooled", POOLED)
def test_pool_full_of_pinned_embeddings_fails_put_clearly(pooled):
    peer = Peer("producer", pooled, pool_bytes=MIB, block_bytes=64 << 10)
    try:
        puts = peer.put([(256, 256)] * 2)  # 256 KiB + framing = 5 blocks each
        assert all("handle" in p for p in puts)
        puts = peer.put([(256, 256)] * 2, seed=10)
        assert "handle" in puts[0]
        assert "encoder cache is full" in puts[1]["error"]
        assert "3 handles pinned and not yet pulled" in puts[1]["error"]
    finally:
        peer.close()


@pytest.mark.server
@pytest.mark.timeout(120)
def test_dead_producer_fails_fast():
    producer = Peer("producer", "nixl")
    warm = Peer("consumer", "nixl", xfer_timeout_s=3, connect_timeout_s=2)
    try:
        first, second, third = producer.put([(64, 256)] * 3)
        assert_fetched([first], warm.fetch([first["handle"]]))  # metadata now cached
        producer.kill()
        start = time.monotonic()
        [got] = warm.fetch([second["handle"]], timeout=30)
        assert "NIXL READ" in got["error"] and "producer dead or unreachable" in got["error"]
        [got] = warm.fetch([third["handle"]], timeout=30)  # dials again: refused
        assert "unreachable" in got["error"]
        assert time.monotonic() - start < 10
    finally:
        producer.kill()
        warm.close()
    cold = Peer("consumer", "nixl", connect_timeout_s=2)
    try:
        [got] = cold.fetch([third["handle"]], timeout=30)
        assert "unreachable at" in got["error"] and "refused" in got["error"]
    finally:
        cold.close()


@pytest.mark.server
@pytest.mark.timeout(120)
@pytest.mark.skipif(bool(mooncake_unavailable()), reason=str(mooncake_unavailable()))
def test_dead_mooncake_producer_fails_fast():
    """Killed after a first pull (session known) and for a consumer that never met it."""
    producer = Peer("producer", "mooncake")
    warm = Peer("consumer", "mooncake")
    try:
        first, second = producer.put([(64, 256)] * 2)
        assert_fetched([first], warm.fetch([first["handle"]]))
        producer.kill()
        start = time.monotonic()
        [got] = warm.fetch([second["handle"]], timeout=30)
        assert "Mooncake READ" in got["error"] and "dead or unreachable" in got["error"]
        assert time.monotonic() - start < 10
    finally:
        producer.kill()
        warm.close()
    cold = Peer("consumer", "mooncake")
    try:
        start = time.monotonic()
        [got] = cold.fetch([second["handle"]], timeout=30)
        assert "Mooncake READ" in got["error"] and time.monotonic() - start < 10
    finally:
        cold.close()


@pytest.mark.server
@pytest.mark.timeout(120)
def test_stalled_producer_times_out_then_recovers():
    # UCX's tcp transport (what a cross-host link without RDMA gets) needs the producer to
    # progress, so a SIGSTOPped producer stalls the READ: the consumer must give up in time.
    tcp = {"UCX_TLS": "tcp"}
    producer = Peer("producer", "nixl", env=tcp)
    consumer = Peer("consumer", "nixl", env=tcp, xfer_timeout_s=1, connect_timeout_s=1)
    try:
        first, second = producer.put([(1024, 1024)] * 2)
        assert_fetched([first], consumer.fetch([first["handle"]]))
        os.kill(producer.proc.pid, signal.SIGSTOP)
        start = time.monotonic()
        [got] = consumer.fetch([second["handle"]], timeout=30)
        assert "timed out after 1.0s" in got["error"]
        assert time.monotonic() - start < 5
        os.kill(producer.proc.pid, signal.SIGCONT)
        assert_fetched([second], consumer.fetch([second["handle"]]))
        assert wait_unpinned(producer)["pinned_handles"] == 0
    finally:
        producer.kill()
        consumer.close()


@pytest.mark.server
@pytest.mark.timeout(120)
def test_restarted_producer_does_not_serve_old_handles():
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        port = sock.getsockname()[1]
    old = Peer("producer", "nixl", port=port)
    try:
        [put] = old.put([(4, 4)])
    finally:
        old.kill()
    new = Peer("producer", "nixl", port=port)
    consumer = Peer("consumer", "nixl")
    try:
        [got] = consumer.fetch([put["handle"]])
        assert "is gone" in got["error"] and "encoder restarted?" in got["error"]
    finally:
        new.close()
        consumer.close()
