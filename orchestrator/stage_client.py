"""Calling another stage: a dict of numpy tensors in, an async stream of dicts out.

Every stage model is decoupled, so a call is one request on a gRPC bidirectional stream --
also when the stage is hosted by this same server (see ``BlsInfer`` for why not BLS).
"""

from __future__ import annotations

import asyncio
import time
from abc import ABC, abstractmethod
from collections.abc import AsyncIterator
from typing import Any

import numpy as np

from orchestrator import tracing
from orchestrator.auth import GRPC_EDGE_HEADER, MAC_PARAMETER, DeploymentKey
from orchestrator.context import RequestContext
from orchestrator.protocol import (
    PROBE_PARAMETER,
    DeadlineExceeded,
    StageError,
    StageUnreachable,
    Tensors,
    Unavailable,
    error_from_message,
)
from orchestrator.reply_channel import REPLY_PARAMETER, ReplyListener

_TRITON_DTYPES = {
    np.dtype(np.object_): "BYTES",
    np.dtype(np.bool_): "BOOL",
    np.dtype(np.float32): "FP32",
    np.dtype(np.float16): "FP16",
    np.dtype(np.int32): "INT32",
    np.dtype(np.int64): "INT64",
}


def triton_dtype(array: np.ndarray) -> str:
    try:
        return _TRITON_DTYPES[array.dtype]
    except KeyError:
        raise TypeError(f"no Triton dtype for numpy {array.dtype}") from None


class StageClient(ABC):
    """Calls one decoupled model and yields its responses' output tensors."""

    @abstractmethod
    def call(
        self, model: str, inputs: Tensors, outputs: list[str], ctx: RequestContext
    ) -> AsyncIterator[Tensors]:
        """Responses of one call made on behalf of ``ctx``'s request: it carries the
        request's id and what is left of its deadline to the callee, and fails with
        ``DeadlineExceeded`` when the deadline passes or no response comes within the idle
        timeout. Cancelling the caller cancels the call (and so the callee's work)."""

    async def call_one(
        self, model: str, inputs: Tensors, outputs: list[str], ctx: RequestContext
    ) -> Tensors:
        """A call whose model answers exactly one response."""
        result: Tensors | None = None
        async for response in self.call(model, inputs, outputs, ctx):
            if result is not None:
                raise StageError(f"{model} answered more than one response")
            result = response
        if result is None:
            raise StageError(f"{model} answered no response")
        return result

    async def ready(self, model: str) -> bool:
        """Whether the hosting server is up and ``model`` says it is healthy."""
        return True

    async def close(self) -> None:
        return None


class BlsInfer:
    """Unary in-process call of a non-decoupled model through Triton's BLS API (the encoder's
    ``vision_encoder``).

    Deliberately not a ``StageClient``: decoupled BLS is unsafe in Triton 2.51's python
    backend. Its stub frees the tensors of a finished decoupled-BLS response iterator on a
    C++ thread without the GIL (fixed upstream in python_backend r24.12, PR #390), which
    corrupted pymalloc in our ``epd`` stub under load. Stage calls therefore always go over
    gRPC, also to this same server.
    """

    def __init__(self, pb_utils: Any) -> None:
        self._pb = pb_utils

    async def infer(
        self, model: str, inputs: Tensors, outputs: list[str], ctx: RequestContext
    ) -> Tensors:
        pb = self._pb
        request = pb.InferenceRequest(
            model_name=model,
            inputs=[pb.Tensor(name, value) for name, value in inputs.items()],
            requested_output_names=outputs,
            timeout=max(1, int(ctx.remaining() * 1_000_000)),
        )
        with tracing.span(model, ctx.trace):
            response = await asyncio.get_running_loop().run_in_executor(None, request.exec)
        if response.has_error():
            raise error_from_message(f"{model}: {response.error().message()}")
        return {t.name(): t.as_numpy() for t in response.output_tensors()}


_CHANNEL_ARGS = [
    ("grpc.max_send_message_length", 2**31 - 1),
    ("grpc.max_receive_message_length", 2**31 - 1),
    # gRPC backs off reconnecting to a peer that refused (up to 120 s by default); a stage
    # server that restarts must be reachable again within a probe period or two.
    ("grpc.initial_reconnect_backoff_ms", 100),
    ("grpc.min_reconnect_backoff_ms", 100),
    ("grpc.max_reconnect_backoff_ms", 1000),
    # Every address the name resolves to gets calls in turn (one stream per call), not
    # only the first: a headless Service's pods share a stage's load.
    ("grpc.lb_policy_name", "round_robin"),
]

_PROBE_INPUT = {"encode": "release", "prefill": "request", "decode": "request", "pd": "request"}
"""A required (or harmless) input of each stage model: a probe must pass Triton's input
checks to reach the model, which answers it without reading the value."""


