"""The load generator's and the report's arithmetic on recorded samples: no servers."""

from __future__ import annotations

import json

import pytest

from epd_bench import ab, load, report
from epd_bench.schema import BenchReport, LatencyStats, RunResult
from orchestrator.config import Topology


def _sample(kind, ttft, pieces, latency, error=None):
    return load.Sample(kind, 0.0, ttft, latency, pieces, "x", error)


def test_reduce_splits_kinds_and_counts_itl_over_successes_only():
    samples = [
        _sample("text", 0.1, [0.1, 0.15, 0.25], 0.3),
        _sample("image", 0.4, [0.4, 0.5], 0.6),
        _sample("image", None, [], 1.0, error="RuntimeError: boom"),
    ]
    r = load.reduce(samples, 2.0, target="epd", workload="mixed", load="concurrency", level=2)
    assert (r.requests, r.errors, r.requests_per_s, r.tokens_per_s) == (3, 1, 1.0, 2.5)
    assert r.ttft_by_kind_s["text"].p50 == pytest.approx(0.1)
    assert r.ttft_by_kind_s["image"].count == 1
    assert sorted(load.itl_gaps(samples)) == pytest.approx([0.05, 0.1, 0.1])
    assert r.error_samples == ["RuntimeError: boom"] and r.latency_s.count == 2


def test_workloads_are_what_they_say():
    mixed = load.WORKLOADS["mixed"](4, 0)
    assert [r.kind for r in mixed] == ["multi", "text", "multi", "text"]
    assert all(len(r.images) == 2 for r in mixed if r.kind == "multi")
    repeated = load.WORKLOADS["repeated"](8, 0)
    assert len({r.images for r in repeated}) == 4  # cycles through four photos
    fresh = load.WORKLOADS["image"](4, 0) + load.WORKLOADS["image"](4, 4)
    assert len({r.images for r in fresh}) == 8  # serials keep runs apart


def test_phase_means_from_two_snapshots():
    before = {p: (1.0, 2.0) for p in load.PHASES}
    after = {p: (3.0, 6.0) for p in load.PHASES} | {"encode": (1.0, 2.0)}
    assert load.phase_means(before, after) == {"prefill": 0.5, "first_token": 0.5, "request": 0.5}


def _run(target, workload, level, rps, text_p90=None):
    by_kind = {"text": LatencyStats(p90=text_p90)} if text_p90 is not None else {}
    return RunResult(
        tool="epd-bench",
        target=target,
        workload=workload,
        load="concurrency",
        level=level,
        requests=4,
        errors=0,
        duration_s=1.0,
        ttft_s=LatencyStats(p90=1.0),
        latency_s=LatencyStats(),
        requests_per_s=rps,
        ttft_by_kind_s=by_kind,
    )


def test_targets_say_per_load_point_or_worst_and_if_met():
    runs = [
        _run("e-p-d/nixl", "mixed", 1, 1.0, text_p90=0.2),
        _run("aggregated", "mixed", 1, 1.0, text_p90=0.5),
        _run("e-p-d/nixl", "mixed", 4, 1.0, text_p90=0.3),
        _run("aggregated", "mixed", 4, 1.0, text_p90=0.5),
        _run("e-p-d/nixl", "large", 2, 3.0),
        _run("e-p-d/inline", "large", 2, 2.0),
    ]
    cache = {"hit_over_miss": {"p50": 0.4}, "encoder_passes": 3, "image_requests": 6}
    transfer = {
        "rows": [
            {"kind": "nixl", "bytes": 16 << 20, "ratio_to_memcpy": 0.6},
            {"kind": "nixl", "bytes": 64 << 20, "ratio_to_memcpy": 0.8},
        ]
    }
    rows = report.targets(runs, cache, transfer)
    text = [(t.detail, t.measured, t.met) for t in rows if t.name.startswith("text-only")]
    assert text == [
        ("concurrency=1", pytest.approx(0.4), True),
        ("concurrency=4", pytest.approx(0.6), False),
    ]
    found = {t.name.split(",")[0]: t for t in rows}
    nixl = found["throughput"]
    assert (nixl.measured, nixl.met) == (pytest.approx(1.5), True)
    pull = found["NIXL pull bandwidth / same-host memcpy at 16 MiB"]
    assert (pull.measured, pull.met, pull.detail) == (0.6, False, "64 MiB: 0.80")
    assert found["repeated images: TTFT p50 on hits / misses"].met is True
    table = report.targets_table(report.targets(runs, cache, transfer))
    assert "| 0.60 | ≤ 0.5 | **no** |" in table


