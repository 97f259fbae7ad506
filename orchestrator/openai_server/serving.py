"""How the front answers a request of either endpoint (a ``Job``): the cap on requests in
flight, one ``RequestContext`` per answer, each answer's first step deciding the status,
the answers' streams merged by choice index, whole answers or server-sent events, and the
client's hang-up stopping every answer in every stage. Errors keep their kind from the
stages to the HTTP status (``protocol.StageError.http_status``) in OpenAI's error shape.
"""

from __future__ import annotations

import asyncio
import contextlib
import json
import time
from collections.abc import AsyncIterator, Awaitable, Callable
from dataclasses import dataclass
from typing import Any

from fastapi import Request
from fastapi.responses import JSONResponse, Response, StreamingResponse
from vllm.entrypoints.serve.engine.protocol import ErrorInfo, ErrorResponse

from orchestrator import tracing
from orchestrator.context import RequestContext
from orchestrator.frontend import Delta
from orchestrator.openai_server.answer import Answer
from orchestrator.openai_server.service import OpenAIService, UnknownModel
from orchestrator.protocol import InvalidRequest, Overloaded, StageError, Tensors, TooLarge

_ERROR_TYPES = {
    400: "BadRequestError",
    401: "AuthenticationError",
    404: "NotFoundError",
    413: "RequestTooLargeError",
    429: "RateLimitError",
    499: "ClientClosedRequest",
    503: "ServiceUnavailableError",
    504: "TimeoutError",
}


def error_body(status: int, message: str, param: str | None = None) -> ErrorResponse:
    """OpenAI's error shape (vLLM's ``ErrorResponse``), with the status as its code."""
    kind = _ERROR_TYPES.get(status, "InternalServerError")
    return ErrorResponse(error=ErrorInfo(message=message, type=kind, param=param, code=status))


def error_response(status: int, message: str, param: str | None = None) -> JSONResponse:
    return JSONResponse(error_body(status, message, param).model_dump(), status_code=status)


def stage_error_response(exc: StageError) -> JSONResponse:
    return error_response(exc.http_status, str(exc))


@dataclass
class Job:
    """One HTTP request as the front serves it: which model, one set of inputs per
    answer (choice index order), what the answer looks like."""

    model: str
    inputs: list[Tensors]
    answer: Answer
    stream: bool
    include_usage: bool
    span: str
    """The name of the request's span (its route's, as OpenAI's SDK names it)."""


async def read_json(service: OpenAIService, raw: Request) -> Any:
    length = raw.headers.get("content-length")
    if length is not None and int(length) > service.max_body_bytes:
        raise TooLarge(f"request body is {length} bytes; the limit is {service.max_body_bytes}")
    body = bytearray()
    async for chunk in raw.stream():
        body += chunk
        if len(body) > service.max_body_bytes:
            raise TooLarge(f"request body is over the limit of {service.max_body_bytes} bytes")
    try:
        return json.loads(body)
    except (json.JSONDecodeError, UnicodeDecodeError) as exc:
        raise InvalidRequest(f"the body is not valid JSON: {exc}") from None


async def serve(service: OpenAIService, raw: Request, job_of: JobMaker) -> Response:
    """Answer one request of either endpoint, and count it by status."""
    status = 500
    try:
        response = await _answer(service, raw, job_of)
        status = response.status_code
        return response
    finally:
        service.requests.labels(status=str(status)).inc()


async def _answer(service: OpenAIService, raw: Request, job_of: JobMaker) -> Response:
    start = time.perf_counter()
    if service.running >= service.max_running:
        return stage_error_response(
            Overloaded(f"this server is at its limit of {service.max_running} requests in flight")
        )
    slots = _Slots(service)
    try:
        try:
            job = await job_of(service, await read_json(service, raw))
            slots.take(len(job.inputs) - 1)  # each answer of each prompt runs as a request
        except UnknownModel as exc:
            return error_response(404, str(exc.args[0]), "model")
        except StageError as exc:
            return stage_error_response(exc)
        limits = service.limits
        contexts = [
            RequestContext.create(limits.request_timeout_s, limits.stream_idle_timeout_s)
            for _ in job.inputs
        ]
        # The request's span, under the client's trace when it sent a traceparent header.
        span = tracing.start(
            job.span,
            tracing.remote_context(raw.headers),
            tracing.trace.SpanKind.SERVER,
            **{
                "epd.request_id": ",".join(ctx.request_id for ctx in contexts),
                "epd.answer_id": job.answer.id,
                "epd.model": job.model,
            },
        )
        for ctx in contexts:
            ctx.trace = tracing.within(span)
        pairs = zip(job.inputs, contexts, strict=True)
        streams = [service.deltas(job.model, inputs, ctx) for inputs, ctx in pairs]
        if not job.stream:
            try:
                return await _until_disconnect(raw, _whole(job.answer, streams, service, start))
            finally:
                span.end()
        # Each prompt's first step decides the status: errors before it are plain HTTP errors.
        firsts = await _until_disconnect(
            raw, asyncio.gather(*(_first(s) for s in streams), return_exceptions=True)
        )
        failed = firsts if isinstance(firsts, Response) else _first_error(firsts)
        if failed is not None:
            for stream in streams:
                await stream.aclose()
            if isinstance(failed, BaseException):
                tracing.failed(span, failed)
            span.end()
            if isinstance(failed, Response):  # the client left already
                return failed
            if isinstance(failed, StageError):
                return stage_error_response(failed)
            raise failed
        service.ttft.observe(time.perf_counter() - start)
        rest = merged(streams)
        stream_slots, slots = slots, None  # the stream gives them back

        async def finish() -> None:
            await rest.aclose()  # cancels the gRPC calls if the stream stopped early
            for stream in streams:  # those never read past their first step
                await stream.aclose()
            stream_slots.release()
            span.end()

        events = _events(job, firsts, rest, stream_slots)
        return _EventStream(events, finish)
    finally:
        if slots is not None:
            slots.release()


