"""Deployment topology: which Triton servers exist, which stages each hosts, how they talk.

One pydantic model validated in one place; every other module receives an already-valid
``Topology``. Loaded from YAML (``epd serve --topology FILE``) or built in code.
"""

from __future__ import annotations

import ipaddress
from pathlib import Path
from typing import Any, Literal

import yaml
from pydantic import BaseModel, ConfigDict, Field, ValidationError, model_validator

StageName = Literal["encode", "prefill", "decode", "pd", "epd", "aggregated"]
"""Triton models a server can host. ``encode`` brings its ``vision_encoder`` along; ``pd``
is one engine that prefills and decodes (E+PD), instead of ``prefill`` + ``decode``."""
PUBLIC_STAGES: frozenset[str] = frozenset({"epd", "aggregated"})
"""Entry points clients call; every other stage is internal (needs the deployment key)."""

TransferKind = Literal["nixl", "mooncake", "inline"]
EncoderRuntimeKind = Literal["onnxruntime", "tensorrt"]

LOOPBACK = "127.0.0.1"


def describe(exc: ValidationError) -> str:
    """A pydantic error as one line a user can act on: ``field.path: what is wrong; ...``."""
    return "; ".join(
        f"{'.'.join(map(str, e['loc'])) or 'value'}: {e['msg'].removeprefix('Value error, ')}"
        for e in exc.errors()
    )


class _Spec(BaseModel):
    model_config = ConfigDict(extra="forbid")


def cpu_list(text: str) -> set[int]:
    """The CPUs of a list such as ``0-3,8`` (``taskset``'s and vLLM's syntax)."""
    cpus: set[int] = set()
    try:
        for part in text.split(","):
            first, _, last = part.partition("-")
            cpus.update(range(int(first), int(last or first) + 1))
    except ValueError:
        raise ValueError(
            f"{text!r} is not a CPU list such as 0-3,8 (an engine is one process here: no "
            "per-rank '|' lists)"
        ) from None
    if not cpus:
        raise ValueError(f"{text!r} names no CPU")
    return cpus


class ServerSpec(_Spec):
    """One Triton server process (one host in a multi-host deployment)."""

    host: str = LOOPBACK
    """Address other servers and clients use to reach this one (an IP or a DNS name); the
    server also binds it unless ``bind`` is set."""
    bind: str | None = None
    """IP address the server's sockets bind to when it differs from ``host``: ``0.0.0.0`` in
    a container or pod whose ``host`` is a service name, or one interface's IP. Triton binds
    only IP addresses, so a ``host`` that is a name needs this."""
    http_port: int = Field(ge=1, le=65535)
    """KServe v2 HTTP port."""
    grpc_port: int = Field(ge=1, le=65535)
    """KServe v2 gRPC port; remote stage calls use it."""
    metrics_port: int = Field(ge=1, le=65535)
    """Prometheus ``/metrics`` port."""
    stages: list[StageName] = Field(min_length=1)
    """Models this server hosts."""
    env: dict[str, str] = Field(default_factory=dict)
    """Extra environment for this server (e.g. ``CUDA_VISIBLE_DEVICES``, thread counts)."""
    engine_args: dict[str, Any] = Field(default_factory=dict)
    """Overrides of ``llm.engine_args`` for the engines on this server (e.g. dtype or
    ``gpu_memory_utilization`` for its GPU type)."""
    instances: dict[str, int] = Field(default_factory=dict)
    """Triton instances per model on this server (``instance_group`` count; default 1),
    e.g. ``{vision_encoder: 2}``."""
    cpus: str | None = Field(default=None, pattern=r"^[0-9,\-]+$")
    """CPU list to pin the server to (``taskset -c``, e.g. ``0`` or ``2-3``): on one CPU box
    it stands in for "separate hardware per stage" in benchmarks."""
    netns: str | None = None
    """Linux network namespace to start the server in (``ip netns exec``): separate hosts
    on one machine, as the multi-host tests use; ``None`` = this process's namespace."""
    openai_port: int | None = Field(default=None, ge=1, le=65535)
    """Port of the OpenAI-compatible HTTP server (``/v1/chat/completions``) run beside this
    server's Triton, on the same address; only on a server hosting ``epd`` or
    ``aggregated``. ``None``: none here."""
    triton: Path | None = None
    """Root of the full Triton install this server runs (``bin/tritonserver``,
    ``backends/``). Default: ``$EPD_TRITON_PATH``, else ``/opt/tritonserver`` (NVIDIA's
    container) when present, else the 2.51 server of the nvidia-pytriton wheel (python
    backend only: enough on CPU, not for the TensorRT encoder)."""

    @property
    def bind_address(self) -> str:
        return self.bind or self.host

    @model_validator(mode="after")
    def _check_addresses(self) -> ServerSpec:
        try:
            ipaddress.ip_address(self.bind_address)
        except ValueError:
            what = "bind" if self.bind else "host"
            hint = "" if self.bind else " (a DNS name is fine as host: then set bind: 0.0.0.0)"
            raise ValueError(
                f"{what} {self.bind_address!r} is not an IP address; Triton binds only IP "
                f"addresses{hint}"
            ) from None
        return self

    @model_validator(mode="after")
    def _check_engine_binding(self) -> ServerSpec:
        bind = self.env.get("VLLM_CPU_OMP_THREADS_BIND", "auto")
        if bind not in ("auto", "nobind", ""):
            try:
                cpu_list(bind)
            except ValueError as exc:
                raise ValueError(f"env VLLM_CPU_OMP_THREADS_BIND: {exc}") from None
        return self

    @property
    def grpc_url(self) -> str:
        return f"{self.host}:{self.grpc_port}"

    @property
    def local_grpc_url(self) -> str:
        """This server's gRPC endpoint as seen from the server itself."""
        bind = self.bind_address
        return f"{'127.0.0.1' if bind in ('0.0.0.0', '::') else bind}:{self.grpc_port}"

    @property
    def http_url(self) -> str:
        return f"{self.host}:{self.http_port}"

    @property
    def ports(self) -> tuple[int, ...]:
        """Every port this server listens on."""
        ports = (self.http_port, self.grpc_port, self.metrics_port)
        return ports if self.openai_port is None else (*ports, self.openai_port)


