"""The whole EPD stack for real, in both single-box layouts: E/P/D (four Triton servers,
prefill and decode engines, NIXL for embeddings and KV) and E+PD (one engine pulls the
embeddings, prefills and decodes). Greedy output must equal plain offline vLLM, token for
token, and the ``aggregated`` baseline beside it."""

from __future__ import annotations

import base64
import io
import json
import os
import re
import struct
import subprocess
import sys
import urllib.error
import urllib.request
import zlib
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import numpy as np
import pytest
from PIL import Image

from orchestrator.client import generate_body, request_inputs, sample_photo, stream
from orchestrator.config import Topology
from tests.conftest import (
    ANIMAL,
    EPD_LAYOUT,
    assert_epd_matches_aggregated,
    cache_metrics,
    local_topology,
    wait_unpinned,
)

pytestmark = pytest.mark.server

MAX_TOKENS = 16


def _png(name: str) -> bytes:
    buf = io.BytesIO()
    Image.open(io.BytesIO(sample_photo(name))).save(buf, format="PNG")
    return buf.getvalue()


CASES = {
    "astronaut": ("Describe this image.", [sample_photo("astronaut")]),
    "coffee_png": ("What is in the cup?", [_png("coffee")]),
    "chelsea": ("What animal is this?", [sample_photo("chelsea")]),
    "text_only": ("Tell me a story about a robot.", []),
    "two_images": ("Compare these two pictures.", [sample_photo("astronaut"), _png("coffee")]),
}


STRUCTURED_MAX_TOKENS = 64
"""Room for a guided answer to end on its own (byte-level tokens on the tiny model)."""

STRUCTURED = {
    "choice_photo": (
        "What animal is this?",
        [sample_photo("chelsea")],
        {"choice": ["a cat", "a dog", "an astronaut", "a cup of coffee"]},
    ),
    "regex_text": (
        "Tell me a story about a robot.",
        [],
        {"regex": "[A-Z][a-z]{2,6}( [a-z]{2,6}){2,4}\\."},
    ),
    "json_two_images": (
        "Compare these two pictures.",
        [sample_photo("astronaut"), _png("coffee")],
        {"json": ANIMAL},
    ),
}
"""Guided decoding cases: (text, images, vLLM ``StructuredOutputsParams`` fields)."""


def follows(constraint: dict, text: str) -> bool:
    """Whether ``text`` is a whole answer ``constraint`` allows."""
    if "choice" in constraint:
        return text in constraint["choice"]
    if "regex" in constraint:
        return re.fullmatch(constraint["regex"], text) is not None
    try:
        answer = json.loads(text)
    except ValueError:
        return False
    return set(answer) == {"animal", "alone"} and answer["animal"] in ("cat", "dog", "bird")


def offline_reference(
    topology: Topology,
    cases: dict[str, tuple[str, list[bytes]]],
    max_tokens: int,
    tmp: Path,
    structured: dict[str, tuple[str, list[bytes], dict]] | None = None,
) -> dict[str, str]:
    """Offline ``vllm.LLM.chat`` texts for ``cases`` (and the guided ``structured`` ones),
    computed in a subprocess (vLLM and NIXL are not fork-safe and heavy in the pytest
    process)."""
    (tmp / "topology.json").write_text(topology.model_dump_json())
    payload = {
        name: {
            "text": text,
            "images": [base64.b64encode(i).decode() for i in images],
            "max_tokens": max_tokens,
        }
        for name, (text, images) in cases.items()
    }
    for name, (text, images, constraint) in (structured or {}).items():
        payload[name] = {
            "text": text,
            "images": [base64.b64encode(i).decode() for i in images],
            "max_tokens": STRUCTURED_MAX_TOKENS,
            "structured_outputs": constraint,
        }
    (tmp / "cases.json").write_text(json.dumps(payload))
    proc = subprocess.run(
        [
            sys.executable,
            str(Path(__file__).with_name("offline_reference.py")),
            str(tmp / "topology.json"),
            str(tmp / "cases.json"),
        ],
        capture_output=True,
        text=True,
        timeout=600,
        env={**os.environ},
    )
    lines = [ln for ln in proc.stdout.splitlines() if ln.startswith("REFERENCE ")]
    assert lines, f"offline reference failed (rc {proc.returncode}):\n{proc.stderr[-4000:]}"
    texts = json.loads(lines[-1].removeprefix("REFERENCE "))
    assert all(texts.values()), f"offline vLLM produced empty text: {texts}"
    return texts


