"""What the planner is asked to serve (a workload) and how well (an SLO).

Both are read from YAML or JSON and validated here, so a bad file is refused with the
field and what to change before any profile is read or any simulation runs.
"""

from __future__ import annotations

import re
from pathlib import Path
from typing import Literal

import yaml
from pydantic import (
    BaseModel,
    ConfigDict,
    Field,
    PositiveInt,
    ValidationError,
    field_validator,
    model_validator,
)

from orchestrator.config import describe

_RESOLUTION = re.compile(r"^(\d+)x(\d+)$")


class PlanInputError(ValueError):
    """A workload, SLO or profile the planner cannot use; the message says what to fix."""


class _Spec(BaseModel):
    model_config = ConfigDict(extra="forbid", frozen=True)


class Workload(_Spec):
    """An open-loop request stream (Poisson arrivals) and the shape of its requests."""

    rate_rps: float = Field(gt=0)
    """Requests per second arriving at the fleet."""
    image_share: float = Field(default=0.5, ge=0, le=1)
    """Share of requests that carry images (the rest are text only)."""
    images_per_request: int = Field(default=1, ge=1, le=64)
    """Images in a request that has images."""
    resolutions: dict[str, float] = Field(default_factory=lambda: {"448x448": 1.0})
    """Image sizes ``WIDTHxHEIGHT`` and their relative weights."""
    prompt_tokens: int = Field(default=64, ge=1)
    """Text tokens of a prompt (chat template included); image tokens come on top."""
    output_tokens: int = Field(default=16, ge=1)
    """Tokens generated per request (the mean, when ``output_distribution`` is geometric)."""
    output_distribution: Literal["fixed", "geometric"] = "fixed"
    """Output lengths: all ``output_tokens``, or geometric with that mean."""
    image_pool: int = Field(default=0, ge=0)
    """0: every image is distinct (no cache hits). N: images are drawn uniformly from N
    distinct ones, so they repeat and the encoder cache answers some."""
    duration_s: float = Field(default=300, gt=0)
    """Simulated seconds of arrivals."""
    warmup_s: float = Field(default=30, ge=0)
    """Arrivals in the first seconds are served but not measured."""
    seed: int = 0
    """Seed of the simulation's random streams (same seed, same answer)."""

    @field_validator("resolutions")
    @classmethod
    def _resolutions(cls, value: dict[str, float]) -> dict[str, float]:
        if not value:
            raise ValueError("give at least one resolution, e.g. {'448x448': 1}")
        for name, weight in value.items():
            match = _RESOLUTION.match(name)
            if not match or int(match[1]) <= 0 or int(match[2]) <= 0:
                raise ValueError(f"resolution {name!r} is not WIDTHxHEIGHT, e.g. '448x448'")
            if not weight > 0:
                raise ValueError(f"resolution {name!r} has weight {weight}; weights must be > 0")
        return value

    @model_validator(mode="after")
    def _warmup(self) -> Workload:
        if self.warmup_s >= self.duration_s:
            raise ValueError(
                f"warmup_s ({self.warmup_s}) must be shorter than duration_s ({self.duration_s})"
            )
        return self

    def sizes(self) -> list[tuple[int, int, float]]:
        """(width, height, probability) per resolution."""
        total = sum(self.resolutions.values())
        out = []
        for name, weight in self.resolutions.items():
            width, height = (int(v) for v in name.split("x"))
            out.append((width, height, weight / total))
        return out


class Slo(_Spec):
    """Latency targets the fleet must meet, as 90th percentiles."""

    ttft_p90_s: float = Field(gt=0)
    """Time to first token, from arrival at the front to the first token at the client."""
    tpot_p90_s: float = Field(gt=0)
    """Time per output token after the first (requests with one output token have none)."""


