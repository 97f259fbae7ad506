"""One side of a transfer test, run in its own process (NIXL is not fork-safe).

Usage: ``python transfer_peer.py producer|consumer KIND CONFIG_JSON``. Reads one JSON
command per line on stdin and answers each with one line ``@@ <json>`` on stdout (other
stdout lines are library noise). Keeps the pytest process free of NIXL.
"""

from __future__ import annotations

import hashlib
import json
import sys
import time
from concurrent.futures import ThreadPoolExecutor
from dataclasses import asdict

import numpy as np

from orchestrator.protocol import EmbeddingHandle, TransferError
from orchestrator.transfer import PoolFullError, make_consumer, make_producer
from orchestrator.transfer.base import numpy_dtype


def sha256(arr: np.ndarray) -> str:
    return hashlib.sha256(np.ascontiguousarray(arr).view(np.uint8).data).hexdigest()


def make_array(seed: int, rows: int, cols: int, dtype: str) -> np.ndarray:
    values = np.random.default_rng(seed).standard_normal((rows, cols), np.float32)
    return values.astype(numpy_dtype(dtype))


def key(spec: dict) -> str:
    """Content hash stand-in: the array is a function of these fields."""
    return f"{spec['seed']}-{spec['rows']}x{spec['cols']}-{spec['dtype']}"


def serve_producer(kind: str, cfg: dict) -> None:
    producer = make_producer(kind, **cfg)

    def put(spec: dict) -> dict:
        arr = make_array(spec["seed"], spec["rows"], spec["cols"], spec["dtype"])
        try:
            handle = producer.put(arr, content_hash=key(spec))
        except PoolFullError as exc:
            return {"error": str(exc)}
        return {"handle": handle.model_dump(mode="json"), "sha256": sha256(arr)}

    def lookup(spec: dict) -> dict:
        handle = producer.lookup(key(spec))
        return {"handle": handle.model_dump(mode="json")} if handle else {"miss": True}

    def run(cmd: dict) -> dict:
        match cmd["op"]:
            case "put":
                with ThreadPoolExecutor(cmd.get("threads", 1)) as pool:
                    return {"results": list(pool.map(put, cmd["specs"]))}
            case "lookup":
                return {"results": [lookup(spec) for spec in cmd["specs"]]}
            case "release":
                return {"released": producer.release(cmd["handle_id"])}
            case "stats":
                return asdict(producer.stats())
        raise ValueError(f"unknown op {cmd['op']!r}")

    serve(run, producer.close)


def serve_consumer(kind: str, cfg: dict) -> None:
    consumer = make_consumer(kind, **cfg)

    def fetch(raw: dict) -> dict:
        handle = EmbeddingHandle.model_validate(raw)
        start = time.perf_counter()
        try:
            arr = consumer.fetch(handle)
        except TransferError as exc:
            return {"error": str(exc), "seconds": time.perf_counter() - start}
        seconds = time.perf_counter() - start
        return {
            "sha256": sha256(arr),
            "shape": list(arr.shape),
            "dtype": arr.dtype.name,
            "seconds": seconds,
        }

    def fetch_rows(raws: list[dict]) -> dict:
        """Land same-width handles in consecutive rows of one array, as prefill does,
        between two guard rows; then offer a destination of the wrong shape."""
        handles = [EmbeddingHandle.model_validate(raw) for raw in raws]
        dtype, cols = numpy_dtype(handles[0].dtype), handles[0].shape[1]
        rows = sum(h.shape[0] for h in handles)
        out = np.full((rows + 2, cols), 7, dtype)
        at, digests = 1, []
        for h in handles:
            consumer.fetch_into(h, out[at : at + h.shape[0]])
            digests.append(sha256(out[at : at + h.shape[0]]))
            at += h.shape[0]
        try:
            consumer.fetch_into(handles[0], out[: handles[0].shape[0] + 1])
            wrong = "accepted"
        except ValueError as exc:
            wrong = str(exc)
        guards = bool((out[0] == 7).all() and (out[-1] == 7).all())
        return {"sha256": digests, "guards_intact": guards, "wrong_shape": wrong}

    def run(cmd: dict) -> dict:
        if cmd["op"] == "fetch_rows":
            return fetch_rows(cmd["handles"])
        if cmd["op"] == "release":
            consumer.release(EmbeddingHandle.model_validate(cmd["handle"]))
            return {"released": True}
        if cmd["op"] != "fetch":
            raise ValueError(f"unknown op {cmd['op']!r}")
        with ThreadPoolExecutor(cmd.get("threads", 1)) as pool:
            return {"results": list(pool.map(fetch, cmd["handles"]))}

    serve(run, consumer.close)


def serve(run, close) -> None:
    reply({"ready": True})
    for line in sys.stdin:
        cmd = json.loads(line)
        if cmd["op"] == "close":
            close()
            reply({"closed": True})
            return
        reply(run(cmd))


def reply(obj: dict) -> None:
    sys.stdout.write("@@ " + json.dumps(obj) + "\n")
    sys.stdout.flush()


if __name__ == "__main__":
    role, kind, config = sys.argv[1], sys.argv[2], json.loads(sys.argv[3])
    (serve_producer if role == "producer" else serve_consumer)(kind, config)
