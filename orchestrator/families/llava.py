"""LLaVA (1.5-style): a CLIP tower at a fixed resolution, features from one (or several)
of its layers, a two-layer MLP projector; a fixed number of image tokens, no grid, no mRoPE.

Why this family among the grid-free ones: vLLM 0.32's ``llava`` accepts precomputed
``image_embeds`` as they are (one ``[tokens, hidden]`` tensor per image, placed where the
prompt's ``<image>`` expands), while ``gemma3_mm`` refuses them outright ("Gemma3 does not
support image_embeds") and ``llava_onevision`` would need its any-resolution tiling and
``image_newline`` packing reproduced outside vLLM.

Preprocessing is HF's ``CLIPImageProcessor`` (PIL backend), bit for bit: resize the shortest
edge (HF's rounding), centre crop (zero padding when the crop is larger), float64 rescale then
float32 normalize. vLLM 0.32's LLaVA has no metadata-only image input, so decode (whose KV
arrives from prefill) is sent prefill's prompt token ids, image placeholders already expanded,
with a ``cache_salt`` made of the images' content hashes: without it, two prompts that differ
only in their images would share decode's prefix-cache blocks.
"""

from __future__ import annotations

import functools
import hashlib
from dataclasses import asdict, dataclass
from typing import TYPE_CHECKING, Any

import numpy as np

from orchestrator.families.base import (
    OPENAI_CLIP_MEAN,
    OPENAI_CLIP_STD,
    EncoderInput,
    GraphInput,
    GraphTarget,
    ImageLayout,
    ModelFamily,
    UnsupportedModel,
    normalize_lut,
    require,
)

if TYPE_CHECKING:
    from PIL import Image


@dataclass(frozen=True)
class ClipImageSettings:
    """Everything that determines a CLIP image processor's output."""

    shortest_edge: int | None
    """Resize so the shorter side is this (aspect kept); None: resize to ``size`` exactly."""
    size: tuple[int, int] | None
    """(height, width) to resize to when there is no ``shortest_edge``."""
    crop: tuple[int, int] | None
    """(height, width) of the centre crop; None: no crop."""
    image_mean: tuple[float, ...]
    image_std: tuple[float, ...]
    resample: int
    rescale_factor: float

    @classmethod
    def from_processor(cls, raw: dict[str, Any], where: str) -> ClipImageSettings:
        require(raw, ("do_resize", "do_rescale", "do_normalize", "do_convert_rgb"), where)
        if raw.get("do_pad"):
            raise UnsupportedModel(f"{where}: do_pad=true (pad to square) is not supported")
        size = raw.get("size") or {}
        if isinstance(size, int):
            size = {"shortest_edge": size}
        crop = raw.get("crop_size") or {}
        if isinstance(crop, int):
            crop = {"height": crop, "width": crop}
        shortest = size.get("shortest_edge")
        if shortest is None and not (size.get("height") and size.get("width")):
            raise UnsupportedModel(f"{where}: image processor size {size} is not understood")
        return cls(
            shortest_edge=int(shortest) if shortest is not None else None,
            size=None if shortest is not None else (int(size["height"]), int(size["width"])),
            crop=(int(crop["height"]), int(crop["width"])) if raw.get("do_center_crop") else None,
            image_mean=tuple(float(v) for v in raw.get("image_mean", OPENAI_CLIP_MEAN)),
            image_std=tuple(float(v) for v in raw.get("image_std", OPENAI_CLIP_STD)),
            resample=int(raw.get("resample", 3)),
            rescale_factor=float(raw.get("rescale_factor", 1 / 255)),
        )

    def resized(self, height: int, width: int) -> tuple[int, int]:
        """(height, width) after the resize step, with HF's rounding (``int`` of the long
        side, as ``get_resize_output_image_size``)."""
        if self.shortest_edge is None:
            return self.size  # type: ignore[return-value]
        short, long = (width, height) if width <= height else (height, width)
        new_short, new_long = self.shortest_edge, int(self.shortest_edge * long / short)
        return (new_long, new_short) if width <= height else (new_short, new_long)

    def output_size(self) -> tuple[int, int]:
        """(height, width) of every processed image."""
        if self.crop is not None:
            return self.crop
        if self.size is None:
            raise UnsupportedModel(
                "resizing the shortest edge without a crop gives images of any size"
            )
        return self.size


