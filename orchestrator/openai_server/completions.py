"""A completions request (``/v1/completions``) in, one ``epd`` / ``aggregated`` request
per answer out (``n`` per prompt); their per-step outputs back into OpenAI text
completions.

A prompt goes to the engine as it is, without the chat template, as vLLM's completions
endpoint sends it: text (tokenized with the tokenizer's special tokens unless
``add_special_tokens`` is false) or token ids, one prompt or a list of them, each its own
choice (``index``), or ``n`` choices each. What the engines cannot do is refused
with a 400 naming the field: the prompt's log-probabilities (``echo`` with ``logprobs``),
``suffix``, prompt embeddings, beam search.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

import numpy as np
from vllm.entrypoints.openai.completion.protocol import (
    CompletionResponse,
    CompletionResponseChoice,
    CompletionResponseStreamChoice,
    CompletionStreamResponse,
)

from orchestrator.frontend import Delta, RawPrompt
from orchestrator.openai_server.answer import Answer, sse
from orchestrator.openai_server.logprobs import completion_logprobs
from orchestrator.openai_server.request import (
    COMMON_FIELDS,
    check_supported,
    common_refusals,
    parallel_samples,
    sampling,
)
from orchestrator.protocol import InvalidRequest, Tensors

SERVED_FIELDS = COMMON_FIELDS | {"prompt", "echo", "logprobs"}
"""Fields of vLLM's ``CompletionRequest`` this server acts on as ``vllm serve`` does."""


def check_completion(request: Any) -> None:
    """Refuse, by name, what this server would otherwise have to ignore."""
    check_supported(
        request,
        SERVED_FIELDS,
        {
            **common_refusals(request),
            "echo": request.echo
            and request.logprobs is not None
            and "echo with logprobs needs the prompt's log-probabilities, which are not returned",
            "suffix": request.suffix is not None and "fill-in-the-middle is not served here",
            "prompt_embeds": request.prompt_embeds is not None and "not served here",
            "max_tokens": request.echo
            and request.max_tokens == 0
            and "echo without generation (max_tokens 0) is not served",
        },
    )


def prompts(request: Any) -> list[RawPrompt]:
    """The request's prompts, one per choice: text, or token ids."""
    prompt = request.prompt
    if prompt is None:
        raise InvalidRequest("prompt is required")
    if isinstance(prompt, str) or (prompt and isinstance(prompt[0], int)):
        return [prompt]
    if not prompt:
        raise InvalidRequest("prompt is empty")
    return list(prompt)


def model_inputs(request: Any, defaults: dict[str, Any]) -> list[Tensors]:
    """The Triton inputs of ``epd`` / ``aggregated``, one set per answer: ``n`` per
    prompt, prompt after prompt (choice ``index`` = prompt's index * ``n`` + answer's)."""
    check_completion(request)
    # vLLM reads a missing or null max_tokens as 16 (the completions API's default)
    options = sampling(request, request.max_tokens, defaults)
    common: Tensors = {
        "stream": np.array([True]),
        "add_special_tokens": np.array([request.add_special_tokens]),
        "return_finish_reason": np.array([True]),
        "return_num_input_tokens": np.array([True]),
        "return_num_output_tokens": np.array([True]),
    }
    if options.logprobs is not None:
        common["return_logprobs"] = np.array([True])
    if request.return_token_ids:
        common["return_token_ids"] = np.array([True])
    sets = []
    for i, prompt in enumerate(prompts(request)):
        if isinstance(prompt, str):
            inputs = {**common, "prompt": np.array([prompt.encode()], dtype=np.object_)}
        elif prompt:
            inputs = {**common, "prompt_token_ids": np.array(prompt, dtype=np.int64)}
        else:
            raise InvalidRequest(f"prompt[{i}] is empty")
        sets += parallel_samples(inputs, options, request.n or 1)
    return sets


@dataclass
class CompletionAnswer(Answer):
    """A text completion, ``per_prompt`` choices per prompt: ``text_completion``, or its
    chunks. With ``echo``, each choice's text starts with its prompt."""

    chunk_type = CompletionStreamResponse
    chunk_object = "text_completion"

    echo: list[str] = field(default_factory=list)
    """Each choice's prompt text still to send (``echo``), emptied once it is."""
    offsets: dict[int, int] = field(default_factory=dict)
    """Where each choice's next streamed token starts in its text (for ``logprobs``)."""
    prompted: set[int] = field(default_factory=set)
    """Choices whose prompt token ids were streamed (``return_token_ids``)."""

    def event(self, index: int, delta: Delta) -> str | None:
        text = self._echoed(index) + delta.text
        if not text and not delta.num_output_tokens and delta.finish_reason is None:
            return None
        extra: dict[str, Any] = {}
        if self.token_ids:
            extra["token_ids"] = delta.token_ids or []
            if index not in self.prompted:  # the choice's first chunk
                self.prompted.add(index)
                extra["prompt_token_ids"] = self.choices[index].prompt_token_ids
        if self.top_logprobs is not None:
            logprobs = completion_logprobs(
                delta.logprobs or [], self.top_logprobs, self.offsets.get(index, 0)
            )
            if logprobs.tokens:  # by the tokens reported, as vLLM advances it
                self.offsets[index] = logprobs.text_offset[-1] + len(logprobs.tokens[-1])
            extra["logprobs"] = logprobs
        choice = CompletionResponseStreamChoice(
            index=index, text=text, finish_reason=delta.finish_reason, **extra
        )
        return sse(self.stream_chunk([choice], **self.choice_usage(index)), exclude_unset=True)

    def _echoed(self, index: int) -> str:
        if not self.echo:
            return ""
        prompt, self.echo[index] = self.echo[index], ""
        return prompt

    def response(self) -> CompletionResponse:
        choices = [
            CompletionResponseChoice(
                index=i,
                text=self._echoed(i) + "".join(c.text),
                logprobs=(
                    None
                    if self.top_logprobs is None
                    else completion_logprobs(c.logprobs, self.top_logprobs)
                ),
                finish_reason=c.finish_reason or "stop",
                prompt_token_ids=c.prompt_token_ids if self.token_ids else None,
                token_ids=c.token_ids if self.token_ids else None,
            )
            for i, c in enumerate(self.choices)
        ]
        return CompletionResponse(
            id=self.id, created=self.created, model=self.model, choices=choices, usage=self.usage()
        )
