"""``epd bench quick``: TTFT and throughput of ``epd`` against ``aggregated`` on one deployment.

A benchmark, not a test: it measures, prints ratios and writes JSON, and asserts nothing.
Both models get identical requests in alternating rounds, so a noisy machine hurts both alike.
The statistics are plain functions over recorded results, so they are unit-tested offline.
"""

from __future__ import annotations

import asyncio
import contextlib
import dataclasses
import json
import math
import os
import tempfile
import time
from collections.abc import Iterator, Sequence
from dataclasses import dataclass
from datetime import UTC, datetime
from pathlib import Path
from typing import Any

from tritonclient.grpc.aio import InferenceServerClient
from tritonclient.utils import InferenceServerException

from epd_bench.photos import photo_variant
from epd_bench.schema import machine_info, package_version
from orchestrator.config import Topology
from orchestrator.triton.deployment import Deployment, on_free_ports

MODELS = ("epd", "aggregated")
KINDS = ("image", "text")
PERCENTILES = (50, 90, 99)
WARMUP_REQUESTS = 2
"""Per model, before measuring: one photo and one text-only request (the mix's first two)."""

MIX: tuple[tuple[str | None, str], ...] = (
    ("astronaut", "Describe this image."),
    (None, "Tell me a story about a robot."),
    ("coffee", "What is in the cup?"),
    ("chelsea", "What animal is this?"),
    (None, "Write a short poem about the sea."),
    ("rocket", "What is happening in this picture?"),
)
"""(scikit-image photo or None for text-only, prompt); request ``i`` is ``MIX[i % len(MIX)]``."""


class BenchError(Exception):
    """The benchmark cannot run as asked (bad settings, unreachable or broken server)."""


@dataclass(frozen=True)
class Settings:
    """What ``epd bench quick`` sends (defaults live in the CLI)."""

    requests: int
    """Per model per round."""
    concurrency: int
    """Streams in flight at once."""
    rounds: int
    max_tokens: int
    timeout_s: float
    """Deadline of one request, so a stuck stream cannot hang the benchmark."""

    def __post_init__(self) -> None:
        counts = ("requests", "concurrency", "rounds", "max_tokens")
        if bad := [f"{name}={getattr(self, name)}" for name in counts if getattr(self, name) < 1]:
            raise BenchError(f"must be at least 1: {', '.join(bad)}")
        if self.timeout_s <= 0:
            raise BenchError(f"timeout must be positive: {self.timeout_s}")


@dataclass(frozen=True)
class BenchRequest:
    text: str
    images: tuple[bytes, ...]

    @property
    def kind(self) -> str:
        return "image" if self.images else "text"


@dataclass(frozen=True)
class RequestResult:
    """What one streamed request did; ``ttft_s`` is None when no text arrived."""

    kind: str
    ttft_s: float | None
    latency_s: float
    pieces: int
    """Non-empty text responses: at most one per token, fewer when a lagging stream
    coalesces them, so throughput is counted in requests and characters instead."""
    text: str = ""
    error: str | None = None


@dataclass(frozen=True)
class Round:
    """One model's pass over one round's requests."""

    model: str
    index: int
    results: list[RequestResult]
    wall_s: float


@dataclass(frozen=True)
class Summary:
    """Latency percentiles of the successful requests; throughput over the wall time."""

    requests: int
    errors: int
    ttft_s: dict[str, float | None]
    latency_s: dict[str, float | None]
    pieces: int
    chars: int
    wall_s: float
    requests_per_s: float | None
    chars_per_s: float | None


# --- workload ---------------------------------------------------------------------------


def workload(count: int, first_serial: int) -> list[BenchRequest]:
    """``count`` requests cycling through ``MIX``, all distinct from any other serial's.

    Every call has the same mix and sizes; ``first_serial`` only changes content, so rounds
    do equal work without later rounds becoming cache hits of earlier ones.
    """
    requests = []
    for i in range(count):
        serial = first_serial + i
        photo, prompt = MIX[i % len(MIX)]
        images = (photo_variant(photo, serial),) if photo else ()
        requests.append(BenchRequest(f"{prompt} (request {serial})", images))
    return requests


def round_order(index: int) -> tuple[str, ...]:
    """ABBA order, so neither model always goes first or always follows the other."""
    return MODELS if index % 2 == 0 else MODELS[::-1]


# --- statistics ---------------------------------------------------------------------------


def percentile(values: Sequence[float], q: float) -> float | None:
    """Linear interpolation between closest ranks (numpy's default); None when empty."""
    if not values:
        return None
    ordered = sorted(values)
    pos = (len(ordered) - 1) * q / 100
    lo = math.floor(pos)
    hi = min(lo + 1, len(ordered) - 1)
    return ordered[lo] + (ordered[hi] - ordered[lo]) * (pos - lo)


def _per_second(count: int, wall_s: float) -> float | None:
    return count / wall_s if wall_s > 0 else None