@pytest.fixture(scope="module")
def reference(tiny_model: Path, tmp_path_factory: pytest.TempPathFactory) -> dict[str, str]:
    """Offline ``vllm.LLM.chat`` texts for every case (once for both layouts)."""
    topology = local_topology(tiny_model, EPD_LAYOUT)
    tmp = tmp_path_factory.mktemp("reference")
    return offline_reference(topology, CASES, MAX_TOKENS, tmp, STRUCTURED)


def _front(topology: Topology):
    return topology.server_of("epd")[1]


def _http_generate(
    topology: Topology, model: str, text: str, images: list[bytes], stream: bool = False
) -> str:
    body = generate_body(text, images, {"max_tokens": MAX_TOKENS, "temperature": 0})
    endpoint = "generate_stream" if stream else "generate"
    request = urllib.request.Request(
        f"http://{_front(topology).http_url}/v2/models/{model}/{endpoint}",
        data=json.dumps(body).encode(),
        headers={"Content-Type": "application/json"},
    )
    with urllib.request.urlopen(request, timeout=300) as response:
        raw = response.read().decode()
    if not stream:
        return json.loads(raw)["text_output"]
    events = [json.loads(line[5:]) for line in raw.splitlines() if line.startswith("data:")]
    assert len(events) >= 1
    assert all("error" not in e for e in events), events
    return "".join(e["text_output"] for e in events)


@pytest.mark.parametrize("case", list(CASES))
@pytest.mark.parametrize("model", ["epd", "aggregated"])
def test_grpc_stream_matches_offline_vllm(epd_stack, reference, model, case):
    text, images = CASES[case]
    pieces = stream(
        _front(epd_stack).grpc_url,
        model,
        text,
        images,
        {"max_tokens": MAX_TOKENS, "temperature": 0},
    )
    assert len(pieces) > 1, "streaming should deliver text in several responses"
    assert "".join(pieces) == reference[case]


@pytest.mark.parametrize("model", ["epd", "aggregated"])
def test_the_last_text_carries_the_final_flag(epd_stack, reference, model):
    """The last response holds the last text and Triton's final flag, as vllm_backend
    sends it: no data-less final after it (one message fewer per request on every hop)."""
    import queue

    import tritonclient.grpc as grpcclient

    text, images = CASES["chelsea"]
    sampling = {"max_tokens": MAX_TOKENS, "temperature": 0}
    results: queue.Queue = queue.Queue()
    seen: list[tuple[str | None, bool]] = []  # (text, final) per response
    with grpcclient.InferenceServerClient(_front(epd_stack).grpc_url) as client:
        client.start_stream(callback=lambda result, error: results.put((result, error)))
        inputs = request_inputs(text, images, sampling, stream=True)
        client.async_stream_infer(model, inputs, enable_empty_final_response=True)
        while not (seen and seen[-1][1]):
            result, error = results.get(timeout=300)
            assert error is None, error
            response = result.get_response()
            piece = result.as_numpy("text_output") if response.outputs else None
            final = response.parameters["triton_final_response"].bool_param
            seen.append((None if piece is None else piece.reshape(-1)[0].decode(), final))
        client.stop_stream()
    assert len(seen) > 1 and None not in [piece for piece, _ in seen], seen
    assert [final for _, final in seen] == [False] * (len(seen) - 1) + [True]
    assert "".join(piece for piece, _ in seen) == reference["chelsea"]


@pytest.mark.parametrize("case", ["astronaut", "text_only", "two_images"])
def test_http_generate_matches_offline_vllm(epd_stack, reference, case):
    text, images = CASES[case]
    assert _http_generate(epd_stack, "epd", text, images) == reference[case]


