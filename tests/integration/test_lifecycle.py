"""A request's whole life on a real deployment: cancellation reaches every stage, deadlines
fail the request (not the server), outsiders cannot call internal stages or forge handles,
and a dead vLLM engine leaves rotation while its twin keeps serving.

Evidence is what the servers themselves report on ``/metrics``: vLLM's unfinished requests
and KV cache usage per engine, the encoder's pinned handles, the front's view of each stage
server, and each model's count of stopped requests.
"""

from __future__ import annotations

import json
import queue
import signal
import time
import urllib.error
import urllib.request
from collections.abc import Callable, Iterator
from pathlib import Path

import numpy as np
import psutil
import pytest

from orchestrator.client import generate, request_inputs, sample_photo
from orchestrator.protocol import (
    DecodeRequest,
    EmbeddingHandle,
    PrefillRequest,
    PrefillResult,
    SamplingOptions,
    from_tensor,
    to_tensor,
)
from orchestrator.triton.deployment import Deployment
from tests.conftest import local_topology, scrape
from tests.integration.internal import CallFailed, call_internal

pytestmark = [pytest.mark.server, pytest.mark.timeout(900)]

LAYOUT = {
    "encoder": ["encode"],
    "prefill1": ["prefill"],
    "prefill2": ["prefill"],
    "front": ["decode", "epd"],
}
LONG = {"max_tokens": 1500, "ignore_eos": True}
"""A request that would run for many seconds if nobody stopped it."""
PHOTO = sample_photo("astronaut")


@pytest.fixture(scope="module")
def stack(tiny_model: Path, tmp_path_factory: pytest.TempPathFactory) -> Iterator[Deployment]:
    topology = local_topology(tiny_model, LAYOUT, routing={"health_interval_s": 0.5})
    deployment = Deployment(topology, tmp_path_factory.mktemp("lifecycle"))
    with deployment.running(timeout_s=600):
        yield deployment


def _metric(stack: Deployment, server: str, name: str, **labels: str) -> float:
    return scrape(stack.topology.servers[server], name, **labels)


def busy(stack: Deployment) -> dict[str, float]:
    """Everything that must be back to zero once no request is in flight."""
    state = {}
    for server, role in (("prefill1", "prefill"), ("prefill2", "prefill"), ("front", "decode")):
        state[f"{server} requests"] = _metric(
            stack, server, "epd_engine_unfinished_requests", role=role
        )
        state[f"{server} kv"] = _metric(stack, server, "epd_engine_kv_cache_usage", role=role)
    state["pinned handles"] = _metric(stack, "encoder", "epd_encoder_cache_pinned_handles")
    return state


def wait_until(check: Callable[[], bool], timeout_s: float) -> float:
    """Seconds until ``check()`` held (polled), or AssertionError after ``timeout_s``."""
    start = time.monotonic()
    while not check():
        if time.monotonic() - start > timeout_s:
            raise AssertionError(f"not within {timeout_s}s")
        time.sleep(0.1)
    return time.monotonic() - start


def wait_idle(stack: Deployment, timeout_s: float = 5) -> float:
    try:
        return wait_until(lambda: not any(busy(stack).values()), timeout_s)
    except AssertionError:
        raise AssertionError(f"still busy after {timeout_s}s: {busy(stack)}") from None


def _front(stack: Deployment):
    return stack.topology.servers["front"]


class _Stream:
    """A streaming gRPC request to ``epd`` the test can cancel as a client would."""

    def __init__(self, stack: Deployment, images: list[bytes], sampling: dict, **kw) -> None:
        import tritonclient.grpc as grpcclient

        self.results: queue.Queue = queue.Queue()
        self.client = grpcclient.InferenceServerClient(_front(stack).grpc_url)
        self.client.start_stream(callback=lambda result, error: self.results.put((result, error)))
        inputs = request_inputs("Describe this image in detail.", images, sampling, True)
        self.client.async_stream_infer("epd", inputs, **kw)

    def next(self, timeout_s: float = 120):
        return self.results.get(timeout=timeout_s)

    def cancel(self) -> None:
        self.client.stop_stream(cancel_requests=True)
        self.client.close()


