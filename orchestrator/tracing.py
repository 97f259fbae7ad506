"""One OpenTelemetry trace per request, across every server it crosses.

Every process that serves a request (each Triton model's stub, the OpenAI front) installs a
tracer provider from the topology's ``tracing`` settings; with none set, OpenTelemetry's
no-op tracer costs next to nothing. The trace context rides each stage call as the W3C
``traceparent`` request parameter (a client may send one too): the runner of the called
model opens its server span under it, so one request is one trace from the front to the
engines. Spans are never made current across a ``yield`` (an async generator shares its
consumer's context): every span is started under an explicit parent and ended by hand.
"""

from __future__ import annotations

import json
import os
import threading
from collections.abc import Iterator, Mapping, Sequence
from contextlib import contextmanager
from pathlib import Path
from typing import Any

from opentelemetry import propagate, trace
from opentelemetry.context import Context

from orchestrator.config import TracingSpec

TRACEPARENT = "traceparent"
"""The request parameter (and HTTP header) that carries the trace context."""

tracer = trace.get_tracer("epd")
"""Spans of this package; a no-op until ``setup`` installs a provider."""

_setup_lock = threading.Lock()
_provider: Any = None


def setup(spec: TracingSpec, instance: str) -> None:
    """Install this process's tracer provider (once; nothing when tracing is off).
    ``instance`` names the process among the deployment's, e.g. ``prefill/prefill``."""
    global _provider
    if not spec.enabled:
        return
    with _setup_lock:
        if _provider is not None:
            return
        from opentelemetry.sdk.resources import Resource
        from opentelemetry.sdk.trace import TracerProvider
        from opentelemetry.sdk.trace.export import BatchSpanProcessor, SimpleSpanProcessor

        resource = Resource.create(
            {"service.name": spec.service_name, "service.instance.id": instance}
        )
        provider = TracerProvider(resource=resource)
        if spec.otlp_endpoint:
            from opentelemetry.exporter.otlp.proto.grpc.trace_exporter import OTLPSpanExporter

            exporter = OTLPSpanExporter(
                endpoint=spec.otlp_endpoint, insecure=spec.otlp_endpoint.startswith("http://")
            )
            provider.add_span_processor(BatchSpanProcessor(exporter))
        if spec.directory:
            name = f"{instance.replace('/', '-')}-{os.getpid()}.jsonl"
            provider.add_span_processor(
                SimpleSpanProcessor(JsonLinesExporter(spec.directory / name))
            )
        trace.set_tracer_provider(provider)
        _provider = provider


def shutdown() -> None:
    """Flush and stop this process's exporters (at the end of the process's serving)."""
    if _provider is not None:
        _provider.shutdown()


def carrier(context: Context | None = None) -> dict[str, str]:
    """The trace context of ``context`` (default: the current one) as request parameters;
    empty when there is no recording span."""
    out: dict[str, str] = {}
    propagate.inject(out, context=context)
    return out


def remote_context(parameters: Mapping[str, Any]) -> Context:
    """The caller's trace context from request parameters or HTTP headers (a fresh root
    when there is none)."""
    value = parameters.get(TRACEPARENT)
    return propagate.extract({TRACEPARENT: value} if isinstance(value, str) else {})


def start(
    name: str, parent: Context | None, kind: trace.SpanKind = trace.SpanKind.INTERNAL, **attrs: Any
) -> trace.Span:
    """A span under ``parent`` (a request's ``RequestContext.trace``), ended by the caller;
    a no-op span when ``parent`` is ``None`` (work outside any request: probes, cleanup).
    Parents are always explicit, never the ambient context: a request's work spans tasks,
    executor threads and async generators, whose context is not the request's."""
    if parent is None:
        return trace.INVALID_SPAN
    return tracer.start_span(name, context=parent, kind=kind, attributes=attrs)


def within(span: trace.Span) -> Context:
    """The context whose current span is ``span`` (the parent for its children)."""
    return trace.set_span_in_context(span)


@contextmanager
def span(name: str, parent: Context | None, **attrs: Any) -> Iterator[trace.Span]:
    """A span under ``parent`` around a block; an exception escaping it marks it failed."""
    current = start(name, parent, **attrs)
    try:
        yield current
    except BaseException as exc:
        failed(current, exc)
        raise
    finally:
        current.end()


def failed(current: trace.Span, exc: BaseException) -> None:
    """Mark ``current`` as failed by ``exc`` (its kind and message, no trace)."""
    from opentelemetry.trace import Status, StatusCode

    why = f"{type(exc).__name__}: {exc}" if str(exc) else type(exc).__name__
    current.set_status(Status(StatusCode.ERROR, why))


class JsonLinesExporter:
    """Appends each finished span to a file as one JSON object per line: name, ids,
    parent, start and end (ns since the epoch), the process and the attributes."""

    def __init__(self, path: Path) -> None:
        path.parent.mkdir(parents=True, exist_ok=True)
        self._file = open(path, "a", encoding="utf-8")  # noqa: SIM115 - lives with the exporter
        self._lock = threading.Lock()

    def export(self, spans: Sequence[Any]) -> Any:
        from opentelemetry.sdk.trace.export import SpanExportResult

        lines = []
        for finished in spans:
            ctx, parent = finished.context, finished.parent
            lines.append(
                json.dumps(
                    {
                        "name": finished.name,
                        "trace_id": f"{ctx.trace_id:032x}",
                        "span_id": f"{ctx.span_id:016x}",
                        "parent_id": f"{parent.span_id:016x}" if parent else None,
                        "start_ns": finished.start_time,
                        "end_ns": finished.end_time,
                        "instance": finished.resource.attributes.get("service.instance.id"),
                        "attributes": dict(finished.attributes or {}),
                    }
                )
            )
        with self._lock:
            self._file.write("".join(line + "\n" for line in lines))
            self._file.flush()
        return SpanExportResult.SUCCESS

    def shutdown(self) -> None:
        with self._lock:
            self._file.close()

    def force_flush(self, timeout_millis: int = 30000) -> bool:
        return True


def read_spans(directory: Path) -> list[dict[str, Any]]:
    """Every span the processes of a deployment wrote to ``directory``, so far: the
    servers write while this reads, and a line without its newline yet is still being
    written (it is read next time)."""
    spans = []
    for path in sorted(directory.glob("*.jsonl")):
        *whole, _being_written = path.read_text(encoding="utf-8").split("\n")
        spans.extend(json.loads(line) for line in whole if line.strip())
    return spans