def clip_pixels(img: Image.Image, cfg: ClipImageSettings) -> np.ndarray:
    """float32 ``[3, H, W]`` exactly as HF's CLIP image processor (PIL backend) makes it."""
    if img.mode != "RGB":
        img = img.convert("RGB")
    height, width = cfg.resized(img.height, img.width)
    pixels = np.asarray(img.resize((width, height), resample=cfg.resample), dtype=np.uint8)
    if cfg.crop is not None:
        pixels = _center_crop(pixels, *cfg.crop)
    lut = normalize_lut(cfg.image_mean, cfg.image_std, cfg.rescale_factor)
    return np.stack([lut[c][pixels[..., c]] for c in range(3)])


def _center_crop(pixels: np.ndarray, crop_h: int, crop_w: int) -> np.ndarray:
    """HF's ``center_crop`` on ``[H, W, 3]`` bytes: the centre, zero-padded where the image
    is smaller than the crop (padding centred, rounding up on the top/left)."""
    h, w = pixels.shape[:2]
    top, left = (h - crop_h) // 2, (w - crop_w) // 2
    if top >= 0 and left >= 0:
        return pixels[top : top + crop_h, left : left + crop_w]
    new_h, new_w = max(crop_h, h), max(crop_w, w)
    canvas = np.zeros((new_h, new_w, 3), dtype=pixels.dtype)
    pad_top, pad_left = -(-(new_h - h) // 2), -(-(new_w - w) // 2)
    canvas[pad_top : pad_top + h, pad_left : pad_left + w] = pixels
    top, left = top + pad_top, left + pad_left
    return canvas[top : top + crop_h, left : left + crop_w]


class LlavaFamily(ModelFamily):
    model_type = "llava"
    vision_prefixes = {
        "vision_tower.vision_model.": "tower.",
        "model.vision_tower.vision_model.": "tower.",
        "vision_tower.": "tower.",
        "model.vision_tower.": "tower.",
        "multi_modal_projector.": "projector.",
        "model.multi_modal_projector.": "projector.",
    }
    decode_needs_token_ids = True

    def __init__(self, checkpoint) -> None:
        super().__init__(checkpoint)
        where = str(checkpoint.path)
        tower = self.vision_config.get("model_type", "clip_vision_model")
        if tower != "clip_vision_model":
            raise UnsupportedModel(
                f"{where}: LLaVA with a {tower!r} vision tower is not supported (CLIP only)"
            )
        self.image_settings = ClipImageSettings.from_processor(
            checkpoint.processor_settings(), where
        )
        image_size = int(self.vision_config.get("image_size", 336))
        if self.image_settings.output_size() != (image_size, image_size):
            raise UnsupportedModel(
                f"{where}: the processor makes {self.image_settings.output_size()} images, the "
                f"tower takes {image_size}x{image_size}"
            )
        self.image_size = image_size
        patch = int(self.vision_config.get("patch_size", 14))
        strategy = self.config.get("vision_feature_select_strategy", "default")
        if strategy not in ("default", "full"):
            raise UnsupportedModel(f"{where}: vision_feature_select_strategy {strategy!r}")
        self.keep_cls = strategy == "full"
        self.tokens = (image_size // patch) ** 2 + (1 if self.keep_cls else 0)
        layers = self.config.get("vision_feature_layer", -2)
        self.feature_layers = [int(i) for i in (layers if isinstance(layers, list) else [layers])]

    @property
    def hidden_size(self) -> int:
        return int(self.checkpoint.text_config["hidden_size"])

    def preprocess_settings(self) -> dict[str, Any]:
        return asdict(self.image_settings)

    def image_layout(self, width: int, height: int) -> ImageLayout:
        return ImageLayout(tokens=self.tokens)

    @property
    def image_token_id(self) -> int:
        config = self.config  # older downloads name it image_token_index, newer both
        return int(
            config["image_token_index"]
            if "image_token_index" in config
            else config["image_token_id"]
        )

    def max_image_tokens(self) -> int:
        return self.tokens

    def encoder_input(self, image: Image.Image) -> EncoderInput:
        pixels = clip_pixels(image, self.image_settings)
        return EncoderInput(
            feeds={"pixel_values": pixels[None]}, layout=ImageLayout(tokens=self.tokens)
        )

    @property
    def graph_inputs(self) -> tuple[GraphInput, ...]:
        size = self.image_size
        return (GraphInput("pixel_values", "float32", (-1, 3, size, size), ((0, "images"),)),)

    def example_input(self) -> EncoderInput:
        """Two images: a batch axis traced at size 1 would be exported as a constant."""
        one = super().example_input()
        feeds = {"pixel_values": np.concatenate([one.feeds["pixel_values"]] * 2)}
        return EncoderInput(feeds=feeds, layout=one.layout)

    def vision_graph(self, weights: dict[str, Any], target: GraphTarget):
        import torch
        from torch import nn
        from transformers import AutoConfig
        from transformers.models.clip.modeling_clip import CLIPVisionModel
        from transformers.models.llava.modeling_llava import LlavaMultiModalProjector

        config = AutoConfig.from_pretrained(self.checkpoint.path)
        with torch.device("meta"):
            parts = nn.Module()
            parts.tower = CLIPVisionModel._from_config(config.vision_config, dtype=torch.float32)
            parts.projector = LlavaMultiModalProjector(config)
        try:
            parts.load_state_dict(weights, strict=True, assign=True)
        except RuntimeError as exc:
            raise ValueError(
                f"the checkpoint's vision weights do not fit its config: {exc}"
            ) from None
        depth = len(parts.tower.encoder.layers)
        # hidden_states[i] (HF's indexing): 0 = embeddings, i = after i layers, -1 = last.
        after = [i if i >= 0 else depth + 1 + i for i in self.feature_layers]
        return llava_graph()(
            parts.tower, parts.projector, after, self.keep_cls, target == "onnxruntime"
        ).eval()

    # vLLM.

    def prefill_images(self, embeds: np.ndarray, layouts: list[ImageLayout]) -> Any:
        """One ``[tokens, hidden]`` tensor per image (views of the pulled rows)."""
        import torch

        out, row = [], 0
        for layout in layouts:
            out.append(torch.from_numpy(embeds[row : row + layout.tokens]))
            row += layout.tokens
        return out

    def decode_prompt(
        self,
        token_ids: list[int],
        prefilled_token_ids: list[int] | None,
        layouts: list[ImageLayout],
        image_hashes: list[str],
    ) -> dict[str, Any]:
        if not layouts:
            return {"prompt_token_ids": token_ids}
        if not prefilled_token_ids:
            raise ValueError("LLaVA decode needs prefill's prompt token ids")
        salt = hashlib.sha256("\0".join(image_hashes).encode()).hexdigest()
        return {"prompt_token_ids": prefilled_token_ids, "cache_salt": salt}


@functools.cache
def llava_graph():
    import torch
    from torch import nn

    from orchestrator.families import graph_ops as ops

    class LlavaVisionGraph(nn.Module):
        """pixel_values [B, 3, S, S] -> projected features [B * tokens, hidden]."""

        def __init__(self, tower, projector, after: list[int], keep_cls: bool, fused: bool):
            super().__init__()
            self.tower, self.projector = tower, projector
            self.after, self.keep_cls, self.fused = after, keep_cls, fused
            self.layers = tower.encoder.layers[: max(after)]
            attn = self.layers[0].self_attn if len(self.layers) else None
            self.num_heads = attn.num_heads if attn is not None else 1
            self.scale = attn.scale if attn is not None else 1.0

        def attention(self, attn, x):
            q, k, v = attn.q_proj(x), attn.k_proj(x), attn.v_proj(x)
            return attn.out_proj(
                ops.full_attention(q, k, v, self.num_heads, self.scale, self.fused)
            )

        def forward(self, pixel_values):
            emb = self.tower.embeddings
            patches = (
                nn.functional.conv2d(
                    pixel_values,
                    emb.patch_embedding.weight,
                    emb.patch_embedding.bias,
                    stride=emb.patch_embedding.stride,
                )
                .flatten(2)
                .transpose(1, 2)
            )
            cls = emb.class_embedding.expand(patches.shape[0], 1, -1)
            x = torch.cat([cls, patches], dim=1) + emb.position_embedding.weight[None]
            x = self.tower.pre_layrnorm(x)
            states = {0: x}
            for i, layer in enumerate(self.layers, start=1):
                x = x + self.attention(layer.self_attn, layer.layer_norm1(x))
                x = x + layer.mlp(layer.layer_norm2(x))
                states[i] = x
            features = torch.cat([states[i] for i in self.after], dim=-1)
            if not self.keep_cls:
                features = features[:, 1:]
            out = self.projector(features)
            return out.reshape(-1, out.shape[-1])

    return LlavaVisionGraph
