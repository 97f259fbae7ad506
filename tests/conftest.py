"""Fixtures shared by all tests: the tiny model, free ports, a running EPD deployment."""

from __future__ import annotations

import functools
import os
import signal
import subprocess
import sys
import time
import warnings
from collections.abc import Iterator
from pathlib import Path
from typing import TYPE_CHECKING

import pytest

from orchestrator.auth import SECRET_ENV, new_secret
from orchestrator.config import ServerSpec, Topology
from orchestrator.ports import free_ports

if TYPE_CHECKING:
    from orchestrator.triton.deployment import Deployment


def _interrupt(*_: object) -> None:
    raise KeyboardInterrupt


# One deployment secret for every stack the tests start, so tests can sign internal calls
# (and forge badly signed ones) like a stage of the deployment would.
os.environ.setdefault(SECRET_ENV, new_secret())

# A CI runner or a person stopping the suite with SIGTERM must still get the fixtures'
# teardown (servers stopped, network namespaces deleted); pytest does that on Ctrl-C only.
signal.signal(signal.SIGTERM, _interrupt)


@pytest.fixture(scope="session")
def tiny_model(tmp_path_factory: pytest.TempPathFactory) -> Path:
    from orchestrator.model.build import build_model

    return build_model(tmp_path_factory.mktemp("model") / "tiny", profile="tiny", seed=0)


ANIMAL = {
    "type": "object",
    "properties": {"animal": {"enum": ["cat", "dog", "bird"]}, "alone": {"type": "boolean"}},
    "required": ["animal", "alone"],
    "additionalProperties": False,
}
"""A JSON schema with a short answer (an enum and a boolean), for guided decoding tests."""


FAMILIES = ("qwen2_vl", "qwen2_5_vl", "qwen3_vl", "llava")
"""Every supported family; each gets a random checkpoint laid out as a hub download."""


@pytest.fixture(scope="session")
def hub_checkpoint(tmp_path_factory: pytest.TempPathFactory):
    """``hub_checkpoint(family)``: that family's random bf16 checkpoint in several shards with
    an index and its processor files, built once per session."""
    from orchestrator.model.build import build_model

    built: dict[str, Path] = {}

    def get(family: str) -> Path:
        if family not in built:
            out = tmp_path_factory.mktemp(f"hub-{family}") / family
            built[family] = build_model(out, family=family, hub_layout=True)  # type: ignore[arg-type]
        return built[family]

    return get


@functools.cache
def mooncake_unavailable() -> str | None:
    """``None`` when Mooncake's engine loads here, else why not (it is an optional install)."""
    probe = subprocess.run(
        [sys.executable, "-c", "import mooncake.engine"], capture_output=True, text=True
    )
    if probe.returncode:
        return f"Mooncake TransferEngine does not load: {probe.stderr.strip().splitlines()[-1]}"
    return None


def local_topology(
    model: Path, layout: dict[str, list[str]], openai_on: str | None = None, **settings
) -> Topology:
    """A topology with one loopback server per ``layout`` entry, on free ports (and an
    OpenAI front beside server ``openai_on``)."""
    ports = iter(free_ports(3 * len(layout) + 1))
    servers = {
        name: ServerSpec(
            http_port=next(ports),
            grpc_port=next(ports),
            metrics_port=next(ports),
            openai_port=next(ports) if name == openai_on else None,
            stages=stages,
        )
        for name, stages in layout.items()
    }
    return Topology(model=model, servers=servers, **settings)


EPD_LAYOUT = {
    "encoder": ["encode"],
    "prefill": ["prefill"],
    "decode": ["decode"],
    "front": ["epd", "aggregated"],
}
"""E/P/D as `topologies/e-p-d-local.yaml` runs it: a server per stage, entry points apart."""
E_PD_LAYOUT = {"encoder": ["encode"], "llm": ["pd"], "front": ["epd", "aggregated"]}
"""E+PD, the embedded default's shape (`epd serve --baseline` without --topology)."""


