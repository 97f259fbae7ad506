"""perf_analyzer's input JSON, the parsing of its CSV and profile export, and the per-level
runner, on a recorded run and on hand-made edge cases: no servers, no real perf_analyzer.

The recording (``data/perf_analyzer_epd*``): ``epd`` on the embedded deployment, workload
``mixed`` (8 requests, max_tokens 8, streaming), concurrency 2, 1500 ms windows. perf_analyzer
printed "Request count: 96" and "Avg latency: 110715 usec". The export keeps only
``text_input`` of the echoed inputs (the photos made it megabytes).
"""

from __future__ import annotations

import base64
import gzip
import io
import json
import stat
import struct
import sys
from pathlib import Path

import pytest
from PIL import Image

from epd_bench import load
from epd_bench import perf_analyzer as pa

DATA = Path(__file__).parent / "data"
RECORDED_CSV = DATA / "perf_analyzer_epd.csv"
RECORDED_EXPORT = DATA / "perf_analyzer_epd_export.json.gz"
WORKLOAD = load.WORKLOADS["mixed"](8, 0)
KINDS = {r.text: r.kind for r in WORKLOAD}


def recorded_profiles() -> dict[int, pa.Profile]:
    return pa.parse_profile_export(gzip.decompress(RECORDED_EXPORT.read_bytes()), KINDS)


def unpack_bytes_tensor(tensor: dict) -> list[bytes]:
    """Inverse of perf_analyzer's BYTES serialization: uint32 LE length, then the bytes."""
    raw = base64.b64decode(tensor["content"]["b64"])
    items, pos = [], 0
    while pos < len(raw):
        (size,) = struct.unpack_from("<I", raw, pos)
        items.append(raw[pos + 4 : pos + 4 + size])
        pos += 4 + size
    return items


# --- input data -------------------------------------------------------------------------------


def test_input_data_carries_every_request_with_real_photos():
    data = pa.input_data(WORKLOAD, max_tokens=8, stream=True)
    json.dumps(data)  # perf_analyzer reads it as JSON
    assert len(data["data"]) == len(WORKLOAD)
    for entry, request in zip(data["data"], WORKLOAD, strict=True):
        assert entry["text_input"] == [request.text]
        assert json.loads(entry["sampling_parameters"][0]) == {"max_tokens": 8, "temperature": 0}
        assert entry["stream"] == [True]
        if request.kind == "text":
            assert "image" not in entry  # optional input left out
            continue
        assert entry["image"]["shape"] == [len(request.images)] == [2]  # multi: two photos
        photos = unpack_bytes_tensor(entry["image"])
        assert photos == list(request.images)  # the bytes as sent, not re-encoded
        for photo in photos:
            assert photo[:2] == b"\xff\xd8"
            assert Image.open(io.BytesIO(photo)).format == "JPEG"


def test_input_data_without_streaming_asks_for_one_response():
    data = pa.input_data(load.WORKLOADS["image"](2, 0), max_tokens=4, stream=False)
    assert [e["stream"] for e in data["data"]] == [[False], [False]]
    assert [e["image"]["shape"] for e in data["data"]] == [[1], [1]]


# --- parsing the recorded run -------------------------------------------------------------------


def test_recorded_export_selects_the_requests_perf_analyzer_counted():
    profile = recorded_profiles()[2]
    assert profile.requests == 96  # perf_analyzer's "Request count"
    mean_us = sum(profile.latency_s) / len(profile.latency_s) * 1e6
    assert mean_us == pytest.approx(110715, abs=1)  # its "Avg latency"
    # Its percentiles are latencies of the selected requests (truncated to µs).
    row = RECORDED_CSV.read_text().splitlines()[1].split(",")
    ours = {int(s * 1e6) for s in profile.latency_s}
    assert {int(row[i]) for i in (10, 11, 12, 13)} <= ours
    assert all(0 < t <= lat for t, lat in zip(profile.ttft_s, profile.latency_s, strict=True))
    assert sorted(profile.ttft_by_kind_s) == ["multi", "text"]
    assert sum(len(v) for v in profile.ttft_by_kind_s.values()) == 96


