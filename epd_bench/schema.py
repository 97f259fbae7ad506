"""The one result schema every benchmark writes (``epd bench run``, ``ab``, ``perf-analyzer``)
and ``epd bench report`` reads: one :class:`RunResult` per workload x target x load point.
"""

from __future__ import annotations

import os
import platform
from collections.abc import Sequence
from importlib import metadata
from typing import Literal

import numpy as np
from pydantic import BaseModel, ConfigDict, Field


class _Model(BaseModel):
    model_config = ConfigDict(extra="forbid", use_attribute_docstrings=True)


class LatencyStats(_Model):
    """Percentiles and mean in seconds; None where nothing was measured."""

    p50: float | None = None
    p90: float | None = None
    p99: float | None = None
    mean: float | None = None
    count: int = 0

    @classmethod
    def of(cls, values: Sequence[float]) -> LatencyStats:
        if not values:
            return cls()
        arr = np.asarray(values, dtype=np.float64)
        p50, p90, p99 = np.percentile(arr, [50, 90, 99])
        return cls(p50=p50, p90=p90, p99=p99, mean=float(arr.mean()), count=len(values))


class RunResult(_Model):
    """One measured run: one workload against one target at one load point."""

    tool: Literal["epd-bench", "perf_analyzer"]
    target: str
    """What was measured: a model (``epd``, ``aggregated``) or an A/B label (``e-p-d/nixl``)."""
    workload: str
    model: str = ""
    """The model directory's name (``tiny``, ``bench``, ``wide``) where the runner knows it."""
    load: Literal["concurrency", "rate"]
    """Closed loop (``level`` requests in flight) or open loop (``level`` requests/s)."""
    level: float
    requests: int
    errors: int
    duration_s: float
    ttft_s: LatencyStats
    """Time to first token (streaming); empty when the tool cannot see it."""
    itl_s: LatencyStats = Field(default_factory=LatencyStats)
    """Inter-token latency: gaps between a request's successive text responses."""
    latency_s: LatencyStats
    """End-to-end request latency."""
    requests_per_s: float | None
    tokens_per_s: float | None = None
    """Output tokens per second (text responses, one per token when streaming keeps up)."""
    ttft_by_kind_s: dict[str, LatencyStats] = Field(default_factory=dict)
    """TTFT per request kind (``text``, ``image``, ...) inside a mixed workload."""
    error_samples: list[str] = Field(default_factory=list)
    ttft_samples_s: list[float] = Field(default_factory=list)
    """Every successful request's TTFT, for CDF plots (empty for perf_analyzer)."""
    latency_samples_s: list[float] = Field(default_factory=list)
    phase_means_s: dict[str, float] = Field(default_factory=dict)
    """Mean seconds per ``epd`` request phase during the run, from the front's
    ``epd_request_phase_seconds`` metrics (empty for other targets)."""
    hops_s: dict[str, LatencyStats] = Field(default_factory=dict)
    """Duration of each hop of the measured ``epd`` requests, by span name, from the
    deployment's traces (``--traces``): ``call X`` is a stage call as the front saw it,
    ``X`` the same call inside the stage, the rest the work inside one."""


class BenchReport(_Model):
    """A whole benchmark invocation: where it ran and every run it made."""

    command: str
    timestamp: str
    machine: dict
    versions: dict
    runs: list[RunResult]
    notes: list[str] = Field(default_factory=list)


def machine_info(loadavg_before: tuple[float, float, float] | None = None) -> dict:
    """Where a benchmark ran, for its report: CPUs, platform, Python and the load around it
    (a busy box explains odd numbers)."""
    info = {
        "cpu_count": os.cpu_count(),
        "platform": platform.platform(),
        "python": platform.python_version(),
        "loadavg_after": os.getloadavg(),
    }
    if loadavg_before is not None:
        info["loadavg_before"] = loadavg_before
    return info


def package_version(module: str) -> str | None:
    dists = metadata.packages_distributions().get(module)
    return metadata.version(dists[0]) if dists else None
