"""``epd bench transfer``'s arithmetic and printing on synthetic timings: no peers, no timing."""

from __future__ import annotations

import argparse
import json
from dataclasses import asdict

import pytest

from epd_bench.transfer import (
    MEMCPY,
    MIB,
    Row,
    Timings,
    add_arguments,
    format_table,
    ratio_line,
    repeats_for,
    size_label,
    summarize,
)
from epd_bench.transfer_peer import embedding

KIB = 1 << 10
SIXTEEN = 16 * MIB


def timings() -> dict[str, dict[int, Timings]]:
    """memcpy moves 16 MiB in 2 ms; nixl takes twice that, inline ten times (put: encode)."""
    return {
        "nixl": {SIXTEEN: Timings([0.004, 0.005, 0.003, 0.004, 0.009], [0.001] * 5)},
        "inline": {
            SIXTEEN: Timings([0.02, 0.02, 0.02], [0.03, 0.01, 0.02]),
            64 * KIB: Timings([0.001], [0.002]),
        },
        MEMCPY: {SIXTEEN: Timings([0.002, 0.001, 0.003]), 64 * KIB: Timings([0.0001])},
    }


def by_key(rows: list[Row]) -> dict[tuple[str, int], Row]:
    return {(r.kind, r.bytes): r for r in rows}


def test_summary_rows_median_p90_bandwidth_and_memcpy_ratio():
    rows = summarize(timings())
    nixl = by_key(rows)[("nixl", SIXTEEN)]
    assert nixl.count == 5
    assert nixl.median_s == pytest.approx(0.004)
    assert nixl.p90_s == pytest.approx(0.0074)  # linear interpolation: 5 + 0.6 * 4 ms
    assert nixl.bandwidth == pytest.approx(SIXTEEN / 0.004)
    assert nixl.ratio_to_memcpy == pytest.approx(0.5)
    assert nixl.put_median_s == pytest.approx(0.001)
    inline = by_key(rows)[("inline", SIXTEEN)]
    assert inline.ratio_to_memcpy == pytest.approx(0.1)
    assert inline.put_median_s == pytest.approx(0.02)
    memcpy = by_key(rows)[(MEMCPY, SIXTEEN)]
    assert (memcpy.ratio_to_memcpy, memcpy.put_median_s) == (1.0, None)


def test_summary_orders_by_size_with_memcpy_first():
    order = [(r.bytes, r.kind) for r in summarize(timings())]
    assert order == [
        (64 * KIB, MEMCPY),
        (64 * KIB, "inline"),
        (SIXTEEN, MEMCPY),
        (SIXTEEN, "nixl"),
        (SIXTEEN, "inline"),
    ]


def test_summary_without_memcpy_has_no_ratio_and_skips_empty_timings():
    rows = summarize({"nixl": {MIB: Timings([0.001]), 2 * MIB: Timings()}})
    assert [(r.bytes, r.ratio_to_memcpy, r.put_median_s) for r in rows] == [(MIB, None, None)]


def test_json_report_feeds_epd_bench_report():
    """Rows and raw timings are dataclasses (``write_report`` encodes them with ``asdict``);
    ``epd bench report`` reads the NIXL row at 16 MiB and the table back."""
    from epd_bench.report import targets

    rows = summarize(timings())
    report = {"rows": rows, "table": format_table(rows), "timings": timings()}
    doc = json.loads(json.dumps(report, default=asdict))
    assert doc["timings"]["nixl"][str(SIXTEEN)]["fetch_s"][0] == 0.004
    [target] = [t for t in targets([], None, doc) if "NIXL" in t.name]
    assert (target.measured, target.met) == (pytest.approx(0.5), False)


def test_table_shows_ms_gbps_and_ratio():
    lines = format_table(summarize(timings())).splitlines()
    assert lines[0].split()[:3] == ["size", "transport", "n"]
    nixl = next(line for line in lines if "nixl" in line).split()
    assert nixl == ["16", "MiB", "nixl", "5", "4.000", "7.400", "4.19", "0.50", "1.000"]
    memcpy = next(line for line in lines if "64 KiB" in line and MEMCPY in line).split()
    assert memcpy[-2:] == ["1.00", "-"]


def test_ratio_line_reads_16_mib_against_memcpy():
    assert ratio_line(summarize(timings())) == (
        "transfer 16 MiB: nixl 0.50x memcpy (4.19 vs 8.39 GB/s), inline 0.10x (0.84 GB/s)"
    )
    assert ratio_line(summarize(timings()), 64 * KIB).startswith(
        "transfer 64 KiB: inline 0.10x memcpy (0.07 vs 0.66 GB/s)"
    )


def test_ratio_line_falls_back_to_the_largest_size_and_copes_with_nothing():
    rows = summarize({"nixl": {MIB: Timings([0.001])}, "inline": {4 * MIB: Timings([0.01])}})
    assert ratio_line(rows) == "transfer 4 MiB: inline -x (0.42 GB/s)"
    assert ratio_line([]) == "transfer: nothing measured"
    only_memcpy = summarize({MEMCPY: {MIB: Timings([0.001])}})
    assert ratio_line(only_memcpy) == "transfer 1 MiB: no transport measured"


@pytest.mark.parametrize(
    ("nbytes", "label"),
    [(64 * KIB, "64 KiB"), (MIB, "1 MiB"), (1536 * KIB, "1536 KiB"), (7, "7 B")],
)
def test_size_label(nbytes, label):
    assert size_label(nbytes) == label


def test_big_sizes_get_fewer_repeats_but_never_below_the_floor():
    budget = 512 * MIB
    assert repeats_for(64 * KIB, 20, budget) == 20
    assert repeats_for(64 * MIB, 20, budget) == 8
    assert repeats_for(1024 * MIB, 20, budget) == 3
    assert repeats_for(1024 * MIB, 1, budget) == 1  # asked for fewer still


def test_embedding_has_exactly_the_size_asked():
    arr = embedding(64 * KIB)
    assert (arr.shape, arr.dtype.name, arr.nbytes) == ((64, 256), "float32", 64 * KIB)
    with pytest.raises(ValueError, match="multiples of 1024"):
        embedding(1000)


def test_arguments_default_to_the_six_sizes_and_refuse_nonsense():
    parser = argparse.ArgumentParser()
    add_arguments(parser)
    args = parser.parse_args([])
    assert args.sizes_kib == [64, 256, 1024, 4096, 16384, 65536]
    assert (args.kinds, args.tcp) == (["nixl", "mooncake", "inline"], False)
    with pytest.raises(SystemExit):
        parser.parse_args(["--repeats", "0"])
    with pytest.raises(SystemExit):
        parser.parse_args(["--kinds", "carrier-pigeon"])
