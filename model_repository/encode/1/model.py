"""Triton adapter for `encode`: images in, metadata-only embedding handles out."""

import triton_python_backend_utils as pb_utils

from orchestrator.handlers import EncodeHandler
from orchestrator.triton.runner import DecoupledModelRunner


class TritonPythonModel:
    def initialize(self, args):
        self.runner = DecoupledModelRunner(args, pb_utils, EncodeHandler.create)

    def execute(self, requests):
        self.runner.submit(requests)

    def finalize(self):
        self.runner.stop()