class TransferSpec(_Spec):
    """How embeddings travel from the encoder to prefill."""

    kind: TransferKind = "nixl"
    """``nixl``: metadata-only handle, prefill pulls with a NIXL READ. ``mooncake``: the
    same with Mooncake's TransferEngine (optional install). ``inline``: bytes in the request
    (A/B baseline)."""
    pool_bytes: int | None = Field(default=None, gt=0)
    """Byte budget of each encoder's embedding cache (for NIXL: the DRAM pool registered
    once at start). Unset: sized from the model — 8 of its largest images' embeddings
    (hidden size x tokens at the processor's largest size x 4 bytes), at least 64 MiB. A
    pool that cannot hold one largest image is refused at start-up."""
    cache: bool = True
    """Keep embeddings after prefill pulled them, keyed by image content, so repeated images
    skip the encoder (LRU within ``pool_bytes``). Off: freed once pulled (A/B baseline)."""
    ttl_s: float = Field(default=60.0, gt=0)
    """Lifetime of a handle; one nobody pulled stops pinning its embedding after it."""
    reclaim_grace_s: float = Field(default=10.0, ge=0)
    """Extra time past ``ttl_s`` before an unpulled embedding may be evicted (above the
    consumer's 5 s READ timeout, so a late READ never sees its slot reused)."""
    prefill_cache_bytes: int = Field(default=0, ge=0)
    """Bytes of pulled embeddings each prefill keeps by content hash, so a hot image does
    not cross the network again (the encoder's handle is then released unread); 0: off."""
    full_wait_s: float = Field(default=2.0, ge=0)
    """How long an encode waits for room when the cache is full of pinned embeddings before
    it fails with UNAVAILABLE."""


class EncoderSpec(_Spec):
    """The vision encoder stage."""

    runtime: EncoderRuntimeKind = "onnxruntime"
    """``onnxruntime`` on CPU (python backend); ``tensorrt`` builds a plan on GPU machines."""
    threads: int = Field(default=1, ge=1)
    """Intra-op threads of the ONNX Runtime session."""


class LLMSpec(_Spec):
    """vLLM engine settings shared by prefill, decode and aggregated."""

    engine_args: dict[str, Any] = Field(
        default_factory=lambda: {
            "dtype": "float32",
            "enforce_eager": True,
            "block_size": 32,
            "max_num_seqs": 16,
            "seed": 0,
            # The HF fast (torchvision) image processor resizes slightly differently from
            # the PIL one our encoder matches; pixel-input engines must use the same.
            "mm_processor_kwargs": {"use_fast": False},
        }
    )
    """Keyword arguments of ``vllm.AsyncEngineArgs`` (role-specific ones are added).
    Without ``max_model_len`` engines serve the model's whole context."""
    kv_buffer_device: Literal["cpu", "cuda"] = "cpu"
    """Where NixlConnector stages KV: ``cpu`` here, ``cuda`` on GPU servers."""
    kv_space_gib: int = Field(default=1, ge=1)
    """``VLLM_CPU_KVCACHE_SPACE`` for CPU engines."""
    nixl_progress_thread: bool = False
    """Let NIXL run its progress thread in the KV connector. It spins a core per engine even
    when idle; vLLM polls transfers on every step without it (``orchestrator.kv_connector``)."""