@pytest.mark.parametrize("case", ["chelsea", "text_only"])
def test_http_generate_stream_matches_offline_vllm(epd_stack, reference, case):
    text, images = CASES[case]
    assert _http_generate(epd_stack, "epd", text, images, stream=True) == reference[case]


def test_reference_is_not_trivial(reference):
    """Different prompts give different greedy text: the comparison can actually fail."""
    assert len(set(reference.values())) == len(reference)


def _responses(
    topology: Topology, model: str, text: str, images: list[bytes], sampling: dict, *asked: str
) -> list[dict[str, np.ndarray]]:
    """Each streamed response's outputs, with the optional outputs ``asked`` (names)."""
    import queue

    import tritonclient.grpc as grpcclient

    results: queue.Queue = queue.Queue()
    responses = []
    with grpcclient.InferenceServerClient(_front(topology).grpc_url) as client:
        client.start_stream(callback=lambda result, error: results.put((result, error)))
        inputs = request_inputs(text, images, sampling, stream=True)
        for name in asked:
            flag = grpcclient.InferInput(f"return_{name}", [1], "BOOL")
            flag.set_data_from_numpy(np.array([True]))
            inputs.append(flag)
        client.async_stream_infer(model, inputs, enable_empty_final_response=True)
        final = False
        while not final:
            result, error = results.get(timeout=300)
            assert error is None, error
            response = result.get_response()
            final = response.parameters["triton_final_response"].bool_param
            if response.outputs:
                responses.append({o.name: result.as_numpy(o.name) for o in response.outputs})
        client.stop_stream()
    return responses


def _logprob_responses(
    topology: Topology, model: str, text: str, images: list[bytes], sampling: dict
) -> list[tuple[str, list[dict], int]]:
    """Each streamed response's text, ``logprobs`` (JSON) and ``num_output_tokens``."""
    return [
        (
            r["text_output"][0].decode(),
            json.loads(r["logprobs"][0]),
            int(r["num_output_tokens"][0]),
        )
        for r in _responses(
            topology, model, text, images, sampling, "logprobs", "num_output_tokens"
        )
    ]


@pytest.mark.parametrize("case", ["two_images", "text_only"])
def test_token_ids_are_the_engines_and_the_same_in_every_path(epd_stack, reference, case):
    """``return_token_ids``: each response's tokens (as many as ``num_output_tokens``) and,
    in the first, the engine's prompt (each image's tokens in place, as long as
    ``num_input_tokens``); ``epd`` answers the ids ``aggregated`` does, and they decode
    to the answer's text."""
    from transformers import AutoTokenizer

    text, images = CASES[case]
    sampling = {"max_tokens": MAX_TOKENS, "temperature": 0}
    asked = ("token_ids", "num_output_tokens", "num_input_tokens")
    ids = {}
    for model in ("epd", "aggregated"):
        responses = _responses(epd_stack, model, text, images, sampling, *asked)
        assert [("prompt_token_ids" in r) for r in responses] == [True] + [False] * (
            len(responses) - 1
        )
        prompt = responses[0]["prompt_token_ids"].tolist()
        assert len(prompt) == int(responses[0]["num_input_tokens"][0]), prompt
        assert all(len(r["token_ids"]) == int(r["num_output_tokens"][0]) for r in responses)
        ids[model] = (prompt, [t for r in responses for t in r["token_ids"].tolist()])
        answer = "".join(r["text_output"][0].decode() for r in responses)
        assert answer == reference[case]
    assert ids["epd"] == ids["aggregated"] and len(ids["epd"][1]) == MAX_TOKENS
    tokenizer = AutoTokenizer.from_pretrained(str(epd_stack.model))
    # (vLLM's incremental detokenizer holds back a character whose bytes are incomplete)
    assert tokenizer.decode(ids["epd"][1], skip_special_tokens=True).startswith(reference[case])


