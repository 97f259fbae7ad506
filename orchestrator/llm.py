"""vLLM hosted inside a Triton python model: one class for every role.

The roles differ only by configuration (KV role, whether images arrive as pixels, as
pulled embeddings, or as grid-only metadata), so they share this one engine host:
``prefill`` and ``decode`` (E/P/D, KV moved between them), ``pd`` (E+PD: embeddings in,
prefill and decode in one engine) and ``aggregated`` (pixels in).
"""

from __future__ import annotations

import asyncio
import contextlib
import json
import os
import uuid
from collections.abc import AsyncIterator
from pathlib import Path
from typing import TYPE_CHECKING, Any, Literal

from orchestrator.config import Topology, cpu_list
from orchestrator.ports import free_ports
from orchestrator.protocol import InvalidRequest, SamplingOptions, Unavailable

if TYPE_CHECKING:
    from orchestrator.triton.runner import ModelContext

LLMRole = Literal["prefill", "decode", "pd", "aggregated"]


def engine_args(topology: Topology, server: str, role: LLMRole) -> dict[str, Any]:
    """``AsyncEngineArgs`` keywords for ``role`` on ``server``: shared settings, the server's
    overrides, then what the role needs."""
    llm = topology.llm
    args: dict[str, Any] = {
        **llm.engine_args,
        **topology.servers[server].engine_args,
        "model": str(topology.model),
        "limit_mm_per_prompt": {"image": topology.limits.max_images_per_request, "video": 0},
    }
    if "max_model_len" not in args:  # explicit, so the front's budget check knows it
        args["max_model_len"] = model_context(topology.model)
    if role in ("prefill", "pd") or (role == "decode" and topology.local_prefill):
        args["enable_mm_embeds"] = True
    if role in ("prefill", "decode"):
        args["kv_transfer_config"] = {
            "kv_connector": "NixlConnector",
            "kv_role": "kv_producer" if role == "prefill" else "kv_consumer",
            "kv_buffer_device": llm.kv_buffer_device,
        }
        if not llm.nixl_progress_thread:
            args["kv_transfer_config"]["kv_connector_module_path"] = "orchestrator.kv_connector"
    return args


def model_context(model: Path) -> int:
    """The text model's ``max_position_embeddings`` (vLLM's default ``max_model_len``)."""
    from orchestrator.model.checkpoint import Checkpoint

    return int(Checkpoint.open(model).text_config["max_position_embeddings"])


def engine_env(topology: Topology, server: str, role: LLMRole) -> dict[str, str]:
    """Process environment the engine reads at start (set before vLLM is imported)."""
    env = {
        "VLLM_CPU_KVCACHE_SPACE": str(topology.llm.kv_space_gib),
        "VLLM_ENABLE_V1_MULTIPROCESSING": "0",
        # A CPU engine shares its cores with the encoder and the Python serving path.
        # OpenMP's default spin-wait after each parallel region kept a second core busy
        # doing nothing (0.35 cores per engine, measured with the tiny model at 25 req/s);
        # idle workers now sleep. A value set by the operator wins (dedicated cores).
        "OMP_WAIT_POLICY": os.environ.get("OMP_WAIT_POLICY", "PASSIVE"),
        "OMP_NUM_THREADS": os.environ.get("OMP_NUM_THREADS") or str(default_engine_threads()),
        "VLLM_CPU_OMP_THREADS_BIND": os.environ.get("VLLM_CPU_OMP_THREADS_BIND") or "auto",
        "HF_HUB_OFFLINE": "1",
        "TRANSFORMERS_OFFLINE": "1",
    }
    if role in ("prefill", "decode"):
        # vLLM binds its side channel here and advertises the same address in
        # kv_transfer_params; PrefillHandler puts the server's public ``host`` there instead.
        bind = topology.servers[server].bind_address
        env["VLLM_NIXL_SIDE_CHANNEL_HOST"] = bind
        env["VLLM_NIXL_SIDE_CHANNEL_PORT"] = str(free_ports(1, bind)[0])
    return env


def default_engine_threads() -> int:
    """OpenMP threads of a CPU engine's steps: one per CPU it is bound to (every CPU this
    process may use but one, kept for the serving processes, unless the operator binds it
    otherwise) -- what ``vllm serve`` gives its CPU worker. We run the engine in-process
    (``VLLM_ENABLE_V1_MULTIPROCESSING=0``), where vLLM neither binds nor can cut torch's
    threads (its CPU worker disables ``torch.set_num_threads``), so the steps ran on every
    core and each waited for the core the serving path held: on 2 cores, one thread served
    the tiny model 18-34% faster (docs/benchmarks.md)."""
    cpus = engine_cpus(os.environ.get("VLLM_CPU_OMP_THREADS_BIND") or "auto")
    return len(cpus) if cpus else max(1, len(os.sched_getaffinity(0)) - 1)