class Limits(_Spec):
    """Limits enforced at the edge (the ``epd`` and ``aggregated`` models)."""

    max_images_per_request: int = Field(default=2, ge=0)
    """More images than this is ``INVALID_ARG`` (also vLLM's ``limit_mm_per_prompt``)."""
    max_image_bytes: int = Field(default=20 << 20, gt=0)
    """Encoded size cap of one image."""
    max_image_pixels: int = Field(default=40_000_000, gt=0)
    """Decoded size cap of one image (width x height from its header, checked at the edge
    and again by the encoder before decoding): decompression bombs stop here."""
    max_text_bytes: int = Field(default=1 << 20, gt=0)
    """Size cap of ``text_input``, or of all text in ``messages`` (UTF-8 bytes), and of
    ``sampling_parameters`` (stop strings, a grammar or JSON schema to compile)."""
    max_messages: int = Field(default=256, ge=1)
    """Most turns in one ``messages`` conversation."""
    max_request_bytes: int = Field(default=64 << 20, gt=0)
    """Cap of text plus all images of one request."""
    request_timeout_s: float = Field(default=300.0, gt=0)
    """Deadline of a whole request, from arrival to its last token. A client may ask for a
    shorter one with Triton's request ``timeout`` (microseconds); never a longer one. Every
    stage call gets what is left of it."""
    stream_idle_timeout_s: float = Field(default=60.0, gt=0)
    """Longest wait for the next response of a stage call (an image's encode, prefill, the
    next decoded token). A request past either timeout fails with ``DEADLINE_EXCEEDED``; the
    server stays in rotation (only failed health probes take one out)."""


class RoutingSpec(_Spec):
    """How the ``epd`` front picks servers and notices dead ones."""

    health_interval_s: float = Field(default=1.0, gt=0)
    """Period of the readiness probe of every stage server that is out of rotation (to
    re-admit it once back) or that this front has called since its last probe (dead ones
    are taken out of rotation)."""
    idle_health_interval_s: float = Field(default=5.0, gt=0)
    """Period of the probe of a server in rotation that this front has not called since its
    last probe (never more often than ``health_interval_s``): an idle front's probes, and
    the stage servers' work answering them, cost a fifth as much (Envoy's
    ``no_traffic_healthy_interval``). A server that dies while nobody calls it is noticed
    within this period, or by the first call that fails on it."""
    probe_timeout_s: float = Field(default=2.0, gt=0)
    """How long a probe waits for its answer (above the 1 s cap on gRPC's reconnect backoff,
    so a server that just came up gets one try)."""
    probe_misses_to_down: int = Field(default=3, ge=1)
    """Probes in a row a server may leave unanswered before it is taken out of rotation: a
    server too busy to answer within ``probe_timeout_s`` is not dead. A refused connection
    or an unhealthy answer (a dead engine) takes it out at the first probe."""
    reuse_index_entries: int = Field(default=65536, ge=0)
    """Images remembered per front for cache-aware routing to the encoder holding them
    (0 turns cache-aware routing off)."""
    encode_attempts: int = Field(default=3, ge=1)
    """Encoders an image is tried on before the request fails (encoders are stateless
    apart from their cache, so a failed encode is retried on another one)."""
    resolve_interval_s: float = Field(default=30.0, gt=0)
    """How often the front opens a fresh channel to each stage server, resolving its name
    again. A name that stands for several pods (a headless Kubernetes Service whose
    Deployment an autoscaler resizes) gains the new pods within this period; calls are
    spread over all of them (round robin per call)."""
    max_local_prefill_tokens: int = Field(default=0, ge=0)
    """E/P/D: a prompt of at most this many tokens (its images' tokens counted) skips the
    prefill server: decode's own engine pulls its images' embeddings and prefills it (no
    prefill call, no KV transfer), as Dynamo's conditional disaggregation
    (``max_local_prefill_length``) and TensorRT-LLM's (``ConditionalDisaggConfig``) do: a
    short prefill costs decode less than the extra hop and the KV's move cost the request.
    0: every prompt goes to prefill. E/P/D topologies only."""
    reply_channel: bool = True
    """Stages write their responses straight to the front over a TCP connection of their
    own (``orchestrator/reply_channel.py``) instead of back through Triton; requests,
    cancellation and errors still go through Triton. Each process that calls stages (the
    OpenAI front, the ``epd`` model) listens on an ephemeral port of its server's bind
    address, which the stage servers must be able to reach (``false``: every response
    through Triton)."""


