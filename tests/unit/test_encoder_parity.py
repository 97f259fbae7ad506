"""Each family's exported ONNX vision encoder must reproduce the HF tower on real images.

The measured errors are printed in the test summary ("ONNX vs HF vision tower").
"""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

import numpy as np
import onnx
import pytest
import torch

from orchestrator.encoder.onnx_export import (
    META_ENCODER_ID,
    META_PREPROCESS,
    META_WEIGHTS_SHA,
    export_vision_encoder,
    read_metadata,
    vision_weights_sha256,
)
from orchestrator.encoder.runtime import OnnxRuntimeEncoder
from orchestrator.families import family_for
from tests.conftest import FAMILIES
from tests.unit.conftest import photo_named

# fp32 rounding through the tower, relative to the largest embedding value. Measured 1e-6 to
# 4e-6 across the families; a wrong position, window or patch order gives ~1e-1.
REL_TOL = 1e-5
ERRORS: dict[str, tuple[float, float]] = {}
"""Largest (absolute, relative) error per family and target, for the summary."""


@pytest.fixture(scope="module")
def hf_models(hub_checkpoint):
    from transformers import AutoModelForImageTextToText

    cache = {}

    def get(family: str):
        if family not in cache:
            path = hub_checkpoint(family)
            model = AutoModelForImageTextToText.from_pretrained(path, dtype=torch.float32)
            cache[family] = model.eval()
        return cache[family]

    return get


def hf_embeddings(name: str, model, image) -> np.ndarray:
    """What the HF model feeds its language model for ``image`` (DeepStack levels appended
    for Qwen3-VL, the way vLLM takes them)."""
    from transformers import AutoImageProcessor

    processor = AutoImageProcessor.from_pretrained(model.config._name_or_path, backend="pil")
    inputs = processor(images=[image], return_tensors="pt")
    with torch.no_grad():
        if name == "llava":
            out = model.model.get_image_features(pixel_values=inputs["pixel_values"])
            features = out.pooler_output if hasattr(out, "pooler_output") else out
            features = features[0] if isinstance(features, list | tuple) else features
            return features.reshape(-1, features.shape[-1]).numpy()
        out = model.model.visual(inputs["pixel_values"], grid_thw=inputs["image_grid_thw"])
        levels = list(out.deepstack_features or []) if name == "qwen3_vl" else []
        return torch.cat([out.pooler_output, *levels], dim=-1).numpy()


def rel_err(got: np.ndarray, ref: np.ndarray) -> float:
    return float(np.abs(got - ref).max() / np.abs(ref).max())


@pytest.mark.parametrize("target", ["onnxruntime", "tensorrt"])
@pytest.mark.parametrize("name", FAMILIES)
def test_export_matches_the_hf_tower(name, target, exported, hub_checkpoint, hf_models):
    """The TensorRT-target graph (plain attention ops) runs in ONNX Runtime too: its maths
    is checked here even where TensorRT itself cannot run."""
    family = family_for(hub_checkpoint(name))
    runtime = OnnxRuntimeEncoder(exported(name, target), intra_op_threads=1)
    assert runtime.hidden_size == family.hidden_size
    photos = ("astronaut", "large_1000x700", "tiny_12x9", "wide_900x40", "gray_camera")
    worst, worst_abs = 0.0, 0.0
    for photo in photos:
        image = photo_named(photo)
        encoder_input = family.encoder_input(image)
        embeds = runtime.run(encoder_input.feeds)
        ref = hf_embeddings(name, hf_models(name), image)
        assert embeds.shape == ref.shape == (encoder_input.layout.tokens, family.hidden_size)
        worst = max(worst, rel_err(embeds, ref))
        worst_abs = max(worst_abs, float(np.abs(embeds - ref).max()))
    ERRORS[f"{name} ({target})"] = (worst_abs, worst)
    assert worst < REL_TOL, f"{name}: relative error {worst:.2e}"


def _ops(path: Path) -> list[tuple[str, str]]:
    graph = onnx.load(str(path), load_external_data=False).graph
    return [(n.domain, n.op_type) for n in graph.node]


