"""The benchmark's arithmetic and workload on synthetic data: no servers, no timing."""

from __future__ import annotations

import asyncio
import io
import json

import numpy as np
import pytest
from PIL import Image

from epd_bench.quick import (
    MIX,
    BenchError,
    RequestResult,
    Round,
    Settings,
    build_report,
    format_table,
    output_mismatches,
    percentile,
    ratio_line,
    ratios,
    round_order,
    run_round,
    summarize,
    warnings,
    workload,
    write_report,
)
from orchestrator.config import default_topology
from orchestrator.triton.deployment import on_free_ports


def ok(kind: str, ttft: float, latency: float, text: str = "abcd") -> RequestResult:
    return RequestResult(kind, ttft, latency, len(text), text)


def failed(kind: str = "image") -> RequestResult:
    return RequestResult(kind, None, 99.0, 0, error="TimeoutError: ")


@pytest.mark.parametrize("n", [1, 2, 5, 24, 101])
@pytest.mark.parametrize("q", [0, 50, 90, 99, 100])
def test_percentile_matches_numpy(n, q):
    values = list(np.random.default_rng(n).exponential(size=n))
    assert percentile(values, q) == pytest.approx(np.percentile(values, q))


def test_percentile_of_nothing_is_none_and_order_does_not_matter():
    assert percentile([], 50) is None
    assert percentile([3.0, 1.0, 2.0], 50) == 2.0


def test_summary_counts_errors_but_keeps_them_out_of_latency_and_throughput():
    results = [ok("image", 0.1, 1.0), ok("text", 0.3, 2.0, "ab"), failed(), failed("text")]
    s = summarize(results, wall_s=4.0)
    assert (s.requests, s.errors, s.pieces, s.chars) == (4, 2, 6, 6)
    assert s.ttft_s["p50"] == pytest.approx(0.2)
    assert s.latency_s["p90"] == pytest.approx(1.9)
    assert s.requests_per_s == pytest.approx(0.5)
    assert s.chars_per_s == pytest.approx(1.5)


def test_summary_of_all_failures_has_no_percentiles_and_zero_throughput():
    s = summarize([failed(), failed()], wall_s=2.0)
    assert s.errors == 2
    assert set(s.ttft_s.values()) == set(s.latency_s.values()) == {None}
    assert s.requests_per_s == 0.0
    assert summarize([], wall_s=0.0).requests_per_s is None


def test_ratios_are_epd_over_aggregated_and_none_when_undefined():
    epd = summarize([ok("image", 0.2, 2.0), ok("image", 0.2, 2.0)], wall_s=2.0)
    agg = summarize([ok("image", 0.1, 1.0), ok("image", 0.1, 1.0)], wall_s=1.0)
    r = ratios(epd, agg)
    assert r["ttft_p50"] == pytest.approx(2.0)
    assert r["latency_p90"] == pytest.approx(2.0)
    assert r["requests_per_s"] == pytest.approx(0.5)
    assert r["chars_per_s"] == pytest.approx(0.5)
    assert ratio_line(r) == "epd/aggregated: TTFT p50 2.00x, throughput 0.50x"
    broken = ratios(epd, summarize([failed()], wall_s=1.0))
    assert broken["ttft_p50"] is None and broken["chars_per_s"] is None
    assert ratio_line(broken) == "epd/aggregated: TTFT p50 -x, throughput -x"


