"""The fleet simulator against closed-form queueing results (fixed seeds)."""

from __future__ import annotations

import math

import pytest

from epd_plan.profile import (
    DecodeProfile,
    EncodeProfile,
    HopsProfile,
    Machine,
    PrefillProfile,
    Profiles,
)
from epd_plan.simulate import Fleet, StageCount, simulate
from epd_plan.workload import PlanInputError, Workload

MACHINE = Machine(name="m")


def profiles(
    encode_s: float = 0.0,
    instances: int = 1,
    per_seq_s: float = 0.0,
    cache: int = 0,
    image_s: float = 0.0,
    hit_s: float = 0.0,
    image_input_s: float = 0.0,
    request_input_s: float = 0.0,
    serving_per_seq_s: float = 0.0,
    per_token_s: float = 0.0,
    llm_call_s: float = 0.0,
    kv_transfer_s: float = 0.0,
) -> Profiles:
    """A stage whose cost is exactly what a queueing model assumes, everything else free."""
    common = {"model": "m", "machine": MACHINE}
    return Profiles(
        [
            EncodeProfile(
                **common,
                base_s=encode_s,
                image_s=image_s,
                mpix_s=0,
                hit_image_s=hit_s,
                instances=instances,
                cache_entries=cache,
            ),
            PrefillProfile(
                **common, base_s=0, per_token_s=per_token_s, budget_tokens=8192, max_seqs=4096
            ),
            DecodeProfile(**common, base_s=0, per_seq_s=per_seq_s, per_kctx_s=0, max_seqs=4096),
            HopsProfile(
                **common,
                encode_call_s=0,
                llm_call_s=llm_call_s,
                kv_transfer_s=kv_transfer_s,
                token_relay_s=0,
                image_input_s=image_input_s,
                request_input_s=request_input_s,
                step_overhead_per_seq_s=serving_per_seq_s,
            ),
        ]
    )


def e_pd(encoders: int = 1) -> Fleet:
    return Fleet("E+PD", {"encode": StageCount("m", encoders), "pd": StageCount("m", 1)})


def e_p_d(local_prefill_tokens: int = 0) -> Fleet:
    stages = {"encode": StageCount("m", 1), "prefill": StageCount("m", 1)}
    return Fleet("E/P/D", stages | {"decode": StageCount("m", 1)}, local_prefill_tokens)


def erlang_c_wait(lam: float, mu: float, c: int) -> float:
    """Mean wait in queue of an M/M/c queue."""
    a = lam / mu
    rho = a / c
    top = a**c / math.factorial(c) / (1 - rho)
    p_wait = top / (sum(a**k / math.factorial(k) for k in range(c)) + top)
    return p_wait / (c * mu - lam)


def images_only(rate: float, **kw) -> Workload:
    """One-token requests, each with an image, ``kw`` changing any of that."""
    shape = {"image_share": 1.0, "prompt_tokens": 1, "output_tokens": 1}
    length = {"duration_s": 40_000 / rate, "warmup_s": 2_000 / rate}
    return Workload(**({"rate_rps": rate} | shape | length | kw))


@pytest.mark.parametrize("rho", [0.5, 0.8])
def test_mm1_encoder_wait(rho: float) -> None:
    mean_s = 0.01
    p = simulate(
        e_pd(),
        profiles(encode_s=mean_s),
        images_only(rho / mean_s, seed=1),
        exponential_encode=True,
    )
    expected = erlang_c_wait(rho / mean_s, 1 / mean_s, 1)  # = rho / (mu - lambda)
    assert p.encode_wait_s.mean == pytest.approx(expected, rel=0.05)
    assert p.utilization["encode"] == pytest.approx(rho, rel=0.03)


@pytest.mark.parametrize("servers,instances", [(4, 1), (2, 3)])
def test_mmc_encoder_wait(servers: int, instances: int) -> None:
    """c = replicas x instances servers behind one queue."""
    c = servers * instances
    mean_s, rho = 0.02, 0.85
    lam = rho * c / mean_s
    p = simulate(
        e_pd(servers),
        profiles(encode_s=mean_s, instances=instances),
        images_only(lam, seed=2),
        exponential_encode=True,
    )
    assert p.encode_wait_s.mean == pytest.approx(erlang_c_wait(lam, 1 / mean_s, c), rel=0.06)


