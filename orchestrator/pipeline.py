"""The E -> P -> D (or E -> PD) request flow behind the public ``epd`` model (hosted by the
``epd`` Triton model for KServe clients, and by the OpenAI front itself for its own).

Each stage is reached through a gRPC ``StageClient``, over loopback when the stage is
hosted by this server (decoupled BLS is unsafe in Triton 2.51: ``stage_client.BlsInfer``).
Only metadata crosses these calls: the encoder answers handles, prefill pulls the
embeddings itself, decode pulls the KV itself.
"""

from __future__ import annotations

import asyncio
import contextlib
import dataclasses
import hashlib
import logging
import time
from collections.abc import AsyncIterator, Awaitable, Callable
from typing import TypeVar

import numpy as np

from orchestrator import tracing
from orchestrator.auth import DeploymentKey
from orchestrator.config import StageName, Topology
from orchestrator.context import RequestContext
from orchestrator.frontend import (
    Delta,
    ExtraOutputs,
    FrontRequest,
    Prompt,
    PromptBuilder,
    completion_responses,
    parse_front_request,
    tensors_delta,
)
from orchestrator.metrics import MetricSink
from orchestrator.protocol import (
    DeadlineExceeded,
    DecodeRequest,
    EmbeddingHandle,
    EncodeResult,
    InvalidRequest,
    Overloaded,
    PrefillDecodeRequest,
    PrefillRequest,
    PrefillResult,
    ReleaseRequest,
    SamplingOptions,
    StageError,
    StageUnreachable,
    Tensors,
    Unavailable,
    from_tensor,
    to_tensor,
)
from orchestrator.reply_channel import ReplyListener
from orchestrator.router import HealthMonitor, ReuseIndex, StageRoute
from orchestrator.stage_client import GrpcStageClient, StageClient
from orchestrator.triton.runner import ModelContext

log = logging.getLogger(__name__)
T = TypeVar("T")

CLEANUP_TIMEOUT_S = 5.0
"""Bound on the calls that clean up after a failed or cancelled request (release handles,
free prefill's KV): past it the encoder's TTL and vLLM's KV lease are the backstop."""


