"""The OpenAI front's translation of chat requests (pure logic, no servers): what is
refused by name, where images go, vLLM's reading of the sampling fields, media URLs."""

from __future__ import annotations

import asyncio
import base64
import json

import pytest
from vllm.entrypoints.openai.chat_completion.protocol import ChatCompletionRequest

from orchestrator.config import Limits
from orchestrator.frontend import Delta, parse_front_request
from orchestrator.openai_server.answer import Choice
from orchestrator.openai_server.chat import ChatAnswer, check_chat, conversation, model_inputs
from orchestrator.openai_server.media import MediaLoader
from orchestrator.openai_server.request import parse_request
from orchestrator.protocol import InvalidRequest, TooLarge


def request(**fields) -> ChatCompletionRequest:
    body = {"model": "m", "messages": [{"role": "user", "content": "hi"}], **fields}
    return ChatCompletionRequest.model_validate(body)


@pytest.mark.parametrize(
    ("fields", "message"),
    [
        ({"prompt_logprobs": 1}, "prompt_logprobs"),
        ({"tools": [{"type": "function", "function": {"name": "f"}}]}, "tools: tool calling"),
        ({"use_beam_search": True}, "beam search"),
        ({"chat_template": "{{ 1 }}"}, "the model's own template"),
    ],
)
def test_what_the_engines_do_not_do_is_refused_by_name(fields, message):
    with pytest.raises(InvalidRequest, match=message):
        check_chat(request(**fields))


@pytest.mark.parametrize(
    "fields",
    [
        {"cache_salt": "tenant-a"},
        {"mm_processor_kwargs": {"max_pixels": 1024}},
        {"truncate_prompt_tokens": 8},
        {"echo": True},
        {"priority": 3},
        {"kv_transfer_params": {"do_remote_prefill": True}},
    ],
)
def test_fields_this_server_does_not_serve_are_refused_by_name_never_ignored(fields):
    name = next(iter(fields))
    with pytest.raises(InvalidRequest, match=name):
        check_chat(request(**fields))


def test_a_field_vllm_does_not_know_is_ignored_as_vllm_serve_ignores_it():
    check_chat(request(no_such_field=1))  # was a KeyError, answered 404


def test_fields_sent_with_their_default_values_and_what_vllm_ignores_too_pass():
    check_chat(
        request(
            echo=False,
            priority=0,
            cache_salt=None,
            user="someone",
            include_reasoning=False,
            request_id="mine",
            stream=True,
            stream_options={"include_usage": True},
            add_special_tokens=True,
            seed=3,
            logit_bias={"5": 1.0},
        )
    )


def test_images_stay_where_they_are_in_the_conversation():
    url = "data:image/png;base64,AAAA"
    chat = conversation(
        request(
            messages=[
                {"role": "developer", "content": "sys"},
                {
                    "role": "user",
                    "content": [
                        {"type": "text", "text": "a"},
                        {"type": "image_url", "image_url": {"url": url}},
                        {"type": "text", "text": "b"},
                        {"type": "image_url", "image_url": {"url": url + "B"}},
                    ],
                },
            ]
        )
    )
    assert chat.messages[0] == {"role": "system", "content": [{"type": "text", "text": "sys"}]}
    kinds = [p["type"] for p in chat.messages[1]["content"]]
    assert kinds == ["text", "image", "text", "image"]
    assert chat.image_urls == [url, url + "B"]
    with pytest.raises(InvalidRequest, match=r"messages\[0\].content\[0\] of type 'input_audio'"):
        audio = {"type": "input_audio", "input_audio": {"data": "AAAA", "format": "wav"}}
        conversation(request(messages=[{"role": "user", "content": [audio]}]))


def sampling(chat: ChatCompletionRequest, defaults: dict):
    """The sampling options the model receives for ``chat``."""
    loader = MediaLoader([], timeout_s=1, max_bytes=8)
    (inputs,) = asyncio.run(model_inputs(chat, defaults, loader))
    return parse_front_request(inputs, Limits()).sampling


def test_sampling_is_vllms_reading_with_the_checkpoints_defaults():
    options = sampling(request(max_completion_tokens=7, stop="x", top_k=5, seed=3), {})
    assert (options.max_tokens, options.stop, options.top_k, options.seed) == (7, ["x"], 5, 3)
    assert options.temperature == 1.0  # vLLM's default when neither request nor checkpoint say
    assert sampling(request(), {"temperature": 0.25}).temperature == 0.25
    assert sampling(request(), {}).max_tokens is None  # what the context leaves
    assert sampling(request(), {"max_tokens": 9}).max_tokens == 9  # generation_config's
    with pytest.raises(InvalidRequest, match="max_tokens"):
        sampling(request(max_tokens=-5), {})


