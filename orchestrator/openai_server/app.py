"""The FastAPI app: ``/v1/chat/completions``, ``/v1/completions``, ``/v1/models``,
``/tokenize``, ``/detokenize``, ``/version``, ``/health``, ``/metrics``.

Both completion endpoints read their request into a ``Job`` (``chat``, ``completions``)
that ``serving`` answers the same way: each answer (``n`` per prompt, of each prompt of a
completions list) is one request of the model, stopped in every stage when the client
goes away.
"""

from __future__ import annotations

import contextlib
from collections.abc import AsyncIterator
from typing import Any

from fastapi import FastAPI, Request
from fastapi.responses import JSONResponse, Response
from vllm.entrypoints.openai.chat_completion.protocol import ChatCompletionRequest
from vllm.entrypoints.openai.completion.protocol import CompletionRequest
from vllm.entrypoints.serve.engine.protocol import ModelCard, ModelList, ModelPermission
from vllm.entrypoints.serve.tokenize.protocol import DetokenizeRequest

from orchestrator import tracing
from orchestrator.config import Topology
from orchestrator.openai_server import chat, completions
from orchestrator.openai_server.answer import Choice
from orchestrator.openai_server.request import parse_request
from orchestrator.openai_server.service import OpenAIService, UnknownModel
from orchestrator.openai_server.serving import (
    Job,
    error_response,
    read_json,
    serve,
    stage_error_response,
)
from orchestrator.protocol import StageError


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
        return await serve(raw.app.state.service, raw, _chat_job)

    @app.post("/v1/completions")
    async def completions(raw: Request) -> Response:
        return await serve(raw.app.state.service, raw, _completion_job)

    @app.post("/tokenize")
    async def tokenize(raw: Request) -> Response:
        service: OpenAIService = raw.app.state.service
        try:
            tokens = await service.tokens()
            request, ids = await tokens.tokenize(await read_json(service, raw))
            context = service.context[service.model_for(request.model)]
            answer = tokens.response(ids, context, bool(request.return_token_strs))
        except UnknownModel as exc:
            return error_response(404, str(exc.args[0]), "model")
        except StageError as exc:
            return stage_error_response(exc)
        return JSONResponse(answer.model_dump())

    @app.post("/detokenize")
    async def detokenize(raw: Request) -> Response:
        service: OpenAIService = raw.app.state.service
        try:
            request = parse_request(DetokenizeRequest, await read_json(service, raw))
            service.model_for(request.model)
            answer = (await service.tokens()).detokenize(request)
        except UnknownModel as exc:
            return error_response(404, str(exc.args[0]), "model")
        except StageError as exc:
            return stage_error_response(exc)
        return JSONResponse(answer.model_dump())

    return app


async def _chat_job(service: OpenAIService, body: Any) -> Job:
    request = parse_request(ChatCompletionRequest, body)
    model = service.model_for(request.model)
    inputs = await chat.model_inputs(request, service.defaults, service.media)
    # The answer's id is the client's request_id, as vLLM names it; inside, the
    # request gets an id of its own (a client's may collide with another's in every
    # stage's bookkeeping: handles released by request id, KV abandoned by it).
    answer = chat.ChatAnswer(
        id=f"chatcmpl-{request.request_id}",
        model=request.model or model,
        choices=[Choice() for _ in inputs],
        per_prompt=len(inputs),  # one conversation
        top_logprobs=(request.top_logprobs or 0) if request.logprobs else None,
        continuous_usage=_continuous_usage(request),
        token_ids=bool(request.return_token_ids),
    )
    return Job(model, inputs, answer, bool(request.stream), _usage(request), "chat.completions")


async def _completion_job(service: OpenAIService, body: Any) -> Job:
    request = parse_request(CompletionRequest, body)
    model = service.model_for(request.model)
    inputs = completions.model_inputs(request, service.defaults)
    echo = []
    request_prompts = completions.prompts(request)
    if request.echo and not request.return_token_ids:  # vLLM echoes the ids instead
        tokenizer = (await service.tokens()).prompts.tokenizer
        texts = [p if isinstance(p, str) else tokenizer.decode(p) for p in request_prompts]
        echo = [text for text in texts for _ in range(request.n)]
    answer = completions.CompletionAnswer(
        id=f"cmpl-{request.request_id}",
        model=request.model or model,
        choices=[Choice() for _ in inputs],
        per_prompt=request.n,
        top_logprobs=request.logprobs,
        continuous_usage=_continuous_usage(request),
        token_ids=bool(request.return_token_ids),
        echo=echo,
    )
    return Job(model, inputs, answer, bool(request.stream), _usage(request), "completions")


def _usage(request: Any) -> bool:
    return bool(request.stream_options and request.stream_options.include_usage)


def _continuous_usage(request: Any) -> bool:
    """Usage in every chunk: asked with ``include_usage``, as vLLM reads the two."""
    return _usage(request) and bool(request.stream_options.continuous_usage_stats)
