"""``epd plan scale``: how fast the simulator is on a datacenter-size fleet.

The profiles here are **synthetic**: round figures of the order of one H100-class GPU per
replica (an encoder at a few ms per image, prefill at ~20k tokens/s, decode steps of
~12 ms at 256 sequences), chosen to load a 1,000-GPU E/P/D fleet at 10,000 req/s without
overloading it. They exercise the simulator at scale; they are not a measurement and no
plan should be made from them.
"""

from __future__ import annotations

import time
from dataclasses import dataclass

from epd_plan.profile import (
    DecodeProfile,
    EncodeProfile,
    HopsProfile,
    Machine,
    PrefillProfile,
    Profiles,
)
from epd_plan.simulate import Fleet, Prediction, StageCount, simulate
from epd_plan.workload import Workload

MACHINE = Machine(name="synthetic-gpu", gpu="synthetic H100-class", cost_per_hour=1.0)
_META = {
    "model": "synthetic-7b-vlm",
    "machine": MACHINE,
    "source": "synthetic",
    "reference": "epd_plan/scale.py: round figures for a scale test, not a measurement",
}


def synthetic_profiles() -> Profiles:
    return Profiles(
        [
            EncodeProfile(**_META, base_s=1e-3, image_s=2e-3, mpix_s=4e-3, cache_entries=2000),
            PrefillProfile(
                **_META,
                base_s=8e-3,
                per_request_s=0.5e-3,
                per_token_s=50e-6,
                budget_tokens=8192,
                max_seqs=256,
            ),
            DecodeProfile(**_META, base_s=10e-3, per_seq_s=40e-6, per_kctx_s=10e-6, max_seqs=256),
            HopsProfile(
                **_META,
                encode_call_s=1e-3,
                llm_call_s=1e-3,
                kv_transfer_s=5e-3,
                token_relay_s=1e-3,
                embedding_pull_s=0.5e-3,
            ),
        ]
    )


def fleet_of(gpus: int) -> Fleet:
    """E/P/D in the proportions the synthetic workload needs at 10 req/s per GPU: 5%
    encoders, 75% prefill, 20% decode (each stage about half busy)."""
    encode = max(1, gpus // 20)
    prefill = max(1, gpus * 3 // 4)
    decode = max(1, gpus - encode - prefill)
    return Fleet(
        "E/P/D",
        {
            "encode": StageCount(MACHINE.name, encode),
            "prefill": StageCount(MACHINE.name, prefill),
            "decode": StageCount(MACHINE.name, decode),
        },
    )


def workload_of(rate_rps: float, duration_s: float) -> Workload:
    """Half the requests carry one photo (a mix of sizes), 300 prompt tokens, geometric
    outputs of mean 150 tokens."""
    return Workload(
        rate_rps=rate_rps,
        image_share=0.5,
        resolutions={"1024x768": 2, "640x480": 1, "1280x720": 1},
        prompt_tokens=300,
        output_tokens=150,
        output_distribution="geometric",
        duration_s=duration_s,
        warmup_s=min(60.0, duration_s / 10),
    )


@dataclass(frozen=True)
class ScaleRun:
    gpus: int
    rate_rps: float
    duration_s: float
    wall_s: float
    """Wall time of the whole simulation, compilation excluded (warmed up first)."""
    prediction: Prediction


def run(gpus: int, rate_rps: float, duration_s: float) -> ScaleRun:
    profiles = synthetic_profiles()
    fleet = fleet_of(gpus)
    # compile the kernel (numba caches it on disk) on a short run first
    simulate(fleet, profiles, workload_of(rate_rps, 2.0))
    started = time.perf_counter()
    prediction = simulate(fleet, profiles, workload_of(rate_rps, duration_s))
    return ScaleRun(gpus, rate_rps, duration_s, time.perf_counter() - started, prediction)