@pytest.mark.parametrize("case", ["chelsea", "two_images", "text_only"])
def test_logprobs_are_vllm_backends_and_the_same_in_every_path(epd_stack, reference, case):
    """``return_logprobs`` with ``sampling_parameters.logprobs``, as Triton's vllm_backend
    answers it: per response, one entry per token it carries (``num_output_tokens``), each
    the sampled token first (greedy: rank 1) and at most ``logprobs`` others. ``epd``
    (E+PD's engine, or E/P/D's decode, whose first token comes from prefill's pulled KV)
    gives the candidates ``aggregated`` gives, with the same log-probabilities."""
    text, images = CASES[case]
    sampling = {"max_tokens": MAX_TOKENS, "temperature": 0, "logprobs": 2}
    steps = {}
    for model in ("epd", "aggregated"):
        responses = _logprob_responses(epd_stack, model, text, images, sampling)
        assert "".join(piece for piece, _, _ in responses) == reference[case]
        assert all(len(logprobs) == count for _, logprobs, count in responses), responses
        steps[model] = [step for _, logprobs, _ in responses for step in logprobs]
        assert len(steps[model]) == MAX_TOKENS
        for step in steps[model]:
            assert 1 <= len(step) <= 3 and next(iter(step.values()))["rank"] == 1, step
            assert all(isinstance(c["decoded_token"], str) for c in step.values()), step
    assert [list(s) for s in steps["epd"]] == [list(s) for s in steps["aggregated"]]
    for ours, theirs in zip(steps["epd"], steps["aggregated"], strict=True):
        for token, candidate in ours.items():
            assert candidate["logprob"] == pytest.approx(theirs[token]["logprob"], abs=1e-3)


@pytest.mark.parametrize("case", list(STRUCTURED))
@pytest.mark.parametrize("model", ["epd", "aggregated"])
def test_guided_decoding_matches_offline_vllm(epd_stack, reference, model, case):
    """``structured_outputs`` (choice, regex, JSON schema; photos, text, two images) as
    Triton's vllm_backend takes it (the constraint as JSON text): the engine that samples
    the answer (pd, or decode after prefill) follows it, token for token as offline vLLM
    guided by the same constraint; the reference itself follows it and is not what the
    model says unguided, so the constraint really steers."""
    text, images, constraint = STRUCTURED[case]
    assert follows(constraint, reference[case]), reference[case]
    sampling = {"max_tokens": STRUCTURED_MAX_TOKENS, "temperature": 0}
    unguided = "".join(stream(_front(epd_stack).grpc_url, model, text, images, sampling))
    assert not follows(constraint, unguided), unguided
    sampling["structured_outputs"] = json.dumps(constraint)
    pieces = stream(_front(epd_stack).grpc_url, model, text, images, sampling)
    assert "".join(pieces) == reference[case]


def _raw_generate(topology: Topology, model: str, body: dict) -> tuple[int, str]:
    request = urllib.request.Request(
        f"http://{_front(topology).http_url}/v2/models/{model}/generate",
        data=json.dumps(body).encode(),
        headers={"Content-Type": "application/json"},
    )
    try:
        with urllib.request.urlopen(request, timeout=120) as response:
            return response.status, response.read().decode()
    except urllib.error.HTTPError as err:
        return err.code, err.read().decode()


def _png_of_size(width: int, height: int) -> bytes:
    buf = io.BytesIO()
    Image.new("RGB", (width, height), (90, 30, 200)).save(buf, format="PNG")
    return buf.getvalue()


def _png_bomb() -> bytes:
    """A small PNG whose header claims 10000x10000 pixels (a decompression bomb: within
    Pillow's own limit, past this deployment's)."""
    png = _png_of_size(1, 1)
    ihdr = b"IHDR" + struct.pack(">II", 10000, 10000) + png[24:29]
    chunk = struct.pack(">I", 13) + ihdr + struct.pack(">I", zlib.crc32(ihdr))
    return png[:8] + chunk + png[33:]