def test_md1_encoder_wait() -> None:
    """Deterministic service: Pollaczek-Khinchine, half the M/M/1 wait."""
    mean_s, rho = 0.01, 0.7
    p = simulate(e_pd(), profiles(encode_s=mean_s), images_only(rho / mean_s, seed=3))
    assert p.encode_wait_s.mean == pytest.approx(rho * mean_s / (2 * (1 - rho)), rel=0.05)


@pytest.mark.parametrize("cost", ["engine", "serving"])
def test_decode_is_processor_sharing(cost: str) -> None:
    """Steps of ``per_seq_s x running`` share one token rate among the running sequences:
    with geometric lengths, an M/M/1-PS queue (mean sojourn S / (1 - rho)). The cost per
    sequence is the engine's own or that of serving each sequence's token: both slow the
    step the same way."""
    per_seq_s, mean_out, rho = 0.001, 200, 0.6
    service = (mean_out - 1) * per_seq_s
    lam = rho / service
    workload = Workload(
        rate_rps=lam,
        image_share=0.0,
        prompt_tokens=1,
        output_tokens=mean_out,
        output_distribution="geometric",
        duration_s=30_000 / lam,
        warmup_s=1_000 / lam,
        seed=4,
    )
    per_seq = {"per_seq_s" if cost == "engine" else "serving_per_seq_s": per_seq_s}
    p = simulate(e_pd(), profiles(**per_seq), workload)
    assert p.latency_s.mean == pytest.approx(service / (1 - rho), rel=0.06)


def test_cache_answers_repeated_images() -> None:
    """Images from a pool no larger than the cache are encoded once each."""
    workload = images_only(50.0, image_pool=20, seed=5)
    p = simulate(e_pd(2), profiles(encode_s=0.001, cache=10), workload)
    assert p.cache_hit_rate == pytest.approx(1.0, abs=0.01)
    p = simulate(e_pd(2), profiles(encode_s=0.001, cache=0), workload)
    assert p.cache_hit_rate == 0.0


def test_a_cached_image_costs_the_encoder_its_decoding() -> None:
    """An image the cache answers still takes the encoder's time to decode and hash it: the
    encoder is busy ``rate x hit cost`` once the pool is cached, not idle, and not busy for
    a whole pass either."""
    rate, image_s, hit_s = 50.0, 0.01, 0.002
    workload = images_only(rate, image_pool=20, seed=6)
    cached = simulate(e_pd(), profiles(image_s=image_s, hit_s=hit_s, cache=20), workload)
    assert cached.cache_hit_rate == pytest.approx(1.0, abs=0.01)
    assert cached.utilization["encode"] == pytest.approx(rate * hit_s, rel=0.05)
    free = simulate(e_pd(), profiles(image_s=image_s, cache=20), workload)
    assert free.utilization["encode"] < 0.01


def test_an_images_input_cost_is_on_the_way_to_its_first_token() -> None:
    """What the engine's stage spends on an image beyond pulling it and prefilling its
    tokens (vLLM's multimodal input) delays the request's first token by as much."""
    workload = images_only(1.0, seed=7)  # an idle fleet: no queueing
    base = simulate(e_pd(), profiles(), workload)
    slower = simulate(e_pd(), profiles(image_input_s=0.005), workload)
    assert slower.ttft_s.mean - base.ttft_s.mean == pytest.approx(0.005, rel=0.02)


def test_a_requests_input_cost_is_on_the_way_to_its_first_token() -> None:
    """What the engine's stage spends on any request outside the engine (tokenising the
    prompt, building the request) delays a text-only request's first token too."""
    workload = images_only(1.0, seed=8).model_copy(update={"image_share": 0.0})
    base = simulate(e_pd(), profiles(), workload)
    slower = simulate(e_pd(), profiles(request_input_s=0.003), workload)
    assert slower.ttft_s.mean - base.ttft_s.mean == pytest.approx(0.003, rel=0.02)


def test_overload_is_reported_unstable() -> None:
    p = simulate(e_pd(), profiles(encode_s=0.01), images_only(150.0), max_inflight=1000)
    assert not p.stable
    assert not p.meets(10.0, 10.0)


def test_same_seed_same_answer() -> None:
    w = images_only(60.0, seed=9)
    a = simulate(e_pd(), profiles(encode_s=0.01), w, exponential_encode=True)
    b = simulate(e_pd(), profiles(encode_s=0.01), w, exponential_encode=True)
    assert a.encode_wait_s == b.encode_wait_s