def test_parse_csv_of_the_recorded_run():
    (r,) = pa.parse_csv(RECORDED_CSV.read_text(), "epd", "mixed", True, recorded_profiles())
    assert (r.tool, r.target, r.workload, r.load, r.level) == (
        "perf_analyzer",
        "epd",
        "mixed",
        "concurrency",
        2,
    )
    assert (r.requests, r.errors) == (96, 0)
    assert r.requests_per_s == pytest.approx(17.6674)
    assert r.requests / r.duration_s == pytest.approx(r.requests_per_s, rel=1e-4)
    assert (r.latency_s.p50, r.latency_s.p90, r.latency_s.p99) == pytest.approx(
        (0.112668, 0.142101, 0.164309)
    )
    assert r.latency_s.mean == pytest.approx(0.110715, abs=1e-6)
    assert r.tokens_per_s == pytest.approx(112.445)  # text responses/s
    assert r.ttft_s.count == 96 and 0 < r.ttft_s.p50 < r.latency_s.p50
    assert r.itl_s.count > 0 and r.itl_s.p50 < r.ttft_s.p50
    assert set(r.ttft_by_kind_s) == {"multi", "text"}


# --- hand-made edge cases ---------------------------------------------------------------------


def _request(start: int, responses: list[tuple[int, str]], text: str = "q") -> dict:
    return {
        "timestamp": start,
        "request_inputs": {"text_input": text},
        "response_timestamps": [t for t, _ in responses],
        "response_outputs": [{"text_output": out} for _, out in responses],
    }


def test_export_keeps_requests_ending_in_the_last_three_windows():
    s = 10**9
    export = {
        "experiments": [
            {
                "experiment": {"mode": "concurrency", "value": 3},
                "window_boundaries": [0, 10 * s, 20 * s, 30 * s, 40 * s, 50 * s],
                "requests": [
                    _request(5 * s, [(15 * s, "early")]),  # ends before the windows
                    # starts before them, ends inside: counted, like perf_analyzer does
                    _request(18 * s, [(19 * s, "a"), (21 * s, "b"), (24 * s, "c")], "pic"),
                    # the empty final response after the window does not count as its end
                    _request(45 * s, [(46 * s, "a"), (51 * s, "")], "txt"),
                    _request(45 * s, [(46 * s, "")]),  # no text at all
                    _request(49 * s, [(52 * s, "late")]),  # ends after the windows
                ],
            }
        ],
        "version": "2.51.0",
    }
    raw = json.dumps(export).encode().replace(b"early", b"\xff\xd8 raw photo bytes")
    profile = pa.parse_profile_export(raw, {"pic": "image", "txt": "text"})[3]
    assert (profile.requests, profile.duration_s) == (2, 30.0)
    assert profile.ttft_s == [1.0, 1.0]
    assert profile.itl_s == [2.0, 3.0]
    assert profile.latency_s == [6.0, 1.0]
    assert profile.ttft_by_kind_s == {"image": [1.0], "text": [1.0]}


HAND_CSV = (
    "Concurrency,Inferences/Second,Client Send,p50 latency,p90 latency,p95 latency,p99 latency\n"
    "1,2.5,0,400000,500000,550000,600000\n"
    "4,6.0,0,700000,900000,950000,990000\n"
)
"""Columns perf_analyzer writes with ``--percentile``: no "Response Throughput"."""


def test_parse_csv_of_several_levels_without_streaming():
    profiles = {
        1: pa.Profile(5, 2.0, ttft_s=[0.4] * 5, latency_s=[0.4] * 5),
        4: pa.Profile(12, 2.0, ttft_s=[0.7] * 12, latency_s=[0.7] * 12),
    }
    results = pa.parse_csv(HAND_CSV, "aggregated", "image", False, profiles)
    assert [(r.level, r.requests, r.requests_per_s) for r in results] == [(1, 5, 2.5), (4, 12, 6.0)]
    assert results[1].latency_s.p99 == pytest.approx(0.99)
    for r in results:  # the whole text in one response: no token timing to report
        assert r.ttft_s.count == 0 and r.itl_s.count == 0 and r.tokens_per_s is None
        assert r.ttft_by_kind_s == {}


@pytest.mark.parametrize(
    ("text", "message"),
    [
        ("", "no rows"),
        ("Concurrency,Inferences/Second\n1,2.0\n", "lacks columns"),
        (HAND_CSV.replace("\n4,", "\n8,"), "concurrency 8"),
    ],
)
def test_parse_csv_refuses_what_it_cannot_read(text, message):
    profiles = {1: pa.Profile(5, 2.0), 4: pa.Profile(12, 2.0)}
    with pytest.raises(pa.PerfAnalyzerError, match=message):
        pa.parse_csv(text, "epd", "image", True, profiles)


@pytest.mark.parametrize(
    ("text", "levels"), [("1:4:1", [1, 2, 3, 4]), ("2", [2]), ("1:8:3", [1, 4, 7]), ("3:3", [3])]
)
def test_concurrency_range(text, levels):
    assert pa.concurrency_range(text) == levels


