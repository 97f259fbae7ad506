"""The public request interface shared by ``epd`` and ``aggregated``.

Inputs follow Triton's vllm_backend conventions: ``text_input`` BYTES [1], ``image`` BYTES
[-1] (encoded images, raw or base64), ``sampling_parameters`` BYTES [1] (JSON), ``stream``
BOOL [1], and the optional outputs it offers (``return_finish_reason``,
``return_num_input_tokens``, ``return_num_output_tokens``, ``return_logprobs`` BOOL [1] ask
for ``finish_reason``, ``num_input_tokens``, ``num_output_tokens``, ``logprobs``: JSON, per
token the candidates ``sampling_parameters.logprobs`` asks for); output ``text_output``
BYTES [1]. Instead of ``text_input`` a request may send ``messages`` BYTES [1]: a chat as
JSON (roles and content parts, ``{"type": "image"}`` where each ``image`` goes), which is
what the OpenAI chat API sends; or a prompt used as it is, without the chat template (what
the OpenAI completions API sends): ``prompt`` BYTES [1], or ``prompt_token_ids`` INT [-1].
Everything here is validated before any stage does work, so bad input costs nothing and
gets a message naming the problem.
"""

from __future__ import annotations

import asyncio
import concurrent.futures
import functools
import json
from collections.abc import AsyncIterator
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import numpy as np

from orchestrator.config import Limits, Topology
from orchestrator.encoder.preprocess import ImageTooLarge, open_image
from orchestrator.llm import LLMRole, engine_args
from orchestrator.protocol import (
    DecodeRequest,
    InvalidRequest,
    LastResponse,
    PrefillDecodeRequest,
    SamplingOptions,
    Tensors,
    TooLarge,
)

CHAT_ROLES = ("system", "user", "assistant")
"""Roles a ``messages`` turn may have (tool turns need tool calling, which is not served)."""


@dataclass(frozen=True)
class ExtraOutputs:
    """Which of vllm_backend's optional outputs the client asked for."""

    finish_reason: bool = False
    num_input_tokens: bool = False
    num_output_tokens: bool = False
    logprobs: bool = False
    token_ids: bool = False
    """``return_token_ids`` (vLLM's OpenAI extension of that name, not vllm_backend's): the
    answer's ``token_ids`` in every response, the engine's ``prompt_token_ids`` (images'
    placeholders expanded) in the first."""

    @classmethod
    def asked_by(cls, inputs: Tensors) -> ExtraOutputs:
        """The ``return_*`` flags of a request's inputs."""
        return cls(*(_flag(inputs, f"return_{name}") for name in cls.__dataclass_fields__))

    @classmethod
    def of_stage(cls, request: PrefillDecodeRequest | DecodeRequest) -> ExtraOutputs:
        """What an engine stage answers its caller (and the caller asks of it): the token
        counts and finish reason always, ``logprobs`` when the request's sampling asks vLLM
        for them, token ids when the client asked for them (a tensor less per token
        otherwise)."""
        logprobs = request.sampling.logprobs is not None
        return cls(True, True, True, logprobs, request.return_token_ids)

    def names(self) -> list[str]:
        """The outputs a response of ``delta_tensors`` with these holds, which is what a
        caller asks for: only those wanted, so a server of an older release that does not
        declare a newer output still answers every request that does not want it."""
        names = ["text_output"]
        names += [n for n in ("finish_reason", "num_input_tokens", "num_output_tokens",
                              "logprobs") if getattr(self, n)]  # fmt: skip
        return names + ["token_ids", "prompt_token_ids"] * self.token_ids


RawPrompt = str | list[int]
"""A prompt used as it is, without the chat template: text, or token ids."""