def half_photos(rate: float, seed: int) -> Workload:
    """Text prompts of 50 tokens, and as many of 50 plus one 448x448 image's 256."""
    shape = {"image_share": 0.5, "prompt_tokens": 50, "output_tokens": 4}
    return images_only(rate, **shape, duration_s=4_000 / rate, warmup_s=200 / rate, seed=seed)


def test_local_prefill_routes_by_the_prompts_tokens_images_included() -> None:
    """Conditional disaggregation: a prompt within the limit, its image's tokens counted,
    skips prefill; the rest go through it. A limit under every prompt is the same fleet as
    none (same seed, same answer), and one over every prompt leaves prefill idle."""
    workload = half_photos(20.0, seed=10)
    costs = profiles(per_token_s=1e-4)
    off = simulate(e_p_d(), costs, workload)
    assert off.local_prefill_share is None
    under = simulate(e_p_d(10), costs, workload)
    assert under.local_prefill_share == 0.0
    assert (under.ttft_s, under.utilization) == (off.ttft_s, off.utilization)
    text_only = simulate(e_p_d(100), costs, workload)
    assert text_only.local_prefill_share == pytest.approx(0.5, abs=0.03)
    assert 0 < text_only.utilization["prefill"] < off.utilization["prefill"]
    everything = simulate(e_p_d(100_000), costs, workload)
    assert everything.local_prefill_share == 1.0
    assert everything.utilization["prefill"] == 0.0
    # decode now computes the prompts prefill did: its engine works for them
    assert (
        everything.utilization["decode"]
        > off.utilization["decode"] + 0.9 * off.utilization["prefill"]
    )


def test_local_prefill_saves_the_prefill_call_and_the_kv_transfer() -> None:
    """On an idle fleet a prompt decode prefills itself reaches its first token the prefill
    call's and the KV transfer's time sooner: it makes one stage call instead of two."""
    workload = half_photos(1.0, seed=11).model_copy(update={"image_share": 0.0})
    costs = profiles(llm_call_s=0.004, kv_transfer_s=0.010)
    remote = simulate(e_p_d(), costs, workload)
    local = simulate(e_p_d(100), costs, workload)
    assert remote.ttft_s.mean == pytest.approx(0.004 + 0.010, rel=0.02)
    assert local.ttft_s.mean == pytest.approx(0.004, rel=0.02)


def test_local_prefill_pulls_the_images_in_decode() -> None:
    """A photo prompt prefilled by decode pulls its image there, on its way to the first
    token, as it would have in prefill."""
    workload = half_photos(1.0, seed=12).model_copy(update={"image_share": 1.0})
    base = simulate(e_p_d(100_000), profiles(), workload)
    slower = simulate(e_p_d(100_000), profiles(image_input_s=0.005), workload)
    assert base.local_prefill_share == 1.0
    assert slower.ttft_s.mean - base.ttft_s.mean == pytest.approx(0.005, rel=0.02)


@pytest.mark.parametrize(
    "layout,stages,tokens,message",
    [
        ("E+PD", {"encode": 1, "pd": 1}, 100, "for E/P/D"),
        ("aggregated", {"aggregated": 1}, 100, "for E/P/D"),
        ("E/P/D", {"encode": 1, "prefill": 1, "decode": 1}, -1, ">= 0"),
    ],
)
def test_local_prefill_is_an_e_p_d_setting(layout, stages, tokens, message) -> None:
    counts = {s: StageCount("m", n) for s, n in stages.items()}
    with pytest.raises(PlanInputError, match=message):
        Fleet(layout, counts, tokens)


@pytest.mark.parametrize("cap", [64, 1280])
def test_image_tokens_follow_the_processors_resize(cap: int) -> None:
    """The profile's token count of an image is Qwen's ``smart_resize`` grid (the families'
    arithmetic) for images under and over the processor's largest: a non-square image
    over the cap is scaled down with its aspect kept, not cut to the cap."""
    from orchestrator.families.qwen2_vl import QwenImageSettings, smart_resize

    settings = QwenImageSettings(max_pixels=cap * 28 * 28)
    encode = profiles().get("encode", "m").model_copy(update={"max_image_tokens": cap})
    for width, height in [(224, 224), (512, 512), (600, 400), (451, 300), (640, 427),
                          (1024, 768), (1920, 1080), (300, 2000), (3000, 3000)]:  # fmt: skip
        h, w = smart_resize(height, width, settings)
        assert encode.image_tokens(width, height) == (h // 28) * (w // 28), (width, height)
