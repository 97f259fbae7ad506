"""``epd bench perf-analyzer``: Triton's own load tool against ``epd`` / ``aggregated``.

A second opinion on ``epd bench run``: perf_analyzer (C++) generates the closed-loop load and
measures, so a client-side artefact of our asyncio load generator cannot hide in the numbers.
Its CSV gives throughput and end-to-end latency percentiles; its profile export (every
request's send and response times) gives TTFT and inter-token gaps over the same windows.
Results use the common :class:`~epd_bench.schema.RunResult` schema.

perf_analyzer comes from the ``tritonclient==2.51.0`` wheel (newer ones need glibc 2.38), in
a venv of its own, and needs ``libb64.so.0d`` and ``libcudart.so.12`` (see docs/platform.md).
"""

from __future__ import annotations

import argparse
import base64
import csv
import io
import itertools
import json
import os
import signal
import statistics
import struct
import subprocess
import sys
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field
from importlib import metadata
from pathlib import Path
from typing import TYPE_CHECKING

if TYPE_CHECKING:  # imported lazily: the CLI builds its parser without numpy or tritonclient
    from epd_bench.load import LoadRequest
    from epd_bench.schema import RunResult

TRITONCLIENT = "tritonclient==2.51.0"
DEFAULT_VENV = Path(".cache/perf-analyzer-venv")
DEFAULT_OUT = Path(".cache/bench/perf_analyzer.json")
LIBS = {"libb64.so.0d": "libb64*.so.0d*", "libcudart.so.12": "libcudart*.so.12*"}
"""Libraries perf_analyzer links against -> glob for a copy under any name (hashed or not)."""
STABILITY_WINDOWS = 3
"""perf_analyzer reports the merge of its last 3 measurement windows."""
DEBIAN_LIB_DIR = Path("/usr/lib/x86_64-linux-gnu")


class PerfAnalyzerError(Exception):
    """perf_analyzer cannot be installed, started, or its output is not what we parse."""


# --- installation ---------------------------------------------------------------------------


def ensure_perf_analyzer(venv_dir: Path = DEFAULT_VENV) -> Path:
    """The perf_analyzer binary, installing ``tritonclient==2.51.0`` into ``venv_dir`` first
    if needed. ``--no-deps``: the binary needs none of the Python client's dependencies, so
    only that one wheel has to be reachable."""
    binary = venv_dir / "bin" / "perf_analyzer"
    if binary.exists():
        return binary
    steps = (
        [sys.executable, "-m", "venv", str(venv_dir)],
        [str(venv_dir / "bin" / "python"), "-m", "pip", "install", "-q", "--no-deps", TRITONCLIENT],
    )
    for step in steps:
        done = subprocess.run(step, capture_output=True, text=True)
        if done.returncode != 0:
            raise PerfAnalyzerError(
                f"installing perf_analyzer failed: {' '.join(step)}\n{done.stderr[-2000:]}"
                f"perf_analyzer ships in the {TRITONCLIENT} wheel: a PyPI index or a local "
                "wheel folder (PIP_FIND_LINKS) must provide it"
            )
    if not binary.exists():
        raise PerfAnalyzerError(f"{TRITONCLIENT} installed, but {binary} is missing")
    return binary


def _library_dirs() -> list[Path]:
    """Where copies may be: nvidia-pytriton's bundled libs (the project venv has them), then
    Debian's ``libb64-0d`` and PyPI's ``nvidia-cuda-runtime-cu12``."""
    dirs = []
    for dist, folder in (
        ("nvidia-pytriton", "nvidia_pytriton.libs"),
        ("nvidia-cuda-runtime-cu12", "nvidia/cuda_runtime/lib"),
    ):
        try:
            dirs.append(Path(str(metadata.distribution(dist).locate_file(folder))))
        except metadata.PackageNotFoundError:
            pass
    return [*dirs, DEBIAN_LIB_DIR]