@dataclass(frozen=True)
class FrontRequest:
    messages: list[dict[str, Any]]
    """The chat in the form chat templates take: ``{"role", "content": [parts]}``, parts
    ``{"type": "text", "text"}`` or ``{"type": "image"}`` (``text_input`` becomes one user
    turn with its images first); empty when the request sent a ``raw_prompt``."""
    images: list[bytes]
    sampling: SamplingOptions
    stream: bool
    outputs: ExtraOutputs = ExtraOutputs()
    add_special_tokens: bool = False
    """The optional ``add_special_tokens`` input (vLLM's field of that name): add the
    tokenizer's special tokens (a BOS) to the prompt. Off by default for a chat (on top of
    its template's), on for a raw prompt, as in vLLM's chat and completions endpoints."""
    raw_prompt: RawPrompt | None = None
    """The ``prompt`` or ``prompt_token_ids`` input: the engine's prompt, no template."""
    template_kwargs: dict[str, Any] = field(default_factory=dict)
    """The ``chat_template_kwargs`` input: the chat template's own variables
    (``add_generation_prompt``, ``continue_final_message``, a model's switches), as
    vLLM's chat endpoint passes them; ``PromptBuilder`` keeps what the template reads."""
    text_bytes: int = 0
    """Bytes of the prompt's text as sent (messages or raw prompt, template variables): what
    the template and the tokenizer work through."""


REFUSED_TEMPLATE_KWARGS = {
    "chat_template": "the model's own template is used",
    "tokenize": "the prompt is tokenized by the server",
    "tools": "tool calling is not served here",
    "documents": "not served here",
    "messages": "send the chat as messages",
    "conversation": "send the chat as messages",
}
"""``chat_template_kwargs`` that would change what the server renders rather than how."""


def parse_template_kwargs(raw: bytes, limits: Limits) -> dict[str, Any]:
    """The ``chat_template_kwargs`` input (a JSON object), checked at the edge."""
    if len(raw) > limits.max_text_bytes:
        raise TooLarge(
            f"chat_template_kwargs is {len(raw)} bytes; the limit is {limits.max_text_bytes}"
        )
    try:
        kwargs = json.loads(_text(raw, "chat_template_kwargs"))
    except json.JSONDecodeError as exc:
        raise InvalidRequest(f"chat_template_kwargs is not valid JSON: {exc}") from None
    if not isinstance(kwargs, dict):
        raise InvalidRequest("chat_template_kwargs must be a JSON object")
    for name, why in REFUSED_TEMPLATE_KWARGS.items():
        if name in kwargs:
            raise InvalidRequest(f"chat_template_kwargs.{name}: {why}")
    for name in ("add_generation_prompt", "continue_final_message"):
        if not isinstance(kwargs.get(name, False), bool):
            raise InvalidRequest(f"chat_template_kwargs.{name} must be true or false")
    if kwargs.get("add_generation_prompt") and kwargs.get("continue_final_message"):
        raise InvalidRequest(
            "Cannot set both `continue_final_message` and `add_generation_prompt` to True."
        )
    return kwargs


PROMPT_FORMS = ("text_input", "messages", "prompt", "prompt_token_ids")
"""The inputs a request states its prompt with: exactly one of them."""


def bad_image(which: str, exc: ValueError) -> InvalidRequest:
    """The client error for an image that failed to open or decode, naming it."""
    kind = TooLarge if isinstance(exc, ImageTooLarge) else InvalidRequest
    return kind(f"{which}: {exc}" if which else str(exc))


def _scalar_bytes(inputs: Tensors, name: str) -> bytes | None:
    if name not in inputs:
        return None
    values = inputs[name].reshape(-1)
    if values.size != 1:
        raise InvalidRequest(f"{name} must hold exactly one element, got {values.size}")
    value = values[0]
    return value if isinstance(value, bytes) else str(value).encode()


def _flag(inputs: Tensors, name: str, default: bool = False) -> bool:
    if name not in inputs:
        return default
    flags = inputs[name].reshape(-1)
    if flags.size != 1:
        raise InvalidRequest(f"{name} must hold exactly one element")
    return bool(flags[0])


def _text(raw: bytes, name: str) -> str:
    try:
        return raw.decode("utf-8")
    except UnicodeDecodeError:
        raise InvalidRequest(f"{name} is not valid UTF-8") from None


