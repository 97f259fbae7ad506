"""Encoder cache, cache-aware routing and failover on a real five-server deployment:
two encoders, prefill, decode and a front, each its own Triton server.

Encoder passes are counted by Triton itself (``nv_inference_count`` of ``vision_encoder``),
so "encoded exactly once" does not rest on our own bookkeeping.
"""

from __future__ import annotations

import io
import json
import time
import urllib.error
import urllib.request
from collections.abc import Iterator
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import numpy as np
import pytest

from orchestrator.client import generate, generate_body, sample_photo
from orchestrator.config import Topology, TransferSpec
from orchestrator.triton.deployment import Deployment
from tests.conftest import (
    cache_metrics,
    encoder_passes,
    local_topology,
    running_deployment,
    scrape,
    wait_unpinned,
)
from tests.integration.internal import call_internal

pytestmark = pytest.mark.server

LAYOUT = {
    "enc1": ["encode"],
    "enc2": ["encode"],
    "prefill": ["prefill"],
    "decode": ["decode"],
    "front": ["epd", "aggregated"],
}
ENCODERS = ("enc1", "enc2")
POOL_BLOCKS = 3
"""Each encoder's cache holds three images: one tiny-model image is 64 tokens x 128 floats
(32 KiB), one 64 KiB block."""
TTL_S = 8.0


def photo(seed: int) -> bytes:
    """A distinct smooth synthetic photo per seed (JPEG)."""
    from PIL import Image

    rng = np.random.default_rng(seed)
    small = rng.integers(0, 256, (6, 8, 3), dtype=np.uint8)
    image = Image.fromarray(small).resize((224, 168), Image.Resampling.BICUBIC)
    buf = io.BytesIO()
    image.save(buf, format="JPEG", quality=90)
    return buf.getvalue()


@pytest.fixture(scope="module")
def stack(tiny_model: Path, tmp_path_factory: pytest.TempPathFactory) -> Iterator[Deployment]:
    topology = local_topology(
        tiny_model,
        LAYOUT,
        transfer=TransferSpec(
            pool_bytes=POOL_BLOCKS * (64 << 10),
            ttl_s=TTL_S,
            reclaim_grace_s=1,
            full_wait_s=1,
            prefill_cache_bytes=256 << 10,
        ),
        routing={"health_interval_s": 0.5},
        limits={"request_timeout_s": 30},
    )
    yield from running_deployment(topology, tmp_path_factory.mktemp("cache"))


def _front(stack: Deployment) -> str:
    return stack.topology.servers["front"].http_url


def _ask(stack: Deployment, images: list[bytes], text: str = "Describe this image.") -> str:
    return generate(_front(stack), "epd", text, images, max_tokens=4)


def _passes(topology: Topology) -> int:
    return sum(encoder_passes(topology.servers[name]) for name in ENCODERS)


def _cache(topology: Topology) -> dict[str, float]:
    time.sleep(1.1)  # both encoders publish every 0.5 s
    stats = [cache_metrics(topology.servers[name], settle_s=0) for name in ENCODERS]
    return {key: sum(s[key] for s in stats) for key in stats[0]}


def _server_up(topology: Topology, target: str) -> bool:
    """The front's view of a stage server (published every 0.5 s, hence the wait)."""
    time.sleep(1.1)
    return scrape(topology.servers["front"], "epd_stage_server_up", target=target) == 1


def test_repeated_images_are_encoded_once_across_two_encoders(stack):
    """12 requests for 3 images, 6 at a time, shuffled: Triton counts 3 encoder passes in
    all, both encoders took part, and every answer equals the aggregated engine's."""
    topo = stack.topology
    images = [sample_photo(name) for name in ("astronaut", "coffee", "chelsea")]
    expected = [
        generate(_front(stack), "aggregated", "Describe this image.", [img], max_tokens=4)
        for img in images
    ]
    order = [i for _ in range(4) for i in range(3)]
    np.random.default_rng(0).shuffle(order)
    before, hits_before = _passes(topo), _cache(topo)["hits"]
    with ThreadPoolExecutor(6) as pool:
        answers = list(pool.map(lambda i: _ask(stack, [images[i]]), order))
    assert answers == [expected[i] for i in order]
    assert _passes(topo) - before == 3
    assert _cache(topo)["hits"] - hits_before == 9
    assert all(encoder_passes(topo.servers[name]) > 0 for name in ENCODERS)


