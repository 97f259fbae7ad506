"""Triton adapter for `decode`: vLLM decode (NixlConnector kv_consumer): pulls prefill's KV and streams tokens."""

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