def perf_analyzer_env(venv_dir: Path = DEFAULT_VENV) -> dict[str, str]:
    """The environment to run perf_analyzer in: ``LD_LIBRARY_PATH`` starts with a folder of
    links under the names it asks for, to copies that may carry hashed names."""
    lib_dir = venv_dir / "lib" / "perf-analyzer-libs"
    lib_dir.mkdir(parents=True, exist_ok=True)
    searched = _library_dirs()
    for name, pattern in LIBS.items():
        found = sorted(p for d in searched for p in d.glob(pattern))
        if not found:
            raise PerfAnalyzerError(
                f"perf_analyzer needs {name}; none in {', '.join(map(str, searched))}. "
                "Install nvidia-pytriton (bundles both), or Debian libb64-0d and PyPI "
                "nvidia-cuda-runtime-cu12"
            )
        link = lib_dir / name
        tmp = lib_dir / f".{name}.tmp"
        tmp.unlink(missing_ok=True)
        tmp.symlink_to(found[0].resolve())
        tmp.replace(link)  # atomic: a concurrent run never sees the link missing
    env = dict(os.environ)
    env["LD_LIBRARY_PATH"] = os.pathsep.join(
        p for p in (str(lib_dir.resolve()), env.get("LD_LIBRARY_PATH")) if p
    )
    return env


# --- input data -----------------------------------------------------------------------------


def _bytes_tensor(items: Sequence[bytes]) -> dict:
    """A BYTES tensor as perf_analyzer's JSON takes raw bytes: base64 of the serialized tensor
    (each element a little-endian uint32 length, then its bytes) plus its shape."""
    serialized = b"".join(struct.pack("<I", len(item)) + item for item in items)
    return {"content": {"b64": base64.b64encode(serialized).decode()}, "shape": [len(items)]}


def input_data(requests: Sequence[LoadRequest], max_tokens: int, stream: bool) -> dict:
    """The ``--input-data`` JSON: one entry per request with the models' public inputs.

    perf_analyzer replays the entries in turn (each concurrent context its own share, so the
    mix it sends can drift from the list's), and more requests than entries repeat content,
    which may hit caches. Images go as the photos' own bytes, never re-encoded.
    """
    sampling = json.dumps({"max_tokens": max_tokens, "temperature": 0})
    data = []
    for request in requests:
        entry: dict = {
            "text_input": [request.text],
            "sampling_parameters": [sampling],
            "stream": [stream],
        }
        if request.images:
            entry["image"] = _bytes_tensor(request.images)
        data.append(entry)
    return {"data": data}


# --- parsing ----------------------------------------------------------------------------------


@dataclass
class Profile:
    """One concurrency level from the profile export, over the windows the CSV reports."""

    requests: int
    duration_s: float
    ttft_s: list[float] = field(default_factory=list)
    itl_s: list[float] = field(default_factory=list)
    latency_s: list[float] = field(default_factory=list)
    ttft_by_kind_s: dict[str, list[float]] = field(default_factory=dict)


def parse_profile_export(raw: bytes, kinds: Mapping[str, str]) -> dict[int, Profile]:
    """Per concurrency level: the requests perf_analyzer counted, with their response times.

    Mirrors perf_analyzer's own selection (requests that end inside its last three windows;
    the end is the last response that carries data), so counts match the CSV. A response
    whose ``text_output`` is empty is the empty final one. ``kinds`` maps ``text_input`` to
    the request's kind. The export echoes the inputs, raw image bytes included, as JSON
    strings: not valid UTF-8, hence the lenient decoding (only prompts are read back).
    """
    doc = json.loads(raw.decode("utf-8", errors="replace"))
    profiles = {}
    for experiment in doc["experiments"]:
        if experiment["experiment"]["mode"] != "concurrency":
            raise PerfAnalyzerError(f"unexpected experiment: {experiment['experiment']}")
        bounds = experiment["window_boundaries"]
        lo, hi = bounds[max(0, len(bounds) - 1 - STABILITY_WINDOWS)], bounds[-1]
        profile = Profile(requests=0, duration_s=(hi - lo) / 1e9)
        for request in experiment["requests"]:
            texts = [
                t
                for t, out in zip(
                    request["response_timestamps"], request["response_outputs"], strict=True
                )
                if out.get("text_output")
            ]
            if not texts or not lo <= texts[-1] <= hi:
                continue
            start = request["timestamp"]
            ttft = (texts[0] - start) / 1e9
            profile.requests += 1
            profile.latency_s.append((texts[-1] - start) / 1e9)
            profile.ttft_s.append(ttft)
            profile.itl_s.extend((b - a) / 1e9 for a, b in itertools.pairwise(texts))
            if kind := kinds.get(request["request_inputs"].get("text_input", "")):
                profile.ttft_by_kind_s.setdefault(kind, []).append(ttft)
        profiles[int(experiment["experiment"]["value"])] = profile
    return profiles


