"""``epd bench run``: a load generator for ``epd`` / ``aggregated`` over gRPC streaming.

Workloads are lists of requests of labelled kinds (``text``, ``image``, ``multi``,
``large``); a run sends one workload to one model either closed-loop (a fixed number of
requests in flight) or open-loop (Poisson arrivals at a fixed rate, whatever the server
does), records TTFT, the gaps between text responses (ITL) and end-to-end latency per
request, and reduces them to a :class:`~epd_bench.schema.RunResult`.
"""

from __future__ import annotations

import asyncio
import itertools
import random
import sys
import time
from collections.abc import Awaitable, Callable, Iterator, Sequence
from dataclasses import dataclass, field
from datetime import UTC, datetime
from pathlib import Path

from tritonclient.grpc.aio import InferenceServerClient

from epd_bench.schema import BenchReport, LatencyStats, RunResult, machine_info
from orchestrator.client import request_inputs
from orchestrator.tracing import read_spans

PHOTOS = ("astronaut", "coffee", "chelsea", "rocket")
PROMPTS = {
    "text": "Tell me a story about a robot.",
    "image": "Describe this image.",
    "multi": "Compare these two pictures.",
    "large": "What is in this photo?",
}


@dataclass(frozen=True)
class LoadRequest:
    kind: str
    text: str
    images: tuple[bytes, ...]


@dataclass
class Sample:
    """What one streamed request did (times in seconds from its start)."""

    kind: str
    start: float
    ttft_s: float | None = None
    latency_s: float = 0.0
    piece_times: list[float] = field(default_factory=list)
    text: str = ""
    error: str | None = None


# --- workloads ------------------------------------------------------------------------------


def _large_photo(name: str, serial: int) -> bytes:
    """A photo upscaled to 1536 px (a big upload; the encoder still resizes it down)."""
    from epd_bench.photos import photo_variant

    return photo_variant(name, serial, (1536, 1536), quality=90)


def _request(kind: str, serial: int, repeat_pool: int | None = None) -> LoadRequest:
    from epd_bench.photos import photo_variant

    def photo(k: int) -> bytes:
        key = serial + k if repeat_pool is None else (serial + k) % repeat_pool
        return photo_variant(PHOTOS[key % len(PHOTOS)], key)

    text = f"{PROMPTS[kind]} (request {serial})"
    if kind == "text":
        return LoadRequest(kind, text, ())
    if kind == "multi":
        return LoadRequest(kind, text, (photo(0), photo(1)))
    if kind == "large":
        return LoadRequest(kind, text, (_large_photo(PHOTOS[serial % len(PHOTOS)], serial),))
    return LoadRequest(kind, text, (photo(0),))


WORKLOADS: dict[str, Callable[[int, int], list[LoadRequest]]] = {
    "image": lambda n, s: [_request("image", s + i) for i in range(n)],
    "text": lambda n, s: [_request("text", s + i) for i in range(n)],
    # Text-only requests interleaved with image-heavy ones: does text wait behind encoding?
    "mixed": lambda n, s: [_request("text" if i % 2 else "multi", s + i) for i in range(n)],
    "repeated": lambda n, s: [_request("image", s + i, repeat_pool=4) for i in range(n)],
    "multi": lambda n, s: [_request("multi", s + i) for i in range(n)],
    "large": lambda n, s: [_request("large", s + i) for i in range(n)],
}
"""Workload name -> (count, first serial) -> requests. Serials make content unique per run,
except ``repeated``, which cycles through four photos."""


# --- sending ----------------------------------------------------------------------------------


async def stream_request(
    client: InferenceServerClient,
    model: str,
    request: LoadRequest,
    sampling: dict,
    timeout_s: float,
) -> Sample:
    """One request on its own gRPC stream; any failure is recorded, never raised."""
    inputs = request_inputs(request.text, list(request.images), sampling, stream=True)

    async def one():
        yield {"model_name": model, "inputs": inputs}

    sample = Sample(request.kind, time.perf_counter())
    pieces: list[str] = []
    responses = client.stream_infer(one(), stream_timeout=timeout_s)
    try:
        async with asyncio.timeout(timeout_s):
            async for result, error in responses:
                if error is not None:
                    raise error
                if piece := result.as_numpy("text_output").reshape(-1)[0].decode():
                    sample.piece_times.append(time.perf_counter() - sample.start)
                    pieces.append(piece)
    except Exception as exc:  # one errored request, not a crashed benchmark
        sample.error = f"{type(exc).__name__}: {exc}"
    finally:
        responses.cancel()
    sample.latency_s = time.perf_counter() - sample.start
    sample.ttft_s = sample.piece_times[0] if sample.piece_times else None
    sample.text = "".join(pieces)
    return sample


