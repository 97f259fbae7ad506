"""Limits at the public edge: each refused with a message naming the input, before any
stage works (pure parsing, no servers); prompts rendered and counted as the engines will."""

from __future__ import annotations

import asyncio
import io
import json
import threading

import numpy as np
import pytest
from PIL import Image

from orchestrator.config import Limits
from orchestrator.frontend import (
    SHORT_PROMPT_BYTES,
    Delta,
    ExtraOutputs,
    Prompt,
    PromptBuilder,
    TokenLogprob,
    completion_responses,
    parse_front_request,
    tensors_delta,
    user_turn,
)
from orchestrator.protocol import InvalidRequest, LastResponse, SamplingOptions, TooLarge


def _png(width: int, height: int) -> bytes:
    buf = io.BytesIO()
    Image.new("RGB", (width, height), (1, 2, 3)).save(buf, format="PNG")
    return buf.getvalue()


def _noise_png(side: int) -> bytes:
    pixels = np.random.default_rng(0).integers(0, 256, (side, side, 3), dtype=np.uint8)
    buf = io.BytesIO()
    Image.fromarray(pixels).save(buf, format="PNG")
    return buf.getvalue()


def _inputs(text: bytes = b"hi", images: list[bytes] | None = None) -> dict[str, np.ndarray]:
    inputs = {"text_input": np.array([text], dtype=np.object_)}
    if images is not None:
        inputs["image"] = np.array(images, dtype=np.object_)
    return inputs


LIMITS = Limits(
    max_images_per_request=3,
    max_image_bytes=4000,
    max_image_pixels=10_000,
    max_text_bytes=100,
    max_request_bytes=5000,
)


@pytest.mark.parametrize(
    ("inputs", "message"),
    [
        (_inputs(b"x" * 101), "text_input is 101 bytes; the limit is 100"),
        (_inputs(images=[_png(8, 8)] * 4), "4 images sent; this deployment accepts at most 3"),
        (_inputs(images=[_png(8, 8), b""]), "image 2 of 2 is empty"),
        (_inputs(images=[_png(8, 8), b"\x89PNG" + b"0" * 4000]), "image 2 of 2 is 4004 bytes"),
        (_inputs(images=[_png(8, 8), _png(101, 100)]), "image 2 of 2: 101x100 = 10100 pixels"),
        (_inputs(images=[_png(8, 8), b"GIF89a\x01\xff"]), "image 2 of 2: bytes are neither"),
        (
            _inputs(images=[_noise_png(32), b"\x89PNG" + bytes(2500)]),
            "request is over 5000 bytes at image 2 of 2",
        ),
        (
            {
                **_inputs(),
                "sampling_parameters": np.array(
                    [json.dumps({"structured_outputs": {"regex": "a" * 80}}).encode()],
                    dtype=np.object_,
                ),
            },
            "sampling_parameters is 117 bytes; the limit is 100",
        ),
    ],
    ids=["text", "count", "empty", "bytes", "pixels", "format", "total", "sampling"],
)
def test_limits_name_the_input(inputs, message):
    with pytest.raises(InvalidRequest, match=message):
        parse_front_request(inputs, LIMITS)


def test_a_request_within_the_limits_passes():
    request = parse_front_request(_inputs(images=[_png(100, 100)] * 3), LIMITS)
    assert len(request.images) == 3
    # text_input is one user turn, its images first
    assert request.messages == [
        {"role": "user", "content": [{"type": "image"}] * 3 + [{"type": "text", "text": "hi"}]}
    ]


def _chat(messages, images: list[bytes] | None = None) -> dict[str, np.ndarray]:
    inputs = {"messages": np.array([json.dumps(messages).encode()], dtype=np.object_)}
    if images is not None:
        inputs["image"] = np.array(images, dtype=np.object_)
    return inputs


def test_messages_keep_each_image_where_it_stands():
    turns = [
        {"role": "system", "content": "be brief"},
        {"role": "user", "content": [{"type": "text", "text": "a"}, {"type": "image"}]},
        {"role": "assistant", "content": "b"},
        {"role": "user", "content": [{"type": "image"}, {"type": "text", "text": "c"}]},
    ]
    request = parse_front_request(_chat(turns, [_png(8, 8), _png(9, 9)]), LIMITS)
    assert [m["role"] for m in request.messages] == ["system", "user", "assistant", "user"]
    assert request.messages[0]["content"] == [{"type": "text", "text": "be brief"}]
    assert request.messages[1]["content"][1] == {"type": "image"}
    assert request.messages[3]["content"][0] == {"type": "image"}


