"""From profiles, a workload and an SLO to the cheapest fleet that meets the SLO.

For each layout (``aggregated``, ``E+PD``, ``E/P/D``) and each choice of profiled hardware
per stage, the search starts from one replica per stage, simulates, and grows the stage the
simulation names as the bottleneck (in proportion to how far over its target utilisation
it is) until the SLO holds; then it gives back replicas one stage at a time while the SLO
still holds. A fleet whose stages are all lightly loaded and still misses the SLO has hit
the latency floor of its hardware: no count fixes that, and the plan says so.
"""

from __future__ import annotations

import itertools
import math
from dataclasses import dataclass, field
from pathlib import Path

from epd_plan.profile import Profiles
from epd_plan.simulate import LAYOUT_STAGES, LAYOUTS, Fleet, Layout, Prediction, StageCount
from epd_plan.simulate import simulate as run_simulation
from epd_plan.workload import Slo, Workload
from orchestrator.config import RoutingSpec, ServerSpec, Topology

TARGET_UTILIZATION = 0.8
"""How busy the search lets the bottleneck stage get before adding replicas to it."""
FLOOR_UTILIZATION = 0.5
"""Below this on every stage, a missed SLO is the hardware's latency floor."""


@dataclass
class LayoutPlan:
    layout: Layout
    fleet: Fleet | None
    """The cheapest fleet found that meets the SLO (None: none does)."""
    prediction: Prediction | None
    cost: float | None
    why_not: str | None = None
    tried: int = 0
    """Simulations run for this layout."""


@dataclass
class Plan:
    workload: Workload
    slo: Slo
    layouts: list[LayoutPlan] = field(default_factory=list)

    @property
    def best(self) -> LayoutPlan | None:
        feasible = [p for p in self.layouts if p.fleet is not None]
        return min(feasible, key=lambda p: p.cost) if feasible else None


def _stage_machines(profiles: Profiles, stage: str) -> list[str]:
    source = "encode" if stage == "encode" else "prefill"
    names = [m.name for m in profiles.machines(source)]
    if stage in ("pd", "aggregated", "prefill", "decode"):
        decode = {m.name for m in profiles.machines("decode")}
        names = [n for n in names if n in decode]
        if stage == "aggregated":
            encode = {m.name for m in profiles.machines("encode")}
            names = [n for n in names if n in encode]
    return names


def plan_layout(
    profiles: Profiles,
    workload: Workload,
    slo: Slo,
    layout: Layout,
    max_replicas: int = 4096,
    max_simulations: int = 60,
    local_prefill_tokens: int = 0,
) -> LayoutPlan:
    """``local_prefill_tokens``: E/P/D fleets prefill prompts up to that many tokens in
    decode (``routing.max_local_prefill_tokens``); other layouts ignore it."""
    stages = LAYOUT_STAGES[layout]
    choices = [_stage_machines(profiles, s) for s in stages]
    missing = [s for s, c in zip(stages, choices, strict=True) if not c]
    if missing:
        return LayoutPlan(layout, None, None, None, f"no profiles for stage(s) {missing}")
    best: LayoutPlan = LayoutPlan(layout, None, None, None, "no hardware choice met the SLO")
    tried = 0
    for machines in itertools.product(*choices):
        fleet = Fleet(
            layout,
            {s: StageCount(m, 1) for s, m in zip(stages, machines, strict=True)},
            local_prefill_tokens if layout == "E/P/D" else 0,
        )
        found, prediction, why, n = _search(
            fleet, profiles, workload, slo, max_replicas, max_simulations
        )
        tried += n
        if found is None:
            best.why_not = f"{found_machines(fleet)}: {why}"
            continue
        cost = found.cost(profiles)
        if best.cost is None or cost < best.cost:
            best = LayoutPlan(layout, found, prediction, cost)
    best.tried = tried
    return best


def found_machines(fleet: Fleet) -> str:
    return ", ".join(f"{s} on {c.machine}" for s, c in fleet.stages.items())


