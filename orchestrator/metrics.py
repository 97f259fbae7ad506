"""Prometheus metrics published through Triton's python-backend metric API (or, for a
handler hosted outside Triton, a ``prometheus_client`` registry).

They appear on the hosting server's ``/metrics`` next to Triton's own series, so one scrape
config covers the whole deployment. Handlers record into plain Python objects; one task on
the model's event loop copies them into Triton every ``period_s``. Only gauges and counters
reach the metric API: the 2.51 stub crashed with its HISTOGRAM kind, so a
:class:`Histogram` is published the way Prometheus lays one out -- ``_bucket{le=...}``,
``_sum`` and ``_count`` counter series -- and ``histogram_quantile`` works on it as usual.
"""

from __future__ import annotations

import asyncio
import bisect
import contextlib
import threading
import urllib.request
from collections.abc import Callable, Iterable, Iterator
from typing import TYPE_CHECKING, Any, Protocol

if TYPE_CHECKING:
    from orchestrator.config import Topology

LATENCY_BUCKETS_S = (0.001, 0.0025, 0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1.0, 2.5, 5.0, 10.0)
"""Bucket bounds for latencies, 1 ms .. 10 s."""


class Histogram:
    """Cumulative bucket counts, sum and count of observations; thread-safe."""

    def __init__(self, buckets: Iterable[float] = LATENCY_BUCKETS_S) -> None:
        self.bounds = tuple(sorted(buckets))
        self._counts = [0] * (len(self.bounds) + 1)  # last one is +Inf
        self._sum = 0.0
        self._lock = threading.Lock()

    def observe(self, value: float) -> None:
        with self._lock:
            self._counts[bisect.bisect_left(self.bounds, value)] += 1
            self._sum += value

    def snapshot(self) -> tuple[list[int], float, int]:
        """(cumulative count per bound incl. +Inf, sum, count)."""
        with self._lock:
            counts, total = list(self._counts), self._sum
        cumulative, running = [], 0
        for c in counts:
            running += c
            cumulative.append(running)
        return cumulative, total, running


class MetricSink(Protocol):
    """Where a handler's series go: Triton's metric API (:class:`MetricsPublisher`) or a
    ``prometheus_client`` registry (:class:`RegistryPublisher`)."""

    def gauge(self, name: str, doc: str, read: Callable[[], float], **labels: str) -> None: ...

    def counter(self, name: str, doc: str, read: Callable[[], float], **labels: str) -> None: ...

    def histogram(self, name: str, doc: str, **labels: str) -> Histogram: ...

    def start(self, period_s: float = 0.5) -> None: ...

    async def stop(self) -> None: ...


class MetricsPublisher:
    """The metric families of one model instance and the task that keeps them current."""

    def __init__(self, pb_utils: Any, labels: dict[str, str]) -> None:
        self._pb = pb_utils
        self._labels = labels
        self._families: dict[str, Any] = {}
        self._updates: list[Callable[[], None]] = []
        self._task: asyncio.Task | None = None

    def _metric(self, name: str, doc: str, kind: str, labels: dict[str, str]) -> Any:
        family = self._families.get(name)
        if family is None:
            mf = self._pb.MetricFamily
            family = mf(name=name, description=doc, kind=getattr(mf, kind))
            self._families[name] = family
        return family.Metric(labels={**self._labels, **labels})

    def gauge(self, name: str, doc: str, read: Callable[[], float], **labels: str) -> None:
        metric = self._metric(name, doc, "GAUGE", labels)
        self._updates.append(lambda: metric.set(float(read())))

    def counter(self, name: str, doc: str, read: Callable[[], float], **labels: str) -> None:
        """A counter mirroring ``read()``, which must never decrease."""
        metric = self._metric(name, doc, "COUNTER", labels)
        published = [0.0]

        def update() -> None:
            value = float(read())
            if value > published[0]:
                metric.increment(value - published[0])
                published[0] = value

        self._updates.append(update)

    def histogram(self, name: str, doc: str, **labels: str) -> Histogram:
        hist = Histogram()
        bounds = [*map(str, hist.bounds), "+Inf"]
        for i, le in enumerate(bounds):
            self.counter(f"{name}_bucket", doc, lambda i=i: hist.snapshot()[0][i], le=le, **labels)
        self.counter(f"{name}_sum", doc, lambda: hist.snapshot()[1], **labels)
        self.counter(f"{name}_count", doc, lambda: hist.snapshot()[2], **labels)
        return hist

    def on_publish(self, update: Callable[[], None]) -> None:
        """Run ``update`` at the start of every publish (e.g. to take one snapshot)."""
        self._updates.insert(0, update)

    def publish(self) -> None:
        for update in self._updates:
            update()

    def start(self, period_s: float = 0.5) -> None:
        """Publish every ``period_s`` from the running loop (the one handlers are built on)."""

        async def refresh() -> None:
            while True:
                self.publish()
                await asyncio.sleep(period_s)

        self._task = asyncio.get_running_loop().create_task(refresh())

    async def stop(self) -> None:
        if self._task is not None:
            self._task.cancel()
            with contextlib.suppress(asyncio.CancelledError):
                await self._task
        self._updates.clear()  # metrics go before their families, as Triton requires
        self._families.clear()


