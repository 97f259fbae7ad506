"""Minimal clients of ``epd`` / ``aggregated`` (what the README shows).

Both models are decoupled, so plain HTTP ``/infer`` does not serve them: HTTP clients use
Triton's ``generate`` / ``generate_stream`` endpoints, gRPC clients a stream.
"""

from __future__ import annotations

import base64
import io
import json
import urllib.request

import numpy as np


def sample_photo(name: str = "astronaut") -> bytes:
    """A real photo shipped with scikit-image, as JPEG bytes (no network needed)."""
    import skimage.data
    from PIL import Image

    buf = io.BytesIO()
    Image.fromarray(getattr(skimage.data, name)()).convert("RGB").save(buf, format="JPEG")
    return buf.getvalue()


def generate_body(text: str, images: list[bytes], sampling: dict) -> dict:
    body: dict = {"text_input": text, "sampling_parameters": json.dumps(sampling)}
    if images:
        body["image"] = [base64.b64encode(img).decode() for img in images]
    return body


def generate(url: str, model: str, text: str, images: list[bytes], max_tokens: int = 32) -> str:
    """One request to Triton's HTTP ``generate`` endpoint; returns the generated text."""
    body = generate_body(text, images, {"max_tokens": max_tokens, "temperature": 0})
    request = urllib.request.Request(
        f"http://{url}/v2/models/{model}/generate",
        data=json.dumps(body).encode(),
        headers={"Content-Type": "application/json"},
    )
    with urllib.request.urlopen(request, timeout=300) as response:
        return json.loads(response.read())["text_output"]


def request_inputs(text: str, images: list[bytes], sampling: dict, stream: bool) -> list:
    """The public inputs as tritonclient gRPC tensors (the aio client takes the same)."""
    import tritonclient.grpc as grpcclient

    values = [("text_input", np.array([text.encode()], dtype=np.object_), "BYTES")]
    if images:
        values.append(("image", np.array(images, dtype=np.object_), "BYTES"))
    params = json.dumps(sampling).encode()
    values.append(("sampling_parameters", np.array([params], dtype=np.object_), "BYTES"))
    values.append(("stream", np.array([stream]), "BOOL"))
    inputs = []
    for name, value, dtype in values:
        tensor = grpcclient.InferInput(name, list(value.shape), dtype)
        tensor.set_data_from_numpy(value)
        inputs.append(tensor)
    return inputs


def stream(url: str, model: str, text: str, images: list[bytes], sampling: dict) -> list[str]:
    """One streaming request over gRPC; returns the text pieces in arrival order."""
    import queue

    import tritonclient.grpc as grpcclient

    inputs = request_inputs(text, images, sampling, stream=True)
    results: queue.Queue = queue.Queue()
    pieces: list[str] = []
    with grpcclient.InferenceServerClient(url) as client:
        client.start_stream(callback=lambda result, error: results.put((result, error)))
        client.async_stream_infer(model, inputs, enable_empty_final_response=True)
        while True:
            result, error = results.get(timeout=300)
            if error is not None:
                raise error
            response = result.get_response()
            if response.outputs:
                pieces.append(result.as_numpy("text_output").reshape(-1)[0].decode())
            if response.parameters["triton_final_response"].bool_param:
                break
        client.stop_stream()
    return pieces
