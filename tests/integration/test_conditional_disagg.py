"""Conditional disaggregation on E/P/D (``routing.max_local_prefill_tokens``): a short
prompt (its images' tokens counted) is prefilled by decode's own engine, which pulls the
images' embeddings itself, past the prefill server; longer prompts still go to prefill.
Either way the answer, and the prompt's token count the client is billed, equal the
``aggregated`` engine's, and every handle the encoder lent is pulled."""

from __future__ import annotations

import base64
import time
from collections.abc import Callable, Iterator
from pathlib import Path

import openai
import pytest

from orchestrator import metrics
from orchestrator.client import sample_photo
from orchestrator.triton.deployment import Deployment
from tests.conftest import (
    EPD_LAYOUT,
    local_topology,
    running_deployment,
    scrape,
    wait_unpinned,
)

pytestmark = pytest.mark.server

MAX_LOCAL = 128
SHORT = "Tell me a story about a robot."
"""45 tokens once the tiny model's chat template wraps it."""
LONG = "Tell me a story about a robot. " * 12
"""266 tokens: past ``MAX_LOCAL``."""


@pytest.fixture(scope="module")
def stack(tiny_model: Path, tmp_path_factory: pytest.TempPathFactory) -> Iterator[Deployment]:
    topology = local_topology(
        tiny_model,
        EPD_LAYOUT,
        openai_on="front",
        routing={"max_local_prefill_tokens": MAX_LOCAL},
    )
    yield from running_deployment(topology, tmp_path_factory.mktemp("conditional"))


@pytest.fixture(scope="module")
def client(stack: Deployment) -> openai.OpenAI:
    return openai.OpenAI(base_url=f"{stack.openai['front'].url}/v1", api_key="-", max_retries=0)


def _taken_in(stack: Deployment, role: str) -> float:
    """Requests the engine of ``role`` has taken in (its stub publishes every 0.5 s)."""
    server = stack.topology.servers[role]
    return scrape(server, "epd_engine_requests_total", role=role)


def _pulled_by(stack: Deployment, server: str) -> float:
    """Embedding bytes ``server`` has pulled from encoders: read once its engine's count
    shows the request, which its stub publishes with them and which moves after the pull."""
    return scrape(stack.topology.servers[server], "epd_embedding_fetch_bytes_total")


def _settled(read: Callable[[], float], expected: float) -> float:
    """``read()`` once it shows ``expected``, or after 3 s of showing something else."""
    deadline = time.monotonic() + 3
    while (value := read()) != expected and time.monotonic() < deadline:
        time.sleep(0.1)
    return value


def _local_prefills(stack: Deployment) -> float:
    """Prompts the OpenAI front's pipeline sent to decode alone (its ``/metrics``)."""
    front = stack.topology.servers["front"]
    return metrics.scrape("127.0.0.1", front.openai_port, "epd_local_prefills_total")


def _chat(client: openai.OpenAI, model: str, text: str, images: list[bytes]):
    urls = ["data:image/jpeg;base64," + base64.b64encode(i).decode() for i in images]
    content = [
        *({"type": "image_url", "image_url": {"url": url}} for url in urls),
        {"type": "text", "text": text},
    ]
    return client.chat.completions.create(
        model=model,
        messages=[{"role": "user", "content": content}],
        max_tokens=16,
        temperature=0,
    )


def _answer_of(client: openai.OpenAI, model: str, text: str, images: list[bytes]):
    reply = _chat(client, model, text, images)
    return reply.choices[0].message.content, reply.usage.prompt_tokens


@pytest.mark.parametrize(
    ("text", "images", "local"),
    [
        pytest.param(SHORT, [], True, id="short text: decode prefills"),
        pytest.param(LONG, [], False, id="long text: prefill"),
        pytest.param("Cat?", [sample_photo("chelsea")], True, id="short with a photo: decode"),
        pytest.param(
            "Compare.",
            [sample_photo("astronaut"), sample_photo("coffee")],
            False,
            id="short text, long with its photos: prefill",  # 64 + 54 image tokens
        ),
        pytest.param(LONG, [sample_photo("chelsea")], False, id="long with a photo: prefill"),
    ],
)
def test_who_prefills_and_the_answer_is_aggregateds(stack, client, text, images, local):
    prefills, decodes = _taken_in(stack, "prefill"), _taken_in(stack, "decode")
    local_prefills = _local_prefills(stack)
    pulled = _pulled_by(stack, "decode")
    answer, prompt_tokens = _answer_of(client, "epd", text, images)
    assert (answer, prompt_tokens) == _answer_of(client, "aggregated", text, images)
    assert answer
    assert _settled(lambda: _taken_in(stack, "decode"), decodes + 1) == decodes + 1
    prefilled = 0 if local else 1  # after decode's count moved, and 3 s more if it is 0
    assert _settled(lambda: _taken_in(stack, "prefill"), prefills + 1) == prefills + prefilled
    assert _local_prefills(stack) == local_prefills + (1 if local else 0)
    assert (_pulled_by(stack, "decode") > pulled) == (local and bool(images))


def test_every_handle_was_pulled(stack):
    stats = wait_unpinned(stack.topology.servers["encoder"])
    assert stats["pinned_handles"] == 0 and stats["expired"] == 0, stats


def test_hang_up_stops_a_prompt_decode_prefilled(stack, client):
    """A client leaving mid-stream stops a request decode took alone as it stops any: its
    engine is idle at once and no handle stays pinned."""
    decode, encoder = stack.topology.servers["decode"], stack.topology.servers["encoder"]
    local_prefills = _local_prefills(stack)
    url = "data:image/jpeg;base64," + base64.b64encode(sample_photo("chelsea")).decode()
    content = [{"type": "image_url", "image_url": {"url": url}}, {"type": "text", "text": "Cat?"}]
    answer = client.chat.completions.create(
        model="epd",
        messages=[{"role": "user", "content": content}],
        max_tokens=1500,
        extra_body={"ignore_eos": True},
        stream=True,
    )
    next(iter(answer))  # the answer has begun
    assert _local_prefills(stack) == local_prefills + 1

    def busy() -> float:  # published every 0.5 s
        return scrape(decode, "epd_engine_unfinished_requests", role="decode")

    assert _settled(busy, 1) == 1
    answer.close()

    def idle() -> float:
        return busy() + scrape(encoder, "epd_encoder_cache_pinned_handles")

    assert _settled(idle, 0) == 0, "decode still busy, or a handle pinned, after hang-up"


def test_decode_serves_short_prompts_while_prefill_is_down(stack, client):
    """Short prompts need no prefill server: they are answered while it is dead; a long
    one fails at once, naming it."""
    expected = _answer_of(client, "aggregated", SHORT, [])
    stack.servers["prefill"].kill()
    assert _answer_of(client, "epd", SHORT, []) == expected
    start = time.monotonic()
    with pytest.raises(openai.APIStatusError) as failure:
        _chat(client, "epd", LONG, [])
    assert time.monotonic() - start < 10
    assert failure.value.status_code == 503 and "prefill" in str(failure.value), failure.value