@pytest.mark.parametrize(
    ("inputs", "message"),
    [
        ({}, "send exactly one of text_input, messages, prompt, prompt_token_ids"),
        ({**_inputs(), **_chat([{"role": "user", "content": "x"}])}, "got text_input, messages"),
        (_chat("hi"), "non-empty JSON list"),
        (_chat([{"role": "tool", "content": "x"}]), r"messages\[0\].role is 'tool'"),
        (_chat([{"role": "user", "content": 3}]), r"messages\[0\].content must be"),
        (
            _chat([{"role": "user", "content": [{"type": "video"}]}]),
            r"messages\[0\].content\[0\] must be",
        ),
        (
            _chat([{"role": "user", "content": [{"type": "image"}]}]),
            r"messages place 1 image\(s\) but 0 image input\(s\) were sent",
        ),
        (_chat([{"role": "user", "content": "x" * 101}]), "101 bytes of text; the limit is 100"),
    ],
    ids=["none", "both", "not-a-list", "role", "content", "part", "image-count", "size"],
)
def test_bad_messages_name_the_turn(inputs, message):
    with pytest.raises(InvalidRequest, match=message):
        parse_front_request(inputs, LIMITS)


def test_optional_outputs_follow_vllm_backend():
    """finish_reason is the string None until the end; token counts are per response when
    streaming, the totals otherwise. A token whose text is not out yet is a response of its
    own with empty text, as vllm_backend and vllm serve stream it (held back for the next
    one, it cost a whole decode step of time to first token); a step with neither tokens
    nor text is none."""

    async def deltas():
        yield Delta("", 0, None, 7)  # nothing yet
        yield Delta("", 1, None, 7)  # a token with no text yet (a character's first byte)
        yield Delta("ab", 1, None, 7)
        yield Delta("c", 1, "length", 7)

    async def collect(stream: bool):
        outputs = ExtraOutputs(True, True, True, logprobs=False, token_ids=False)
        return [r async for r in completion_responses(deltas(), stream, outputs)]

    streamed = asyncio.run(collect(True))
    assert [type(r) for r in streamed] == [dict, dict, LastResponse]  # the last: final flag
    assert [r["text_output"][0] for r in streamed] == [b"", b"ab", b"c"]
    assert [r["finish_reason"][0] for r in streamed] == [b"None", b"None", b"length"]
    assert [int(r["num_output_tokens"][0]) for r in streamed] == [1, 1, 1]
    assert all(int(r["num_input_tokens"][0]) == 7 for r in streamed)
    [whole] = asyncio.run(collect(False))
    assert isinstance(whole, LastResponse)
    assert whole["text_output"][0] == b"abc" and int(whole["num_output_tokens"][0]) == 3
    assert tensors_delta(whole) == Delta("abc", 3, "length", 7)
    [plain] = asyncio.run(_plain(deltas))
    assert set(plain) == {"text_output"}  # nothing asked, nothing extra


async def _plain(deltas):
    return [r async for r in completion_responses(deltas(), False, ExtraOutputs())]


def _step(*candidates: tuple[int, float, int, str]) -> dict[int, TokenLogprob]:
    return {t: TokenLogprob(lp, rank, text) for t, lp, rank, text in candidates}


