"""Per-stage profiles: what one replica of a stage costs on one kind of hardware.

One file per (stage, hardware, model), written by ``epd plan profile`` from measurements on
the machine it runs on, or entered by hand from published figures (``source: published``
with a ``reference``) for hardware we cannot run. Each profile keeps its raw samples beside
the linear model fitted to them, so a reader can check the fit:

- ``encode``: seconds per encode call = ``base_s`` + per image not in the cache
  (``image_s`` + ``mpix_s`` x megapixels); ``instances`` passes run in parallel.
- ``prefill``: an engine step that prefills ``n`` tokens of ``r`` new requests lasts
  ``base_s + per_request_s * r + per_token_s * n`` (token budget ``budget_tokens`` per step,
  as vLLM's ``max_num_batched_tokens``).
- ``decode``: a step with ``b`` running sequences of total context ``c`` tokens lasts
  ``base_s + per_seq_s * b + per_kctx_s * c / 1000``.
- ``hops``: what the deployment adds around the stages (stage calls, KV transfer, relaying
  tokens to the client), from the per-hop traces of a real request.
"""

from __future__ import annotations

import math
import os
import platform
from collections.abc import Sequence
from datetime import UTC, datetime
from pathlib import Path
from typing import Annotated, Literal

import numpy as np
from pydantic import BaseModel, ConfigDict, Field, TypeAdapter, ValidationError

from epd_plan.workload import PlanInputError
from orchestrator.config import describe


class _Spec(BaseModel):
    model_config = ConfigDict(extra="forbid", frozen=True)


class Machine(_Spec):
    """The hardware a profile was measured on (or is published for)."""

    name: str = Field(pattern=r"^[A-Za-z0-9._-]+$")
    """Short name used in file names and plans, e.g. ``cpu-2c`` or ``h100-sxm``."""
    cpu: str = ""
    cores: int = Field(default=0, ge=0)
    gpu: str | None = None
    memory_gib: float = Field(default=0, ge=0)
    cost_per_hour: float = Field(default=1.0, gt=0)
    """Relative cost of one replica on this hardware: what the planner minimises."""

    @classmethod
    def this(cls, name: str | None = None, cost_per_hour: float = 1.0) -> Machine:
        """This machine, described from /proc (no GPU: the product runs CPU-only here)."""
        cpu = platform.processor()
        try:
            for line in Path("/proc/cpuinfo").read_text().splitlines():
                if line.startswith("model name"):
                    cpu = line.split(":", 1)[1].strip()
                    break
        except OSError:
            pass
        cores = len(os.sched_getaffinity(0))
        memory = os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES") / 2**30
        return cls(
            name=name or f"cpu-{cores}c",
            cpu=cpu,
            cores=cores,
            memory_gib=round(memory, 1),
            cost_per_hour=cost_per_hour,
        )


class _Profile(_Spec):
    model: str
    """The checkpoint profiled (its directory name or hub id)."""
    machine: Machine
    source: Literal["measured", "published", "synthetic"] = "measured"
    """``measured`` here by ``epd plan profile``; ``published`` figures for hardware we
    cannot run; ``synthetic`` round figures for exercising the simulator, never a plan."""
    reference: str | None = None
    """Where published (or synthetic) figures come from; required for both."""
    measured_at: str = ""
    command: str = ""
    """The command that measured it."""

    def check(self) -> None:
        if self.source != "measured" and not self.reference:
            raise PlanInputError(
                f"{self.stage} profile for {self.machine.name}: {self.source} figures need a "
                "`reference` saying where they come from"
            )

    @property
    def key(self) -> tuple[str, str]:
        return self.stage, self.machine.name  # type: ignore[attr-defined]


class EncodeSample(_Spec):
    width: int
    height: int
    images: int
    """Images in the call."""
    latency_s: float
    cached: bool = False
    """Answered from the encoder cache: the image was decoded and hashed, the tower not run."""


