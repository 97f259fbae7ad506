"""The OpenAI front's translation of completions requests (pure logic, no servers): what
is refused by name, one model request per prompt with vLLM's completions defaults, the
answers' shapes, and how a batch's streams are merged and stopped."""

from __future__ import annotations

import asyncio
import json

import pytest
from vllm.entrypoints.openai.completion.protocol import CompletionRequest

from orchestrator.config import Limits
from orchestrator.frontend import Delta, parse_front_request
from orchestrator.openai_server.answer import Choice
from orchestrator.openai_server.completions import (
    CompletionAnswer,
    check_completion,
    model_inputs,
)
from orchestrator.openai_server.serving import merged
from orchestrator.protocol import InvalidRequest, StageError


def request(**fields) -> CompletionRequest:
    return CompletionRequest.model_validate({"model": "m", "prompt": "Once", **fields})


@pytest.mark.parametrize(
    ("fields", "message"),
    [
        ({"echo": True, "logprobs": 0}, "echo: echo with logprobs needs the prompt's"),
        ({"suffix": "end"}, "suffix: fill-in-the-middle"),
        ({"echo": True, "max_tokens": 0}, "max_tokens: echo without generation"),
        ({"use_beam_search": True}, "beam search"),
        ({"prompt_logprobs": 1}, "prompt_logprobs"),
        ({"truncate_prompt_tokens": 8}, "truncate_prompt_tokens: not supported"),
        ({"cache_salt": "tenant-a"}, "cache_salt: not supported"),
    ],
)
def test_what_the_engines_do_not_do_is_refused_by_name(fields, message):
    with pytest.raises(InvalidRequest, match=message):
        check_completion(request(**fields))


def test_fields_sent_with_their_default_values_pass():
    check_completion(
        request(echo=True, n=1, priority=0, user="someone", request_id="mine", seed=3, stop="x")
    )


def _front(inputs):
    return [parse_front_request(one, Limits()) for one in inputs]


def test_each_prompt_is_one_model_request_with_vllms_completions_defaults():
    (text,) = _front(model_inputs(request(), {"temperature": 0.5}))
    assert text.raw_prompt == "Once" and text.add_special_tokens and text.messages == []
    assert text.sampling.max_tokens == 16  # the completions API's default
    assert text.sampling.temperature == 0.5  # the checkpoint's, as vllm serve applies
    assert text.stream and text.outputs.num_input_tokens
    (ids,) = _front(model_inputs(request(prompt=[7, 8, 9]), {}))
    assert ids.raw_prompt == [7, 8, 9]
    batch = _front(model_inputs(request(prompt=["a", "b c"], add_special_tokens=False), {}))
    assert [r.raw_prompt for r in batch] == ["a", "b c"]
    assert not any(r.add_special_tokens for r in batch)
    (null,) = _front(model_inputs(request(max_tokens=None), {"max_tokens": 9}))
    assert null.sampling.max_tokens == 16  # vLLM reads null as the default too
    pairs = _front(model_inputs(request(prompt=["a", "b"], n=2, seed=3, temperature=1), {}))
    got = [(r.raw_prompt, r.sampling.seed) for r in pairs]
    assert got == [("a", 3), ("a", 4), ("b", 3), ("b", 4)]  # index = prompt * n + answer
    with pytest.raises(InvalidRequest, match="n must be 1 when using greedy sampling"):
        model_inputs(request(n=2, temperature=0), {})
    with pytest.raises(InvalidRequest, match=r"prompt\[1\] is empty"):
        model_inputs(request(prompt=[[1], []]), {})


def _event(text: str) -> dict:
    assert text.startswith("data: ") and text.endswith("\n\n")
    return json.loads(text.removeprefix("data: "))


