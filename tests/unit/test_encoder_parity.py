"""The exported ONNX vision encoder must reproduce HF's vision tower on real images."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

import numpy as np
import onnx
import pytest
import skimage.data
import torch
from PIL import Image

from orchestrator.encoder.onnx_export import (
    META_ENCODER_ID,
    META_PREPROCESS,
    META_WEIGHTS_SHA,
    export_vision_encoder,
    vision_weights_sha256,
)
from orchestrator.encoder.preprocess import PreprocessConfig, preprocess
from orchestrator.encoder.runtime import OnnxRuntimeEncoder, make_encoder_runtime

# fp32 rounding through the tower, relative to the largest embedding value. Measured ~2.5e-6
# (HF fp32 itself is ~2e-6 away from fp64 here); a wrong position or patch order gives ~1e-1.
REL_TOL = 1e-5


@pytest.fixture(scope="module")
def runtime(tiny_onnx: Path) -> OnnxRuntimeEncoder:
    return OnnxRuntimeEncoder(tiny_onnx, intra_op_threads=1)


def _hf_embeds(hf_model, pixel_values: np.ndarray, grids: np.ndarray) -> np.ndarray:
    with torch.no_grad():
        out = hf_model.model.visual(
            torch.from_numpy(pixel_values), grid_thw=torch.from_numpy(grids)
        )
    return out.pooler_output.numpy()


def _rel_err(got: np.ndarray, ref: np.ndarray) -> float:
    return float(np.abs(got - ref).max() / np.abs(ref).max())


def test_matches_hf_vision_tower(photo, preprocess_cfg, runtime, hf_model) -> None:
    pixel_values, grid = preprocess(photo, preprocess_cfg)
    embeds = runtime.encode(pixel_values, grid)
    ref = _hf_embeds(hf_model, pixel_values, np.array([grid]))
    assert (
        embeds.shape
        == ref.shape
        == (grid[1] * grid[2] // 4, hf_model.config.text_config.hidden_size)
    )
    assert _rel_err(embeds, ref) < REL_TOL


def test_several_images_in_one_call(preprocess_cfg, runtime, hf_model) -> None:
    """Segment masking keeps images independent: a batch equals the images one by one."""
    items = [
        preprocess(Image.fromarray(getattr(skimage.data, n)()), preprocess_cfg)
        for n in ("astronaut", "coffee", "chelsea")
    ]
    pixel_values = np.concatenate([pv for pv, _ in items])
    grids = np.array([g for _, g in items])
    batched = runtime.encode(pixel_values, grids)
    single = np.concatenate([runtime.encode(pv, g) for pv, g in items])
    assert _rel_err(batched, single) < REL_TOL
    assert _rel_err(batched, _hf_embeds(hf_model, pixel_values, grids)) < REL_TOL


def test_wrong_positions_are_detected(preprocess_cfg, runtime, hf_model) -> None:
    """Guards the tolerance: positions in raster instead of merge-block order must fail it."""
    pixel_values, grid = preprocess(Image.fromarray(skimage.data.astronaut()), preprocess_cfg)
    _, h, w = grid
    raster = np.stack(np.divmod(np.arange(h * w), w), axis=-1).astype(np.int64)
    wrong = runtime.run_graph(pixel_values, raster, np.zeros(h * w, dtype=np.int64))
    ref = _hf_embeds(hf_model, pixel_values, np.array([grid]))
    assert _rel_err(wrong, ref) > 100 * REL_TOL


def test_metadata_identifies_encoder(tiny_onnx, preprocess_cfg, runtime, hf_model) -> None:
    meta = {p.key: p.value for p in onnx.load(str(tiny_onnx)).metadata_props}
    sha = vision_weights_sha256(hf_model.model.visual)
    assert meta[META_WEIGHTS_SHA] == sha
    assert meta[META_ENCODER_ID] == runtime.encoder_id == f"qwen2vl-vision-{sha[:16]}"
    assert meta[META_PREPROCESS] == preprocess_cfg.canonical_json()
    assert (runtime.merge_size, runtime.hidden_size) == (2, 128)


def test_export_is_deterministic(tiny_model, tiny_onnx, tmp_path) -> None:
    again = export_vision_encoder(tiny_model, tmp_path / "again.onnx")
    assert again.read_bytes() == tiny_onnx.read_bytes()


def test_model_build_is_deterministic(tiny_model, tmp_path) -> None:
    from orchestrator.model.tiny import build_model

    same = build_model(tmp_path / "same", seed=0)
    other = build_model(tmp_path / "other", seed=1)
    weights = (tiny_model / "model.safetensors").read_bytes()
    assert (same / "model.safetensors").read_bytes() == weights
    assert (other / "model.safetensors").read_bytes() != weights
    for name in ("tokenizer.json", "config.json", "processor_config.json"):
        assert (same / name).read_bytes() == (tiny_model / name).read_bytes()


def test_encode_rejects_mismatched_grid(preprocess_cfg: PreprocessConfig, runtime) -> None:
    pixel_values, _ = preprocess(Image.fromarray(skimage.data.coffee()), preprocess_cfg)
    with pytest.raises(ValueError, match="do not match"):
        runtime.encode(pixel_values, (1, 4, 4))
    with pytest.raises(ValueError, match="merge_size"):
        runtime.encode(pixel_values[:15], (1, 3, 5))


def test_factory_is_lazy_and_strict(tiny_onnx: Path) -> None:
    assert isinstance(make_encoder_runtime("onnxruntime", tiny_onnx), OnnxRuntimeEncoder)
    with pytest.raises(ValueError, match="unknown encoder runtime"):
        make_encoder_runtime("openvino", tiny_onnx)  # type: ignore[arg-type]
    code = "import orchestrator.encoder.runtime, sys; print('tensorrt' in sys.modules)"
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True)
    assert out.stdout.strip() == "False"
