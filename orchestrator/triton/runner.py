"""Glue between Triton's python backend and our async stage handlers.

Each ``model.py`` builds one ``DecoupledModelRunner`` around a handler (the Dynamo-style
``async generate(request)`` object). The runner owns a private asyncio loop in a daemon
thread -- vLLM's ``AsyncLLM`` must live on one loop, and the stub's own loop must never
block -- converts Triton tensors to numpy and back, and maps ``StageError`` kinds onto
``TritonError`` codes so clients see ``INVALID_ARG`` / ``UNAVAILABLE`` / ``CANCELLED`` with
our message.
"""

from __future__ import annotations

import asyncio
import concurrent.futures
import contextlib
import faulthandler
import json
import locale
import os
import queue
import signal
import threading
import traceback
from collections.abc import AsyncIterator, Awaitable, Callable
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Protocol

from orchestrator import tracing
from orchestrator.auth import MAC_PARAMETER, SECRET_ENV, DeploymentKey
from orchestrator.config import Topology
from orchestrator.context import RequestContext
from orchestrator.protocol import PROBE_PARAMETER, LastResponse, StageError, Tensors, error_message
from orchestrator.reply_channel import (
    REPLY_PARAMETER,
    Reply,
    ReplyWriter,
    encode_frame,
    parse_reply_to,
)


class StageHandler(Protocol):
    """What a Triton model delegates to: one request in, a stream of output tensors out."""

    async def generate(self, inputs: Tensors, ctx: RequestContext) -> AsyncIterator[Tensors]: ...

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


WATCH_PERIOD_S = 0.1
"""How often in-flight requests are checked for client cancellation and their deadline."""


def dump_stacks_on_signal() -> None:
    """Every python model of ours calls this at start: on SIGUSR1 (what the server's
    ``dump_stacks`` sends when a start stalls) the stub writes all its threads' stacks to
    stderr, the server log, instead of dying of the signal."""
    faulthandler.register(signal.SIGUSR1, all_threads=True)


class SentTicket:
    """One queued response; the request's next response waits until this one is sent."""

    __slots__ = ("sent", "waiter")

    def __init__(self) -> None:
        self.sent = False
        self.waiter: asyncio.Future | None = None


class ResponseSendThread:
    """Sends responses from a thread of its own, in the order they were put.

    A python-backend ``send`` is a round trip to the server process (the stub waits for
    its turn, GIL released); made on the event loop, it stalled the engine's output
    handling and every other request for each token sent. As in Triton's vllm_backend,
    the loop only queues. A failed send is logged: the request's final flag still goes
    out after it, and its client learns of the end either way.

    A request hands over its next response only once the previous one is sent
    (``wait_sent``): while the server is busy, vLLM's output collector merges the tokens
    that come meanwhile into one delta, as it does for ``vllm serve``'s HTTP stream, so a
    lagging path sends fewer, larger responses instead of queueing one per token."""

    def __init__(self, name: str, pb_utils: Any, loop: asyncio.AbstractEventLoop) -> None:
        self._pb = pb_utils
        self._loop = loop
        self._lock = threading.Lock()
        self._queue: queue.SimpleQueue[tuple[Any, Any, int, Reply | None, SentTicket] | None] = (
            queue.SimpleQueue()
        )
        self._thread = threading.Thread(target=self._run, name=f"{name}-send", daemon=True)
        self._thread.start()

    def send(
        self, sender: Any, response: Any = None, final: bool = False, reply: Reply | None = None
    ) -> SentTicket:
        """Queue a response; the final one of a call whose reply channel failed
        (``reply_channel``) goes out as an ``INTERNAL`` error instead."""
        flags = self._pb.TRITONSERVER_RESPONSE_COMPLETE_FINAL if final else 0
        ticket = SentTicket()
        self._queue.put((sender, response, flags, reply, ticket))
        return ticket

    async def wait_sent(self, ticket: SentTicket) -> None:
        """Return once ``ticket``'s response has left (at once if it has); on the loop."""
        with self._lock:
            if ticket.sent:
                return
            ticket.waiter = waiter = self._loop.create_future()
        await waiter

    def _run(self) -> None:
        while (item := self._queue.get()) is not None:
            sender, response, flags, reply, ticket = item
            if reply is not None and reply.broken:
                response = self._reply_failed(reply)
            try:
                sender.send(response, flags=flags)
            except Exception:  # noqa: BLE001 - the thread must outlive one bad send
                self._pb.Logger.log_error(f"sending a response failed:\n{traceback.format_exc()}")
            with self._lock:
                ticket.sent = True
                waiter = ticket.waiter
            if waiter is not None:
                with contextlib.suppress(RuntimeError):  # the loop has stopped
                    self._loop.call_soon_threadsafe(_resolve, waiter)

    def _reply_failed(self, reply: Reply) -> Any:
        host, port = reply.address
        failed = StageError(f"the reply channel to {host}:{port} failed")
        error = self._pb.TritonError(error_message(failed), self._pb.TritonError.INTERNAL)
        return self._pb.InferenceResponse(error=error)

    def stop(self, timeout_s: float = 10) -> None:
        """Send what is queued, then end the thread."""
        self._queue.put(None)
        self._thread.join(timeout=timeout_s)


