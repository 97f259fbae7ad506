"""The OpenAI-compatible front on a real deployment, driven by the real ``openai`` client
(sync and async, streaming and not, chat and completions): the same greedy tokens as
Triton's generate endpoint and as plain ``vllm serve`` on the same checkpoint, OpenAI-shaped
errors with the right statuses, and a client that hangs up mid-stream stops the request in
every stage.
"""

from __future__ import annotations

import asyncio
import base64
import json
import time
import urllib.request
from collections.abc import Callable, Iterator
from pathlib import Path

import httpx
import openai
import pytest

from epd_bench import openai_peer
from orchestrator.client import sample_photo
from orchestrator.triton.deployment import Deployment
from tests.conftest import ANIMAL, EPD_LAYOUT, local_topology, running_deployment, scrape

pytestmark = [pytest.mark.server, pytest.mark.timeout(1200)]

PHOTO, COFFEE = sample_photo("astronaut"), sample_photo("coffee")
GREEDY = {"temperature": 0, "max_tokens": 12}


def image_part(data: bytes) -> dict:
    url = "data:image/jpeg;base64," + base64.b64encode(data).decode()
    return {"type": "image_url", "image_url": {"url": url}}


CASES = {
    "photo": [
        {"role": "user", "content": [image_part(PHOTO), {"type": "text", "text": "What is this?"}]}
    ],
    "two images interleaved": [
        {
            "role": "user",
            "content": [
                {"type": "text", "text": "Compare"},
                image_part(PHOTO),
                {"type": "text", "text": "with"},
                image_part(COFFEE),
                {"type": "text", "text": "in one line."},
            ],
        }
    ],
    "multi-turn with a system prompt": [
        {"role": "system", "content": "You answer in French."},
        {"role": "user", "content": [image_part(COFFEE), {"type": "text", "text": "Drink?"}]},
        {"role": "assistant", "content": "Un café."},
        {"role": "user", "content": "Hot or cold?"},
    ],
    "text only": [{"role": "user", "content": "Tell me a story about a cat."}],
}


@pytest.fixture(scope="module")
def stack(tiny_model: Path, tmp_path_factory: pytest.TempPathFactory) -> Iterator[Deployment]:
    workdir = tmp_path_factory.mktemp("openai")
    topology = local_topology(
        tiny_model,
        EPD_LAYOUT,
        openai_on="front",
        openai={"max_concurrent_requests": 4},
        tracing={"directory": workdir / "traces"},
    )
    yield from running_deployment(topology, workdir)


def base_url(stack: Deployment) -> str:
    return f"{stack.openai['front'].url}/v1"


@pytest.fixture(scope="module")
def client(stack: Deployment) -> openai.OpenAI:
    return openai.OpenAI(base_url=base_url(stack), api_key="unused", max_retries=0)


def streamed(client: openai.OpenAI, model: str, messages: list) -> tuple[str, str, object]:
    chunks = list(
        client.chat.completions.create(
            model=model,
            messages=messages,
            stream=True,
            stream_options={"include_usage": True},
            **GREEDY,
        )
    )
    assert chunks[0].choices[0].delta.role == "assistant"
    text = "".join(c.choices[0].delta.content or "" for c in chunks if c.choices)
    finish = [
        c.choices[0].finish_reason for c in chunks if c.choices and c.choices[0].finish_reason
    ]
    assert chunks[-1].choices == [] and chunks[-1].usage is not None
    return text, finish[-1], chunks[-1].usage


def triton_generate(stack: Deployment, messages: list) -> str:
    """The same chat through Triton's own generate endpoint (``messages`` input)."""
    images, turns = [], []
    for turn in messages:
        content = turn["content"]
        if isinstance(content, str):
            content = [{"type": "text", "text": content}]
        parts = []
        for part in content:
            if part["type"] == "image_url":
                images.append(part["image_url"]["url"].split(",", 1)[1])
                parts.append({"type": "image"})
            else:
                parts.append(part)
        turns.append({"role": turn["role"], "content": parts})
    body = {"messages": json.dumps(turns), "sampling_parameters": json.dumps(GREEDY)}
    if images:
        body["image"] = images
    front = stack.topology.servers["front"]
    request = urllib.request.Request(
        f"http://{front.http_url}/v2/models/epd/generate",
        data=json.dumps(body).encode(),
        headers={"Content-Type": "application/json"},
    )
    with urllib.request.urlopen(request, timeout=300) as response:
        return json.loads(response.read())["text_output"]


def test_models_and_health(stack, client):
    models = client.models.list().data
    assert [m.id for m in models] == [stack.topology.model.name, "epd", "aggregated"]
    assert all(m.root == str(stack.topology.model) and m.max_model_len > 0 for m in models)
    with urllib.request.urlopen(f"{stack.openai['front'].url}/health", timeout=10) as response:
        assert response.status == 200
    import vllm

    version = httpx.get(f"{stack.openai['front'].url}/version", timeout=10).json()
    assert version["version"] == vllm.__version__ and version["epd"], version


