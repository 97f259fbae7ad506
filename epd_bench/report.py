"""``epd bench report``: the benchmark JSON files as Markdown tables, PNG plots and the
issue's targets (measured ratio, target, met or by how much missed).

Inputs are what the benchmark commands write: ``BenchReport`` files (``epd bench run``,
``ab``, ``perf-analyzer``) plus the ``cache`` and ``transfer`` reports when given.
"""

from __future__ import annotations

import json
from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from epd_bench.schema import BenchReport, RunResult

EPD_TARGETS = ("epd", "e-p-d/nixl")
"""Names the E/P/D-over-NIXL deployment goes by (``bench run`` vs ``bench ab``)."""


@dataclass(frozen=True)
class Target:
    name: str
    measured: float | None
    goal: str
    met: bool | None
    detail: str


def _ms(value: float | None) -> str:
    return "–" if value is None else f"{value * 1e3:.0f}"


def _num(value: float | None, spec: str = ".2f") -> str:
    return "–" if value is None else format(value, spec)


def runs_table(runs: Sequence[RunResult]) -> str:
    lines = [
        "| model | workload | target | load | TTFT p50 / p90 / p99 ms | latency p50 / p90 ms "
        "| ITL p50 ms | req/s | tok/s | errors |",
        "|---|---|---|---|---|---|---|---|---|---|",
    ]
    for r in runs:
        lines.append(
            f"| {r.model or '–'} | {r.workload} | {r.target} | {r.load}={r.level:g} | "
            f"{_ms(r.ttft_s.p50)} / {_ms(r.ttft_s.p90)} / {_ms(r.ttft_s.p99)} | "
            f"{_ms(r.latency_s.p50)} / {_ms(r.latency_s.p90)} | {_ms(r.itl_s.p50)} | "
            f"{_num(r.requests_per_s)} | {_num(r.tokens_per_s, '.1f')} | {r.errors}/{r.requests} |"
        )
    return "\n".join(lines)


def _find(runs: Sequence[RunResult], targets: Sequence[str], workload: str) -> list[RunResult]:
    """Our own load generator's runs only: perf_analyzer's are tabled, not compared."""
    return [
        r for r in runs if r.target in targets and r.workload == workload and r.tool == "epd-bench"
    ]


def _pairs(runs, a_targets, b_targets, workload):
    """(a, b) runs of one workload and model at the same load point."""
    b_runs = {(r.model, r.load, r.level): r for r in _find(runs, b_targets, workload)}
    return [
        (a, b_runs[(a.model, a.load, a.level)])
        for a in _find(runs, a_targets, workload)
        if (a.model, a.load, a.level) in b_runs
    ]


def _point(run: RunResult) -> str:
    """Where a ratio was taken: the load point, and the model when known."""
    return f"{run.load}={run.level:g}" + (f", {run.model} model" if run.model else "")


def _ratio(a: float | None, b: float | None) -> float | None:
    return a / b if a is not None and b else None


