"""One handler per Triton model role, each with ``async generate(inputs)``.

Handlers take and yield numpy tensors (the ``model.py`` adapters and the runner do the
Triton plumbing) and raise ``StageError`` subclasses for errors a client should see.
"""

from __future__ import annotations

import asyncio
from collections.abc import AsyncIterator
from typing import Any

import numpy as np

from orchestrator.frontend import PromptBuilder, parse_front_request, text_responses
from orchestrator.llm import LLMEngine, image_input, to_vllm_sampling
from orchestrator.protocol import (
    DecodeRequest,
    EncodeResult,
    InvalidRequest,
    PrefillRequest,
    PrefillResult,
    StageError,
    from_tensor,
    to_tensor,
)
from orchestrator.stage_client import BlsStageClient
from orchestrator.triton.runner import ModelContext

Tensors = dict[str, np.ndarray]


async def text_deltas(outputs: AsyncIterator[Any]) -> AsyncIterator[str]:
    async for out in outputs:
        yield out.outputs[0].text


class EncodeHandler:
    """Decode + preprocess images, run ``vision_encoder`` (BLS), park the embeddings in the
    transfer pool and answer with metadata-only handles."""

    def __init__(self, ctx: ModelContext) -> None:
        from orchestrator.encoder.preprocess import PreprocessConfig
        from orchestrator.metrics import PoolMetrics
        from orchestrator.transfer import make_producer

        topo = ctx.topology
        self.preprocess_config = PreprocessConfig.from_model_dir(topo.model)
        self.encoder_id = ctx.params["encoder_id"]
        self.bls = BlsStageClient(ctx.pb_utils, topo.limits.stage_timeout_s)
        self.producer = make_producer(
            topo.transfer.kind,
            pool_bytes=topo.transfer.pool_bytes,
            ttl_s=topo.transfer.ttl_s,
            host=topo.servers[ctx.server].host,
        )
        labels = {"server": ctx.server, "transport": topo.transfer.kind}
        self.metrics = PoolMetrics(ctx.pb_utils, self.producer, labels)
        self.metrics.start()  # on the runner's loop: handlers are built there

    @classmethod
    async def create(cls, ctx: ModelContext) -> EncodeHandler:
        return cls(ctx)

    def _prepare(self, i: int, data: bytes) -> tuple[np.ndarray, tuple[int, int, int], str]:
        from orchestrator.encoder.preprocess import content_hash, decode_image, preprocess

        try:
            image = decode_image(data)
            pixel_values, grid = preprocess(image, self.preprocess_config)
        except ValueError as exc:
            raise InvalidRequest(f"image {i}: {exc}") from None
        return pixel_values, grid, content_hash(image, self.preprocess_config, self.encoder_id)

    async def generate(self, inputs: Tensors) -> AsyncIterator[Tensors]:
        from orchestrator.encoder.runtime import graph_inputs

        images = inputs["image"].reshape(-1)
        handles = []
        loop = asyncio.get_running_loop()
        try:
            for i, data in enumerate(images):
                pixel_values, grid, digest = await loop.run_in_executor(
                    None, self._prepare, i, bytes(data)
                )
                feeds = graph_inputs(pixel_values, grid, self.preprocess_config.merge_size)
                out = await self.bls.infer("vision_encoder", feeds, ["image_embeds"])
                handles.append(
                    self.producer.put(out["image_embeds"], image_grid_thw=grid, content_hash=digest)
                )
        except Exception:
            for handle in handles:  # nobody will pull these
                self.producer.release(handle.handle_id)
            raise
        self.metrics.update()
        yield to_tensor("handles", EncodeResult(handles=handles))

    async def close(self) -> None:
        await self.metrics.stop()
        self.producer.close()