class EncodeProfile(_Profile):
    stage: Literal["encode"] = "encode"
    base_s: float = Field(ge=0)
    image_s: float = Field(ge=0)
    mpix_s: float = Field(ge=0)
    hit_image_s: float = Field(default=0, ge=0)
    """Per image the encoder cache answers: still decoded (to hash its pixels) and handed
    out, but no pass of the tower."""
    hit_mpix_s: float = Field(default=0, ge=0)
    """Per megapixel of an image the cache answers (decoding it)."""
    instances: int = Field(default=1, ge=1)
    """Encode calls one replica serves at once."""
    cache_entries: int = Field(default=0, ge=0)
    """Images one replica's encoder cache holds."""
    token_unit_px: int = Field(default=28, ge=1)
    """Side of the square one image token covers (Qwen2-VL: 14 px patches merged 2x2)."""
    max_image_tokens: int = Field(default=16384, ge=1)
    """Tokens of the largest image the processor produces (bigger ones are resized down)."""
    cores_busy: float = Field(default=0, ge=0)
    """Cores an encode call keeps busy on average (its server's CPU seconds over the calls'
    seconds there, Triton's handling included, measured by ``epd plan profile``; 0: not
    measured, taken as every core of its machine): what it takes from the stages it shares
    one box with. Its decoding and preprocessing are one Python thread, only the tower's
    pass uses every core."""
    samples: list[EncodeSample] = Field(default_factory=list)

    def image_tokens(self, width: int, height: int) -> int:
        """Prompt tokens of a ``width`` x ``height`` image: sides rounded to the unit; an
        image over the processor's largest is scaled down, its aspect kept, and each side
        rounded down, as Qwen's ``smart_resize`` does (a 600x400 image at a 64-token cap
        is 9 x 6 = 54 tokens, not 64)."""
        unit = self.token_unit_px
        tokens = max(1, round(width / unit)) * max(1, round(height / unit))
        if tokens <= self.max_image_tokens:
            return tokens
        scale = math.sqrt(width * height / (self.max_image_tokens * unit * unit))
        sides = [max(1, math.floor(side / scale / unit)) for side in (width, height)]
        return min(sides[0] * sides[1], self.max_image_tokens)

    def call_s(self, width: int, height: int, images: int = 1) -> float:
        return self.base_s + images * (self.image_s + self.mpix_s * width * height / 1e6)


class PrefillSample(_Spec):
    prompt_tokens: int
    batch: int
    """Prompts submitted together."""
    latency_s: float
    """Until the last of them had its first token."""


class _EngineProfile(_Profile):
    threads: int = Field(default=0, ge=0)
    """OpenMP threads of the engine's steps (``OMP_NUM_THREADS`` of the engine measured;
    0: not recorded, taken as every core of its machine): the cores a step keeps busy,
    what it takes from the stages it shares one box with."""


class PrefillProfile(_EngineProfile):
    stage: Literal["prefill"] = "prefill"
    base_s: float = Field(ge=0)
    per_request_s: float = Field(default=0, ge=0)
    """A new request's own cost (input processing, its first output), once."""
    per_token_s: float = Field(ge=0)
    budget_tokens: int = Field(ge=1)
    max_seqs: int = Field(ge=1)
    samples: list[PrefillSample] = Field(default_factory=list)


class DecodeSample(_Spec):
    batch: int
    context_tokens: int
    itl_s: float


class DecodeProfile(_EngineProfile):
    stage: Literal["decode"] = "decode"
    base_s: float = Field(ge=0)
    per_seq_s: float = Field(ge=0)
    per_kctx_s: float = Field(ge=0)
    max_seqs: int = Field(ge=1)
    samples: list[DecodeSample] = Field(default_factory=list)


