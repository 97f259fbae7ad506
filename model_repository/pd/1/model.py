"""Triton adapter for `pd`: one vLLM engine that pulls the embeddings and streams the text."""

import triton_python_backend_utils as pb_utils

from orchestrator.handlers import PrefillDecodeHandler
from orchestrator.triton.runner import DecoupledModelRunner


class TritonPythonModel:
    def initialize(self, args):
        self.runner = DecoupledModelRunner(args, pb_utils, PrefillDecodeHandler.create)

    def execute(self, requests):
        self.runner.submit(requests)

    def finalize(self):
        self.runner.stop()