def parse_messages(raw: bytes, limits: Limits) -> tuple[list[dict[str, Any]], int, int]:
    """The ``messages`` input as chat-template turns, the number of image parts in it and
    its text's size in bytes; ``InvalidRequest`` naming the turn and part at fault."""
    try:
        turns = json.loads(_text(raw, "messages"))
    except json.JSONDecodeError as exc:
        raise InvalidRequest(f"messages is not valid JSON: {exc}") from None
    if not isinstance(turns, list) or not turns:
        raise InvalidRequest("messages must be a non-empty JSON list of turns")
    if len(turns) > limits.max_messages:
        raise TooLarge(f"{len(turns)} messages; this deployment accepts {limits.max_messages}")
    messages, images, text_bytes = [], 0, 0
    for i, turn in enumerate(turns):
        where = f"messages[{i}]"
        if not isinstance(turn, dict):
            raise InvalidRequest(f"{where} must be an object with role and content")
        role, content = turn.get("role"), turn.get("content")
        if role not in CHAT_ROLES:
            raise InvalidRequest(f"{where}.role is {role!r}; supported roles: {CHAT_ROLES}")
        if isinstance(content, str):
            content = [{"type": "text", "text": content}]
        if not isinstance(content, list):
            raise InvalidRequest(f"{where}.content must be a string or a list of parts")
        parts = []
        for j, part in enumerate(content):
            kind = part.get("type") if isinstance(part, dict) else None
            if kind == "text" and isinstance(part.get("text"), str):
                parts.append({"type": "text", "text": part["text"]})
                text_bytes += len(part["text"].encode("utf-8"))
            elif kind == "image":
                parts.append({"type": "image"})
                images += 1
            else:
                raise InvalidRequest(
                    f"{where}.content[{j}] must be {{'type': 'text', 'text': str}} or "
                    "{'type': 'image'} (the image itself goes in the image input)"
                )
        messages.append({"role": role, "content": parts})
    if text_bytes > limits.max_text_bytes:
        raise TooLarge(
            f"messages hold {text_bytes} bytes of text; the limit is {limits.max_text_bytes}"
        )
    return messages, images, text_bytes


def parse_front_request(inputs: Tensors, limits: Limits) -> FrontRequest:
    """Validate the public inputs; raise ``InvalidRequest`` naming what is wrong."""
    sent = [name for name in PROMPT_FORMS if name in inputs]
    if len(sent) != 1:
        raise InvalidRequest(
            f"send exactly one of {', '.join(PROMPT_FORMS)} (got {', '.join(sent) or 'none'})"
        )
    raw_text = _scalar_bytes(inputs, "text_input")
    raw_messages = _scalar_bytes(inputs, "messages")
    items = inputs["image"].reshape(-1) if "image" in inputs else []
    raw_prompt = None
    messages: list[dict[str, Any]] = []
    if sent[0] in ("prompt", "prompt_token_ids"):
        if len(items):
            raise InvalidRequest(
                f"{sent[0]} is used as it is, with no place for images: send images with "
                "messages or text_input, whose chat template places them"
            )
        raw_prompt, text_bytes = parse_raw_prompt(inputs, limits)
    elif raw_messages is not None:
        messages, placed, text_bytes = parse_messages(raw_messages, limits)
        if placed != len(items):
            raise InvalidRequest(
                f"messages place {placed} image(s) but {len(items)} image input(s) were sent"
            )
    else:
        assert raw_text is not None
        text = _text(raw_text, "text_input")
        if not text.strip():
            raise InvalidRequest("text_input is empty")
        text_bytes = len(raw_text)
        if text_bytes > limits.max_text_bytes:
            raise TooLarge(
                f"text_input is {text_bytes} bytes; the limit is {limits.max_text_bytes}"
            )
        messages = [user_turn(text, len(items))]

    check_image_count(len(items), limits)
    template_kwargs: dict[str, Any] = {}
    if (raw_kwargs := _scalar_bytes(inputs, "chat_template_kwargs")) is not None:
        if raw_prompt is not None:
            raise InvalidRequest(
                f"chat_template_kwargs applies to a chat; {sent[0]} is used as it is"
            )
        template_kwargs = parse_template_kwargs(raw_kwargs, limits)
        text_bytes += len(raw_kwargs)
    raw_sampling = _scalar_bytes(inputs, "sampling_parameters")
    if raw_sampling is not None and len(raw_sampling) > limits.max_text_bytes:
        # user text too: stop strings, bad words, a grammar or JSON schema to compile
        raise TooLarge(
            f"sampling_parameters is {len(raw_sampling)} bytes; the limit is "
            f"{limits.max_text_bytes}"
        )
    images: list[bytes] = []
    total = text_bytes + len(raw_sampling or b"")
    for i, item in enumerate(items):
        which = f"image {i + 1} of {len(items)}"
        data = item if isinstance(item, bytes) else str(item).encode()
        if not data:
            raise InvalidRequest(f"{which} is empty")
        if len(data) > limits.max_image_bytes:
            raise TooLarge(f"{which} is {len(data)} bytes; the limit is {limits.max_image_bytes}")
        total += len(data)
        if total > limits.max_request_bytes:
            raise TooLarge(
                f"request is over {limits.max_request_bytes} bytes at {which} "
                "(text and images together)"
            )
        try:
            open_image(data, limits.max_image_pixels)  # header only: format and size
        except ValueError as exc:
            raise bad_image(which, exc) from None
        images.append(data)

    sampling = SamplingOptions.parse(raw_sampling)
    outputs = ExtraOutputs.asked_by(inputs)
    return FrontRequest(
        messages,
        images,
        sampling,
        _flag(inputs, "stream"),
        outputs,
        _flag(inputs, "add_special_tokens", default=raw_prompt is not None),
        raw_prompt,
        template_kwargs,
        text_bytes,
    )


