"""``epd bench ab``: one workload against several deployments in one invocation.

The deployments run one after another on the same machine with the same requests:
aggregated vs E+PD vs E/P/D, NIXL metadata-only vs inline embeddings, encoder cache on
vs off, and vLLM offline on the same requests. Optionally each server is pinned to its own
CPUs (``taskset``), which on one CPU box stands in for giving every stage its own hardware.
"""

from __future__ import annotations

import asyncio
import dataclasses
from collections.abc import Callable
from pathlib import Path

from epd_bench.load import LoadPlan, execute
from epd_bench.schema import RunResult
from orchestrator.config import Topology, default_topology


def _e_p_d(model: Path) -> Topology:
    return default_topology(model, "E/P/D")


def _with_transfer(**changes) -> Callable[[Path], Topology]:
    def build(model: Path) -> Topology:
        base = _e_p_d(model)
        return base.model_copy(update={"transfer": base.transfer.model_copy(update=changes)})

    return build


VARIANTS: dict[str, tuple[Callable[[Path], Topology], tuple[str, ...]]] = {
    "e-p-d/nixl": (_e_p_d, ("epd", "aggregated")),
    "e-pd/nixl": (default_topology, ("epd",)),
    "e-p-d/inline": (_with_transfer(kind="inline"), ("epd",)),
    "e-p-d/nixl/no-cache": (_with_transfer(cache=False), ("epd",)),
}
"""Deployment label -> (topology builder, models measured on it). ``aggregated`` runs on
the first deployment's front (it is the same vLLM engine in any layout)."""

OFFLINE = "offline-vllm"
"""Not a deployment: vLLM in-process on the same requests (``bench/offline.py``)."""
NAMES = (*VARIANTS, OFFLINE)


def pin_cpus(topology: Topology, cpu_lists: list[str]) -> Topology:
    """Give server i the CPU list ``cpu_lists[i % len]`` (e.g. ``["0", "1"]``)."""
    servers = {
        name: spec.model_copy(update={"cpus": cpu_lists[i % len(cpu_lists)]})
        for i, (name, spec) in enumerate(topology.servers.items())
    }
    return topology.model_copy(update={"servers": servers})


def run(
    model: Path,
    variants: list[str],
    plan: LoadPlan,
    timeout_s: float,
    cpu_lists: list[str] | None = None,
    encoder_threads: int | None = None,
    traces: bool = False,
) -> list[RunResult]:
    """Start each variant's deployment in turn, run ``plan`` against it, stop it (with
    ``traces``, each ``epd`` run also reports the time of every hop).

    ``encoder_threads`` sets ONNX Runtime's threads in the encoder: vLLM's own (aggregated)
    vision tower uses every core through torch, so a fair A/B gives the encoder as many.
    """
    results: list[RunResult] = []
    for name in variants:
        if name == OFFLINE:
            from epd_bench import offline

            print(f"== {name}: vLLM in-process", flush=True)
            runs = offline.run(plan, model, timeout_s + 3600)
        else:
            runs = _run_deployment(name, model, plan, timeout_s, cpu_lists, encoder_threads, traces)
        results += [run.model_copy(update={"model": model.name}) for run in runs]
    return results


def _run_deployment(
    name: str,
    model: Path,
    plan: LoadPlan,
    timeout_s: float,
    cpu_lists: list[str] | None,
    encoder_threads: int | None,
    traces: bool,
) -> list[RunResult]:
    from epd_bench.quick import embedded

    build, models = VARIANTS[name]
    topology = build(model)
    if encoder_threads:
        encoder = topology.encoder.model_copy(update={"threads": encoder_threads})
        topology = topology.model_copy(update={"encoder": encoder})
    if cpu_lists:
        topology = pin_cpus(topology, cpu_lists)
    print(f"== {name}: starting {len(topology.servers)} servers", flush=True)
    with embedded(topology, timeout_s, traces) as running:
        _, front = running.server_of("epd")
        variant_plan = dataclasses.replace(plan, models=models)

        def label(m: str) -> str:
            return "aggregated" if m == "aggregated" else name

        return asyncio.run(
            execute(
                front.grpc_url,
                variant_plan,
                label,
                (front.host, front.metrics_port),
                running.tracing.directory,
            )
        )