def test_logprobs_ride_with_their_tokens_in_vllm_backends_shape():
    """``logprobs`` (asked by ``return_logprobs``) lists each token's candidates, vLLM's
    order kept (the sampled token first), in the response of its token (one with no text
    yet too); JSON ``null`` when the sampling asked for none."""
    a = _step((5, -0.1, 1, "a"), (9, -2.5, 2, "z"))
    b = _step((6, -1.5, 2, "b"), (7, -0.3, 1, "B"))
    c = _step((8, float("-inf"), 3, "\u00e9"), (7, -0.3, 1, "B"))

    async def deltas():
        yield Delta("", 1, None, 7, [a])
        yield Delta("ab", 1, None, 7, [b])
        yield Delta("c", 1, "length", 7, [c])

    async def collect(stream: bool):
        outputs = ExtraOutputs(logprobs=True)
        return [r async for r in completion_responses(deltas(), stream, outputs)]

    streamed = asyncio.run(collect(True))
    assert [json.loads(r["logprobs"][0]) for r in streamed[:2]] == [
        [{"5": {"logprob": -0.1, "rank": 1, "decoded_token": "a"},
          "9": {"logprob": -2.5, "rank": 2, "decoded_token": "z"}}],
        [{"6": {"logprob": -1.5, "rank": 2, "decoded_token": "b"},
          "7": {"logprob": -0.3, "rank": 1, "decoded_token": "B"}}],
    ]  # fmt: skip
    [whole] = asyncio.run(
        _collect(
            completion_responses(deltas(), False, ExtraOutputs(True, True, True, logprobs=True))
        )
    )
    back = tensors_delta(whole)
    assert back.logprobs == [a, b, c] and list(back.logprobs[0]) == [5, 9]  # order kept

    async def unasked():
        yield Delta("x", 1, "stop", 7)

    [none] = asyncio.run(
        _collect(
            completion_responses(unasked(), False, ExtraOutputs(True, True, True, logprobs=True))
        )
    )
    assert none["logprobs"][0] == b"null" and tensors_delta(none).logprobs is None


async def _collect(responses):
    return [r async for r in responses]


@pytest.mark.parametrize("family", ["qwen2_vl", "llava"])
def test_prompts_are_tokenized_as_the_tokenizer_tokenizes_them(hub_checkpoint, family):
    prompts = PromptBuilder(hub_checkpoint(family), max_model_len=64)
    text = prompts.build("Describe both.", 2)  # the template's own special tokens inside
    for add in (False, True):
        expected = prompts.tokenizer(text, add_special_tokens=add).input_ids
        assert prompts.tokenize(text, add) == expected
    rendered = prompts.render_now([user_turn("Describe both.", 2)])
    assert rendered == Prompt(text, prompts.tokenize(text, False))
    # two images of 5 tokens each: the placeholders count once in the text already
    total, sampling = prompts.fit(rendered, [5, 5], SamplingOptions(max_tokens=None))
    assert total == rendered.text_tokens + 8 and sampling.max_tokens == 64 - total
    with pytest.raises(InvalidRequest, match="exceeds the model's context of 64 tokens"):
        prompts.fit(rendered, [], SamplingOptions(max_tokens=64))


def test_a_tokenizer_that_asks_to_truncate_does_not_cut_the_prompt(hub_checkpoint, tmp_path):
    """The engines take the front's token ids as they are: a tokenizer.json that truncates
    (HF's own calls switch that off) must not shorten a prompt that is then refused as
    too long, or worse, served cut."""
    import shutil

    model = shutil.copytree(hub_checkpoint("qwen2_vl"), tmp_path / "model")
    config = json.loads((model / "tokenizer.json").read_text())
    config["truncation"] = {
        "direction": "Right",
        "max_length": 3,
        "strategy": "LongestFirst",
        "stride": 0,
    }
    (model / "tokenizer.json").write_text(json.dumps(config))
    prompts = PromptBuilder(model, max_model_len=64)
    text = prompts.build("Describe this in many more words than three.", 0)
    ids = prompts.tokenize(text, False)
    assert len(ids) > 3 and ids == prompts.tokenizer(text, add_special_tokens=False).input_ids


@pytest.mark.parametrize(
    ("text_bytes", "thread"),
    [(SHORT_PROMPT_BYTES, "MainThread"), (SHORT_PROMPT_BYTES + 1, "prompt")],
)
def test_a_long_prompt_is_rendered_off_the_callers_loop(hub_checkpoint, text_bytes, thread):
    """A short prompt on the caller's loop (a hop to the thread costs more than rendering
    it), a long one on the builder's thread, where it cannot hold up the loop's streams."""

    class Recording(PromptBuilder):
        def prompt_now(self, request):
            self.thread = threading.current_thread().name
            return super().prompt_now(request)

    prompts = Recording(hub_checkpoint("qwen2_vl"), max_model_len=4096)
    limits = LIMITS.model_copy(update={"max_text_bytes": 2 * SHORT_PROMPT_BYTES})
    request = parse_front_request(_inputs(b"x" * text_bytes), limits)
    assert request.text_bytes == text_bytes
    rendered = asyncio.run(prompts.render(request))
    assert rendered.text_tokens > 0
    assert prompts.thread.split("_")[0] == thread


