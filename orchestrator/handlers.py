"""One handler per Triton model role, each with ``async generate(inputs)``.

Handlers take and yield numpy tensors (the ``model.py`` adapters and the runner do the
Triton plumbing) and raise ``StageError`` subclasses for errors a client should see.
"""

from __future__ import annotations

import asyncio
import hashlib
import logging
import time
from collections import OrderedDict
from collections.abc import AsyncIterator, Awaitable, Callable
from typing import TYPE_CHECKING, Any, ClassVar, Self

import numpy as np

from orchestrator import tracing
from orchestrator.auth import DeploymentKey
from orchestrator.cache import LocalEmbeddingCache
from orchestrator.context import RequestContext
from orchestrator.frontend import (
    ExtraOutputs,
    PromptBuilder,
    bad_image,
    completion_responses,
    deltas_of,
    parse_front_request,
)
from orchestrator.llm import LLMEngine, LLMRole, to_vllm_sampling
from orchestrator.protocol import (
    Cancelled,
    DecodeRequest,
    EmbeddingHandle,
    EncodeResult,
    InvalidRequest,
    Overloaded,
    PrefillDecodeRequest,
    PrefillRequest,
    PrefillResult,
    ReleaseRequest,
    StageError,
    Tensors,
    Unauthenticated,
    from_tensor,
    to_tensor,
)
from orchestrator.stage_client import BlsInfer
from orchestrator.transfer.base import PoolFullError, numpy_dtype
from orchestrator.triton.runner import ModelContext

if TYPE_CHECKING:
    from orchestrator.families import ModelFamily

log = logging.getLogger(__name__)

ISSUED_REQUESTS_REMEMBERED = 1 << 12
"""Requests an encoder remembers for release by request id (older ones: the TTL)."""
IMAGE_BYTES_REMEMBERED = 1 << 14
"""Images (by a digest of their bytes) whose pixels' hash an encoder remembers (~3 MB)."""
USED_HANDLES_REMEMBERED = 1 << 16
"""Handle ids a prefill server remembers to refuse a replay (a few MB at most)."""
ABANDONED_REQUESTS_REMEMBERED = 1 << 12
"""Abandoned request ids a decode server remembers, to refuse them should they still come."""


def _remember(memory: OrderedDict, key: str, value: Any, limit: int) -> None:
    """Set ``key`` as the most recent entry of a memory that keeps the latest ``limit``."""
    memory[key] = value
    memory.move_to_end(key)
    while len(memory) > limit:
        memory.popitem(last=False)


async def _timing_first_token(
    responses: AsyncIterator[Tensors], ctx: RequestContext
) -> AsyncIterator[Tensors]:
    """``responses`` as they come, with a ``first_token`` span from now to the first one
    (for decode: its KV pull and first step; for pd: the prefill and first step)."""
    span = tracing.start("first_token", ctx.trace)
    try:
        async for response in responses:
            if span is not None:
                span.end()
                span = None
            yield response
    finally:
        if span is not None:
            span.end()


