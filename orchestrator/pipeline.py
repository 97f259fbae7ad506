"""The E -> P -> D request flow behind the public ``epd`` model.

Each stage is reached through a ``StageClient``: BLS when the stage is hosted by this
server, gRPC when the topology puts it elsewhere. Only metadata crosses these calls: the
encoder answers handles, prefill pulls the embeddings itself, decode pulls the KV itself.
"""

from __future__ import annotations

import uuid
from collections.abc import AsyncIterator

import numpy as np

from orchestrator.config import StageName
from orchestrator.frontend import PromptBuilder, parse_front_request, text_responses
from orchestrator.protocol import (
    DecodeRequest,
    EncodeResult,
    PrefillRequest,
    PrefillResult,
    from_tensor,
    to_tensor,
)
from orchestrator.router import StageRoute
from orchestrator.stage_client import BlsStageClient, GrpcStageClient, StageClient
from orchestrator.triton.runner import ModelContext

Tensors = dict[str, np.ndarray]


def _message(tensors: Tensors, name: str) -> bytes:
    return tensors[name].reshape(-1)[0]


class EPDPipeline:
    """Handler of the ``epd`` model: validate, encode, prefill, then stream decode."""

    def __init__(self, ctx: ModelContext) -> None:
        topo = ctx.topology
        self.limits = topo.limits
        self.prompts = PromptBuilder.for_topology(topo, ("prefill", "decode"))
        timeout = topo.limits.stage_timeout_s
        self._clients: dict[str, StageClient] = {}
        self.routes: dict[StageName, StageRoute] = {}
        for stage in ("encode", "prefill", "decode"):
            targets = {}
            for name, server in topo.servers_of(stage).items():
                if name not in self._clients:
                    self._clients[name] = (
                        BlsStageClient(ctx.pb_utils, timeout)
                        if name == ctx.server
                        else GrpcStageClient(server.grpc_url, timeout)
                    )
                targets[name] = self._clients[name]
            self.routes[stage] = StageRoute(stage, targets)

    @classmethod
    async def create(cls, ctx: ModelContext) -> EPDPipeline:
        return cls(ctx)

    async def generate(self, inputs: Tensors) -> AsyncIterator[Tensors]:
        request = parse_front_request(inputs, self.limits)
        request_id = uuid.uuid4().hex
        prompt = self.prompts.build(request.text, len(request.images))

        handles = []
        if request.images:
            images = {"image": np.array(request.images, dtype=np.object_)}
            with self.routes["encode"].pick() as encoder:
                encoded = await encoder.call_one("encode", images, ["handles"])
            handles = from_tensor(encoded, "handles", EncodeResult).handles
        grids = [h.image_grid_thw for h in handles]
        self.prompts.check_budget(prompt, grids, request.sampling.max_tokens)

        prefill = PrefillRequest(request_id=request_id, prompt=prompt, handles=handles)
        with self.routes["prefill"].pick() as prefiller:
            prefilled = await prefiller.call_one(
                "prefill", to_tensor("request", prefill), ["result"]
            )
        result = from_tensor(prefilled, "result", PrefillResult)

        decode = DecodeRequest(
            request_id=request_id,
            prompt=prompt,
            image_grid_thw=grids,
            image_hashes=[h.content_hash for h in handles],
            sampling=request.sampling,
            kv_transfer_params=result.kv_transfer_params,
        )
        with self.routes["decode"].pick() as decoder:
            deltas = decoder.call("decode", to_tensor("request", decode), ["text_output"])
            async for response in text_responses(_texts(deltas), request.stream):
                yield response

    async def close(self) -> None:
        for client in self._clients.values():
            await client.close()


async def _texts(responses: AsyncIterator[Tensors]) -> AsyncIterator[str]:
    async for tensors in responses:
        yield _message(tensors, "text_output").decode("utf-8")