class Progress:
    """A one-line progress bar on stderr (only when it is a terminal)."""

    def __init__(self, total: int, label: str) -> None:
        self.total, self.label, self.done = total, label, 0
        self.enabled = sys.stderr.isatty()

    def step(self) -> None:
        self.done += 1
        if self.enabled:
            filled = 30 * self.done // max(1, self.total)
            bar = "#" * filled + "." * (30 - filled)
            sys.stderr.write(f"\r{self.label} [{bar}] {self.done}/{self.total}")
            if self.done == self.total:
                sys.stderr.write("\n")
            sys.stderr.flush()


Send = Callable[[LoadRequest], Awaitable[Sample]]
"""Sends one request and records it: over gRPC to Triton, or straight into a vLLM engine."""


def grpc_sender(
    client: InferenceServerClient, model: str, sampling: dict, timeout_s: float
) -> Send:
    return lambda request: stream_request(client, model, request, sampling, timeout_s)


async def closed_loop(
    send: Send, requests: Sequence[LoadRequest], concurrency: int, progress: Progress | None = None
) -> tuple[list[Sample], float]:
    """Keep ``concurrency`` requests in flight until all are sent; (samples, wall seconds)."""
    gate = asyncio.Semaphore(concurrency)

    async def gated(request: LoadRequest) -> Sample:
        async with gate:
            sample = await send(request)
        if progress:
            progress.step()
        return sample

    start = time.perf_counter()
    samples = await asyncio.gather(*(gated(r) for r in requests))
    return list(samples), time.perf_counter() - start


async def open_loop(
    send: Send,
    requests: Sequence[LoadRequest],
    rate: float,
    seed: int = 0,
    progress: Progress | None = None,
) -> tuple[list[Sample], float]:
    """Send at Poisson arrival times of ``rate`` requests/s regardless of completions."""
    rng = random.Random(seed)
    start = time.perf_counter()
    tasks = []
    at = 0.0
    for request in requests:
        await asyncio.sleep(max(0.0, start + at - time.perf_counter()))
        tasks.append(asyncio.create_task(send(request)))
        if progress:
            tasks[-1].add_done_callback(lambda _: progress.step())
        at += rng.expovariate(rate)
    samples = await asyncio.gather(*tasks)
    return list(samples), time.perf_counter() - start


def load_points(plan: LoadPlan) -> list[tuple[str, float]]:
    return [("concurrency", float(c)) for c in plan.concurrency] + [("rate", r) for r in plan.rates]


def plan_requests(plan: LoadPlan) -> list[tuple[str, str, float, list[LoadRequest]]]:
    """(workload, load, level, requests) in run order; each point gets fresh content, so
    any two runners of the same plan (Triton, offline vLLM) send the same requests."""
    points, serial = [], 0
    for workload in plan.workloads:
        for load, level in load_points(plan):
            points.append((workload, load, level, WORKLOADS[workload](plan.requests, serial)))
            serial += plan.requests
    return points


async def measure(
    send: Send, requests: Sequence[LoadRequest], load: str, level: float, label: str
) -> tuple[list[Sample], float]:
    progress = Progress(len(requests), label)
    if load == "concurrency":
        return await closed_loop(send, requests, int(level), progress)
    return await open_loop(send, requests, level, progress=progress)


# --- statistics -------------------------------------------------------------------------------


def itl_gaps(samples: Sequence[Sample]) -> list[float]:
    return [b - a for s in samples if not s.error for a, b in itertools.pairwise(s.piece_times)]


PHASES = ("encode", "prefill", "first_token", "request")


