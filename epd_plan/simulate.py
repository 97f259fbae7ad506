"""A fleet (counts per stage and hardware) + profiles + a workload -> predicted latencies.

The event loop itself is ``kernel.run`` (compiled); this module turns the planner's view of
a fleet into its arrays and its histograms back into percentiles, utilisations and the
bottleneck stage.
"""

from __future__ import annotations

import time
from dataclasses import dataclass, field
from typing import Literal

import numpy as np

from epd_plan import kernel
from epd_plan.profile import DecodeProfile, EncodeProfile, HopsProfile, PrefillProfile, Profiles
from epd_plan.workload import PlanInputError, Workload

Layout = Literal["aggregated", "E+PD", "E/P/D"]
LAYOUTS: tuple[Layout, ...] = ("aggregated", "E+PD", "E/P/D")
LAYOUT_STAGES: dict[str, tuple[str, ...]] = {
    "aggregated": ("aggregated",),
    "E+PD": ("encode", "pd"),
    "E/P/D": ("encode", "prefill", "decode"),
}
"""The stages (Triton models hosting work) of each layout, in request order."""


@dataclass(frozen=True)
class StageCount:
    machine: str
    """The hardware profile name its replicas run on."""
    replicas: int


@dataclass(frozen=True)
class Fleet:
    layout: Layout
    stages: dict[str, StageCount]
    local_prefill_tokens: int = 0
    """E/P/D only: the topology's ``routing.max_local_prefill_tokens`` (conditional
    disaggregation: prompts of at most this many tokens, images included, are prefilled
    by decode and skip prefill); 0 sends every prompt through prefill."""

    def __post_init__(self) -> None:
        want = set(LAYOUT_STAGES[self.layout])
        if set(self.stages) != want:
            raise PlanInputError(
                f"a {self.layout} fleet has stages {sorted(want)}, got {sorted(self.stages)}"
            )
        if self.local_prefill_tokens < 0:
            raise PlanInputError(
                f"local prefill tokens must be >= 0, got {self.local_prefill_tokens}"
            )
        if self.local_prefill_tokens and self.layout != "E/P/D":
            raise PlanInputError(
                "local prefill (conditional disaggregation) is for E/P/D: "
                f"a {self.layout} fleet has no prefill stage to skip"
            )
        for stage, count in self.stages.items():
            if count.replicas < 1:
                raise PlanInputError(f"{stage}: replicas must be >= 1, got {count.replicas}")

    def cost(self, profiles: Profiles) -> float:
        """Cost per hour: replicas times their hardware's ``cost_per_hour``."""
        total = 0.0
        for stage, count in self.stages.items():
            machine = _machine_of(profiles, stage, count.machine)
            total += count.replicas * machine.cost_per_hour
        return total

    def describe(self) -> str:
        parts = [f"{s} {c.replicas}x{c.machine}" for s, c in self.stages.items()]
        local = f" (local prefill <= {self.local_prefill_tokens})" * bool(self.local_prefill_tokens)
        return f"{self.layout}: " + ", ".join(parts) + local

    def with_replicas(self, stage: str, replicas: int) -> Fleet:
        stages = dict(self.stages)
        stages[stage] = StageCount(stages[stage].machine, replicas)
        return Fleet(self.layout, stages, self.local_prefill_tokens)


def _machine_of(profiles: Profiles, stage: str, machine: str):
    profile_stage = {"aggregated": "prefill", "pd": "prefill"}.get(stage, stage)
    return profiles.get(profile_stage, machine).machine


@dataclass(frozen=True)
class Percentiles:
    p50: float
    p90: float
    p99: float
    mean: float
    count: int

    @classmethod
    def of(cls, hist: np.ndarray, total: float) -> Percentiles:
        count = int(hist.sum())
        if count == 0:
            return cls(float("nan"), float("nan"), float("nan"), float("nan"), 0)
        cumulative = np.cumsum(hist)

        def at(q: float) -> float:
            b = int(np.searchsorted(cumulative, q * count))
            return float(kernel.HIST_LO * 10 ** ((b + 0.5) / kernel.HIST_PER_DECADE))

        return cls(at(0.5), at(0.9), at(0.99), total / count, count)


