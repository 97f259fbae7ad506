"""Triton adapter for `decode`: vLLM KV consumer that streams the generated text."""

import triton_python_backend_utils as pb_utils

from orchestrator.handlers import DecodeHandler
from orchestrator.triton.runner import DecoupledModelRunner


class TritonPythonModel:
    def initialize(self, args):
        self.runner = DecoupledModelRunner(args, pb_utils, DecodeHandler.create)

    def execute(self, requests):
        self.runner.submit(requests)

    def finalize(self):
        self.runner.stop()