class HopsProfile(_Profile):
    stage: Literal["hops"] = "hops"
    encode_call_s: float = Field(ge=0)
    """A call to an encoder beyond the encoder's own work."""
    llm_call_s: float = Field(ge=0)
    """A call to a prefill / pd / aggregated engine beyond the engine's work."""
    kv_transfer_s: float = Field(ge=0)
    """From the end of prefill to the request joining a decode engine (E/P/D)."""
    token_relay_s: float = Field(ge=0)
    """From a token leaving the engine to reaching the client."""
    embedding_pull_s: float = Field(default=0, ge=0)
    """Pulling one image's embeddings from its encoder, before the engine gets the prompt."""
    request_input_s: float = Field(default=0, ge=0)
    """What an engine's stage spends on a request outside the engine's own steps (the prompt
    tokenised, the request built and checked): a text-only ``prefill`` span less the
    engine's prefill of a short prompt alone."""
    image_input_s: float = Field(default=0, ge=0)
    """What the stage fed by handles spends per image beyond pulling its embeddings and
    prefilling its tokens: checking the handle, vLLM's processing of the embeddings input
    (the ``prefill`` span of a request with an image minus that of a text-only one, less
    the pull and the image tokens' prefill)."""
    step_overhead_s: float = Field(default=0, ge=0)
    """What serving a step's outputs through Triton adds to each engine step, whatever its
    size (with ``step_overhead_per_seq_s``, fitted to the time per output token in the
    deployment less the engine's own, one request alone and several at once)."""
    step_overhead_per_seq_s: float = Field(default=0, ge=0)
    """What serving adds to a step per sequence in it: each token's trip through the stage's
    Python and Triton to the client, on the cores the engine steps on."""


Profile = Annotated[
    EncodeProfile | PrefillProfile | DecodeProfile | HopsProfile, Field(discriminator="stage")
]
_PROFILE = TypeAdapter(Profile)


def read(path: Path) -> EncodeProfile | PrefillProfile | DecodeProfile | HopsProfile:
    try:
        profile = _PROFILE.validate_json(path.read_text())
    except OSError as exc:
        raise PlanInputError(f"cannot read profile {path}: {exc.strerror}") from None
    except ValidationError as exc:
        raise PlanInputError(f"{path}: not a valid profile: {describe(exc)}") from None
    profile.check()
    return profile


def write(profile: _Profile, directory: Path) -> Path:
    """``<directory>/<stage>-<machine>.json``."""
    directory.mkdir(parents=True, exist_ok=True)
    path = directory / f"{profile.stage}-{profile.machine.name}.json"  # type: ignore[attr-defined]
    path.write_text(profile.model_dump_json(indent=1) + "\n")
    return path


class Profiles:
    """Every profile of one model, by (stage, machine)."""

    def __init__(self, profiles: Sequence[_Profile]) -> None:
        self.by_key = {p.key: p for p in profiles}
        models = {p.model for p in profiles}
        if len(models) > 1:
            raise PlanInputError(f"profiles of several models mixed: {sorted(models)}")

    @classmethod
    def load(cls, directory: Path) -> Profiles:
        files = sorted(directory.glob("*.json"))
        if not files:
            raise PlanInputError(
                f"no profiles in {directory}; measure them with `epd plan profile --out "
                f"{directory}` or enter published ones"
            )
        return cls([read(f) for f in files])

    def get(self, stage: str, machine: str):
        try:
            return self.by_key[stage, machine]
        except KeyError:
            have = ", ".join(f"{s}@{m}" for s, m in sorted(self.by_key)) or "none"
            raise PlanInputError(
                f"no {stage} profile for hardware {machine!r} (have: {have})"
            ) from None

    def machines(self, stage: str) -> list[Machine]:
        return [p.machine for (s, _), p in sorted(self.by_key.items()) if s == stage]


def fit(rows: Sequence[Sequence[float]], ys: Sequence[float]) -> list[float]:
    """Non-negative least squares: coefficients ``c >= 0`` minimising ``|rows @ c - ys|``."""
    from scipy.optimize import nnls

    coefficients, _ = nnls(np.asarray(rows, float), np.asarray(ys, float))
    return [float(c) for c in coefficients]


def now() -> str:
    return datetime.now(UTC).isoformat(timespec="seconds")
