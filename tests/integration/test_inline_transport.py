"""The same EPD stack with the ``inline`` transport (embedding bytes inside the request):
the A/B baseline must give the same tokens as NIXL handles and as the aggregated engine."""

from __future__ import annotations

from collections.abc import Iterator
from pathlib import Path

import pytest

from orchestrator.client import sample_photo
from orchestrator.config import Topology, TransferSpec
from tests.conftest import EPD_LAYOUT, assert_epd_matches_aggregated, local_topology, running_stack

pytestmark = pytest.mark.server


@pytest.fixture(scope="module")
def inline_stack(tiny_model: Path, tmp_path_factory: pytest.TempPathFactory) -> Iterator[Topology]:
    topology = local_topology(tiny_model, EPD_LAYOUT, transfer=TransferSpec(kind="inline"))
    yield from running_stack(topology, tmp_path_factory.mktemp("inline"))


@pytest.mark.parametrize(
    ("text", "images"),
    [
        ("Describe this image.", [sample_photo("astronaut")]),
        ("Compare these two pictures.", [sample_photo("chelsea"), sample_photo("coffee")]),
    ],
)
def test_inline_embeddings_match_aggregated(inline_stack, text, images):
    assert_epd_matches_aggregated(inline_stack, text, images)
