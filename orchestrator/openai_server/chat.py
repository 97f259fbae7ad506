"""A chat completion request in, the ``epd`` / ``aggregated`` model's inputs out; the
model's per-step outputs back into OpenAI answers (whole, or as stream chunks).

What the engines cannot do is refused with a 400 naming the field, never ignored:
``n`` > 1, tool calling, log-probabilities, beam search, structured output.
"""

from __future__ import annotations

import json
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import numpy as np
from vllm.entrypoints.generate.base.protocol import DeltaMessage
from vllm.entrypoints.openai.chat_completion.protocol import (
    ChatCompletionResponse,
    ChatCompletionResponseChoice,
    ChatCompletionResponseStreamChoice,
    ChatCompletionStreamResponse,
    ChatMessage,
)
from vllm.entrypoints.serve.engine.protocol import UsageInfo
from vllm.exceptions import VLLMError

from orchestrator.frontend import CHAT_ROLES, Delta
from orchestrator.openai_server.media import MediaLoader
from orchestrator.protocol import InvalidRequest, SamplingOptions

Tensors = dict[str, np.ndarray]

GENERATION_DEFAULTS = ("repetition_penalty", "temperature", "top_k", "top_p", "min_p")
"""Sampling defaults a checkpoint's ``generation_config.json`` sets, as vLLM reads them."""


def generation_defaults(model: Path) -> dict[str, Any]:
    """The checkpoint's own sampling defaults (what ``vllm serve`` applies when a request
    leaves a parameter out); ``max_new_tokens`` becomes the default ``max_tokens``."""
    path = model / "generation_config.json"
    if not path.is_file():
        return {}
    config = json.loads(path.read_text())
    defaults = {k: config[k] for k in GENERATION_DEFAULTS if config.get(k) is not None}
    if config.get("max_new_tokens"):
        defaults["max_tokens"] = config["max_new_tokens"]
    return defaults


SERVED_FIELDS = frozenset(
    {
        # the conversation and how it is rendered and tokenized
        "messages", "model", "add_generation_prompt", "add_special_tokens",
        # the answer's shape
        "stream", "stream_options", "request_id",
        # sampling: vLLM's to_sampling_params reads them; SamplingOptions carries them
        "max_tokens", "max_completion_tokens", "temperature", "top_p", "top_k", "min_p",
        "seed", "stop", "stop_token_ids", "include_stop_str_in_output", "ignore_eos",
        "min_tokens", "presence_penalty", "frequency_penalty", "repetition_penalty",
        "logit_bias", "allowed_token_ids", "bad_words", "skip_special_tokens",
        "spaces_between_special_tokens",
        # what vllm serve without a reasoning parser or tools does not act on either
        "user", "include_reasoning", "parallel_tool_calls",
    }
)  # fmt: skip
"""Fields of vLLM's ``ChatCompletionRequest`` this server acts on as ``vllm serve`` does.
Any other field a request sets to something but its default is refused by name: a new
vLLM field is refused until it is served, never silently dropped."""


def check_supported(request: Any) -> None:
    """Refuse, by name, what this server would otherwise have to ignore."""
    refusals = {
        "n": (request.n or 1) != 1 and "one answer per request (n must be 1)",
        "tools": bool(request.tools) and "tool calling is not served here",
        "tool_choice": request.tool_choice not in (None, "none") and "tool calling is not served",
        "logprobs": bool(request.logprobs) and "log-probabilities are not returned",
        "top_logprobs": bool(request.top_logprobs) and "log-probabilities are not returned",
        "prompt_logprobs": request.prompt_logprobs is not None and "not returned",
        "use_beam_search": request.use_beam_search and "beam search is not served here",
        "response_format": (
            request.response_format is not None
            and request.response_format.type != "text"
            and "structured output is not enabled in this deployment"
        ),
        "structured_outputs": request.structured_outputs is not None and "not enabled here",
        "continue_final_message": request.continue_final_message and "not supported",
        "add_generation_prompt": not request.add_generation_prompt and "must be true",
        "chat_template": request.chat_template is not None and "the model's own template is used",
    }
    for name, why in refusals.items():
        if why:
            raise InvalidRequest(f"{name}: {why}")
    fields = type(request).model_fields
    for name in sorted(request.model_fields_set - SERVED_FIELDS - refusals.keys()):
        if getattr(request, name) != fields[name].get_default(call_default_factory=True):
            raise InvalidRequest(f"{name}: not supported by this server")
    options = request.stream_options
    if options is not None and options.continuous_usage_stats:
        raise InvalidRequest("stream_options.continuous_usage_stats: not supported")


@dataclass
class Conversation:
    """The chat as the ``messages`` input takes it, and the image URLs in order."""

    messages: list[dict[str, Any]] = field(default_factory=list)
    image_urls: list[str] = field(default_factory=list)


