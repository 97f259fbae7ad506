"""Offline vLLM on the same requests: the yardstick for ``epd``'s own overhead.

Runs in its own process (``python -m epd_bench.offline PLAN_JSON MODEL_DIR``):
one ``AsyncLLM`` built with exactly the aggregated model's engine args, fed the plan's
requests in-process (same prompts, same decoded images, same sampling) with the same
closed/open-loop driver, and prints one ``RunResult`` JSON per load point, target
``offline-vllm``. No Triton, no gRPC, no transfers: what is left is vLLM itself.
"""

from __future__ import annotations

import asyncio
import dataclasses
import json
import subprocess
import sys
import time
from pathlib import Path

from epd_bench.load import LoadPlan, LoadRequest, Sample, measure, plan_requests, reduce
from epd_bench.schema import RunResult

TARGET = "offline-vllm"


async def _run(plan: LoadPlan, model: Path) -> list[RunResult]:
    from orchestrator.config import default_topology
    from orchestrator.encoder.preprocess import decode_image
    from orchestrator.frontend import PromptBuilder, user_turn
    from orchestrator.llm import LLMEngine, engine_args, engine_env, to_vllm_sampling
    from orchestrator.protocol import SamplingOptions

    topology = default_topology(model)
    server, _ = topology.server_of("aggregated")
    engine = LLMEngine(
        engine_args(topology, server, "aggregated"), engine_env(topology, server, "aggregated")
    )
    prompts = PromptBuilder.for_topology(topology, ("aggregated",))
    sampling = to_vllm_sampling(SamplingOptions(max_tokens=plan.max_tokens, temperature=0))

    async def send(request: LoadRequest) -> Sample:
        sample = Sample(request.kind, time.perf_counter())
        try:
            images = [decode_image(data) for data in request.images]
            turn = user_turn(request.text, len(images))
            prompt = {"prompt_token_ids": prompts.render_now([turn]).token_ids}
            if images:
                prompt["multi_modal_data"] = {"image": images}
            async for out in engine.generate(prompt, sampling):
                if out.outputs[0].text:
                    sample.piece_times.append(time.perf_counter() - sample.start)
                    sample.text += out.outputs[0].text
        except Exception as exc:  # noqa: BLE001 - recorded like the gRPC driver does
            sample.error = f"{type(exc).__name__}: {exc}"
        sample.latency_s = time.perf_counter() - sample.start
        sample.ttft_s = sample.piece_times[0] if sample.piece_times else None
        return sample

    results = []
    try:
        from epd_bench.load import WORKLOADS

        for request in WORKLOADS["mixed"](plan.warmup, 10**6):
            await send(request)
        for workload, load, level, requests in plan_requests(plan):
            label = f"{workload} {TARGET} {load}={level:g}"
            samples, wall = await measure(send, requests, load, level, label)
            results.append(
                reduce(samples, wall, target=TARGET, workload=workload, load=load, level=level)
            )
    finally:
        engine.shutdown()
    return results


def run(plan: LoadPlan, model: Path, timeout_s: float) -> list[RunResult]:
    """The offline runs in a child process (vLLM owns its process; nothing leaks into ours)."""
    proc = subprocess.run(
        [
            sys.executable,
            "-m",
            "epd_bench.offline",
            json.dumps(dataclasses.asdict(plan)),
            str(model),
        ],
        capture_output=True,
        text=True,
        timeout=timeout_s,
    )
    if proc.returncode:
        raise RuntimeError(f"offline vLLM run failed ({proc.returncode}):\n{proc.stderr[-3000:]}")
    return [
        RunResult.model_validate_json(line[3:])
        for line in proc.stdout.splitlines()
        if line.startswith("@@ ")
    ]


if __name__ == "__main__":
    raw = json.loads(sys.argv[1])
    plan = LoadPlan(**{k: tuple(v) if isinstance(v, list) else v for k, v in raw.items()})
    for result in asyncio.run(_run(plan, Path(sys.argv[2]))):
        print("@@ " + result.model_dump_json(), flush=True)