class EncodeHandler:
    """Decode + preprocess images, answer cached ones from the encoder cache, run
    ``vision_encoder`` (BLS) on the rest, and answer with metadata-only handles.

    The cache is keyed by decoded pixels (the same image in another encoding is a hit), so
    finding an image means decoding it -- most of what a hit costs (a 896 x 896 JPEG: ~15
    ms here, against ~40 for a whole pass). Bytes seen before are therefore remembered by
    their own digest, and the same bytes again go straight to the cache."""

    def __init__(self, ctx: ModelContext) -> None:
        from orchestrator.families import family_for
        from orchestrator.metrics import MetricsPublisher, publish_producer
        from orchestrator.transfer import make_producer, pool_bytes_for

        topo = ctx.topology
        spec = topo.transfer
        self.family = family_for(topo.model)
        self.preprocessing = self.family.preprocess_fingerprint()
        self.encoder_id = ctx.params["encoder_id"]
        self.max_image_pixels = topo.limits.max_image_pixels
        self.full_wait_s = spec.full_wait_s
        self.key = DeploymentKey.from_env()
        self.bls = BlsInfer(ctx.pb_utils)
        self.producer = make_producer(
            spec.kind,
            pool_bytes=pool_bytes_for(spec.pool_bytes, self.family.max_image_bytes()),
            cache=spec.cache,
            ttl_s=spec.ttl_s,
            reclaim_grace_s=spec.reclaim_grace_s,
            host=topo.servers[ctx.server].bind_address,
            advertise_host=topo.servers[ctx.server].host,
        )
        self._encoding: dict[str, asyncio.Future] = {}  # content hash -> its encoder pass
        self.pixel_hashes: OrderedDict[bytes, str] = OrderedDict()
        """Content hash of the image, by digest of its bytes (the latest images only)."""
        self.decoded = 0
        self.issued: OrderedDict[str, list[str]] = OrderedDict()
        """Handle ids issued per request id (the latest requests only)."""
        self.released: OrderedDict[str, None] = OrderedDict()
        """Requests the front released by id (the latest only): a handle still being made
        for one of them is released as soon as it exists."""
        self.metrics = MetricsPublisher(
            ctx.pb_utils, {"server": ctx.server, "transport": spec.kind}
        )
        publish_producer(self.metrics, self.producer.stats)
        self.metrics.counter(
            "epd_encoder_images_decoded_total",
            "Images the encoder decoded (bytes it saw before and still holds are not decoded)",
            lambda: self.decoded,
        )
        self.encode_seconds = self.metrics.histogram(
            "epd_encoder_pass_seconds", "Time of one vision encoder pass (one image)"
        )
        self.metrics.start()  # on the runner's loop: handlers are built there

    @classmethod
    async def create(cls, ctx: ModelContext) -> EncodeHandler:
        return cls(ctx)

    def _prepare(self, which: str, data: bytes) -> tuple[Any, str]:
        from orchestrator.encoder.preprocess import content_hash, decode_image

        try:
            image = decode_image(data, self.max_image_pixels)
            self.family.image_layout(image.width, image.height)  # beyond the family's limits
        except ValueError as exc:
            raise bad_image(which, exc) from None
        return image, content_hash(image, self.preprocessing, self.encoder_id)

    async def _encode(self, image: Any, digest: str, ctx: RequestContext) -> EmbeddingHandle:
        """Run the encoder on an image nobody holds; one pass per content hash at a time."""
        loop = asyncio.get_running_loop()
        with tracing.span("preprocess", ctx.trace):
            encoder_input = await loop.run_in_executor(None, self.family.encoder_input, image)
        start = time.perf_counter()
        feeds = encoder_input.feeds
        out = await self.bls.infer("vision_encoder", feeds, ["image_embeds"], ctx)
        self.encode_seconds.observe(time.perf_counter() - start)
        embeds, layout = out["image_embeds"], encoder_input.layout
        if embeds.shape != (layout.tokens, self.family.hidden_size):
            raise StageError(
                f"vision encoder returned {list(embeds.shape)}, expected "
                f"[{layout.tokens}, {self.family.hidden_size}] for this image"
            )
        deadline = time.monotonic() + self.full_wait_s
        while True:
            try:
                return self.producer.put(embeds, grid_thw=layout.grid_thw, content_hash=digest)
            except PoolFullError as exc:
                if time.monotonic() >= deadline:
                    raise Overloaded(f"{exc} (waited {self.full_wait_s:g}s for room)") from None
            await asyncio.sleep(0.01)

    def _signed(self, handle: EmbeddingHandle) -> EmbeddingHandle:
        return handle.model_copy(update={"signature": self.key.handle_signature(handle)})

    async def _handle(self, data: bytes, which: str, ctx: RequestContext) -> EmbeddingHandle:
        """A signed handle to the image's embeddings, encoding them if nobody holds them.
        The image is decoded only when its bytes are new here or its embeddings must be
        made again."""
        seen = hashlib.sha256(data).digest()
        digest = self.pixel_hashes.get(seen)

        async def decode() -> tuple[Any, str]:
            with tracing.span("decode_image", ctx.trace):
                image, digest = await asyncio.get_running_loop().run_in_executor(
                    None, self._prepare, which, data
                )
            self.decoded += 1
            return image, digest

        image = None
        if digest is None:
            image, digest = await decode()
        _remember(self.pixel_hashes, seen, digest, IMAGE_BYTES_REMEMBERED)
        return self._signed(await self._lend(image, decode, digest, ctx))

    async def _lend(
        self,
        image: Any,
        decode: Callable[[], Awaitable[tuple[Any, str]]],
        digest: str,
        ctx: RequestContext,
    ) -> EmbeddingHandle:
        while True:
            if (handle := self.producer.lookup(digest)) is not None:
                return handle
            pending = self._encoding.get(digest)
            if pending is None:
                break
            # Another request is encoding this image: wait for it, then look again (its
            # failure or cancellation is its own; we then encode it ourselves).
            await asyncio.wait([pending])
        done = asyncio.get_running_loop().create_future()
        self._encoding[digest] = done
        try:
            if image is None:  # known bytes whose embeddings were evicted
                image, _ = await decode()
            return await self._encode(image, digest, ctx)
        finally:
            del self._encoding[digest]
            done.set_result(None)

    async def generate(self, inputs: Tensors, ctx: RequestContext) -> AsyncIterator[Tensors]:
        if "release" in inputs:  # a request ended before its handles were pulled
            release = from_tensor(inputs, "release", ReleaseRequest)
            ids = list(release.handle_ids)
            if release.request_id:
                ids += self.issued.pop(release.request_id, [])
                # An encode of that request still running here (its cancel lost or not
                # arrived yet) must not leave a handle behind when it finishes.
                _remember(self.released, release.request_id, None, ISSUED_REQUESTS_REMEMBERED)
            for handle_id in ids:
                self.producer.release(handle_id)
            yield to_tensor("handles", EncodeResult(handles=[]))
            return
        if "image" not in inputs:
            raise InvalidRequest("encode needs 'image' (or 'release')")
        images = inputs["image"].reshape(-1)
        handles: list[EmbeddingHandle] = []
        try:
            for i, data in enumerate(images):
                # One image per call from the front, which names it in the whole request.
                which = f"image {i}" if len(images) > 1 else ""
                handles.append(await self._handle(bytes(data), which, ctx))
                issued = [*self.issued.get(ctx.request_id, []), handles[-1].handle_id]
                _remember(self.issued, ctx.request_id, issued, ISSUED_REQUESTS_REMEMBERED)
            # Released or cancelled while we encoded: nobody will pull these.
            if ctx.request_id in self.released or ctx.client_gone():
                raise Cancelled(f"request {ctx.request_id} ended while its image was encoded")
        except BaseException:
            for handle in handles:
                self.producer.release(handle.handle_id)
            raise
        yield to_tensor("handles", EncodeResult(handles=handles))

    async def close(self) -> None:
        await self.metrics.stop()
        self.producer.close()