def _resolve(waiter: asyncio.Future) -> None:
    if not waiter.done():  # a cancelled request stopped waiting
        waiter.set_result(None)


class DecoupledModelRunner:
    """Serves a decoupled Triton model from an async handler on a private event loop.

    Per request it owns the ``RequestContext``: the deadline (the topology's
    ``request_timeout_s``, shortened by the client's Triton ``timeout``), and a watcher that
    cancels the handler's task when Triton reports the request cancelled (the client closed
    its gRPC stream) or the deadline passes. Internal models (the default; public entry
    points pass ``public=True``) refuse calls without the deployment's credential. A call
    may name a reply channel (``reply_channel``) for its answers: honoured on a call whose
    credential covers it, refused (``UNAUTHENTICATED``) on one whose credential does not.
    """

    def __init__(
        self,
        args: dict[str, Any],
        pb_utils: Any,
        make_handler: Callable[[ModelContext], Awaitable[StageHandler]],
        start_timeout_s: float = 600,
        public: bool = False,
    ) -> None:
        # The stub embeds Python in an isolated config whose preferred encoding is ASCII;
        # torch/vLLM read UTF-8 templates at import and die without this.
        locale.setlocale(locale.LC_CTYPE, "C.UTF-8")
        dump_stacks_on_signal()
        self._pb = pb_utils
        self._loop = asyncio.new_event_loop()
        self._thread = threading.Thread(
            target=self._loop.run_forever, name=f"{args['model_name']}-loop", daemon=True
        )
        self._thread.start()
        self._inflight: set[concurrent.futures.Future] = set()
        self._live: dict[asyncio.Task, tuple[RequestContext, Any]] = {}
        self._watcher: asyncio.Task | None = None
        ctx = model_context(args, pb_utils)
        tracing.setup(ctx.topology.tracing, f"{ctx.server}/{ctx.model_name}")
        self.model = ctx.model_name
        self.public = public
        self._limits = ctx.topology.limits
        # Internal models refuse calls without the deployment's credential. A public one
        # takes anyone's call, and a reply channel only from a call signed with it (the
        # OpenAI front's): no client may make it connect somewhere.
        has_secret = SECRET_ENV in os.environ
        self._key = DeploymentKey.from_env() if has_secret or not public else None
        self._responses = ResponseSendThread(args["model_name"], pb_utils, self._loop)
        self._replies = None if self._key is None else ReplyWriter(self._key.reply_token)
        self.handler: StageHandler = asyncio.run_coroutine_threadsafe(
            make_handler(ctx), self._loop
        ).result(start_timeout_s)
        self.stopped = {"cancelled": 0, "deadline": 0}
        self.in_flight = 0
        self._metrics = asyncio.run_coroutine_threadsafe(self._publish(ctx), self._loop).result(30)

    async def _publish(self, ctx: ModelContext) -> Any:
        from orchestrator.metrics import MetricsPublisher

        metrics = MetricsPublisher(ctx.pb_utils, {"server": ctx.server, "model": self.model})
        for reason in self.stopped:
            metrics.counter(
                "epd_requests_stopped_total",
                "Requests stopped before their end: the client cancelled, or the deadline passed",
                lambda r=reason: self.stopped[r],
                reason=reason,
            )
        metrics.gauge(
            "epd_requests_in_flight",
            "Requests this model is working on (health probes aside): its queue depth, what "
            "an autoscaler reads",
            lambda: self.in_flight,
        )
        metrics.start()
        return metrics

    def submit(self, requests: list[Any]) -> None:
        """Schedule every request on the loop; responses go out through their senders."""
        for request in requests:
            inputs = {t.name(): t.as_numpy() for t in request.inputs()}
            call = _Call(
                inputs=inputs,
                sender=request.get_response_sender(),
                request_id=request.request_id(),
                timeout_us=request.timeout(),
                parameters=request.parameters(),
            )
            fut = asyncio.run_coroutine_threadsafe(self._serve(call), self._loop)
            self._inflight.add(fut)
            fut.add_done_callback(self._inflight.discard)

    def _context(self, call: _Call) -> RequestContext:
        timeout_s = self._limits.request_timeout_s
        if call.timeout_us > 0:
            timeout_s = min(timeout_s, call.timeout_us / 1e6)
        # Internal calls keep the front's id (one id in every stage's log and engine);
        # a public request gets a fresh one: client-chosen ids may collide in vLLM.
        return RequestContext.create(
            timeout_s,
            self._limits.stream_idle_timeout_s,
            request_id=None if self.public else call.request_id,
        )

    async def _serve(self, call: _Call) -> None:
        pb, sender, responses = self._pb, call.sender, self._responses
        ctx = self._context(call)
        ctx.client_gone = sender.is_cancelled
        parameters = _parameters(call.parameters)
        probe = PROBE_PARAMETER in parameters and not self.public
        span = tracing.start(
            self.model,
            None if probe else tracing.remote_context(parameters),
            tracing.trace.SpanKind.SERVER,
            **{"epd.request_id": ctx.request_id},
        )
        ctx.trace = tracing.within(span)
        task = asyncio.current_task()
        assert task is not None
        self._live[task] = (ctx, sender)
        self.in_flight += not probe
        if self._watcher is None:
            self._watcher = self._loop.create_task(self._watch())
        final_sent, previous, reply = False, None, None
        try:
            reply_to = str(parameters.get(REPLY_PARAMETER, "")) if self._key else ""
            if self._key is not None and (reply_to or not self.public):
                self._key.verify_call(
                    self.model,
                    call.request_id,
                    call.inputs,
                    parameters.get(MAC_PARAMETER),
                    reply_to,
                )
            if reply_to:
                reply = Reply(*parse_reply_to(reply_to))
            if probe:
                await self._check_health()
            else:
                async for outputs in self.handler.generate(call.inputs, ctx):
                    if final_sent:
                        raise RuntimeError(f"{self.model} yielded after its last response")
                    final_sent = isinstance(outputs, LastResponse)
                    if previous is not None:  # Triton's path (a reply channel waits in write)
                        await responses.wait_sent(previous)
                    if reply is not None:
                        await self._replies.write(
                            reply, encode_frame(reply.call, outputs, final_sent)
                        )
                        if final_sent:
                            responses.send(sender, final=True, reply=reply)
                    else:
                        tensors = [pb.Tensor(name, value) for name, value in outputs.items()]
                        response = pb.InferenceResponse(output_tensors=tensors)
                        previous = responses.send(sender, response, final_sent)
                    if final_sent:  # its sender is closing: the watcher must not ask it
                        self._live.pop(task, None)
            if not final_sent:
                if reply is not None:
                    await self._replies.write(reply, encode_frame(reply.call, {}, last=True))
                responses.send(sender, final=True, reply=reply)
        except asyncio.CancelledError:
            stopped = ctx.stop_error()
            if stopped is None:  # the loop is shutting down, not our watcher
                raise
            task.uncancel()
            self.stopped["cancelled" if ctx.cancelled else "deadline"] += 1
            tracing.failed(span, stopped)
            if not final_sent:
                self._send_error(sender, stopped, ctx)
        except Exception as exc:  # every failure must reach the client, never the loop
            tracing.failed(span, exc)
            if not final_sent:
                self._send_error(sender, exc, ctx)
            else:  # the client has its whole answer; what failed after it is ours to log
                self._pb.Logger.log_error(
                    f"{self.model} request {ctx.request_id} failed after its last "
                    f"response:\n{traceback.format_exc()}"
                )
        finally:
            self._live.pop(task, None)
            self.in_flight -= not probe
            span.end()

    async def _check_health(self) -> None:
        check = getattr(self.handler, "check_health", None)
        if check is not None:
            await check()

    async def _watch(self) -> None:
        """Cancel the tasks of requests the client cancelled or whose deadline passed;
        runs only while requests are in flight (an idle server does nothing here)."""
        try:
            while self._live:
                await asyncio.sleep(WATCH_PERIOD_S)
                for task, (ctx, sender) in list(self._live.items()):
                    if task.done() or ctx.cancelled or ctx.timed_out:
                        continue
                    if sender.is_cancelled():
                        ctx.cancelled = True
                        task.cancel()
                    elif ctx.expired():
                        ctx.timed_out = True
                        task.cancel()
        finally:
            self._watcher = None

    def _send_error(self, sender: Any, exc: BaseException, ctx: RequestContext) -> None:
        error = self._pb.InferenceResponse(error=self._triton_error(exc, ctx))
        self._responses.send(sender, error, final=True)

    def _triton_error(self, exc: BaseException, ctx: RequestContext) -> Any:
        """Our errors keep their kind and message; anything else is a short ``INTERNAL``
        naming the request, with the trace in the server log only."""
        error = self._pb.TritonError
        if not isinstance(exc, StageError):
            self._pb.Logger.log_error(
                f"{self.model} request {ctx.request_id} failed:\n{traceback.format_exc()}"
            )
            exc = StageError(
                f"internal error in {self.model} (request {ctx.request_id}); "
                "the server log has the details"
            )
        return error(error_message(exc), getattr(error, exc.triton_code, error.INTERNAL))

    def stop(self, drain_timeout_s: float = 30) -> None:
        """Let in-flight requests finish (bounded), close the handler, stop the loop."""
        if self._inflight:
            concurrent.futures.wait(list(self._inflight), timeout=drain_timeout_s)
        try:
            asyncio.run_coroutine_threadsafe(self._close(), self._loop).result(30)
        finally:
            self._loop.call_soon_threadsafe(self._loop.stop)
            self._thread.join(timeout=10)
            self._responses.stop()

    async def _close(self) -> None:
        try:
            await self._metrics.stop()
            if self._replies is not None:
                await self._replies.close()
        finally:
            await self.handler.close()
            tracing.shutdown()


@dataclass(frozen=True)
class _Call:
    """What the runner takes from a Triton request before handing it to its loop."""

    inputs: Tensors
    sender: Any
    request_id: str
    timeout_us: int
    parameters: str


def _parameters(raw: str) -> dict[str, Any]:
    """Triton's request parameters (a JSON object); anything else counts as none."""
    try:
        parameters = json.loads(raw or "{}")
    except ValueError:
        return {}
    return parameters if isinstance(parameters, dict) else {}
