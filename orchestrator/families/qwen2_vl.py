"""Qwen2-VL: dynamic resolution (any size, resized to multiples of 28 px within the
processor's pixel range), 2-D rotary positions in the tower, 2x2 patch merging, mRoPE grids.

The encoder side is numpy + Pillow, bit-exact with HF's ``Qwen2VLImageProcessor`` (PIL
backend): HF's order of operations (PIL resize, float64 rescale then float32 normalize, HF's
patch order). What a static graph cannot hold — rotary positions from the grid — is computed
here in numpy and fed to the graph as an input, so one shape-agnostic ONNX file serves every
image size. Qwen2.5-VL and Qwen3-VL extend this module's family class.
"""

from __future__ import annotations

import functools
import math
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
    normalize_lut,
    require,
)

if TYPE_CHECKING:
    from PIL import Image

MAX_ASPECT_RATIO = 200
"""HF's limit on max(h, w) / min(h, w)."""


@dataclass(frozen=True)
class QwenImageSettings:
    """Everything that determines a Qwen image processor's output."""

    patch_size: int = 14
    merge_size: int = 2
    temporal_patch_size: int = 2
    min_pixels: int = 56 * 56
    max_pixels: int = 28 * 28 * 1280
    image_mean: tuple[float, ...] = OPENAI_CLIP_MEAN
    image_std: tuple[float, ...] = OPENAI_CLIP_STD
    resample: int = 3  # PIL bicubic
    rescale_factor: float = 1 / 255

    @property
    def factor(self) -> int:
        """Resized sides are multiples of this, so patches merge into whole tokens."""
        return self.patch_size * self.merge_size

    @property
    def patch_dim(self) -> int:
        return 3 * self.temporal_patch_size * self.patch_size * self.patch_size

    @classmethod
    def from_processor(cls, raw: dict[str, Any], where: str) -> QwenImageSettings:
        """From saved processor settings: ``min/max_pixels`` or ``size.{shortest,longest}_edge``
        (both layouts transformers has written)."""
        require(raw, ("do_resize", "do_rescale", "do_normalize", "do_convert_rgb"), where)
        size = raw.get("size") or {}
        default = cls()
        return cls(
            patch_size=int(raw.get("patch_size", default.patch_size)),
            merge_size=int(raw.get("merge_size", default.merge_size)),
            temporal_patch_size=int(raw.get("temporal_patch_size", default.temporal_patch_size)),
            min_pixels=int(
                raw.get("min_pixels")
                or size.get("shortest_edge")
                or size.get("min_pixels")
                or default.min_pixels
            ),
            max_pixels=int(
                raw.get("max_pixels")
                or size.get("longest_edge")
                or size.get("max_pixels")
                or default.max_pixels
            ),
            image_mean=tuple(float(v) for v in raw.get("image_mean", OPENAI_CLIP_MEAN)),
            image_std=tuple(float(v) for v in raw.get("image_std", OPENAI_CLIP_STD)),
            resample=int(raw.get("resample", default.resample)),
            rescale_factor=float(raw.get("rescale_factor", default.rescale_factor)),
        )


def smart_resize(height: int, width: int, cfg: QwenImageSettings) -> tuple[int, int]:
    """Target (height, width): multiples of ``cfg.factor``, area within [min, max] pixels.

    Same rounding as HF's Qwen2-VL ``smart_resize``; grid sizes (and so token counts) depend
    on it, so it must not drift.
    """
    if max(height, width) / min(height, width) > MAX_ASPECT_RATIO:
        raise ValueError(
            f"aspect ratio {max(height, width) / min(height, width):.1f} exceeds "
            f"{MAX_ASPECT_RATIO} ({width}x{height})"
        )
    factor = cfg.factor
    h_bar = round(height / factor) * factor
    w_bar = round(width / factor) * factor
    if h_bar * w_bar > cfg.max_pixels:
        beta = math.sqrt((height * width) / cfg.max_pixels)
        h_bar = max(factor, math.floor(height / beta / factor) * factor)
        w_bar = max(factor, math.floor(width / beta / factor) * factor)
    elif h_bar * w_bar < cfg.min_pixels:
        beta = math.sqrt(cfg.min_pixels / (height * width))
        h_bar = math.ceil(height * beta / factor) * factor
        w_bar = math.ceil(width * beta / factor) * factor
    return h_bar, w_bar