class RegistryPublisher:
    """The same families as :class:`MetricsPublisher`, for a handler that runs outside a
    Triton stub (the OpenAI front runs ``epd``'s pipeline itself): they join a
    ``prometheus_client`` registry, read when it is scraped, so nothing runs in between."""

    def __init__(self, registry: Any, labels: dict[str, str]) -> None:
        self._registry = registry
        self._labels = labels
        self._series: list[tuple[str, str, str, dict[str, str], Any]] = []
        self._before: list[Callable[[], None]] = []
        registry.register(self)

    def gauge(self, name: str, doc: str, read: Callable[[], float], **labels: str) -> None:
        self._series.append((name, doc, "gauge", labels, read))

    def counter(self, name: str, doc: str, read: Callable[[], float], **labels: str) -> None:
        """A counter mirroring ``read()``, which must never decrease."""
        self._series.append((name, doc, "counter", labels, read))

    def histogram(self, name: str, doc: str, **labels: str) -> Histogram:
        hist = Histogram()
        self._series.append((name, doc, "histogram", labels, hist))
        return hist

    def on_publish(self, update: Callable[[], None]) -> None:
        """Run ``update`` before every scrape (e.g. to take one snapshot)."""
        self._before.append(update)

    def start(self, period_s: float = 0.5) -> None:
        """Nothing to do: the series are read when scraped."""

    async def stop(self) -> None:
        self._registry.unregister(self)

    def collect(self) -> Iterator[Any]:
        """``prometheus_client``'s collector interface."""
        from prometheus_client.core import (
            CounterMetricFamily,
            GaugeMetricFamily,
            HistogramMetricFamily,
        )

        kinds = {
            "gauge": GaugeMetricFamily,
            "counter": CounterMetricFamily,
            "histogram": HistogramMetricFamily,
        }
        for update in self._before:
            update()
        families: dict[str, Any] = {}
        for name, doc, kind, own, source in self._series:
            labels = {**self._labels, **own}
            family = families.get(name)
            if family is None:
                family = families[name] = kinds[kind](name, doc, labels=list(labels))
            values = list(labels.values())
            if kind == "histogram":
                cumulative, total, _ = source.snapshot()
                bounds = [*map(str, source.bounds), "+Inf"]
                family.add_metric(values, list(zip(bounds, cumulative, strict=True)), total)
            else:
                family.add_metric(values, float(source()))
        yield from families.values()


def publish_engine(metrics: MetricsPublisher, engine: Any, role: str) -> None:
    """Series of one vLLM engine (an ``llm.LLMEngine``): what it took in and what it is
    still working on."""
    metrics.counter(
        "epd_engine_requests_total",
        "Requests the vLLM engine has taken in",
        lambda: engine.admitted,
        role=role,
    )
    metrics.gauge(
        "epd_engine_unfinished_requests",
        "Requests the vLLM engine has neither finished nor aborted",
        engine.unfinished_requests,
        role=role,
    )

    def scheduler(field: str) -> Callable[[], float]:
        return lambda: getattr(engine.scheduler_stats, field, 0.0)

    metrics.gauge(
        "epd_engine_running_requests",
        "Requests the engine core scheduled in its latest step",
        scheduler("num_running_reqs"),
        role=role,
    )
    metrics.gauge(
        "epd_engine_waiting_requests",
        "Requests waiting for the engine core to schedule them (its queue)",
        scheduler("num_waiting_reqs"),
        role=role,
    )
    metrics.gauge(
        "epd_engine_kv_cache_usage",
        "Fraction of the engine's KV cache blocks in use after its latest step",
        scheduler("kv_cache_usage"),
        role=role,
    )


CACHE_GAUGES = {
    "entries": "Embeddings held in the encoder cache, pinned or not",
    "pinned_handles": "Handles lent out by the encoder and not yet pulled",
    "bytes_in_use": "Bytes of the encoder cache in use",
    "bytes_free": "Free bytes in the encoder cache",
    "pool_bytes": "Byte budget of the encoder cache (for NIXL: the registered pool)",
}
CACHE_COUNTERS = {
    "hits": "Images answered from the encoder cache (no encoder pass)",
    "misses": "Images the encoder had to encode",
    "evictions": "Unpinned embeddings evicted to make room",
    "expired": "Handles unpinned because nobody pulled them before their TTL",
}


def publish_producer(publisher: MetricsPublisher, stats: Callable[[], Any]) -> None:
    """``epd_encoder_cache_*`` series from a producer's ``stats()``, one snapshot a publish."""
    snapshot = [stats()]
    publisher.on_publish(lambda: snapshot.__setitem__(0, stats()))
    for field, doc in CACHE_GAUGES.items():
        read = lambda f=field: getattr(snapshot[0], f)  # noqa: E731
        publisher.gauge(f"epd_encoder_cache_{field}", doc, read)
    for field, doc in CACHE_COUNTERS.items():
        read = lambda f=field: getattr(snapshot[0], f)  # noqa: E731
        publisher.counter(f"epd_encoder_cache_{field}_total", doc, read)


def scrape(host: str, port: int, name: str, **labels: str) -> float:
    """Sum of the series ``name`` on ``http://host:port/metrics`` whose labels include
    ``labels`` (e.g. Triton's ``nv_inference_count`` for ``model="vision_encoder"``)."""
    url = f"http://{host}:{port}/metrics"
    with urllib.request.urlopen(url, timeout=10) as response:
        lines = response.read().decode().splitlines()
    wanted = [f'{k}="{v}"' for k, v in labels.items()]
    total, found = 0.0, False
    for line in lines:
        series, _, value = line.rpartition(" ")
        if series.partition("{")[0] == name and all(w in series for w in wanted):
            total += float(value)
            found = True
    if not found:
        raise LookupError(f"no series {name}{labels or ''} at {url}")
    return total


def encoder_passes(topology: Topology) -> int:
    """Vision encoder forward passes so far on every encoder server, by Triton's own count."""
    return sum(
        int(scrape(s.host, s.metrics_port, "nv_inference_count", model="vision_encoder"))
        for s in topology.servers_of("encode").values()
    )