def _raw(name: str, value) -> dict[str, np.ndarray]:
    if name == "prompt":
        return {"prompt": np.array([value], dtype=np.object_)}
    return {"prompt_token_ids": np.array(value)}


@pytest.mark.parametrize(
    ("inputs", "error", "message"),
    [
        ({**_inputs(), **_raw("prompt", b"x")}, InvalidRequest, "exactly one of text_input, "),
        ({**_raw("prompt", b"x"), "image": np.array([_png(8, 8)], dtype=np.object_)},
         InvalidRequest, "prompt is used as it is, with no place for images"),
        (_raw("prompt", b"x" * 101), TooLarge, "prompt is 101 bytes; the limit is 100"),
        (_raw("prompt", b"\xff"), InvalidRequest, "prompt is not valid UTF-8"),
        (_raw("prompt_token_ids", [1.5, 2.0]), InvalidRequest, "must be integers"),
        (_raw("prompt_token_ids", [3, -1]), InvalidRequest, r"a negative id \(-1\)"),
        (_raw("prompt_token_ids", np.zeros(0, np.int64)), InvalidRequest, "is empty"),
    ],
    ids=["two forms", "images", "bytes", "utf-8", "floats", "negative", "empty"],
)  # fmt: skip
def test_a_raw_prompt_is_checked_at_the_edge(inputs, error, message):
    with pytest.raises(error, match=message):
        parse_front_request(inputs, LIMITS)


def test_a_raw_prompt_gets_special_tokens_unless_told_not_to_and_a_chat_only_when_asked():
    raw = parse_front_request(_raw("prompt", b"Once"), LIMITS)
    assert (raw.raw_prompt, raw.messages, raw.add_special_tokens) == ("Once", [], True)
    ids = parse_front_request(_raw("prompt_token_ids", np.array([[4, 5]], np.int32)), LIMITS)
    assert ids.raw_prompt == [4, 5] and ids.add_special_tokens
    off = {**_raw("prompt", b"Once"), "add_special_tokens": np.array([False])}
    assert not parse_front_request(off, LIMITS).add_special_tokens
    assert not parse_front_request(_inputs(), LIMITS).add_special_tokens


def test_a_raw_prompt_is_the_engines_prompt_as_it_is(hub_checkpoint):
    """No template: the text as the tokenizer tokenizes it (LLaVA's adds a BOS), token ids
    as they are once they are in the vocabulary."""
    prompts = PromptBuilder(hub_checkpoint("llava"), max_model_len=64)
    text = parse_front_request(_raw("prompt", b"Once upon a time"), LIMITS)
    expected = prompts.tokenizer("Once upon a time").input_ids
    assert prompts.prompt_now(text) == Prompt("Once upon a time", expected)
    assert expected[0] == prompts.tokenizer.bos_token_id
    ids = parse_front_request(_raw("prompt_token_ids", expected), LIMITS)
    assert prompts.prompt_now(ids).token_ids == expected
    vocab = prompts.max_token_id
    assert vocab >= len(prompts.tokenizer) - 1
    too_big = parse_front_request(_raw("prompt_token_ids", [1, vocab + 1]), LIMITS)
    with pytest.raises(InvalidRequest, match=f"holds {vocab + 1}, out of the vocabulary"):
        prompts.prompt_now(too_big)
    empty = {**_raw("prompt", b""), "add_special_tokens": np.array([False])}
    with pytest.raises(InvalidRequest, match="the prompt is empty"):
        prompts.prompt_now(parse_front_request(empty, LIMITS))


def _with_kwargs(kwargs, base=None) -> dict[str, np.ndarray]:
    raw = kwargs if isinstance(kwargs, bytes) else json.dumps(kwargs).encode()
    return {**(base or _inputs()), "chat_template_kwargs": np.array([raw], dtype=np.object_)}


