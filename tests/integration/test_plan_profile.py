"""``epd plan profile`` measures the real stack on this machine (a vLLM engine alone, then
the E/P/D deployment with traces), and ``epd plan`` turns those profiles into a fleet and a
topology that the product accepts. How close its predictions come to real runs is a
benchmark (``epd plan validate``, docs/benchmarks.md), not a test: this box is noisy."""

from __future__ import annotations

import json
import os
from pathlib import Path

import pytest
import yaml

from epd_plan.profile import Profiles
from orchestrator.cli import main as epd
from orchestrator.config import Topology

pytestmark = pytest.mark.server


def test_profile_this_machine_then_plan_a_valid_topology(tiny_model: Path, tmp_path: Path):
    profiles_dir = tmp_path / "profiles"
    out = ["--out", str(profiles_dir)]
    assert epd(["plan", "profile", "--quick", "--model", str(tiny_model), *out]) == 0

    profiles = Profiles.load(profiles_dir)
    (machine,) = profiles.machines("encode")
    assert sorted(p.name for p in profiles_dir.iterdir()) == sorted(
        f"{stage}-{machine.name}.json" for stage in ("encode", "prefill", "decode", "hops")
    )
    for stage in ("encode", "prefill", "decode", "hops"):
        profile = profiles.get(stage, machine.name)
        assert profile.source == "measured" and profile.command.startswith("epd plan profile")
        assert profile.model == tiny_model.name
    encode = profiles.get("encode", machine.name)
    prefill = profiles.get("prefill", machine.name)
    decode = profiles.get("decode", machine.name)
    # what was measured costs something, and each fit kept its samples
    assert encode.image_s + encode.mpix_s > 0 and encode.hit_image_s + encode.hit_mpix_s > 0
    assert sorted(s.cached for s in encode.samples) == [False] * 6 + [True] * 6
    assert prefill.per_token_s > 0 and prefill.samples
    assert decode.base_s > 0 and decode.samples
    # the engine's default (a CPU left to serving) unless the environment says
    threads = int(os.environ.get("OMP_NUM_THREADS") or max(1, machine.cores - 1))
    assert prefill.threads == decode.threads == threads
    # what the encoder keeps of the cores: some, and no more than the machine has
    assert 0 < encode.cores_busy <= machine.cores + 0.5, encode.cores_busy

    workload = tmp_path / "workload.yaml"
    workload.write_text(
        yaml.safe_dump(
            {
                "rate_rps": 2,
                "image_share": 0.5,
                "resolutions": {"448x448": 1},
                "prompt_tokens": 40,
                "output_tokens": 16,
                "duration_s": 300,
            }
        )
    )
    slo = tmp_path / "slo.yaml"
    slo.write_text(yaml.safe_dump({"ttft_p90_s": 2.0, "tpot_p90_s": 0.5}))
    stages_of = {
        "aggregated": {"aggregated"},
        "E+PD": {"epd", "encode", "pd"},
        "E/P/D": {"epd", "encode", "prefill", "decode"},
    }
    for layouts in ([], ["--layout", "E/P/D"]):  # the cheapest of all, then E/P/D alone
        topology_file, report_file = tmp_path / "topology.yaml", tmp_path / "plan.json"
        args = ["plan", "--profiles", str(profiles_dir), "--workload", str(workload), *layouts]
        args += ["--slo", str(slo), "--model", str(tiny_model)]
        assert epd([*args, "--topology-out", str(topology_file), "--out", str(report_file)]) == 0
        report = json.loads(report_file.read_text())
        best = report["recommended"]
        topology = Topology.load(topology_file)
        assert topology.model == tiny_model
        assert {s for server in topology.servers.values() for s in server.stages} == stages_of[best]
    assert best == "E/P/D"
    servers = topology.servers.values()
    counts = {s: sum(1 for v in servers if s in v.stages) for s in stages_of[best]}
    assert report["k8s_replicas"] == {
        "epd-encoder": counts["encode"],
        "epd-prefill": counts["prefill"],
        "epd-decode": counts["decode"],
    }