def targets(
    runs: Sequence[RunResult], cache: dict | None = None, transfer: dict | None = None
) -> list[Target]:
    """Each target of the benchmark issue that the data can answer, at its hardest point."""
    found: list[Target] = []

    pairs = _pairs(runs, EPD_TARGETS, ("aggregated",), "mixed")
    ratios = [
        (_ratio(a.ttft_by_kind_s["text"].p90, b.ttft_by_kind_s["text"].p90), a)
        for a, b in pairs
        if "text" in a.ttft_by_kind_s and "text" in b.ttft_by_kind_s
    ]
    for value, run in ratios:  # one row per load point: interference grows with load
        if value is not None:
            found.append(
                Target(
                    "text-only p90 TTFT under the mixed workload, EPD / aggregated",
                    value,
                    "≤ 0.5",
                    value <= 0.5,
                    _point(run),
                )
            )

    for workload in ("large", "multi", "image"):
        pairs = _pairs(runs, ("e-p-d/nixl",), ("e-p-d/inline",), workload)
        values = [(_ratio(a.requests_per_s, b.requests_per_s), a) for a, b in pairs]
        values = [(v, a) for v, a in values if v is not None]
        if values:
            worst, run = min(values, key=lambda x: x[0])
            found.append(
                Target(
                    f"throughput, NIXL metadata-only / inline embeddings ({workload} workload)",
                    worst,
                    "≥ 1.2",
                    worst >= 1.2,
                    f"worst over load points ({_point(run)})",
                )
            )
            break

    for workload in ("image", "mixed", "text", "multi"):
        pairs = _pairs(runs, EPD_TARGETS, ("offline-vllm",), workload)
        if not pairs:
            continue
        worst, run = min(
            ((_ratio(a.requests_per_s, b.requests_per_s), a) for a, b in pairs),
            key=lambda x: x[0] or 0,
        )
        if worst is not None:
            found.append(
                Target(
                    f"throughput, epd / offline vLLM ({workload} workload)",
                    worst,
                    "≥ 0.8",
                    worst >= 0.8,
                    f"worst over load points ({_point(run)})",
                )
            )
        single = [(a, b) for a, b in pairs if a.load == "concurrency" and a.level == 1]
        if single and (value := _ratio(single[0][0].ttft_s.p50, single[0][1].ttft_s.p50)):
            found.append(
                Target(
                    f"TTFT p50 at concurrency 1, epd / offline vLLM ({workload} workload)",
                    value,
                    "≤ 1.15",
                    value <= 1.15,
                    _point(single[0][0]),
                )
            )
        break

    if transfer:
        nixl = {
            r["bytes"]: r["ratio_to_memcpy"]
            for r in transfer.get("rows", [])
            if r.get("kind") == "nixl" and r.get("ratio_to_memcpy") is not None
        }
        if (value := nixl.get(16 << 20)) is not None:
            largest = max(nixl)
            found.append(
                Target(
                    "NIXL pull bandwidth / same-host memcpy at 16 MiB",
                    value,
                    "≥ 0.7",
                    value >= 0.7,
                    f"{largest >> 20} MiB: {nixl[largest]:.2f}" if largest > 16 << 20 else "",
                )
            )

    if cache and cache.get("hit_over_miss", {}).get("p50") is not None:
        value = cache["hit_over_miss"]["p50"]
        found.append(
            Target(
                "repeated images: TTFT p50 on hits / misses",
                value,
                "≤ 0.5",
                value <= 0.5,
                f"{cache['encoder_passes']} encoder passes, {cache['image_requests']} images",
            )
        )
    return found


def targets_table(found: Sequence[Target]) -> str:
    lines = ["| target | measured | goal | met | note |", "|---|---|---|---|---|"]
    for t in found:
        verdict = "yes" if t.met else "**no**"
        lines.append(f"| {t.name} | {_num(t.measured)} | {t.goal} | {verdict} | {t.detail} |")
    return "\n".join(lines)


# --- plots --------------------------------------------------------------------------------