def _search(
    fleet: Fleet,
    profiles: Profiles,
    workload: Workload,
    slo: Slo,
    max_replicas: int,
    max_simulations: int,
) -> tuple[Fleet | None, Prediction | None, str, int]:
    simulations = 0

    def sim(f: Fleet) -> Prediction:
        nonlocal simulations
        simulations += 1
        return run_simulation(f, profiles, workload)

    prediction = sim(fleet)
    while not prediction.meets(slo.ttft_p90_s, slo.tpot_p90_s):
        if simulations >= max_simulations:
            return None, None, f"no fleet found within {max_simulations} simulations", simulations
        busiest = max(prediction.utilization.values())
        if prediction.stable and busiest < FLOOR_UTILIZATION:
            return (
                None,
                None,
                (
                    f"the SLO is below this hardware's latency floor: TTFT p90 "
                    f"{prediction.ttft_s.p90 * 1e3:.1f} ms, TPOT p90 "
                    f"{prediction.tpot_s.p90 * 1e3:.2f} ms with every stage under "
                    f"{FLOOR_UTILIZATION:.0%} busy"
                ),
                simulations,
            )
        over = {s: u for s, u in prediction.utilization.items() if u >= TARGET_UTILIZATION}
        if not over:
            over = {prediction.bottleneck: busiest}
        grew = False
        for stage, util in over.items():
            current = fleet.stages[stage].replicas
            factor = max(util / TARGET_UTILIZATION, 1.0 if prediction.stable else 1.25)
            wanted = min(max_replicas, max(current + 1, math.ceil(current * factor)))
            if wanted > current:
                fleet = fleet.with_replicas(stage, wanted)
                grew = True
        if not grew:
            return None, None, f"more than {max_replicas} replicas of a stage needed", simulations
        prediction = sim(fleet)
    # Give back what is not needed, one stage at a time (bisection on its count).
    for stage in fleet.stages:
        low, high = 1, fleet.stages[stage].replicas
        while low < high:
            mid = (low + high) // 2
            trial = sim(fleet.with_replicas(stage, mid))
            if trial.meets(slo.ttft_p90_s, slo.tpot_p90_s):
                high = mid
            else:
                low = mid + 1
        if high != fleet.stages[stage].replicas:
            fleet = fleet.with_replicas(stage, high)
    return fleet, sim(fleet), "", simulations


def plan(
    profiles: Profiles,
    workload: Workload,
    slo: Slo,
    layouts: tuple[Layout, ...] = LAYOUTS,
    local_prefill_tokens: int = 0,
) -> Plan:
    result = Plan(workload, slo)
    for layout in layouts:
        result.layouts.append(
            plan_layout(profiles, workload, slo, layout, local_prefill_tokens=local_prefill_tokens)
        )
    return result


_SERVER_NAMES = {"encode": "encoder", "pd": "pd", "prefill": "prefill", "decode": "decode"}


def topology_for(fleet: Fleet, model: Path) -> Topology:
    """A multi-host topology with one server per replica, hosts named after them (edit the
    ``host`` of each to its address), Triton's default ports on each, the OpenAI API on the
    front. Validated like any topology."""

    def server(host: str, stages: list[str], openai: bool = False) -> ServerSpec:
        return ServerSpec(
            host=host,
            bind="0.0.0.0",
            http_port=8000,
            grpc_port=8001,
            metrics_port=8002,
            openai_port=9000 if openai else None,
            stages=stages,
        )

    servers: dict[str, ServerSpec] = {}
    if fleet.layout == "aggregated":
        for i in range(fleet.stages["aggregated"].replicas):
            servers[f"aggregated-{i}"] = server(f"aggregated-{i}", ["aggregated"], openai=True)
    else:
        for stage, count in fleet.stages.items():
            for i in range(count.replicas):
                name = f"{_SERVER_NAMES[stage]}-{i}"
                servers[name] = server(name, [stage])
        servers["front"] = server("front", ["epd"], openai=True)
    routing = RoutingSpec(max_local_prefill_tokens=fleet.local_prefill_tokens)
    return Topology(model=model, servers=servers, routing=routing)


def replica_counts(fleet: Fleet) -> dict[str, int]:
    """Replicas per Kubernetes Deployment of ``deploy/k8s`` (E/P/D manifests)."""
    names = {"encode": "epd-encoder", "prefill": "epd-prefill", "decode": "epd-decode"}
    return {names.get(s, f"epd-{s}"): c.replicas for s, c in fleet.stages.items()}
