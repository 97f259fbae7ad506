"""The error taxonomy (one place: ``protocol.py``), the per-request context, and the
sampling parameters taken at the edge."""

from __future__ import annotations

import dataclasses
import json
import time

import pytest
from vllm.sampling_params import StructuredOutputsParams

from orchestrator.context import RequestContext
from orchestrator.protocol import (
    Cancelled,
    DeadlineExceeded,
    InvalidRequest,
    Overloaded,
    SamplingOptions,
    StageError,
    StageUnreachable,
    TooLarge,
    Unauthenticated,
    Unavailable,
    error_from_message,
    error_message,
)

KINDS = [StageError, InvalidRequest, TooLarge, Unauthenticated, Unavailable, Overloaded,
         DeadlineExceeded, Cancelled]  # fmt: skip


@pytest.mark.parametrize("kind", KINDS)
def test_every_kind_survives_the_wire(kind):
    exc = error_from_message(error_message(kind("what went wrong")))
    assert type(exc) is kind and str(exc) == "what went wrong"


def test_kinds_say_whose_fault_retry_and_status():
    table = {k.kind: (k.triton_code, k.http_status, k.fault, k.retryable) for k in KINDS}
    assert table == {
        "INTERNAL": ("INTERNAL", 500, "server", False),
        "INVALID_ARG": ("INVALID_ARG", 400, "client", False),
        "TOO_LARGE": ("INVALID_ARG", 413, "client", False),
        "UNAUTHENTICATED": ("INVALID_ARG", 401, "client", False),
        "UNAVAILABLE": ("UNAVAILABLE", 503, "server", True),
        "OVERLOADED": ("UNAVAILABLE", 429, "server", True),
        "DEADLINE_EXCEEDED": ("UNAVAILABLE", 504, "server", True),
        "CANCELLED": ("CANCELLED", 499, "client", False),
    }
    # a timeout is not "unreachable": only StageUnreachable takes a server out
    assert not issubclass(DeadlineExceeded, StageUnreachable)


def test_an_unknown_message_is_internal_with_the_text():
    exc = error_from_message("grpc says no")
    assert type(exc) is StageError and str(exc) == "grpc says no"


def test_context_says_why_it_stopped_and_what_is_left():
    ctx = RequestContext.create(timeout_s=0.05, idle_timeout_s=1)
    assert 0 < ctx.remaining() <= 0.05 and ctx.stop_error() is None
    time.sleep(0.06)
    assert ctx.expired() and ctx.remaining() == 0
    ctx.timed_out = True
    assert isinstance(ctx.stop_error(), DeadlineExceeded)
    ctx.cancelled = True
    assert isinstance(ctx.stop_error(), Cancelled)
    assert RequestContext.create(1, 1).request_id != RequestContext.create(1, 1).request_id


def test_sampling_takes_vllms_fields_and_refuses_what_it_cannot_answer():
    opts = SamplingOptions.parse(
        '{"max_tokens": 8, "ignore_eos": true, "min_tokens": 2, "stop": "x", '
        '"repetition_penalty": 1.1, "logit_bias": {"5": -3}, "top_k": -1}'
    )
    kwargs = opts.vllm_kwargs()
    assert kwargs["ignore_eos"] and kwargs["min_tokens"] == 2 and kwargs["stop"] == ["x"]
    assert kwargs["logit_bias"] == {5: -3.0} and kwargs["top_k"] == 0 and "n" not in kwargs
    for raw, expected in (
        ('{"n": 2}', "n"),
        ('{"prompt_logprobs": 5}', "prompt_logprobs is not supported"),
        ('{"logprobs": -2}', "logprobs"),
        ('{"best_of": 3}', "best_of is not supported"),
        ('{"temprature": 1}', "temprature"),
        ('{"presence_penalty": 9}', "presence_penalty"),
    ):
        with pytest.raises(InvalidRequest, match=expected):
            SamplingOptions.parse(raw)


def test_structured_outputs_are_vllms_constraints_in_vllm_backends_shapes():
    """One constraint of vLLM's ``StructuredOutputsParams``, as an object or as JSON text
    (what Triton's vllm_backend reads), or under vllm_backend's older name; it survives the
    wire between stages and reaches vLLM under vLLM's own field names."""
    schema = {"type": "object", "properties": {"a": {"type": "integer"}}}
    for raw in (
        {"structured_outputs": {"json": schema}},
        {"structured_outputs": json.dumps({"json": schema})},
        {"guided_decoding": {"json": schema}},
    ):
        opts = SamplingOptions.parse(json.dumps(raw))
        assert SamplingOptions.parse(opts.model_dump_json()) == opts
        constraint = opts.vllm_kwargs()["structured_outputs"]
        assert constraint["json"] == schema and constraint["regex"] is None
        assert set(constraint) == {
            f.name for f in dataclasses.fields(StructuredOutputsParams) if f.init
        }
    assert SamplingOptions.parse("{}").vllm_kwargs()["structured_outputs"] is None
    for raw, expected in (
        (
            {"structured_outputs": {"regex": "a", "choice": ["b"]}},
            "exactly one of .*got regex, choice",
        ),
        ({"structured_outputs": {"disable_any_whitespace": True}}, "exactly one of .*got none"),
        ({"structured_outputs": {"choice": []}}, "structured_outputs.choice"),
        ({"structured_outputs": {"regex": "a", "backend": "outlines"}}, "backend"),
        ({"structured_outputs": "{regex"}, "structured_outputs: not valid JSON"),
        (
            {"structured_outputs": {"regex": "a"}, "guided_decoding": {"regex": "b"}},
            "structured_outputs or guided_decoding, not both",
        ),
    ):
        with pytest.raises(InvalidRequest, match=expected):
            SamplingOptions.parse(json.dumps(raw))


def test_the_engine_gets_the_constraint_as_vllms_own_params():
    from orchestrator.llm import to_vllm_sampling

    params = to_vllm_sampling(SamplingOptions.parse('{"structured_outputs": {"choice": ["x"]}}'))
    assert params.structured_outputs == StructuredOutputsParams(choice=["x"])
    assert to_vllm_sampling(SamplingOptions()).structured_outputs is None
