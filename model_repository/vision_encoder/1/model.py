"""Triton adapter for `vision_encoder`: the exported vision tower on ONNX Runtime (CPU)."""

import json
from pathlib import Path

import triton_python_backend_utils as pb_utils

from orchestrator.encoder.onnx_export import OUTPUT_NAME
from orchestrator.encoder.runtime import OnnxRuntimeEncoder
from orchestrator.triton.runner import dump_stacks_on_signal


class TritonPythonModel:
    def initialize(self, args):
        dump_stacks_on_signal()
        params = json.loads(args["model_config"]).get("parameters", {})
        threads = int(params.get("intra_op_threads", {}).get("string_value", "0"))
        model_file = Path(args["model_repository"]) / args["model_version"] / "model.onnx"
        self.encoder = OnnxRuntimeEncoder(model_file, intra_op_threads=threads)

    def execute(self, requests):
        responses = []
        for request in requests:
            feeds = {
                name: pb_utils.get_input_tensor_by_name(request, name).as_numpy()
                for name in self.encoder.input_names
            }
            try:
                embeds = self.encoder.run(feeds)
                out = pb_utils.InferenceResponse([pb_utils.Tensor(OUTPUT_NAME, embeds)])
            except Exception as exc:  # noqa: BLE001 - reported to the caller
                out = pb_utils.InferenceResponse(error=pb_utils.TritonError(f"INTERNAL: {exc}"))
            responses.append(out)
        return responses
