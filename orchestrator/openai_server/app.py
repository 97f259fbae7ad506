"""The FastAPI app: ``/v1/chat/completions``, ``/v1/completions``, ``/v1/models``,
``/tokenize``, ``/detokenize``, ``/version``, ``/health``, ``/metrics``.

Both endpoints' requests become a ``Job`` (``chat``, ``completions``), served here the same
way: a prompt, or each prompt of a completions batch, is one request of the model. A
request for ``epd`` runs ``epd``'s pipeline in this process: the front calls the
stages itself, as Dynamo's frontend routes to its workers, instead of relaying every
token through the ``epd`` Triton model beside it (that hop cost ~15 ms of CPU per request
and a stage call's latency each way). A request for ``aggregated`` is one streaming gRPC
call to that model. A client that goes away cancels the request (a stream's generator is
closed by Starlette, a plain request is raced against the disconnect), which stops it in
every stage. Errors keep their kind from the stages to the HTTP status
(``protocol.StageError.http_status``) in OpenAI's error shape.
"""

from __future__ import annotations

import asyncio
import contextlib
import json
import logging
import time
from collections.abc import AsyncIterator, Awaitable, Callable
from dataclasses import dataclass
from typing import Any

from fastapi import FastAPI, Request
from fastapi.responses import JSONResponse, Response, StreamingResponse
from vllm.entrypoints.openai.chat_completion.protocol import ChatCompletionRequest
from vllm.entrypoints.openai.completion.protocol import CompletionRequest
from vllm.entrypoints.serve.engine.protocol import (
    ErrorInfo,
    ErrorResponse,
    ModelCard,
    ModelList,
    ModelPermission,
)
from vllm.entrypoints.serve.tokenize.protocol import DetokenizeRequest

from orchestrator import tracing
from orchestrator.auth import DeploymentKey
from orchestrator.config import Topology
from orchestrator.context import RequestContext
from orchestrator.frontend import DELTA_OUTPUTS, Delta, context_length, tensors_delta
from orchestrator.openai_server import chat, completions
from orchestrator.openai_server.answer import Answer, Choice
from orchestrator.openai_server.media import MediaLoader
from orchestrator.openai_server.request import generation_defaults, parse_request
from orchestrator.openai_server.tokens import Tokens
from orchestrator.pipeline import EPDPipeline
from orchestrator.protocol import (
    DeadlineExceeded,
    InvalidRequest,
    Overloaded,
    StageError,
    TooLarge,
)
from orchestrator.reply_channel import ReplyListener
from orchestrator.stage_client import GrpcStageClient

log = logging.getLogger(__name__)
Tensors = dict[str, Any]

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