CSV_REQUIRED = ("Concurrency", "Inferences/Second", "p50 latency", "p90 latency", "p99 latency")


def parse_csv(
    text: str, model: str, workload: str, streaming: bool, profiles: Mapping[int, Profile]
) -> list[RunResult]:
    """perf_analyzer's ``-f`` CSV (one row per concurrency level) as results.

    From the CSV: requests/s, end-to-end latency percentiles (µs; for decoupled models
    perf_analyzer times a request to its last response, despite its banner "using the first
    response") and text responses/s. The CSV has no counts, mean or first-response times:
    those come from ``profiles`` (``parse_profile_export``), over the same requests. TTFT,
    ITL and tokens/s only mean something when the model streams tokens (``streaming``).
    """
    from epd_bench.schema import LatencyStats, RunResult

    rows = list(csv.DictReader(io.StringIO(text)))
    if not rows:
        raise PerfAnalyzerError("perf_analyzer CSV has no rows")
    if missing := [c for c in CSV_REQUIRED if c not in rows[0]]:
        raise PerfAnalyzerError(f"perf_analyzer CSV lacks columns {missing}: {list(rows[0])}")

    def seconds(row: dict, column: str) -> float:
        return float(row[column]) / 1e6

    results = []
    for row in rows:
        level = int(row["Concurrency"])
        if level not in profiles:
            raise PerfAnalyzerError(f"no profile export data for concurrency {level}")
        profile = profiles[level]

        def stats(values: Sequence[float]) -> LatencyStats:
            return LatencyStats.of(values) if streaming else LatencyStats()

        results.append(
            RunResult(
                tool="perf_analyzer",
                target=model,
                workload=workload,
                load="concurrency",
                level=level,
                requests=profile.requests,
                errors=0,  # perf_analyzer exits with an error instead of counting failures
                duration_s=profile.duration_s,
                ttft_s=stats(profile.ttft_s),
                itl_s=stats(profile.itl_s),
                latency_s=LatencyStats(
                    p50=seconds(row, "p50 latency"),
                    p90=seconds(row, "p90 latency"),
                    p99=seconds(row, "p99 latency"),
                    mean=statistics.fmean(profile.latency_s) if profile.latency_s else None,
                    count=profile.requests,
                ),
                requests_per_s=float(row["Inferences/Second"]),
                tokens_per_s=float(row["Response Throughput"])
                if streaming and row.get("Response Throughput")
                else None,
                ttft_by_kind_s={k: stats(v) for k, v in sorted(profile.ttft_by_kind_s.items())}
                if streaming
                else {},
            )
        )
    return results


# --- running ----------------------------------------------------------------------------------


@dataclass(frozen=True)
class Settings:
    """How perf_analyzer measures each level."""

    measurement_interval_ms: int = 5000
    stability_percentage: float = 50
    """perf_analyzer's default 10% never settles on a noisy 2-core box."""
    max_trials: int = 10


def command(
    binary: Path, url: str, model: str, data: Path, level: int, settings: Settings, stem: Path
) -> list[str]:
    """One level's command line, writing ``stem``.csv and ``stem``.json. Both models are
    decoupled, which perf_analyzer serves only over gRPC streaming (``--streaming``),
    whatever the ``stream`` input says."""
    return [
        str(binary),
        *("-i", "grpc", "-u", url, "-m", model, "--streaming"),
        *("--input-data", str(data), "--concurrency-range", str(level)),
        *("--measurement-interval", str(settings.measurement_interval_ms)),
        *("--stability-percentage", f"{settings.stability_percentage:g}"),
        *("--max-trials", str(settings.max_trials)),
        *("-f", str(stem.with_suffix(".csv"))),
        *("--profile-export-file", str(stem.with_suffix(".json"))),
    ]