@pytest.mark.parametrize("case", list(CASES))
def test_answers_as_triton_generate_does(stack, client, case):
    messages = CASES[case]
    model = stack.topology.model.name
    whole = client.chat.completions.create(model=model, messages=messages, **GREEDY)
    text, finish, usage = streamed(client, model, messages)
    assert whole.id.startswith("chatcmpl-") and whole.model == model
    mine = client.chat.completions.create(
        model=model, messages=messages, extra_body={"request_id": f"mine-{case}"}, **GREEDY
    )
    assert mine.id == f"chatcmpl-mine-{case}"  # as vLLM names its answers
    assert whole.choices[0].message.content == text == triton_generate(stack, messages)
    assert whole.choices[0].finish_reason == finish == "length"
    assert whole.usage.completion_tokens == usage.completion_tokens == 12
    assert whole.usage.prompt_tokens == usage.prompt_tokens
    images = sum(
        isinstance(t["content"], list) and "image_url" in str(t["content"]) for t in messages
    )
    if images:  # image tokens count as prompt tokens
        assert usage.prompt_tokens > 64 * images, usage
    baseline = client.chat.completions.create(model="aggregated", messages=messages, **GREEDY)
    assert baseline.choices[0].message.content == text
    assert baseline.usage.prompt_tokens == whole.usage.prompt_tokens


def test_a_clients_trace_continues_through_every_server(stack, client):
    """A client's ``traceparent`` header: the front's span joins that trace, and every
    stage the request crossed adds its spans to it."""
    trace_id, client_span = "4bf92f3577b34da6a3ce929d0e0e4736", "00f067aa0ba902b7"
    header = {"traceparent": f"00-{trace_id}-{client_span}-01"}
    messages = [{"role": "user", "content": [image_part(PHOTO), {"type": "text", "text": "?"}]}]
    client.chat.completions.create(
        model="epd", messages=messages, max_tokens=2, extra_headers=header
    )
    from orchestrator.tracing import read_spans

    deadline = time.monotonic() + 10
    while True:  # spans are written as they end; the front's last
        spans = [
            s for s in read_spans(stack.topology.tracing.directory) if s["trace_id"] == trace_id
        ]
        names = {s["name"] for s in spans}
        if "chat.completions" in names or time.monotonic() > deadline:
            break
        time.sleep(0.2)
    [top] = [s for s in spans if s["name"] == "chat.completions"]
    assert top["parent_id"] == client_span and top["instance"] == "front/openai"
    # epd's pipeline runs in the OpenAI front: no hop through the epd Triton model
    [epd] = [s for s in spans if s["name"] == "epd"]
    assert epd["parent_id"] == top["span_id"] and epd["instance"] == "front/openai"
    assert "call epd" not in names
    instances = {s["instance"] for s in spans}
    assert {"front/openai", "encoder/encode", "prefill/prefill", "decode/decode"} <= instances
    assert {"call encode", "call prefill", "prefill", "call decode", "decode"} <= names


def test_async_client_streams_the_same(stack, client):
    messages = CASES["photo"]
    expected = client.chat.completions.create(model="epd", messages=messages, **GREEDY)

    async def run() -> list[str]:
        async with openai.AsyncOpenAI(base_url=base_url(stack), api_key="unused") as aclient:

            async def one() -> str:
                stream = await aclient.chat.completions.create(
                    model="epd", messages=messages, stream=True, **GREEDY
                )
                return "".join([c.choices[0].delta.content or "" async for c in stream])

            return [await one(), await one()]

    assert asyncio.run(run()) == [expected.choices[0].message.content] * 2


def _status(client: openai.OpenAI, **request) -> tuple[int, str]:
    request = {"model": "epd", "messages": CASES["text only"], **request}
    with pytest.raises(openai.APIStatusError) as failure:
        client.chat.completions.create(**request)
    body = failure.value.body
    assert isinstance(body, dict) and set(body) >= {"message", "type", "code"}, body
    return failure.value.status_code, body["message"]


NOT_A_TYPE = {"schema": {"type": "objectx"}}


def test_errors_have_the_right_status_and_say_what_is_wrong(stack, client):
    bad_image = {"type": "image_url", "image_url": {"url": "data:image/png;base64,aGVsbG8="}}
    remote = {"type": "image_url", "image_url": {"url": "http://example.com/cat.png"}}
    cases = [
        ({"model": "gpt-4o"}, 404, "The model `gpt-4o` does not exist"),
        ({"n": 2, "temperature": 0}, 400, "n must be 1 when using greedy sampling"),
        ({"logprobs": True, "top_logprobs": 21}, 400, "greater than max allowed: 20"),
        ({"temperature": -1}, 400, "temperature"),
        (
            {"tools": [{"type": "function", "function": {"name": "f", "parameters": {}}}]},
            400,
            "tool calling",
        ),
        ({"messages": [{"role": "user", "content": [bad_image]}]}, 400, "image 1 of 1"),
        ({"messages": [{"role": "user", "content": [remote]}]}, 400, "not fetched"),
        ({"messages": [{"role": "tool", "content": "x"}]}, 400, "role 'tool'"),
        ({"messages": [{"role": "user", "content": [image_part(PHOTO)] * 3}]}, 413, "3 images"),
        ({"max_tokens": 100_000}, 400, "exceeds the model's context"),
        ({"extra_body": {"cache_salt": "tenant-a"}}, 400, "cache_salt: not supported"),
        # a constraint vLLM cannot compile: refused by decode's engine, after prefill
        ({"extra_body": {"structured_outputs": {"regex": "[0-9"}}}, 400, "invalid regex"),
        (
            {
                "response_format": {
                    "type": "json_schema",
                    "json_schema": {"name": "x", **NOT_A_TYPE},
                }
            },
            400,
            "Invalid type: objectx",
        ),
        ({"extra_body": {"structured_outputs": {"regex": "a" * (1 << 20)}}}, 413, "sampling"),
    ]
    for request, status, message in cases:
        got = _status(client, **request)
        assert got[0] == status and message in got[1], (request, got)
    url = f"{base_url(stack)}/chat/completions"
    response = httpx.post(url, content=b"{not json", headers={"Content-Type": "application/json"})
    assert response.status_code == 400 and "not valid JSON" in response.text
    # the server is still up and answering
    assert client.chat.completions.create(model="epd", messages=CASES["photo"], **GREEDY)


