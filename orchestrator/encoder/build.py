"""Build the vision encoder's TensorRT plan on a GPU host and check it against ONNX Runtime.

This is the script a GPU machine runs (``epd encoder build --trt MODEL_DIR``): it exports the
graph for TensorRT (plain attention ops), builds ``vision_encoder.plan`` next to the model
(where ``epd render`` picks it up for ``encoder.runtime: tensorrt``) and reports the plan's
error against the ONNX Runtime export on real photos. It cannot run on CPU-only machines;
there it stops at once and says why.
"""

from __future__ import annotations

import tempfile
from pathlib import Path

import numpy as np

from orchestrator.client import sample_photo
from orchestrator.encoder.onnx_export import export_vision_encoder
from orchestrator.encoder.preprocess import decode_image
from orchestrator.encoder.runtime import OnnxRuntimeEncoder, TensorRTEncoder, require_tensorrt
from orchestrator.families import family_for

PHOTOS = ("astronaut", "coffee", "chelsea")


def build_tensorrt_plan(model_dir: Path, plan: Path | None = None, fp16: bool = False) -> dict:
    """Export, build, compare; returns the plan path and the max abs/rel error per photo."""
    require_tensorrt()  # fail before minutes of export work on a machine that cannot build
    family = family_for(model_dir)
    plan = plan or model_dir / "vision_encoder.plan"
    with tempfile.TemporaryDirectory() as tmp:
        ort_path = export_vision_encoder(model_dir, Path(tmp) / "ort" / "model.onnx")
        trt_path = export_vision_encoder(
            model_dir, Path(tmp) / "trt" / "model.onnx", target="tensorrt"
        )
        reference = OnnxRuntimeEncoder(ort_path)
        engine = TensorRTEncoder(trt_path, engine_path=plan, fp16=fp16)
        errors = {}
        for name in PHOTOS:
            feeds = family.encoder_input(decode_image(sample_photo(name))).feeds
            want, got = reference.run(feeds), engine.run(feeds)
            abs_err = float(np.abs(got - want).max())
            errors[name] = {"max_abs": abs_err, "max_rel": abs_err / float(np.abs(want).max())}
    return {"plan": str(plan), "fp16": fp16, "errors": errors}
