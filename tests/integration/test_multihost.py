"""E, P and D on three separate hosts (network namespaces): embeddings cross hosts over
NIXL (UCX forced to TCP, as between machines without RDMA), KV over vLLM's NixlConnector,
stage calls over gRPC -- and the answer is still token-exact with the aggregated engine."""

from __future__ import annotations

import subprocess
from collections.abc import Iterator
from pathlib import Path

import pytest

from orchestrator.client import sample_photo, stream
from orchestrator.config import ServerSpec, Topology
from tests.conftest import (
    EPD_LAYOUT,
    assert_epd_matches_aggregated,
    running_stack,
    scrape,
    wait_unpinned,
)
from tests.integration.netns import can_create_namespaces, isolated_hosts

pytestmark = [
    pytest.mark.server,
    pytest.mark.skipif(bool(can_create_namespaces()), reason=str(can_create_namespaces())),
]


LAYOUTS = {
    "E/P/D": EPD_LAYOUT,
    # Encoder and prefill known by name (as services in compose or k8s), bound to their IP:
    # NIXL handles, vLLM's KV side channel and stage calls all go by name.
    "E/P/D by name": EPD_LAYOUT,
    "2E/P/D": {
        "encoder1": ["encode"],
        "encoder2": ["encode"],
        **{name: stages for name, stages in EPD_LAYOUT.items() if name != "encoder"},
    },
}


@pytest.fixture(scope="module", params=list(LAYOUTS))
def multihost_stack(
    request, tiny_model: Path, tmp_path_factory: pytest.TempPathFactory
) -> Iterator[Topology]:
    layout = LAYOUTS[request.param]
    with isolated_hosts(list(layout)) as hosts:
        by_name = request.param.endswith("by name")
        servers = {
            name: ServerSpec(
                host=name if by_name and name != "front" else hosts[name].ip,
                bind=hosts[name].ip if by_name and name != "front" else None,
                netns=hosts[name].netns,
                http_port=8000,
                grpc_port=8001,
                metrics_port=8002,
                stages=stages,
                env={"UCX_TLS": "tcp"},
            )
            for name, stages in layout.items()
        }
        topology = Topology(model=tiny_model, servers=servers)
        yield from running_stack(topology, tmp_path_factory.mktemp("multihost"))


def test_servers_live_on_their_own_hosts(multihost_stack):
    hosts = {spec.host for spec in multihost_stack.servers.values()}
    assert len(hosts) == len(multihost_stack.servers) and "127.0.0.1" not in hosts
    for spec in multihost_stack.servers.values():
        pids = subprocess.run(
            ["ip", "netns", "pids", spec.netns], capture_output=True, text=True, check=True
        ).stdout.split()
        assert pids, f"nothing runs in {spec.netns}"


@pytest.mark.parametrize(
    ("text", "images"),
    [
        ("Describe this image.", [sample_photo("astronaut")]),
        ("Compare these two pictures.", [sample_photo("chelsea"), sample_photo("coffee")]),
        ("Tell me a story about a robot.", []),
    ],
)
def test_epd_across_hosts_matches_aggregated(multihost_stack, text, images):
    assert_epd_matches_aggregated(multihost_stack, text, images)


def test_embeddings_were_pulled_across_hosts_from_every_encoder(multihost_stack):
    """Each encoder host served requests, and every handle it lent was unpinned by the
    prefill host's NIXL READ notification, none by TTL: the embeddings really crossed."""
    front = multihost_stack.server_of("epd")[1]
    for name in ("coffee", "chelsea", "astronaut", "coffee"):
        stream(
            front.grpc_url, "epd", "Describe this image.", [sample_photo(name)], {"max_tokens": 2}
        )
    for name, encoder in multihost_stack.servers_of("encode").items():
        assert scrape(encoder, "nv_inference_request_success", model="encode") > 0, name
        stats = wait_unpinned(encoder)
        assert stats["pinned_handles"] == 0 and stats["expired"] == 0, (name, stats)