class OpenAIService:
    """What the routes share: ``epd``'s pipeline, the Triton client, names, limits and
    counters."""

    def __init__(self, topology: Topology, server: str) -> None:
        from prometheus_client import CollectorRegistry, Counter, Gauge, Histogram

        spec = topology.servers[server]
        self.topology = topology
        self.server = server
        hosted = [m for m in ("epd", "aggregated") if m in spec.stages]
        self.models = {topology.served_model_name: hosted[0], **{m: m for m in hosted}}
        """Names a request may send, and the Triton model each one calls."""
        roles = {"epd": topology.llm_stages, "aggregated": ("aggregated",)}
        self.context = {m: context_length(topology, roles[m]) for m in hosted}
        """Each model's context length (``max_model_len`` in ``/v1/models``)."""
        key = DeploymentKey.from_env()
        self.replies = None
        """Where the answers of this front's calls come back (``reply_channel``): the
        pipeline's stage calls and its own calls of ``aggregated``."""
        if topology.routing.reply_channel:
            self.replies = ReplyListener.for_server(topology, server, key)
        self.client = GrpcStageClient(
            spec.local_grpc_url, key, topology.routing.resolve_interval_s, self.replies
        )
        limits = topology.limits
        self.limits = limits
        self.defaults = generation_defaults(topology.model)
        self.media = MediaLoader(
            topology.openai.allowed_media_domains,
            topology.openai.media_timeout_s,
            limits.max_image_bytes,
        )
        self.max_body_bytes = limits.max_request_bytes * 4 // 3 + (1 << 20)  # base64, JSON
        self.max_running = topology.openai.max_concurrent_requests
        self.running = 0
        self._tokens: Tokens | None = None
        self.pipeline: EPDPipeline | None = None
        """``epd``'s pipeline, run here (once ``start`` made it) when the server hosts ``epd``."""
        self.in_flight = 0
        """``epd`` requests in the pipeline now."""
        self.stopped = {"cancelled": 0, "deadline": 0}
        """``epd`` requests stopped before their end, by reason."""
        self.registry = CollectorRegistry()
        self.requests = Counter(
            "epd_openai_requests",
            "Requests answered (chat and completions), by HTTP status",
            ["status"],
            registry=self.registry,
        )
        Gauge(
            "epd_openai_requests_running",
            "Requests in flight (each prompt of a completions batch counts)",
            registry=self.registry,
        ).set_function(lambda: self.running)
        self.ttft = Histogram(
            "epd_openai_time_to_first_token_seconds",
            "From a request's arrival to its first answer token",
            registry=self.registry,
            buckets=(0.05, 0.1, 0.25, 0.5, 1, 2.5, 5, 10, 30),
        )

    async def start(self) -> None:
        """Start ``epd``'s pipeline (on the running loop, which its gRPC channels belong
        to), its series on this front's ``/metrics`` as the ``epd`` model has them."""
        if self.replies is not None:
            await self.replies.start()
        if "epd" not in self.context:
            return
        from orchestrator.metrics import RegistryPublisher

        metrics = RegistryPublisher(self.registry, {"server": self.server})
        metrics.gauge(
            "epd_requests_in_flight",
            "Requests this model is working on: its queue depth, what an autoscaler reads",
            lambda: self.in_flight,
            model="epd",
        )
        for reason in self.stopped:
            metrics.counter(
                "epd_requests_stopped_total",
                "Requests stopped before their end: the client cancelled, or the deadline passed",
                lambda r=reason: self.stopped[r],
                model="epd",
                reason=reason,
            )
        self.pipeline = await EPDPipeline.start(self.topology, self.server, metrics, self.replies)

    async def close(self) -> None:
        try:
            if self.pipeline is not None:
                await self.pipeline.close()
        finally:
            await self.media.close()
            await self.client.close()
            if self.replies is not None:
                await self.replies.close()

    async def tokens(self) -> Tokens:
        """The checkpoint's tokenizer and family (``/tokenize``, ``/detokenize``, and
        ``echo`` of a token-id prompt), loaded off the loop on first use."""
        if self._tokens is None:
            from orchestrator.families import family_for
            from orchestrator.frontend import PromptBuilder

            model = self.topology.model
            prompts, family = await asyncio.gather(
                asyncio.to_thread(PromptBuilder, model, min(self.context.values())),
                asyncio.to_thread(family_for, model),
            )
            self._tokens = Tokens(prompts, family, self.media, self.limits.max_image_pixels)
        return self._tokens

    def model_for(self, name: str | None) -> str:
        if not name:
            return next(iter(self.models.values()))
        if name not in self.models:
            raise LookupError(
                f"The model `{name}` does not exist. Valid names: {', '.join(self.models)}."
            )
        return self.models[name]

    async def deltas(self, model: str, inputs: dict, ctx: RequestContext) -> AsyncIterator[Delta]:
        """The model's steps; closing this generator early stops the request everywhere."""
        if model == "epd" and self.pipeline is not None:
            responses = self._epd(self.pipeline, inputs, ctx)
        else:
            responses = self.client.call(model, inputs, DELTA_OUTPUTS, ctx)
        async with contextlib.aclosing(responses) as rs:
            async for tensors in rs:
                yield tensors_delta(tensors)

    async def _epd(
        self, pipeline: EPDPipeline, inputs: Tensors, ctx: RequestContext
    ) -> AsyncIterator[Tensors]:
        """``epd``'s responses from the pipeline, with what the ``epd`` model's runner adds:
        its span, the count of requests in flight and of those stopped, and a short
        ``INTERNAL`` error for the client when something unexpected fails (the trace goes to
        the log)."""
        span = tracing.start("epd", ctx.trace, **{"epd.request_id": ctx.request_id})
        ctx.trace = tracing.within(span)
        self.in_flight += 1
        try:
            async for tensors in pipeline.generate(inputs, ctx):
                yield tensors
        except (asyncio.CancelledError, GeneratorExit):  # the client went away
            self.stopped["cancelled"] += 1
            raise
        except StageError as exc:
            self.stopped["deadline"] += isinstance(exc, DeadlineExceeded)
            tracing.failed(span, exc)
            raise
        except Exception as exc:
            log.exception("epd request %s failed", ctx.request_id)
            tracing.failed(span, exc)
            raise StageError(
                f"internal error in epd (request {ctx.request_id}); the server log has the details"
            ) from None
        finally:
            self.in_flight -= 1
            span.end()


