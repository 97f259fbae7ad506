"""A chat completion request in, the ``epd`` / ``aggregated`` model's inputs out; the
model's per-step outputs back into OpenAI chat answers (whole, or as stream chunks).

What the engines cannot do is refused with a 400 naming the field, never ignored: tool
calling, beam search. ``n`` answers are ``n`` requests, as vLLM's
parallel sampling makes them; ``response_format`` is guided decoding in the engine.
"""

from __future__ import annotations

import json
from dataclasses import dataclass, field
from typing import Any

import numpy as np
from vllm.entrypoints.generate.base.protocol import DeltaMessage
from vllm.entrypoints.openai.chat_completion.protocol import (
    ChatCompletionLogProbs,
    ChatCompletionResponse,
    ChatCompletionResponseChoice,
    ChatCompletionResponseStreamChoice,
    ChatCompletionStreamResponse,
    ChatMessage,
)

from orchestrator.frontend import CHAT_ROLES, Delta, StepLogprobs
from orchestrator.openai_server.answer import Answer, sse
from orchestrator.openai_server.logprobs import chat_logprobs
from orchestrator.openai_server.media import MediaLoader
from orchestrator.openai_server.request import (
    COMMON_FIELDS,
    check_supported,
    common_refusals,
    parallel_samples,
    sampling,
)
from orchestrator.protocol import InvalidRequest, Tensors

SERVED_FIELDS = COMMON_FIELDS | {
    # the conversation and how it is rendered and tokenized
    "messages", "max_completion_tokens", "logprobs", "top_logprobs",
    # the chat template's own variables, as vLLM passes them to it
    "add_generation_prompt", "continue_final_message", "chat_template_kwargs",
    # what vllm serve without a reasoning parser or tools does not act on either
    "include_reasoning", "parallel_tool_calls",
}  # fmt: skip
"""Fields of vLLM's ``ChatCompletionRequest`` this server acts on as ``vllm serve`` does."""


def check_chat(request: Any) -> None:
    """Refuse, by name, what this server would otherwise have to ignore."""
    check_supported(
        request,
        SERVED_FIELDS,
        {
            **common_refusals(request),
            "tools": bool(request.tools) and "tool calling is not served here",
            "tool_choice": request.tool_choice not in (None, "none")
            and "tool calling is not served",
            "chat_template": request.chat_template is not None
            and "the model's own template is used",
        },
    )


DEFAULT_TEMPLATE_KWARGS = {"add_generation_prompt": True, "continue_final_message": False}


def template_kwargs(request: Any) -> dict[str, Any]:
    """The chat template's keyword arguments as vLLM's chat endpoint passes them: its two
    fields that shape the prompt's end, then the request's ``chat_template_kwargs``."""
    return {
        "add_generation_prompt": request.add_generation_prompt,
        "continue_final_message": request.continue_final_message,
        **(request.chat_template_kwargs or {}),
    }


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


async def model_inputs(request: Any, defaults: dict[str, Any], media: MediaLoader) -> list[Tensors]:
    """The Triton inputs of ``epd`` / ``aggregated`` for a chat request, one set per
    answer (``n``; each image fetched or decoded here, then checked again by the model)."""
    check_chat(request)
    chat = conversation(request)
    images = [
        await media.load(url, f"image {i + 1} of {len(chat.image_urls)}")
        for i, url in enumerate(chat.image_urls)
    ]
    asked = request.max_completion_tokens or request.max_tokens or defaults.get("max_tokens")
    options = sampling(request, asked, defaults)
    inputs: Tensors = {
        "messages": np.array([json.dumps(chat.messages).encode()], dtype=np.object_),
        "stream": np.array([True]),
        "return_finish_reason": np.array([True]),
        "return_num_input_tokens": np.array([True]),
        "return_num_output_tokens": np.array([True]),
    }
    if options.logprobs is not None:
        inputs["return_logprobs"] = np.array([True])
    if request.return_token_ids:
        inputs["return_token_ids"] = np.array([True])
    if (kwargs := template_kwargs(request)) != DEFAULT_TEMPLATE_KWARGS:
        encoded = json.dumps(kwargs).encode()
        inputs["chat_template_kwargs"] = np.array([encoded], dtype=np.object_)
    if images:
        inputs["image"] = np.array(images, dtype=np.object_)
    if request.add_special_tokens:
        inputs["add_special_tokens"] = np.array([True])
    return parallel_samples(inputs, options, request.n or 1)


@dataclass
class ChatAnswer(Answer):
    """A chat answer (``n`` choices of one conversation): ``chat.completion``, or its
    chunks."""

    chunk_type = ChatCompletionStreamResponse
    chunk_object = "chat.completion.chunk"

    def opening(self) -> list[str]:
        role = DeltaMessage(role="assistant", content="")
        chunks = []
        for i, choice in enumerate(self.choices):
            prompt = {"prompt_token_ids": choice.prompt_token_ids} if self.token_ids else {}
            chunks.append(self._chunk(i, role, {}, {**prompt, **self.choice_usage(i, 0)}))
        return chunks

    def event(self, index: int, delta: Delta) -> str | None:
        if not delta.text and not delta.num_output_tokens and delta.finish_reason is None:
            return None  # neither tokens nor text: a token with no text yet is still sent
        fields: dict[str, Any] = {"finish_reason": delta.finish_reason}
        if (logprobs := self._logprobs(delta.logprobs)) is not None:
            fields["logprobs"] = logprobs
        if self.token_ids:
            fields["token_ids"] = delta.token_ids or []
        message = DeltaMessage(content=delta.text)
        return self._chunk(index, message, fields, self.choice_usage(index))

    def _chunk(
        self, index: int, delta: DeltaMessage, fields: dict[str, Any], extra: dict[str, Any]
    ) -> str:
        """One chunk: choice ``index``'s ``delta`` and ``fields``; ``extra`` on the chunk."""
        choice = ChatCompletionResponseStreamChoice(index=index, delta=delta, **fields)
        return sse(self.stream_chunk([choice], **extra), exclude_unset=True)

    def _logprobs(self, steps: list[StepLogprobs] | None) -> ChatCompletionLogProbs | None:
        if self.top_logprobs is None:
            return None
        return chat_logprobs(steps or [], self.top_logprobs)

    def response(self) -> ChatCompletionResponse:
        choices = [
            ChatCompletionResponseChoice(
                index=i,
                message=ChatMessage(role="assistant", content="".join(answer.text)),
                logprobs=self._logprobs(answer.logprobs),
                finish_reason=answer.finish_reason or "stop",
                token_ids=answer.token_ids if self.token_ids else None,
            )
            for i, answer in enumerate(self.choices)
        ]
        return ChatCompletionResponse(
            id=self.id,
            created=self.created,
            model=self.model,
            choices=choices,
            usage=self.usage(),
            prompt_token_ids=self.choices[0].prompt_token_ids if self.token_ids else None,
        )