def conversation(request: Any) -> Conversation:
    """Turns and content parts, each image where it stands among the text."""
    chat = Conversation()
    for i, turn in enumerate(request.messages):
        where = f"messages[{i}]"
        role, content = turn.get("role"), turn.get("content")
        if role == "developer":  # OpenAI's newer name for the system turn
            role = "system"
        if role not in CHAT_ROLES:
            raise InvalidRequest(f"{where}.role {role!r} is not supported; use one of {CHAT_ROLES}")
        if content is None:
            raise InvalidRequest(f"{where}.content is required")
        if isinstance(content, str):
            content = [{"type": "text", "text": content}]
        parts = []
        for j, part in enumerate(content):
            kind = part.get("type")
            if kind == "text":
                parts.append({"type": "text", "text": part.get("text") or ""})
            elif kind in ("image_url", "input_image") or (kind is None and "image_url" in part):
                url = part["image_url"]
                url = url.get("url") if isinstance(url, dict) else url
                if not isinstance(url, str):
                    raise InvalidRequest(f"{where}.content[{j}].image_url.url is required")
                parts.append({"type": "image"})
                chat.image_urls.append(url)
            else:
                raise InvalidRequest(
                    f"{where}.content[{j}] of type {kind!r} is not supported; "
                    "send 'text' and 'image_url' parts"
                )
        chat.messages.append({"role": role, "content": parts})
    return chat


def sampling(request: Any, defaults: dict[str, Any]) -> SamplingOptions:
    """vLLM's own reading of the request's sampling fields (``to_sampling_params``, with
    the checkpoint's defaults), as the engine options the models take; ``max_tokens`` is
    left to the model (``None``: what the context leaves) unless the request sets it."""
    asked = request.max_completion_tokens or request.max_tokens or defaults.get("max_tokens")
    try:
        params = request.to_sampling_params(asked or 1 << 20, defaults)
    except (ValueError, VLLMError) as exc:  # vLLM's validation errors
        raise InvalidRequest(str(exc)) from None
    fields = set(SamplingOptions.model_fields) - {"n", "max_tokens"}
    options = {name: getattr(params, name) for name in fields}
    options["stop"] = list(params.stop or [])
    options["stop_token_ids"] = list(request.stop_token_ids or [])
    try:
        return SamplingOptions.model_validate({**options, "max_tokens": asked})
    except ValueError as exc:
        raise InvalidRequest(f"sampling parameters: {exc}") from None


async def model_inputs(request: Any, defaults: dict[str, Any], media: MediaLoader) -> Tensors:
    """The Triton inputs of ``epd`` / ``aggregated`` for a chat request (each image
    fetched or decoded here, then checked again by the model)."""
    check_supported(request)
    chat = conversation(request)
    images = [
        await media.load(url, f"image {i + 1} of {len(chat.image_urls)}")
        for i, url in enumerate(chat.image_urls)
    ]
    options = sampling(request, defaults)
    inputs: Tensors = {
        "messages": np.array([json.dumps(chat.messages).encode()], dtype=np.object_),
        "sampling_parameters": np.array([options.model_dump_json().encode()], dtype=np.object_),
        "stream": np.array([True]),
        "return_finish_reason": np.array([True]),
        "return_num_input_tokens": np.array([True]),
        "return_num_output_tokens": np.array([True]),
    }
    if images:
        inputs["image"] = np.array(images, dtype=np.object_)
    if request.add_special_tokens:
        inputs["add_special_tokens"] = np.array([True])
    return inputs


@dataclass
class Answer:
    """One answer as it streams: what the client is owed at the end."""

    id: str
    model: str
    created: int = field(default_factory=lambda: int(time.time()))
    text: list[str] = field(default_factory=list)
    prompt_tokens: int = 0
    completion_tokens: int = 0
    finish_reason: str | None = None

    def add(self, delta: Delta) -> None:
        self.text.append(delta.text)
        if delta.num_input_tokens:
            self.prompt_tokens = delta.num_input_tokens
        self.completion_tokens += delta.num_output_tokens
        if delta.finish_reason is not None:
            self.finish_reason = delta.finish_reason

    def usage(self) -> UsageInfo:
        return UsageInfo(
            prompt_tokens=self.prompt_tokens,
            completion_tokens=self.completion_tokens,
            total_tokens=self.prompt_tokens + self.completion_tokens,
        )

    def response(self) -> ChatCompletionResponse:
        """The whole answer (``stream: false``)."""
        choice = ChatCompletionResponseChoice(
            index=0,
            message=ChatMessage(role="assistant", content="".join(self.text)),
            finish_reason=self.finish_reason or "stop",
        )
        return ChatCompletionResponse(
            id=self.id, created=self.created, model=self.model, choices=[choice], usage=self.usage()
        )

    def chunk(
        self, role: str | None = None, text: str | None = None, finish: str | None = None
    ) -> str:
        """One server-sent event of the stream (``stream: true``)."""
        delta = DeltaMessage(role=role, content=text) if role else DeltaMessage(content=text)
        choice = ChatCompletionResponseStreamChoice(index=0, delta=delta, finish_reason=finish)
        chunk = ChatCompletionStreamResponse(
            id=self.id,
            object="chat.completion.chunk",
            created=self.created,
            model=self.model,
            choices=[choice],
        )
        return f"data: {chunk.model_dump_json(exclude_unset=True)}\n\n"

    def usage_chunk(self) -> str:
        """The last event when ``stream_options.include_usage``: no choices, the usage."""
        chunk = ChatCompletionStreamResponse(
            id=self.id,
            object="chat.completion.chunk",
            created=self.created,
            model=self.model,
            choices=[],
            usage=self.usage(),
        )
        return f"data: {chunk.model_dump_json(exclude_unset=True, exclude_none=True)}\n\n"