def _failed(model: str, workload: str, level: int, error: str) -> RunResult:
    """A level perf_analyzer could not measure: kept in the report with the reason."""
    from epd_bench.schema import LatencyStats, RunResult

    return RunResult(
        tool="perf_analyzer",
        target=model,
        workload=workload,
        load="concurrency",
        level=level,
        requests=0,
        errors=0,
        duration_s=0.0,
        ttft_s=LatencyStats(),
        latency_s=LatencyStats(),
        requests_per_s=None,
        error_samples=[error],
    )


def run(
    url_grpc: str,
    model: str,
    concurrency_levels: Sequence[int],
    streaming: bool,
    pa_binary: Path,
    env: Mapping[str, str],
    workdir: Path,
    *,
    requests: Sequence[LoadRequest],
    workload: str,
    max_tokens: int,
    settings: Settings = Settings(),
) -> list[RunResult]:
    """One perf_analyzer process per level, so an unstable level costs only itself.

    ``workdir`` keeps the input JSON and each level's CSV and console output; the profile
    exports (every request's inputs, photos included) are deleted once parsed.
    """
    workdir.mkdir(parents=True, exist_ok=True)
    data = workdir / f"{workload}-input.json"
    data.write_text(json.dumps(input_data(requests, max_tokens, streaming)))
    kinds = {r.text: r.kind for r in requests}
    # Each window lasts 1.2 intervals, then in-flight requests drain. perf_analyzer has no
    # request timeout: a request the server never finishes would hang it forever.
    deadline_s = settings.max_trials * settings.measurement_interval_ms * 1.2 / 1000 + 120
    results = []
    for level in concurrency_levels:
        out = workdir / f"{model}-{workload}-c{level}"
        argv = command(pa_binary, url_grpc, model, data, level, settings, out)
        try:
            done = subprocess.run(
                argv, env=dict(env), capture_output=True, text=True, timeout=deadline_s
            )
        except subprocess.TimeoutExpired:
            results.append(_failed(model, workload, level, f"timed out after {deadline_s:.0f}s"))
            continue
        out.with_suffix(".log").write_text(done.stdout + done.stderr)
        export = out.with_suffix(".json")
        if done.returncode != 0 or not export.exists():
            lines = (done.stdout + done.stderr).strip().splitlines() or ["no output"]
            results.append(
                _failed(model, workload, level, f"perf_analyzer rc={done.returncode}: {lines[-1]}")
            )
            continue
        profiles = parse_profile_export(export.read_bytes(), kinds)
        export.unlink()
        csv_text = out.with_suffix(".csv").read_text()
        results.extend(parse_csv(csv_text, model, workload, streaming, profiles))
    return results


def concurrency_range(text: str) -> list[int]:
    """perf_analyzer's ``start[:end[:step]]`` as the list of levels."""
    try:
        parts = [int(p) for p in text.split(":")]
    except ValueError:
        parts = []
    if not 1 <= len(parts) <= 3 or min(parts) < 1:
        raise PerfAnalyzerError(f"concurrency must be start[:end[:step]] of positive ints: {text}")
    start = parts[0]
    end = parts[1] if len(parts) > 1 else start
    step = parts[2] if len(parts) > 2 else 1
    if end < start:
        raise PerfAnalyzerError(f"concurrency range ends before it starts: {text}")
    return list(range(start, end + 1, step))


def _topology(model_dir: Path):
    """The embedded default deployment, building the tiny model first if absent."""
    from orchestrator.config import default_topology

    if not (model_dir / "config.json").exists():
        from orchestrator.model.build import build_model

        print(f"building the tiny model into {model_dir} ...", flush=True)
        build_model(model_dir, profile="tiny")
    return default_topology(model_dir.resolve())


