"""Triton adapter for `prefill`: vLLM KV producer fed with embeddings pulled by handle."""

import triton_python_backend_utils as pb_utils

from orchestrator.handlers import PrefillHandler
from orchestrator.triton.runner import DecoupledModelRunner


class TritonPythonModel:
    def initialize(self, args):
        self.runner = DecoupledModelRunner(args, pb_utils, PrefillHandler.create)

    def execute(self, requests):
        self.runner.submit(requests)

    def finalize(self):
        self.runner.stop()
