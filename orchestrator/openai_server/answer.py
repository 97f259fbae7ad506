"""An answer as it streams, for either endpoint: its choices (``n`` per prompt), the usage, and the
endpoint's own shapes (whole, or as server-sent events) in its subclass."""

from __future__ import annotations

import time
from abc import ABC, abstractmethod
from dataclasses import dataclass, field
from typing import Any, ClassVar

from vllm.entrypoints.serve.engine.protocol import UsageInfo

from orchestrator.frontend import Delta, StepLogprobs


@dataclass
class Choice:
    """One prompt's answer so far."""

    text: list[str] = field(default_factory=list)
    prompt_tokens: int = 0
    completion_tokens: int = 0
    finish_reason: str | None = None
    logprobs: list[StepLogprobs] = field(default_factory=list)
    """Each token's candidates, when the request asked for log-probabilities."""
    token_ids: list[int] = field(default_factory=list)
    prompt_token_ids: list[int] | None = None
    """The engine's prompt (when token ids were asked for)."""

    def add(self, delta: Delta) -> None:
        self.text.append(delta.text)
        self.logprobs.extend(delta.logprobs or [])
        self.token_ids.extend(delta.token_ids or [])
        if self.prompt_token_ids is None:
            self.prompt_token_ids = delta.prompt_token_ids
        if delta.num_input_tokens:
            self.prompt_tokens = delta.num_input_tokens
        self.completion_tokens += delta.num_output_tokens
        if delta.finish_reason is not None:
            self.finish_reason = delta.finish_reason


@dataclass
class Answer(ABC):
    """What the client is owed: each choice, by index."""

    chunk_type: ClassVar[type]
    """The endpoint's stream chunk model (vLLM's)."""
    chunk_object: ClassVar[str]
    """The chunks' ``object`` (set, so that it is sent)."""

    id: str
    model: str
    choices: list[Choice]
    per_prompt: int = 1
    """Choices per prompt (``n``): a prompt's tokens count once in the usage, as in vLLM."""
    continuous_usage: bool = False
    """Each chunk carries its choice's usage so far (``stream_options.include_usage`` with
    ``continuous_usage_stats``, as vLLM serves it)."""
    token_ids: bool = False
    """``return_token_ids``: the prompt's and the answer's token ids, as vLLM adds them."""
    top_logprobs: int | None = None
    """Candidates to list per token when the request asked for log-probabilities (the
    chat's ``top_logprobs``, the completions' ``logprobs``); ``None``: it did not."""
    created: int = field(default_factory=lambda: int(time.time()))

    def add(self, index: int, delta: Delta) -> None:
        self.choices[index].add(delta)

    def usage(self) -> UsageInfo:
        prompt = sum(c.prompt_tokens for c in self.choices[:: self.per_prompt])
        completion = sum(c.completion_tokens for c in self.choices)
        return UsageInfo(
            prompt_tokens=prompt, completion_tokens=completion, total_tokens=prompt + completion
        )

    def opening(self) -> list[str]:
        """The events before any text (sent once each choice's first step is in)."""
        return []

    def choice_usage(self, index: int, completion: int | None = None) -> dict[str, Any]:
        """``usage=`` for a chunk of choice ``index`` when the client asked for it in every
        chunk: its prompt's tokens and its answer's so far (or ``completion``)."""
        if not self.continuous_usage:
            return {}
        choice = self.choices[index]
        done = choice.completion_tokens if completion is None else completion
        return {
            "usage": UsageInfo(
                prompt_tokens=choice.prompt_tokens,
                completion_tokens=done,
                total_tokens=choice.prompt_tokens + done,
            )
        }

    @abstractmethod
    def event(self, index: int, delta: Delta) -> str | None:
        """The event for one step of choice ``index`` (already added); ``None`` when the
        step gives the client nothing."""

    def usage_event(self) -> str:
        """The last event when ``stream_options.include_usage``: no choices, the usage."""
        chunk = self.stream_chunk([], usage=self.usage())
        return sse(chunk, exclude_unset=True, exclude_none=True)

    def stream_chunk(self, choices: list, **extra: Any) -> Any:
        """One chunk of the stream (the endpoint's chunk model) holding ``choices``."""
        return self.chunk_type(
            id=self.id,
            object=self.chunk_object,
            created=self.created,
            model=self.model,
            choices=choices,
            **extra,
        )

    @abstractmethod
    def response(self) -> Any:
        """The whole answer (``stream: false``), a vLLM protocol model."""


def sse(model: Any, **dump: Any) -> str:
    """One server-sent event holding ``model`` as JSON."""
    return f"data: {model.model_dump_json(**dump)}\n\n"