def check_image_count(count: int, limits: Limits) -> None:
    """``TooLarge`` past the deployment's images per request."""
    if count > limits.max_images_per_request:
        raise TooLarge(
            f"{count} images sent; this deployment accepts at most "
            f"{limits.max_images_per_request} per request"
        )


def parse_raw_prompt(inputs: Tensors, limits: Limits) -> tuple[RawPrompt, int]:
    """The ``prompt`` (text) or ``prompt_token_ids`` input, and its size in bytes."""
    raw = _scalar_bytes(inputs, "prompt")
    if raw is not None:
        if len(raw) > limits.max_text_bytes:
            raise TooLarge(f"prompt is {len(raw)} bytes; the limit is {limits.max_text_bytes}")
        return _text(raw, "prompt"), len(raw)
    ids = inputs["prompt_token_ids"].reshape(-1)
    if ids.dtype.kind not in "iu":
        raise InvalidRequest(f"prompt_token_ids must be integers, got {ids.dtype}")
    if not ids.size:
        raise InvalidRequest("prompt_token_ids is empty")
    if ids.min() < 0:
        raise InvalidRequest(f"prompt_token_ids holds a negative id ({ids.min()})")
    return ids.tolist(), ids.nbytes


def user_turn(text: str, num_images: int) -> dict[str, Any]:
    """One user turn: the images, then the text (``text_input``'s shape)."""
    content = [{"type": "image"} for _ in range(num_images)] + [{"type": "text", "text": text}]
    return {"role": "user", "content": content}


def context_length(topology: Topology, roles: tuple[LLMRole, ...]) -> int:
    """The context of requests served by the engines of ``roles``: the smallest
    ``max_model_len`` among those engines' servers."""
    return min(
        int(engine_args(topology, server, role)["max_model_len"])
        for role in roles
        for server in topology.servers_of(role)
    )


@dataclass(frozen=True)
class Prompt:
    """A chat rendered by the model's template: its text, and its tokens as every engine of
    the request takes them (each image's placeholder one token, expanded by vLLM)."""

    text: str
    """The prompt's text ("" for a prompt sent as token ids)."""
    token_ids: list[int]

    @property
    def text_tokens(self) -> int:
        return len(self.token_ids)

    def length(self, image_tokens: list[int]) -> int:
        """Tokens the engine computes once each image's placeholder expands to its
        ``image_tokens`` (every family's template writes one placeholder per image)."""
        return self.text_tokens - len(image_tokens) + sum(image_tokens)


SHORT_PROMPT_BYTES = 4096
"""Up to this much text a prompt is rendered on the caller's loop: the template and the
tokenizer take 0.1-1.2 ms on 200 B-4 KiB, less than the hop to the builder's thread and
back costs a busy loop (the render's p90 3.9 -> 0.6 ms, ``docs/benchmarks.md``). A longer
one is rendered on the thread, where a 1 MiB prompt cannot hold up other streams."""