@pytest.mark.parametrize("text", ["0:2", "3:1", "a", "1:2:3:4", ""])
def test_concurrency_range_refuses_nonsense(text):
    with pytest.raises(pa.PerfAnalyzerError):
        pa.concurrency_range(text)


# --- installation and environment ---------------------------------------------------------


def test_env_links_hashed_library_names_under_the_wanted_ones(tmp_path, monkeypatch):
    libs = tmp_path / "libs"
    libs.mkdir()
    (libs / "libb64-98cb6333.so.0d").write_bytes(b"b64")
    (libs / "libcudart-09529672.so.12.6.77").write_bytes(b"cudart")
    monkeypatch.setattr(pa, "_library_dirs", lambda: [libs])
    monkeypatch.setenv("LD_LIBRARY_PATH", "/elsewhere")
    venv = tmp_path / "venv"
    for _ in range(2):  # idempotent
        env = pa.perf_analyzer_env(venv)
    first, rest = env["LD_LIBRARY_PATH"].split(":", 1)
    assert rest == "/elsewhere"
    assert (Path(first) / "libb64.so.0d").read_bytes() == b"b64"
    assert (Path(first) / "libcudart.so.12").read_bytes() == b"cudart"


def test_env_names_the_missing_library(tmp_path, monkeypatch):
    monkeypatch.setattr(pa, "_library_dirs", lambda: [tmp_path])
    with pytest.raises(pa.PerfAnalyzerError, match=r"libb64\.so\.0d.*libb64-0d"):
        pa.perf_analyzer_env(tmp_path / "venv")


def test_ensure_returns_an_installed_binary_without_pip(tmp_path, monkeypatch):
    binary = tmp_path / "bin" / "perf_analyzer"
    binary.parent.mkdir()
    binary.touch()
    monkeypatch.setattr(pa.subprocess, "run", lambda *a, **k: pytest.fail("installed again"))
    assert pa.ensure_perf_analyzer(tmp_path) == binary


def test_command_streams_over_grpc_with_a_loose_stability_check():
    argv = pa.command(
        Path("/pa"), "h:1", "epd", Path("in.json"), 3, pa.Settings(1500, 50, 7), Path("w/c3")
    )
    line = " ".join(argv)
    assert line.startswith("/pa -i grpc -u h:1 -m epd --streaming --input-data in.json")
    for part in (
        "--concurrency-range 3",
        "--measurement-interval 1500",
        "--stability-percentage 50",
        "--max-trials 7",
        "-f w/c3.csv",
        "--profile-export-file w/c3.json",
    ):
        assert part in line


# --- the per-level runner, with a stand-in binary -------------------------------------------


FAKE = """#!{python}
import gzip, os, shutil, sys
args = sys.argv[1:]
value = lambda flag: args[args.index(flag) + 1]
if value("--concurrency-range") != "2":
    print("Failed to obtain stable measurement.")
    sys.exit(2)
shutil.copy(os.environ["FAKE_CSV"], value("-f"))
with open(value("--profile-export-file"), "wb") as out:
    out.write(gzip.decompress(open(os.environ["FAKE_EXPORT"], "rb").read()))
print("Request count: 96")
"""


def test_run_measures_each_level_alone_and_keeps_failures(tmp_path):
    binary = tmp_path / "perf_analyzer"
    binary.write_text(FAKE.format(python=sys.executable))
    binary.chmod(binary.stat().st_mode | stat.S_IXUSR)
    env = {"FAKE_CSV": str(RECORDED_CSV), "FAKE_EXPORT": str(RECORDED_EXPORT)}
    work = tmp_path / "work"
    results = pa.run(
        "h:1",
        "epd",
        [2, 3],
        True,
        binary,
        env,
        work,
        requests=WORKLOAD,
        workload="mixed",
        max_tokens=8,
        settings=pa.Settings(100, 50, 1),
    )
    ok, failed = results
    assert (ok.level, ok.requests, ok.error_samples) == (2, 96, [])
    assert (failed.level, failed.requests, failed.requests_per_s) == (3, 0, None)
    assert failed.error_samples == ["perf_analyzer rc=2: Failed to obtain stable measurement."]
    assert len(json.loads((work / "mixed-input.json").read_text())["data"]) == 8
    assert (work / "epd-mixed-c2.log").read_text() == "Request count: 96\n"
    assert not (work / "epd-mixed-c2.json").exists()  # the bulky export is gone once parsed
