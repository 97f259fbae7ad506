"""The planner: inputs refused with a message, a search that meets the SLO at the lowest
count, the latency floor recognised, and the topology it writes."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import yaml

from epd_plan import planner, scale
from epd_plan.cli import parse_fleet
from epd_plan.profile import (
    DecodeProfile,
    EncodeProfile,
    HopsProfile,
    Machine,
    PrefillProfile,
    Profiles,
    read,
    write,
)
from epd_plan.simulate import Fleet, StageCount, simulate
from epd_plan.workload import PlanInputError, Slo, Workload, parse, workload_of_trace
from orchestrator.cli import main as epd
from orchestrator.config import RoutingSpec, Topology, default_topology

CPU = Machine(name="cpu", cost_per_hour=1.0)
GPU = Machine(name="gpu", cost_per_hour=2.5)


def stage_profiles(machine: Machine, speed: float = 1.0) -> list:
    """A GPU-ish engine and encoder, ``speed`` times faster on faster hardware."""
    common = {"model": "m", "machine": machine}
    return [
        EncodeProfile(
            **common,
            base_s=0.002 / speed,
            image_s=0.02 / speed,
            mpix_s=0.01 / speed,
            cache_entries=64,
            max_image_tokens=1024,
        ),
        PrefillProfile(
            **common,
            base_s=0.004 / speed,
            per_token_s=2e-5 / speed,
            budget_tokens=2048,
            max_seqs=64,
        ),
        DecodeProfile(
            **common, base_s=0.006 / speed, per_seq_s=1e-4 / speed, per_kctx_s=0, max_seqs=64
        ),
    ]


HOPS = {"encode_call_s": 0.002, "llm_call_s": 0.002, "kv_transfer_s": 0.004, "token_relay_s": 0.001}


def profiles(*machines: tuple[Machine, float], **hop_costs: float) -> Profiles:
    hops = HopsProfile(model="m", machine=CPU, **(HOPS | hop_costs))
    return Profiles([hops, *(p for m, s in machines for p in stage_profiles(m, s))])


WORKLOAD = Workload(
    rate_rps=40, image_share=0.5, prompt_tokens=100, output_tokens=32, duration_s=60, warmup_s=5
)


@pytest.mark.parametrize(
    "text,fix",
    [
        ("rate_rps: 0", "rate_rps"),
        ("rate_rps: 5\nimage_share: 1.5", "image_share"),
        ("rate_rps: 5\nresolutions: {'448': 1}", "WIDTHxHEIGHT"),
        ("rate_rps: 5\nresolutions: {'448x448': 0}", "weights must be > 0"),
        ("rate_rps: 5\nduration_s: 10\nwarmup_s: 20", "warmup_s"),
        ("rate_rps: 5\nprompt_token: 3", "prompt_token"),
        ("[1, 2]", "expected a mapping"),
    ],
)
def test_bad_workloads_are_refused_with_what_to_fix(text: str, fix: str) -> None:
    with pytest.raises(PlanInputError, match=fix):
        parse(text, Workload, "w.yaml")


def test_bad_slo_is_refused() -> None:
    with pytest.raises(PlanInputError, match="ttft_p90_s"):
        parse("ttft_p90_s: -1\ntpot_p90_s: 0.1", Slo, "slo.yaml")


@pytest.mark.parametrize("source", ["published", "synthetic"])
def test_figures_not_measured_here_need_a_reference(tmp_path: Path, source: str) -> None:
    profile = stage_profiles(GPU)[0].model_copy(update={"source": source})
    with pytest.raises(PlanInputError, match=f"{source} figures need a `reference`"):
        read(write(profile, tmp_path))
    cited = profile.model_copy(update={"reference": "vendor datasheet, table 3"})
    assert read(write(cited, tmp_path)) == cited


def test_scale_run_is_a_stable_synthetic_fleet_of_the_asked_size(capsys) -> None:
    assert epd(["plan", "scale", "--gpus", "40", "--rate", "400", "--duration", "20"]) == 0
    out = capsys.readouterr().out
    assert "synthetic profiles: not a measurement" in out
    assert "E/P/D encode=2, prefill=30, decode=8" in out
    run = scale.run(40, 400, 20)
    assert sum(c.replicas for c in run.prediction.fleet.stages.values()) == 40
    assert run.prediction.stable and 380 < run.prediction.throughput_rps < 420
    assert all(p.source == "synthetic" for p in scale.synthetic_profiles().by_key.values())


def test_search_meets_the_slo_with_no_replica_to_spare() -> None:
    slo = Slo(ttft_p90_s=0.25, tpot_p90_s=0.05)
    p = profiles((CPU, 1.0))
    result = planner.plan_layout(p, WORKLOAD, slo, "E/P/D")
    assert result.fleet is not None, result.why_not
    assert result.prediction.meets(slo.ttft_p90_s, slo.tpot_p90_s)
    for stage, count in result.fleet.stages.items():
        if count.replicas > 1:  # one fewer of any stage misses the SLO
            fewer = simulate(result.fleet.with_replicas(stage, count.replicas - 1), p, WORKLOAD)
            assert not fewer.meets(slo.ttft_p90_s, slo.tpot_p90_s), stage


def test_cheapest_hardware_per_stage_is_chosen() -> None:
    """The fast hardware costs 2.5x: 2x faster, the CPU fleet wins; 5x faster, the GPU one
    does (the load needs about three CPU replicas per stage)."""
    slo = Slo(ttft_p90_s=0.5, tpot_p90_s=0.05)
    heavy = WORKLOAD.model_copy(update={"rate_rps": 200})
    slow = planner.plan_layout(profiles((CPU, 1.0), (GPU, 2.0)), heavy, slo, "E+PD")
    fast = planner.plan_layout(profiles((CPU, 1.0), (GPU, 5.0)), heavy, slo, "E+PD")
    assert {c.machine for c in slow.fleet.stages.values()} == {"cpu"}
    assert "gpu" in {c.machine for c in fast.fleet.stages.values()}
    assert fast.cost <= slow.cost


def test_latency_floor_is_reported_not_searched() -> None:
    """No replica count brings TTFT under the hops themselves."""
    result = planner.plan_layout(
        profiles((CPU, 1.0)), WORKLOAD, Slo(ttft_p90_s=0.001, tpot_p90_s=1), "E/P/D"
    )
    assert result.fleet is None
    assert "latency floor" in result.why_not
    assert result.tried < 5


def test_topology_of_a_fleet_is_valid(tmp_path: Path) -> None:
    fleet = Fleet(
        "E/P/D",
        {
            "encode": StageCount("cpu", 2),
            "prefill": StageCount("cpu", 1),
            "decode": StageCount("cpu", 3),
        },
    )
    topology = planner.topology_for(fleet, tmp_path)
    assert isinstance(topology, Topology)
    assert len(topology.servers_of("encode")) == 2
    assert len(topology.servers_of("decode")) == 3
    assert topology.server_of("epd")[1].openai_port == 9000
    assert planner.replica_counts(fleet) == {"epd-encoder": 2, "epd-prefill": 1, "epd-decode": 3}
    assert topology.routing.max_local_prefill_tokens == 0
    local = Fleet(fleet.layout, fleet.stages, local_prefill_tokens=300)
    assert planner.topology_for(local, tmp_path).routing.max_local_prefill_tokens == 300


def test_fleet_arguments_are_checked() -> None:
    assert parse_fleet("E+PD encode=2 pd=3@gpu") == (
        "E+PD",
        {"encode": (2, None), "pd": (3, "gpu")},
    )
    with pytest.raises(PlanInputError, match="layout"):
        parse_fleet("EPD encode=1")
    with pytest.raises(PlanInputError, match="stage=REPLICAS"):
        parse_fleet("E+PD encode=two")
    with pytest.raises(PlanInputError, match="stages"):
        Fleet("E+PD", {"encode": StageCount("cpu", 1)})


def _profile_dir(tmp_path: Path) -> Path:
    folder = tmp_path / "profiles"
    for profile in profiles((CPU, 1.0)).by_key.values():
        write(profile, folder)
    return folder


def test_cli_plans_and_writes_a_topology(tmp_path: Path, capsys) -> None:
    folder = _profile_dir(tmp_path)
    (tmp_path / "w.yaml").write_text("rate_rps: 20\nduration_s: 30\nwarmup_s: 3\n")
    (tmp_path / "slo.yaml").write_text("ttft_p90_s: 0.3\ntpot_p90_s: 0.05\n")
    out = tmp_path / "topology.yaml"
    code = epd(
        [
            "plan",
            "--profiles",
            str(folder),
            "--workload",
            str(tmp_path / "w.yaml"),
            "--slo",
            str(tmp_path / "slo.yaml"),
            "--model",
            str(tmp_path),
            "--topology-out",
            str(out),
            "--out",
            str(tmp_path / "plan.json"),
        ]
    )
    printed = capsys.readouterr().out
    assert code == 0, printed
    assert "recommended:" in printed
    assert Topology.load(out).servers
    (tmp_path / "bad.yaml").write_text("rate_rps: -3\n")
    code = epd(
        [
            "plan",
            "--profiles",
            str(folder),
            "--workload",
            str(tmp_path / "bad.yaml"),
            "--slo",
            str(tmp_path / "slo.yaml"),
        ]
    )
    assert code == 2
    assert "rate_rps" in capsys.readouterr().err


def test_serving_cost_per_sequence_is_told_from_the_per_step_one() -> None:
    """``epd plan profile`` splits what serving adds to a step (the client's gap between
    tokens less the engine's own step) into a per-step and a per-sequence part from one
    request alone and four at once."""
    from epd_plan.measure import serving_overheads

    decode = DecodeProfile(
        model="m", machine=CPU, base_s=0.006, per_seq_s=1e-4, per_kctx_s=0, max_seqs=64
    )
    step, per_seq = 0.001, 0.0005
    alone = decode.base_s + decode.per_seq_s + step + per_seq
    four = decode.base_s + 4 * decode.per_seq_s + step + 4 * per_seq
    assert serving_overheads(alone, four, 4, decode) == pytest.approx((step, per_seq))
    # a batch served faster than one alone (noise) is no negative cost
    assert serving_overheads(alone, alone, 4, decode) == (pytest.approx(step + per_seq), 0.0)
    # requests the stages staggered so that no two decoded at once tell nothing per sequence
    assert serving_overheads(alone, four, 1, decode) == (pytest.approx(step + per_seq), 0.0)


def test_one_host_shares_its_cores_between_encoder_engine_and_serving() -> None:
    """A single box (E+PD, one of each): an encoder pass, an engine step and the serving
    path's work (the hops) that overlap share the cores; with nothing to overlap the box is
    as fast as separate machines."""
    p = profiles((CPU, 1.0))
    fleet = Fleet("E+PD", {"encode": StageCount("cpu", 1), "pd": StageCount("cpu", 1)})

    def ttft(workload: Workload, one_host: bool, p: Profiles = p) -> float:
        return simulate(fleet, p, workload, one_host=one_host).ttft_s.p50

    sparse = WORKLOAD.model_copy(update={"rate_rps": 0.2, "image_share": 1.0, "duration_s": 600})
    assert ttft(sparse, True) == pytest.approx(ttft(sparse, False), rel=0.01)
    # text only: the engine's steps share the box with the other requests' hops alone
    text = WORKLOAD.model_copy(update={"image_share": 0.0})
    free_hops = profiles((CPU, 1.0), llm_call_s=0.0, token_relay_s=0.0)
    assert ttft(text, True, free_hops) == pytest.approx(ttft(text, False, free_hops), rel=0.01)
    assert ttft(text, True) > 1.1 * ttft(text, False)
    # busy: images are encoded while other requests decode, and both slow down
    busy = WORKLOAD.model_copy(update={"rate_rps": 20, "image_share": 1.0})
    assert ttft(busy, True) > 1.2 * ttft(busy, False)
    two = Fleet("E+PD", {"encode": StageCount("cpu", 1), "pd": StageCount("cpu", 2)})
    with pytest.raises(PlanInputError, match="one box"):
        simulate(two, p, busy, one_host=True)


def test_one_host_slows_only_what_outgrows_its_cores() -> None:
    """On two cores an engine's step on both (its OpenMP threads) is slowed less by an
    encoder that keeps one busy (as measured) than by one that wants both, which halves
    the speed of both while they overlap; an engine on one thread beside an encoder on
    the other is not slowed at all."""
    box = Machine(name="box", cores=2)
    free_hops = {"encode_call_s": 0.0, "llm_call_s": 0.0, "kv_transfer_s": 0.0}
    fleet = Fleet("E+PD", {"encode": StageCount("box", 1), "pd": StageCount("box", 1)})
    busy = WORKLOAD.model_copy(update={"rate_rps": 20, "image_share": 1.0})

    def ttft(encoder_cores: float, one_host: bool = True, engine_threads: int = 2) -> float:
        p = profiles((box, 1.0), token_relay_s=0.0, **free_hops)
        key = ("encode", "box")
        p.by_key[key] = p.by_key[key].model_copy(update={"cores_busy": encoder_cores})
        for key in (("prefill", "box"), ("decode", "box")):
            p.by_key[key] = p.by_key[key].model_copy(update={"threads": engine_threads})
        return simulate(fleet, p, busy, one_host=one_host).ttft_s.p50

    apart = ttft(2.0, one_host=False)
    assert ttft(2.0) > ttft(1.0) > apart
    assert ttft(0.0) == pytest.approx(ttft(2.0), rel=0.01)  # not measured: every core
    assert ttft(1.0, engine_threads=0) == pytest.approx(ttft(1.0), rel=0.01)  # not recorded
    assert ttft(1.0, engine_threads=1) == pytest.approx(apart, rel=0.01)
    assert ttft(2.0, engine_threads=1) > apart


def test_a_recorded_trace_becomes_the_workload_it_shows(tmp_path: Path, capsys) -> None:
    lines = []
    for i in range(101):  # 100 gaps of 0.05 s: 20 req/s
        request = {"t": 10 + i * 0.05, "prompt_tokens": 40 + i % 2 * 20, "output_tokens": 8 + i % 3}
        if i % 4 == 0:  # a quarter carry two photos, from a pool of five
            request["images"] = [[1024, 768], [448, 448]]
            request["image_ids"] = [f"a{i % 5}", f"b{i % 5}"]
        lines.append(json.dumps(request))
    trace = tmp_path / "trace.jsonl"
    trace.write_text("\n".join(lines) + "\n")
    w = workload_of_trace(trace)
    assert w.rate_rps == pytest.approx(20)
    assert w.image_share == pytest.approx(26 / 101) and w.images_per_request == 2
    assert w.resolutions == {"1024x768": 26, "448x448": 26}
    assert w.prompt_tokens == 50 and w.output_tokens == 9 and w.output_distribution == "geometric"
    assert w.image_pool == 10  # ten distinct images behind 52
    args = ["plan", "--profiles", str(_profile_dir(tmp_path)), "--workload", str(trace)]
    assert epd([*args, "--fleet", "E+PD encode=1 pd=1"]) == 0
    assert "workload from the trace" in capsys.readouterr().out

    trace.write_text(lines[0] + "\n" + '{"t": 1, "prompt_tokens": 0, "output_tokens": 3}\n')
    with pytest.raises(PlanInputError, match=r"trace.jsonl:2: .*prompt_tokens"):
        workload_of_trace(trace)
    trace.write_text('{"t": 1, "prompt_tokens": 5, "output_tokens": 3, "images": [[4, 4]], '
                     '"image_ids": ["a", "b"]}\n')  # fmt: skip
    with pytest.raises(PlanInputError, match=r"trace.jsonl:1: .*2 image_ids for 1 images"):
        workload_of_trace(trace)
    trace.write_text('{"t": 1, "prompt_tokens": 5, "output_tokens": 3, "images": [[0, 4]]}\n')
    with pytest.raises(PlanInputError, match=r"trace.jsonl:1: .*images"):
        workload_of_trace(trace)


@pytest.mark.parametrize(
    "rate", ["image-heavy=0", "image-heavy=fast", "image-heavy", "image-heavy=inf"]
)
def test_validate_refuses_a_rate_it_cannot_use(rate: str, tmp_path: Path, capsys) -> None:
    args = ["plan", "validate", "--profiles", str(_profile_dir(tmp_path)), "--rate", rate]
    assert epd(args) == 2
    assert "rate above 0" in capsys.readouterr().err


def test_cli_predicts_and_plans_with_local_prefill(tmp_path: Path, capsys) -> None:
    """``--max-local-prefill-tokens``: the E/P/D fleet's short prompts skip prefill in the
    prediction, the planned topology carries the setting, and another layout's fleet is
    refused with the reason."""
    folder = _profile_dir(tmp_path)
    (tmp_path / "w.yaml").write_text(
        "rate_rps: 20\nimage_share: 0.5\nprompt_tokens: 100\nduration_s: 30\nwarmup_s: 3\n"
    )
    (tmp_path / "slo.yaml").write_text("ttft_p90_s: 0.3\ntpot_p90_s: 0.05\n")
    args = ["plan", "--profiles", str(folder), "--workload", str(tmp_path / "w.yaml")]
    fleet = ["--fleet", "E/P/D encode=1 prefill=1 decode=1", "--max-local-prefill-tokens", "200"]
    assert epd([*args, *fleet, "--out", str(tmp_path / "p.json")]) == 0
    printed = capsys.readouterr().out
    assert "(local prefill <= 200)" in printed and "  local prefill " in printed, printed
    prediction = json.loads((tmp_path / "p.json").read_text())["prediction"]
    assert prediction["fleet"]["local_prefill_tokens"] == 200
    assert 0.4 < prediction["local_prefill_share"] < 0.6

    out = tmp_path / "topology.yaml"
    planned = ["--slo", str(tmp_path / "slo.yaml"), "--layout", "E/P/D", "--model", str(tmp_path)]
    code = epd([*args, *planned, "--max-local-prefill-tokens", "200", "--topology-out", str(out)])
    assert code == 0, capsys.readouterr()
    assert Topology.load(out).routing.max_local_prefill_tokens == 200

    capsys.readouterr()
    code = epd([*args, "--fleet", "E+PD encode=1 pd=1", "--max-local-prefill-tokens", "200"])
    assert code == 2
    assert "for E/P/D" in capsys.readouterr().err


def test_validate_simulates_the_topology_it_runs(tmp_path: Path, capsys) -> None:
    """``epd plan validate --topology``: the fleet it simulates is the one-box layout it
    runs, conditional disaggregation included; a layout it cannot simulate as one box is
    refused before any server starts."""
    from epd_plan.validate import fleet_of

    costs = profiles((CPU, 1.0))
    e_pd = fleet_of(default_topology(tmp_path), costs)
    assert (e_pd.layout, set(e_pd.stages), e_pd.local_prefill_tokens) == (
        "E+PD",
        {"encode", "pd"},
        0,
    )
    local = default_topology(tmp_path, layout="E/P/D").model_copy(
        update={"routing": RoutingSpec(max_local_prefill_tokens=120)}
    )
    e_p_d = fleet_of(local, costs)
    assert (e_p_d.layout, e_p_d.local_prefill_tokens) == ("E/P/D", 120)
    assert all(c.replicas == 1 for c in e_p_d.stages.values())

    two_decoders = planner.topology_for(
        Fleet(
            "E/P/D",
            {
                "encode": StageCount("cpu", 1),
                "prefill": StageCount("cpu", 1),
                "decode": StageCount("cpu", 2),
            },
        ),
        tmp_path,
    )
    with pytest.raises(PlanInputError, match=r"one server per stage.*decode"):
        fleet_of(two_decoders, costs)
    path = tmp_path / "two.yaml"
    path.write_text(yaml.safe_dump(json.loads(two_decoders.model_dump_json(exclude_defaults=True))))
    args = ["plan", "validate", "--profiles", str(_profile_dir(tmp_path)), "--topology", str(path)]
    assert epd(args) == 2
    assert "one server per stage" in capsys.readouterr().err