def test_ratios_pair_runs_of_the_same_model_only():
    runs = [
        _run("e-p-d/nixl", "large", 1, 3.0).model_copy(update={"model": "wide"}),
        _run("e-p-d/inline", "large", 1, 2.0).model_copy(update={"model": "bench"}),
    ]
    assert report.targets(runs) == []  # different models: no ratio
    runs.append(_run("e-p-d/inline", "large", 1, 1.0).model_copy(update={"model": "wide"}))
    [nixl] = report.targets(runs)
    assert nixl.measured == pytest.approx(3.0)
    assert nixl.detail == "worst over load points (concurrency=1, wide model)"
    assert "| wide | large | e-p-d/nixl | concurrency=1 |" in report.runs_table(runs)


def test_report_round_trips_through_json(tmp_path):
    doc = load.report("epd bench run", [_run("epd", "mixed", 1, 1.0, text_p90=0.1)])
    path = tmp_path / "run.json"
    path.write_text(doc.model_dump_json())
    [back] = report.load_reports([path])
    assert back == BenchReport.model_validate(json.loads(path.read_text()))
    assert "| mixed | epd | concurrency=1 |" in report.runs_table(back.runs)


def test_ab_variants_are_valid_deployments(tiny_model):
    for name, (build, models) in ab.VARIANTS.items():
        topology = Topology.model_validate(build(tiny_model).model_dump())
        assert "epd" in {s for spec in topology.servers.values() for s in spec.stages}, name
        assert models[0] == "epd"
    pinned = ab.pin_cpus(ab.VARIANTS["e-pd/nixl"][0](tiny_model), ["0", "1"])
    assert [s.cpus for s in pinned.servers.values()] == ["0", "1", "0"]


def test_hop_stats_count_the_traces_of_requests_begun_in_the_window():
    def span(trace: str, name: str, start: int, ms: float, parent: str | None = "x") -> dict:
        return {
            "trace_id": trace,
            "name": name,
            "parent_id": parent,
            "start_ns": start,
            "end_ns": start + int(ms * 1e6),
        }

    spans = [
        span("a", "epd", 100, 50, parent=None),
        span("a", "encode", 110, 10),
        span("b", "epd", 200, 30, parent=None),
        span("b", "encode", 210, 20),
        span("b", "encode", 220, 40),  # a second image
        span("c", "epd", 900, 10, parent=None),  # began after the window
        span("c", "encode", 905, 5),
        span("d", "epd", 150, 10),  # not a root: a client's trace we only joined
    ]
    hops = load.hop_stats(spans, 100, 500)
    assert set(hops) == {"epd", "encode"}
    assert hops["epd"].count == 2 and hops["epd"].p50 == pytest.approx(0.040)
    assert hops["encode"].count == 3 and hops["encode"].p50 == pytest.approx(0.020)
    table = load.format_hops(hops)
    assert table.splitlines()[1].split()[:3] == ["epd", "40.0", "48.0"]


def test_hop_stats_add_each_stage_calls_way_in_and_out_and_the_first_tokens_way_back():
    def span(name: str, span_id: str, parent: str | None, start_ms: float, end_ms: float):
        return {
            "trace_id": "t",
            "name": name,
            "span_id": span_id,
            "parent_id": parent,
            "start_ns": int(start_ms * 1e6),
            "end_ns": int(end_ms * 1e6),
        }

    spans = [
        span("epd", "1", None, 0, 100),
        span("call pd", "2", "1", 2, 90),
        span("pd", "3", "2", 6, 87),  # 4 ms in, 3 ms out
        span("first_token", "4", "3", 7, 20),
        span("stream", "5", "1", 22.5, 90),  # the first token reached the front 2.5 ms later
        span("call encode", "6", "1", 1, 2),
        span("vision_encoder", "7", "6", 1.2, 1.8),  # not the stage the call names
    ]
    hops = load.hop_stats(spans, 0, 10**9)
    assert hops["pd in"].p50 == pytest.approx(0.004)
    assert hops["pd out"].p50 == pytest.approx(0.003)
    assert hops["first_token out"].p50 == pytest.approx(0.0025)
    assert "vision_encoder in" not in hops and "encode in" not in hops