@pytest.mark.parametrize(
    ("inputs", "error", "message"),
    [
        (_with_kwargs({"chat_template": "{{ 1 }}"}), InvalidRequest, "own template is used"),
        (_with_kwargs({"tokenize": True}), InvalidRequest, "chat_template_kwargs.tokenize"),
        (_with_kwargs({"tools": []}), InvalidRequest, "tool calling is not served"),
        (_with_kwargs({"add_generation_prompt": "yes"}), InvalidRequest, "true or false"),
        (
            _with_kwargs({"add_generation_prompt": True, "continue_final_message": True}),
            InvalidRequest,
            "Cannot set both",
        ),
        (_with_kwargs([1]), InvalidRequest, "must be a JSON object"),
        (_with_kwargs(b"{x"), InvalidRequest, "not valid JSON"),
        (_with_kwargs({"x": "y" * 100}), TooLarge, "chat_template_kwargs is 109 bytes"),
        (_with_kwargs({}, _raw("prompt", b"x")), InvalidRequest, "applies to a chat"),
    ],
)
def test_chat_template_kwargs_are_checked_at_the_edge(inputs, error, message):
    with pytest.raises(error, match=message):
        parse_front_request(inputs, LIMITS)


def test_the_template_gets_the_variables_it_reads_as_vllm_passes_them(hub_checkpoint, tmp_path):
    """``chat_template_kwargs`` reach the template (a model's switch, here ``greeting``),
    what it does not read is dropped as vLLM drops it, and ``continue_final_message`` ends
    the prompt inside the assistant's last turn instead of opening a new one."""
    import shutil

    model = shutil.copytree(hub_checkpoint("qwen2_vl"), tmp_path / "model")
    template = model / "chat_template.jinja"
    template.write_text("{% if greeting %}{{ greeting }}\n{% endif %}" + template.read_text())
    prompts = PromptBuilder(model, max_model_len=64)
    assert {"greeting", "add_generation_prompt"} <= prompts.template_variables
    chat = [user_turn("hi", 0)]
    plain = prompts.build_chat(chat)
    assert prompts.build_chat(chat, {"greeting": "Ahoy"}) == "Ahoy\n" + plain
    assert prompts.build_chat(chat, {"not_read": 1}) == plain
    request = parse_front_request(_with_kwargs({"greeting": "Ahoy"}), LIMITS)
    assert prompts.prompt_now(request).text == "Ahoy\n" + plain
    started = [*chat, {"role": "assistant", "content": [{"type": "text", "text": "Once upon"}]}]
    kwargs = {"add_generation_prompt": False, "continue_final_message": True}
    assert prompts.build_chat(started, kwargs).endswith("Once upon")
    assert not prompts.build_chat(started, {"add_generation_prompt": False}).endswith("Once upon")


def test_token_ids_ride_with_their_tokens_and_the_prompt_with_the_first():
    async def deltas():
        yield Delta("", 1, None, 3, None, [7], [1, 2, 3])  # a token with no text yet
        yield Delta("ab", 1, None, 3, None, [8], [1, 2, 3])
        yield Delta("c", 1, "stop", 3, None, [9], [1, 2, 3])

    outputs = ExtraOutputs(True, True, True, logprobs=False, token_ids=True)
    streamed = asyncio.run(_collect(completion_responses(deltas(), True, outputs)))
    assert [r["token_ids"].tolist() for r in streamed] == [[7], [8], [9]]
    assert ["prompt_token_ids" in r for r in streamed] == [True, False, False]
    assert tensors_delta(streamed[0]).prompt_token_ids == [1, 2, 3]
    [whole] = asyncio.run(_collect(completion_responses(deltas(), False, outputs)))
    assert whole["token_ids"].tolist() == [7, 8, 9]
    assert whole["prompt_token_ids"].tolist() == [1, 2, 3]
    plain = ExtraOutputs(True, True, True, logprobs=False, token_ids=False)
    [unasked] = asyncio.run(_collect(completion_responses(deltas(), False, plain)))
    assert "token_ids" not in unasked and "prompt_token_ids" not in unasked
    # what a caller asks for is what such responses hold: nothing an older server lacks
    assert set(outputs.names()) == set(whole) and set(plain.names()) == set(unasked)