class TracingSpec(_Spec):
    """OpenTelemetry traces: one trace per request, a span per hop in every server it
    crosses (the trace context rides each stage call). Off unless an exporter is set."""

    otlp_endpoint: str | None = None
    """OTLP/gRPC collector every server exports to, e.g. ``http://collector:4317``
    (``http://``: plaintext, ``https://``: TLS)."""
    directory: Path | None = None
    """Folder where every process appends its finished spans as JSON lines (one file per
    process): for tests and ``epd bench``, which reads them back per hop."""
    service_name: str = "epd"
    """``service.name`` of the spans; each process adds its server and model
    (``service.instance.id``)."""

    @property
    def enabled(self) -> bool:
        return self.otlp_endpoint is not None or self.directory is not None


class OpenAISpec(_Spec):
    """The OpenAI-compatible front (``/v1/chat/completions``) of servers with an
    ``openai_port``: a client of their public Triton models."""

    served_model_name: str | None = None
    """Model name clients send; default: the checkpoint folder's name. It names the ``epd``
    pipeline (``aggregated`` where the server hosts no ``epd``); ``epd`` and
    ``aggregated`` are accepted too, to pick one by name."""
    allowed_media_domains: list[str] = Field(default_factory=list)
    """Hosts whose ``http(s)`` image URLs the front fetches (exact names). Empty: only
    ``data:`` URLs are accepted, the server fetches nothing on a client's behalf."""
    media_timeout_s: float = Field(default=10.0, gt=0)
    """Time limit of fetching one image URL (its size is capped by
    ``limits.max_image_bytes``)."""
    max_concurrent_requests: int = Field(default=256, ge=1)
    """Requests in flight at once; more are answered 429 at once rather than queued."""


class Topology(_Spec):
    """A whole deployment: servers, what each hosts, and the knobs of every stage."""

    model: Path
    """Directory of the HF-format VLM (``epd model build`` makes the tiny one)."""
    servers: dict[str, ServerSpec] = Field(min_length=1)
    """Servers by name."""
    transfer: TransferSpec = Field(default_factory=TransferSpec)
    encoder: EncoderSpec = Field(default_factory=EncoderSpec)
    llm: LLMSpec = Field(default_factory=LLMSpec)
    routing: RoutingSpec = Field(default_factory=RoutingSpec)
    limits: Limits = Field(default_factory=Limits)
    openai: OpenAISpec = Field(default_factory=OpenAISpec)
    tracing: TracingSpec = Field(default_factory=TracingSpec)

    @property
    def served_model_name(self) -> str:
        return self.openai.served_model_name or self.model.name

    @model_validator(mode="after")
    def _check(self) -> Topology:
        problems: list[str] = []
        hosting: dict[str, list[str]] = {}
        for name, server in self.servers.items():
            for stage in server.stages:
                hosting.setdefault(stage, []).append(name)
        if not hosting.keys() & PUBLIC_STAGES:
            problems.append("no server hosts an entry point: add 'epd' or 'aggregated'")
        if "epd" in hosting:
            problems += _epd_route_problems(hosting)
        if self.local_prefill and "pd" in hosting:
            problems.append(
                "routing.max_local_prefill_tokens sends short prompts past the prefill "
                "server (E/P/D); with 'pd' (E+PD) every prompt is prefilled locally already: "
                "leave it 0"
            )
        for name, server in self.servers.items():
            public, internal = _split(server.stages)
            if public and internal:
                problems.append(
                    f"server {name!r} hosts entry points {public} and internal stages "
                    f"{internal}: clients reach the entry points' server, so internal stages "
                    "need servers of their own (docs/security.md)"
                )
        for name, server in self.servers.items():
            models = {*server.stages, *(["vision_encoder"] if "encode" in server.stages else [])}
            for model, count in server.instances.items():
                if model not in models:
                    problems.append(
                        f"server {name!r} sets instances of {model!r}, which it "
                        f"does not host (it hosts {sorted(models)})"
                    )
                elif count < 1:
                    problems.append(f"server {name!r}: instances of {model!r} must be >= 1")
        for name, server in self.servers.items():
            if server.openai_port is not None and not PUBLIC_STAGES & set(server.stages):
                problems.append(
                    f"server {name!r} has an openai_port but hosts no entry point "
                    "('epd' or 'aggregated') for it to call"
                )
        seen: dict[tuple[str, int], str] = {}
        for name, server in self.servers.items():
            if len(set(server.ports)) != len(server.ports):
                problems.append(f"server {name!r} uses one port twice: {server.ports}")
            for port in set(server.ports):
                other = seen.setdefault((server.host, port), name)
                if other != name:
                    problems.append(f"servers {other!r} and {name!r} both use {server.host}:{port}")
        if problems:
            raise ValueError("invalid topology: " + "; ".join(problems))
        return self

    @property
    def local_prefill(self) -> bool:
        """E/P/D's decode engines prefill short prompts themselves (conditional
        disaggregation): they pull embeddings too."""
        return self.routing.max_local_prefill_tokens > 0

    @property
    def one_engine(self) -> bool:
        """E+PD: ``epd`` sends the prompt to one ``pd`` engine, not to prefill then decode."""
        return bool(self.servers_of("pd"))

    @property
    def llm_stages(self) -> tuple[StageName, ...]:
        """The engines behind ``epd``, in the order a prompt visits them."""
        return ("pd",) if self.one_engine else ("prefill", "decode")

    def servers_of(self, stage: StageName) -> dict[str, ServerSpec]:
        """Every server hosting ``stage``, by name (several scale a stage out)."""
        return {name: s for name, s in self.servers.items() if stage in s.stages}

    def server_of(self, stage: StageName) -> tuple[str, ServerSpec]:
        """The (name, spec) of the first server hosting ``stage``."""
        for name, server in self.servers_of(stage).items():
            return name, server
        raise KeyError(f"no server hosts stage {stage!r}")

    @classmethod
    def load(cls, path: str | Path) -> Topology:
        """Read a YAML topology; relative ``model`` paths resolve against the file's folder."""
        path = Path(path)
        data = yaml.safe_load(path.read_text()) or {}
        if isinstance(data, dict) and "model" in data:
            model = Path(str(data["model"])).expanduser()
            data["model"] = model if model.is_absolute() else (path.parent / model).resolve()
        try:
            return cls.model_validate(data)
        except ValidationError as exc:
            raise ValueError(f"{path}: {describe(exc)}") from None


