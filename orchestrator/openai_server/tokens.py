"""``/tokenize`` and ``/detokenize`` as ``vllm serve`` answers them: a prompt's or a chat's
token ids as the engines take them (a chat through the model's template, each image's
placeholder repeated for the image's tokens, as vLLM expands it), and token ids back to
text. Nothing here calls a model: the checkpoint's tokenizer and family answer."""

from __future__ import annotations

import asyncio
import json
from dataclasses import dataclass
from typing import Any

from vllm.entrypoints.serve.tokenize.protocol import (
    DetokenizeRequest,
    DetokenizeResponse,
    TokenizeChatRequest,
    TokenizeCompletionRequest,
    TokenizeResponse,
)

from orchestrator.config import Limits
from orchestrator.encoder.preprocess import open_image
from orchestrator.families.base import ModelFamily
from orchestrator.frontend import (
    PromptBuilder,
    bad_image,
    check_image_count,
    parse_messages,
    parse_template_kwargs,
)
from orchestrator.openai_server.chat import conversation, template_kwargs
from orchestrator.openai_server.media import MediaLoader
from orchestrator.openai_server.request import check_supported, parse_request
from orchestrator.protocol import InvalidRequest, TooLarge

SERVED_FIELDS = frozenset(
    {"model", "prompt", "messages", "add_generation_prompt", "add_special_tokens",
     "return_token_strs", "continue_final_message", "chat_template_kwargs"}
)  # fmt: skip
"""Fields of vLLM's tokenize requests this server acts on as ``vllm serve`` does."""


@dataclass
class Tokens:
    """What the two routes need: the tokenizer (with the chat template), the family (how
    many tokens an image takes, and its placeholder), the media loader, and the limits a
    request to the models is held to (a tokenize request is held to the same)."""

    prompts: PromptBuilder
    family: ModelFamily
    media: MediaLoader
    limits: Limits

    async def tokenize(self, body: Any) -> tuple[Any, list[int]]:
        """The request (vLLM's chat or prompt form) and its token ids."""
        if isinstance(body, dict) and "messages" in body:
            chat = parse_request(TokenizeChatRequest, body)
            check_supported(
                chat,
                SERVED_FIELDS,
                {
                    "chat_template": chat.chat_template is not None
                    and "the model's own template is used",
                    "tools": bool(chat.tools) and "tool calling is not served here",
                },
            )
            return chat, await self._chat_ids(chat)
        request = parse_request(TokenizeCompletionRequest, body)
        check_supported(request, SERVED_FIELDS, {})
        size, limit = len(request.prompt.encode()), self.limits.max_text_bytes
        if size > limit:
            raise TooLarge(f"prompt is {size} bytes; the limit is {limit}")
        ids = await asyncio.to_thread(
            self.prompts.tokenize, request.prompt, request.add_special_tokens
        )
        return request, ids

    async def _chat_ids(self, request: Any) -> list[int]:
        chat = conversation(request)
        # the models' own checks of a chat: turns, text size, images per request
        parse_messages(json.dumps(chat.messages).encode(), self.limits)
        check_image_count(len(chat.image_urls), self.limits)
        tokens = []
        for i, url in enumerate(chat.image_urls):
            which = f"image {i + 1} of {len(chat.image_urls)}"
            data = await self.media.load(url, which)
            try:
                size = open_image(data, self.limits.max_image_pixels).size
                tokens.append(self.family.image_layout(*size).tokens)
            except ValueError as exc:
                raise bad_image(which, exc) from None
        kwargs = template_kwargs(request)
        parse_template_kwargs(json.dumps(kwargs).encode(), self.limits)  # the models' checks
        rendered = await asyncio.to_thread(
            self.prompts.render_now, chat.messages, request.add_special_tokens, kwargs
        )
        return expand_images(rendered.token_ids, self.family.image_token_id, tokens)

    def response(self, ids: list[int], max_model_len: int, strings: bool) -> TokenizeResponse:
        token_strs = self.prompts.tokenizer.convert_ids_to_tokens(ids) if strings else None
        return TokenizeResponse(
            count=len(ids), max_model_len=max_model_len, tokens=ids, token_strs=token_strs
        )

    def detokenize(self, request: DetokenizeRequest) -> DetokenizeResponse:
        if request.tokens and max(request.tokens) > self.prompts.max_token_id:
            raise InvalidRequest(
                f"tokens holds {max(request.tokens)}, out of the vocabulary "
                f"(its largest id is {self.prompts.max_token_id})"
            )
        return DetokenizeResponse(prompt=self.prompts.tokenizer.decode(request.tokens))


def expand_images(ids: list[int], placeholder: int, tokens: list[int]) -> list[int]:
    """``ids`` with the ``i``-th ``placeholder`` repeated ``tokens[i]`` times."""
    if ids.count(placeholder) != len(tokens):
        raise InvalidRequest(
            f"the chat's text holds the image placeholder itself: {ids.count(placeholder)} "
            f"placeholders for {len(tokens)} image(s)"
        )
    out: list[int] = []
    images = iter(tokens)
    for token in ids:
        out.extend([token] * next(images) if token == placeholder else [token])
    return out