class PrefillHandler:
    """Pull embeddings by handle, prefill with vLLM (KV producer), return ``kv_transfer_params``."""

    def __init__(self, ctx: ModelContext) -> None:
        from orchestrator.transfer import make_consumer

        self.engine = LLMEngine.for_model(ctx, "prefill")
        self.consumer = make_consumer(ctx.topology.transfer.kind)

    @classmethod
    async def create(cls, ctx: ModelContext) -> PrefillHandler:
        return cls(ctx)

    async def generate(self, inputs: Tensors) -> AsyncIterator[Tensors]:
        request: PrefillRequest = from_tensor(inputs, "request", PrefillRequest)
        images = None
        if request.handles:
            loop = asyncio.get_running_loop()
            embeds = [
                await loop.run_in_executor(None, self.consumer.fetch, handle)
                for handle in request.handles
            ]
            images = image_input([h.image_grid_thw for h in request.handles], embeds)
        from vllm import SamplingParams

        remote_decode = {"kv_transfer_params": {"do_remote_decode": True}}
        sampling = SamplingParams(max_tokens=1, temperature=0.0, extra_args=remote_decode)
        final = None
        hashes = [h.content_hash for h in request.handles]
        async for out in self.engine.generate(
            request.prompt, images, sampling, request.request_id, image_uuids=hashes
        ):
            final = out
        if final is None:
            raise StageError("prefill produced no output")
        yield to_tensor(
            "result",
            PrefillResult(
                kv_transfer_params=final.kv_transfer_params,
                num_prompt_tokens=len(final.prompt_token_ids or []),
            ),
        )

    async def close(self) -> None:
        self.engine.shutdown()
        self.consumer.close()


class DecodeHandler:
    """Pull prefill's KV (vLLM NixlConnector consumer) and stream the generated text."""

    def __init__(self, ctx: ModelContext) -> None:
        self.engine = LLMEngine.for_model(ctx, "decode")

    @classmethod
    async def create(cls, ctx: ModelContext) -> DecodeHandler:
        return cls(ctx)

    async def generate(self, inputs: Tensors) -> AsyncIterator[Tensors]:
        request: DecodeRequest = from_tensor(inputs, "request", DecodeRequest)
        images = image_input(request.image_grid_thw) if request.image_grid_thw else None
        extra = {"kv_transfer_params": request.kv_transfer_params}
        sampling = to_vllm_sampling(request.sampling, extra_args=extra)
        outputs = self.engine.generate(
            request.prompt, images, sampling, request.request_id, image_uuids=request.image_hashes
        )
        async for response in text_responses(text_deltas(outputs), stream=True):
            yield response

    async def close(self) -> None:
        self.engine.shutdown()


class AggregatedHandler:
    """The baseline: one vLLM engine, pixels in, text out, same interface as ``epd``."""

    def __init__(self, ctx: ModelContext) -> None:
        from orchestrator.encoder.preprocess import PreprocessConfig

        topo = ctx.topology
        self.limits = topo.limits
        self.engine = LLMEngine.for_model(ctx, "aggregated")
        self.prompts = PromptBuilder.for_topology(topo, ("aggregated",))
        self.preprocess_config = PreprocessConfig.from_model_dir(topo.model)

    @classmethod
    async def create(cls, ctx: ModelContext) -> AggregatedHandler:
        return cls(ctx)

    async def generate(self, inputs: Tensors) -> AsyncIterator[Tensors]:
        from orchestrator.encoder.preprocess import decode_image, image_grid

        request = parse_front_request(inputs, self.limits)
        images, grids = [], []
        for i, data in enumerate(request.images):
            try:
                images.append(decode_image(data))
                grids.append(image_grid(images[-1], self.preprocess_config))
            except ValueError as exc:
                raise InvalidRequest(f"image {i}: {exc}") from None
        prompt = self.prompts.build(request.text, len(images))
        self.prompts.check_budget(prompt, grids, request.sampling.max_tokens)
        sampling = to_vllm_sampling(request.sampling)
        outputs = self.engine.generate(prompt, images or None, sampling)
        async for response in text_responses(text_deltas(outputs), request.stream):
            yield response

    async def close(self) -> None:
        self.engine.shutdown()