def plot_all(runs: Sequence[RunResult], img_dir: Path) -> list[Path]:
    """Latency CDFs, throughput vs concurrency and the TTFT breakdown; the files written."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    img_dir.mkdir(parents=True, exist_ok=True)
    runs = [r for r in runs if r.tool == "epd-bench"]  # perf_analyzer's are tabled only
    written = []
    workloads = sorted({r.workload for r in runs})
    for workload in workloads:
        group = [r for r in runs if r.workload == workload and r.ttft_samples_s]
        if not group:
            continue
        fig, ax = plt.subplots(figsize=(6, 4))
        ax.set_prop_cycle(color=plt.cm.tab20.colors)  # one colour per target x level
        for r in group:
            xs = sorted(r.ttft_samples_s)
            ys = [(i + 1) / len(xs) for i in range(len(xs))]
            ax.step(
                [x * 1e3 for x in xs], ys, where="post", label=f"{r.target} {r.load}={r.level:g}"
            )
        ax.set(xlabel="TTFT (ms)", ylabel="fraction of requests", title=f"TTFT CDF: {workload}")
        ax.legend(fontsize=7)
        ax.grid(alpha=0.3)
        written.append(_save(fig, img_dir / f"ttft-cdf-{workload}.png"))

        closed = [r for r in runs if r.workload == workload and r.load == "concurrency"]
        if len({r.level for r in closed}) > 1:
            fig, ax = plt.subplots(figsize=(6, 4))
            ax.set_prop_cycle(color=plt.cm.tab20.colors)
            for target in sorted({r.target for r in closed}):
                points = sorted(
                    (r.level, r.requests_per_s or 0) for r in closed if r.target == target
                )
                ax.plot(*zip(*points, strict=True), marker="o", label=target)
            ax.set(xlabel="concurrency", ylabel="requests/s", title=f"Throughput: {workload}")
            ax.legend(fontsize=7)
            ax.grid(alpha=0.3)
            written.append(_save(fig, img_dir / f"throughput-{workload}.png"))

    phased = [r for r in runs if r.phase_means_s]
    if phased:
        fig, ax = plt.subplots(figsize=(7, 1.8 + 0.4 * len(phased)))
        labels = [f"{r.workload} {r.target} {r.load}={r.level:g}" for r in phased]
        left = [0.0] * len(phased)
        # Phases are nested from request start: encode, then prefill, then decode's first token.
        steps = [
            ("encode", lambda r: r.phase_means_s.get("encode", 0.0)),
            ("prefill", lambda r: r.phase_means_s.get("prefill", 0.0)),
            (
                "decode to first token",
                lambda r: max(
                    0.0,
                    r.phase_means_s.get("first_token", 0.0)
                    - r.phase_means_s.get("encode", 0.0)
                    - r.phase_means_s.get("prefill", 0.0),
                ),
            ),
        ]
        for name, width in steps:
            widths = [width(r) * 1e3 for r in phased]
            ax.barh(labels, widths, left=left, label=name)
            left = [a + b for a, b in zip(left, widths, strict=True)]
        ax.set(xlabel="mean ms from arrival", title="epd TTFT by phase")
        ax.legend(fontsize=7)
        written.append(_save(fig, img_dir / "ttft-phases.png"))
    return written


def _save(fig: Any, path: Path) -> Path:
    fig.savefig(path, dpi=110, bbox_inches="tight")
    import matplotlib.pyplot as plt

    plt.close(fig)
    return path


# --- the document -------------------------------------------------------------------------


def render(
    reports: Sequence[BenchReport],
    out: Path,
    img_dir: Path,
    cache: dict | None = None,
    transfer: dict | None = None,
    analysis: str = "",
) -> str:
    """Write ``out`` (Markdown) and the plots; returns the Markdown. ``analysis`` is a
    person's reading of the numbers (why a target is missed), placed under the targets."""
    runs = [r for report in reports for r in report.runs]
    found = targets(runs, cache, transfer)
    images = plot_all(runs, img_dir)
    parts = ["# Benchmarks", "", "Produced by `epd bench report` from these runs:", ""]
    for report in reports:
        m = report.machine
        parts.append(
            f"- `{report.command}` — {report.timestamp}, {m.get('cpu_count')} CPUs, "
            f"{m.get('platform')}, versions {json.dumps(report.versions)}"
        )
        parts += [f"  - note: {n}" for n in report.notes]
    parts += [
        "",
        "## Targets",
        "",
        targets_table(found) if found else "No target could be computed from these runs.",
        "",
    ]
    if analysis:
        parts += [analysis.strip(), ""]
    parts += ["## Runs", "", runs_table(runs), ""]
    if cache:
        t = cache["ttft_s"]
        parts += [
            "## Encoder cache (`epd bench cache`)",
            "",
            f"TTFT p50 hits {_ms(t['hit']['p50'])} ms vs misses {_ms(t['miss']['p50'])} ms "
            f"(ratio {_num(cache['hit_over_miss']['p50'])}); {cache['encoder_passes']} encoder "
            f"passes for {cache['image_requests']} image requests.",
            "",
        ]
    if transfer:
        parts += [
            "## Embedding transfer (`epd bench transfer`)",
            "",
            "```",
            transfer.get("table", ""),
            "```",
            "",
        ]
    if images:
        parts += ["## Plots", ""]
        parts += [f"![{p.stem}]({p.relative_to(out.parent).as_posix()})" for p in images]
        parts.append("")
    text = "\n".join(parts)
    out.parent.mkdir(parents=True, exist_ok=True)
    out.write_text(text)
    return text


def load_reports(paths: Sequence[Path]) -> list[BenchReport]:
    return [BenchReport.model_validate_json(p.read_text()) for p in paths]