@dataclass
class Prediction:
    """What the simulation of one fleet under one workload says."""

    fleet: Fleet
    ttft_s: Percentiles
    tpot_s: Percentiles
    latency_s: Percentiles
    encode_wait_s: Percentiles
    throughput_rps: float
    """Measured requests answered per second of measured arrivals."""
    utilization: dict[str, float]
    """How loaded each stage's replicas were over the simulated time (1: at capacity; over
    1: requests waited for seats). Encoders: busy share; engines: see ``simulate``."""
    cache_hit_rate: float | None
    local_prefill_share: float | None
    """E/P/D with local prefill on: the share of measured requests decode prefilled."""
    stable: bool
    """False when requests piled up beyond the simulator's bound: the fleet cannot keep up."""
    events: int
    wall_s: float
    notes: list[str] = field(default_factory=list)

    @property
    def bottleneck(self) -> str:
        return max(self.utilization, key=self.utilization.__getitem__)

    def meets(self, ttft_p90_s: float, tpot_p90_s: float) -> bool:
        return (
            self.stable
            and self.ttft_s.p90 <= ttft_p90_s
            and (self.tpot_s.count == 0 or self.tpot_s.p90 <= tpot_p90_s)
        )


def _engine_row(
    profiles: Profiles, stage: str, count: StageCount, hops: HopsProfile, workload: Workload
) -> list[float]:
    prefill: PrefillProfile = profiles.get("prefill", count.machine)
    decode: DecodeProfile = profiles.get("decode", count.machine)
    row = [0.0] * kernel.P_COLUMNS
    row[kernel.P_REPLICAS] = count.replicas
    row[kernel.P_ENTER_DELAY] = hops.llm_call_s + hops.request_input_s
    if stage == "decode":
        row[kernel.P_ROLE] = kernel.ROLE_DECODE
        row[kernel.P_BUDGET] = max(prefill.budget_tokens, decode.max_seqs)
        row[kernel.P_ENTER_DELAY] = hops.kv_transfer_s
    elif stage == "prefill":
        row[kernel.P_ROLE] = kernel.ROLE_PREFILL
        row[kernel.P_BUDGET] = prefill.budget_tokens
    else:
        row[kernel.P_ROLE] = kernel.ROLE_FULL
        row[kernel.P_BUDGET] = prefill.budget_tokens
    if stage == "aggregated":  # vLLM's own tower runs inside the engine's steps
        encode: EncodeProfile = profiles.get("encode", count.machine)
        per_image = [p * encode.call_s(w, h) - p * encode.base_s for w, h, p in workload.sizes()]
        row[kernel.P_EXTRA_PER_IMAGE] = sum(per_image)
    row[kernel.P_MAX_SEQS] = decode.max_seqs if stage != "prefill" else prefill.max_seqs
    if stage == "prefill":
        row[kernel.P_BASE] = prefill.base_s
    else:  # every step decodes (and streams its tokens through Triton)
        row[kernel.P_BASE] = decode.base_s + hops.step_overhead_s
    # One engine: some of its steps also prefill (decode's, only for the prompts it
    # prefills itself with local prefill on; the kernel charges it only then)
    if stage in ("pd", "aggregated", "decode"):
        row[kernel.P_PREFILL_STEP] = max(0.0, prefill.base_s - decode.base_s)
    # Fed by handles: the engine pulls the embeddings first (decode: its local prefills)
    if stage in ("pd", "prefill", "decode"):
        row[kernel.P_PULL_PER_IMAGE] = hops.embedding_pull_s + hops.image_input_s
    row[kernel.P_PER_REQUEST] = prefill.per_request_s
    row[kernel.P_PER_TOKEN] = prefill.per_token_s
    row[kernel.P_PER_SEQ] = decode.per_seq_s
    if stage != "prefill":  # each running sequence's token is served through Triton
        row[kernel.P_PER_SEQ] += hops.step_overhead_per_seq_s
    row[kernel.P_PER_KCTX] = decode.per_kctx_s
    return row


