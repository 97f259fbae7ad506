"""The interface every model family implements (in the spirit of vLLM's
``SupportsMultiModal`` + processing info): what the stages ask a family, and nothing else.

A family owns everything that differs between VLMs:
- **images** (encoder side, numpy + Pillow only): the settings that decide preprocessing, the
  tokens and structure an image becomes (:class:`ImageLayout`), and the vision graph's inputs;
- **the vision graph** (export side, torch): the tower and projector as one ONNX-exportable
  module fed by those inputs, loaded from the checkpoint's vision weights only;
- **vLLM's inputs**: what prefill passes as ``image_embeds`` (and beside it), and what decode
  needs to place the image tokens when the KV arrives from prefill.

Stages never compute a family's arithmetic themselves; a new family is one module plus its
random test checkpoint (``orchestrator.model.build``).
"""

from __future__ import annotations

import json
from abc import ABC, abstractmethod
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any, ClassVar, Literal

import numpy as np
from pydantic import BaseModel, ConfigDict, PositiveInt

from orchestrator.model.checkpoint import Checkpoint, CheckpointError

if TYPE_CHECKING:
    from PIL import Image

GraphTarget = Literal["onnxruntime", "tensorrt"]
"""Which runtime an export is for: ONNX Runtime gets its fused (flash) attention kernel,
TensorRT plain ONNX ops that its builder fuses itself."""

OPENAI_CLIP_MEAN = (0.48145466, 0.4578275, 0.40821073)
OPENAI_CLIP_STD = (0.26862954, 0.26130258, 0.27577711)
"""The normalisation CLIP (and so Qwen2-VL, Qwen2.5-VL and LLaVA) processors default to."""

EMBEDDING_BYTES = 4
"""Embeddings travel as float32 (the exported graph's output)."""


class ImageLayout(BaseModel):
    """What one image becomes in the prompt: its embedding rows and its structure. Also a
    wire type: decode receives one per image."""

    model_config = ConfigDict(extra="forbid", frozen=True)

    tokens: PositiveInt
    """Embedding rows = image tokens the prompt's placeholder expands to."""
    grid_thw: tuple[PositiveInt, PositiveInt, PositiveInt] | None = None
    """(t, h, w) patch grid for families with mRoPE grids (Qwen); None for fixed-size ones."""


@dataclass(frozen=True)
class EncoderInput:
    """One preprocessed image: the vision graph's inputs by name, and its layout."""

    feeds: dict[str, np.ndarray]
    layout: ImageLayout


@dataclass(frozen=True)
class GraphInput:
    """One input of the exported vision graph (also its Triton ``config.pbtxt`` entry)."""

    name: str
    dtype: Literal["float32", "int64"]
    dims: tuple[int, ...]
    """-1 for dynamic axes."""
    dynamic: tuple[tuple[int, str], ...] = ()
    """(axis, name) of each dynamic axis; axes of one name have one size (e.g. "patches")."""


class UnsupportedModel(CheckpointError):
    """The checkpoint's family (or one of its options) is not served by this project."""


