"""Greedy outputs of plain offline ``vllm.LLM.generate`` for the e2e cases (the ground truth).

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
from orchestrator.frontend import PromptBuilder
from orchestrator.llm import engine_args, engine_env


def main() -> None:
    topology = Topology.model_validate_json(Path(sys.argv[1]).read_text())
    cases = json.loads(Path(sys.argv[2]).read_text())
    server = next(iter(topology.servers_of("aggregated")))
    os.environ.update(engine_env(topology, server, "aggregated"))
    from vllm import LLM, SamplingParams

    llm = LLM(**engine_args(topology, server, "aggregated"))
    prompts = PromptBuilder.for_topology(topology, ("aggregated",))
    requests, params = [], []
    for case in cases.values():
        images = [decode_image(base64.b64decode(b)) for b in case["images"]]
        request = {"prompt": prompts.build(case["text"], len(images))}
        if images:
            request["multi_modal_data"] = {"image": images}
        requests.append(request)
        params.append(SamplingParams(max_tokens=case["max_tokens"], temperature=0.0))
    outputs = llm.generate(requests, params, use_tqdm=False)
    texts = {name: out.outputs[0].text for name, out in zip(cases, outputs, strict=True)}
    print("REFERENCE " + json.dumps(texts), flush=True)


if __name__ == "__main__":
    main()