def engine_cpus(bind: str) -> set[int] | None:
    """CPUs a CPU engine's core process runs on, from vLLM's own ``VLLM_CPU_OMP_THREADS_BIND``
    (which vLLM applies only to the workers of its multiprocess executor, not to the
    in-process engine we run): ``auto`` is every CPU this process may use but the last, kept
    for the serving processes (``vllm serve``'s choice on one NUMA node; one usable CPU is
    used as it is); ``nobind`` leaves the engine wherever the kernel puts it; a list such as
    ``0-3,8`` names the CPUs. ``None``: no binding."""
    if bind == "nobind":
        return None
    usable = sorted(os.sched_getaffinity(0))
    if bind == "auto":
        return set(usable[:-1] or usable)
    cpus = cpu_list(bind)  # the topology checked its syntax; what this host has, here
    if not cpus <= set(usable):
        raise ValueError(
            f"VLLM_CPU_OMP_THREADS_BIND={bind!r}: CPUs {sorted(cpus - set(usable))} are not "
            f"among those this server may use ({usable})"
        )
    return cpus


@contextlib.contextmanager
def processes_started_on(cpus: set[int] | None):
    """Processes started in the block run on ``cpus``; this process keeps its CPUs. A child
    inherits the CPUs of the thread that starts it, which is how vLLM's engine core process
    (its scheduler and the forward passes; the one process of an in-process engine) gets
    bound without reaching into vLLM. Binding it gave the tiny model on 2 cores 15-25% more
    requests/s under load: its steps and its socket threads stay on one core while the
    serving path's processes share the other (docs/benchmarks.md)."""
    if cpus is None:
        yield
        return
    own = os.sched_getaffinity(0)
    threads = set(os.listdir("/proc/self/task"))
    os.sched_setaffinity(0, cpus)
    try:
        yield
    finally:
        os.sched_setaffinity(0, own)
        for tid in set(os.listdir("/proc/self/task")) - threads:  # threads started meanwhile
            with contextlib.suppress(ProcessLookupError):
                os.sched_setaffinity(int(tid), own)


def to_vllm_sampling(opts: SamplingOptions, **overrides: Any):
    """vLLM's ``SamplingParams`` for the options (streamed as deltas); a combination vLLM
    refuses is ``InvalidRequest`` with its message."""
    from vllm import SamplingParams
    from vllm.exceptions import VLLMClientError
    from vllm.sampling_params import RequestOutputKind, StructuredOutputsParams

    kwargs: dict[str, Any] = {**opts.vllm_kwargs(), "output_kind": RequestOutputKind.DELTA}
    kwargs.update(overrides)
    try:
        if kwargs.get("structured_outputs") is not None:
            kwargs["structured_outputs"] = StructuredOutputsParams(**kwargs["structured_outputs"])
        return SamplingParams(**kwargs)
    except (ValueError, VLLMClientError) as exc:
        raise InvalidRequest(f"invalid sampling_parameters: {exc}") from None


def _recorder(engine: LLMEngine):
    """A vLLM stat-logger factory (its public plugin seam) that keeps the latest scheduler
    stats of ``engine``'s core: running and waiting requests, KV cache usage."""
    from vllm.v1.metrics.loggers import StatLoggerBase

    class SchedulerStatsRecorder(StatLoggerBase):
        def __init__(self, vllm_config: Any, engine_index: int = 0) -> None:
            pass

        def record(self, scheduler_stats, iteration_stats, mm_cache_stats=None, engine_idx=0):
            if scheduler_stats is not None:
                engine.scheduler_stats = scheduler_stats

        def log_engine_initialized(self) -> None:
            pass

    return SchedulerStatsRecorder


def _has_pixels(prompt: dict[str, Any]) -> bool:
    """Whether a vLLM prompt's images are pictures (``aggregated``) rather than embeddings."""
    from PIL import Image

    images = prompt.get("multi_modal_data", {}).get("image")
    return isinstance(images, list) and any(isinstance(i, Image.Image) for i in images)


