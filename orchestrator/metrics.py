"""Prometheus metrics published through Triton's python-backend metric API.

They appear on the hosting server's ``/metrics`` next to Triton's own series, so one scrape
config covers the whole deployment.
"""

from __future__ import annotations

import asyncio
import contextlib
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