class EmbeddingPuller:
    """The consuming side of the embedding handoff, for ``prefill`` and ``pd``: checks each
    handle before anything is dialled or allocated, refuses replays, pulls every image's
    embeddings into its rows of the engine input, and keeps recently pulled ones (this
    server's own cache, so a repeated image costs no pull)."""

    def __init__(self, ctx: ModelContext, family: ModelFamily, metrics: Any) -> None:
        from orchestrator.transfer import make_consumer

        topo = ctx.topology
        self.family = family
        self.key = DeploymentKey.from_env()
        self.encoder_hosts = {topo.servers[name].host for name in topo.servers_of("encode")}
        self.used: OrderedDict[str, None] = OrderedDict()
        """Ids of the handles consumed here lately: a handle is good for one use."""
        self.consumer = make_consumer(topo.transfer.kind, host=topo.servers[ctx.server].host)
        self.fetch_seconds = metrics.histogram(
            "epd_embedding_fetch_seconds", "Time to pull one image's embeddings from its encoder"
        )
        self.fetched_bytes = 0
        metrics.counter(
            "epd_embedding_fetch_bytes_total",
            "Embedding bytes pulled from encoders",
            lambda: self.fetched_bytes,
        )
        self.local = LocalEmbeddingCache(topo.transfer.prefill_cache_bytes)
        metrics.counter(
            "epd_prefill_cache_hits_total",
            "Images whose embeddings this server already held (not pulled again)",
            lambda: self.local.hits,
        )

    async def prompt(
        self, token_ids: list[int], handles: list[EmbeddingHandle], ctx: RequestContext
    ) -> dict[str, Any]:
        """vLLM's prompt of ``token_ids`` with the handles' images, their embeddings pulled."""
        for handle in handles:
            self.check_handle(handle)
        for handle in handles:
            _remember(self.used, handle.handle_id, None, USED_HANDLES_REMEMBERED)
        prompt: dict[str, Any] = {"prompt_token_ids": token_ids}
        if handles:
            nbytes = sum(h.nbytes for h in handles)
            with tracing.span("embedding_pull", ctx.trace, images=len(handles), bytes=nbytes):
                embeds = await self._pull(handles)
            layouts = [h.layout for h in handles]
            prompt["multi_modal_data"] = {"image": self.family.prefill_images(embeds, layouts)}
            # vLLM's identity of each image: its content, not the tensor it is given.
            prompt["multi_modal_uuids"] = {"image": [h.content_hash for h in handles]}
        return prompt

    def check_handle(self, handle: EmbeddingHandle) -> None:
        """Before anything is dialled or allocated: an encoder of this deployment signed
        the handle, it points at an encoder host of the topology, and its shape is one the
        family can produce (``Unauthenticated`` / ``InvalidRequest`` otherwise)."""
        self.key.check_handle_signature(handle, handle.signature)
        if handle.handle_id in self.used:
            raise Unauthenticated(f"handle {handle.handle_id} was already used (a replay)")
        host = handle.location.host
        if host is not None and host not in self.encoder_hosts:
            raise Unauthenticated(
                f"handle {handle.handle_id} points at {host}, which hosts no encoder of this "
                f"deployment ({sorted(self.encoder_hosts)})"
            )
        tokens, width = handle.shape
        limit = self.family.max_image_tokens()
        if width != self.family.hidden_size or tokens > limit:
            raise InvalidRequest(
                f"handle {handle.handle_id} has shape {list(handle.shape)}; this model's "
                f"images are at most {limit} tokens of width {self.family.hidden_size}"
            )

    def _fetch_into(self, handle: EmbeddingHandle, out: np.ndarray) -> bool:
        """Fill ``out`` with the handle's embeddings; True if they were pulled (not held)."""
        if (held := self.local.get(handle.content_hash)) is not None:
            try:
                self.consumer.release(handle)
            except Exception as exc:  # noqa: BLE001 - the pin then lasts until its TTL
                log.warning("release of handle %s failed: %s", handle.handle_id, exc)
            out[...] = held
            return False
        start = time.perf_counter()
        self.consumer.fetch_into(handle, out)
        self.fetch_seconds.observe(time.perf_counter() - start)
        self.local.put(handle.content_hash, out)
        return True

    async def _pull(self, handles: list[EmbeddingHandle]) -> np.ndarray:
        """All images' embeddings in one array (vLLM's input), each pulled into its rows."""
        widths = {(h.shape[1], h.dtype) for h in handles}
        if len(widths) > 1:
            raise StageError(f"encoders disagree on embedding width/dtype: {sorted(widths)}")
        [(width, dtype)] = widths
        embeds = np.empty((sum(h.shape[0] for h in handles), width), numpy_dtype(dtype))
        loop = asyncio.get_running_loop()
        row = 0
        for handle in handles:
            rows = embeds[row : row + handle.shape[0]]
            row += handle.shape[0]
            if await loop.run_in_executor(None, self._fetch_into, handle, rows):
                self.fetched_bytes += handle.nbytes  # summed on the loop thread only
        return embeds

    def close(self) -> None:
        self.consumer.close()


