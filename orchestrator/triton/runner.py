"""Glue between Triton's python backend and our async stage handlers.

Each ``model.py`` builds one ``DecoupledModelRunner`` around a handler (the Dynamo-style
``async generate(request)`` object). The runner owns a private asyncio loop in a daemon
thread -- vLLM's ``AsyncLLM`` must live on one loop, and the stub's own loop must never
block -- converts Triton tensors to numpy and back, and maps ``StageError`` codes onto
``TritonError`` so clients see ``INVALID_ARG`` / ``UNAVAILABLE`` with our message.
"""

from __future__ import annotations

import asyncio
import concurrent.futures
import json
import locale
import threading
import traceback
from collections.abc import AsyncIterator, Awaitable, Callable
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Protocol

import numpy as np

from orchestrator.config import Topology
from orchestrator.protocol import StageError, error_message

Tensors = dict[str, np.ndarray]


class StageHandler(Protocol):
    """What a Triton model delegates to: one request in, a stream of output tensors out."""

    async def generate(self, inputs: Tensors) -> AsyncIterator[Tensors]: ...

    async def close(self) -> None: ...


@dataclass(frozen=True)
class ModelContext:
    """What a handler needs to know about where it runs."""

    topology: Topology
    server: str
    model_name: str
    pb_utils: Any
    """The stub's ``triton_python_backend_utils`` (for BLS and metrics)."""
    params: dict[str, str]
    """All string parameters of the model's config.pbtxt (written by ``epd render``)."""
    version_dir: Path
    """The model's version folder (``<repo>/<model>/1``), where its artifacts live."""


def model_context(args: dict[str, Any], pb_utils: Any) -> ModelContext:
    """Read the topology and server name that ``epd render`` wrote into config.pbtxt."""
    config = json.loads(args["model_config"])
    params = {k: v["string_value"] for k, v in config.get("parameters", {}).items()}
    try:
        topology_path, server = Path(params["topology"]), params["server"]
    except KeyError as exc:
        raise ValueError(
            f"model {args['model_name']!r}: config.pbtxt lacks parameter {exc}; "
            "render the repository with `epd render`"
        ) from None
    topology = Topology.model_validate_json(topology_path.read_text())
    version_dir = Path(args["model_repository"]) / args["model_version"]
    return ModelContext(topology, server, args["model_name"], pb_utils, params, version_dir)


class DecoupledModelRunner:
    """Serves a decoupled Triton model from an async handler on a private event loop."""

    def __init__(
        self,
        args: dict[str, Any],
        pb_utils: Any,
        make_handler: Callable[[ModelContext], Awaitable[StageHandler]],
        start_timeout_s: float = 600,
    ) -> None:
        # The stub embeds Python in an isolated config whose preferred encoding is ASCII;
        # torch/vLLM read UTF-8 templates at import and die without this.
        locale.setlocale(locale.LC_CTYPE, "C.UTF-8")
        self._pb = pb_utils
        self._loop = asyncio.new_event_loop()
        self._thread = threading.Thread(
            target=self._loop.run_forever, name=f"{args['model_name']}-loop", daemon=True
        )
        self._thread.start()
        self._inflight: set[asyncio.Future] = set()
        ctx = model_context(args, pb_utils)
        self.handler: StageHandler = asyncio.run_coroutine_threadsafe(
            make_handler(ctx), self._loop
        ).result(start_timeout_s)

    def submit(self, requests: list[Any]) -> None:
        """Schedule every request on the loop; responses go out through their senders."""
        for request in requests:
            inputs = {t.name(): t.as_numpy() for t in request.inputs()}
            fut = asyncio.run_coroutine_threadsafe(
                self._serve(inputs, request.get_response_sender()), self._loop
            )
            self._inflight.add(fut)
            fut.add_done_callback(self._inflight.discard)

    async def _serve(self, inputs: Tensors, sender: Any) -> None:
        pb = self._pb
        try:
            async for outputs in self.handler.generate(inputs):
                tensors = [pb.Tensor(name, value) for name, value in outputs.items()]
                sender.send(pb.InferenceResponse(output_tensors=tensors))
            sender.send(flags=pb.TRITONSERVER_RESPONSE_COMPLETE_FINAL)
        except Exception as exc:  # every failure must reach the client, never the loop
            sender.send(
                pb.InferenceResponse(error=self._triton_error(exc)),
                flags=pb.TRITONSERVER_RESPONSE_COMPLETE_FINAL,
            )

    def _triton_error(self, exc: Exception) -> Any:
        error = self._pb.TritonError
        if isinstance(exc, StageError):
            return error(error_message(exc), getattr(error, exc.code, error.INTERNAL))
        self._pb.Logger.log_error(traceback.format_exc())
        detail = "".join(traceback.format_exception_only(exc)).strip()
        return error(error_message(StageError(detail)), error.INTERNAL)

    def stop(self, drain_timeout_s: float = 30) -> None:
        """Let in-flight requests finish (bounded), close the handler, stop the loop."""
        if self._inflight:
            concurrent.futures.wait(list(self._inflight), timeout=drain_timeout_s)
        try:
            asyncio.run_coroutine_threadsafe(self.handler.close(), self._loop).result(30)
        finally:
            self._loop.call_soon_threadsafe(self._loop.stop)
            self._thread.join(timeout=10)
