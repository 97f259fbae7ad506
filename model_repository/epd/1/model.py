"""Triton adapter for `epd`: the public entry point, routing Encode -> Prefill -> Decode."""

import triton_python_backend_utils as pb_utils

from orchestrator.pipeline import EPDPipeline
from orchestrator.triton.runner import DecoupledModelRunner


class TritonPythonModel:
    def initialize(self, args):
        self.runner = DecoupledModelRunner(args, pb_utils, EPDPipeline.create, public=True)

    def execute(self, requests):
        self.runner.submit(requests)

    def finalize(self):
        self.runner.stop()