def create_app(topology: Topology, server: str) -> FastAPI:
    @contextlib.asynccontextmanager
    async def lifespan(app: FastAPI) -> AsyncIterator[None]:
        tracing.setup(topology.tracing, f"{server}/openai")
        # Built on the server's loop: gRPC's asyncio channel belongs to the loop it is made on.
        app.state.service = OpenAIService(topology, server)
        await app.state.service.start()
        yield
        await app.state.service.close()
        tracing.shutdown()

    app = FastAPI(title="epd OpenAI-compatible API", lifespan=lifespan)

    @app.get("/health")
    async def health(raw: Request) -> Response:
        """200 once every model this front calls is ready on its Triton server."""
        service: OpenAIService = raw.app.state.service
        for model in set(service.models.values()):
            if not await service.client.model_ready(model):
                return Response(status_code=503)
        return Response(status_code=200)

    @app.get("/version")
    async def version() -> JSONResponse:
        """The vLLM whose request shapes and engines this server runs (what a client of
        ``vllm serve`` reads here), and this project's own version."""
        from importlib.metadata import version

        from vllm import __version__ as vllm_version

        return JSONResponse({"version": vllm_version, "epd": version("epd-orchestrator")})

    @app.get("/metrics")
    async def metrics(raw: Request) -> Response:
        from prometheus_client import CONTENT_TYPE_LATEST, generate_latest

        registry = raw.app.state.service.registry
        return Response(generate_latest(registry), media_type=CONTENT_TYPE_LATEST)

    @app.get("/v1/models")
    async def models(raw: Request) -> JSONResponse:
        service: OpenAIService = raw.app.state.service
        root = str(topology.model)
        cards = [
            ModelCard(
                id=name,
                root=root,
                parent=None if name == topology.served_model_name else topology.served_model_name,
                owned_by="epd",
                max_model_len=service.context[model],
                permission=[ModelPermission()],
            )
            for name, model in service.models.items()
        ]
        return JSONResponse(ModelList(data=cards).model_dump())

    @app.post("/v1/chat/completions")
    async def chat_completions(raw: Request) -> Response:
        return await _serve(raw.app.state.service, raw, _chat_job)

    @app.post("/v1/completions")
    async def completions(raw: Request) -> Response:
        return await _serve(raw.app.state.service, raw, _completion_job)

    @app.post("/tokenize")
    async def tokenize(raw: Request) -> Response:
        service: OpenAIService = raw.app.state.service
        try:
            tokens = await service.tokens()
            request, ids = await tokens.tokenize(await _read_json(service, raw))
            context = service.context[service.model_for(request.model)]
            answer = tokens.response(ids, context, bool(request.return_token_strs))
        except LookupError as exc:
            return error_response(404, str(exc.args[0]), "model")
        except StageError as exc:
            return stage_error_response(exc)
        return JSONResponse(answer.model_dump())

    @app.post("/detokenize")
    async def detokenize(raw: Request) -> Response:
        service: OpenAIService = raw.app.state.service
        try:
            request = parse_request(DetokenizeRequest, await _read_json(service, raw))
            service.model_for(request.model)
            answer = (await service.tokens()).detokenize(request)
        except LookupError as exc:
            return error_response(404, str(exc.args[0]), "model")
        except StageError as exc:
            return stage_error_response(exc)
        return JSONResponse(answer.model_dump())

    return app


