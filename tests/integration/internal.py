"""Calling an internal stage model from a test, as a stage of the deployment would (or as
an outsider would, with the credential missing or wrong)."""

from __future__ import annotations

import queue
import uuid

import numpy as np

from orchestrator.auth import GRPC_EDGE_HEADER, MAC_PARAMETER, DeploymentKey
from orchestrator.config import ServerSpec
from orchestrator.reply_channel import REPLY_PARAMETER
from orchestrator.stage_client import triton_dtype


class CallFailed(Exception):
    """The server answered the call with an error (its message is the exception's)."""


def call_internal(
    server: ServerSpec,
    model: str,
    inputs: dict[str, np.ndarray],
    *,
    edge_header: bool = True,
    sign: bool = True,
    mac: str | None = None,
    reply_to: str = "",
    sign_reply_to: bool = True,
    timeout_s: float = 120,
) -> list[dict[str, np.ndarray]]:
    """One streamed call of ``model`` on ``server``; its responses' tensors (those Triton
    brought), or ``CallFailed`` with the server's error message. By default the call
    carries what the front's calls carry (Triton's edge header and the call's MAC, from
    the test process's ``EPD_DEPLOYMENT_SECRET``); ``mac`` replaces the MAC, ``sign=False``
    omits it. ``reply_to`` asks for the answer on that reply channel, bound into the MAC
    unless ``sign_reply_to=False``."""
    import tritonclient.grpc as grpcclient
    from tritonclient.utils import InferenceServerException

    key = DeploymentKey.from_env()
    request_id = uuid.uuid4().hex
    tensors = []
    for name, value in inputs.items():
        tensor = grpcclient.InferInput(name, list(value.shape), triton_dtype(value))
        tensor.set_data_from_numpy(value)
        tensors.append(tensor)
    parameters = {}
    if reply_to:
        parameters[REPLY_PARAMETER] = reply_to
    if sign:
        signed_reply_to = reply_to if sign_reply_to else ""
        parameters[MAC_PARAMETER] = mac or key.sign_call(model, request_id, inputs, signed_reply_to)
    headers = {GRPC_EDGE_HEADER: key.edge_token} if edge_header else None
    results: queue.Queue = queue.Queue()
    responses: list[dict[str, np.ndarray]] = []
    with grpcclient.InferenceServerClient(server.grpc_url) as client:
        client.start_stream(
            callback=lambda result, error: results.put((result, error)), headers=headers
        )
        try:
            client.async_stream_infer(
                model,
                tensors,
                request_id=request_id,
                parameters=parameters or None,
                enable_empty_final_response=True,
            )
        except InferenceServerException:
            pass  # the stream was refused at once; its error is in the callback
        try:
            while True:
                result, error = results.get(timeout=timeout_s)
                if error is not None:
                    raise CallFailed(error.message())
                response = result.get_response()
                if response.outputs:
                    responses.append({o.name: result.as_numpy(o.name) for o in response.outputs})
                if response.parameters["triton_final_response"].bool_param:
                    return responses
        finally:
            client.stop_stream()