class ModelFamily(ABC):
    """One checkpoint's family knowledge; built from a validated :class:`Checkpoint`."""

    model_type: ClassVar[str]
    """``config.json``'s ``model_type`` this family serves."""
    vision_prefixes: ClassVar[dict[str, str]]
    """Checkpoint tensor prefix -> module prefix of the export graph's weights (both hub
    layouts of a family map to one)."""
    graph_version: ClassVar[int] = 1
    """Bumped when the family's exported graph changes, so cached exports are redone."""

    def __init__(self, checkpoint: Checkpoint) -> None:
        self.checkpoint = checkpoint
        self.config = checkpoint.config
        self.vision_config: dict[str, Any] = checkpoint.config.get("vision_config") or {}

    # The images.

    @property
    @abstractmethod
    def hidden_size(self) -> int:
        """Width of one embedding row (what vLLM's ``image_embeds`` must have)."""

    @abstractmethod
    def preprocess_settings(self) -> dict[str, Any]:
        """Every setting that changes ``encoder_input``'s output (part of cache keys)."""

    def preprocess_fingerprint(self) -> str:
        """Stable text of the preprocessing settings, for hashing."""
        settings = {"family": self.model_type, **self.preprocess_settings()}
        return json.dumps(settings, sort_keys=True, separators=(",", ":"))

    @abstractmethod
    def image_layout(self, width: int, height: int) -> ImageLayout:
        """The layout of a ``width`` x ``height`` image, without preprocessing it; raises
        ``ValueError`` for an image this family cannot take (saying why)."""

    @abstractmethod
    def encoder_input(self, image: Image.Image) -> EncoderInput:
        """Preprocess one RGB image exactly as the checkpoint's HF processor (PIL backend)
        does, into the vision graph's inputs."""

    @property
    @abstractmethod
    def image_token_id(self) -> int:
        """The token the chat template writes once per image, which vLLM repeats for each
        of the image's ``tokens`` (what a prompt's token count includes)."""

    @abstractmethod
    def max_image_tokens(self) -> int:
        """Tokens of the largest image the processor produces (sizes the embedding pool)."""

    def max_image_bytes(self) -> int:
        """Embedding bytes of the largest image."""
        return self.max_image_tokens() * self.hidden_size * EMBEDDING_BYTES

    # The vision graph (export side; imports torch).

    @property
    @abstractmethod
    def graph_inputs(self) -> tuple[GraphInput, ...]:
        """The graph's inputs, in order."""

    @abstractmethod
    def vision_graph(self, weights: dict[str, Any], target: GraphTarget):
        """The tower + projector as a ``torch.nn.Module`` whose ``forward`` takes
        ``graph_inputs`` in order and returns ``[tokens, hidden_size]`` float32; ``weights``
        are the checkpoint's vision tensors renamed by ``vision_prefixes``."""

    def dim_multiples(self) -> dict[str, int]:
        """Dynamic axes whose size is always a multiple of something (the exporter must
        know, e.g. patches merge in groups of four)."""
        return {}

    def example_input(self) -> EncoderInput:
        """Inputs to trace the graph with: a small synthetic image's."""
        from PIL import Image

        return self.encoder_input(Image.new("RGB", (84, 56), (120, 60, 30)))

    # vLLM.

    @abstractmethod
    def prefill_images(self, embeds: np.ndarray, layouts: list[ImageLayout]) -> Any:
        """``multi_modal_data["image"]`` for a prefill engine (``enable_mm_embeds``) from all
        images' embeddings, concatenated in prompt order (rows ``layouts[i].tokens`` each)."""

    @abstractmethod
    def decode_prompt(
        self,
        token_ids: list[int],
        prefilled_token_ids: list[int] | None,
        layouts: list[ImageLayout],
        image_hashes: list[str],
    ) -> dict[str, Any]:
        """The vLLM prompt of a KV-consumer decode from the front's ``token_ids``: the KV of
        every prompt token arrives from prefill, so only what places the image tokens (and
        keeps different images apart in decode's prefix cache) is needed."""

    decode_needs_token_ids: ClassVar[bool] = False
    """Whether ``decode_prompt`` needs prefill's ``prefilled_token_ids`` (families whose
    vLLM input has no metadata-only form)."""

    def encoder_id(self, weights_sha256: str) -> str:
        """Identity of an exported encoder (part of embedding cache keys)."""
        return f"{self.model_type}-vision-{weights_sha256[:16]}"


def normalize_lut(
    mean: tuple[float, ...], std: tuple[float, ...], rescale_factor: float
) -> np.ndarray:
    """``[3, 256]`` float32: HF's value for each (channel, byte), computed with its arithmetic
    (float64 rescale, then float32 normalize), so a table lookup reproduces it bit for bit."""
    scaled = (np.arange(256, dtype=np.float64) * rescale_factor).astype(np.float32)
    mean_arr = np.asarray(mean, dtype=np.float32)[:, None]
    std_arr = np.asarray(std, dtype=np.float32)[:, None]
    return (scaled[None, :] - mean_arr) / std_arr


def require(settings: dict[str, Any], flags: tuple[str, ...], where: str) -> None:
    """Refuse processor options the family's preprocessing does not implement."""
    for flag in flags:
        if not settings.get(flag, True):
            raise UnsupportedModel(f"{where}: {flag}=false is not supported by this preprocessor")