def test_hot_image_is_not_pulled_again_by_prefill(stack):
    """Prefill keeps what it pulled: a repeat is answered from its cache, the encoder's
    handle is released unread (its pin goes at once, not at TTL), the answer is the same."""
    topology = stack.topology
    prefill = topology.servers["prefill"]
    image = photo(7)
    first = _ask(stack, [image])
    time.sleep(1.1)
    pulled = scrape(prefill, "epd_embedding_fetch_bytes_total")
    hits = scrape(prefill, "epd_prefill_cache_hits_total")
    assert _ask(stack, [image]) == first
    time.sleep(1.1)
    assert scrape(prefill, "epd_embedding_fetch_bytes_total") == pulled
    assert scrape(prefill, "epd_prefill_cache_hits_total") == hits + 1
    for name in ENCODERS:
        stats = wait_unpinned(topology.servers[name], timeout_s=3)
        assert stats["pinned_handles"] == 0 and stats["expired"] == 0, (name, stats)


def test_eviction_under_the_byte_budget(stack):
    """Eight new images, one after the other, alternate between the two encoders (four each
    into three-image caches): each evicts its least recently used, a repeat of the first
    image is encoded again on its encoder, a repeat of the last is a hit."""
    topology = stack.topology
    new = [photo(100 + k) for k in range(8)]
    before = _cache(topology)
    for image in new:
        _ask(stack, [image])
    after = _cache(topology)
    assert after["entries"] == 2 * POOL_BLOCKS
    assert after["evictions"] - before["evictions"] >= 2
    assert after["misses"] - before["misses"] == 8
    passes = _passes(topology)
    _ask(stack, [new[-1]])
    assert _passes(topology) == passes  # still cached on its holder
    _ask(stack, [new[0]])
    assert _passes(topology) == passes + 1  # evicted: encoded again


def test_same_pixels_in_another_encoding_hit_the_cache(stack):
    """The cache key is the decoded pixels: a lossless PNG of an image an encoder holds is a
    hit there; the very same bytes again are a hit without even being decoded (these
    handles are never pulled; they expire after ttl + grace)."""
    from PIL import Image

    jpeg = photo(1)
    png = io.BytesIO()
    Image.open(io.BytesIO(jpeg)).save(png, format="PNG")
    enc1 = stack.topology.servers["enc1"]
    _encode_directly(stack.topology, "enc1", [jpeg])
    passes, hits = encoder_passes(enc1), cache_metrics(enc1)["hits"]
    decoded = scrape(enc1, "epd_encoder_images_decoded_total")
    [again] = _encode_directly(stack.topology, "enc1", [jpeg])["handles"]
    [handle] = _encode_directly(stack.topology, "enc1", [png.getvalue()])["handles"]
    assert encoder_passes(enc1) == passes
    assert cache_metrics(enc1)["hits"] == hits + 2
    assert scrape(enc1, "epd_encoder_images_decoded_total") == decoded + 1  # the PNG only
    assert handle["grid_thw"] == again["grid_thw"] == [1, 12, 16]


def _encode_directly(topology: Topology, server: str, images: list[bytes]) -> dict:
    """Call one encoder's ``encode`` model as the front does (signed): the handles it
    answers stay pinned, unpulled."""
    [response] = call_internal(
        topology.servers[server], "encode", {"image": np.array(images, dtype=np.object_)}
    )
    return json.loads(response["handles"].reshape(-1)[0])