class PromptBuilder:
    """Applies the model's own chat template with one image slot per image."""

    def __init__(self, model_dir: Path, max_model_len: int) -> None:
        from transformers import AutoConfig, AutoTokenizer

        self.tokenizer = AutoTokenizer.from_pretrained(str(model_dir))
        self._backend = getattr(self.tokenizer, "backend_tokenizer", None)
        """A fast tokenizer's own (``tokenize`` calls it directly)."""
        if self._backend is not None:
            # A tokenizer.json may ask to truncate or pad, which HF's own calls switch off
            # and a too-long prompt must not meet (it is refused, never served cut).
            self._backend.no_truncation()
            self._backend.no_padding()
        self.max_model_len = max_model_len
        vocab = AutoConfig.from_pretrained(str(model_dir)).get_text_config().vocab_size
        self.max_token_id = max(max(self.tokenizer.get_vocab().values()), vocab - 1)
        """The largest id a token-id prompt may hold: the tokenizer's or the model's, as
        vLLM checks (either may have ids the other lacks)."""
        # One thread of its own, as vLLM's server tokenizes: a long prompt takes a second
        # (1 MiB of text), which on the event loop stalled every other request's stream.
        self._thread = concurrent.futures.ThreadPoolExecutor(1, thread_name_prefix="prompt")

    @classmethod
    def for_topology(cls, topology: Topology, roles: tuple[LLMRole, ...]) -> PromptBuilder:
        """The builder for requests served by the engines of ``roles``."""
        return cls(topology.model, max_model_len=context_length(topology, roles))

    def build(self, text: str, num_images: int) -> str:
        """The prompt of one user turn with ``num_images`` images before its text."""
        return self.build_chat([user_turn(text, num_images)])

    def build_chat(
        self, messages: list[dict[str, Any]], template_kwargs: dict[str, Any] | None = None
    ) -> str:
        """The prompt of a conversation, each image where its part stands, ready for the
        assistant's answer unless ``template_kwargs`` say otherwise (as vLLM's chat endpoint
        renders it: of those, what the template reads, the rest dropped as vLLM drops it)."""
        kwargs = {"add_generation_prompt": True, **(template_kwargs or {})}
        kwargs = {k: v for k, v in kwargs.items() if k in self.template_variables}
        try:
            return self.tokenizer.apply_chat_template(messages, tokenize=False, **kwargs)
        except Exception as exc:  # noqa: BLE001 - the template's own complaint (jinja)
            raise InvalidRequest(f"the model's chat template refused the messages: {exc}") from None

    @functools.cached_property
    def template_variables(self) -> frozenset[str]:
        """Keyword arguments the chat template can take: the variables it reads, and HF's
        own two that shape the end of the prompt."""
        import jinja2
        from jinja2 import meta

        template = self.tokenizer.chat_template
        if isinstance(template, dict):  # named templates: HF renders the default one
            template = template.get("default", "")
        read = meta.find_undeclared_variables(jinja2.Environment().parse(template or ""))
        shaping = {"add_generation_prompt", "continue_final_message"}
        return frozenset((read | shaping) - REFUSED_TEMPLATE_KWARGS.keys())

    def render_now(
        self,
        messages: list[dict[str, Any]],
        add_special_tokens: bool = False,
        template_kwargs: dict[str, Any] | None = None,
    ) -> Prompt:
        """The conversation's prompt, tokenized as vLLM's chat endpoint tokenizes it: with
        the tokenizer's special tokens on top of the template's only if asked."""
        text = self.build_chat(messages, template_kwargs)
        return Prompt(text, self.tokenize(text, add_special_tokens))

    def prompt_now(self, request: FrontRequest) -> Prompt:
        """The request's prompt: its chat through the template, or its raw prompt as it
        is (text tokenized, token ids checked against the vocabulary)."""
        raw = request.raw_prompt
        if raw is None:
            return self.render_now(
                request.messages, request.add_special_tokens, request.template_kwargs
            )
        if isinstance(raw, str):
            prompt = Prompt(raw, self.tokenize(raw, request.add_special_tokens))
        else:
            if max(raw) > self.max_token_id:
                raise InvalidRequest(
                    f"prompt_token_ids holds {max(raw)}, out of the vocabulary "
                    f"(its largest id is {self.max_token_id})"
                )
            prompt = Prompt("", raw)
        if not prompt.token_ids:
            raise InvalidRequest("the prompt is empty")
        return prompt

    async def render(self, request: FrontRequest) -> Prompt:
        """``prompt_now``: on the caller's event loop for a short prompt, else on the
        builder's own thread (``SHORT_PROMPT_BYTES``)."""
        if request.text_bytes <= SHORT_PROMPT_BYTES:
            return self.prompt_now(request)
        loop = asyncio.get_running_loop()
        return await loop.run_in_executor(self._thread, self.prompt_now, request)

    def tokenize(self, text: str, add_special_tokens: bool) -> list[int]:
        """``text``'s token ids. A fast tokenizer tokenizes through its batch call, which
        releases the GIL while it works (its single ``encode`` does not), in the variant
        without character offsets: 2.6x faster on 1 MiB of text, and its result is freed
        in 1 ms where the full one held the GIL for 100 ms."""
        if self._backend is not None:
            (encoding,) = self._backend.encode_batch_fast(
                [text], add_special_tokens=add_special_tokens
            )
            return encoding.ids
        return self.tokenizer(text, add_special_tokens=add_special_tokens).input_ids

    def fit(
        self, prompt: Prompt, image_tokens: list[int], sampling: SamplingOptions
    ) -> tuple[int, SamplingOptions]:
        """Prompt length once each image's placeholder expands to its ``image_tokens``, and
        ``sampling`` with ``max_tokens`` settled (``None``: what the context leaves, as
        vLLM's OpenAI server does); ``InvalidRequest`` if it cannot fit. Every family's
        template writes one placeholder token per image, so with no ``image_tokens`` given
        this is a lower bound: what does not fit then never will."""
        total = prompt.length(image_tokens)
        max_tokens = sampling.max_tokens
        if total >= self.max_model_len or total + (max_tokens or 0) > self.max_model_len:
            asked = f" + max_tokens ({max_tokens})" if max_tokens else ""
            raise InvalidRequest(
                f"prompt ({total} tokens){asked} exceeds the model's context of "
                f"{self.max_model_len} tokens"
            )
        if max_tokens is None:
            sampling = sampling.model_copy(update={"max_tokens": self.max_model_len - total})
        return total, sampling


