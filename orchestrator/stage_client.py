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


def infer_request(
    model: str,
    inputs: Tensors,
    outputs: list[str],
    ctx: RequestContext,
    parameters: dict[str, str],
) -> Any:
    """Triton's ``ModelInferRequest`` of one call on behalf of ``ctx``'s request: the
    tensors in its raw contents (BYTES length-prefixed, as Triton reads them), the time
    left to the request as Triton's ``timeout`` (µs), ``parameters`` as strings."""
    from tritonclient.grpc import service_pb2
    from tritonclient.utils import serialize_byte_tensor

    request = service_pb2.ModelInferRequest(model_name=model, id=ctx.request_id)
    for name, value in inputs.items():
        tensor = request.inputs.add(name=name, datatype=triton_dtype(value))
        tensor.shape.extend(value.shape)
        if value.dtype == np.object_:
            serialized = serialize_byte_tensor(value)
            request.raw_input_contents.append(serialized.item() if serialized.size else b"")
        else:
            request.raw_input_contents.append(value.tobytes())
    for name in outputs:
        request.outputs.add(name=name)
    request.parameters["timeout"].int64_param = max(1, int(ctx.remaining() * 1_000_000))
    for name, value in parameters.items():
        request.parameters[name].string_param = value
    return request


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

_STREAM_INFER = "/inference.GRPCInferenceService/ModelStreamInfer"


class _Channel:
    """One gRPC channel to a stage server, the calls made on it, and its count of calls
    in flight (a channel replaced by a fresh one is closed once its last call ends).

    Triton's ``ModelStreamInfer`` is a bidirectional stream, but a stage call sends one
    request on it, so it is called here as server-streaming: on the wire that is the same
    thing (one HTTP/2 stream, one message, the client's half-close), and gRPC then sends
    the headers, the request and the half-close in one batch. As a bidirectional call (what
    tritonclient's ``stream_infer`` makes) they are three operations, each waited for in
    turn on the event loop, with a task to feed the request iterator. Measured against a
    running server, alternated, the server-streaming call takes about a quarter less of
    the caller's CPU (``docs/benchmarks.md``: 0.72 against 0.90 ms a call, four at once)."""

    def __init__(self, url: str) -> None:
        import grpc
        from tritonclient.grpc import service_pb2, service_pb2_grpc

        self.opened = time.monotonic()
        self.channel = grpc.aio.insecure_channel(url, options=_CHANNEL_ARGS)
        self.service = service_pb2_grpc.GRPCInferenceServiceStub(self.channel)
        self.stream_infer = self.channel.unary_stream(
            _STREAM_INFER,
            request_serializer=service_pb2.ModelInferRequest.SerializeToString,
            response_deserializer=service_pb2.ModelStreamInferResponse.FromString,
        )
        self.calls = 0


