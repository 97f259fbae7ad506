"""A stage call's request as Triton reads it: the tensors decoded from the raw contents
with tritonclient's own decoders, the request's id, its deadline and its parameters. (That
Triton serves such requests is what every integration test's stage calls prove.)"""

from __future__ import annotations

import grpc
import numpy as np
from tritonclient.utils import deserialize_bytes_tensor

from orchestrator.context import RequestContext
from orchestrator.stage_client import _rpc_error, infer_request

_NUMPY = {"FP32": np.float32, "INT64": np.int64, "BOOL": np.bool_}


def _decoded(request) -> dict[str, np.ndarray]:
    tensors = {}
    for tensor, raw in zip(request.inputs, request.raw_input_contents, strict=True):
        shape = list(tensor.shape)
        if tensor.datatype == "BYTES":
            tensors[tensor.name] = deserialize_bytes_tensor(raw).reshape(shape)
        else:
            dtype = _NUMPY[tensor.datatype]
            tensors[tensor.name] = np.frombuffer(raw, dtype=dtype).reshape(shape)
    return tensors


def test_the_request_carries_every_tensor_as_triton_decodes_it():
    inputs = {
        "request": np.array([b'{"a": 1}', b"", "é".encode()], dtype=np.object_),
        "empty": np.array([], dtype=np.object_),
        "embedding": np.arange(6, dtype=np.float32).reshape(2, 3),
        "ids": np.array([[1, 2**40]], dtype=np.int64),
        "stream": np.array([True]),
    }
    ctx = RequestContext.create(timeout_s=2.0, idle_timeout_s=1.0, request_id="r-1")
    request = infer_request("pd", inputs, ["a", "b"], ctx, {"mac": "m", "reply_to": "x/1"})

    assert request.model_name == "pd" and request.id == "r-1"
    assert [t.datatype for t in request.inputs] == ["BYTES", "BYTES", "FP32", "INT64", "BOOL"]
    decoded = _decoded(request)
    assert decoded.keys() == inputs.keys()
    for name, value in inputs.items():
        assert decoded[name].shape == value.shape, name
        assert decoded[name].tolist() == value.tolist(), name
    assert [o.name for o in request.outputs] == ["a", "b"]
    assert 1_000_000 < request.parameters["timeout"].int64_param <= 2_000_000
    assert request.parameters["mac"].string_param == "m"
    assert request.parameters["reply_to"].string_param == "x/1"


def test_a_request_past_its_deadline_still_asks_triton_for_a_positive_timeout():
    """Triton reads 0 as "no timeout": a late call must time out at once, not never."""
    ctx = RequestContext.create(timeout_s=-1.0, idle_timeout_s=1.0)
    request = infer_request("encode", {}, [], ctx, {})
    assert request.parameters["timeout"].int64_param == 1


def test_a_grpc_error_reads_as_its_status_and_details():
    error = grpc.aio.AioRpcError(
        grpc.StatusCode.UNAVAILABLE, grpc.aio.Metadata(), grpc.aio.Metadata(), "connection refused"
    )
    assert _rpc_error(error) == "UNAVAILABLE: connection refused"
    assert _rpc_error(ValueError("other")) == "other"