@dataclass(frozen=True)
class TokenLogprob:
    """One candidate token at one step of the answer (vLLM's ``Logprob``)."""

    logprob: float
    rank: int | None
    """Its rank in the vocabulary at that step (1: the likeliest)."""
    decoded_token: str | None


StepLogprobs = dict[int, TokenLogprob]
"""One step's candidates by token id, in vLLM's order: the sampled token first, then the
likeliest ``logprobs`` tokens (the sampled one not twice)."""


@dataclass(frozen=True)
class Delta:
    """What one step of generation adds: text, how many tokens it took, and how the
    answer ended once it has."""

    text: str
    num_output_tokens: int
    finish_reason: str | None = None
    num_input_tokens: int | None = None
    logprobs: list[StepLogprobs] | None = None
    """One entry per token of the step, when the request asked for log-probabilities."""
    token_ids: list[int] | None = None
    """The step's tokens, where they were asked for (``return_token_ids``)."""
    prompt_token_ids: list[int] | None = None
    """The engine's prompt (each image's placeholder expanded), in an answer's first step
    when token ids were asked for."""


async def deltas_of(outputs: AsyncIterator[Any]) -> AsyncIterator[Delta]:
    """``Delta``s of vLLM ``RequestOutput``s streamed with ``RequestOutputKind.DELTA`` (the
    prompt's ids in the first only)."""
    first = True
    async for out in outputs:
        answer = out.outputs[0]
        prompt = out.prompt_token_ids
        steps = None
        if answer.logprobs is not None:
            steps = [
                {t: TokenLogprob(p.logprob, p.rank, p.decoded_token) for t, p in step.items()}
                for step in answer.logprobs
            ]
        yield Delta(
            answer.text,
            len(answer.token_ids),
            answer.finish_reason,
            len(prompt) if prompt is not None else None,
            steps,
            list(answer.token_ids),
            None if prompt is None or not first else list(prompt),
        )
        first = False


def _logprobs_json(steps: list[StepLogprobs] | None) -> bytes:
    """vllm_backend's ``logprobs`` output: per token ``{token id: {logprob, rank,
    decoded_token}}``, ``null`` when the request's sampling asked for none."""
    if steps is None:
        return b"null"
    return json.dumps(
        [{str(t): vars(p) for t, p in step.items()} for step in steps], ensure_ascii=False
    ).encode()