@dataclass
class Job:
    """One HTTP request as the front serves it: which model, one set of inputs per
    prompt, what the answer looks like."""

    model: str
    inputs: list[Tensors]
    answer: Answer
    stream: bool
    include_usage: bool
    span: str
    """The name of the request's span (its route's, as OpenAI's SDK names it)."""


async def _chat_job(service: OpenAIService, body: Any) -> Job:
    request = parse_request(ChatCompletionRequest, body)
    model = service.model_for(request.model)
    inputs = await chat.model_inputs(request, service.defaults, service.media)
    # The answer's id is the client's request_id, as vLLM names it; inside, the
    # request gets an id of its own (a client's may collide with another's in every
    # stage's bookkeeping: handles released by request id, KV abandoned by it).
    answer = chat.ChatAnswer(id=f"chatcmpl-{request.request_id}", model=request.model or model)
    return Job(model, [inputs], answer, bool(request.stream), _usage(request), "chat.completions")


async def _completion_job(service: OpenAIService, body: Any) -> Job:
    request = parse_request(CompletionRequest, body)
    model = service.model_for(request.model)
    inputs = completions.model_inputs(request, service.defaults)
    echo = []
    request_prompts = completions.prompts(request)
    if request.echo:
        tokenizer = (await service.tokens()).prompts.tokenizer
        echo = [p if isinstance(p, str) else tokenizer.decode(p) for p in request_prompts]
    answer = completions.CompletionAnswer(
        id=f"cmpl-{request.request_id}",
        model=request.model or model,
        choices=[Choice() for _ in inputs],
        echo=echo,
    )
    return Job(model, inputs, answer, bool(request.stream), _usage(request), "completions")


def _usage(request: Any) -> bool:
    return bool(request.stream_options and request.stream_options.include_usage)


async def _read_json(service: OpenAIService, raw: Request) -> Any:
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


async def _serve(service: OpenAIService, raw: Request, job_of: JobMaker) -> Response:
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
            job = await job_of(service, await _read_json(service, raw))
            slots.take(len(job.inputs) - 1)  # a batch's prompts each run as a request
        except LookupError as exc:
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
        rest = _merged(streams)
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
"""Reads an endpoint's request body into a ``Job`` (``StageError`` or ``LookupError``
when it cannot be served)."""


def _first_error(steps: list[Delta | BaseException]) -> BaseException | None:
    return next((step for step in steps if isinstance(step, BaseException)), None)


async def _first(stream: AsyncIterator[Delta]) -> Delta:
    """A stream's first step (an empty one for a stream that ends at once)."""
    return await anext(stream, Delta("", 0, "stop"))


async def _merged(streams: list[AsyncIterator[Delta]]) -> AsyncIterator[tuple[int, Delta]]:
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
    """A request's share of the front's ``max_concurrent_requests`` (one per prompt),
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
                f"{1 + more} prompts in one request; this server runs at most "
                f"{service.max_running} at once"
            )
        if service.running + more > service.max_running:
            raise Overloaded(
                f"this server is at its limit of {service.max_running} requests in flight "
                f"(the request's {1 + more} prompts each count)"
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
        async with contextlib.aclosing(_merged(streams)) as steps:
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
        for event in answer.opening():
            yield event
        for index, delta in [*enumerate(firsts)]:
            answer.add(index, delta)
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