_JPEG = sample_photo("astronaut")
BAD_INPUTS = {
    "corrupt_image": (
        {"image": [base64.b64encode(_JPEG[: len(_JPEG) // 3]).decode()]},
        "image 1 of 1: ",
    ),
    "not_an_image": (
        {"image": [base64.b64encode(b"hello, not a picture").decode()]},
        "image 1 of 1: ",
    ),
    "second_of_two_corrupt": (
        {"image": [base64.b64encode(_JPEG).decode(), base64.b64encode(_JPEG[:999]).decode()]},
        "image 2 of 2: ",
    ),
    "context_overflow_after_encode": (
        {
            "image": [base64.b64encode(_JPEG).decode()],
            "sampling_parameters": json.dumps({"max_tokens": 2000}),
        },
        "exceeds the model's context",
    ),
    "beyond_the_family_s_limits": (
        {"image": [base64.b64encode(_png_of_size(402, 2)).decode()]},
        "image 1 of 1: aspect ratio 201.0 exceeds 200",
    ),
    "pixel_bomb": (
        {"image": [base64.b64encode(_JPEG).decode(), base64.b64encode(_png_bomb()).decode()]},
        "TOO_LARGE: image 2 of 2: 10000x10000 = 100000000 pixels exceeds the limit of 40000000",
    ),
    "text_too_long": (
        {"text_input": "x" * ((1 << 20) + 1)},
        "TOO_LARGE: text_input is 1048577 bytes",
    ),
    "empty_text": ({"text_input": "   "}, "text_input is empty"),
    "missing_text": ({"text_input": None}, "text_input"),
    "bad_json": ({"sampling_parameters": "{max_tokens: 3"}, "not valid JSON"),
    "zero_max_tokens": ({"sampling_parameters": json.dumps({"max_tokens": 0})}, "max_tokens"),
    "huge_max_tokens": (
        {"sampling_parameters": json.dumps({"max_tokens": 100000})},
        "exceeds the model's context",
    ),
    "too_many_images": (
        {"image": [base64.b64encode(_JPEG).decode()] * 3},
        "TOO_LARGE: 3 images sent",
    ),
    "two_constraints": (
        {
            "sampling_parameters": json.dumps(
                {"structured_outputs": {"regex": "a", "choice": ["b"]}}
            )
        },
        "structured_outputs: set exactly one of json, regex, choice",
    ),
    "constraint_the_engine_cannot_compile": (
        {"sampling_parameters": json.dumps({"structured_outputs": {"regex": "[0-9"}})},
        "invalid regex",
    ),
    "sampling_parameters_too_long": (
        {"sampling_parameters": json.dumps({"structured_outputs": {"regex": "a" * (1 << 20)}})},
        "TOO_LARGE: sampling_parameters is 1048613 bytes",
    ),
}


@pytest.mark.parametrize("model", ["epd", "aggregated"])
@pytest.mark.parametrize("case", list(BAD_INPUTS))
def test_bad_input_is_invalid_arg_and_server_stays_up(epd_stack, model, case):
    patch, expected = BAD_INPUTS[case]
    body = {"text_input": "Describe this image.", "sampling_parameters": "{}"}
    body.update(patch)
    body = {k: v for k, v in body.items() if v is not None}
    status, text = _raw_generate(epd_stack, model, body)
    assert status == 400, (status, text)  # Triton's INVALID_ARG; the kind is in the text
    kind = "TOO_LARGE" if expected.startswith("TOO_LARGE") else "INVALID_ARG"
    assert f'"{kind}: ' in text and expected in text, text
    ok_status, ok = _raw_generate(
        epd_stack, model, {"text_input": "hi", "sampling_parameters": json.dumps({"max_tokens": 2})}
    )
    assert ok_status == 200, ok
    if model == "epd":  # a request that fails after encoding releases its handles at once
        stats = cache_metrics(epd_stack.server_of("encode")[1])
        assert stats["pinned_handles"] == 0, stats


def test_same_size_images_never_share_kv(epd_stack, reference):
    """coffee and chelsea have one patch grid. Decode sees only grids, so unless requests
    carry the images' content hashes vLLM's prefix cache hands chelsea coffee's KV."""
    from orchestrator.encoder.preprocess import decode_image
    from orchestrator.families import family_for

    family = family_for(epd_stack.model)
    images = [decode_image(CASES[c][1][0]) for c in ("coffee_png", "chelsea")]
    grids = {family.image_layout(i.width, i.height).grid_thw for i in images}
    assert len(grids) == 1, "the two photos must share a grid for this test to mean anything"
    for case in ("coffee_png", "chelsea", "coffee_png", "chelsea"):
        text, images = CASES[case]
        assert _http_generate(epd_stack, "epd", text, images) == reference[case], case


def test_concurrent_requests_are_exact_and_every_handle_is_pulled(epd_stack, reference):
    """Concurrent image requests stay token-exact; every handle the encoder lent is unpinned
    by prefill's pull (not by TTL expiry) once the batch is done."""
    cases = list(CASES) * 2
    with ThreadPoolExecutor(5) as pool:
        texts = list(pool.map(lambda c: _http_generate(epd_stack, "epd", *CASES[c]), cases))
    assert texts == [reference[c] for c in cases]
    stats = wait_unpinned(epd_stack.server_of("encode")[1])
    assert stats["pinned_handles"] == 0 and stats["expired"] == 0, stats
    assert 0 < stats["bytes_in_use"] <= stats["pool_bytes"], stats


def test_load_generator_and_report_run_end_to_end(epd_stack, tmp_path):
    """A few seconds of `epd bench run` against the live stack, then `epd bench report` on it:
    both models answered everything, the front's phase metrics were read, plots written."""
    import asyncio

    from epd_bench import load, report

    front = epd_stack.server_of("epd")[1]
    plan = load.LoadPlan(
        models=("epd", "aggregated"),
        workloads=("mixed",),
        concurrency=(2,),
        requests=4,
        max_tokens=4,
        warmup=1,
    )
    runs = asyncio.run(
        load.execute(
            front.grpc_url,
            plan,
            front_metrics=(front.host, front.metrics_port),
            traces=epd_stack.tracing.directory,
        )
    )
    assert [(r.target, r.requests, r.errors) for r in runs] == [("epd", 4, 0), ("aggregated", 4, 0)]
    assert set(runs[0].ttft_by_kind_s) == {"text", "multi"} and runs[0].ttft_s.count == 4
    # E+PD has no prefill of its own: its first token is the one engine's
    phases = set(load.PHASES) - ({"prefill"} if epd_stack.one_engine else set())
    assert set(runs[0].phase_means_s) == phases and not runs[1].phase_means_s
    # every measured epd request's hops, from the traces (warm-up requests left out)
    assert runs[0].hops_s["epd"].count == 4 and runs[0].hops_s["stream"].count == 4
    assert {"call encode", "encode", "embedding_pull", "first_token"} <= set(runs[0].hops_s)
    # the ways in and out of each stage call, from spans of different servers
    llm = "pd" if epd_stack.one_engine else "decode"
    assert {"encode in", "encode out", f"{llm} in", "first_token out"} <= set(runs[0].hops_s)
    assert runs[0].hops_s["encode in"].count == runs[0].hops_s["encode"].count
    assert not runs[1].hops_s
    doc = report.render([load.report("test", runs)], tmp_path / "benchmarks.md", tmp_path / "img")
    assert "text-only p90 TTFT under the mixed workload" in doc
    assert (tmp_path / "img" / "ttft-cdf-mixed.png").stat().st_size > 0
    assert (tmp_path / "img" / "ttft-phases.png").stat().st_size > 0


def test_one_request_is_one_trace_through_every_hop(epd_stack):
    """The trace of one image request (an image no cache holds): a span for every hop, in
    every server it crossed, all under the front's ``epd`` span, one trace id."""
    import time

    from epd_bench.photos import photo_variant
    from orchestrator.tracing import read_spans

    traces = epd_stack.tracing.directory
    image = photo_variant("astronaut", 424242)
    sent_ns = time.time_ns()
    assert stream(_front(epd_stack).grpc_url, "epd", "Describe this image.", [image], {})
    llm = (
        {"call pd": "front/epd", "pd": "llm/pd"}
        if epd_stack.one_engine
        else {
            "call prefill": "front/epd",
            "prefill": "prefill/prefill",
            "call decode": "front/epd",
            "decode": "decode/decode",
        }
    )
    expected = {
        "epd": "front/epd",
        "call encode": "front/epd",
        "encode": "encoder/encode",
        "decode_image": "encoder/encode",
        "preprocess": "encoder/encode",
        "vision_encoder": "encoder/encode",
        "embedding_pull": "llm/pd" if epd_stack.one_engine else "prefill/prefill",
        "first_token": "llm/pd" if epd_stack.one_engine else "decode/decode",
        "stream": "front/epd",
        **llm,
    }
    # Each server exports its spans in its own time, and earlier tests left traces of
    # their own here: wait for this request's root and every span of its trace.
    deadline = time.monotonic() + 10
    while True:
        spans = read_spans(traces)
        roots = [s for s in spans if s["name"] == "epd" and s["start_ns"] >= sent_ns]
        mine = [s for s in spans if roots and s["trace_id"] == roots[0]["trace_id"]]
        if len(mine) >= len(expected) or time.monotonic() > deadline:
            break
        time.sleep(0.2)
    assert len(roots) == 1, roots
    assert {s["name"]: s["instance"] for s in mine} == expected
    ids = {s["span_id"] for s in mine}
    assert [s["name"] for s in mine if s["parent_id"] not in ids] == ["epd"]  # one tree
    assert all(s["end_ns"] >= s["start_ns"] for s in mine)


def test_engines_are_bound_and_the_serving_path_is_not(epd_stack):
    """Each engine's core process runs on the CPUs ``vllm serve`` would give its worker
    (``VLLM_CPU_OMP_THREADS_BIND=auto``: every CPU but the last), while Triton and the
    python-backend stubs that carry requests keep every CPU: the steps and the engine's
    socket threads stay on their cores, the serving path's processes use the rest."""
    import psutil

    from orchestrator.llm import engine_cpus

    own = frozenset(os.sched_getaffinity(0))
    if len(own) < 2:
        pytest.skip(f"NOT TESTED: tests get one CPU here ({sorted(own)}), nothing to bind apart")
    engines: dict[str, set[frozenset[int]]] = {}
    serving: set[frozenset[int]] = set()
    seen: set[str] = set()
    for proc in psutil.Process().children(recursive=True):
        try:
            name = proc.name()
            masks = {frozenset(os.sched_getaffinity(t.id)) for t in proc.threads()}
            parent_cmd = " ".join(proc.parent().cmdline())
        except (psutil.Error, OSError):
            continue  # gone meanwhile
        if name.startswith("VLLM::EngineCor"):
            engines[re.search(r"/(\w+)/1/model\.py", parent_cmd).group(1)] = masks
        elif name in ("tritonserver", "triton_python_backend_stub"):  # cmdline-extended
            serving |= masks
            seen.add(name)
    roles = {"pd"} if epd_stack.one_engine else {"prefill", "decode"}
    assert set(engines) == roles | {"aggregated"}
    assert seen == {"tritonserver", "triton_python_backend_stub"}
    assert serving == {own}, "a serving process or one of its threads was left bound"
    bound = frozenset(engine_cpus("auto"))
    for model, masks in engines.items():
        assert own not in masks, f"{model}: an engine thread runs on every CPU"
        if model in ("pd", "aggregated"):
            assert masks == {bound}, model
        # vLLM's NIXL connector moves the thread that runs the forward pass of a prefill or
        # decode engine to the last CPU of each NUMA node (its KV transfer reservation).


def test_engines_are_handed_rendered_prompts(epd_stack):
    """Every engine (``pd`` or prefill and decode, and ``aggregated``) gets vLLM's rendered
    engine input, as ``vllm serve`` hands its engine one. A raw prompt dict is deprecated in
    ``AsyncLLM.add_request`` (vLLM warns once per process) and was rendered on vLLM's thread
    pool: two thread hops per request on the stub's busy loop."""
    assert_epd_matches_aggregated(epd_stack, "What is in this photo?", [sample_photo()])
    assert_epd_matches_aggregated(epd_stack, "Say hello.", [])
    logs = sorted(epd_stack.tracing.directory.parent.glob("try*/logs/*.log"))
    texts = {log.name: log.read_text(errors="replace") for log in logs}
    with_engines = [name for name, text in texts.items() if "Resolved architecture" in text]
    assert len(with_engines) >= 2, f"no vLLM log lines in the servers' logs: {sorted(texts)}"
    raw = [name for name, text in texts.items() if "Passing raw prompts" in text]
    assert not raw, f"an engine was handed a raw prompt: {raw}"
