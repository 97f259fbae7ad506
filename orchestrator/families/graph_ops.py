"""Torch building blocks of the exported vision graphs (imported at export time only).

Attention is where memory goes: a tower that forms ``heads x N x N`` scores needs 17 GB per
head for one 1792-px image. So full attention within an image is one op, ``epd::mha``, that
exports for ONNX Runtime as ``com.microsoft.MultiHeadAttention`` — whose CPU kernel is MLAS's
flash attention (memory linear in N) — and for TensorRT as plain MatMul/Softmax, which
TensorRT's builder fuses into its own flash kernels. Windowed attention (Qwen2.5-VL) gathers
each window's tokens into a ``[windows, window_len]`` layout, so its scores are
``heads x N x window_len``: linear too.
"""

from __future__ import annotations

import functools

import torch
from torch import nn

from orchestrator.families.base import GraphTarget


@torch.library.custom_op("epd::mha", mutates_args=())
def mha(
    q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, num_heads: int, scale: float
) -> torch.Tensor:
    """Bidirectional attention over ``[batch, seq, heads * head_dim]`` tensors."""
    b, s, d = q.shape
    heads = [t.reshape(b, -1, num_heads, d // num_heads).transpose(1, 2) for t in (q, k, v)]
    out = nn.functional.scaled_dot_product_attention(*heads, scale=scale)
    return out.transpose(1, 2).reshape(b, s, d)


@mha.register_fake
def _mha_shape(q, k, v, num_heads, scale):
    return torch.empty_like(q)


@functools.cache
def _ort_mha():
    """``com.microsoft.MultiHeadAttention`` as an onnxscript op (ORT's contrib schema is not
    in onnx's registry, so its signature is declared here: q, k, v in; num_heads, scale)."""
    from onnx.defs import OpSchema
    from onnxscript._internal.values import Op, Opset

    param = OpSchema.FormalParameter
    schema = OpSchema(
        "MultiHeadAttention",
        "com.microsoft",
        1,
        inputs=[param("query", "T"), param("key", "T"), param("value", "T")],
        outputs=[param("output", "T")],
        type_constraints=[("T", ["tensor(float)"], "float32")],
        attributes=[
            OpSchema.Attribute("num_heads", OpSchema.AttrType.INT, "attention heads"),
            OpSchema.Attribute("scale", OpSchema.AttrType.FLOAT, "score scale"),
        ],
    )
    return Op(Opset("com.microsoft", 1), "MultiHeadAttention", schema)


def _mha_to_ort(q, k, v, num_heads: int, scale: float):
    return _ort_mha()(q, k, v, num_heads=num_heads, scale=scale)


def translation_table(target: GraphTarget) -> dict:
    """The exporter's custom translations for ``target`` (none: plain ops for TensorRT)."""
    return {torch.ops.epd.mha.default: _mha_to_ort} if target == "onnxruntime" else {}


def full_attention(
    q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, num_heads: int, scale: float, fused: bool
) -> torch.Tensor:
    """Every token attends to every token of its image: ``[B, S, D]`` -> ``[B, S, D]``."""
    if fused:
        return torch.ops.epd.mha(q, k, v, num_heads, scale)
    b, s, d = q.shape
    qh, kh, vh = (t.reshape(b, s, num_heads, d // num_heads).transpose(1, 2) for t in (q, k, v))
    scores = torch.matmul(qh, kh.transpose(2, 3)) * scale
    return torch.matmul(torch.softmax(scores, dim=-1), vh).transpose(1, 2).reshape(b, s, d)


def windowed_attention(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    num_heads: int,
    scale: float,
    window_index: torch.Tensor,
    window_inverse: torch.Tensor,
) -> torch.Tensor:
    """Attention within windows: ``window_index`` ``[W, L]`` lists each window's tokens
    (``N`` pads short windows), ``window_inverse`` ``[N]`` is each token's slot in the
    flattened ``[W * L]`` layout."""
    n, d = q.shape
    w, length = window_index.shape
    pad = torch.zeros(1, d, dtype=q.dtype)
    flat = window_index.reshape(-1)
    qw, kw, vw = (
        torch.cat([t, pad])[flat].reshape(w, length, num_heads, d // num_heads).transpose(1, 2)
        for t in (q, k, v)
    )
    valid = (window_index < n)[:, None, None, :]
    bias = torch.where(valid, 0.0, float("-inf"))
    scores = torch.matmul(qw, kw.transpose(2, 3)) * scale + bias
    out = torch.matmul(torch.softmax(scores, dim=-1), vw)  # [W, H, L, Dh]
    return out.transpose(1, 2).reshape(w * length, d)[window_inverse]


def rotary_cos_sin(
    position_ids: torch.Tensor, inv_freq: torch.Tensor
) -> tuple[torch.Tensor, torch.Tensor]:
    """2-D rotary angles of Qwen towers: (h, w) positions -> ``cos, sin`` ``[N, 1, head_dim]``."""
    freqs = (position_ids[..., None].float() * inv_freq).flatten(1)  # [N, head_dim / 2]
    emb = torch.cat([freqs, freqs], dim=-1)[:, None, :]
    return emb.cos(), emb.sin()


def apply_rotary(t: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    half = t.shape[-1] // 2
    return t * cos + torch.cat([-t[..., half:], t[..., :half]], dim=-1) * sin


def patch_projection(conv: nn.Module) -> tuple[nn.Parameter, nn.Parameter | None]:
    """A Conv3d/Conv2d whose stride equals its kernel, over one flattened patch, is a matmul
    with its flattened kernel: (weight ``[out, in * k...]``, bias or None)."""
    weight = nn.Parameter(
        conv.weight.detach().reshape(conv.weight.shape[0], -1), requires_grad=False
    )
    bias = None
    if conv.bias is not None:
        bias = nn.Parameter(conv.bias.detach().clone(), requires_grad=False)
    return weight, bias