def _steps_of(raw: bytes) -> list[StepLogprobs] | None:
    steps = json.loads(raw)
    if steps is None:
        return None
    return [{int(t): TokenLogprob(**p) for t, p in step.items()} for step in steps]


def delta_tensors(delta: Delta, outputs: ExtraOutputs) -> Tensors:
    """One response: ``text_output`` and the optional outputs asked for, as vllm_backend
    fills them (``finish_reason`` is the string ``None`` until the last response)."""
    tensors = {"text_output": np.array([delta.text.encode("utf-8")], dtype=np.object_)}
    if outputs.finish_reason:
        tensors["finish_reason"] = np.array([str(delta.finish_reason).encode()], dtype=np.object_)
    if outputs.num_input_tokens:
        tensors["num_input_tokens"] = np.array([delta.num_input_tokens or 0], dtype=np.uint32)
    if outputs.num_output_tokens:
        tensors["num_output_tokens"] = np.array([delta.num_output_tokens], dtype=np.uint32)
    if outputs.logprobs:
        tensors["logprobs"] = np.array([_logprobs_json(delta.logprobs)], dtype=np.object_)
    if outputs.token_ids:
        tensors["token_ids"] = np.array(delta.token_ids or [], dtype=np.int64)
        if delta.prompt_token_ids is not None:
            tensors["prompt_token_ids"] = np.array(delta.prompt_token_ids, dtype=np.int64)
    return tensors


def tensors_delta(tensors: Tensors) -> Delta:
    """The ``Delta`` of a response made by ``delta_tensors`` with every output."""
    reason = tensors["finish_reason"].reshape(-1)[0].decode()
    logprobs = tensors.get("logprobs")
    tokens, prompt = tensors.get("token_ids"), tensors.get("prompt_token_ids")
    return Delta(
        text=tensors["text_output"].reshape(-1)[0].decode("utf-8"),
        num_output_tokens=int(tensors["num_output_tokens"].reshape(-1)[0]),
        finish_reason=None if reason == "None" else reason,
        num_input_tokens=int(tensors["num_input_tokens"].reshape(-1)[0]),
        logprobs=None if logprobs is None else _steps_of(logprobs.reshape(-1)[0]),
        token_ids=None if tokens is None else tokens.reshape(-1).tolist(),
        prompt_token_ids=None if prompt is None else prompt.reshape(-1).tolist(),
    )


async def completion_responses(
    deltas: AsyncIterator[Delta], stream: bool, outputs: ExtraOutputs
) -> AsyncIterator[Tensors]:
    """When streaming, one response per step that adds tokens or ends the answer, as
    vllm_backend and ``vllm serve`` stream: a token whose text is not out yet (the first
    byte of a character) goes out with empty text, not held back a step (token counts are
    per response); else one response with the whole answer."""
    text: list[str] = []
    tokens, prompt, reason = 0, None, None
    # of the tokens not sent yet: their candidates, their ids; the prompt's, until sent
    steps: list[StepLogprobs] | None = None
    ids: list[int] = []
    prompt_ids: list[int] | None = None
    sent = False
    async for delta in deltas:
        tokens += delta.num_output_tokens
        prompt = prompt if delta.num_input_tokens is None else delta.num_input_tokens
        reason = delta.finish_reason
        if delta.logprobs is not None:
            steps = (steps or []) + delta.logprobs
        ids += delta.token_ids or []
        if not sent and prompt_ids is None:
            prompt_ids = delta.prompt_token_ids
        if not stream:
            text.append(delta.text)
        elif reason is not None or delta.text or tokens:  # the finishing output is last
            response = Delta(delta.text, tokens, reason, prompt, steps, ids, prompt_ids)
            tensors = delta_tensors(response, outputs)
            yield LastResponse(tensors) if reason is not None else tensors
            tokens, steps, ids = 0, None if steps is None else [], []
            prompt_ids, sent = None, True
    if not stream:
        whole = Delta("".join(text), tokens, reason, prompt, steps, ids, prompt_ids)
        yield LastResponse(delta_tensors(whole, outputs))