def _completion_status(client: openai.OpenAI, **request) -> tuple[int, str]:
    with pytest.raises(openai.APIStatusError) as failure:
        client.completions.create(**{"model": "epd", "prompt": "Once", **request})
    body = failure.value.body
    assert isinstance(body, dict) and set(body) >= {"message", "type", "code"}, body
    return failure.value.status_code, body["message"]


def test_completions_errors_have_the_right_status_and_say_what_is_wrong(stack, client):
    cases = [
        ({"model": "gpt-4o"}, 404, "The model `gpt-4o` does not exist"),
        ({"n": 2, "temperature": 0}, 400, "n must be 1 when using greedy sampling"),
        ({"logprobs": 1, "echo": True}, 400, "the prompt's log-probabilities"),
        ({"logprobs": 30}, 400, "logprobs"),
        ({"suffix": "end"}, 400, "suffix"),
        ({"prompt": ""}, 400, "must be provided and non-empty"),
        ({"prompt": []}, 400, "prompt"),
        ({"prompt": [[1, 2], []]}, 400, "prompt[1] is empty"),
        ({"prompt": [1 << 30]}, 400, "out of the vocabulary"),
        ({"prompt": "Once", "max_tokens": 100_000}, 400, "exceeds the model's context"),
        ({"echo": True, "max_tokens": 0}, 400, "echo without generation"),
        ({"extra_body": {"cache_salt": "tenant-a"}}, 400, "cache_salt: not supported"),
    ]
    for request, status, message in cases:
        got = _completion_status(client, **request)
        assert got[0] == status and message in got[1], (request, got)
    # the server is still up and answering
    assert client.completions.create(model="epd", prompt="Once", **GREEDY).choices[0].text


def _engine_busy(stack: Deployment) -> float:
    servers = stack.topology.servers
    return sum(
        scrape(servers[server], "epd_engine_unfinished_requests", role=role)
        for server, role in (("prefill", "prefill"), ("decode", "decode"))
    ) + scrape(servers["encoder"], "epd_encoder_cache_pinned_handles")


def _wait(check, timeout_s: float) -> bool:
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        if check():
            return True
        time.sleep(0.1)
    return False


def _stopped(stack: Deployment) -> float:
    """``epd`` requests the OpenAI front stopped because the client went away."""
    from orchestrator.metrics import scrape as read

    front = stack.topology.servers["front"]
    name = "epd_requests_stopped_total"
    return read("127.0.0.1", front.openai_port, name, model="epd", reason="cancelled")


def _hang_up_stops_every_stage(
    stack: Deployment, hang_up: Callable[[], None], requests: int = 1
) -> None:
    """``hang_up()`` sends ``requests`` long requests and leaves: the front stops them
    (epd's pipeline runs there, so no Triton hop can lose the cancel) and every stage is
    idle within seconds."""
    before = _stopped(stack)
    hang_up()
    assert _wait(lambda: _stopped(stack) == before + requests, 3), "the front did not stop it"
    assert _wait(lambda: _engine_busy(stack) == 0, 5), "stages still busy after hang-up"


LONG = {
    "model": "epd",
    "messages": CASES["photo"],
    "max_tokens": 1500,
    "ignore_eos": True,
    "temperature": 0,
}
"""A request that runs for seconds if nobody stops it."""


def test_full_is_429_and_hang_up_mid_stream_stops_every_stage(stack, client):
    """Long answers, streamed: with one of the front's four places taken, a completions
    list of four prompts (each answer counts) is 429 and one of five never fits (413); once
    a chat with three answers takes the rest, any request is 429. Then the client hangs
    up: all four are stopped and every stage is idle at once."""

    def stream_then_leave() -> None:
        url = f"{base_url(stack)}/chat/completions"
        with (
            httpx.Client(timeout=60) as http,
            http.stream("POST", url, json={**LONG, "stream": True}) as one,
        ):
            lines = one.iter_lines()  # kept: dropping it would close the stream early
            first = next(lines)  # the role: decoding has begun
            assert first.startswith("data: ") and '"error"' not in first, first
            for prompts, status, message in (
                (4, 429, "each of the request's 4 answers counts"),
                (5, 413, "5 answers in one request (prompts x n); this server runs at most 4"),
            ):
                got = _completion_status(client, prompt=["Once"] * prompts)
                assert got == (status, got[1]) and message in got[1], got
            three = {**LONG, "stream": True, "n": 3, "temperature": 1.0}
            with http.stream("POST", url, json=three) as two:
                more = two.iter_lines()
                first = next(more)
                assert first.startswith("data: ") and '"error"' not in first, first
                status, message = _status(client)
                assert status == 429 and "limit of 4 requests in flight" in message

    _hang_up_stops_every_stage(stack, stream_then_leave, requests=4)


