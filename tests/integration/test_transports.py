"""The same EPD stack with the other embedding transports: ``inline`` (bytes inside the
request, the A/B baseline) and ``mooncake`` (Mooncake TransferEngine pulls) must give the
same tokens as the aggregated engine, as NIXL handles do; pulled handles are unpinned."""

from __future__ import annotations

from collections.abc import Iterator
from pathlib import Path

import pytest

from orchestrator.client import sample_photo
from orchestrator.config import Topology, TransferSpec
from tests.conftest import (
    EPD_LAYOUT,
    assert_epd_matches_aggregated,
    local_topology,
    mooncake_unavailable,
    running_stack,
    wait_unpinned,
)

pytestmark = pytest.mark.server


@pytest.fixture(
    scope="module",
    params=[
        "inline",
        pytest.param(
            "mooncake",
            marks=pytest.mark.skipif(
                bool(mooncake_unavailable()), reason=str(mooncake_unavailable())
            ),
        ),
    ],
)
def transport_stack(
    request, tiny_model: Path, tmp_path_factory: pytest.TempPathFactory
) -> Iterator[Topology]:
    # The inline stack also answers through Triton (no reply channel), so that path, the
    # one `routing.reply_channel: false` keeps, stays token-exact too.
    topology = local_topology(
        tiny_model,
        EPD_LAYOUT,
        transfer=TransferSpec(kind=request.param),
        routing={"reply_channel": request.param != "inline"},
    )
    yield from running_stack(topology, tmp_path_factory.mktemp(request.param))


@pytest.mark.parametrize(
    ("text", "images"),
    [
        ("Describe this image.", [sample_photo("astronaut")]),
        ("Compare these two pictures.", [sample_photo("chelsea"), sample_photo("coffee")]),
    ],
)
def test_embeddings_match_aggregated(transport_stack, text, images):
    assert_epd_matches_aggregated(transport_stack, text, images)


def test_every_handle_was_pulled(transport_stack):
    stats = wait_unpinned(transport_stack.server_of("encode")[1])
    assert stats["pinned_handles"] == 0 and stats["expired"] == 0, stats
    assert stats["misses"] == 3 and stats["entries"] == 3, stats
