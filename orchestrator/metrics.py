"""Prometheus metrics published through Triton's python-backend metric API.

They appear on the hosting server's ``/metrics`` next to Triton's own series, so one scrape
config covers the whole deployment.
"""

from __future__ import annotations

import asyncio
import contextlib
import time
from collections.abc import Iterator
from dataclasses import asdict
from typing import Any

from orchestrator.transfer.base import EmbeddingProducer

POOL_GAUGES = {
    "slots_in_use": "Embedding handles parked in the encoder pool, not yet pulled",
    "bytes_in_use": "Bytes of the encoder pool held by parked embeddings",
    "bytes_free": "Free bytes in the encoder pool",
    "pool_bytes": "Size of the encoder pool (registered once with NIXL)",
    "reclaimed_expired": "Handles reclaimed because nobody pulled them before their TTL",
}


class PoolMetrics:
    """Gauges ``epd_embedding_pool_*`` mirroring a producer's stats.

    Slots are freed asynchronously (by the consumer's NIXL notification or by TTL), so the
    gauges are refreshed on a timer as well as after every put.
    """

    def __init__(self, pb_utils: Any, producer: EmbeddingProducer, labels: dict[str, str]):
        self._producer = producer
        self._gauges = {}
        for field, doc in POOL_GAUGES.items():
            family = pb_utils.MetricFamily(
                name=f"epd_embedding_pool_{field}",
                description=doc,
                kind=pb_utils.MetricFamily.GAUGE,
            )
            self._gauges[field] = (family, family.Metric(labels=labels))
        self._task: asyncio.Task | None = None

    def update(self) -> None:
        for field, value in asdict(self._producer.stats()).items():
            if field in self._gauges:
                self._gauges[field][1].set(float(value))

    def start(self, period_s: float = 0.5) -> None:
        async def refresh() -> None:
            while True:
                self.update()
                await asyncio.sleep(period_s)

        self._task = asyncio.get_running_loop().create_task(refresh())

    async def stop(self) -> None:
        if self._task is not None:
            self._task.cancel()
            with contextlib.suppress(asyncio.CancelledError):
                await self._task
        self._gauges.clear()  # metrics go before their families, as Triton requires


LATENCY_BUCKETS_S = [0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1.0, 2.5, 5.0, 10.0, 30.0]


class StageLatency:
    """Histogram ``epd_stage_latency_seconds{stage=...}`` of the front's calls to each stage,
    so a slow hop shows up on the front's ``/metrics`` without tracing."""

    STAGES = ("encode", "prefill", "decode_first_token", "decode")

    def __init__(self, pb_utils: Any, labels: dict[str, str]) -> None:
        self._family = pb_utils.MetricFamily(
            name="epd_stage_latency_seconds",
            description="Latency of the epd front's calls to each stage",
            kind=pb_utils.MetricFamily.HISTOGRAM,
        )
        self._metrics = {
            stage: self._family.Metric(labels={**labels, "stage": stage}, buckets=LATENCY_BUCKETS_S)
            for stage in self.STAGES
        }

    def observe(self, stage: str, seconds: float) -> None:
        self._metrics[stage].observe(seconds)

    @contextlib.contextmanager
    def timed(self, stage: str) -> Iterator[None]:
        """Observe the block's duration (also when it fails: slow failures matter too)."""
        start = time.perf_counter()
        try:
            yield
        finally:
            self.observe(stage, time.perf_counter() - start)

    def close(self) -> None:
        self._metrics.clear()  # metrics go before their family, as Triton requires