def test_hang_up_while_waiting_for_a_whole_answer_stops_every_stage(stack):
    """Not streaming, the client gives up (its read timeout) before the answer is whole:
    the request stops in every stage, as when a stream is closed."""

    def wait_then_leave() -> None:
        with pytest.raises(httpx.ReadTimeout), httpx.Client(timeout=0.5) as http:
            http.post(f"{base_url(stack)}/chat/completions", json=LONG)

    _hang_up_stops_every_stage(stack, wait_then_leave)


@pytest.fixture(scope="module")
def vllm_serve(stack: Deployment, tmp_path_factory) -> Iterator[str]:
    """Plain ``vllm serve`` on the same checkpoint with the engine settings our stack uses."""
    log = tmp_path_factory.mktemp("vllm") / "serve.log"
    with openai_peer.vllm_serve(stack.topology, log, "tiny") as (url, _):
        yield f"{url}/v1"


@pytest.mark.parametrize("case", list(CASES))
def test_answers_as_vllm_serve_does(vllm_serve, client, case):
    peer = openai.OpenAI(base_url=vllm_serve, api_key="unused", max_retries=0)
    theirs = peer.chat.completions.create(model="tiny", messages=CASES[case], **GREEDY)
    ours = client.chat.completions.create(model="epd", messages=CASES[case], **GREEDY)
    assert ours.choices[0].message.content == theirs.choices[0].message.content
    assert ours.usage.prompt_tokens == theirs.usage.prompt_tokens
    assert ours.usage.completion_tokens == theirs.usage.completion_tokens
    assert ours.choices[0].finish_reason == theirs.choices[0].finish_reason


COMPLETIONS = {
    "text": {"prompt": "Once upon a time"},
    "token ids": {"prompt": [100, 200, 300, 400]},
    "a batch of texts, echoed": {"prompt": ["The cat", "A dog sat on"], "echo": True},
    "a batch of token ids, echoed": {"prompt": [[100, 200, 300], [401, 402]], "echo": True},
    "a stop string, no special tokens": {
        "prompt": "Once upon a time",
        "stop": ["e"],
        "add_special_tokens": False,
    },
}
"""Completions requests (prompts as they are, no chat template), ours and ``vllm serve``'s."""


def _completion(client: openai.OpenAI, model: str, case: str, stream: bool) -> dict:
    """Each choice's text and finish reason by index, and the usage."""
    request = {**COMPLETIONS[case], **GREEDY}
    extra = {"add_special_tokens": request.pop("add_special_tokens", True)}
    if stream:
        request["stream_options"] = {"include_usage": True}
    answer = client.completions.create(model=model, extra_body=extra, stream=stream, **request)
    chunks = list(answer) if stream else [answer]
    texts: dict[int, str] = {}
    finish: dict[int, str] = {}
    for chunk in chunks:
        assert chunk.object == "text_completion" and chunk.id.startswith("cmpl-"), chunk
        for choice in chunk.choices:
            texts[choice.index] = texts.get(choice.index, "") + choice.text
            finish[choice.index] = choice.finish_reason or finish.get(choice.index)
    usage = chunks[-1].usage
    return {
        "texts": texts,
        "finish": finish,
        "usage": (usage.prompt_tokens, usage.completion_tokens),
    }


@pytest.mark.parametrize("case", list(COMPLETIONS))
def test_completions_answer_as_vllm_serve_does(vllm_serve, stack, client, case):
    """Prompts as they are (text or token ids, one or a batch, echoed or not), whole and
    streamed, through ``epd`` (E/P/D here) and ``aggregated``: the same greedy answers,
    choice for choice, and the same token counts as ``vllm serve``'s."""
    peer = openai.OpenAI(base_url=vllm_serve, api_key="unused", max_retries=0)
    theirs = _completion(peer, "tiny", case, stream=False)
    prompt = COMPLETIONS[case]["prompt"]
    prompts = [prompt] if isinstance(prompt, str) or isinstance(prompt[0], int) else prompt
    assert len(theirs["texts"]) == len(prompts) and theirs["usage"][1] > 0, theirs
    if COMPLETIONS[case].get("echo") and isinstance(prompts[0], str):
        assert all(theirs["texts"][i].startswith(p) for i, p in enumerate(prompts)), theirs
    for model in ("epd", "aggregated"):
        for stream in (False, True):
            assert _completion(client, model, case, stream) == theirs, (model, stream)


GUIDED = {
    "json schema, photo": {
        "messages": CASES["photo"],
        "response_format": {"type": "json_schema", "json_schema": {"name": "a", "schema": ANIMAL}},
    },
    "json object, two images": {
        "messages": CASES["two images interleaved"],
        "response_format": {"type": "json_object"},
    },
    "choice, text": {
        "messages": CASES["text only"],
        "extra_body": {"structured_outputs": {"choice": ["yes", "no", "maybe"]}},
    },
    "regex, completions": {
        "prompt": "Once upon a time",
        "extra_body": {"structured_outputs": {"regex": "[A-Z][a-z]{2,6}( [a-z]{2,6}){2,4}\\."}},
    },
}
"""Guided decoding as ``vllm serve`` takes it: OpenAI's ``response_format`` and vLLM's
``structured_outputs``, chat (photos, text) and completions."""