def test_response_format_and_structured_outputs_are_vllms_reading_of_them():
    """The constraint the engine gets is the one vLLM's own request reads from the
    ``response_format`` or ``structured_outputs`` fields."""
    schema = {"type": "object", "properties": {"a": {"type": "integer"}}}
    json_schema = {"type": "json_schema", "json_schema": {"name": "a", "schema": schema}}
    cases = [
        ({"response_format": json_schema}, "json", schema),
        ({"response_format": {"type": "json_object"}}, "json_object", True),
        ({"structured_outputs": {"choice": ["yes", "no"]}}, "choice", ["yes", "no"]),
        ({"structured_outputs": {"regex": "[0-9]+"}}, "regex", "[0-9]+"),
    ]
    for fields, kind, value in cases:
        constraint = sampling(request(**fields), {}).structured_outputs
        assert constraint is not None and constraint.vllm_kwargs()[kind] == value, fields
    assert sampling(request(response_format={"type": "text"}), {}).structured_outputs is None
    both = {"model": "m", "messages": [], "structured_outputs": {"regex": "a", "choice": ["b"]}}
    with pytest.raises(InvalidRequest, match="only use one kind"):
        parse_request(ChatCompletionRequest, both)


def test_the_template_variables_reach_the_models_as_vllm_passes_them():
    loader = MediaLoader([], timeout_s=1, max_bytes=8)
    (plain,) = asyncio.run(model_inputs(request(), {}, loader))
    assert "chat_template_kwargs" not in plain  # the template's defaults: nothing to send
    turns = [{"role": "user", "content": "hi"}, {"role": "assistant", "content": "Once"}]
    asked = request(
        messages=turns,
        add_generation_prompt=False,
        continue_final_message=True,
        chat_template_kwargs={"enable_thinking": False},
    )
    (inputs,) = asyncio.run(model_inputs(asked, {}, loader))
    assert parse_front_request(inputs, Limits()).template_kwargs == {
        "add_generation_prompt": False,
        "continue_final_message": True,
        "enable_thinking": False,
    }
    with pytest.raises(InvalidRequest, match="tool calling is not served"):
        tools = request(chat_template_kwargs={"tools": [{"type": "function"}]})
        parse_front_request(asyncio.run(model_inputs(tools, {}, loader))[0], Limits())


def test_n_answers_are_n_requests_seeded_as_vllms_parallel_sampling_seeds_them():
    loader = MediaLoader([], timeout_s=1, max_bytes=8)
    sets = asyncio.run(model_inputs(request(n=3, seed=7, temperature=0.8), {}, loader))
    assert [parse_front_request(s, Limits()).sampling.seed for s in sets] == [7, 8, 9]
    unseeded = asyncio.run(model_inputs(request(n=2, temperature=0.8), {}, loader))
    assert [parse_front_request(s, Limits()).sampling.seed for s in unseeded] == [None, None]
    with pytest.raises(InvalidRequest, match="n must be 1 when using greedy sampling"):
        asyncio.run(model_inputs(request(n=2, temperature=0), {}, loader))


def test_several_answers_stream_each_under_its_index_and_count_the_prompt_once():
    answer = ChatAnswer(id="chatcmpl-2", model="m", choices=[Choice(), Choice()], per_prompt=2)
    roles = [json.loads(e.removeprefix("data: ")) for e in answer.opening()]
    assert [r["choices"][0]["index"] for r in roles] == [0, 1]
    answer.add(1, Delta("b", 1, "stop", 5))
    answer.add(0, Delta("a", 2, "length", 5))
    event = json.loads(answer.event(1, Delta("b", 1, "stop")).removeprefix("data: "))
    assert event["choices"][0]["index"] == 1
    whole = answer.response().model_dump()
    assert [c["message"]["content"] for c in whole["choices"]] == ["a", "b"]
    assert whole["usage"]["prompt_tokens"] == 5 and whole["usage"]["completion_tokens"] == 3


def test_add_special_tokens_reaches_the_pipeline_off_by_default_as_in_vllm():
    loader = MediaLoader([], timeout_s=1, max_bytes=8)
    for fields, expected in (({}, False), ({"add_special_tokens": True}, True)):
        (inputs,) = asyncio.run(model_inputs(request(**fields), {}, loader))
        assert parse_front_request(inputs, Limits()).add_special_tokens is expected