def simulate(
    fleet: Fleet,
    profiles: Profiles,
    workload: Workload,
    hops_machine: str | None = None,
    exponential_encode: bool = False,
    max_inflight: int | None = None,
    one_host: bool = False,
) -> Prediction:
    """Run the fleet under the workload. ``exponential_encode`` draws encode times from an
    exponential distribution with the profile's mean (for checks against queueing theory).
    ``one_host``: every stage shares one machine's cores (a single-box deployment: one
    encoder, one replica per engine stage): an encoder pass, an engine step and the hops'
    work (the serving path's Python) that overlap slow each other once together they want
    more cores than the box has; otherwise each replica has hardware of its own."""
    hops: HopsProfile = _hops(profiles, hops_machine)
    stages = LAYOUT_STAGES[fleet.layout]
    engines = [s for s in stages if s != "encode"]
    pools = np.array(
        [_engine_row(profiles, s, fleet.stages[s], hops, workload) for s in engines], float
    )
    sizes = workload.sizes()
    if "encode" in fleet.stages:
        count = fleet.stages["encode"]
        encode: EncodeProfile = profiles.get("encode", count.machine)
        tokens = encode
        servers = count.replicas * encode.instances
        cache_entries = count.replicas * encode.cache_entries
        enc = (encode.base_s, encode.image_s, encode.mpix_s, encode.hit_image_s, encode.hit_mpix_s)
    else:
        servers, cache_entries, enc = 0, 0, (0.0,) * 5
        tokens = profiles.get("encode", fleet.stages["aggregated"].machine)
    if one_host and (servers > 1 or any(c.replicas > 1 for c in fleet.stages.values())):
        raise PlanInputError(
            "one_host models one box: one encoder instance and one replica per stage"
        )
    inflight = max_inflight or int(min(1 << 22, max(1 << 14, workload.rate_rps * 120)))
    started = time.perf_counter()
    hist, sums, counters, enc_busy, work, present, end_s = kernel.run(
        workload.seed,
        workload.rate_rps,
        workload.duration_s,
        workload.warmup_s,
        workload.image_share,
        workload.images_per_request,
        np.array([p for _, _, p in sizes], float),
        np.array([w * h / 1e6 for w, h, _ in sizes], float),
        np.array([tokens.image_tokens(w, h) for w, h, _ in sizes], np.int64),
        workload.prompt_tokens,
        workload.output_tokens,
        workload.output_distribution == "geometric",
        workload.image_pool,
        servers,
        *enc,
        exponential_encode,
        hops.encode_call_s,
        cache_entries,
        pools,
        hops.token_relay_s,
        inflight,
        one_host,
        *_host(profiles, fleet, engines),
        fleet.local_prefill_tokens,
    )
    wall = time.perf_counter() - started
    utilization = {}  # over the simulated time, arrivals and draining
    if servers:
        utilization["encode"] = float(enc_busy) / (servers * end_s)
    for i, stage in enumerate(engines):
        # An engine steps whenever it holds a sequence, so "busy" says little: it is as
        # loaded as the larger of its step time spent on work (beyond a step's fixed cost)
        # and its seats taken (requests present / max_num_seqs).
        replica_s = fleet.stages[stage].replicas * end_s
        seats = float(present[i]) / (replica_s * pools[i, kernel.P_MAX_SEQS])
        utilization[stage] = max(float(work[i]) / replica_s, seats)
    images = int(counters[kernel.C_IMAGES])
    stable = not counters[kernel.C_OVERFLOW]
    return Prediction(
        fleet=fleet,
        ttft_s=Percentiles.of(hist[0], sums[0]),
        tpot_s=Percentiles.of(hist[1], sums[1]),
        latency_s=Percentiles.of(hist[2], sums[2]),
        encode_wait_s=Percentiles.of(hist[3], sums[3]),
        throughput_rps=int(counters[kernel.C_MEASURED]) / (workload.duration_s - workload.warmup_s),
        utilization=utilization,
        cache_hit_rate=int(counters[kernel.C_HITS]) / images if images else None,
        local_prefill_share=(
            int(counters[kernel.C_LOCAL]) / max(1, int(counters[kernel.C_MEASURED]))
            if fleet.local_prefill_tokens
            else None
        ),
        stable=stable,
        events=int(counters[kernel.C_EVENTS]),
        wall_s=wall,
        notes=[] if stable else [f"over {inflight} requests in flight: stopped early"],
    )


def _host(profiles: Profiles, fleet: Fleet, engines: list[str]) -> tuple[int, np.ndarray]:
    """For ``one_host``: the cores of the box every stage shares (as its engine's profile
    describes it; 1 when it does not say) and the cores each job keeps busy: the encoder's
    pass as measured, an engine's step its OpenMP threads (a step waits for the slowest;
    either, when its profile does not say, every core), the serving path one (a Python
    thread)."""
    machine = profiles.get("prefill", fleet.stages[engines[0]].machine).machine
    cores = max(1, machine.cores)
    encoder = 0.0
    if "encode" in fleet.stages:
        encoder = profiles.get("encode", fleet.stages["encode"].machine).cores_busy
    steps = [profiles.get("prefill", fleet.stages[s].machine).threads for s in engines]
    return cores, np.array([encoder or cores, *(min(t or cores, cores) for t in steps), 1.0])


def _hops(profiles: Profiles, machine: str | None) -> HopsProfile:
    found = [p for (s, _), p in profiles.by_key.items() if s == "hops"]
    if machine is not None:
        return profiles.get("hops", machine)
    if not found:
        raise PlanInputError("no hops profile (the deployment's per-hop overheads)")
    return found[0]