def test_full_cache_fails_with_overloaded_then_recovers(stack):
    """Every slot of both encoders pinned by handles nobody pulls: a request for a new image
    waits its bounded time on each encoder, fails OVERLOADED saying the encoder cache is
    full, the servers stay up, and once the handles expire the same request succeeds."""
    topology = stack.topology
    for i, name in enumerate(ENCODERS):
        assert wait_unpinned(topology.servers[name], timeout_s=TTL_S + 5)["pinned_handles"] == 0
        _encode_directly(topology, name, [photo(200 + 10 * i + k) for k in range(POOL_BLOCKS)])
    body = generate_body("Describe this image.", [photo(300)], {"max_tokens": 4})
    request = urllib.request.Request(
        f"http://{_front(stack)}/v2/models/epd/generate",
        data=json.dumps(body).encode(),
        headers={"Content-Type": "application/json"},
    )
    start = time.monotonic()
    with pytest.raises(urllib.error.HTTPError) as failure:
        urllib.request.urlopen(request, timeout=60)
    elapsed = time.monotonic() - start
    message = json.loads(failure.value.read())["error"]
    # Triton 2.51's generate endpoint answers 400 for every model error; the code rides in
    # the message (decoupled models' stream errors carry no status either).
    assert message.startswith("OVERLOADED: encoder cache is full"), message
    assert "3 handles pinned and not yet pulled (waited 1s for room)" in message
    assert elapsed < 15, elapsed  # 1 s of waiting per encoder, not a hang
    for name in ENCODERS:
        assert stack.servers[name].is_ready()
    time.sleep(TTL_S + 1.5)  # the pinned handles expire (ttl + grace)
    assert _ask(stack, [photo(300)])
    stats = _cache(topology)
    assert stats["expired"] >= 2 * POOL_BLOCKS and stats["pinned_handles"] == 0


def test_cache_benchmark_runs_end_to_end(stack):
    """``epd bench cache`` against this deployment: every repeat was served without an
    encoder pass (counted by Triton), and both phases have TTFTs."""
    from epd_bench import cache, quick

    settings = quick.Settings(requests=2, concurrency=2, rounds=1, max_tokens=2, timeout_s=60)
    url = stack.topology.servers["front"].grpc_url
    report = cache.run(url, stack.topology, settings, images=2, args={})
    assert report["errors"] == []
    assert (report["image_requests"], report["encoder_passes"]) == (4, 2)
    assert report["hit_over_miss"]["p50"] is not None
    assert cache.ratio_line(report).startswith("cache: TTFT p50 hit/miss")


def _workload(n: int) -> list[tuple[str, list[bytes]]]:
    images = [photo(400 + k) for k in range(6)] + [sample_photo("astronaut")]
    items: list[tuple[str, list[bytes]]] = []
    for i in range(n):
        if i % 5 == 4:
            items.append(("Tell me a story about a robot.", []))
        else:
            items.append(("Describe this image.", [images[i % len(images)]]))
    return items


def test_killed_encoder_under_load_loses_no_request_and_is_readmitted(stack):
    """200 requests at concurrency 8; one encoder is SIGKILLed (the whole process group)
    after 40 have completed. Every request completes with the answer it gets on a healthy
    deployment; once restarted, the encoder is re-admitted and serves again."""
    topology = stack.topology
    work = _workload(200)
    expected = {}
    for text, images in work:
        key = (text, tuple(images))
        if key not in expected:
            expected[key] = generate(_front(stack), "epd", text, images, max_tokens=4)
    completed = [0]

    def run(item: tuple[str, list[bytes]]) -> str:
        answer = generate(_front(stack), "epd", item[0], item[1], max_tokens=4)
        completed[0] += 1
        return answer

    with ThreadPoolExecutor(8) as pool:
        futures = [pool.submit(run, item) for item in work]
        deadline = time.monotonic() + 120
        while completed[0] < 40 and time.monotonic() < deadline:
            time.sleep(0.01)
        stack.servers["enc1"].kill()
        answers = [f.result(timeout=300) for f in futures]
    assert answers == [expected[(t, tuple(i))] for t, i in work]
    assert not _server_up(topology, "enc1")

    stack.servers["enc1"].start()
    stack.servers["enc1"].wait_ready(300)
    deadline = time.monotonic() + 30
    while not _server_up(topology, "enc1"):
        assert time.monotonic() < deadline, "enc1 was not re-admitted"
        time.sleep(0.5)
    for seed in range(500, 504):  # new images spread over both encoders again
        _ask(stack, [photo(seed)])
    assert encoder_passes(topology.servers["enc1"]) > 0