def run_cli(
    url: str | None,
    model: str,
    concurrency: str,
    streaming: bool,
    out: Path,
    timeout: float,
    *,
    workload: str = "mixed",
    requests: int = 24,
    max_tokens: int = 16,
    settings: Settings = Settings(),
    model_dir: Path = Path(".cache/models/tiny"),
    venv_dir: Path = DEFAULT_VENV,
) -> int:
    """Install perf_analyzer if needed, measure each level against ``url`` (or against the
    embedded deployment, started on free ports and stopped after), write a ``BenchReport``.

    Returns 0, or 2 when perf_analyzer could not be set up or a level failed.
    """
    import contextlib

    from epd_bench import load, quick

    try:
        levels = concurrency_range(concurrency)
        if workload not in load.WORKLOADS:
            raise PerfAnalyzerError(f"unknown workload {workload!r}; known: {list(load.WORKLOADS)}")
        binary = ensure_perf_analyzer(venv_dir)
        env = perf_analyzer_env(venv_dir)
    except PerfAnalyzerError as exc:
        print(f"epd bench perf-analyzer: {exc}", file=sys.stderr)
        return 2
    batch = load.WORKLOADS[workload](requests, 0)
    with contextlib.ExitStack() as stack:
        if url is None:
            print("starting the embedded deployment on free ports ...", flush=True)
            running = stack.enter_context(quick.embedded(_topology(model_dir), timeout))
            url = running.server_of("epd")[1].grpc_url
        results = run(
            url,
            model,
            levels,
            streaming,
            binary,
            env,
            out.parent / f"{out.stem}-files",
            requests=batch,
            workload=workload,
            max_tokens=max_tokens,
            settings=settings,
        )
    for result in results:
        print(load.summary_line(result), *result.error_samples, flush=True)
    example = command(binary, url, model, Path("INPUT.json"), levels[0], settings, Path("OUT"))
    notes = [
        f"perf_analyzer from {TRITONCLIENT}: {' '.join(example[1:])}",
        f"{len(batch)} distinct requests, replayed in turn by perf_analyzer",
        f"{'streaming' if streaming else 'non-streaming'} responses, max_tokens={max_tokens}",
    ]
    out.parent.mkdir(parents=True, exist_ok=True)
    out.write_text(load.report(" ".join(sys.argv), results, notes).model_dump_json(indent=1) + "\n")
    print(f"wrote {out}")
    return 2 if any(r.error_samples for r in results) else 0


def _interrupt(*_: object) -> None:
    raise KeyboardInterrupt


def cmd(args: argparse.Namespace) -> int:
    """``epd bench perf-analyzer``."""
    signal.signal(signal.SIGTERM, _interrupt)  # unwind through the deployment's finally
    return run_cli(
        args.url,
        args.target,
        args.concurrency,
        not args.no_stream,
        Path(args.out),
        args.timeout,
        workload=args.workload,
        requests=args.requests,
        max_tokens=args.max_tokens,
        settings=Settings(args.measurement_interval, args.stability_percentage, args.max_trials),
        model_dir=Path(args.model),
        venv_dir=Path(args.venv),
    )


def add_arguments(parser: argparse.ArgumentParser) -> None:
    """The flags of ``epd bench perf-analyzer``; sets ``func`` to :func:`cmd`."""
    parser.add_argument("--url", help="gRPC HOST:PORT of a running front (default: start one)")
    parser.add_argument("--target", default="epd", choices=["epd", "aggregated"])
    parser.add_argument("--model", default=".cache/models/tiny", help="model dir (built if absent)")
    parser.add_argument("--concurrency", default="1:4:1", help="levels as start[:end[:step]]")
    parser.add_argument("--workload", default="mixed", help="image|text|mixed|repeated|multi|large")
    parser.add_argument("--requests", type=int, default=24, help="distinct requests (replayed)")
    parser.add_argument("--max-tokens", type=int, default=16)
    parser.add_argument("--no-stream", action="store_true", help="one response per request")
    parser.add_argument("--measurement-interval", type=int, default=5000, help="ms per window")
    parser.add_argument("--stability-percentage", type=float, default=50)
    parser.add_argument("--max-trials", type=int, default=10, help="windows before giving up")
    parser.add_argument("--timeout", type=float, default=600, help="seconds to become ready")
    parser.add_argument("--venv", default=str(DEFAULT_VENV), help="perf_analyzer's own venv")
    parser.add_argument("--out", default=str(DEFAULT_OUT), help="JSON report path")
    parser.set_defaults(func=cmd)