JobMaker = Callable[[OpenAIService, Any], Awaitable[Job]]
"""Reads an endpoint's request body into a ``Job`` (``StageError`` or ``UnknownModel``
when it cannot be served)."""


def _first_error(steps: list[Delta | BaseException]) -> BaseException | None:
    return next((step for step in steps if isinstance(step, BaseException)), None)


async def _first(stream: AsyncIterator[Delta]) -> Delta:
    """A stream's first step (an empty one for a stream that ends at once)."""
    return await anext(stream, Delta("", 0, "stop"))


async def merged(streams: list[AsyncIterator[Delta]]) -> AsyncIterator[tuple[int, Delta]]:
    """The streams' steps as they come, each with its stream's index; the first error
    ends it, and closing it stops every stream."""
    if len(streams) == 1:
        async with contextlib.aclosing(streams[0]) as only:
            async for delta in only:
                yield 0, delta
        return
    steps: asyncio.Queue[tuple[int, Delta | Exception | None]] = asyncio.Queue()

    async def pump(index: int, stream: AsyncIterator[Delta]) -> None:
        try:
            async with contextlib.aclosing(stream):
                async for delta in stream:
                    steps.put_nowait((index, delta))
        except Exception as exc:  # noqa: BLE001 - handed to the reader, which raises it
            steps.put_nowait((index, exc))
        else:
            steps.put_nowait((index, None))

    pumps = [asyncio.ensure_future(pump(i, s)) for i, s in enumerate(streams)]
    try:
        running = len(pumps)
        while running:
            index, step = await steps.get()
            if step is None:
                running -= 1
            elif isinstance(step, Exception):
                raise step
            else:
                yield index, step
    finally:
        for task in pumps:
            task.cancel()
        await asyncio.gather(*pumps, return_exceptions=True)


class _Slots:
    """A request's share of the front's ``max_concurrent_requests`` (one per answer),
    given back once: by a stream before its ``[DONE]``, so a client that waits for it
    before sending the next request never finds the front full because of its own last
    request."""

    def __init__(self, service: OpenAIService) -> None:
        self.service: OpenAIService | None = service
        self.count = 1
        service.running += 1

    def take(self, more: int) -> None:
        """``more`` slots besides the first, or ``TooLarge`` / ``Overloaded``."""
        service = self.service
        assert service is not None
        if more <= 0:
            return
        if 1 + more > service.max_running:
            raise TooLarge(
                f"{1 + more} answers in one request (prompts x n); this server runs at most "
                f"{service.max_running} at once"
            )
        if service.running + more > service.max_running:
            raise Overloaded(
                f"this server is at its limit of {service.max_running} requests in flight "
                f"(each of the request's {1 + more} answers counts)"
            )
        service.running += more
        self.count += more

    def release(self) -> None:
        if self.service is not None:
            self.service.running -= self.count
            self.service = None


async def _until_disconnect(raw: Request, work: Any) -> Any:
    """``work``'s result, or a 499 once the client disconnected first (``work`` is
    cancelled: the stages stop the request)."""
    task = asyncio.ensure_future(work)

    async def disconnected() -> None:
        while (await raw.receive())["type"] != "http.disconnect":
            pass

    watch = asyncio.ensure_future(disconnected())
    try:
        await asyncio.wait([task, watch], return_when=asyncio.FIRST_COMPLETED)
    finally:
        watch.cancel()
    if not task.done():
        task.cancel()
        with contextlib.suppress(BaseException):
            await task
        return error_response(499, "the client closed the connection")
    return task.result()


async def _whole(
    answer: Answer, streams: list[AsyncIterator[Delta]], service: OpenAIService, start: float
) -> Response:
    first = True
    try:
        async with contextlib.aclosing(merged(streams)) as steps:
            async for index, delta in steps:
                if first:
                    service.ttft.observe(time.perf_counter() - start)
                    first = False
                answer.add(index, delta)
    except StageError as exc:
        return stage_error_response(exc)
    return JSONResponse(answer.response().model_dump())


class _EventStream(StreamingResponse):
    """Server-sent events whose ``finish`` runs however the response ends: sent whole,
    client gone mid-stream, or gone before the first byte (when the body generator never
    even starts, so its own ``finally`` would not run)."""

    def __init__(self, events: AsyncIterator[str], finish: Any) -> None:
        super().__init__(events, media_type="text/event-stream")
        self._finish = finish

    async def __call__(self, scope: Any, receive: Any, send: Any) -> None:
        try:
            await super().__call__(scope, receive, send)
        finally:
            await self.body_iterator.aclose()  # type: ignore[union-attr]
            await self._finish()


async def _events(
    job: Job, firsts: list[Delta], rest: AsyncIterator[tuple[int, Delta]], slots: _Slots
) -> AsyncIterator[str]:
    """Server-sent events: the opening (chat: the role), each step as it comes, the usage
    if asked, ``[DONE]``. An error after the first steps is an error event (the status is
    long sent)."""
    answer = job.answer
    try:
        for index, delta in enumerate(firsts):
            answer.add(index, delta)
        for event in answer.opening():
            yield event
        for index, delta in enumerate(firsts):
            if (event := answer.event(index, delta)) is not None:
                yield event
        async for index, delta in rest:
            answer.add(index, delta)
            if (event := answer.event(index, delta)) is not None:
                yield event
        if job.include_usage:
            yield answer.usage_event()
    except StageError as exc:
        yield f"data: {error_body(exc.http_status, str(exc)).model_dump_json()}\n\n"
    slots.release()
    yield "data: [DONE]\n\n"
