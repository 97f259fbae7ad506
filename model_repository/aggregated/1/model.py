"""Triton adapter for `aggregated`: the one-engine baseline (pixels in, text out)."""

import triton_python_backend_utils as pb_utils

from orchestrator.handlers import AggregatedHandler
from orchestrator.triton.runner import DecoupledModelRunner


class TritonPythonModel:
    def initialize(self, args):
        self.runner = DecoupledModelRunner(args, pb_utils, AggregatedHandler.create, public=True)

    def execute(self, requests):
        self.runner.submit(requests)

    def finalize(self):
        self.runner.stop()