def patchify(img: Image.Image, cfg: QwenImageSettings) -> tuple[np.ndarray, tuple[int, int, int]]:
    """Resize, normalize and patchify one image: ``pixel_values`` float32
    ``[grid_h * grid_w, cfg.patch_dim]`` and the grid ``(1, grid_h, grid_w)``, laid out
    exactly as HF's Qwen2-VL image processor lays them out (merge block by merge block)."""
    if img.mode != "RGB":
        img = img.convert("RGB")
    height, width = smart_resize(img.height, img.width, cfg)
    pixels = np.asarray(img.resize((width, height), resample=cfg.resample), dtype=np.uint8)
    lut = normalize_lut(cfg.image_mean, cfg.image_std, cfg.rescale_factor)
    chw = np.stack([lut[c][pixels[..., c]] for c in range(3)])

    p, m, t = cfg.patch_size, cfg.merge_size, cfg.temporal_patch_size
    grid_h, grid_w = height // p, width // p
    patches = chw.reshape(3, grid_h // m, m, p, grid_w // m, m, p)
    patches = patches.transpose(1, 4, 2, 5, 0, 3, 6)  # (gh, gw, mh, mw, C, ph, pw)
    patches = np.broadcast_to(patches[:, :, :, :, :, None], (*patches.shape[:5], t, p, p))
    pixel_values = np.ascontiguousarray(patches.reshape(grid_h * grid_w, cfg.patch_dim))
    return pixel_values, (1, grid_h, grid_w)


def vision_position_ids(grid_thw: tuple[int, int, int], merge_size: int) -> np.ndarray:
    """(h, w) rotary positions of every patch, int64 ``[t*h*w, 2]``, in merge-block order
    (as ``patchify`` emits patches): the position of patch i is not simply ``divmod(i, w)``."""
    t, h, w = grid_thw
    hpos, wpos = np.meshgrid(np.arange(h), np.arange(w), indexing="ij")
    block = (h // merge_size, merge_size, w // merge_size, merge_size)
    hpos = hpos.reshape(block).transpose(0, 2, 1, 3).reshape(-1)
    wpos = wpos.reshape(block).transpose(0, 2, 1, 3).reshape(-1)
    return np.tile(np.stack([hpos, wpos], axis=-1), (t, 1)).astype(np.int64)


def axial_inv_freq(head_dim: int, theta: float):
    """Inverse frequencies of the towers' 2-D rotary embedding (a quarter of a head each for
    h and w), as HF's ``compute_axial_rope_parameters``."""
    import torch

    spatial = head_dim // 2
    return 1.0 / (theta ** (torch.arange(0, spatial, 2, dtype=torch.float) / spatial))


class Qwen2VLFamily(ModelFamily):
    model_type = "qwen2_vl"
    vision_prefixes = {"visual.": "", "model.visual.": ""}
    graph_version = 3
    """3: one image per call, full attention as one fused op (no bias over all patches)."""

    def __init__(self, checkpoint) -> None:
        super().__init__(checkpoint)
        self.image_settings = QwenImageSettings.from_processor(
            checkpoint.processor_settings(), str(checkpoint.path)
        )
        merge = int(self.vision_config.get("spatial_merge_size", 2))
        if merge != self.image_settings.merge_size:
            raise ValueError(
                f"{checkpoint.path}: the processor merges {self.image_settings.merge_size}x"
                f"{self.image_settings.merge_size} patches, the tower {merge}x{merge}"
            )

    @property
    def hidden_size(self) -> int:
        return int(self.vision_config["hidden_size"])

    def preprocess_settings(self) -> dict[str, Any]:
        return asdict(self.image_settings)

    def image_layout(self, width: int, height: int) -> ImageLayout:
        cfg = self.image_settings
        h, w = smart_resize(height, width, cfg)
        grid = (1, h // cfg.patch_size, w // cfg.patch_size)
        return ImageLayout(tokens=h * w // cfg.factor**2, grid_thw=grid)

    @property
    def image_token_id(self) -> int:
        return int(self.config["image_token_id"])

    def max_image_tokens(self) -> int:
        return self.image_settings.max_pixels // self.image_settings.factor**2

    def encoder_input(self, image: Image.Image) -> EncoderInput:
        pixel_values, grid = patchify(image, self.image_settings)
        layout = ImageLayout(
            tokens=grid[1] * grid[2] // self.image_settings.merge_size**2, grid_thw=grid
        )
        feeds = {
            "pixel_values": pixel_values,
            "position_ids": vision_position_ids(grid, self.image_settings.merge_size),
            **self._extra_feeds(grid),
        }
        return EncoderInput(feeds=feeds, layout=layout)

    def _extra_feeds(self, grid: tuple[int, int, int]) -> dict[str, np.ndarray]:
        """Further grid-derived graph inputs of a subclass's tower."""
        return {}

    @property
    def graph_inputs(self) -> tuple[GraphInput, ...]:
        return (
            GraphInput(
                "pixel_values", "float32", (-1, self.image_settings.patch_dim), ((0, "patches"),)
            ),
            GraphInput("position_ids", "int64", (-1, 2), ((0, "patches"),)),
        )

    def dim_multiples(self) -> dict[str, int]:
        return {"patches": self.image_settings.merge_size**2}

    # The graph.

    tower_class = (
        "transformers.models.qwen2_vl.modeling_qwen2_vl.Qwen2VisionTransformerPretrainedModel"
    )
    """HF's vision module of the family (its submodules are reused by the graph)."""

    def vision_graph(self, weights: dict[str, Any], target: GraphTarget):
        from transformers import AutoConfig

        config = AutoConfig.from_pretrained(self.checkpoint.path).vision_config
        visual = load_module(self.tower_class, config, weights)
        return self.graph_class()(visual, self.vision_config, target == "onnxruntime").eval()

    @staticmethod
    def graph_class():
        return qwen2_vl_graph()

    # vLLM.

    def prefill_images(self, embeds: np.ndarray, layouts: list[ImageLayout]) -> Any:
        """One dict for all images: embeddings concatenated, one grid row per image."""
        import torch

        return {
            "image_embeds": torch.from_numpy(embeds),
            "image_grid_thw": torch.tensor([lay.grid_thw for lay in layouts], dtype=torch.int64),
        }

    def decode_prompt(
        self,
        token_ids: list[int],
        prefilled_token_ids: list[int] | None,
        layouts: list[ImageLayout],
        image_hashes: list[str],
    ) -> dict[str, Any]:
        """The metadata-only form a KV consumer accepts: the grids size the placeholders and
        the mRoPE positions; the content hashes keep two images of one size apart (vLLM
        would otherwise hash only the grids and share prefix-cache blocks between them)."""
        import torch

        request: dict[str, Any] = {"prompt_token_ids": token_ids}
        if layouts:
            grids = torch.tensor([lay.grid_thw for lay in layouts], dtype=torch.int64)
            request["multi_modal_data"] = {"image": {"image_grid_thw": grids}}
            request["multi_modal_uuids"] = {"image": list(image_hashes)}
        return request


def load_module(class_path: str, config, weights: dict[str, Any]):
    """HF's ``class_path`` module for ``config`` holding ``weights``: built on the meta device
    (a 670M-parameter tower is not randomly initialised first), then given the tensors;
    strict, so weights that do not fit the config fail here, naming the tensors."""
    import importlib

    import torch

    module_name, _, name = class_path.rpartition(".")
    module_cls = getattr(importlib.import_module(module_name), name)
    with torch.device("meta"):
        module = module_cls._from_config(config, dtype=torch.float32)
    try:
        module.load_state_dict(weights, strict=True, assign=True)
    except RuntimeError as exc:
        raise ValueError(f"the checkpoint's vision weights do not fit its config: {exc}") from None
    if hasattr(module, "rotary_pos_emb"):  # its buffers stay on meta; the graph has its own
        del module.rotary_pos_emb
    return module.eval()


@functools.cache
def qwen2_vl_graph():
    """The Qwen2-VL vision graph class (torch is imported only when a graph is built).

    Subclasses (Qwen2.5-VL, Qwen3-VL) override the hooks: ``embed`` (patches -> hidden),
    ``attention`` per block, ``collect`` features after a block, ``finish`` (merger).
    ``forward`` takes ``pixel_values, position_ids`` and the family's extra inputs.
    """
    from torch import nn

    from orchestrator.families import graph_ops as ops

    class Qwen2VLVisionGraph(nn.Module):
        def __init__(self, visual, vision_config: dict[str, Any], fused: bool) -> None:
            super().__init__()
            self.visual = visual
            self.fused = fused
            self.patch_weight, self.patch_bias = ops.patch_projection(visual.patch_embed.proj)
            del visual.patch_embed
            attn = visual.blocks[0].attn
            self.num_heads, self.head_dim = attn.num_heads, attn.head_dim
            self.scaling = attn.head_dim**-0.5
            rope = vision_config.get("rope_parameters") or {}
            theta = float(rope.get("rope_theta", 10000.0))
            self.register_buffer("inv_freq", axial_inv_freq(self.head_dim, theta), persistent=False)

        def embed(self, pixel_values, extras):
            return nn.functional.linear(pixel_values, self.patch_weight, self.patch_bias)

        def qkv(self, attn, x, cos, sin):
            n = x.shape[0]
            q, k, v = attn.qkv(x).reshape(n, 3, self.num_heads, self.head_dim).unbind(1)
            q = ops.apply_rotary(q, cos, sin).reshape(n, -1)
            k = ops.apply_rotary(k, cos, sin).reshape(n, -1)
            return q, k, v.reshape(n, -1)

        def attention(self, index, attn, x, cos, sin, extras):
            q, k, v = self.qkv(attn, x, cos, sin)
            out = ops.full_attention(
                q[None], k[None], v[None], self.num_heads, self.scaling, self.fused
            )
            return attn.proj(out[0])

        def collect(self, index, x):
            return None

        def finish(self, x, collected):
            return self.visual.merger(x)

        def forward(self, pixel_values, position_ids, *extras):
            x = self.embed(pixel_values, extras)
            cos, sin = ops.rotary_cos_sin(position_ids, self.inv_freq)
            collected = []
            for i, blk in enumerate(self.visual.blocks):
                x = x + self.attention(i, blk.attn, blk.norm1(x), cos, sin, extras)
                x = x + blk.mlp(blk.norm2(x))
                if (feature := self.collect(i, x)) is not None:
                    collected.append(feature)
            return self.finish(x, collected)

    return Qwen2VLVisionGraph