class LLMEngine:
    """An ``AsyncLLM`` for one role; must be created and used on one asyncio loop."""

    def __init__(self, args: dict[str, Any], env: dict[str, str]) -> None:
        os.environ.update(env)
        from vllm import AsyncEngineArgs
        from vllm.v1.engine.async_llm import AsyncLLM

        self.scheduler_stats: Any = None
        """The engine core's latest ``SchedulerStats`` (sent with each step's outputs)."""
        self.admitted = 0
        """Requests vLLM has taken in so far."""
        from vllm.platforms import current_platform

        on_cpu = current_platform.is_cpu()  # on a GPU box neither vLLM nor we bind the core
        cpus = engine_cpus(env.get("VLLM_CPU_OMP_THREADS_BIND", "nobind")) if on_cpu else None
        with processes_started_on(cpus):
            self.engine = AsyncLLM.from_engine_args(
                AsyncEngineArgs(**args), stat_loggers=[_recorder(self)]
            )

    def unfinished_requests(self) -> int:
        """Requests this engine has not finished or aborted (vLLM's output processor)."""
        return self.engine.output_processor.get_num_unfinished_requests()

    @classmethod
    def for_model(cls, ctx: ModelContext, role: LLMRole) -> LLMEngine:
        """The engine of a Triton model: args from its ``1/model.json`` (as in Triton's
        vllm_backend; ``epd render`` writes it from the topology), env from the topology."""
        args = json.loads((ctx.version_dir / "model.json").read_text())
        return cls(args, engine_env(ctx.topology, ctx.server, role))

    async def generate(
        self, prompt: dict[str, Any], sampling, request_id: str | None = None
    ) -> AsyncIterator[Any]:
        """Yield vLLM ``RequestOutput`` deltas for a vLLM prompt dict (token ids as the front
        tokenized them, ``multi_modal_data``, ``multi_modal_uuids``, ``cache_salt``); vLLM's
        input errors become ``InvalidRequest``."""
        from vllm.exceptions import VLLMClientError

        rid = request_id or uuid.uuid4().hex
        # vLLM's own generate() aborts only what it has admitted: a request cancelled while
        # vLLM still processed its input is dropped unseen, and a decode engine's request
        # then never tells prefill to free the KV it holds for it (vLLM's 30 s KV lease
        # frees it instead). So admission, through the same public add_request(), runs to
        # its end, and whatever ends the stream early aborts the request, which vLLM's
        # connector turns into prefill's release.
        admission = asyncio.ensure_future(self._admit(rid, prompt, sampling))
        try:
            outputs = await asyncio.shield(admission)
        except asyncio.CancelledError:
            with contextlib.suppress(Exception):
                await admission
                await self.engine.abort(rid)
            raise
        except (ValueError, VLLMClientError) as exc:  # vLLM's input checks (length, limits)
            raise InvalidRequest(str(exc)) from None
        self.admitted += 1
        finished = False
        try:
            while not finished:
                out = outputs.get_nowait() or await outputs.get()
                finished = out.finished
                yield out
        except (ValueError, VLLMClientError) as exc:
            raise InvalidRequest(str(exc)) from None
        finally:
            if not finished:
                with contextlib.suppress(Exception):  # a dead engine has nothing to abort
                    await self.engine.abort(rid)

    async def _admit(self, rid: str, prompt: dict[str, Any], sampling) -> Any:
        """Render the prompt into vLLM's engine input, then add the request (a raw prompt
        dict is deprecated in ``add_request``, which renders it on vLLM's thread pool).

        Token ids, and images given as embeddings, only need their placeholders expanded:
        pure Python that holds the GIL anyway, so it is rendered on this loop. Through the
        pool it took two thread hops, each up to the interpreter's 5 ms switch interval on
        a busy loop (admission p90, ``docs/benchmarks.md``: text 5.3 -> 1.2 ms, photos
        10.3 -> 6.0 ms). Pixels go through the image processor, which is real work: on
        vLLM's multimodal thread, as ``vllm serve`` runs it."""
        renderer = self.engine.renderer
        if _has_pixels(prompt):
            (engine_input,) = await renderer.render_cmpl_async([prompt])
        else:
            (engine_input,) = renderer.render_cmpl([prompt])
        return await self.engine.add_request(rid, engine_input, sampling)

    async def check_health(self) -> None:
        """``Unavailable`` when the engine core is dead (vLLM's own health check)."""
        try:
            await self.engine.check_health()
        except Exception as exc:  # noqa: BLE001 - EngineDeadError and kin
            why = str(exc) or type(exc).__name__
            raise Unavailable(f"vLLM engine is not healthy: {why}") from None

    async def reject_kv_transfer(self, request_id: str, kv_transfer_params: dict) -> None:
        """Free the remote KV that ``kv_transfer_params`` point at without pulling it (vLLM
        submits a pre-aborted request whose connector hook notifies the producer)."""
        await self.engine.notify_kv_transfer_request_rejected(request_id, kv_transfer_params)

    def shutdown(self) -> None:
        """Stop the EngineCore now, on the engine's loop; dropping the reference keeps
        ``AsyncLLM.__del__`` from shutting down again during interpreter teardown."""
        self.engine.shutdown()
        del self.engine