def test_answers_in_openai_shapes_with_the_prompt_echoed_once():
    answer = CompletionAnswer("cmpl-1", "m", [Choice(), Choice()], echo=["A", "B"])
    assert answer.opening() == []
    answer.add(1, Delta("x", 1, None, 4))
    first = _event(answer.event(1, Delta("x", 1, None, 4)))
    assert first["object"] == "text_completion" and first["id"] == "cmpl-1"
    assert first["choices"] == [{"index": 1, "text": "Bx", "finish_reason": None}]
    assert _event(answer.event(1, Delta("y", 1, None)))["choices"][0]["text"] == "y"
    assert answer.event(1, Delta("", 0, None)) is None  # nothing to send
    assert _event(answer.event(1, Delta("", 1, None)))["choices"][0]["text"] == ""  # a token
    answer.add(0, Delta("", 0, "length", 3))
    last = _event(answer.event(0, Delta("", 0, "length")))["choices"][0]
    assert (last["index"], last["text"], last["finish_reason"]) == (0, "A", "length")
    usage = _event(answer.usage_event())
    assert usage["choices"] == [] and usage["usage"]["prompt_tokens"] == 7

    whole = CompletionAnswer("cmpl-2", "m", [Choice(), Choice()], echo=["A", "B"])
    whole.add(0, Delta("he", 2, None, 3))
    whole.add(1, Delta("yo", 1, "stop", 4))
    body = whole.response().model_dump()
    assert [(c["index"], c["text"]) for c in body["choices"]] == [(0, "Ahe"), (1, "Byo")]
    assert body["usage"]["prompt_tokens"] == 7 and body["usage"]["completion_tokens"] == 3


async def _steps(name: str, texts: list[str], log: list[str], fail: bool = False):
    try:
        for text in texts:
            await asyncio.sleep(0)
            yield Delta(text, 1, None)
        if fail:
            raise StageError(f"{name} failed")
        await asyncio.Event().wait() if name == "forever" else None
    finally:
        log.append(f"{name} closed")


def test_a_batchs_streams_merge_by_index_and_the_first_error_stops_them_all():
    async def run():
        log: list[str] = []
        both = merged([_steps("a", ["a1", "a2"], log), _steps("b", ["b1"], log)])
        got = [(i, d.text) async for i, d in both]
        assert sorted(got) == [(0, "a1"), (0, "a2"), (1, "b1")]
        assert [t for i, t in got if i == 0] == ["a1", "a2"]  # each stream in its order
        assert sorted(log) == ["a closed", "b closed"]

        log.clear()
        both = merged([_steps("forever", ["f1"], log), _steps("b", ["b1"], log, fail=True)])
        with pytest.raises(StageError, match="b failed"):
            async for _ in both:
                pass
        assert sorted(log) == ["b closed", "forever closed"]  # the other one is stopped

        log.clear()  # a client that leaves: closing the merge stops every stream
        both = merged([_steps("forever", ["f1"], log), _steps("b", ["b1"], log)])
        await anext(both)
        await both.aclose()
        assert sorted(log) == ["b closed", "forever closed"]

    asyncio.run(run())


def test_logprobs_in_the_openai_shapes_vllm_serve_answers_with():
    """Chat lists ``top_logprobs`` candidates per token, completions ``logprobs`` + 1 (the
    OpenAI API's rule for each); -inf is -9999.0; a completions chunk's offsets go on from
    where the tokens before it ended."""
    from orchestrator.frontend import TokenLogprob
    from orchestrator.openai_server.logprobs import chat_logprobs, completion_logprobs

    steps = [
        {
            5: TokenLogprob(-0.5, 2, "He"),
            3: TokenLogprob(-0.2, 1, "I"),
            8: TokenLogprob(-3, 3, "A"),
        },
        {6: TokenLogprob(float("-inf"), 9, "llo"), 1: TokenLogprob(-0.1, 1, "!")},
    ]
    chat = chat_logprobs(steps, 1).content
    assert [(c.token, c.logprob, c.bytes) for c in chat] == [
        ("He", -0.5, list(b"He")),
        ("llo", -9999.0, list(b"llo")),
    ]
    assert [[t.token for t in c.top_logprobs] for c in chat] == [["He"], ["llo"]]
    assert [len(c.top_logprobs) for c in chat_logprobs(steps, 0).content] == [0, 0]
    assert [len(c.top_logprobs) for c in chat_logprobs(steps, -1).content] == [3, 2]
    whole = completion_logprobs(steps, 1)
    assert whole.tokens == ["He", "llo"] and whole.token_logprobs == [-0.5, -9999.0]
    assert whole.top_logprobs == [{"He": -0.5, "I": -0.2}, {"llo": -9999.0, "!": -0.1}]
    assert whole.text_offset == [0, 2]
    assert completion_logprobs(steps[1:], 1, offset=2).text_offset == [2]
