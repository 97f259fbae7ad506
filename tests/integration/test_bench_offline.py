"""The offline-vLLM yardstick of `epd bench ab`: a real in-process engine in a child."""

from __future__ import annotations

from pathlib import Path

import pytest

from epd_bench import load, offline


@pytest.mark.server
@pytest.mark.timeout(600)
def test_offline_vllm_runs_the_same_plan(tiny_model: Path):
    plan = load.LoadPlan(
        models=(), workloads=("mixed",), concurrency=(1, 2), requests=2, max_tokens=3, warmup=1
    )
    results = offline.run(plan, tiny_model, timeout_s=500)
    assert [(r.target, r.load, r.level, r.requests, r.errors) for r in results] == [
        ("offline-vllm", "concurrency", 1.0, 2, 0),
        ("offline-vllm", "concurrency", 2.0, 2, 0),
    ]
    assert all(r.ttft_s.count == 2 and r.requests_per_s for r in results)
    assert set(results[0].ttft_by_kind_s) == {"text", "multi"}