@pytest.mark.parametrize("name", FAMILIES)
def test_full_attention_is_one_fused_op_for_onnx_runtime(name, exported, hub_checkpoint):
    """ORT's MultiHeadAttention runs MLAS flash attention on CPU (memory linear in the
    image); the TensorRT graph keeps plain ops for TensorRT to fuse. Qwen2-VL and Qwen3-VL
    attend fully in every block, so their ORT graph has no Softmax (no N x N scores) at all;
    Qwen2.5-VL keeps one per windowed block (scores of 64-patch windows)."""
    config = family_for(hub_checkpoint(name)).vision_config
    blocks = config.get("depth") or config["num_hidden_layers"]
    windowed = blocks - len(config["fullatt_block_indexes"]) if name == "qwen2_5_vl" else 0
    run = blocks - 1 if name == "llava" else blocks  # LLaVA's features come from layer -2
    ort_ops, trt_ops = _ops(exported(name)), _ops(exported(name, "tensorrt"))
    assert ort_ops.count(("com.microsoft", "MultiHeadAttention")) == run - windowed
    assert ort_ops.count(("", "Softmax")) == windowed
    assert trt_ops.count(("", "Softmax")) == run
    assert not [op for op in trt_ops if op[0] not in ("", "ai.onnx")]


def test_wrong_positions_are_detected(exported, hub_checkpoint, hf_models):
    """Guards the tolerance: positions in raster instead of merge-block order must fail it."""
    family = family_for(hub_checkpoint("qwen2_vl"))
    image = photo_named("astronaut")
    feeds = dict(family.encoder_input(image).feeds)
    _, h, w = family.encoder_input(image).layout.grid_thw
    feeds["position_ids"] = np.stack(np.divmod(np.arange(h * w), w), axis=-1).astype(np.int64)
    wrong = OnnxRuntimeEncoder(exported("qwen2_vl")).run(feeds)
    assert rel_err(wrong, hf_embeddings("qwen2_vl", hf_models("qwen2_vl"), image)) > 100 * REL_TOL


def test_metadata_identifies_the_encoder(exported, hub_checkpoint, hf_models):
    family = family_for(hub_checkpoint("qwen2_vl"))
    meta = read_metadata(exported("qwen2_vl"))
    sha = vision_weights_sha256(hf_models("qwen2_vl").model.visual.state_dict())
    assert meta[META_WEIGHTS_SHA] == sha
    assert meta[META_ENCODER_ID] == f"qwen2_vl-vision-{sha[:16]}"
    assert meta[META_PREPROCESS] == family.preprocess_fingerprint()


def test_export_is_deterministic(tiny_model, tmp_path) -> None:
    first = export_vision_encoder(tiny_model, tmp_path / "a" / "model.onnx")
    again = export_vision_encoder(tiny_model, tmp_path / "b" / "model.onnx")
    assert again.read_bytes() == first.read_bytes()


def test_large_towers_export_with_external_data(hub_checkpoint, tmp_path, monkeypatch):
    """Past the threshold the weights go to ``model.onnx.data`` beside the graph (one
    protobuf cannot hold a 2.6 GB tower); the pair loads and computes the same."""
    import orchestrator.encoder.onnx_export as export

    path = hub_checkpoint("qwen2_5_vl")
    small = export.export_vision_encoder(path, tmp_path / "one" / "model.onnx")
    monkeypatch.setattr(export, "EXTERNAL_DATA_BYTES", 0)
    split = export.export_vision_encoder(path, tmp_path / "two" / "model.onnx")
    data = split.with_name("model.onnx.data")
    assert data.stat().st_size > split.stat().st_size
    assert not small.with_name("model.onnx.data").exists()
    feeds = family_for(path).encoder_input(photo_named("coffee")).feeds
    np.testing.assert_array_equal(
        OnnxRuntimeEncoder(split).run(feeds), OnnxRuntimeEncoder(small).run(feeds)
    )


def test_model_build_is_deterministic(tiny_model, tmp_path) -> None:
    from orchestrator.model.build import build_model

    same = build_model(tmp_path / "same", seed=0)
    other = build_model(tmp_path / "other", seed=1)
    weights = (tiny_model / "model.safetensors").read_bytes()
    assert (same / "model.safetensors").read_bytes() == weights
    assert (other / "model.safetensors").read_bytes() != weights
    for name in ("tokenizer.json", "config.json", "processor_config.json"):
        assert (same / name).read_bytes() == (tiny_model / name).read_bytes()


def test_runtime_names_missing_inputs(exported) -> None:
    runtime = OnnxRuntimeEncoder(exported("qwen2_vl"))
    with pytest.raises(ValueError, match="inputs missing: \\['position_ids'\\]"):
        runtime.run({"pixel_values": np.zeros((4, 1176), np.float32)})


def test_importing_the_runtimes_loads_no_tensorrt() -> None:
    """TensorRT is imported by its runtime only: CPU hosts have none."""
    code = "import orchestrator.encoder.runtime, sys; print('tensorrt' in sys.modules)"
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True)
    assert out.stdout.strip() == "False"