def _guided(client: openai.OpenAI, model: str, case: str, stream: bool) -> tuple[str, str]:
    """The answer's text and finish reason."""
    request = {"model": model, "temperature": 0, "max_tokens": 48, "stream": stream}
    request.update(GUIDED[case])
    chat = "messages" in request
    api = client.chat.completions if chat else client.completions
    answer = api.create(**request)
    text, finish = "", ""
    for chunk in answer if stream else [answer]:
        for choice in chunk.choices:
            if chat:
                text += (choice.delta.content if stream else choice.message.content) or ""
            else:
                text += choice.text
            finish = choice.finish_reason or finish
    return text, finish


@pytest.mark.parametrize("case", list(GUIDED))
def test_guided_answers_are_vllm_serves(vllm_serve, stack, client, case):
    """Each constraint steers the answer as in ``vllm serve``: the same greedy text,
    through ``epd`` (E/P/D: decode's engine follows it from the first token) and
    ``aggregated``, whole and streamed."""
    peer = openai.OpenAI(base_url=vllm_serve, api_key="unused", max_retries=0)
    theirs = _guided(peer, "tiny", case, stream=False)
    if case == "json schema, photo":  # vLLM's JSON lets whitespace run past max_tokens
        assert theirs[0].startswith("{") and '"animal"' in theirs[0], theirs
    if case == "choice, text":
        assert theirs[0] in ("yes", "no", "maybe"), theirs
    for model in ("epd", "aggregated"):
        for stream in (False, True):
            assert _guided(client, model, case, stream) == theirs, (model, stream)


def test_a_started_answer_is_continued_as_vllm_serve_continues_it(vllm_serve, stack, client):
    """``continue_final_message`` (``add_generation_prompt`` false) continues the assistant's
    last turn instead of answering it; ``chat_template_kwargs`` the template does not read
    are dropped, as vLLM drops them. The same text and prompt tokens as ``vllm serve``,
    through ``epd`` and ``aggregated``, and ``/tokenize`` counts that prompt as both do."""
    peer = openai.OpenAI(base_url=vllm_serve, api_key="unused", max_retries=0)
    messages = [*CASES["photo"], {"role": "assistant", "content": "It is a"}]
    extra = {
        "add_generation_prompt": False,
        "continue_final_message": True,
        "chat_template_kwargs": {"enable_thinking": False},
    }
    theirs = peer.chat.completions.create(
        model="tiny", messages=messages, extra_body=extra, **GREEDY
    )
    answered = peer.chat.completions.create(model="tiny", messages=messages, **GREEDY)
    assert theirs.usage.prompt_tokens < answered.usage.prompt_tokens  # no new turn opened
    for model in ("epd", "aggregated"):
        ours = client.chat.completions.create(
            model=model, messages=messages, extra_body=extra, **GREEDY
        )
        assert ours.choices[0].message.content == theirs.choices[0].message.content, model
        assert ours.usage.prompt_tokens == theirs.usage.prompt_tokens, model
    body = {"model": "tiny", "messages": messages, **extra}
    for url in (vllm_serve.removesuffix("/v1"), base_url(stack).removesuffix("/v1")):
        status, counted = _post(f"{url}/tokenize", body)
        assert status == 200 and counted["count"] == theirs.usage.prompt_tokens, (url, counted)


@pytest.mark.parametrize("endpoint", ["chat", "completions"])
def test_usage_in_every_chunk_as_vllm_serve_sends_it(vllm_serve, stack, client, endpoint):
    """``stream_options.continuous_usage_stats``: every chunk carries its choice's usage so
    far (chat's role chunk: nothing generated yet), counting up to the totals of the last
    chunk, which equal ``vllm serve``'s, through ``epd`` and ``aggregated``."""
    options = {"include_usage": True, "continuous_usage_stats": True}

    def chunks(c: openai.OpenAI, model: str) -> list:
        if endpoint == "chat":
            api, request = c.chat.completions, {"messages": CASES["photo"]}
        else:
            api, request = c.completions, {"prompt": "Once upon a time"}
        return list(
            api.create(model=model, stream=True, stream_options=options, **request, **GREEDY)
        )

    peer = openai.OpenAI(base_url=vllm_serve, api_key="unused", max_retries=0)
    for model, answer in [("tiny", chunks(peer, "tiny"))] + [
        (model, chunks(client, model)) for model in ("epd", "aggregated")
    ]:
        assert all(c.usage is not None for c in answer), model
        total = answer[-1].usage
        assert not answer[-1].choices and total.completion_tokens == GREEDY["max_tokens"], model
        assert {c.usage.prompt_tokens for c in answer} == {total.prompt_tokens}, model
        done = [c.usage.completion_tokens for c in answer]
        assert done == sorted(done) and done[-2] == total.completion_tokens, (model, done)
        if endpoint == "chat":
            assert answer[0].choices[0].delta.role == "assistant" and done[0] == 0, model
        if model == "tiny":
            theirs = total
        else:
            assert total == theirs, model


