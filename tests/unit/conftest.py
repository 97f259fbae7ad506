"""Shared fixtures for encoder unit tests: one tiny model and one ONNX export per session."""

from __future__ import annotations

from pathlib import Path

import pytest
import skimage.data
from PIL import Image

from orchestrator.encoder.preprocess import PreprocessConfig


@pytest.fixture(scope="session")
def preprocess_cfg(tiny_model: Path) -> PreprocessConfig:
    return PreprocessConfig.from_model_dir(tiny_model)


@pytest.fixture(scope="session")
def tiny_onnx(tiny_model: Path, tmp_path_factory: pytest.TempPathFactory) -> Path:
    from orchestrator.encoder.onnx_export import export_vision_encoder

    return export_vision_encoder(tiny_model, tmp_path_factory.mktemp("onnx") / "vision.onnx")


@pytest.fixture(scope="session")
def hf_model(tiny_model: Path):
    import torch
    from transformers import Qwen2VLForConditionalGeneration

    model = Qwen2VLForConditionalGeneration.from_pretrained(tiny_model, dtype=torch.float32)
    return model.eval()


PHOTO_NAMES = ("astronaut", "coffee", "chelsea", "strip_30x500", "large_1000x700", "gray_camera")


def _photo(name: str) -> Image.Image:
    """Real photos plus odd sizes: a 30x500 strip (upscaled) and a 1000x700 (downscaled)."""
    if name == "strip_30x500":
        return _photo("coffee").resize((30, 500), Image.Resampling.BILINEAR)
    if name == "large_1000x700":
        return _photo("astronaut").resize((1000, 700), Image.Resampling.BILINEAR)
    if name == "gray_camera":
        return Image.fromarray(skimage.data.camera())
    return Image.fromarray(getattr(skimage.data, name)())


@pytest.fixture(scope="session", params=PHOTO_NAMES)
def photo(request: pytest.FixtureRequest) -> Image.Image:
    """Each test using this runs once per photo."""
    return _photo(request.param)
