"""``epd bench soak``: many mixed requests against one deployment; does anything grow?

The mix is what a real front sees: photos (a pool of distinct crops, so the encoder cache
both hits and evicts), text-only requests, bad images that must fail with ``INVALID_ARG``,
and clients that cancel mid-stream. After a warm-up, the resident memory of every server
(its Triton process and everything it started: python stubs, vLLM engine cores) is sampled
as the run goes; the report gives each server's growth from the warm-up to the end, and
every answer that was not what its kind should get counts as an error.
"""

from __future__ import annotations

import json
import queue
import tempfile
import time
from collections import Counter
from concurrent.futures import ThreadPoolExecutor
from dataclasses import asdict, dataclass, field
from pathlib import Path

import numpy as np

from orchestrator.client import request_inputs, sample_photo
from orchestrator.config import Topology

KINDS = ("photo", "text", "bad_image", "cancel")
WEIGHTS = (0.4, 0.4, 0.1, 0.1)


@dataclass
class SoakReport:
    requests: int
    warmup: int
    concurrency: int
    wall_s: float
    requests_per_s: float
    answers: dict[str, int]
    """Per kind and outcome (``photo ok``, ``bad_image refused``, ``cancel cancelled``...)."""
    errors: list[str]
    """Answers a request of that kind should not get (first 20)."""
    rss_mib: dict[str, list[float]]
    """Per server: resident MiB of its process tree at each sample (after the warm-up)."""
    growth_pct: dict[str, float]
    samples_at: list[int] = field(default_factory=list)
    """Requests answered when each RSS sample was taken."""


def tree_rss_mib(pid: int) -> float:
    import psutil

    root = psutil.Process(pid)
    total = 0
    for proc in [root, *root.children(recursive=True)]:
        try:
            total += proc.memory_info().rss
        except psutil.Error:
            pass  # gone meanwhile
    return total / (1 << 20)


def _one(url: str, kind: str, serial: int, photos: list[bytes]) -> str:
    """Send one request of ``kind``; the outcome word (``ok``, ``refused``, ``cancelled``)
    or an ``error: ...`` line."""
    import tritonclient.grpc as grpcclient
    from tritonclient.utils import InferenceServerException

    image = photos[serial % len(photos)]
    text, images, sampling = f"Describe picture {serial}.", [image], {"max_tokens": 8}
    if kind == "text":
        text, images = f"Tell me about the number {serial}.", []
    elif kind == "bad_image":
        images = [image[: len(image) // 3]]
    elif kind == "cancel":
        sampling = {"max_tokens": 64, "ignore_eos": True}
    results: queue.Queue = queue.Queue()
    with grpcclient.InferenceServerClient(url) as client:
        client.start_stream(callback=lambda result, error: results.put((result, error)))
        try:
            client.async_stream_infer(
                "epd",
                request_inputs(text, images, sampling, True),
                enable_empty_final_response=True,
            )
            if kind == "cancel":
                time.sleep(0.05 + 0.05 * (serial % 5))
                client.stop_stream(cancel_requests=True)
                return "cancelled"
            while True:
                result, error = results.get(timeout=300)
                if error is not None:
                    message = error.message()
                    if kind == "bad_image" and message.startswith("INVALID_ARG: image 1 of 1"):
                        return "refused"
                    return f"error: {kind}: {message[:200]}"
                if result.get_response().parameters["triton_final_response"].bool_param:
                    return "ok" if kind in ("photo", "text") else f"error: {kind} was served"
        except InferenceServerException as exc:
            return f"error: {kind}: {exc.message()[:200]}"
        finally:
            client.stop_stream()


def run(
    topology: Topology,
    requests: int,
    warmup: int,
    concurrency: int,
    samples: int = 10,
    timeout_s: float = 600,
    progress=print,
) -> SoakReport:
    from epd_bench.photos import photo_variant
    from orchestrator.triton.deployment import Deployment, on_free_ports

    topology = on_free_ports(topology)
    rng = np.random.default_rng(0)
    kinds = rng.choice(KINDS, size=warmup + requests, p=WEIGHTS)
    photos = [photo_variant("astronaut", i) for i in range(24)] + [sample_photo("coffee")]
    with tempfile.TemporaryDirectory(prefix="epd-soak-") as workdir:
        deployment = Deployment(topology, Path(workdir))
        with deployment.running(timeout_s):
            url = topology.servers[topology.server_of("epd")[0]].grpc_url
            pids = {name: server.pid for name, server in deployment.servers.items()}
            answers: Counter = Counter()
            errors: list[str] = []
            rss: dict[str, list[float]] = {name: [] for name in pids}
            sampled_at: list[int] = []
            step = max(1, requests // samples)
            batches = [range(0, warmup)] + [
                range(b, min(b + step, warmup + requests))
                for b in range(warmup, warmup + requests, step)
            ]
            start = time.perf_counter()
            with ThreadPoolExecutor(concurrency) as pool:
                for batch in batches:
                    if batch.start == warmup:
                        start = time.perf_counter()
                    if batch.start >= warmup:
                        for name, pid in pids.items():
                            rss[name].append(round(tree_rss_mib(pid), 1))
                        sampled_at.append(batch.start - warmup)
                    outcomes = pool.map(lambda i: (kinds[i], _one(url, kinds[i], i, photos)), batch)
                    for kind, outcome in outcomes:
                        if outcome.startswith("error"):
                            errors.append(outcome)
                            answers[f"{kind} error"] += 1
                        elif batch.start >= warmup:
                            answers[f"{kind} {outcome}"] += 1
                    progress(f"  {batch.stop} requests answered")
            wall = time.perf_counter() - start
            time.sleep(2)  # let cancelled work drain before the last sample
            for name, pid in pids.items():
                rss[name].append(round(tree_rss_mib(pid), 1))
            sampled_at.append(requests)
    growth = {name: round(100 * (v[-1] - v[0]) / v[0], 2) for name, v in rss.items()}
    return SoakReport(
        requests=requests,
        warmup=warmup,
        concurrency=concurrency,
        wall_s=round(wall, 1),
        requests_per_s=round(requests / wall, 2) if wall else 0.0,
        answers=dict(sorted(answers.items())),
        errors=errors[:20],
        rss_mib=rss,
        growth_pct=growth,
        samples_at=sampled_at,
    )


def format_report(report: SoakReport) -> str:
    lines = [
        f"{report.requests} requests after {report.warmup} warm-up, concurrency "
        f"{report.concurrency}: {report.wall_s:.0f} s, {report.requests_per_s} req/s, "
        f"{sum(1 for k in report.answers if k.endswith('error'))} error kinds, "
        f"{len(report.errors)} errors shown",
        "answers: " + ", ".join(f"{k} {v}" for k, v in report.answers.items()),
        f"{'server':<10} {'RSS after warm-up':>18} {'RSS at end':>11} {'growth':>8}",
    ]
    for name, values in report.rss_mib.items():
        lines.append(
            f"{name:<10} {values[0]:>15.0f} MiB {values[-1]:>7.0f} MiB "
            f"{report.growth_pct[name]:>7.2f}%"
        )
    return "\n".join(lines)


def write(report: SoakReport, path: Path, command: str) -> None:
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(json.dumps({"command": command, **asdict(report)}, indent=2) + "\n")