@pytest.mark.parametrize("endpoint", ["chat", "completions"])
def test_a_token_with_no_text_yet_is_a_chunk_as_vllm_serve_sends_it(
    vllm_serve, stack, client, endpoint
):
    """A token whose text is not out yet (a character's first byte) goes out at once as a
    chunk with empty text, as ``vllm serve`` streams it, through ``epd`` and
    ``aggregated``. Until 2026-12-07 it waited for the next token's chunk: one decode step
    more of time to first token where an answer starts with one. The tiny model's greedy
    chat answer to this prompt does, its completion has two such tokens after the first
    (checked on ``vllm serve``'s own stream)."""
    options = {"include_usage": True, "continuous_usage_stats": True}

    def steps(c: openai.OpenAI, model: str) -> list[tuple[str, int]]:
        """Each chunk's text and the answer's tokens so far (chat's role chunk left out)."""
        if endpoint == "chat":
            messages = [{"role": "user", "content": "Once upon a time"}]
            answer = c.chat.completions.create(
                model=model, messages=messages, stream=True, stream_options=options, **GREEDY
            )
            chunks = [ch for ch in answer if ch.choices and ch.choices[0].delta.role is None]
            return [(ch.choices[0].delta.content, ch.usage.completion_tokens) for ch in chunks]
        answer = c.completions.create(
            model=model, prompt="Once upon a time", stream=True, stream_options=options, **GREEDY
        )
        return [(ch.choices[0].text, ch.usage.completion_tokens) for ch in answer if ch.choices]

    peer = openai.OpenAI(base_url=vllm_serve, api_key="unused", max_retries=0)
    theirs = steps(peer, "tiny")
    first_empty = next((i for i, (text, _) in enumerate(theirs) if not text), None)
    assert first_empty is not None, f"the answer no longer has such a token: {theirs}"
    one_each = list(range(1, len(theirs) + 1))  # tokens so far, chunk by chunk
    assert [n for _, n in theirs[: first_empty + 1]] == one_each[: first_empty + 1], theirs
    if endpoint == "chat":
        assert first_empty == 0, theirs  # the answer starts with one: time to first token
    for model in ("epd", "aggregated"):
        ours = steps(client, model)
        assert ours[: first_empty + 1] == theirs[: first_empty + 1], (model, ours)
        assert "".join(t for t, _ in ours) == "".join(t for t, _ in theirs), model
        if [n for _, n in theirs] == one_each and [n for _, n in ours] == one_each:
            assert ours == theirs, model  # neither server merged two steps into one chunk


TOKEN_IDS = {
    "chat, photo": {"messages": CASES["photo"]},
    "chat, two images": {"messages": CASES["two images interleaved"]},
    "completions, two prompts": {"prompt": ["Once upon a time", "The cat"]},
}
"""``return_token_ids`` (vLLM's extension) on both endpoints, with and without images."""


def _token_ids(client: openai.OpenAI, model: str, case: str, stream: bool) -> dict:
    """Each choice's prompt token ids (as the engine took the prompt) and answer token ids,
    and the text, from a whole answer or its chunks."""
    request = {"model": model, "stream": stream, **GREEDY, **TOKEN_IDS[case]}
    chat = "messages" in request
    api = client.chat.completions if chat else client.completions
    answer = api.create(**request, extra_body={"return_token_ids": True})
    prompts: dict[int, list[int]] = {}
    tokens: dict[int, list[int]] = {}
    texts: dict[int, str] = {}
    for chunk in answer if stream else [answer]:
        for choice in chunk.choices:
            i = choice.index
            owner = chunk if chat else choice
            if getattr(owner, "prompt_token_ids", None) is not None:
                assert i not in prompts or not stream, "prompt ids are sent once per choice"
                prompts[i] = owner.prompt_token_ids
            tokens[i] = tokens.get(i, []) + (getattr(choice, "token_ids", None) or [])
            if chat:
                text = (choice.delta.content if stream else choice.message.content) or ""
            else:
                text = choice.text
            texts[i] = texts.get(i, "") + text
    return {"prompts": prompts, "tokens": tokens, "texts": texts}


@pytest.mark.parametrize("case", list(TOKEN_IDS))
def test_token_ids_are_vllm_serves(vllm_serve, stack, client, case):
    """The prompt as the engine took it (each image's tokens in place) and the answer's
    token ids, choice by choice, as ``vllm serve`` returns them, through ``epd`` (E/P/D)
    and ``aggregated``, whole and streamed (the prompt in each choice's first chunk)."""
    peer = openai.OpenAI(base_url=vllm_serve, api_key="unused", max_retries=0)
    theirs = _token_ids(peer, "tiny", case, stream=False)
    assert all(len(t) == GREEDY["max_tokens"] for t in theirs["tokens"].values()), theirs
    assert theirs["prompts"] and all(theirs["prompts"].values()), theirs
    for model in ("epd", "aggregated"):
        for stream in (False, True):
            assert _token_ids(client, model, case, stream) == theirs, (model, stream)


LOGPROBS = {
    "chat, photo, top 3": {"messages": CASES["photo"], "logprobs": True, "top_logprobs": 3},
    "chat, two images, the tokens alone": {
        "messages": CASES["two images interleaved"],
        "logprobs": True,
    },
    "completions, 2": {"prompt": "Once upon a time", "logprobs": 2},
}
"""Log-probabilities as ``vllm serve`` answers them, chat (``top_logprobs`` candidates per
token) and completions (``logprobs`` + 1 per token, text offsets)."""