class _EngineHandler:
    """What every handler hosting a vLLM engine shares: the engine of its role (args from
    ``model.json``), its metrics, the health check the front's probe asks, shutdown."""

    role: ClassVar[LLMRole]

    def __init__(self, ctx: ModelContext, **labels: str) -> None:
        from orchestrator.families import family_for
        from orchestrator.metrics import MetricsPublisher, publish_engine

        self.family = family_for(ctx.topology.model)
        self.engine = LLMEngine.for_model(ctx, self.role)
        self.metrics = MetricsPublisher(ctx.pb_utils, {"server": ctx.server, **labels})
        publish_engine(self.metrics, self.engine, self.role)

    @classmethod
    async def create(cls, ctx: ModelContext) -> Self:
        handler = cls(ctx)
        handler.metrics.start()
        return handler

    async def check_health(self) -> None:
        await self.engine.check_health()

    async def close(self) -> None:
        await self.metrics.stop()
        self.engine.shutdown()


class _PullingHandler(_EngineHandler):
    """An engine fed with image embeddings pulled by handle (prefill, pd)."""

    def __init__(self, ctx: ModelContext) -> None:
        super().__init__(ctx, transport=ctx.topology.transfer.kind)
        self.puller = EmbeddingPuller(ctx, self.family, self.metrics)

    async def close(self) -> None:
        await super().close()
        self.puller.close()