class EPDPipeline:
    """Handler of the ``epd`` model: validate, encode, then prefill and stream decode --
    on one ``pd`` engine (E+PD) when the topology has one, else on ``prefill`` then
    ``decode`` (E/P/D), or on ``decode`` alone for a prompt short enough
    (``routing.max_local_prefill_tokens``).

    Failure policy: an image whose encode fails with UNAVAILABLE (encoder dead, its cache
    full) is retried on another encoder; if prefill (or pd) cannot pull the embeddings
    (their encoder died after answering), the images are encoded again elsewhere and that
    stage is retried once. LLM stages are not retried otherwise: a dead one fails the
    request at once with a message naming it, and is skipped until its readiness probe
    passes again.
    """

    def __init__(
        self,
        topo: Topology,
        server: str,
        metrics: MetricSink,
        replies: ReplyListener | None = None,
    ) -> None:
        self.limits = topo.limits
        self.routing = topo.routing
        self.one_engine = topo.one_engine
        self.llm_stages = topo.llm_stages
        """Where a prompt goes after its images are encoded: E+PD or E/P/D."""
        self.prompts = PromptBuilder.for_topology(topo, self.llm_stages)
        key = DeploymentKey.from_env()
        self.replies = replies
        """Where the stages' answers come back: the process's listener when its owner
        gives one (the OpenAI front's, shared with its own calls), else one of its own."""
        self._owns_replies = replies is None and topo.routing.reply_channel
        if self._owns_replies:
            self.replies = ReplyListener.for_server(topo, server, key)
        self._clients: dict[str, StageClient] = {}
        self.routes: dict[StageName, StageRoute] = {}
        for stage in ("encode", *self.llm_stages):
            targets = {}
            for name, spec in topo.servers_of(stage).items():
                if name not in self._clients:
                    url = spec.local_grpc_url if name == server else spec.grpc_url
                    self._clients[name] = GrpcStageClient(
                        url, key, topo.routing.resolve_interval_s, self.replies
                    )
                targets[name] = self._clients[name]
            self.routes[stage] = StageRoute(stage, targets, topo.routing.probe_misses_to_down)
        self.reuse = ReuseIndex(topo.routing.reuse_index_entries)
        self.health = HealthMonitor(
            self.routes.values(),
            topo.routing.health_interval_s,
            topo.routing.probe_timeout_s,
            topo.routing.idle_health_interval_s,
        )
        self.metrics = metrics
        self.local_prefills = 0
        if not self.one_engine:
            self.metrics.counter(
                "epd_local_prefills_total",
                "E/P/D requests whose prompt decode prefilled itself, past the prefill "
                "servers (routing.max_local_prefill_tokens)",
                lambda: self.local_prefills,
            )
        self.seconds = {
            phase: self.metrics.histogram(
                "epd_request_phase_seconds",
                "Latency of the phases of an epd request: encode (all images), prefill "
                "(incl. pulling embeddings), first_token and request (from arrival)",
                phase=phase,
            )
            for phase in ("encode", "prefill", "first_token", "request")
        }
        for stage, route in self.routes.items():
            for name in route.targets:
                self.metrics.gauge(
                    "epd_stage_outstanding",
                    "Calls in flight from this front to a stage server (its queue from here)",
                    lambda r=route, n=name: r.outstanding[n],
                    stage=stage,
                    target=name,
                )
                self.metrics.gauge(
                    "epd_stage_server_up",
                    "1 while a stage server is in rotation, 0 while it is taken out",
                    lambda r=route, n=name: 0 if r.is_down(n) else 1,
                    stage=stage,
                    target=name,
                )

    @classmethod
    async def create(cls, ctx: ModelContext) -> EPDPipeline:
        """The ``epd`` Triton model's pipeline, its metrics on that server's ``/metrics``."""
        from orchestrator.metrics import MetricsPublisher

        metrics = MetricsPublisher(ctx.pb_utils, {"server": ctx.server})
        return await cls.start(ctx.topology, ctx.server, metrics)

    @classmethod
    async def start(
        cls,
        topology: Topology,
        server: str,
        metrics: MetricSink,
        replies: ReplyListener | None = None,
    ) -> EPDPipeline:
        """A pipeline on the running loop that calls the stages from ``server`` (its own
        stages over loopback): in the ``epd`` model, or in the OpenAI front beside it,
        which gives it its (started) ``replies`` listener."""
        pipeline = cls(topology, server, metrics, replies)
        if pipeline._owns_replies:
            await pipeline.replies.start()
        pipeline.metrics.start()
        pipeline.health.start()
        return pipeline

    async def generate(self, inputs: Tensors, ctx: RequestContext) -> AsyncIterator[Tensors]:
        start = time.perf_counter()
        request = parse_front_request(inputs, self.limits)
        prompt = await self.prompts.render(request)
        self.prompts.fit(prompt, [], request.sampling)  # too long already: no image is encoded
        # Text-only requests need no encoder; prefill is not needed by a prompt short
        # enough for decode to prefill (judged again once the images' tokens are known).
        stages = ("encode",) if request.images else ()
        stages += ("decode",) if self._prefilled_by_decode(prompt, []) else self.llm_stages
        for stage in stages:
            await self.routes[stage].require(self.routing.probe_timeout_s)

        handles, holders = await self._encode_all(request.images, ctx)
        self.seconds["encode"].observe(time.perf_counter() - start)
        if self.one_engine:
            deltas = self._prefill_and_decode(prompt, request, handles, holders, ctx, "pd")
        elif self._prefilled_by_decode(prompt, [h.layout.tokens for h in handles]):
            self.local_prefills += 1
            deltas = self._prefill_and_decode(prompt, request, handles, holders, ctx, "decode")
        else:
            deltas = self._prefill_then_decode(prompt, request, handles, holders, ctx)
        stream = None  # the answer's span, from its first token to its end
        try:
            async for response in completion_responses(deltas, request.stream, request.outputs):
                if stream is None:
                    self.seconds["first_token"].observe(time.perf_counter() - start)
                    stream = tracing.start("stream", ctx.trace)
                yield response
        finally:
            if stream is not None:
                stream.end()
        self.seconds["request"].observe(time.perf_counter() - start)

    async def _start(
        self,
        begin: Callable[[list[EmbeddingHandle], SamplingOptions], Awaitable[T]],
        prompt: Prompt,
        request: FrontRequest,
        handles: list[EmbeddingHandle],
        holders: list[str],
        ctx: RequestContext,
    ) -> tuple[T, list[EmbeddingHandle], SamplingOptions]:
        """Fit the prompt to the context, then ``begin`` the stage that pulls the embeddings
        (prefill, or pd up to its first token). If that stage is up but could not pull them
        (their encoder died after answering), the images are encoded again, elsewhere if
        need be, and it is begun once more. If it fails, or the client cancels, the handles
        are released at once: what was not pulled would stay pinned until its TTL."""
        try:
            tokens = [h.layout.tokens for h in handles]
            _, sampling = self.prompts.fit(prompt, tokens, request.sampling)
            try:
                return await begin(handles, sampling), handles, sampling
            except Unavailable as exc:
                if not handles or isinstance(exc, StageUnreachable | DeadlineExceeded | Overloaded):
                    raise
                log.warning("request %s: could not pull embeddings (%s)", ctx.request_id, exc)
                route = self.routes["encode"]
                for name in set(holders):
                    if not await route.probe(name, self.routing.probe_timeout_s):
                        self.reuse.forget_server(name)
                await self._release(handles, holders)
                handles, holders = await self._encode_all(request.images, ctx)
                return await begin(handles, sampling), handles, sampling
        except BaseException:
            await self._cleanup(self._release(handles, holders))
            raise

    async def _prefill_and_decode(
        self,
        prompt: Prompt,
        request: FrontRequest,
        handles: list[EmbeddingHandle],
        holders: list[str],
        ctx: RequestContext,
        stage: StageName,
    ) -> AsyncIterator[Delta]:
        """One engine pulls the embeddings, prefills and streams the answer: ``pd`` (E+PD),
        or ``decode`` for a prompt too short to be worth a prefill server and the KV's
        move (E/P/D's conditional disaggregation, ``routing.max_local_prefill_tokens``)."""
        route = self.routes[stage]
        kind = PrefillDecodeRequest if stage == "pd" else DecodeRequest

        async def first_delta(
            pulled_by: list[EmbeddingHandle], sampling: SamplingOptions
        ) -> tuple[Delta, AsyncIterator[Delta]]:
            message = kind(
                request_id=ctx.request_id,
                prompt_token_ids=prompt.token_ids,
                handles=pulled_by,
                sampling=sampling,
                return_token_ids=request.outputs.token_ids,
            )
            stream = self._stream(route, message, ctx)
            try:
                return await anext(stream), stream
            except StopAsyncIteration:
                raise StageError("pd answered nothing") from None
            except BaseException:
                await stream.aclose()
                raise

        (first, stream), _, _ = await self._start(
            first_delta, prompt, request, handles, holders, ctx
        )
        async with contextlib.aclosing(stream):
            yield first
            async for delta in stream:
                yield delta

    async def _stream(
        self, route: StageRoute, message: PrefillDecodeRequest | DecodeRequest, ctx: RequestContext
    ) -> AsyncIterator[Delta]:
        name = route.choose()
        try:
            with route.use(name) as client:
                tensors = to_tensor("request", message)
                names = ExtraOutputs.of_stage(message).names()
                async for response in client.call(route.stage, tensors, names, ctx):
                    yield tensors_delta(response)
        except StageUnreachable as exc:
            route.mark_down(name, str(exc))
            raise

    async def _prefill_then_decode(
        self,
        prompt: Prompt,
        request: FrontRequest,
        handles: list[EmbeddingHandle],
        holders: list[str],
        ctx: RequestContext,
    ) -> AsyncIterator[Delta]:
        """E/P/D: prefill pulls the embeddings and computes the KV; decode pulls the KV and
        streams the answer."""
        started = time.perf_counter()

        async def prefill(
            pulled_by: list[EmbeddingHandle], sampling: SamplingOptions
        ) -> PrefillResult:
            message = PrefillRequest(
                request_id=ctx.request_id,
                prompt_token_ids=prompt.token_ids,
                handles=pulled_by,
            )
            return await self._prefill_to_the_end(message, ctx)

        result, handles, sampling = await self._start(
            prefill, prompt, request, handles, holders, ctx
        )
        self.seconds["prefill"].observe(time.perf_counter() - started)
        decode = DecodeRequest(
            request_id=ctx.request_id,
            prompt_token_ids=prompt.token_ids,
            prefilled_token_ids=result.prompt_token_ids,
            images=[h.layout for h in handles],
            image_hashes=[h.content_hash for h in handles],
            sampling=sampling,
            return_token_ids=request.outputs.token_ids,
            kv_transfer_params=result.kv_transfer_params,
        )
        route = self.routes["decode"]
        name = route.choose()
        first = True
        try:
            with route.use(name) as decoder:
                tensors = to_tensor("request", decode)
                names = ExtraOutputs.of_stage(decode).names()
                responses = decoder.call("decode", tensors, names, ctx)
                async for delta in _deltas(responses, result.num_prompt_tokens):
                    first = False
                    yield delta
        except BaseException as exc:
            if isinstance(exc, StageUnreachable):
                route.mark_down(name, str(exc))
            if first and decode.kv_transfer_params:
                # Decode may never have admitted the request: free prefill's KV now.
                kv_params = decode.kv_transfer_params
                await self._cleanup(self._abandon(ctx.request_id, kv_params, name))
            raise

    def _prefilled_by_decode(self, prompt: Prompt, image_tokens: list[int]) -> bool:
        """Conditional disaggregation on E/P/D: whether the prompt, its images expanded to
        ``image_tokens`` (none given: a lower bound), is short enough for decode to prefill
        it itself (``routing.max_local_prefill_tokens``)."""
        limit = self.routing.max_local_prefill_tokens
        return not self.one_engine and 0 < prompt.length(image_tokens) <= limit

    async def _cleanup(self, work: Awaitable[None]) -> None:
        """Run cleanup of a failed or cancelled request, bounded: it must not hold the
        request (or its cancellation) open when a stage does not answer."""
        try:
            async with asyncio.timeout(CLEANUP_TIMEOUT_S):
                await work
        except Exception as exc:  # noqa: BLE001 - logged; the request's own error wins
            log.warning("cleanup after a failed request did not finish: %s", exc)

    async def _abandon(self, request_id: str, kv_params: dict, name: str | None = None) -> None:
        """Have a decode server (``name``, or any) tell prefill's engine to free the KV it
        holds for a request that will not be decoded (vLLM's rejected-transfer notice)."""
        name = name or self.routes["decode"].choose()
        ctx = RequestContext.create(CLEANUP_TIMEOUT_S, CLEANUP_TIMEOUT_S, f"{request_id}-x")
        message = DecodeRequest(
            request_id=request_id,
            prompt_token_ids=[],
            sampling=SamplingOptions(),
            kv_transfer_params=kv_params,
            abandon=True,
        )
        client = self.routes["decode"].targets[name]
        async for _ in client.call("decode", to_tensor("request", message), ["text_output"], ctx):
            pass

    async def _prefill_to_the_end(
        self, request: PrefillRequest, ctx: RequestContext
    ) -> PrefillResult:
        """Prefill; if the request is stopped meanwhile (client cancel, deadline), prefill
        is let finish (Dynamo's "stop", not "kill"): only its answer says which KV it now
        holds for decode, and that KV is then freed at once instead of at the end of vLLM's
        KV lease. Past ``CLEANUP_TIMEOUT_S`` it is killed (vLLM aborts it, which frees its
        KV too)."""
        # The call itself may outlive the request by that bound: when the deadline stops the
        # request, prefill (which enforces what we pass it) must not stop at the same time.
        grace = dataclasses.replace(ctx, deadline=ctx.deadline + CLEANUP_TIMEOUT_S)
        call = asyncio.ensure_future(self._prefill(request, grace))
        try:
            return await asyncio.shield(call)
        except asyncio.CancelledError:
            try:
                async with asyncio.timeout(CLEANUP_TIMEOUT_S):
                    result = await call
            except Exception:  # noqa: BLE001 - failed or killed: nothing left to free
                raise asyncio.CancelledError from None
            if result.kv_transfer_params:
                await self._cleanup(self._abandon(ctx.request_id, result.kv_transfer_params))
            raise

    async def _encode_all(
        self, images: list[bytes], ctx: RequestContext
    ) -> tuple[list[EmbeddingHandle], list[str]]:
        """One handle per image (encoded in parallel) and the encoder that holds each; if
        any image fails, or the request is cancelled, the handles issued are released
        before the error is raised -- by request id too, which also catches a handle whose
        answer the cancelled call never read."""
        contacted: set[str] = set()
        tasks = [
            asyncio.ensure_future(
                self._encode_one(image, f"image {i + 1} of {len(images)}", ctx, contacted)
            )
            for i, image in enumerate(images)
        ]
        try:
            if tasks:  # all of them, also after one failed: each handle issued is released
                await asyncio.wait(tasks)
            failed = next((t.exception() for t in tasks if t.done() and t.exception()), None)
            if failed is not None:
                raise failed
            return [t.result()[0] for t in tasks], [t.result()[1] for t in tasks]
        except BaseException:
            for task in tasks:
                task.cancel()
            if tasks:
                await asyncio.wait(tasks)
            ok = [t.result() for t in tasks if not t.cancelled() and t.exception() is None]
            handles, holders = [h for h, _ in ok], [n for _, n in ok]
            # By request id too: an encoder may have issued a handle whose answer we no
            # longer wait for (cancelled meanwhile).
            await self._cleanup(self._release(handles, holders, ctx.request_id, contacted))
            raise

    async def _release(
        self,
        handles: list[EmbeddingHandle],
        holders: list[str],
        request_id: str | None = None,
        contacted: set[str] | frozenset[str] = frozenset(),
    ) -> None:
        """Unpin handles at their encoders now, and with ``request_id`` every handle the
        ``contacted`` encoders issued to that request (best effort: a dead encoder's pins
        die with it, and TTL stays the backstop). Ids already pulled are ignored there."""
        by_server: dict[str, list[str]] = {name: [] for name in contacted}
        for handle, name in zip(handles, holders, strict=True):
            by_server.setdefault(name, []).append(handle.handle_id)

        async def release(name: str, ids: list[str]) -> None:
            message = to_tensor("release", ReleaseRequest(handle_ids=ids, request_id=request_id))
            ctx = RequestContext.create(CLEANUP_TIMEOUT_S, CLEANUP_TIMEOUT_S)
            client = self.routes["encode"].targets[name]
            try:
                await client.call_one("encode", message, ["handles"], ctx)
            except Exception as exc:  # noqa: BLE001 - logged; the request's own error wins
                log.warning("release of %d handle(s) on %s failed: %s", len(ids), name, exc)

        await asyncio.gather(*(release(name, ids) for name, ids in by_server.items()))

    async def _encode_one(
        self, image: bytes, which: str, ctx: RequestContext, contacted: set[str]
    ) -> tuple[EmbeddingHandle, str]:
        """Encode one image; a bad image is ``InvalidRequest`` naming it (``which``)."""
        try:
            return await self._encode_on_some_encoder(image, ctx, contacted)
        except InvalidRequest as exc:
            raise type(exc)(f"{which}: {exc}") from None

    async def _encode_on_some_encoder(
        self, image: bytes, ctx: RequestContext, contacted: set[str]
    ) -> tuple[EmbeddingHandle, str]:
        route = self.routes["encode"]
        key = hashlib.sha256(image).hexdigest()  # cheap; the encoder keys by decoded pixels
        tried: list[str] = []
        last: Unavailable | None = None
        for _ in range(self.routing.encode_attempts):
            try:
                name = route.choose(prefer=self.reuse.holder(key), exclude=tried)
            except Unavailable:
                if last is None:
                    raise
                break
            if self.reuse.max_entries:
                self.reuse.record(key, name)
            contacted.add(name)
            try:
                with route.use(name) as encoder:
                    images = {"image": np.array([image], dtype=np.object_)}
                    out = await encoder.call_one("encode", images, ["handles"], ctx)
                return from_tensor(out, "handles", EncodeResult).handles[0], name
            except DeadlineExceeded:
                raise  # time is up: another encoder won't help
            except Unavailable as exc:  # down, or its cache full: another one may do
                self.reuse.forget(key, name)
                if isinstance(exc, StageUnreachable):
                    route.mark_down(name, str(exc))
                    self.reuse.forget_server(name)
                log.warning("encode on %s failed, trying another encoder: %s", name, exc)
                tried.append(name)
                last = exc
        raise last

    async def _prefill(self, request: PrefillRequest, ctx: RequestContext) -> PrefillResult:
        route = self.routes["prefill"]
        name = route.choose()
        message = to_tensor("request", request)
        try:
            with route.use(name) as prefiller:
                out = await prefiller.call_one("prefill", message, ["result"], ctx)
        except StageUnreachable as exc:
            route.mark_down(name, str(exc))
            raise
        return from_tensor(out, "result", PrefillResult)

    async def close(self) -> None:
        try:  # metric families must go while the stub is alive, whatever else fails
            await self.metrics.stop()
        finally:
            await self.health.stop()
            for client in self._clients.values():
                await client.close()
            if self._owns_replies:
                await self.replies.close()


async def _deltas(responses: AsyncIterator[Tensors], prompt_tokens: int) -> AsyncIterator[Delta]:
    """Decode's steps; the prompt's length is prefill's count (the tokens it computed)."""
    async for tensors in responses:
        delta = tensors_delta(tensors)
        yield dataclasses.replace(delta, num_input_tokens=prompt_tokens)