def load(path: Path, kind: type[_Spec]) -> _Spec:
    """Read a YAML/JSON file (or a YAML string) as ``kind``; errors name the field."""
    try:
        text = path.read_text()
    except OSError as exc:
        raise PlanInputError(f"cannot read {path}: {exc.strerror}") from None
    return parse(text, kind, str(path))


class TracedRequest(_Spec):
    """One line of a recorded trace (JSON Lines)."""

    t: float = Field(ge=0)
    """Arrival, seconds from any fixed origin."""
    images: list[tuple[PositiveInt, PositiveInt]] = Field(default_factory=list)
    """``[width, height]`` of each image."""
    image_ids: list[str] | None = None
    """Content ids of the images (any stable hash): repeats tell the encoder cache's share."""
    prompt_tokens: int = Field(ge=1)
    """Text tokens of the prompt (image tokens come on top)."""
    output_tokens: int = Field(ge=1)

    @model_validator(mode="after")
    def _ids(self) -> TracedRequest:
        if self.image_ids is not None and len(self.image_ids) != len(self.images):
            raise ValueError(
                f"{len(self.image_ids)} image_ids for {len(self.images)} images: one id each"
            )
        return self


def workload_of_trace(path: Path) -> Workload:
    """A recorded trace (one :class:`TracedRequest` per line) summarised as a workload:
    its mean rate (Poisson arrivals), its share of image requests and their mean image
    count, its resolution mix, its mean prompt and output lengths (outputs geometric
    unless all equal) and, from ``image_ids``, how many distinct images it repeats. The
    simulation draws requests like these; it does not replay the trace request by request."""
    try:
        lines = path.read_text().splitlines()
    except OSError as exc:
        raise PlanInputError(f"cannot read {path}: {exc.strerror}") from None
    requests = []
    for number, line in enumerate(lines, 1):
        if not line.strip():
            continue
        try:
            requests.append(TracedRequest.model_validate_json(line))
        except ValidationError as exc:
            raise PlanInputError(
                f"{path}:{number}: not a traced request: {describe(exc)}"
            ) from None
    if len(requests) < 2:
        raise PlanInputError(f"{path}: a trace needs at least two requests")
    times = sorted(r.t for r in requests)
    span = times[-1] - times[0]
    if span <= 0:
        raise PlanInputError(f"{path}: every request arrives at the same time; no rate to take")
    with_images = [r for r in requests if r.images]
    sizes: dict[str, float] = {}
    for r in with_images:
        for width, height in r.images:
            sizes[f"{width}x{height}"] = sizes.get(f"{width}x{height}", 0) + 1
    ids = [i for r in requests for i in (r.image_ids or [])]
    outputs = [r.output_tokens for r in requests]
    duration = max(span, 60.0)
    return Workload(
        rate_rps=(len(requests) - 1) / span,
        image_share=len(with_images) / len(requests),
        images_per_request=max(1, round(sum(len(r.images) for r in with_images) / len(with_images)))
        if with_images
        else 1,
        resolutions=sizes or {"448x448": 1.0},
        prompt_tokens=round(sum(r.prompt_tokens for r in requests) / len(requests)),
        output_tokens=max(1, round(sum(outputs) / len(outputs))),
        output_distribution="fixed" if len(set(outputs)) == 1 else "geometric",
        image_pool=len(set(ids)) if len(set(ids)) < len(ids) else 0,
        duration_s=duration,
        warmup_s=duration / 10,
    )


def parse(text: str, kind: type[_Spec], where: str) -> _Spec:
    try:
        data = yaml.safe_load(text)
    except yaml.YAMLError as exc:
        raise PlanInputError(f"{where} is not valid YAML/JSON: {exc}") from None
    if not isinstance(data, dict):
        raise PlanInputError(f"{where}: expected a mapping of {kind.__name__} fields")
    try:
        return kind.model_validate(data)
    except ValidationError as exc:
        raise PlanInputError(f"{where}: invalid {kind.__name__}: {describe(exc)}") from None