def summarize(results: Sequence[RequestResult], wall_s: float) -> Summary:
    """Failed requests count as errors only: they neither shorten latency nor add throughput."""
    ok = [r for r in results if r.error is None]
    ttfts = [r.ttft_s for r in ok if r.ttft_s is not None]
    latencies = [r.latency_s for r in ok]
    chars = sum(len(r.text) for r in ok)
    return Summary(
        requests=len(results),
        errors=len(results) - len(ok),
        ttft_s={f"p{q}": percentile(ttfts, q) for q in PERCENTILES},
        latency_s={f"p{q}": percentile(latencies, q) for q in PERCENTILES},
        pieces=sum(r.pieces for r in ok),
        chars=chars,
        wall_s=wall_s,
        requests_per_s=_per_second(len(ok), wall_s),
        chars_per_s=_per_second(chars, wall_s),
    )


def model_stats(rounds: Sequence[Round]) -> dict[str, Any]:
    """One model's rounds pooled (``all``, ``image``, ``text``) plus each round alone.

    The per-kind summaries share the whole wall time, so their throughputs add up to ``all``.
    """
    results = [r for rnd in rounds for r in rnd.results]
    wall_s = sum(rnd.wall_s for rnd in rounds)
    stats: dict[str, Any] = {"all": summarize(results, wall_s)}
    for kind in KINDS:
        stats[kind] = summarize([r for r in results if r.kind == kind], wall_s)
    stats["rounds"] = [summarize(rnd.results, rnd.wall_s) for rnd in rounds]
    return stats


def output_mismatches(epd: Round, aggregated: Round) -> int:
    """Requests both answered, with different text. Greedy output is meant to be identical,
    so a nonzero count means the two models did not do the same work and ratios mislead."""
    pairs = zip(epd.results, aggregated.results, strict=True)
    return sum(e.error is None and a.error is None and e.text != a.text for e, a in pairs)


def _ratio(num: float | None, den: float | None) -> float | None:
    return num / den if num is not None and den else None


def ratios(epd: Summary, aggregated: Summary) -> dict[str, float | None]:
    """epd / aggregated: below 1 is better for times, above 1 is better for throughput."""
    return {
        "ttft_p50": _ratio(epd.ttft_s["p50"], aggregated.ttft_s["p50"]),
        "ttft_p90": _ratio(epd.ttft_s["p90"], aggregated.ttft_s["p90"]),
        "latency_p50": _ratio(epd.latency_s["p50"], aggregated.latency_s["p50"]),
        "latency_p90": _ratio(epd.latency_s["p90"], aggregated.latency_s["p90"]),
        "requests_per_s": _ratio(epd.requests_per_s, aggregated.requests_per_s),
        "chars_per_s": _ratio(epd.chars_per_s, aggregated.chars_per_s),
    }


def _fmt(value: float | None, scale: float = 1.0, spec: str = ".0f") -> str:
    return "-" if value is None else format(value * scale, spec)


def ratio_line(r: dict[str, float | None]) -> str:
    """The one line to read. Both models generate the same text for the same requests, so
    completed requests per second is the throughput (and equals the output-rate ratio)."""
    return (
        f"epd/aggregated: TTFT p50 {_fmt(r['ttft_p50'], spec='.2f')}x, "
        f"throughput {_fmt(r['requests_per_s'], spec='.2f')}x"
    )


def format_table(stats: dict[str, dict[str, Any]]) -> str:
    """Per model and kind: counts, TTFT and latency percentiles in ms, throughput."""
    lines = [
        f"{'model':<11}{'kind':<6}{'reqs':>5}{'err':>4}  {'TTFT ms p50/p90/p99':>21}  "
        f"{'latency ms p50/p90/p99':>23}{'req/s':>7}{'chars/s':>9}"
    ]
    for model, by_kind in stats.items():
        for kind in ("all", *KINDS):
            s: Summary = by_kind[kind]
            ttft = "/".join(_fmt(s.ttft_s[f"p{q}"], 1000) for q in PERCENTILES)
            latency = "/".join(_fmt(s.latency_s[f"p{q}"], 1000) for q in PERCENTILES)
            lines.append(
                f"{model:<11}{kind:<6}{s.requests:>5}{s.errors:>4}  {ttft:>21}  {latency:>23}"
                f"{_fmt(s.requests_per_s, spec='.2f'):>7}{_fmt(s.chars_per_s, spec='.1f'):>9}"
            )
    return "\n".join(lines)


# --- running ------------------------------------------------------------------------------


async def _send(
    client: InferenceServerClient,
    model: str,
    request: BenchRequest,
    sampling: dict,
    timeout_s: float,
) -> RequestResult:
    """One request on its own gRPC stream (``load.stream_request``), as this report counts it."""
    from epd_bench.load import LoadRequest, stream_request

    load_request = LoadRequest(request.kind, request.text, request.images)
    sample = await stream_request(client, model, load_request, sampling, timeout_s)
    if sample.error is not None:
        return RequestResult(request.kind, None, sample.latency_s, 0, error=sample.error)
    pieces = len(sample.piece_times)
    return RequestResult(request.kind, sample.ttft_s, sample.latency_s, pieces, sample.text)