def test_report_pools_rounds_splits_kinds_and_serializes(tmp_path):
    def rnd(model: str, index: int, scale: float) -> Round:
        results = [ok("image", 0.2 * scale, 1.0 * scale), ok("text", 0.1 * scale, 0.5 * scale)]
        return Round(model, index, results + [failed()] * index, wall_s=2.0 * scale)

    rounds = [rnd("epd", 0, 1.0), rnd("aggregated", 0, 2.0), rnd("aggregated", 1, 2.0)]
    rounds.append(rnd("epd", 1, 1.0))
    report = build_report(rounds, {"args": {"requests": 2}})
    epd = report["models"]["epd"]
    assert (epd["all"].requests, epd["all"].errors, epd["all"].wall_s) == (5, 1, 4.0)
    assert (epd["image"].requests, epd["text"].requests) == (3, 2)
    assert epd["image"].requests_per_s + epd["text"].requests_per_s == epd["all"].requests_per_s
    assert [s.requests for s in epd["rounds"]] == [2, 3]
    assert report["ratios"]["ttft_p50"] == pytest.approx(0.5)
    assert report["ratios_by_kind"]["text"]["ttft_p50"] == pytest.approx(0.5)
    assert len(report["ratios_per_round"]) == 2
    assert report["errors"] == ["TimeoutError: "]
    assert report["output_mismatches"] == [0, 0]
    assert warnings(report) == ["error: TimeoutError: "]
    table = format_table(report["models"])
    assert len(table.splitlines()) == 1 + 2 * 3
    write_report(report, tmp_path / "deep" / "quick.json")
    loaded = json.loads((tmp_path / "deep" / "quick.json").read_text())
    assert loaded["models"]["aggregated"]["all"]["ttft_s"]["p50"] == pytest.approx(0.3)
    assert loaded["args"] == {"requests": 2}


def test_output_mismatches_count_only_requests_both_answered():
    epd = Round("epd", 0, [ok("image", 1, 1, "a"), ok("text", 1, 1, "b"), failed()], 1.0)
    agg = Round(
        "aggregated", 0, [ok("image", 1, 1, "a"), ok("text", 1, 1, "c"), ok("image", 1, 1)], 1.0
    )
    assert output_mismatches(epd, agg) == 1
    report = build_report([epd, agg], {})
    assert report["output_mismatches"] == [1]
    assert any("answered differently" in line for line in warnings(report))


class FakeStream:
    """A gRPC response stream: text pieces for text-only requests, a server error for images."""

    def __init__(self, requests) -> None:
        self.requests = requests
        self.replies: list | None = None
        self.cancelled = False

    def __aiter__(self) -> FakeStream:
        return self

    async def __anext__(self) -> tuple:
        if self.replies is None:
            request = await anext(self.requests)
            names = [tensor.name() for tensor in request["inputs"]]
            if "image" in names:
                self.replies = [(None, RuntimeError("stage call failed"))]
            else:
                self.replies = [(FakeResult(t), None) for t in ("", "Once", " upon", "")]
        if not self.replies:
            raise StopAsyncIteration
        return self.replies.pop(0)

    def cancel(self) -> None:
        self.cancelled = True


class FakeResult:
    def __init__(self, text: str) -> None:
        self.text = text

    def as_numpy(self, name: str) -> np.ndarray:
        assert name == "text_output"
        return np.array([self.text.encode()], dtype=np.object_)


class FakeClient:
    def __init__(self) -> None:
        self.streams: list[FakeStream] = []

    def stream_infer(self, requests, stream_timeout: float) -> FakeStream:
        self.streams.append(FakeStream(requests))
        return self.streams[-1]


def test_a_round_streams_each_request_and_records_pieces_or_the_error():
    client = FakeClient()
    settings = Settings(requests=3, concurrency=2, rounds=1, max_tokens=4, timeout_s=30)
    results, wall_s = asyncio.run(run_round(client, "epd", workload(3, 0), settings))
    assert wall_s >= 0 and len(client.streams) == 3
    assert all(stream.cancelled for stream in client.streams), "every stream is closed"
    image, text, _ = results
    assert (image.kind, image.error, image.ttft_s) == (
        "image",
        "RuntimeError: stage call failed",
        None,
    )
    assert (text.kind, text.error, text.pieces, text.text) == ("text", None, 2, "Once upon")
    assert text.ttft_s is not None and text.ttft_s <= text.latency_s


def test_round_order_alternates_which_model_goes_first():
    assert [round_order(i)[0] for i in range(4)] == ["epd", "aggregated", "epd", "aggregated"]


def test_workload_is_deterministic_with_the_mix_and_never_repeats_content():
    first, again, later = workload(8, 2), workload(8, 2), workload(8, 10)
    assert first == again
    assert [r.kind for r in first] == [r.kind for r in later]
    expected = ["text" if MIX[i % len(MIX)][0] is None else "image" for i in range(8)]
    assert [r.kind for r in first] == expected
    images = [img for r in first + later for img in r.images]
    assert len(set(images)) == len(images)
    assert len({r.text for r in first + later}) == 16
    sizes = [Image.open(io.BytesIO(r.images[0])).size for r in (first[0], later[0])]
    assert sizes[0] == sizes[1], "variants of one photo must cost the same to encode"


