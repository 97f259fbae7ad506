"""Qwen2.5-VL: Qwen2-VL's preprocessing and vLLM input, a tower with windowed attention.

Most blocks attend within windows of ``window_size`` pixels (112: 4x4 merged tokens, 64
patches); the blocks in ``fullatt_block_indexes`` attend over the whole image. HF reorders the
sequence window by window and back; here the sequence keeps its order and windowed blocks
gather each window's tokens into a padded ``[windows, 64]`` layout (``window_index``) and
scatter them back (``window_inverse``), both computed in numpy from the grid. Same maths,
and scores stay ``heads x N x 64`` instead of ``heads x N x N``.
"""

from __future__ import annotations

import functools
import math
from typing import Any

import numpy as np

from orchestrator.families.base import GraphInput
from orchestrator.families.qwen2_vl import Qwen2VLFamily, qwen2_vl_graph


def window_layout(
    grid_thw: tuple[int, int, int], merge_size: int, window_units: int
) -> tuple[np.ndarray, np.ndarray]:
    """``(window_index [W, L], window_inverse [N])`` of one image's patches.

    Windows are ``window_units`` x ``window_units`` merged tokens, in raster order over the
    image and raster order of tokens within a window (HF's ``get_vision_window_index``); a
    token's ``merge_size**2`` patches stay together. Windows at the right and bottom edges
    are smaller; their rows of ``window_index`` are padded with ``N`` (one past the last
    patch). Empty windows do not exist.
    """
    t, h, w = grid_thw
    mh, mw = h // merge_size, w // merge_size
    unit = merge_size * merge_size
    n = t * h * w
    length = window_units * window_units * unit
    tokens = np.arange(t * mh * mw).reshape(t, mh, mw)
    rows = []
    for frame in range(t):
        for wy in range(math.ceil(mh / window_units)):
            for wx in range(math.ceil(mw / window_units)):
                block = tokens[
                    frame,
                    wy * window_units : (wy + 1) * window_units,
                    wx * window_units : (wx + 1) * window_units,
                ].reshape(-1)
                patches = (block[:, None] * unit + np.arange(unit)).reshape(-1)
                rows.append(np.pad(patches, (0, length - patches.size), constant_values=n))
    index = np.stack(rows).astype(np.int64)
    flat = index.reshape(-1)
    inverse = np.empty(n, dtype=np.int64)
    valid = flat < n
    inverse[flat[valid]] = np.nonzero(valid)[0]
    return index, inverse


class Qwen2_5VLFamily(Qwen2VLFamily):
    model_type = "qwen2_5_vl"
    graph_version = 1
    tower_class = (
        "transformers.models.qwen2_5_vl.modeling_qwen2_5_vl"
        ".Qwen2_5_VisionTransformerPretrainedModel"
    )

    def __init__(self, checkpoint) -> None:
        super().__init__(checkpoint)
        cfg = self.image_settings
        window = int(self.vision_config.get("window_size", 112))
        if window % cfg.factor:
            raise ValueError(
                f"{checkpoint.path}: window_size {window} is not a multiple of {cfg.factor} px"
            )
        self.window_units = window // cfg.factor

    @property
    def hidden_size(self) -> int:
        return int(self.vision_config["out_hidden_size"])

    def preprocess_settings(self) -> dict[str, Any]:
        return {**super().preprocess_settings(), "window_units": self.window_units}

    def _extra_feeds(self, grid: tuple[int, int, int]) -> dict[str, np.ndarray]:
        index, inverse = window_layout(grid, self.image_settings.merge_size, self.window_units)
        return {"window_index": index, "window_inverse": inverse}

    @property
    def graph_inputs(self) -> tuple[GraphInput, ...]:
        length = self.window_units**2 * self.image_settings.merge_size**2
        return (
            *super().graph_inputs,
            GraphInput("window_index", "int64", (-1, length), ((0, "windows"),)),
            GraphInput("window_inverse", "int64", (-1,), ((0, "patches"),)),
        )

    def example_input(self):
        """Six windows, some partial, so no axis is traced at a size the exporter would
        treat as a constant (0 or 1)."""
        from PIL import Image

        side = self.window_units * self.image_settings.factor
        return self.encoder_input(Image.new("RGB", (side * 5 // 2, side * 3 // 2), (120, 60, 30)))

    @staticmethod
    def graph_class():
        return qwen2_5_vl_graph()


@functools.cache
def qwen2_5_vl_graph():
    from orchestrator.families import graph_ops as ops

    class Qwen2_5VLVisionGraph(qwen2_vl_graph()):
        """Windowed attention except in ``fullatt_block_indexes``; patch embedding, norms
        (RMSNorm), MLPs (SwiGLU) and merger are HF's modules."""

        def __init__(self, visual, vision_config: dict[str, Any], fused: bool) -> None:
            super().__init__(visual, vision_config, fused)
            self.full_blocks = frozenset(int(i) for i in vision_config["fullatt_block_indexes"])

        def attention(self, index, attn, x, cos, sin, extras):
            if index in self.full_blocks:
                return super().attention(index, attn, x, cos, sin, extras)
            window_index, window_inverse = extras
            q, k, v = self.qkv(attn, x, cos, sin)
            out = ops.windowed_attention(
                q, k, v, self.num_heads, self.scaling, window_index, window_inverse
            )
            return attn.proj(out)

    return Qwen2_5VLVisionGraph