async def run_round(
    client: InferenceServerClient, model: str, requests: list[BenchRequest], settings: Settings
) -> tuple[list[RequestResult], float]:
    sampling = {"max_tokens": settings.max_tokens, "temperature": 0}
    gate = asyncio.Semaphore(settings.concurrency)

    async def gated(request: BenchRequest) -> RequestResult:
        async with gate:
            return await _send(client, model, request, sampling, settings.timeout_s)

    start = time.perf_counter()
    results = await asyncio.gather(*(gated(r) for r in requests))
    return list(results), time.perf_counter() - start


async def _bench(url: str, settings: Settings) -> list[Round]:
    rounds: list[Round] = []
    async with InferenceServerClient(url) as client:
        for model in MODELS:
            try:
                ready = await client.is_model_ready(model, client_timeout=10)
            except InferenceServerException as exc:
                raise BenchError(f"cannot reach {url}: {exc}") from None
            if not ready:
                raise BenchError(f"model {model!r} is not ready at {url}")
        warmup = workload(WARMUP_REQUESTS, first_serial=0)
        for model in MODELS:
            results, _ = await run_round(client, model, warmup, settings)
            if all(r.error for r in results):
                raise BenchError(f"every warm-up request to {model!r} failed: {results[0].error}")
        for index in range(settings.rounds):
            requests = workload(settings.requests, WARMUP_REQUESTS + index * settings.requests)
            for model in round_order(index):
                results, wall_s = await run_round(client, model, requests, settings)
                rounds.append(Round(model, index, results, wall_s))
                errors = sum(r.error is not None for r in results)
                print(
                    f"round {index + 1}/{settings.rounds} {model:<10} {len(results)} requests "
                    f"in {wall_s:.1f}s, {errors} errors",
                    flush=True,
                )
    return rounds


def build_report(rounds: Sequence[Round], context: dict[str, Any]) -> dict[str, Any]:
    """The JSON document: ``context`` plus per-model stats and epd/aggregated ratios."""
    by_model = {model: [r for r in rounds if r.model == model] for model in MODELS}
    stats = {model: model_stats(model_rounds) for model, model_rounds in by_model.items()}
    epd, aggregated = stats["epd"], stats["aggregated"]
    return {
        **context,
        "models": stats,
        "ratios": ratios(epd["all"], aggregated["all"]),
        "ratios_by_kind": {kind: ratios(epd[kind], aggregated[kind]) for kind in KINDS},
        "ratios_per_round": [
            ratios(e, a) for e, a in zip(epd["rounds"], aggregated["rounds"], strict=True)
        ],
        "output_mismatches": [
            output_mismatches(e, a)
            for e, a in zip(by_model["epd"], by_model["aggregated"], strict=True)
        ],
        "errors": sorted({r.error for rnd in rounds for r in rnd.results if r.error})[:10],
    }


def run(url: str, settings: Settings, args: dict[str, Any]) -> dict[str, Any]:
    """Warm up, run the alternating rounds against the front at ``url``, return the report."""
    load_before = os.getloadavg()
    rounds = asyncio.run(_bench(url, settings))
    context = {
        "timestamp": datetime.now(UTC).isoformat(timespec="seconds"),
        "machine": machine_info(load_before),
        "versions": {
            "vllm": package_version("vllm"),
            "tritonclient": package_version("tritonclient"),
        },
        "args": args,
        "url": url,
        "settings": settings,
        "workload": {"mix": [photo or "text-only" for photo, _ in MIX]},
    }
    return build_report(rounds, context)


def warnings(report: dict[str, Any]) -> list[str]:
    """What makes the ratios doubtful: failed requests and diverging outputs."""
    lines = [f"error: {error}" for error in report["errors"]]
    if any(report["output_mismatches"]):
        lines.append(
            f"warning: epd and aggregated answered differently "
            f"(per round: {report['output_mismatches']}); they did not do the same work"
        )
    return lines


def write_report(report: dict[str, Any], path: Path) -> None:
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(json.dumps(report, indent=2, default=dataclasses.asdict) + "\n")


# --- embedded deployment ------------------------------------------------------------------


@contextlib.contextmanager
def embedded_deployment(
    topology: Topology, timeout_s: float, traces: bool = False
) -> Iterator[Deployment]:
    """Run ``topology`` on free ports in a throwaway workdir; yield the running deployment.
    With ``traces``, every server writes its spans to ``tracing.directory`` in that workdir.

    The deployment is always stopped, whatever happens inside.
    """
    topology = on_free_ports(topology)
    with tempfile.TemporaryDirectory(prefix="epd-bench-") as workdir:
        if traces:
            tracing = topology.tracing.model_copy(update={"directory": Path(workdir) / "traces"})
            topology = topology.model_copy(update={"tracing": tracing})
        with Deployment(topology, Path(workdir)).running(timeout_s) as deployment:
            yield deployment


@contextlib.contextmanager
def embedded(topology: Topology, timeout_s: float, traces: bool = False) -> Iterator[Topology]:
    """``embedded_deployment``, yielding the topology it runs (its ports, its trace folder)."""
    with embedded_deployment(topology, timeout_s, traces) as deployment:
        yield deployment.topology
