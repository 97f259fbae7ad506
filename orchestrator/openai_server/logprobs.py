"""The answer's log-probabilities in the OpenAI shapes ``vllm serve`` answers with: chat's
``logprobs.content`` and the completions API's four parallel lists.

The steps come from the engine that sampled the answer (``Delta.logprobs``, vLLM's order:
the sampled token first, then the likeliest others). As in vLLM, ``-inf`` is written as
-9999.0 (JSON has no infinity), a chat step lists ``top_logprobs`` alternatives and a
completions step ``logprobs`` + 1 (the OpenAI API's rule for that endpoint).
"""

from __future__ import annotations

from vllm.entrypoints.openai.chat_completion.protocol import (
    ChatCompletionLogProb,
    ChatCompletionLogProbs,
    ChatCompletionLogProbsContent,
)
from vllm.entrypoints.openai.completion.protocol import CompletionLogProbs

from orchestrator.frontend import StepLogprobs, TokenLogprob

FLOOR = -9999.0
"""What ``-inf`` becomes (OpenAI's value, and vLLM's)."""


def _token(token_id: int, candidate: TokenLogprob) -> str:
    return (
        candidate.decoded_token if candidate.decoded_token is not None else f"token_id:{token_id}"
    )


def _bytes(text: str) -> list[int]:
    return list(text.encode("utf-8", errors="replace"))


def chat_logprobs(steps: list[StepLogprobs], top: int | None) -> ChatCompletionLogProbs:
    """``logprobs`` of a chat choice (or of one chunk's tokens): each token with its
    log-probability and the ``top`` likeliest candidates at its step (-1: all returned)."""
    content = []
    for step in steps:
        token_id, sampled = next(iter(step.items()))  # the sampled token comes first
        token = _token(token_id, sampled)
        alternatives = [
            ChatCompletionLogProb(
                token=(text := _token(t, c)), logprob=max(c.logprob, FLOOR), bytes=_bytes(text)
            )
            for i, (t, c) in enumerate(step.items())
            if top == -1 or (top is not None and i < top)
        ]
        content.append(
            ChatCompletionLogProbsContent(
                token=token,
                logprob=max(sampled.logprob, FLOOR),
                bytes=None if sampled.decoded_token is None else _bytes(token),
                top_logprobs=alternatives,
            )
        )
    return ChatCompletionLogProbs(content=content)


def completion_logprobs(steps: list[StepLogprobs], top: int, offset: int = 0) -> CompletionLogProbs:
    """``logprobs`` of a completions choice (or of one chunk's tokens, its first token at
    character ``offset`` of the answer): tokens, their log-probabilities, the ``top`` + 1
    likeliest candidates at each step, and where each token starts in the text."""
    tokens, token_logprobs, alternatives, offsets = [], [], [], []
    for step in steps:
        token_id, sampled = next(iter(step.items()))  # the sampled token comes first
        token = _token(token_id, sampled)
        tokens.append(token)
        token_logprobs.append(max(sampled.logprob, FLOOR))
        alternatives.append(
            {
                _token(t, c): max(c.logprob, FLOOR)
                for i, (t, c) in enumerate(step.items())
                if top == -1 or top >= i
            }
        )
        offsets.append(offset)
        offset += len(token)
    return CompletionLogProbs(
        text_offset=offsets, token_logprobs=token_logprobs, tokens=tokens, top_logprobs=alternatives
    )