class PrefillHandler(_PullingHandler):
    """Pull embeddings by handle, prefill with vLLM (KV producer), return ``kv_transfer_params``."""

    role = "prefill"

    def __init__(self, ctx: ModelContext) -> None:
        super().__init__(ctx)
        self.public_host = ctx.topology.servers[ctx.server].host

    async def generate(self, inputs: Tensors, ctx: RequestContext) -> AsyncIterator[Tensors]:
        request: PrefillRequest = from_tensor(inputs, "request", PrefillRequest)
        prompt = await self.puller.prompt(request.prompt_token_ids, request.handles, ctx)
        from vllm import SamplingParams

        remote_decode = {"kv_transfer_params": {"do_remote_decode": True}}
        sampling = SamplingParams(max_tokens=1, temperature=0.0, extra_args=remote_decode)
        final = None
        async for out in self.engine.generate(prompt, sampling, request.request_id):
            final = out
        if final is None:
            raise StageError("prefill produced no output")
        kv_params = final.kv_transfer_params
        if kv_params and "remote_host" in kv_params:  # vLLM advertises its bind address
            kv_params = {**kv_params, "remote_host": self.public_host}
        yield to_tensor(
            "result",
            PrefillResult(
                kv_transfer_params=kv_params,
                num_prompt_tokens=len(final.prompt_token_ids or []),
                prompt_token_ids=(
                    list(final.prompt_token_ids or [])
                    if request.handles and self.family.decode_needs_token_ids
                    else None
                ),
            ),
        )


class PrefillDecodeHandler(_PullingHandler):
    """E+PD: one vLLM engine pulls the embeddings by handle, prefills and streams the
    decode itself (no KV moves between engines, one scheduler)."""

    role = "pd"

    async def generate(self, inputs: Tensors, ctx: RequestContext) -> AsyncIterator[Tensors]:
        request = from_tensor(inputs, "request", PrefillDecodeRequest)
        prompt = await self.puller.prompt(request.prompt_token_ids, request.handles, ctx)
        sampling = to_vllm_sampling(request.sampling)
        outputs = self.engine.generate(prompt, sampling, request.request_id)
        answered = ExtraOutputs.of_stage(request)
        responses = completion_responses(deltas_of(outputs), True, answered)
        async for response in _timing_first_token(responses, ctx):
            yield response