def phase_totals(metrics: tuple[str, int]) -> dict[str, tuple[float, float]]:
    """(sum, count) of the front's ``epd_request_phase_seconds`` per phase, so far."""
    from orchestrator.metrics import scrape

    host, port = metrics
    name = "epd_request_phase_seconds"
    return {
        phase: (
            scrape(host, port, f"{name}_sum", phase=phase),
            scrape(host, port, f"{name}_count", phase=phase),
        )
        for phase in PHASES
    }


def phase_means(before: dict, after: dict) -> dict[str, float]:
    """Mean seconds per phase between two ``phase_totals`` snapshots."""
    means = {}
    for phase in PHASES:
        count = after[phase][1] - before[phase][1]
        if count > 0:
            means[phase] = (after[phase][0] - before[phase][0]) / count
    return means


def reduce(
    samples: Sequence[Sample],
    wall_s: float,
    *,
    target: str,
    workload: str,
    load: str,
    level: float,
) -> RunResult:
    """The run's statistics over successful requests; throughput over the wall time."""
    ok = [s for s in samples if s.error is None]
    kinds = sorted({s.kind for s in ok})
    return RunResult(
        tool="epd-bench",
        target=target,
        workload=workload,
        load=load,
        level=level,
        requests=len(samples),
        errors=len(samples) - len(ok),
        duration_s=wall_s,
        ttft_s=LatencyStats.of([s.ttft_s for s in ok if s.ttft_s is not None]),
        itl_s=LatencyStats.of(itl_gaps(ok)),
        latency_s=LatencyStats.of([s.latency_s for s in ok]),
        requests_per_s=len(ok) / wall_s if wall_s > 0 else None,
        tokens_per_s=sum(len(s.piece_times) for s in ok) / wall_s if wall_s > 0 else None,
        ttft_by_kind_s={
            kind: LatencyStats.of([s.ttft_s for s in ok if s.kind == kind and s.ttft_s is not None])
            for kind in kinds
        },
        error_samples=sorted({s.error for s in samples if s.error})[:5],
        ttft_samples_s=[s.ttft_s for s in ok if s.ttft_s is not None],
        latency_samples_s=[s.latency_s for s in ok],
    )


# --- running --------------------------------------------------------------------------------


@dataclass(frozen=True)
class LoadPlan:
    """What ``epd bench run`` sends."""

    models: tuple[str, ...]
    workloads: tuple[str, ...]
    concurrency: tuple[int, ...] = ()
    """Closed-loop levels (requests in flight)."""
    rates: tuple[float, ...] = ()
    """Open-loop levels (requests/s)."""
    requests: int = 24
    max_tokens: int = 16
    timeout_s: float = 300.0
    warmup: int = 2


async def execute(
    url: str,
    plan: LoadPlan,
    label: Callable[[str], str] = str,
    front_metrics: tuple[str, int] | None = None,
    traces: Path | None = None,
) -> list[RunResult]:
    """Every workload x model x level of ``plan`` against the front at ``url``.

    Models alternate within each load point so drift on a noisy box hits them alike.
    ``label`` names the target in results (A/B runs prefix the deployment). With the
    front's metrics address, ``epd`` runs also get their mean time per request phase; with
    the deployment's trace folder, the duration of each hop (``hop_stats``).
    """
    sampling = {"max_tokens": plan.max_tokens, "temperature": 0}
    results: list[RunResult] = []
    async with InferenceServerClient(url) as client:
        for model in plan.models:
            for request in WORKLOADS["mixed"](plan.warmup, 10**6):
                await stream_request(client, model, request, sampling, plan.timeout_s)
        for workload, load, level, requests in plan_requests(plan):
            for model in plan.models:
                send = grpc_sender(client, model, sampling, plan.timeout_s)
                phases = front_metrics if model == "epd" else None
                before = phase_totals(phases) if phases else None
                started_ns = time.time_ns()
                samples, wall = await measure(
                    send, requests, load, level, f"{workload} {model} {load}={level:g}"
                )
                result = reduce(
                    samples, wall, target=label(model), workload=workload, load=load, level=level
                )
                if phases:
                    await asyncio.sleep(1.1)  # the front publishes every 0.5 s
                    result.phase_means_s = phase_means(before, phase_totals(phases))
                if traces is not None and model == "epd":
                    await asyncio.sleep(0.5)  # the front's span ends after its last answer
                    result.hops_s = hop_stats(read_spans(traces), started_ns, time.time_ns())
                    print(format_hops(result.hops_s), flush=True)
                results.append(result)
                print(summary_line(result), flush=True)
    return results