def test_cancel_after_first_token_stops_every_stage(stack):
    assert wait_idle(stack) < 5

    def stopped(model: str) -> float:
        return _metric(
            stack, "front", "epd_requests_stopped_total", model=model, reason="cancelled"
        )

    before = {model: stopped(model) for model in ("epd", "decode")}
    stream = _Stream(stack, [PHOTO], LONG)
    result, error = stream.next()
    assert error is None and result.as_numpy("text_output").size == 1
    wait_until(lambda: _metric(stack, "front", "epd_engine_unfinished_requests") == 1, 5)
    stream.cancel()
    took = wait_idle(stack)
    print(f"cancelled after the first token: every stage idle {took:.2f}s later")
    for model, count in before.items():
        assert stopped(model) == count + 1, model  # stopped by the cancel, not finished
    assert generate(_front(stack).http_url, "epd", "hello", [PHOTO], 4)


@pytest.mark.parametrize("delay_s", [0.0, 0.05, 0.2, 0.5])
def test_cancel_at_any_point_leaves_nothing_behind(stack, delay_s):
    """Cancelled while encoding, pulling embeddings, prefilling, between prefill and decode
    or decoding (wherever ``delay_s`` lands): afterwards nothing is running, no KV is held,
    no handle is pinned -- at once, not after a TTL or a KV lease."""
    stream = _Stream(stack, [PHOTO, sample_photo("coffee")], LONG)
    time.sleep(delay_s)
    stream.cancel()
    wait_idle(stack)


def test_deadline_fails_the_request_not_the_server(stack):
    stream = _Stream(stack, [PHOTO], LONG, timeout=1_500_000)  # Triton's timeout, in us
    start = time.monotonic()
    while True:
        result, error = stream.next()
        if error is not None:
            break
    took = time.monotonic() - start
    stream.cancel()
    assert "DEADLINE_EXCEEDED" in error.message(), error.message()
    assert took < 10, took
    wait_idle(stack)
    up = _metric(stack, "front", "epd_stage_server_up", stage="decode", target="front")
    assert up == 1  # a timeout is the request's failure, not the server's
    assert generate(_front(stack).http_url, "epd", "hello", [], 4)


def _decode_request(**overrides) -> dict[str, np.ndarray]:
    body = {
        "request_id": "forged",
        "prompt": "hi",
        "sampling": {"max_tokens": 2},
        "kv_transfer_params": {
            "do_remote_prefill": True,
            "remote_host": "10.255.255.1",
            "remote_port": 5600,
            "remote_engine_id": "x",
            "remote_block_ids": [[1, 2, 3]],
            "remote_request_id": "someone-elses",
        },
        **overrides,
    }
    return {"request": np.array([json.dumps(body).encode()], dtype=np.object_)}


def test_internal_models_refuse_outsiders(stack):
    topology = stack.topology
    front, prefill, encoder = (topology.servers[n] for n in ("front", "prefill1", "encoder"))
    # decode shares the public server with epd: the stage itself refuses the call
    with pytest.raises(CallFailed, match="UNAUTHENTICATED: decode is an internal stage"):
        call_internal(front, "decode", _decode_request(), sign=False)
    with pytest.raises(CallFailed, match="UNAUTHENTICATED: decode: the call's credential"):
        call_internal(front, "decode", _decode_request(), mac="0" * 64)
    # signed for another body: the MAC binds the inputs
    with pytest.raises(CallFailed, match="UNAUTHENTICATED"):
        good = {"request": _decode_request(prompt="other")["request"]}
        from orchestrator.auth import DeploymentKey

        mac = DeploymentKey.from_env().sign_call("decode", "some-id", good)
        call_internal(front, "decode", _decode_request(), mac=mac)
    # servers with only internal stages: Triton itself refuses inference without the header
    for server, model in ((prefill, "prefill"), (encoder, "encode"), (encoder, "vision_encoder")):
        with pytest.raises(CallFailed, match="restricted"):
            call_internal(server, model, _decode_request(), edge_header=False)
    # nobody outside unloads a model or registers shared memory on any server
    for path in ("repository/models/epd/unload", "systemsharedmemory/region/x/register"):
        with pytest.raises(urllib.error.HTTPError):
            urllib.request.urlopen(
                urllib.request.Request(f"http://{front.http_url}/v2/{path}", data=b"{}"),
                timeout=10,
            )
    assert generate(front.http_url, "epd", "hello", [PHOTO], 4)


