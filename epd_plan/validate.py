"""``epd plan validate``: the simulator's predictions against real runs on this machine.

For each workload (image-heavy, text-heavy, repeated images) it runs a real one-box
deployment (the default E+PD, one encoder and one engine, or ``--topology``: E+PD or E/P/D
with one server per stage, conditional disaggregation included) under open-loop Poisson
load with ``epd bench run``'s load generator, then simulates the same fleet under the same
workload -- the same rate as offered (the load generator's Poisson draw), the prompt and
image sizes of the requests sent, the output lengths the model produced -- from the
profiles, and prints
predicted / measured for TTFT p50 and p90, time per output token and throughput.
A benchmark, not a test: this box is shared and noisy.
"""

from __future__ import annotations

import asyncio
import io
from collections import Counter
from dataclasses import dataclass
from typing import Any

from epd_plan.profile import Profiles
from epd_plan.simulate import Fleet, StageCount, simulate
from epd_plan.workload import PlanInputError, Workload
from orchestrator.config import Topology

SCENARIOS = {"image-heavy": "image", "text-heavy": "text", "repeated": "repeated"}
"""Validation workload -> ``epd bench run`` workload."""
REPEAT_POOL = 4
"""Distinct photos the ``repeated`` bench workload cycles through."""


@dataclass(frozen=True)
class Comparison:
    scenario: str
    rate_rps: float
    measured: dict[str, float]
    predicted: dict[str, float]

    def ratios(self) -> dict[str, float]:
        return {k: self.predicted[k] / self.measured[k] for k in self.measured if self.measured[k]}


def fleet_of(topology: Topology, profiles: Profiles) -> Fleet:
    """The simulator's fleet for a one-box ``topology``: one encoder and one server per
    engine stage, on the profiled hardware (the first profiled machine of each kind)."""
    if topology.one_engine:
        layout, stages = "E+PD", ("encode", "pd")
    elif topology.servers_of("prefill") and topology.servers_of("decode"):
        layout, stages = "E/P/D", ("encode", "prefill", "decode")
    else:
        raise PlanInputError("validate runs an E+PD or an E/P/D topology")
    several = [s for s in stages if len(topology.servers_of(s)) != 1]
    if several:
        raise PlanInputError(
            f"validate simulates one box: one server per stage, not several for {several}"
        )
    encode = profiles.machines("encode")[0].name
    engine = profiles.machines("prefill")[0].name
    counts = {s: StageCount(encode if s == "encode" else engine, 1) for s in stages}
    return Fleet(layout, counts, topology.routing.max_local_prefill_tokens)


def _workload_of(
    requests: list, topology: Topology, rate: float, output_tokens: float, bench: str
) -> Workload:
    """The simulator's workload for requests like ``requests`` at ``rate``."""
    from PIL import Image

    from orchestrator.families import family_for
    from orchestrator.frontend import PromptBuilder, user_turn
    from orchestrator.protocol import SamplingOptions

    prompts = PromptBuilder.for_topology(topology, topology.llm_stages)
    family = family_for(topology.model)
    sizes: Counter[str] = Counter()
    text_tokens = []
    for request in requests:
        prompt = prompts.render_now([user_turn(request.text, len(request.images))])
        images = [Image.open(io.BytesIO(data)).size for data in request.images]
        for width, height in images:
            sizes[f"{width}x{height}"] += 1
        tokens = [family.image_layout(w, h).tokens for w, h in images]
        total, _ = prompts.fit(prompt, tokens, SamplingOptions(max_tokens=1))
        text_tokens.append(total - sum(tokens))
    with_images = sum(1 for r in requests if r.images)
    duration = max(600.0, 3000 / rate)
    return Workload(
        rate_rps=rate,
        image_share=with_images / len(requests),
        images_per_request=max((len(r.images) for r in requests), default=1) or 1,
        resolutions=dict(sizes) or {"448x448": 1.0},
        prompt_tokens=round(sum(text_tokens) / len(text_tokens)),
        output_tokens=max(1, round(output_tokens)),
        image_pool=REPEAT_POOL if bench == "repeated" else 0,
        duration_s=duration,
        warmup_s=duration / 10,
    )


def realized_rate(rate: float, requests: int, seed: int = 0) -> float:
    """The rate ``epd bench run``'s open loop actually offers: it draws its Poisson gaps
    from ``random.Random(seed)``, and over a few hundred requests the draw is off the
    nominal rate by several percent."""
    import random

    rng = random.Random(seed)
    span = sum(rng.expovariate(rate) for _ in range(requests - 1))
    return (requests - 1) / span


def run(
    topology: Topology,
    fleet: Fleet,
    profiles: Profiles,
    rates: dict[str, float],
    requests: int,
    timeout_s: float,
) -> list[Comparison]:
    from epd_bench.load import WORKLOADS, LoadPlan, execute
    from epd_bench.quick import embedded

    """Run ``topology`` under each workload, then simulate ``fleet`` (its ``fleet_of``)."""
    results = {}
    with embedded(topology, timeout_s) as running:
        url = running.server_of("epd")[1].grpc_url
        for scenario, rate in rates.items():
            plan = LoadPlan(
                models=("epd",), workloads=(SCENARIOS[scenario],), rates=(rate,),
                requests=requests, max_tokens=16,
            )  # fmt: skip
            (result,) = asyncio.run(execute(url, plan))
            results[scenario] = result
    comparisons = []
    for scenario, rate in rates.items():
        result = results[scenario]
        ok = result.requests - result.errors
        output_tokens = result.tokens_per_s * result.duration_s / ok
        sent = WORKLOADS[SCENARIOS[scenario]](requests, 0)
        offered = realized_rate(rate, requests)
        workload = _workload_of(sent, topology, offered, output_tokens, SCENARIOS[scenario])
        p = simulate(fleet, profiles, workload, one_host=True)
        measured = {
            "ttft_p50_s": result.ttft_s.p50,
            "ttft_p90_s": result.ttft_s.p90,
            "tpot_p50_s": result.itl_s.p50,
            "throughput_rps": result.requests_per_s,
        }
        predicted = {
            "ttft_p50_s": p.ttft_s.p50,
            "ttft_p90_s": p.ttft_s.p90,
            "tpot_p50_s": p.tpot_s.p50,
            "throughput_rps": p.throughput_rps,
        }
        comparisons.append(Comparison(scenario, offered, measured, predicted))
    return comparisons


def table(comparisons: list[Comparison]) -> str:
    lines = [
        f"{'workload':<12} {'rate':>5}  {'metric':<15} {'measured':>10} {'predicted':>10} "
        f"{'pred/meas':>9}"
    ]
    for c in comparisons:
        ratios = c.ratios()
        for metric, value in c.measured.items():
            ms = 1e3 if metric.endswith("_s") else 1.0
            unit = " ms" if ms != 1.0 else ""
            lines.append(
                f"{c.scenario:<12} {c.rate_rps:>5.2f}  {metric:<15} {value * ms:>10.1f} "
                f"{c.predicted[metric] * ms:>10.1f} {ratios.get(metric, float('nan')):>8.2f}x"
                f"{unit}"
            )
    return "\n".join(lines)


def report(comparisons: list[Comparison], command: str) -> dict[str, Any]:
    from epd_bench.schema import machine_info

    return {
        "command": command,
        "machine": machine_info(),
        "comparisons": [
            {
                "workload": c.scenario,
                "rate_rps": c.rate_rps,
                "measured": c.measured,
                "predicted": c.predicted,
                "ratios": c.ratios(),
            }
            for c in comparisons
        ],
    }