def test_media_urls():
    loader = MediaLoader(["images.example"], timeout_s=1, max_bytes=8)

    async def load(url: str) -> bytes:
        return await loader.load(url, "image 1 of 1")

    data = base64.b64encode(b"1234").decode()
    assert asyncio.run(load(f"data:image/png;base64,{data}")) == b"1234"
    for url, error, message in [
        (f"data:text/plain;base64,{data}", InvalidRequest, "is not an image"),
        ("data:image/png,1234", InvalidRequest, "only base64"),
        ("data:image/png;base64,@@@", InvalidRequest, "not valid base64"),
        ("data:image/png;base64," + base64.b64encode(bytes(16)).decode(), TooLarge, "limit"),
        ("http://169.254.169.254/latest", InvalidRequest, "not fetched by this server"),
        ("file:///etc/passwd", InvalidRequest, "data: URL or an http"),
    ]:
        with pytest.raises(error, match=message):
            asyncio.run(load(url))


def test_answers_in_openai_shapes():
    answer = ChatAnswer(id="chatcmpl-1", model="m", choices=[Choice()])
    (role,) = answer.opening()
    role = json.loads(role.removeprefix("data: "))
    assert role["choices"][0]["delta"] == {"role": "assistant", "content": ""}
    answer.add(0, Delta("he", 2, None, 9))
    assert answer.event(0, Delta("", 0, None)) is None  # nothing to send
    no_text_yet = json.loads(answer.event(0, Delta("", 1, None)).removeprefix("data: "))
    assert no_text_yet["choices"][0]["delta"] == {"content": ""}  # a token: vLLM sends it
    answer.add(0, Delta("y", 1, "stop", 9))
    whole = answer.response().model_dump()
    assert whole["choices"][0]["message"] == {**whole["choices"][0]["message"], "content": "hey"}
    assert whole["usage"]["prompt_tokens"] == 9 and whole["usage"]["completion_tokens"] == 3
    chunk = json.loads(answer.event(0, Delta("y", 1, "stop")).removeprefix("data: "))
    assert chunk["id"] == "chatcmpl-1" and chunk["object"] == "chat.completion.chunk"
    assert chunk["choices"][0] == {"index": 0, "delta": {"content": "y"}, "finish_reason": "stop"}
    usage = json.loads(answer.usage_event().removeprefix("data: "))
    assert usage["choices"] == [] and usage["usage"]["total_tokens"] == 12


def test_allowed_hosts_are_fetched_within_limits():
    """A real HTTP server on loopback: fetched when its host is allowed, refused past the
    byte cap, on an error status, and when it redirects (never followed)."""
    import http.server
    import threading

    class Images(http.server.BaseHTTPRequestHandler):
        def do_GET(self) -> None:  # noqa: N802 - the stdlib's name
            if self.path == "/small":
                self.send_response(200), self.end_headers(), self.wfile.write(b"12345")
            elif self.path == "/big":
                self.send_response(200), self.end_headers(), self.wfile.write(bytes(64))
            elif self.path == "/elsewhere":
                self.send_response(302)
                self.send_header("Location", "http://169.254.169.254/")
                self.end_headers()
            else:
                self.send_response(404), self.end_headers()

        def log_message(self, *args) -> None:
            pass

    server = http.server.ThreadingHTTPServer(("127.0.0.1", 0), Images)
    threading.Thread(target=server.serve_forever, daemon=True).start()
    base = f"http://127.0.0.1:{server.server_address[1]}"

    async def load(path: str) -> bytes:
        loader = MediaLoader(["127.0.0.1"], timeout_s=5, max_bytes=8)
        try:
            return await loader.load(base + path, "image 1 of 1")
        finally:
            await loader.close()

    try:
        assert asyncio.run(load("/small")) == b"12345"
        for path, error, message in [
            ("/big", TooLarge, "over the limit of 8 bytes"),
            ("/missing", InvalidRequest, "answered HTTP 404"),
            ("/elsewhere", InvalidRequest, "answered HTTP 302"),
        ]:
            with pytest.raises(error, match=message):
                asyncio.run(load(path))
    finally:
        server.shutdown()


def test_tokenize_repeats_each_placeholder_for_its_image_and_refuses_one_written_as_text():
    from orchestrator.openai_server.tokens import expand_images

    assert expand_images([1, 9, 2, 9], 9, [3, 1]) == [1, 9, 9, 9, 2, 9]
    with pytest.raises(InvalidRequest, match="2 placeholders for 1 image"):
        expand_images([9, 1, 9], 9, [4])