def _real_handle(stack: Deployment) -> EmbeddingHandle:
    [response] = call_internal(
        stack.topology.servers["encoder"], "encode", {"image": np.array([PHOTO], dtype=object)}
    )
    payload = json.loads(response["handles"].reshape(-1)[0])
    return EmbeddingHandle.model_validate(payload["handles"][0])


def _prefill(stack: Deployment, handle: EmbeddingHandle) -> PrefillResult:
    """Prefill one image as the front would; decode is then told to free the KV prefill
    holds for it (nobody decodes it)."""
    from orchestrator.frontend import PromptBuilder

    prompt = PromptBuilder.for_topology(stack.topology, ("prefill",)).build("hi", 1)
    request = PrefillRequest(request_id=f"t{time.monotonic_ns()}", prompt=prompt, handles=[handle])
    [response] = call_internal(
        stack.topology.servers["prefill1"], "prefill", to_tensor("request", request)
    )
    result = from_tensor(response, "result", PrefillResult)
    abandon = DecodeRequest(
        request_id=f"{request.request_id}-x",
        prompt="",
        sampling=SamplingOptions(),
        kv_transfer_params=result.kv_transfer_params,
        abandon=True,
    )
    assert call_internal(_front(stack), "decode", to_tensor("request", abandon)) == []
    return result


def _signed(handle: EmbeddingHandle, **changes) -> EmbeddingHandle:
    from orchestrator.auth import DeploymentKey

    forged = handle.model_copy(update=changes)
    return forged.model_copy(
        update={"signature": DeploymentKey.from_env().handle_signature(forged)}
    )


def test_forged_handles_are_refused_before_anything_is_dialled(stack):
    real = _real_handle(stack)
    nixl = real.location
    cases = {
        "bad signature": (real.model_copy(update={"signature": "0" * 64}), "bad signature"),
        "caller-chosen cache key": (
            real.model_copy(update={"content_hash": "attacker"}),
            "bad signature",
        ),
        "foreign address": (
            _signed(real, location=nixl.model_copy(update={"metadata_addr": "10.255.255.1:1"})),
            "points at 10.255.255.1, which hosts no encoder",
        ),
        "huge shape": (_signed(real, shape=(10**9, real.shape[1])), "images are at most"),
    }
    for case, (handle, expected) in cases.items():
        start = time.monotonic()
        with pytest.raises(CallFailed) as failure:
            _prefill(stack, handle)
        assert expected in str(failure.value), (case, str(failure.value))
        assert time.monotonic() - start < 5, case  # refused, not dialled and timed out
    assert _prefill(stack, real)  # the genuine handle works once...
    with pytest.raises(CallFailed, match="already used"):
        _prefill(stack, real)  # ...and not twice
    wait_idle(stack)


def _engine_core(server_pid: int) -> psutil.Process:
    for child in psutil.Process(server_pid).children(recursive=True):
        if "EngineCore" in child.name() or "EngineCore" in " ".join(child.cmdline()):
            return child
    raise AssertionError(f"no vLLM EngineCore process under {server_pid}")


def test_dead_engine_leaves_rotation_and_its_twin_serves(stack):
    """Last in this module: it kills prefill1's engine core (its Triton server stays up)."""
    server = stack.servers["prefill1"]
    _engine_core(server._proc.pid).send_signal(signal.SIGKILL)
    took = wait_until(
        lambda: (
            _metric(stack, "front", "epd_stage_server_up", stage="prefill", target="prefill1") == 0
        ),
        10,
    )
    print(f"dead engine core: prefill1 out of rotation {took:.2f}s later")
    assert server.is_ready()  # Triton itself still says ready: only the probe knows
    for _ in range(4):
        assert generate(_front(stack).http_url, "epd", "hello", [PHOTO], 4)
