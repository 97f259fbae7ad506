"""Build the vision encoder's TensorRT plan on a GPU host and check it against ONNX Runtime.

This is the script a GPU machine runs (``epd encoder build --trt MODEL_DIR``): it exports
the ONNX file, builds ``vision_encoder.plan`` next to the model (where ``epd render`` picks it
up for ``encoder.runtime: tensorrt``) and reports the plan's error against ONNX Runtime on
real photos. It cannot run on CPU-only machines; there it stops at once and says why.
"""

from __future__ import annotations

import tempfile
from pathlib import Path

import numpy as np

from orchestrator.client import sample_photo
from orchestrator.encoder.onnx_export import export_vision_encoder
from orchestrator.encoder.preprocess import PreprocessConfig, decode_image, preprocess
from orchestrator.encoder.runtime import OnnxRuntimeEncoder, TensorRTEncoder, require_tensorrt

PHOTOS = ("astronaut", "coffee", "chelsea")


def build_tensorrt_plan(model_dir: Path, plan: Path | None = None, fp16: bool = False) -> dict:
    """Export, build, compare; returns the plan path and the max abs/rel error per photo."""
    require_tensorrt()  # fail before minutes of export work on a machine that cannot build
    plan = plan or model_dir / "vision_encoder.plan"
    with tempfile.TemporaryDirectory() as tmp:
        onnx_path = export_vision_encoder(model_dir, Path(tmp) / "vision_encoder.onnx")
        reference = OnnxRuntimeEncoder(onnx_path)
        engine = TensorRTEncoder(onnx_path, engine_path=plan, fp16=fp16)
        config = PreprocessConfig.from_model_dir(model_dir)
        errors = {}
        for name in PHOTOS:
            pixel_values, grid = preprocess(decode_image(sample_photo(name)), config)
            want = reference.encode(pixel_values, grid)
            got = engine.encode(pixel_values, grid)
            abs_err = float(np.abs(got - want).max())
            errors[name] = {"max_abs": abs_err, "max_rel": abs_err / float(np.abs(want).max())}
    return {"plan": str(plan), "fp16": fp16, "errors": errors}
