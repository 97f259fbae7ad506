"""``epd bench cache``: what the encoder cache buys on repeated images.

Each round sends ``images`` photos nobody has sent before (misses), then the same photos
again with another question (hits: the encoder answers from its cache, or the front routes
them to the encoder that holds them). It reports TTFT of hits against misses and the
encoder passes Triton counted against the image requests sent. On hits vLLM's prefix cache
also reuses the image's KV in prefill, as it would for a user repeating an image; the
ratio measures the whole repeated-image path, not the encoder alone.
"""

from __future__ import annotations

import asyncio
from dataclasses import dataclass
from datetime import UTC, datetime
from typing import Any

from tritonclient.grpc.aio import InferenceServerClient

from epd_bench.photos import photo_variant
from epd_bench.quick import (
    PERCENTILES,
    BenchError,
    BenchRequest,
    RequestResult,
    Settings,
    percentile,
    run_round,
)
from epd_bench.schema import machine_info, package_version
from orchestrator.config import Topology
from orchestrator.metrics import encoder_passes

PHOTOS = ("astronaut", "coffee", "chelsea", "rocket")
PHASES = ("miss", "hit")


@dataclass(frozen=True)
class CacheRound:
    miss: list[RequestResult]
    hit: list[RequestResult]
    passes: int
    """Encoder passes Triton counted during the round."""


def round_requests(index: int, images: int) -> dict[str, list[BenchRequest]]:
    """The round's first sightings and repeats: same photos, different questions."""
    photos = [
        photo_variant(PHOTOS[i % len(PHOTOS)], 10_000 + index * images + i) for i in range(images)
    ]
    return {
        "miss": [
            BenchRequest(f"Describe this image. ({index}.{i})", (p,)) for i, p in enumerate(photos)
        ],
        "hit": [
            BenchRequest(f"What else is in this picture? ({index}.{i})", (p,))
            for i, p in enumerate(photos)
        ],
    }


def summarize(rounds: list[CacheRound]) -> dict[str, Any]:
    """TTFT percentiles per phase, hit/miss ratios, and encoder passes vs image requests."""
    ttft: dict[str, dict[str, float | None]] = {}
    for phase in PHASES:
        values = [r.ttft_s for rnd in rounds for r in getattr(rnd, phase) if r.ttft_s is not None]
        ttft[phase] = {f"p{q}": percentile(values, q) for q in PERCENTILES}
    ratios = {
        key: (ttft["hit"][key] / ttft["miss"][key])
        if ttft["hit"][key] and ttft["miss"][key]
        else None
        for key in ("p50", "p90")
    }
    image_requests = sum(len(rnd.miss) + len(rnd.hit) for rnd in rounds)
    passes = sum(rnd.passes for rnd in rounds)
    errors = sorted({r.error for rnd in rounds for p in PHASES for r in getattr(rnd, p) if r.error})
    return {
        "ttft_s": ttft,
        "hit_over_miss": ratios,
        "image_requests": image_requests,
        "encoder_passes": passes,
        "passes_saved": image_requests - passes,
        "errors": errors[:10],
    }


def ratio_line(summary: dict[str, Any]) -> str:
    r, t = summary["hit_over_miss"], summary["ttft_s"]
    if r["p50"] is None:
        return "cache: no successful requests to compare"
    return (
        f"cache: TTFT p50 hit/miss {r['p50']:.2f}x "
        f"({t['hit']['p50'] * 1e3:.0f} vs {t['miss']['p50'] * 1e3:.0f} ms), "
        f"{summary['encoder_passes']} encoder passes for {summary['image_requests']} image "
        f"requests ({summary['passes_saved']} saved)"
    )


async def _bench(url: str, topology: Topology, settings: Settings, images: int) -> list[CacheRound]:
    rounds = []
    async with InferenceServerClient(url) as client:
        if not await client.is_model_ready("epd", client_timeout=10):
            raise BenchError(f"model 'epd' is not ready at {url}")
        warm = round_requests(-1, 1)  # one miss and one hit, unmeasured
        await run_round(client, "epd", warm["miss"] + warm["hit"], settings)
        for index in range(settings.rounds):
            requests = round_requests(index, images)
            before = encoder_passes(topology)
            miss, _ = await run_round(client, "epd", requests["miss"], settings)
            hit, _ = await run_round(client, "epd", requests["hit"], settings)
            rounds.append(CacheRound(miss, hit, encoder_passes(topology) - before))
            print(
                f"round {index + 1}/{settings.rounds}: {len(miss)} misses, {len(hit)} hits",
                flush=True,
            )
    return rounds


def run(url: str, topology: Topology, settings: Settings, images: int, args: dict) -> dict:
    """Run the rounds against the front at ``url`` (encoders from ``topology``); the report."""
    if images < 1:
        raise BenchError(f"images must be at least 1: {images}")
    rounds = asyncio.run(_bench(url, topology, settings, images))
    return {
        "timestamp": datetime.now(UTC).isoformat(timespec="seconds"),
        "machine": machine_info(),
        "versions": {
            "vllm": package_version("vllm"),
            "tritonclient": package_version("tritonclient"),
        },
        "args": args,
        "settings": settings,
        "transfer": topology.transfer.model_dump(),
        **summarize(rounds),
    }