class GrpcStageClient(StageClient):
    """Remote call over a gRPC stream of Triton's inference protocol, signed with the
    deployment key.

    A call does not ask Triton for an empty final response
    (``triton_enable_empty_final_response``), so a request that ends with a data-less
    final flag is finished when the server closes the stream: it does so once our single
    request is complete, the stream half-closed, the same moment.

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
        from tritonclient.grpc import service_pb2

        self._pb = service_pb2
        self._url = url
        self._key = key
        self._replies = replies
        self._reply_address: str | None = None
        self._draining: set[asyncio.Task] = set()
        self._metadata = ((GRPC_EDGE_HEADER, key.edge_token),)
        self._resolve_interval_s = resolve_interval_s
        self._current = _Channel(url)
        self._open: list[_Channel] = [self._current]
        """Channels not closed yet: the current one, and replaced ones with calls in flight."""

    def _channel(self) -> _Channel:
        """The current channel, replaced by a fresh one (the name resolved again) every
        ``resolve_interval_s``; the old one is closed by its last call."""
        if time.monotonic() - self._current.opened >= self._resolve_interval_s:
            old, self._current = self._current, _Channel(self._url)
            self._open.append(self._current)
            if old.calls == 0:
                self._open.remove(old)
                asyncio.get_running_loop().create_task(old.channel.close())
        return self._current

    async def call(
        self,
        model: str,
        inputs: Tensors,
        outputs: list[str],
        ctx: RequestContext,
        parameters: dict[str, str] | None = None,
    ) -> AsyncIterator[Tensors]:
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
        parameters = {MAC_PARAMETER: mac, **tracing.carrier(tracing.within(span)), **parameters}
        channel = self._channel()
        channel.calls += 1
        stream = channel.stream_infer(
            infer_request(model, inputs, outputs, ctx, parameters), metadata=self._metadata
        )
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
            raise StageUnreachable(f"{model} at {self._url} failed: {_rpc_error(exc)}") from None
        finally:
            span.end()
            if reply_call is not None:
                self._replies.forget(reply_call)
            if watch is not None and finished and not watch.done():
                # The answer is complete and Triton's final flag on its way: let it come.
                drain = asyncio.get_running_loop().create_task(
                    self._drain(watch, stream, channel, ctx.idle_timeout_s)
                )
                self._draining.add(drain)
                drain.add_done_callback(self._draining.discard)
            else:
                if watch is not None:
                    watch.cancel()
                if not finished:  # we stop early (cancelled, timed out): so must the callee
                    stream.cancel()
                await self._release(channel)

    async def _triton_responses(
        self, stream: Any, model: str, ctx: RequestContext
    ) -> AsyncIterator[Tensors]:
        """The call's responses as the gRPC stream brings them."""
        from grpc.aio import EOF
        from tritonclient.grpc import InferResult

        while True:
            wait = min(ctx.idle_timeout_s, ctx.remaining())
            try:
                async with asyncio.timeout(wait):
                    message = await stream.read()
            except TimeoutError:
                raise self._timed_out(model, wait, ctx) from None
            if message is EOF:
                return
            if message.error_message:
                raise error_from_message(message.error_message)
            response = message.infer_response
            if response.outputs:
                result = InferResult(response)
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
            async for message in stream:
                if message.error_message:
                    inbox.put_nowait((None, error_from_message(message.error_message)))
                    return
                response = message.infer_response
                if response.outputs:
                    wrong = StageError(f"{model} answered on Triton, not on the reply channel")
                    inbox.put_nowait((None, wrong))
                    return
                if response.parameters["triton_final_response"].bool_param:
                    break
        except Exception as exc:  # grpc errors: unreachable, reset
            failed = StageUnreachable(f"{model} at {self._url} failed: {_rpc_error(exc)}")
            inbox.put_nowait((None, failed))
            return
        inbox.put_nowait((None, None))

    async def _drain(
        self, watch: asyncio.Task, stream: Any, channel: _Channel, wait_s: float
    ) -> None:
        """Wait (bounded) for the rest of a finished call's gRPC stream, then release it."""
        try:
            async with asyncio.timeout(wait_s):
                await asyncio.shield(watch)
        except TimeoutError:
            watch.cancel()
            stream.cancel()
        finally:
            await self._release(channel)

    async def _release(self, channel: _Channel) -> None:
        """One call on ``channel`` is over; a replaced channel closes with its last call."""
        channel.calls -= 1
        if channel is not self._current and channel.calls == 0:
            self._open.remove(channel)
            await channel.channel.close()

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
        from grpc.aio import AioRpcError

        while True:
            try:
                answer = await self._channel().service.ServerReady(self._pb.ServerReadyRequest())
                if not answer.ready:
                    return False
                break
            except AioRpcError:
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
        from grpc.aio import AioRpcError

        try:
            answer = await self._channel().service.ModelReady(
                self._pb.ModelReadyRequest(name=model), metadata=self._metadata
            )
        except AioRpcError:
            return False
        return answer.ready

    async def close(self) -> None:
        for drain in list(self._draining):
            drain.cancel()
        await asyncio.gather(*self._draining, return_exceptions=True)
        for channel in self._open:
            await channel.channel.close()
        self._open.clear()


def _rpc_error(exc: Exception) -> str:
    """A gRPC error as its status and details (its repr also has a debug string)."""
    from grpc.aio import AioRpcError

    if isinstance(exc, AioRpcError):
        return f"{exc.code().name}: {exc.details()}"
    return str(exc)


def _host_of(url: str) -> str:
    return url.rsplit(":", 1)[0].strip("[]")