class DecodeHandler(_EngineHandler):
    """Pull prefill's KV (vLLM NixlConnector consumer) and stream the generated text. With
    conditional disaggregation (``routing.max_local_prefill_tokens``) it also takes short
    prompts without KV and prefills them itself, their embeddings pulled as pd does."""

    role = "decode"

    def __init__(self, ctx: ModelContext) -> None:
        super().__init__(ctx)
        self.puller = (
            EmbeddingPuller(ctx, self.family, self.metrics) if ctx.topology.local_prefill else None
        )
        self.admitted: set[str] = set()
        """Requests in this engine now (their KV may be on its way from prefill)."""
        self.abandoned: OrderedDict[str, None] = OrderedDict()

    async def close(self) -> None:
        await super().close()
        if self.puller is not None:
            self.puller.close()

    async def _abandon(self, request: DecodeRequest) -> None:
        """Let prefill free the KV of a request that ended before its first token now,
        instead of when its lease runs out (vLLM's pre-aborted request). Not when this
        engine has the request: its READ may be in flight, and freeing the blocks under it
        would stall or corrupt it; vLLM's abort of the request tells prefill itself."""
        if request.request_id in self.admitted:
            return
        _remember(self.abandoned, request.request_id, None, ABANDONED_REQUESTS_REMEMBERED)
        if request.kv_transfer_params:
            await self.engine.reject_kv_transfer(
                f"{request.request_id}-abandoned", request.kv_transfer_params
            )

    async def generate(self, inputs: Tensors, ctx: RequestContext) -> AsyncIterator[Tensors]:
        request: DecodeRequest = from_tensor(inputs, "request", DecodeRequest)
        if request.abandon:
            await self._abandon(request)
            return
        if request.request_id in self.abandoned:  # its KV is gone already
            raise Cancelled(f"request {request.request_id} was abandoned before decode")
        if request.kv_transfer_params is None:  # a short prompt, prefilled here
            if self.puller is None:
                raise InvalidRequest(
                    "no kv_transfer_params: this decode server prefills no prompt itself "
                    "(routing.max_local_prefill_tokens is 0)"
                )
            prompt = await self.puller.prompt(request.prompt_token_ids, request.handles, ctx)
            sampling = to_vllm_sampling(request.sampling)
        else:
            try:
                prompt = self.family.decode_prompt(
                    request.prompt_token_ids,
                    request.prefilled_token_ids,
                    request.images,
                    request.image_hashes,
                )
            except ValueError as exc:
                raise InvalidRequest(str(exc)) from None
            extra = {"kv_transfer_params": request.kv_transfer_params}
            sampling = to_vllm_sampling(request.sampling, extra_args=extra)
        self.admitted.add(request.request_id)
        try:
            outputs = self.engine.generate(prompt, sampling, request.request_id)
            deltas = deltas_of(outputs)
            answered = ExtraOutputs.of_stage(request)
            responses = completion_responses(deltas, True, answered)
            async for response in _timing_first_token(responses, ctx):
                yield response
        finally:
            self.admitted.discard(request.request_id)


class AggregatedHandler(_EngineHandler):
    """The baseline: one vLLM engine, pixels in, text out, same interface as ``epd``."""

    role = "aggregated"

    def __init__(self, ctx: ModelContext) -> None:
        super().__init__(ctx)
        self.limits = ctx.topology.limits
        self.prompts = PromptBuilder.for_topology(ctx.topology, ("aggregated",))

    def _decode_images(self, encoded: list[bytes]) -> tuple[list[Any], list[int]]:
        """The request's images (PIL) and the tokens each takes, made off the loop (the
        engine's outputs are handled there); a bad image is ``InvalidRequest`` naming it."""
        from orchestrator.encoder.preprocess import decode_image

        images, tokens = [], []
        for i, data in enumerate(encoded):
            try:
                images.append(decode_image(data, self.limits.max_image_pixels))
                tokens.append(self.family.image_layout(images[-1].width, images[-1].height).tokens)
            except ValueError as exc:
                raise bad_image(f"image {i + 1} of {len(encoded)}", exc) from None
        return images, tokens

    async def generate(self, inputs: Tensors, ctx: RequestContext) -> AsyncIterator[Tensors]:
        request = parse_front_request(inputs, self.limits)
        rendered = await self.prompts.render(request)
        self.prompts.fit(rendered, [], request.sampling)  # too long already: decode nothing
        images, tokens = await asyncio.get_running_loop().run_in_executor(
            None, self._decode_images, request.images
        )
        _, sampling = self.prompts.fit(rendered, tokens, request.sampling)
        prompt: dict[str, Any] = {"prompt_token_ids": rendered.token_ids}
        if images:
            prompt["multi_modal_data"] = {"image": images}
        outputs = self.engine.generate(prompt, to_vllm_sampling(sampling), ctx.request_id)
        async for response in completion_responses(
            deltas_of(outputs), request.stream, request.outputs
        ):
            yield response
