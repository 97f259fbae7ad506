"""The public request interface shared by ``epd`` and ``aggregated``.

Inputs follow Triton's vllm_backend conventions: ``text_input`` BYTES [1], ``image`` BYTES
[-1] (encoded images, raw or base64), ``sampling_parameters`` BYTES [1] (JSON), ``stream``
BOOL [1]; output ``text_output`` BYTES [1]. Everything here is validated before any stage
does work, so bad input costs nothing and gets a message naming the problem.
"""

from __future__ import annotations

from collections.abc import AsyncIterator
from dataclasses import dataclass
from pathlib import Path

import numpy as np

from orchestrator.config import Limits, Topology
from orchestrator.encoder.preprocess import ImageTooLarge, open_image
from orchestrator.llm import LLMRole, engine_args
from orchestrator.protocol import InvalidRequest, SamplingOptions, TooLarge

Tensors = dict[str, np.ndarray]


@dataclass(frozen=True)
class FrontRequest:
    text: str
    images: list[bytes]
    sampling: SamplingOptions
    stream: bool


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


def parse_front_request(inputs: Tensors, limits: Limits) -> FrontRequest:
    """Validate the public inputs; raise ``InvalidRequest`` naming what is wrong."""
    raw_text = _scalar_bytes(inputs, "text_input")
    if raw_text is None:
        raise InvalidRequest("text_input is required")
    try:
        text = raw_text.decode("utf-8")
    except UnicodeDecodeError:
        raise InvalidRequest("text_input is not valid UTF-8") from None
    if not text.strip():
        raise InvalidRequest("text_input is empty")
    if len(raw_text) > limits.max_text_bytes:
        raise TooLarge(f"text_input is {len(raw_text)} bytes; the limit is {limits.max_text_bytes}")

    items = inputs["image"].reshape(-1) if "image" in inputs else []
    if len(items) > limits.max_images_per_request:
        raise TooLarge(
            f"{len(items)} images sent; this deployment accepts at most "
            f"{limits.max_images_per_request} per request"
        )
    images: list[bytes] = []
    total = len(raw_text)
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

    sampling = SamplingOptions.parse(_scalar_bytes(inputs, "sampling_parameters"))
    stream = False
    if "stream" in inputs:
        flags = inputs["stream"].reshape(-1)
        if flags.size != 1:
            raise InvalidRequest("stream must hold exactly one element")
        stream = bool(flags[0])
    return FrontRequest(text=text, images=images, sampling=sampling, stream=stream)


class PromptBuilder:
    """Applies the model's own chat template with one image slot per image."""

    def __init__(self, model_dir: Path, max_model_len: int) -> None:
        from transformers import AutoTokenizer

        self.tokenizer = AutoTokenizer.from_pretrained(str(model_dir))
        self.max_model_len = max_model_len

    @classmethod
    def for_topology(cls, topology: Topology, roles: tuple[LLMRole, ...]) -> PromptBuilder:
        """The builder for requests served by the engines of ``roles``: their context is the
        smallest ``max_model_len`` among those engines' servers."""
        max_model_len = min(
            int(engine_args(topology, server, role)["max_model_len"])
            for role in roles
            for server in topology.servers_of(role)
        )
        return cls(topology.model, max_model_len=max_model_len)

    def build(self, text: str, num_images: int) -> str:
        content = [{"type": "image"} for _ in range(num_images)] + [{"type": "text", "text": text}]
        return self.tokenizer.apply_chat_template(
            [{"role": "user", "content": content}], tokenize=False, add_generation_prompt=True
        )

    def check_budget(self, prompt: str, image_tokens: list[int], max_tokens: int) -> int:
        """Prompt length once each image's placeholder expands to its ``image_tokens``;
        ``InvalidRequest`` if it cannot fit. Every family's template writes one placeholder
        token per image; special tokens are added as vLLM adds them to a text prompt."""
        text_tokens = len(self.tokenizer(prompt).input_ids)
        total = text_tokens - len(image_tokens) + sum(image_tokens)
        if total + max_tokens > self.max_model_len:
            raise InvalidRequest(
                f"prompt ({total} tokens) + max_tokens ({max_tokens}) exceeds the model's "
                f"context of {self.max_model_len} tokens"
            )
        return total


def text_tensor(text: str) -> Tensors:
    return {"text_output": np.array([text.encode("utf-8")], dtype=np.object_)}


async def text_responses(deltas: AsyncIterator[str], stream: bool) -> AsyncIterator[Tensors]:
    """One response per delta when streaming, else a single response with the whole text."""
    if stream:
        async for delta in deltas:
            if delta:
                yield text_tensor(delta)
        return
    yield text_tensor("".join([d async for d in deltas]))