def test_killed_decode_fails_fast_then_serves_again_once_back(stack):
    topology = stack.topology
    decode = stack.servers["decode"]
    decode.kill()
    for _ in range(3):
        start = time.monotonic()
        with pytest.raises(urllib.error.HTTPError) as failure:
            _ask(stack, [sample_photo("coffee")])
        message = json.loads(failure.value.read())["error"]
        assert time.monotonic() - start < 10, message
        assert "decode" in message, message
    assert not _server_up(topology, "decode")
    decode.start()
    decode.wait_ready(600)
    deadline = time.monotonic() + 30
    while True:
        try:
            assert _ask(stack, [sample_photo("coffee")])
            break
        except urllib.error.HTTPError:
            assert time.monotonic() < deadline, "decode was not re-admitted"
            time.sleep(0.5)


def test_one_name_for_several_encoders_spreads_calls_and_renews_its_channel(stack):
    """What a headless Kubernetes Service gives the front: one stage address that stands
    for several pods. Calls go round robin over all of them, and the channel is renewed
    every ``resolve_interval_s`` (the name resolved again, to find pods an autoscaler
    added) without failing a call; a replaced channel is closed once idle."""
    import asyncio

    from orchestrator.auth import DeploymentKey
    from orchestrator.context import RequestContext
    from orchestrator.protocol import PROBE_PARAMETER
    from orchestrator.stage_client import GrpcStageClient

    encoders = [stack.topology.servers[n] for n in ("enc1", "enc2")]
    url = "ipv4:" + ",".join(f"127.0.0.1:{e.grpc_port}" for e in encoders)
    probe = {"release": np.array([b"{}"], dtype=np.object_)}  # encode's probe input

    def answered() -> list[float]:
        return [scrape(e, "nv_inference_request_success", model="encode") for e in encoders]

    def probe_calls(resolve_interval_s: float) -> tuple[int, int]:
        """20 probe calls of one RPC each (``ready()`` makes two, and round robin over two
        servers could send each of its probes to the same one): the channels used, and
        those still open after."""

        async def run() -> tuple[int, int]:
            client = GrpcStageClient(url, DeploymentKey(stack.secret), resolve_interval_s)
            used: set = set()
            try:
                assert await client.ready("encode")
                for _ in range(20):
                    ctx = RequestContext.create(timeout_s=30, idle_timeout_s=30)
                    async for _ in client.call("encode", probe, [], ctx, {PROBE_PARAMETER: "1"}):
                        pass
                    used.add(client._client)  # kept: ids of closed ones may be reused
                    await asyncio.sleep(0.05)
                return len(used), len(client._calls)
            finally:
                await client.close()

        return asyncio.run(run())

    # One channel: calls alternate between the servers.
    before = answered()
    probe_calls(resolve_interval_s=3600)
    spread = [a - b for a, b in zip(answered(), before, strict=True)]
    assert sum(spread) >= 20 and min(spread) >= 5, spread
    # Renewed every 0.2 s (a fresh channel sends its first calls to whichever server it
    # reached first, so no spread is asked of these): no call fails, old channels close.
    used, still_open = probe_calls(resolve_interval_s=0.2)
    assert used >= 3 and still_open == 1, (used, still_open)
