"""What the OpenAI front's routes share: ``epd``'s pipeline (run in this process), the
Triton client for ``aggregated``, the model names, limits, counters, and the tokenizer.

A request for ``epd`` runs ``epd``'s pipeline here: the front calls the stages itself, as
Dynamo's frontend routes to its workers, instead of relaying every token through the
``epd`` Triton model beside it (that hop cost ~15 ms of CPU per request and a stage call's
latency each way). A request for ``aggregated`` is one streaming gRPC call to that model.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
from collections.abc import AsyncIterator

from orchestrator import tracing
from orchestrator.auth import DeploymentKey
from orchestrator.config import Topology
from orchestrator.context import RequestContext
from orchestrator.frontend import Delta, ExtraOutputs, context_length, tensors_delta
from orchestrator.openai_server.media import MediaLoader
from orchestrator.openai_server.request import generation_defaults
from orchestrator.openai_server.tokens import Tokens
from orchestrator.pipeline import EPDPipeline
from orchestrator.protocol import DeadlineExceeded, StageError, Tensors
from orchestrator.reply_channel import ReplyListener
from orchestrator.stage_client import GrpcStageClient

log = logging.getLogger(__name__)


class UnknownModel(LookupError):
    """A request names a model this front does not serve (404)."""


class OpenAIService:
    """What the routes share: ``epd``'s pipeline, the Triton client, names, limits,
    counters, and the tokenizer (``tokens``)."""

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
            "Requests in flight (each answer counts: n, times a completions list's prompts)",
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
        ``echo`` of a token-id prompt), loaded off the loop on first use; the tokenizer is
        ``epd``'s pipeline's own when this front runs one."""
        if self._tokens is None:
            from orchestrator.families import family_for
            from orchestrator.frontend import PromptBuilder

            model = self.topology.model
            family = await asyncio.to_thread(family_for, model)
            if self.pipeline is not None:
                prompts = self.pipeline.prompts
            else:
                context = min(self.context.values())
                prompts = await asyncio.to_thread(PromptBuilder, model, context)
            self._tokens = Tokens(prompts, family, self.media, self.limits)
        return self._tokens

    def model_for(self, name: str | None) -> str:
        if not name:
            return next(iter(self.models.values()))
        if name not in self.models:
            raise UnknownModel(
                f"The model `{name}` does not exist. Valid names: {', '.join(self.models)}."
            )
        return self.models[name]

    async def deltas(self, model: str, inputs: dict, ctx: RequestContext) -> AsyncIterator[Delta]:
        """The model's steps; closing this generator early stops the request everywhere."""
        if model == "epd" and self.pipeline is not None:
            responses = self._epd(self.pipeline, inputs, ctx)
        else:
            names = ExtraOutputs.asked_by(inputs).names()
            responses = self.client.call(model, inputs, names, ctx)
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
