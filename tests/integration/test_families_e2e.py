"""Every supported family, from a checkpoint laid out as a hub download (bf16 shards,
index, processor files), served by the whole stack in both layouts: ``epd`` (E -> P -> D
over NIXL, and E -> PD) equals the ``aggregated`` engine equals plain offline vLLM, token
for token (fp32 compute), on a real photo, two images, odd sizes and a text-only request."""

from __future__ import annotations

import io
import json
import urllib.request
from collections.abc import Iterator

import pytest
from PIL import Image

from orchestrator.client import sample_photo, stream
from orchestrator.config import Topology
from tests.conftest import (
    E_PD_LAYOUT,
    EPD_LAYOUT,
    FAMILIES,
    local_topology,
    running_stack,
    wait_unpinned,
)
from tests.integration.test_epd_e2e import offline_reference

pytestmark = pytest.mark.server


def _png(name: str, size: tuple[int, int] | None = None) -> bytes:
    image = Image.open(io.BytesIO(sample_photo(name)))
    if size is not None:
        image = image.resize(size, Image.Resampling.BILINEAR)
    buf = io.BytesIO()
    image.save(buf, format="PNG")
    return buf.getvalue()


CASES = {
    "photo": ("Describe this image.", [sample_photo("astronaut")]),
    "two_images": ("Compare these two pictures.", [sample_photo("chelsea"), _png("coffee")]),
    "tiny_12x9": ("What is in this picture?", [_png("chelsea", (12, 9))]),
    "strip_900x40": ("What is shown here?", [_png("coffee", (900, 40))]),
    "text_only": ("Tell me a story about a robot.", []),
}
MAX_TOKENS = 12


@pytest.fixture(scope="module", params=FAMILIES)
def family(request: pytest.FixtureRequest) -> str:
    return request.param


@pytest.fixture(scope="module", params=["E/P/D", "E+PD"])
def family_stack(
    request: pytest.FixtureRequest,
    family: str,
    hub_checkpoint,
    tmp_path_factory: pytest.TempPathFactory,
) -> Iterator[Topology]:
    """Each family in both layouts: E/P/D (decode gets only layouts and KV) and E+PD (one
    engine takes the embeddings)."""
    layout = EPD_LAYOUT if request.param == "E/P/D" else E_PD_LAYOUT
    topology = local_topology(hub_checkpoint(family), layout)
    yield from running_stack(topology, tmp_path_factory.mktemp(f"stack-{family}"))


@pytest.fixture(scope="module")
def reference(family: str, hub_checkpoint, tmp_path_factory) -> dict[str, str]:
    """Offline vLLM's answers (once per family, for both layouts)."""
    topology = local_topology(hub_checkpoint(family), EPD_LAYOUT)
    return offline_reference(topology, CASES, MAX_TOKENS, tmp_path_factory.mktemp("ref"))


@pytest.mark.parametrize("case", list(CASES))
def test_epd_equals_aggregated_equals_offline_vllm(family_stack, reference, case):
    text, images = CASES[case]
    front = family_stack.server_of("epd")[1]
    sampling = {"max_tokens": MAX_TOKENS, "temperature": 0}
    epd = "".join(stream(front.grpc_url, "epd", text, images, sampling))
    aggregated = "".join(stream(front.grpc_url, "aggregated", text, images, sampling))
    assert epd == aggregated == reference[case]


def test_the_comparison_can_fail(family_stack, reference):
    """Different requests give different greedy text, and every handle was pulled."""
    assert len(set(reference.values())) == len(reference)
    stats = wait_unpinned(family_stack.server_of("encode")[1])
    assert stats["pinned_handles"] == 0, stats


def _generate(topology: Topology, model: str, text: str, **inputs: object) -> tuple[int, str]:
    """``num_input_tokens`` and text of a greedy answer through Triton's generate endpoint
    (``text`` as ``text_input`` unless ``inputs`` give the prompt another way)."""
    body = {
        **({} if {"prompt", "prompt_token_ids"} & inputs.keys() else {"text_input": text}),
        "sampling_parameters": json.dumps({"max_tokens": MAX_TOKENS, "temperature": 0}),
        "return_num_input_tokens": True,
        **inputs,
    }
    request = urllib.request.Request(
        f"http://{topology.server_of('epd')[1].http_url}/v2/models/{model}/generate",
        data=json.dumps(body).encode(),
        headers={"Content-Type": "application/json"},
    )
    with urllib.request.urlopen(request, timeout=300) as response:
        answer = json.loads(response.read())
    return int(answer["num_input_tokens"]), answer["text_output"]


def test_special_tokens_are_added_on_top_of_the_template_only_when_asked(family_stack):
    """As in vLLM's chat endpoint: the template's prompt is tokenized without the
    tokenizer's special tokens unless ``add_special_tokens`` says so (Llama's BOS for
    LLaVA: one token more; Qwen's tokenizer adds none), alike in every engine."""
    from transformers import AutoTokenizer

    tokenizer = AutoTokenizer.from_pretrained(str(family_stack.model))
    added = len(tokenizer("hello").input_ids) - len(
        tokenizer("hello", add_special_tokens=False).input_ids
    )
    text = "Tell me a story about a robot."
    plain = {m: _generate(family_stack, m, text) for m in ("epd", "aggregated")}
    asked = {m: _generate(family_stack, m, text, add_special_tokens=True) for m in plain}
    assert plain["epd"] == plain["aggregated"] and asked["epd"] == asked["aggregated"]
    assert asked["epd"][0] - plain["epd"][0] == added


def test_a_raw_prompt_is_used_as_it_is(family_stack):
    """``prompt`` (the completions API's): no chat template, the tokenizer's special
    tokens added unless ``add_special_tokens`` is false, as vLLM's completions endpoint
    does; ``prompt_token_ids`` of the same tokens answers the same, in every engine."""
    from transformers import AutoTokenizer

    tokenizer = AutoTokenizer.from_pretrained(str(family_stack.model))
    text = "Once upon a time, a robot"
    ids = tokenizer(text).input_ids
    for model in ("epd", "aggregated"):
        answer = _generate(family_stack, model, "", prompt=text)
        assert answer[0] == len(ids), (model, answer, ids)
        assert _generate(family_stack, model, "", prompt_token_ids=ids) == answer
        bare = _generate(family_stack, model, "", prompt=text, add_special_tokens=False)
        assert bare[0] == len(tokenizer(text, add_special_tokens=False).input_ids)
    chat = _generate(family_stack, "epd", text)
    assert chat[0] > len(ids) and chat != answer  # the template's turn markers
