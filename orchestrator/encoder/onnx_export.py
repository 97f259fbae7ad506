"""Export a Qwen2-VL vision tower to ONNX with a dynamic number of patches.

HF's vision forward derives rotary positions and attention segments from ``grid_thw`` with
Python loops and ``.tolist()``, which freezes one image size into a traced graph. Here those
are graph *inputs* (``position_ids``, ``segment_ids``) computed in numpy by
``orchestrator.encoder.preprocess``, so the graph itself is shape-agnostic and the same file
serves onnxruntime and TensorRT. Attention is full within a segment (one image) and masked
across segments, so several images may share one call.
"""

from __future__ import annotations

import hashlib
import warnings
from pathlib import Path

from orchestrator.encoder.preprocess import PreprocessConfig

INPUT_NAMES = ("pixel_values", "position_ids", "segment_ids")
OUTPUT_NAME = "image_embeds"
OPSET = 18
GRAPH_VERSION = 2
"""Bumped when the exported graph changes, so cached exports are redone (2: the segment
mask is one additive bias for all blocks instead of a masked fill per block)."""
META_ENCODER_ID = "epd.encoder_id"
META_WEIGHTS_SHA = "epd.vision_weights_sha256"
META_PREPROCESS = "epd.preprocess"
META_MERGE_SIZE = "epd.merge_size"
META_HIDDEN_SIZE = "epd.hidden_size"


def vision_weights_sha256(visual) -> str:
    """Hash of the vision tower's parameters (names, dtypes, shapes, bytes), layout-independent.

    Identifies the encoder independently of file format, so embeddings made by ONNX, TensorRT
    or HF from the same weights share an identity.
    """
    import torch

    h = hashlib.sha256()
    for name, tensor in sorted(visual.state_dict().items()):
        t = tensor.detach().to("cpu").contiguous()
        h.update(f"{name}|{t.dtype}|{tuple(t.shape)}\0".encode())
        h.update(t.reshape(-1).view(torch.uint8).numpy().tobytes())
    return h.hexdigest()


def _graph_module(visual):
    """Wrap HF's vision modules in a forward whose only inputs are tensors."""
    import torch
    from torch import nn

    class VisionGraph(nn.Module):
        def __init__(self) -> None:
            super().__init__()
            self.visual = visual
            proj = visual.patch_embed.proj
            # Conv3d with stride == kernel over one patch is a matmul with the flat kernel.
            self.patch_weight = nn.Parameter(
                proj.weight.detach().reshape(proj.weight.shape[0], -1), requires_grad=False
            )
            inv_freq = visual.rotary_pos_emb.inv_freq.detach().float().clone()
            self.register_buffer("inv_freq", inv_freq, persistent=False)
            attn = visual.blocks[0].attn
            self.num_heads = attn.num_heads
            self.head_dim = attn.head_dim
            self.scaling = attn.scaling

        def forward(self, pixel_values, position_ids, segment_ids):
            x = nn.functional.linear(pixel_values, self.patch_weight)
            freqs = (position_ids[..., None].float() * self.inv_freq).flatten(1)  # [N, D/2]
            emb = torch.cat([freqs, freqs], dim=-1)[:, None, :]  # [N, 1, D]
            cos, sin = emb.cos(), emb.sin()
            # Images attend within themselves. One additive bias for every block and head:
            # a masked fill per block was a quarter of ONNX Runtime's time (its Where).
            same_image = segment_ids[:, None] == segment_ids[None, :]
            bias = torch.where(same_image, 0.0, float("-inf"))
            for blk in self.visual.blocks:
                x = x + self._attention(blk.attn, blk.norm1(x), cos, sin, bias)
                x = x + blk.mlp(blk.norm2(x))
            return self.visual.merger(x)

        def _attention(self, attn, x, cos, sin, bias):
            n = x.shape[0]
            q, k, v = attn.qkv(x).reshape(n, 3, self.num_heads, self.head_dim).unbind(1)
            q = q * cos + _rotate_half(q) * sin
            k = k * cos + _rotate_half(k) * sin
            q, k, v = (t.transpose(0, 1) for t in (q, k, v))  # [H, N, Dh]
            scores = torch.matmul(q, k.transpose(1, 2)) * self.scaling + bias
            out = torch.matmul(torch.softmax(scores, dim=-1), v)
            return attn.proj(out.transpose(0, 1).reshape(n, -1))

    def _rotate_half(t):
        half = t.shape[-1] // 2
        return torch.cat([-t[..., half:], t[..., :half]], dim=-1)

    return VisionGraph().eval()


def export_vision_encoder(model_dir: str | Path, out_path: str | Path) -> Path:
    """Write the vision tower of the checkpoint in ``model_dir`` to ``out_path`` (ONNX).

    Inputs: ``pixel_values`` float32 ``[N, patch_dim]``, ``position_ids`` int64 ``[N, 2]``,
    ``segment_ids`` int64 ``[N]``; output ``image_embeds`` float32 ``[N / merge^2, hidden]``.
    The encoder identity, weight hash and preprocessing settings go into ``metadata_props``.
    """
    import onnx
    import torch
    from transformers import Qwen2VLForConditionalGeneration

    from orchestrator.encoder.preprocess import segment_ids, vision_position_ids

    model_dir, out_path = Path(model_dir), Path(out_path)
    model = Qwen2VLForConditionalGeneration.from_pretrained(model_dir, dtype=torch.float32).eval()
    visual = model.model.visual
    merge = visual.spatial_merge_size
    graph = _graph_module(visual)
    cfg = PreprocessConfig.from_model_dir(model_dir)

    grid = (1, 2 * merge, 3 * merge)
    n = grid[0] * grid[1] * grid[2]
    example = (
        torch.zeros(n, cfg.patch_dim, dtype=torch.float32),
        torch.from_numpy(vision_position_ids(grid, merge)),
        torch.from_numpy(segment_ids(grid)),
    )
    tokens = torch.export.Dim("num_tokens", min=1, max=65536)
    patches = tokens * (merge * merge)
    with torch.no_grad(), warnings.catch_warnings():
        # torch 2.13's exporter warns about its own pytree internals and about the three
        # inputs sharing one axis name (which is the intent).
        warnings.filterwarnings("ignore", message=".*LeafSpec.*", category=FutureWarning)
        warnings.filterwarnings("ignore", message="# The axis name", category=UserWarning)
        program = torch.onnx.export(
            graph,
            example,
            dynamo=True,
            opset_version=OPSET,
            input_names=list(INPUT_NAMES),
            output_names=[OUTPUT_NAME],
            dynamic_shapes={
                "pixel_values": {0: patches},
                "position_ids": {0: patches},
                "segment_ids": {0: patches},
            },
            optimize=True,
            verbose=False,
        )
    proto = program.model_proto
    # The exporter names the output's first axis after an internal symbol ("s23").
    proto.graph.output[0].type.tensor_type.shape.dim[0].dim_param = "num_tokens"
    weights_sha = vision_weights_sha256(visual)
    meta = {
        META_ENCODER_ID: f"qwen2vl-vision-{weights_sha[:16]}",
        META_WEIGHTS_SHA: weights_sha,
        META_PREPROCESS: cfg.canonical_json(),
        META_MERGE_SIZE: str(merge),
        META_HIDDEN_SIZE: str(model.config.vision_config.hidden_size),
    }
    del proto.metadata_props[:]
    for key, value in sorted(meta.items()):
        proto.metadata_props.add(key=key, value=value)
    onnx.checker.check_model(proto)
    out_path.parent.mkdir(parents=True, exist_ok=True)
    onnx.save_model(proto, out_path)
    return out_path
