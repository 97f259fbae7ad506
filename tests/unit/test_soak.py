"""``epd bench soak``'s bookkeeping (the run itself needs servers: it is a benchmark)."""

from __future__ import annotations

import os

from epd_bench.soak import SoakReport, format_report, tree_rss_mib


def test_tree_rss_counts_this_process():
    assert 1 < tree_rss_mib(os.getpid()) < 1 << 20


def test_report_shows_growth_per_server_and_error_kinds():
    report = SoakReport(
        requests=100,
        warmup=10,
        concurrency=4,
        wall_s=5.0,
        requests_per_s=20.0,
        answers={"photo ok": 60, "cancel cancelled": 30, "text error": 10},
        errors=["error: text: UNAVAILABLE: ..."],
        rss_mib={"front": [100.0, 103.0], "encoder": [50.0, 50.0]},
        growth_pct={"front": 3.0, "encoder": 0.0},
        samples_at=[0, 100],
    )
    text = format_report(report)
    assert "1 error kinds" in text and "text error 10" in text
    assert "front" in text and "3.00%" in text and "0.00%" in text