def _split(stages: list[StageName]) -> tuple[list[str], list[str]]:
    """A server's stages as (entry points, internal stages)."""
    return (
        [s for s in stages if s in PUBLIC_STAGES],
        [s for s in stages if s not in PUBLIC_STAGES],
    )


def _epd_route_problems(hosting: dict[str, list[str]]) -> list[str]:
    """What keeps ``epd`` from routing E -> PD (a ``pd`` stage) or E -> P -> D."""
    if "pd" in hosting and hosting.keys() & {"prefill", "decode"}:
        return [
            "'epd' routes a request either to one engine ('pd', E+PD) or to 'prefill' then "
            "'decode' (E/P/D), not both: host 'pd' or 'prefill' + 'decode'"
        ]
    needed = ("encode", "pd") if "pd" in hosting else ("encode", "prefill", "decode")
    return [f"'epd' needs stage {s!r}, which no server hosts" for s in needed if s not in hosting]


LocalLayout = Literal["E+PD", "E/P/D"]

_LOCAL_STAGE_SERVERS: dict[LocalLayout, dict[str, list[StageName]]] = {
    "E+PD": {"llm": ["pd"]},
    "E/P/D": {"prefill": ["prefill"], "decode": ["decode"]},
}


def default_topology(model: Path, layout: LocalLayout = "E+PD", baseline: bool = True) -> Topology:
    """The embedded CPU default: the encoder, the LLM stage(s) and the front (entry points
    only), each a local server. ``E+PD`` (the default) runs one engine that prefills and
    decodes; ``E/P/D`` separate prefill and decode engines (``topologies/e-p-d-local.yaml``).
    ``baseline``: the front also hosts ``aggregated`` (one engine, pixels in) to compare
    against, which loads the model a second time.

    The front keeps Triton's default ports 8000/8001/8002 so stock clients just work, and
    serves the OpenAI API on 9000 (as Triton's own OpenAI frontend does).
    """
    servers = {
        "encoder": ServerSpec(http_port=8100, grpc_port=8101, metrics_port=8102, stages=["encode"])
    }
    for i, (name, stages) in enumerate(_LOCAL_STAGE_SERVERS[layout].items()):
        base = 8200 + 100 * i
        servers[name] = ServerSpec(
            http_port=base, grpc_port=base + 1, metrics_port=base + 2, stages=stages
        )
    servers["front"] = ServerSpec(
        http_port=8000,
        grpc_port=8001,
        metrics_port=8002,
        openai_port=9000,
        stages=["epd", "aggregated"] if baseline else ["epd"],
    )
    return Topology(model=model, servers=servers)
