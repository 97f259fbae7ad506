"""Qwen3-VL: Qwen2-VL's dynamic resolution at patch 16, a learned position grid resampled to
each image, and DeepStack.

- **Position embeddings**: a square learned table (``num_position_embeddings``, e.g. 48x48)
  bilinearly resampled (align-corners) to the image's patch grid. The taps and weights depend
  on the grid only, so numpy computes them (``pos_embed_index`` / ``pos_embed_weight``, four
  taps per patch, in vLLM's order) and the graph gathers and sums.
- **DeepStack**: after the blocks in ``deepstack_visual_indexes`` a merger of its own turns the
  hidden states into extra features that vLLM adds to the first text layers' inputs. They
  travel with the image's embeddings in one handle, the way vLLM's own tower returns them and
  its ``image_embeds`` input takes them: ``[tokens, out_hidden * (1 + len(indexes))]``, main
  embedding first, then each level.
"""

from __future__ import annotations

import functools
from typing import Any

import numpy as np

from orchestrator.families.base import GraphInput
from orchestrator.families.qwen2_vl import Qwen2VLFamily, qwen2_vl_graph


def pos_embed_taps(
    grid_thw: tuple[int, int, int], side: int, merge_size: int
) -> tuple[np.ndarray, np.ndarray]:
    """Bilinear taps into a ``side x side`` table for every patch, in merge-block order:
    ``(index [N, 4] int64, weight [N, 4] float32)``, computed as vLLM's
    ``pos_embed_interpolate_native`` does (float32 ``linspace``, align-corners)."""
    t, h, w = grid_thw
    h_idx = np.linspace(0, side - 1, h, dtype=np.float64).astype(np.float32)
    w_idx = np.linspace(0, side - 1, w, dtype=np.float64).astype(np.float32)
    h_floor, w_floor = h_idx.astype(np.int64), w_idx.astype(np.int64)
    h_ceil, w_ceil = np.minimum(h_floor + 1, side - 1), np.minimum(w_floor + 1, side - 1)
    dh = (h_idx - h_floor.astype(np.float32))[:, None]
    dw = (w_idx - w_floor.astype(np.float32))[None, :]
    w11 = dh * dw
    w10 = dh - w11
    w01 = dw - w11
    w00 = np.float32(1) - dh - w01
    rows_f, rows_c = (h_floor * side)[:, None], (h_ceil * side)[:, None]
    cols_f, cols_c = w_floor[None, :], w_ceil[None, :]
    index = np.stack(
        np.broadcast_arrays(rows_f + cols_f, rows_f + cols_c, rows_c + cols_f, rows_c + cols_c), -1
    )
    weight = np.stack(np.broadcast_arrays(w00, w01, w10, w11), -1).astype(np.float32)

    def block_order(a: np.ndarray) -> np.ndarray:  # raster [h, w, 4] -> merge blocks [h*w, 4]
        m = merge_size
        a = a.reshape(h // m, m, w // m, m, 4).transpose(0, 2, 1, 3, 4).reshape(-1, 4)
        return np.tile(a, (t, 1))

    return np.ascontiguousarray(block_order(index)), np.ascontiguousarray(block_order(weight))


class Qwen3VLFamily(Qwen2VLFamily):
    model_type = "qwen3_vl"
    vision_prefixes = {"model.visual.": "", "visual.": ""}
    graph_version = 1
    tower_class = "transformers.models.qwen3_vl.modeling_qwen3_vl.Qwen3VLVisionModel"

    def __init__(self, checkpoint) -> None:
        super().__init__(checkpoint)
        self.grid_side = int(round(int(self.vision_config["num_position_embeddings"]) ** 0.5))
        self.deepstack_levels = len(self.vision_config.get("deepstack_visual_indexes") or [])

    @property
    def hidden_size(self) -> int:
        """Main embedding plus one DeepStack feature per level, concatenated."""
        return int(self.vision_config["out_hidden_size"]) * (1 + self.deepstack_levels)

    def preprocess_settings(self) -> dict[str, Any]:
        return {**super().preprocess_settings(), "position_grid": self.grid_side}

    def _extra_feeds(self, grid: tuple[int, int, int]) -> dict[str, np.ndarray]:
        index, weight = pos_embed_taps(grid, self.grid_side, self.image_settings.merge_size)
        return {"pos_embed_index": index, "pos_embed_weight": weight}

    @property
    def graph_inputs(self) -> tuple[GraphInput, ...]:
        return (
            *super().graph_inputs,
            GraphInput("pos_embed_index", "int64", (-1, 4), ((0, "patches"),)),
            GraphInput("pos_embed_weight", "float32", (-1, 4), ((0, "patches"),)),
        )

    @staticmethod
    def graph_class():
        return qwen3_vl_graph()


@functools.cache
def qwen3_vl_graph():
    import torch

    class Qwen3VLVisionGraph(qwen2_vl_graph()):
        """Patch embedding with bias plus resampled learned positions; LayerNorm/GELU blocks;
        DeepStack features collected after their blocks and concatenated to the output."""

        def __init__(self, visual, vision_config: dict[str, Any], fused: bool) -> None:
            super().__init__(visual, vision_config, fused)
            self.deepstack = [int(i) for i in vision_config.get("deepstack_visual_indexes") or []]

        def embed(self, pixel_values, extras):
            pos_index, pos_weight = extras
            x = super().embed(pixel_values, extras)
            table = self.visual.pos_embed.weight
            return x + (table[pos_index] * pos_weight[:, :, None]).sum(1)

        def collect(self, index, x):
            if index not in self.deepstack:
                return None
            return self.visual.deepstack_merger_list[self.deepstack.index(index)](x)

        def finish(self, x, collected):
            return torch.cat([self.visual.merger(x), *collected], dim=-1)

    return Qwen3VLVisionGraph