def _logprobs(client: openai.OpenAI, model: str, case: str, stream: bool) -> list[tuple]:
    """Per token: (token, log-probability, the candidates' tokens, their log-probabilities,
    text offset) from a whole answer or its chunks."""
    request = {"model": model, "stream": stream, **GREEDY, **LOGPROBS[case]}
    chat = "messages" in request
    answer = (client.chat.completions if chat else client.completions).create(**request)
    steps = []
    for chunk in answer if stream else [answer]:
        for choice in chunk.choices:
            if choice.logprobs is None:
                continue
            if chat:
                for c in choice.logprobs.content or []:
                    top = c.top_logprobs
                    steps.append(
                        (c.token, c.logprob, [t.token for t in top], [t.logprob for t in top], None)
                    )
            else:
                lp = choice.logprobs
                for i, token in enumerate(lp.tokens):
                    top = lp.top_logprobs[i]
                    steps.append(
                        (
                            token,
                            lp.token_logprobs[i],
                            list(top),
                            list(top.values()),
                            lp.text_offset[i],
                        )
                    )
    return steps


def _same_logprobs(ours: list[tuple], theirs: list[tuple]) -> None:
    assert [(s[0], s[2], s[4]) for s in ours] == [(s[0], s[2], s[4]) for s in theirs]
    for mine, peer in zip(ours, theirs, strict=True):
        assert mine[1] == pytest.approx(peer[1], abs=1e-3)
        assert mine[3] == pytest.approx(peer[3], abs=1e-3)


@pytest.mark.parametrize("case", list(LOGPROBS))
def test_logprobs_are_vllm_serves(vllm_serve, stack, client, case):
    """The same tokens, candidates and offsets as ``vllm serve``, log-probabilities equal
    to 1e-3, through ``epd`` (E/P/D: decode's engine computes them from the first token)
    and ``aggregated``; a stream's chunks carry together what the whole answer does."""
    peer = openai.OpenAI(base_url=vllm_serve, api_key="unused", max_retries=0)
    theirs = _logprobs(peer, "tiny", case, stream=False)
    assert len(theirs) == GREEDY["max_tokens"], theirs
    alternatives = {"chat, photo, top 3": 3, "chat, two images, the tokens alone": 0}
    if case in alternatives:
        assert all(len(step[2]) == alternatives[case] for step in theirs), theirs
    for model in ("epd", "aggregated"):
        for stream in (False, True):
            _same_logprobs(_logprobs(client, model, case, stream), theirs)


SAMPLED = {"seed": 7, "temperature": 1.0, "max_tokens": 8}
"""Seeded sampling: with ``n`` answers, vLLM seeds the j-th ``seed + j``."""


def _texts(answer, stream: bool, chat: bool) -> dict[int, str]:
    """Each choice's text by index, from a whole answer or its chunks."""
    texts: dict[int, str] = {}
    for chunk in answer if stream else [answer]:
        for choice in chunk.choices:
            if chat:
                text = (choice.delta.content if stream else choice.message.content) or ""
            else:
                text = choice.text
            texts[choice.index] = texts.get(choice.index, "") + text
    return texts


def test_n_seeded_answers_are_vllm_serves(vllm_serve, stack, client):
    """``n`` answers, seeded, to a chat with a photo and to a list of two prompts: each
    choice equals ``vllm serve``'s of the same index (its parallel sampling's seeds),
    through ``epd`` (E/P/D) and ``aggregated``, whole and streamed."""
    peer = openai.OpenAI(base_url=vllm_serve, api_key="unused", max_retries=0)
    chat = {"messages": CASES["photo"], "n": 3, **SAMPLED}
    cmpl = {"prompt": ["Once upon a time", "The cat"], "n": 2, **SAMPLED}
    theirs_chat = _texts(peer.chat.completions.create(model="tiny", **chat), False, True)
    theirs_cmpl = _texts(peer.completions.create(model="tiny", **cmpl), False, False)
    assert len(theirs_chat) == 3 and len(set(theirs_chat.values())) > 1, theirs_chat
    assert len(theirs_cmpl) == 4 and len(set(theirs_cmpl.values())) > 2, theirs_cmpl
    for model in ("epd", "aggregated"):
        for stream in (False, True):
            ours = client.chat.completions.create(model=model, stream=stream, **chat)
            assert _texts(ours, stream, True) == theirs_chat, (model, stream)
            ours = client.completions.create(model=model, stream=stream, **cmpl)
            assert _texts(ours, stream, False) == theirs_cmpl, (model, stream)
    whole = client.chat.completions.create(model="epd", **chat)
    one = client.chat.completions.create(model="epd", **{**chat, "n": 1})
    assert whole.usage.prompt_tokens == one.usage.prompt_tokens  # the prompt counts once


TOKENIZE = {
    "prompt": {"prompt": "Once upon a time"},
    "prompt, no special tokens, token strings": {
        "prompt": "Once upon a time",
        "add_special_tokens": False,
        "return_token_strs": True,
    },
    "text chat": {"messages": CASES["text only"]},
    "chat with a photo": {"messages": CASES["photo"]},
    "two images interleaved": {"messages": CASES["two images interleaved"]},
}
"""``/tokenize`` requests, both forms: a prompt as it is, and a chat (images counted)."""