def test_settings_reject_nonsense():
    Settings(requests=1, concurrency=1, rounds=1, max_tokens=1, timeout_s=1)
    with pytest.raises(BenchError, match="concurrency=0"):
        Settings(requests=1, concurrency=0, rounds=1, max_tokens=1, timeout_s=1)


def test_free_ports_keep_the_layout(tmp_path):
    default = default_topology(tmp_path)
    moved = on_free_ports(default)
    ports = [p for s in moved.servers.values() for p in s.ports]
    assert len(set(ports)) == len(ports) == 10  # three servers, the front with its OpenAI port
    assert not set(ports) & {p for s in default.servers.values() for p in s.ports}
    assert {n: s.stages for n, s in moved.servers.items()} == {
        n: s.stages for n, s in default.servers.items()
    }


def test_cache_bench_summary_counts_passes_saved_and_hit_ratio():
    from epd_bench.cache import CacheRound, ratio_line, round_requests
    from epd_bench.cache import summarize as summarize_cache

    def results(*ttfts):
        return [RequestResult("image", t, 2 * t, 3, "x") for t in ttfts]

    rounds = [
        CacheRound(miss=results(0.2, 0.4), hit=results(0.1, 0.1), passes=2),
        CacheRound(miss=results(0.3, 0.3), hit=results(0.15, 0.15), passes=3),
    ]
    summary = summarize_cache(rounds)
    assert summary["ttft_s"]["miss"]["p50"] == pytest.approx(0.3)
    assert summary["hit_over_miss"]["p50"] == pytest.approx(0.125 / 0.3)
    assert (summary["image_requests"], summary["encoder_passes"], summary["passes_saved"]) == (
        8,
        5,
        3,
    )
    assert ratio_line(summary).startswith("cache: TTFT p50 hit/miss 0.42x (125 vs 300 ms), 5 ")
    first, again = round_requests(0, 3), round_requests(1, 3)
    assert [r.images for r in first["miss"]] == [r.images for r in first["hit"]]
    assert first["miss"][0].text != first["hit"][0].text
    assert not {r.images for r in first["miss"]} & {r.images for r in again["miss"]}


def test_openai_report_shows_cpu_per_request_by_server():
    from epd_bench.openai_peer import PeerResult, format_report

    def run(rps: float, cpu: dict[str, float]) -> dict:
        return {"req_per_s": rps, "ttft_p50_ms": 10.0, "ttft_p90_ms": 20.0, "cpu_ms": cpu}

    ours = PeerResult(
        "epd", "text", [run(9, {"llm": 30.0, "front": 10.0}), run(11, {"llm": 40.0, "front": 12.0})]
    )
    peer = PeerResult("vllm serve", "text", [run(20, {"vllm serve": 25.0})])
    report = format_report([ours, peer])
    assert "text   epd          total   46.0: llm 35.0, front 11.0" in report
    assert "text   vllm serve   total   25.0: vllm serve 25.0" in report
    assert "epd        text   req/s 0.50x" in report
    assert "; paired" not in report  # one peer run: no rounds to pair

    # Rounds: each of ours over the peer's run of the same round, not median over median.
    peer = PeerResult("vllm serve", "text", [run(10, {}), run(22, {})])
    report = format_report([ours, peer])
    assert "req/s 0.62x" in report  # 10 / 16
    assert "paired req/s 0.70x [0.50-0.90], TTFT p90 1.00x [1.00-1.00]" in report


def test_the_reading_in_the_committed_report_is_the_one_it_is_rendered_from():
    """``docs/benchmarks.md`` is ``epd bench report ... --analysis docs/benchmarks-analysis.md``:
    a reading added to the report alone would be lost the next time it is rendered."""
    from pathlib import Path

    docs = Path(__file__).resolve().parents[2] / "docs"
    report = (docs / "benchmarks.md").read_text()
    reading = report[report.index("## Reading the numbers") : report.index("\n## Runs\n")]
    assert reading.strip() == (docs / "benchmarks-analysis.md").read_text().strip()
