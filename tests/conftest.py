"""Fixtures shared by all tests: the tiny model, free ports, a running EPD deployment."""

from __future__ import annotations

import signal
import urllib.request
from collections.abc import Iterator
from pathlib import Path

import pytest

from orchestrator.config import ServerSpec, Topology
from orchestrator.ports import free_ports


def _interrupt(*_: object) -> None:
    raise KeyboardInterrupt


# A CI runner or a person stopping the suite with SIGTERM must still get the fixtures'
# teardown (servers stopped, network namespaces deleted); pytest does that on Ctrl-C only.
signal.signal(signal.SIGTERM, _interrupt)


@pytest.fixture(scope="session")
def tiny_model(tmp_path_factory: pytest.TempPathFactory) -> Path:
    from orchestrator.model.tiny import build_model

    return build_model(tmp_path_factory.mktemp("model") / "tiny", profile="tiny", seed=0)


def local_topology(model: Path, layout: dict[str, list[str]], **settings) -> Topology:
    """A topology with one loopback server per ``layout`` entry, on free ports."""
    ports = iter(free_ports(3 * len(layout)))
    servers = {
        name: ServerSpec(
            http_port=next(ports), grpc_port=next(ports), metrics_port=next(ports), stages=stages
        )
        for name, stages in layout.items()
    }
    return Topology(model=model, servers=servers, **settings)


EPD_LAYOUT = {
    "encoder": ["encode"],
    "prefill": ["prefill"],
    "front": ["decode", "epd", "aggregated"],
}
"""The embedded default's shape: three servers, as `epd serve` runs them."""


def pool_metrics(encoder: ServerSpec) -> dict[str, float]:
    """An encoder server's ``epd_embedding_pool_*`` gauges, scraped from its ``/metrics``."""
    url = f"http://{encoder.host}:{encoder.metrics_port}/metrics"
    with urllib.request.urlopen(url, timeout=10) as response:
        lines = response.read().decode().splitlines()
    prefix = "epd_embedding_pool_"
    return {
        line[len(prefix) : line.index("{")]: float(line.rsplit(" ", 1)[1])
        for line in lines
        if line.startswith(prefix)
    }


def running_stack(topology: Topology, workdir: Path) -> Iterator[Topology]:
    from orchestrator.triton.deployment import Deployment

    with Deployment(topology, workdir).running(timeout_s=600):
        yield topology


@pytest.fixture(scope="module")
def epd_stack(tiny_model: Path, tmp_path_factory: pytest.TempPathFactory) -> Iterator[Topology]:
    """The three-server EPD deployment, started once per module and always stopped."""
    yield from running_stack(local_topology(tiny_model, EPD_LAYOUT), tmp_path_factory.mktemp("epd"))


def assert_epd_matches_aggregated(topology: Topology, text: str, images: list[bytes]) -> None:
    """Greedy text of ``epd`` equals the aggregated engine's on the same front (gRPC stream)."""
    from orchestrator.client import stream

    front = topology.server_of("epd")[1]
    sampling = {"max_tokens": 16, "temperature": 0}
    epd = stream(front.grpc_url, "epd", text, images, sampling)
    aggregated = stream(front.grpc_url, "aggregated", text, images, sampling)
    assert "".join(epd) == "".join(aggregated) != ""