class GrpcStageClient(StageClient):
    """Remote call over tritonclient's asyncio gRPC stream, signed with the deployment key.

    The aio client cannot ask for Triton's empty final response, so a request that ends
    with a data-less final flag is finished when the server closes the stream (it does so
    once our single request is complete and we have half-closed).

    With ``replies`` (a started ``ReplyListener``), the callee writes its responses to that
    listener instead (``reply_channel``): the call yields them as they arrive there and
    ends at the last one, while the gRPC stream, read beside them, brings only the
    callee's errors and its final flag.
    """

    def __init__(
        self,
        url: str,
        key: DeploymentKey,
        resolve_interval_s: float = 30.0,
        replies: ReplyListener | None = None,
    ) -> None:
        import tritonclient.grpc.aio as grpcclient

        self._mod = grpcclient
        self._url = url
        self._key = key
        self._replies = replies
        self._reply_address: str | None = None
        self._draining: set[asyncio.Task] = set()
        self._headers = {GRPC_EDGE_HEADER: key.edge_token}
        self._resolve_interval_s = resolve_interval_s
        self._client = self._open()
        self._calls: dict[Any, int] = {self._client: 0}
        """Calls in flight per channel: a channel replaced by a fresh one is closed once
        its last call ends."""

    def _open(self) -> Any:
        self._opened = time.monotonic()
        return self._mod.InferenceServerClient(self._url, channel_args=_CHANNEL_ARGS)

    def _channel(self) -> Any:
        """The current channel, replaced by a fresh one (the name resolved again) every
        ``resolve_interval_s``; the old one is closed by its last call."""
        if time.monotonic() - self._opened >= self._resolve_interval_s:
            old, self._client = self._client, self._open()
            self._calls[self._client] = 0
            if self._calls[old] == 0:
                del self._calls[old]
                asyncio.get_running_loop().create_task(old.close())
        return self._client

    async def call(
        self,
        model: str,
        inputs: Tensors,
        outputs: list[str],
        ctx: RequestContext,
        parameters: dict[str, str] | None = None,
    ) -> AsyncIterator[Tensors]:
        mod = self._mod
        infer_inputs = []
        for name, value in inputs.items():
            tensor = mod.InferInput(name, list(value.shape), triton_dtype(value))
            tensor.set_data_from_numpy(value)
            infer_inputs.append(tensor)
        parameters = dict(parameters or {})
        reply_call, inbox = None, None
        if self._replies is not None:
            reply_call, inbox = self._replies.open()
            if self._reply_address is None:
                self._reply_address = self._replies.address_toward(_host_of(self._url))
            parameters[REPLY_PARAMETER] = f"{self._reply_address}/{reply_call}"
        mac = self._key.sign_call(
            model, ctx.request_id, inputs, parameters.get(REPLY_PARAMETER, "")
        )
        span = tracing.start(
            f"call {model}",
            ctx.trace,
            tracing.trace.SpanKind.CLIENT,
            **{"server.address": self._url},
        )
        request = {
            "model_name": model,
            "inputs": infer_inputs,
            "outputs": [mod.InferRequestedOutput(n) for n in outputs],
            "request_id": ctx.request_id,
            "timeout": max(1, int(ctx.remaining() * 1_000_000)),
            "parameters": {
                MAC_PARAMETER: mac,
                **tracing.carrier(tracing.within(span)),
                **parameters,
            },
        }

        async def requests():
            yield request

        client = self._channel()
        self._calls[client] += 1
        stream = client.stream_infer(requests(), headers=self._headers)
        watch = None
        finished = False
        try:
            if inbox is None:
                responses = self._triton_responses(stream, model, ctx)
            else:
                watch = asyncio.get_running_loop().create_task(self._watch(stream, inbox, model))
                responses = self._reply_responses(inbox, model, ctx)
            async for response in responses:
                yield response
            finished = True
        except StageError as exc:
            tracing.failed(span, exc)
            raise
        except Exception as exc:  # grpc errors: unreachable, reset
            tracing.failed(span, exc)
            raise StageUnreachable(f"{model} at {self._url} failed: {exc}") from None
        finally:
            span.end()
            if reply_call is not None:
                self._replies.forget(reply_call)
            if watch is not None and finished and not watch.done():
                # The answer is complete and Triton's final flag on its way: let it come.
                drain = asyncio.get_running_loop().create_task(
                    self._drain(watch, stream, client, ctx.idle_timeout_s)
                )
                self._draining.add(drain)
                drain.add_done_callback(self._draining.discard)
            else:
                if watch is not None:
                    watch.cancel()
                if not finished:  # we stop early (cancelled, timed out): so must the callee
                    stream.cancel()
                await self._release(client)

    async def _triton_responses(
        self, stream: Any, model: str, ctx: RequestContext
    ) -> AsyncIterator[Tensors]:
        """The call's responses as the gRPC stream brings them."""
        while True:
            wait = min(ctx.idle_timeout_s, ctx.remaining())
            try:
                async with asyncio.timeout(wait):
                    result, error = await anext(stream)
            except StopAsyncIteration:
                return
            except TimeoutError:
                raise self._timed_out(model, wait, ctx) from None
            if error is not None:
                raise error_from_message(error.message())
            response = result.get_response()
            if response.outputs:
                yield {o.name: result.as_numpy(o.name) for o in response.outputs}
            if response.parameters["triton_final_response"].bool_param:
                return

    async def _reply_responses(
        self, inbox: asyncio.Queue, model: str, ctx: RequestContext
    ) -> AsyncIterator[Tensors]:
        """The call's responses from its reply channel, up to the last one. The gRPC
        stream's watcher puts the callee's error or end on the same queue (``last`` None)."""
        triton_ended = False
        while True:
            wait = min(ctx.idle_timeout_s, ctx.remaining())
            try:
                async with asyncio.timeout(wait):
                    last, payload = await inbox.get()
            except TimeoutError:
                if triton_ended:
                    raise StageError(
                        f"{model} at {self._url} ended request {ctx.request_id} but its "
                        "answer never came over the reply channel"
                    ) from None
                raise self._timed_out(model, wait, ctx) from None
            if last is None:
                if payload is not None:
                    raise payload
                triton_ended = True  # its frames left before the final flag: still coming
                continue
            if payload:
                yield payload
            if last:
                return

    async def _watch(self, stream: Any, inbox: asyncio.Queue, model: str) -> None:
        """Read a reply-channel call's gRPC stream to its end: the callee's error, or its
        end, goes on ``inbox``."""
        try:
            async for result, error in stream:
                if error is not None:
                    inbox.put_nowait((None, error_from_message(error.message())))
                    return
                response = result.get_response()
                if response.outputs:
                    wrong = StageError(f"{model} answered on Triton, not on the reply channel")
                    inbox.put_nowait((None, wrong))
                    return
                if response.parameters["triton_final_response"].bool_param:
                    break
        except Exception as exc:  # grpc errors: unreachable, reset
            inbox.put_nowait((None, StageUnreachable(f"{model} at {self._url} failed: {exc}")))
            return
        inbox.put_nowait((None, None))

    async def _drain(self, watch: asyncio.Task, stream: Any, client: Any, wait_s: float) -> None:
        """Wait (bounded) for the rest of a finished call's gRPC stream, then release it."""
        try:
            async with asyncio.timeout(wait_s):
                await asyncio.shield(watch)
        except TimeoutError:
            watch.cancel()
            stream.cancel()
        finally:
            await self._release(client)

    async def _release(self, client: Any) -> None:
        """One call on ``client`` is over; a replaced channel closes with its last call."""
        self._calls[client] -= 1
        if client is not self._client and self._calls[client] == 0:
            del self._calls[client]
            await client.close()

    def _timed_out(self, model: str, wait: float, ctx: RequestContext) -> DeadlineExceeded:
        what = "deadline" if wait < ctx.idle_timeout_s else "idle timeout"
        return DeadlineExceeded(
            f"{model} at {self._url}: no response within {wait:.1f}s ({what}) "
            f"for request {ctx.request_id}"
        )

    async def ready(self, model: str) -> bool:
        """The server is ready and ``model`` answers a probe (the engines inside are alive).

        Retries the server check until answered: while the channel waits out its reconnect
        backoff, calls fail at once with the last error (e.g. "connection refused" from
        before the server was up), so one failed call says little. The caller bounds the
        wait."""
        from tritonclient.utils import InferenceServerException

        while True:
            try:
                if not await self._channel().is_server_ready():
                    return False
                break
            except InferenceServerException:
                await asyncio.sleep(0.1)
        probe = {_PROBE_INPUT[model]: np.array([b"{}"], dtype=np.object_)}
        ctx = RequestContext.create(timeout_s=30, idle_timeout_s=30)
        try:
            async for _ in self.call(model, probe, [], ctx, {PROBE_PARAMETER: "1"}):
                pass
        except Unavailable:
            return False
        return True

    async def model_ready(self, model: str) -> bool:
        """Triton's own readiness of ``model`` (False while the server is unreachable)."""
        from tritonclient.utils import InferenceServerException

        try:
            return await self._channel().is_model_ready(model, headers=self._headers)
        except InferenceServerException:
            return False

    async def close(self) -> None:
        for drain in list(self._draining):
            drain.cancel()
        await asyncio.gather(*self._draining, return_exceptions=True)
        for client in list(self._calls):
            await client.close()
        self._calls.clear()


def _host_of(url: str) -> str:
    return url.rsplit(":", 1)[0].strip("[]")