def _post(url: str, body: dict) -> tuple[int, dict]:
    response = httpx.post(url, json=body, timeout=60)
    return response.status_code, response.json()


@pytest.mark.parametrize("case", list(TOKENIZE))
def test_tokenize_and_detokenize_answer_as_vllm_serve_does(vllm_serve, stack, client, case):
    """The same token ids (each image's placeholder repeated for its tokens), count,
    context and token strings as ``vllm serve``, and the same text back; a chat's count is
    the ``usage.prompt_tokens`` its completion reports."""
    peer, ours = vllm_serve.removesuffix("/v1"), stack.openai["front"].url
    status, theirs = _post(f"{peer}/tokenize", {"model": "tiny", **TOKENIZE[case]})
    assert status == 200 and theirs["count"] == len(theirs["tokens"]) > 0, theirs
    for model in ("epd", "aggregated"):
        assert _post(f"{ours}/tokenize", {"model": model, **TOKENIZE[case]}) == (200, theirs)
    back = {"model": "tiny", "tokens": theirs["tokens"]}
    assert _post(f"{ours}/detokenize", back) == _post(f"{peer}/detokenize", back)
    if messages := TOKENIZE[case].get("messages"):
        answer = client.chat.completions.create(model="epd", messages=messages, **GREEDY)
        assert answer.usage.prompt_tokens == theirs["count"]


def test_tokenize_errors_have_the_right_status_and_say_what_is_wrong(stack):
    url = stack.openai["front"].url
    bad_image = {"type": "image_url", "image_url": {"url": "data:image/png;base64,aGVsbG8="}}
    tools = [{"type": "function", "function": {"name": "f", "parameters": {}}}]
    for route, body, status, message in [
        ("tokenize", {"model": "gpt-4o", "prompt": "x"}, 404, "does not exist"),
        ("tokenize", {"messages": [{"role": "user", "content": [bad_image]}]}, 400, "image 1 of 1"),
        ("tokenize", {"messages": CASES["text only"], "tools": tools}, 400, "tools: tool calling"),
        (
            "tokenize",
            {"messages": CASES["text only"], "chat_template_kwargs": {"tokenize": True}},
            400,
            "chat_template_kwargs.tokenize",
        ),
        ("tokenize", {"prompt": "x" * (1 << 20 | 1)}, 413, "the limit is 1048576"),
        (
            "tokenize",
            {"messages": [{"role": "user", "content": [image_part(PHOTO)] * 3}]},
            413,
            "3 images sent",
        ),
        ("detokenize", {"tokens": [1 << 30]}, 400, "out of the vocabulary"),
        ("detokenize", {"model": "gpt-4o", "tokens": [1]}, 404, "does not exist"),
    ]:
        got, body = _post(f"{url}/{route}", body)
        assert got == status and message in body["error"]["message"], (route, body)


@pytest.mark.parametrize("kind", list(openai_peer.KINDS))
def test_vllm_bench_serve_runs_against_it(stack, tmp_path, kind):
    """vLLM's own load generator runs clean: the chat API with synthetic images or
    without, and the completions API."""
    result = openai_peer.bench_serve(
        stack.openai["front"].url,
        stack.topology.model,
        "epd",
        kind,
        prompts=6,
        warmups=1,
        concurrency=1,
        out=tmp_path / "result.json",
    )
    summary = {k: result.get(k) for k in ("completed", "failed", "errors", "total_output_tokens")}
    assert result["completed"] == 6 and not result.get("failed"), summary
    assert result["total_output_tokens"] == 6 * 16


def test_text_is_measured_while_photos_are_answered(stack, vllm_serve, tmp_path):
    """``epd bench openai``'s mixed workload: the text run happens while the photo load is
    answered (against ``vllm serve``: this module's front takes four requests at a time)."""
    result = openai_peer.bench_serve(
        vllm_serve.removesuffix("/v1"), stack.topology.model, "tiny", openai_peer.MIXED,
        prompts=6, warmups=1, concurrency=2, out=tmp_path / "result.json",
    )  # fmt: skip
    load = result["photo_load"]
    assert result["completed"] == 6 and not result.get("failed"), result.get("errors")
    assert load["failed"] == 0 and load["req_per_s"] > 0, load


def test_aiperf_runs_against_it(stack, tmp_path):
    """NVIDIA's AIPerf (chat, streaming, synthetic images) runs without an error."""
    result = openai_peer.aiperf_profile(
        stack.openai["front"].url, stack.topology.model, "epd", 6, 1, tmp_path / "aiperf"
    )
    assert result["request_count"]["avg"] == 6 and result["error_summary"] == [], result
    assert result["num_images"]["avg"] == 1, result["num_images"]


def test_a_dead_stage_is_503_and_what_does_not_need_it_still_works(stack, client):
    """Last in this module: it kills the encoder server. Photos then fail at once with
    503 naming the stage; text-only requests, which need no encoder, are still served."""
    stack.servers["encoder"].kill()
    status, message = _status(client, messages=CASES["photo"], max_tokens=4)
    assert status == 503 and "encode" in message, message
    assert client.chat.completions.create(model="epd", messages=CASES["text only"], **GREEDY)
