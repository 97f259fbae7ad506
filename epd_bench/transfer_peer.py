"""One side of ``epd bench transfer``, in a process of its own: NIXL and Mooncake are not
fork-safe, and a separate consumer process is what prefill is.

Usage: ``python -m epd_bench.transfer_peer producer|consumer KIND CONFIG_JSON``
(CONFIG_JSON: :class:`~orchestrator.transfer.ProducerConfig` or ``ConsumerConfig`` fields).
Answers ``{"ready": true}`` once the transport is up, then one JSON command per stdin line
with one line ``@@ <json>`` on stdout (other stdout lines are library noise). Any failure
ends the process with a traceback on stderr; so does end of input, after closing the
transport, so a peer never outlives its driver.

Producer ops: ``put`` (``nbytes``, ``serial``) -> ``handle``, ``seconds`` in ``put``.
Consumer ops: ``fetch`` (``handle``) -> ``seconds`` in ``fetch_into``, ``nbytes`` fetched;
``memcpy`` (``nbytes``, ``repeats``) -> ``seconds`` of each ``np.copyto`` of that size.
"""

from __future__ import annotations

import json
import sys
import time
from collections.abc import Callable

import numpy as np

from orchestrator.protocol import EmbeddingHandle
from orchestrator.transfer import EmbeddingProducer, make_consumer, make_producer
from orchestrator.transfer.base import numpy_dtype

COLUMNS = 256
"""float32 columns of a benchmark embedding: one KiB per row."""
UNPIN_WAIT_S = 5.0


def embedding(nbytes: int) -> np.ndarray:
    """A 2-D float32 array of exactly ``nbytes`` (a multiple of 1 KiB), its pages touched."""
    row = 4 * COLUMNS
    if nbytes <= 0 or nbytes % row:
        raise ValueError(f"benchmark sizes must be positive multiples of {row} bytes: {nbytes}")
    return np.full((nbytes // row, COLUMNS), 1.0, np.float32)


def serve_producer(kind: str, cfg: dict) -> None:
    producer = make_producer(kind, **cfg)
    arrays: dict[int, np.ndarray] = {}

    def run(cmd: dict) -> dict:
        if cmd["op"] != "put":
            raise ValueError(f"unknown producer op {cmd['op']!r}")
        nbytes = cmd["nbytes"]
        if nbytes not in arrays:
            arrays[nbytes] = embedding(nbytes)
        _wait_unpinned(producer)
        start = time.perf_counter()
        handle = producer.put(arrays[nbytes], content_hash=f"bench-{nbytes}-{cmd['serial']}")
        seconds = time.perf_counter() - start
        return {"handle": handle.model_dump(mode="json"), "seconds": seconds}

    serve(run, producer.close)


def _wait_unpinned(producer: EmbeddingProducer) -> None:
    """Let the last fetch's notification free its slot first (bounded), so the pool never
    fills and the producer is not freeing while the next fetch runs."""
    deadline = time.monotonic() + UNPIN_WAIT_S
    while producer.stats().pinned_handles and time.monotonic() < deadline:
        time.sleep(0.001)


def serve_consumer(kind: str, cfg: dict) -> None:
    consumer = make_consumer(kind, **cfg)
    landing: dict[tuple, np.ndarray] = {}

    def fetch(raw: dict) -> dict:
        """``fetch_into`` a destination reused per shape, like memcpy's: faulting in a fresh
        array's pages (prefill allocates one per request) is the allocator's cost, not the
        transport's."""
        handle = EmbeddingHandle.model_validate(raw)
        key = (handle.shape, handle.dtype)
        if (out := landing.get(key)) is None:
            out = landing[key] = np.zeros(handle.shape, numpy_dtype(handle.dtype))
        start = time.perf_counter()
        consumer.fetch_into(handle, out)
        return {"seconds": time.perf_counter() - start, "nbytes": out.nbytes}

    def memcpy(nbytes: int, repeats: int) -> dict:
        src = embedding(nbytes)
        dst = np.empty_like(src)
        np.copyto(dst, src)  # fault the destination's pages in, as a reused buffer has them
        seconds = []
        for _ in range(repeats):
            start = time.perf_counter()
            np.copyto(dst, src)
            seconds.append(time.perf_counter() - start)
        return {"seconds": seconds}

    def run(cmd: dict) -> dict:
        match cmd["op"]:
            case "fetch":
                return fetch(cmd["handle"])
            case "memcpy":
                return memcpy(cmd["nbytes"], cmd["repeats"])
        raise ValueError(f"unknown consumer op {cmd['op']!r}")

    serve(run, consumer.close)


def serve(run: Callable[[dict], dict], close: Callable[[], None]) -> None:
    """Answer commands until end of input, then close the transport."""
    try:
        reply({"ready": True})
        for line in sys.stdin:
            reply(run(json.loads(line)))
    finally:
        close()


def reply(obj: dict) -> None:
    sys.stdout.write("@@ " + json.dumps(obj) + "\n")
    sys.stdout.flush()


if __name__ == "__main__":
    role, kind, config = sys.argv[1], sys.argv[2], json.loads(sys.argv[3])
    {"producer": serve_producer, "consumer": serve_consumer}[role](kind, config)