def scrape(server: ServerSpec, name: str, **labels: str) -> float:
    """Sum of the series ``name`` on a server's ``/metrics`` whose labels include ``labels``."""
    from orchestrator.metrics import scrape as read

    # A server known by name inside its namespace is reached here by the IP it binds.
    address = server.bind if server.bind not in (None, "0.0.0.0", "::") else server.host
    return read(address, server.metrics_port, name, **labels)


def cache_metrics(encoder: ServerSpec, settle_s: float = 1.1) -> dict[str, float]:
    """An encoder server's ``epd_encoder_cache_*`` series (gauges and ``_total`` counters),
    read after ``settle_s``: the encoder publishes them every 0.5 s."""
    from orchestrator.metrics import CACHE_COUNTERS, CACHE_GAUGES

    time.sleep(settle_s)

    stats = {f: scrape(encoder, f"epd_encoder_cache_{f}") for f in CACHE_GAUGES}
    stats.update({f: scrape(encoder, f"epd_encoder_cache_{f}_total") for f in CACHE_COUNTERS})
    return stats


def encoder_passes(encoder: ServerSpec) -> int:
    """Vision encoder forward passes so far, by Triton's own count (not ours)."""
    return int(scrape(encoder, "nv_inference_count", model="vision_encoder"))


def wait_unpinned(encoder: ServerSpec, timeout_s: float = 10) -> dict[str, float]:
    """The encoder's cache stats once every handle it lent was pulled (bounded wait)."""
    deadline = time.monotonic() + timeout_s
    while cache_metrics(encoder, 0.2)["pinned_handles"] and time.monotonic() < deadline:
        pass
    return cache_metrics(encoder)


def running_deployment(topology: Topology, workdir: Path) -> Iterator[Deployment]:
    """The deployment, started and always stopped. A start that stalls (a server not ready
    in 600 s: once in CI, the front's engine after it was built) is retried once, loudly;
    its servers' stacks are in ``workdir/try1/logs`` (``wait_ready`` has them dumped)."""
    from orchestrator.triton.deployment import Deployment

    for attempt in (1, 2):
        deployment = Deployment(topology, workdir / f"try{attempt}")
        try:
            deployment.start(timeout_s=600)
        except TimeoutError as stalled:
            if attempt == 2:
                raise
            print(f"\n!!! STACK START STALLED, RETRYING ONCE: {str(stalled)[-3000:]}")
            warnings.warn(f"stack start stalled, retried: logs in {workdir}/try1", stacklevel=2)
            continue
        try:
            yield deployment
        finally:
            deployment.stop()
        return


def running_stack(topology: Topology, workdir: Path) -> Iterator[Topology]:
    for deployment in running_deployment(topology, workdir):
        yield deployment.topology


@pytest.fixture(scope="module", params=["E/P/D", "E+PD"])
def epd_stack(
    request: pytest.FixtureRequest, tiny_model: Path, tmp_path_factory: pytest.TempPathFactory
) -> Iterator[Topology]:
    """The E/P/D and the E+PD deployment in turn, each started once per module and always
    stopped: every test that uses it holds for both layouts."""
    layout = EPD_LAYOUT if request.param == "E/P/D" else E_PD_LAYOUT
    workdir = tmp_path_factory.mktemp("epd")
    topology = local_topology(tiny_model, layout, tracing={"directory": workdir / "traces"})
    yield from running_stack(topology, workdir)


def assert_epd_matches_aggregated(topology: Topology, text: str, images: list[bytes]) -> None:
    """Greedy text of ``epd`` equals the aggregated engine's on the same front (gRPC stream)."""
    from orchestrator.client import stream

    front = topology.server_of("epd")[1]
    sampling = {"max_tokens": 16, "temperature": 0}
    epd = stream(front.grpc_url, "epd", text, images, sampling)
    aggregated = stream(front.grpc_url, "aggregated", text, images, sampling)
    assert "".join(epd) == "".join(aggregated) != ""
