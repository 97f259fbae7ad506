"""Greedy outputs of plain offline ``vllm.LLM.chat`` for the e2e cases (the ground truth),
guided by a case's ``structured_outputs`` constraint where it has one.

vLLM's own chat path -- its rendering of the checkpoint's chat template and its tokenization
of the result (no special tokens added on top of the template's, as ``vllm serve``'s chat
endpoint) -- so the reference shares none of our prompt code.

Run as a subprocess (vLLM and NIXL are not fork-safe and heavy in the pytest process):
``python offline_reference.py TOPOLOGY.json CASES.json`` prints ``{case: text}`` as JSON.
"""

import base64
import json
import os
import sys
from pathlib import Path

from orchestrator.config import Topology
from orchestrator.encoder.preprocess import decode_image
from orchestrator.llm import engine_args, engine_env


def main() -> None:
    topology = Topology.model_validate_json(Path(sys.argv[1]).read_text())
    cases = json.loads(Path(sys.argv[2]).read_text())
    server = next(iter(topology.servers_of("aggregated")))
    os.environ.update(engine_env(topology, server, "aggregated"))
    from vllm import LLM, SamplingParams
    from vllm.sampling_params import StructuredOutputsParams

    llm = LLM(**engine_args(topology, server, "aggregated"))
    chats, params = [], []
    for case in cases.values():
        images = [decode_image(base64.b64decode(b)) for b in case["images"]]
        parts = [{"type": "image_pil", "image_pil": image} for image in images]
        parts.append({"type": "text", "text": case["text"]})  # text_input's shape
        chats.append([{"role": "user", "content": parts}])
        constraint = case.get("structured_outputs")
        params.append(
            SamplingParams(
                max_tokens=case["max_tokens"],
                temperature=0.0,
                structured_outputs=constraint and StructuredOutputsParams(**constraint),
            )
        )
    outputs = llm.chat(chats, params, use_tqdm=False)
    texts = {name: out.outputs[0].text for name, out in zip(cases, outputs, strict=True)}
    print("REFERENCE " + json.dumps(texts), flush=True)


if __name__ == "__main__":
    main()