def hop_stats(spans: list[dict], start_ns: int, end_ns: int) -> dict[str, LatencyStats]:
    """Durations per span name over the ``epd`` requests that began in [start, end]: every
    span of their traces, in whichever server it ran; and the ways between the spans
    (``transport_gaps``)."""
    measured = {
        s["trace_id"]
        for s in spans
        if s["name"] == "epd" and s["parent_id"] is None and start_ns <= s["start_ns"] <= end_ns
    }
    mine = [s for s in spans if s["trace_id"] in measured]
    by_name: dict[str, list[float]] = {}
    for s in mine:
        by_name.setdefault(s["name"], []).append((s["end_ns"] - s["start_ns"]) / 1e9)
    for name, seconds in transport_gaps(mine):
        by_name.setdefault(name, []).append(seconds)
    return {name: LatencyStats.of(values) for name, values in sorted(by_name.items())}


def transport_gaps(spans: list[dict]) -> Iterator[tuple[str, float]]:
    """What a stage call costs outside the stage, from the spans of the same traces: ``X
    in`` from the caller's ``call X`` to the stage's ``X`` span (the caller's serialising,
    gRPC, Triton, the python backend's stub and loop), ``X out`` from the stage's end to
    the caller's (its last response's way back), and ``first_token out`` from an engine's
    first output to the front's ``stream`` (the first token's way to the front)."""
    by_id = {s["span_id"]: s for s in spans if "span_id" in s}
    streams = {s["trace_id"]: s for s in spans if s["name"] == "stream"}
    for s in spans:
        call = by_id.get(s["parent_id"])
        if call is not None and call["name"] == f"call {s['name']}":
            yield f"{s['name']} in", (s["start_ns"] - call["start_ns"]) / 1e9
            yield f"{s['name']} out", (call["end_ns"] - s["end_ns"]) / 1e9
        stream = streams.get(s["trace_id"])
        if s["name"] == "first_token" and stream is not None:
            yield "first_token out", (stream["start_ns"] - s["end_ns"]) / 1e9


def format_hops(hops: dict[str, LatencyStats]) -> str:
    """The per-hop table: p50 / p90 / count, in the order a request crosses them."""
    order = {name: hops[name].p50 or 0.0 for name in hops}
    lines = [f"  {'hop':<16} {'p50 ms':>8} {'p90 ms':>8} {'count':>6}"]
    for name in sorted(hops, key=lambda n: -order[n]):
        h = hops[name]
        lines.append(f"  {name:<16} {h.p50 * 1e3:>8.1f} {h.p90 * 1e3:>8.1f} {h.count:>6}")
    return "\n".join(lines)


def summary_line(r: RunResult) -> str:
    def ms(v: float | None) -> str:
        return "-" if v is None else f"{v * 1e3:.0f}"

    rps = "-" if r.requests_per_s is None else f"{r.requests_per_s:.2f}"
    return (
        f"{r.workload:<9} {r.target:<22} {r.load}={r.level:g}: TTFT p50/p90 "
        f"{ms(r.ttft_s.p50)}/{ms(r.ttft_s.p90)} ms, latency p50 {ms(r.latency_s.p50)} ms, "
        f"{rps} req/s, {r.errors} errors"
    )


def report(command: str, runs: list[RunResult], notes: Sequence[str] = ()) -> BenchReport:
    from epd_bench.schema import package_version

    return BenchReport(
        command=command,
        timestamp=datetime.now(UTC).isoformat(timespec="seconds"),
        machine=machine_info(),
        versions={
            "vllm": package_version("vllm"),
            "tritonclient": package_version("tritonclient"),
            "nixl": package_version("nixl"),
        },
        runs=runs,
        notes=list(notes),
    )
