"""Topology validation, wire protocol helpers and repository rendering (no servers)."""

from __future__ import annotations

import json
import os
import sys
from pathlib import Path

import numpy as np
import pytest
import yaml
from pydantic import ValidationError

from orchestrator.config import ServerSpec, Topology, default_topology
from orchestrator.protocol import (
    InvalidRequest,
    SamplingOptions,
    StageError,
    Unavailable,
    error_from_message,
    error_message,
)


def _server(port: int, stages: list[str], host: str = "127.0.0.1") -> ServerSpec:
    return ServerSpec(
        host=host, http_port=port, grpc_port=port + 1, metrics_port=port + 2, stages=stages
    )


def test_default_topology_is_e_pd_with_front_on_triton_ports():
    topo = default_topology(Path("/m"))
    assert {n: s.stages for n, s in topo.servers.items()} == {
        "encoder": ["encode"],
        "llm": ["pd"],
        "front": ["epd", "aggregated"],
    }
    assert topo.one_engine
    assert topo.server_of("epd")[1].ports == (8000, 8001, 8002, 9000)
    split = default_topology(Path("/m"), "E/P/D")
    assert not split.one_engine
    assert [split.server_of(s)[0] for s in ("prefill", "decode")] == ["prefill", "decode"]


@pytest.mark.parametrize(
    ("servers", "message"),
    [
        (
            {"a": _server(9000, ["epd"]), "b": _server(9100, ["decode"])},
            "'epd' needs stage 'encode'",
        ),
        (
            {"a": _server(9000, ["epd"]), "b": _server(9100, ["encode", "prefill"])},
            "'epd' needs stage 'decode'",
        ),
        (
            {"a": _server(9000, ["epd"]), "b": _server(9100, ["encode", "pd", "decode"])},
            "'epd' routes a request either to one engine ('pd', E+PD) or to 'prefill' then "
            "'decode' (E/P/D), not both",
        ),
        (
            {"a": _server(9000, ["epd", "decode"]), "b": _server(9100, ["encode", "prefill"])},
            "server 'a' hosts entry points ['epd'] and internal stages ['decode']",
        ),
        (
            {"a": _server(9000, ["aggregated", "encode"])},
            "internal stages need servers of their own",
        ),
        ({"a": _server(9000, ["prefill"])}, "no server hosts an entry point"),
        (
            {"a": _server(9000, ["aggregated"]), "b": _server(9001, ["aggregated"])},
            "both use 127.0.0.1:9001",
        ),
    ],
)
def test_invalid_topologies_say_what_to_fix(servers, message):
    with pytest.raises(ValueError, match="invalid topology") as err:
        Topology(model=Path("/m"), servers=servers)
    assert message in str(err.value)


def test_local_prefill_is_an_e_p_d_setting():
    """Conditional disaggregation routes past prefill servers; E+PD has none."""
    e_p_d = default_topology(Path("/m"), "E/P/D").model_dump()
    e_p_d["routing"] = {"max_local_prefill_tokens": 256}
    assert Topology.model_validate(e_p_d).routing.max_local_prefill_tokens == 256
    e_pd = {**default_topology(Path("/m")).model_dump(), "routing": e_p_d["routing"]}
    with pytest.raises(ValueError, match="with 'pd' .* leave it 0"):
        Topology.model_validate(e_pd)


def test_decode_gets_either_prefills_kv_or_what_it_prefills_itself():
    """Image layouts place a KV that arrives from prefill; handles feed a prompt decode
    prefills itself: a request with the one but not its source is refused at parse."""
    from orchestrator.families.base import ImageLayout
    from orchestrator.protocol import DecodeRequest, from_tensor, to_tensor

    fields = {"request_id": "r", "prompt_token_ids": [1, 2], "sampling": SamplingOptions()}
    layout = ImageLayout(tokens=4, grid_thw=(1, 4, 4))
    with_kv = DecodeRequest(**fields, images=[layout], kv_transfer_params={"x": 1})
    assert from_tensor(to_tensor("request", with_kv), "request", DecodeRequest) == with_kv
    without = with_kv.model_dump(exclude={"kv_transfer_params"})
    wire = {"request": np.array([json.dumps(without).encode()], dtype=np.object_)}
    with pytest.raises(InvalidRequest, match="image layouts come with prefill's"):
        from_tensor(wire, "request", DecodeRequest)


def test_same_port_on_different_hosts_is_fine():
    Topology(
        model=Path("/m"),
        servers={
            "a": _server(9000, ["aggregated"]),
            "b": _server(9000, ["aggregated"], "10.0.0.2"),
        },
    )


def test_yaml_load_resolves_model_and_rejects_unknown_keys(tmp_path: Path):
    doc = {
        "model": "models/tiny",
        "servers": {
            "f": {"http_port": 1, "grpc_port": 2, "metrics_port": 3, "stages": ["aggregated"]}
        },
    }
    (tmp_path / "t.yaml").write_text(yaml.safe_dump(doc))
    assert Topology.load(tmp_path / "t.yaml").model == tmp_path / "models" / "tiny"
    doc["transfer"] = {"kind": "carrier-pigeon"}
    (tmp_path / "bad.yaml").write_text(yaml.safe_dump(doc))
    with pytest.raises(ValueError, match="bad.yaml.*transfer.kind"):
        Topology.load(tmp_path / "bad.yaml")


@pytest.mark.parametrize(
    ("raw", "message"),
    [
        ("{max_tokens: 3", "not valid JSON"),
        ("[1, 2]", "must be a JSON object"),
        ('{"max_tokens": 0}', "max_tokens"),
        ('{"temperature": -1}', "temperature"),
        ('{"top_p": 1.5}', "top_p"),
        ('{"bogus": 1}', "bogus"),
    ],
)
def test_sampling_parameters_errors_name_the_field(raw, message):
    with pytest.raises(InvalidRequest, match=message):
        SamplingOptions.parse(raw)


def test_sampling_parameters_defaults_and_stop_string():
    assert SamplingOptions.parse(None) == SamplingOptions()
    assert SamplingOptions.parse(b'{"stop": "END"}').stop == ["END"]


@pytest.mark.parametrize("exc", [InvalidRequest("bad image"), Unavailable("gone")])
def test_error_code_survives_the_wire(exc):
    back = error_from_message(error_message(exc))
    assert type(back) is type(exc) and str(back) == str(exc)
    assert type(error_from_message("plain text")) is StageError


def test_render_writes_every_servers_repository(tiny_model: Path, tmp_path: Path):
    from orchestrator.triton.repository import render

    repos = render(default_topology(tiny_model), tmp_path)
    models = {name: sorted(p.name for p in repo.iterdir()) for name, repo in repos.items()}
    assert models == {
        "encoder": ["encode", "vision_encoder"],
        "llm": ["pd"],
        "front": ["aggregated", "epd"],
    }
    assert (repos["encoder"] / "vision_encoder" / "1" / "model.onnx").stat().st_size > 0
    pd = json.loads((repos["llm"] / "pd" / "1" / "model.json").read_text())
    assert pd["enable_mm_embeds"] is True and "kv_transfer_config" not in pd
    repos = render(default_topology(tiny_model, "E/P/D"), tmp_path)
    prefill = json.loads((repos["prefill"] / "prefill" / "1" / "model.json").read_text())
    assert prefill["kv_transfer_config"]["kv_role"] == "kv_producer"
    assert prefill["enable_mm_embeds"] is True
    decode = json.loads((repos["decode"] / "decode" / "1" / "model.json").read_text())
    assert decode["kv_transfer_config"]["kv_role"] == "kv_consumer"
    assert "enable_mm_embeds" not in decode
    config = (repos["encoder"] / "encode" / "config.pbtxt").read_text()
    assert 'key: "server", value: { string_value: "encoder" }' in config
    assert 'key: "encoder_id"' in config


def test_a_stage_may_scale_out_over_several_servers():
    topo = Topology(
        model=Path("/m"),
        servers={
            "e1": _server(9000, ["encode"]),
            "e2": _server(9100, ["encode"]),
            "f": _server(9200, ["epd"]),
            "p": _server(9300, ["pd"]),
        },
    )
    assert list(topo.servers_of("encode")) == ["e1", "e2"]


@pytest.mark.parametrize(
    "path", sorted((Path(__file__).parents[2] / "topologies").glob("*.yaml")), ids=str
)
def test_shipped_topologies_are_valid(path: Path):
    topology = Topology.load(path)
    assert topology.servers_of("epd") or topology.servers_of("aggregated")


def test_per_server_engine_args_and_instances_are_rendered(tiny_model: Path, tmp_path: Path):
    from orchestrator.triton.repository import render

    topo = default_topology(tiny_model, "E/P/D")
    topo.servers["prefill"].engine_args = {"max_num_seqs": 4}
    topo.servers["encoder"].instances = {"vision_encoder": 2}
    repos = render(Topology.model_validate(topo.model_dump()), tmp_path)
    prefill = json.loads((repos["prefill"] / "prefill" / "1" / "model.json").read_text())
    decode = json.loads((repos["decode"] / "decode" / "1" / "model.json").read_text())
    assert prefill["max_num_seqs"] == 4 and decode["max_num_seqs"] == 16
    assert "count: 2" in (repos["encoder"] / "vision_encoder" / "config.pbtxt").read_text()
    assert "count: 1" in (repos["encoder"] / "encode" / "config.pbtxt").read_text()


def test_engines_serve_the_model_context_unless_the_topology_caps_it(tiny_model: Path):
    from orchestrator.llm import engine_args
    from orchestrator.model.build import _PROFILES

    topo = default_topology(tiny_model, "E/P/D")
    assert engine_args(topo, "prefill", "prefill")["max_model_len"] == 2048
    topo.servers["prefill"].engine_args = {"max_model_len": 512}
    assert engine_args(topo, "prefill", "prefill")["max_model_len"] == 512
    for spec in _PROFILES.values():  # Qwen2-VL's mRoPE covers half of each head, 2:3:3
        t, h, w = spec.mrope_section
        assert t + h + w == spec.text_hidden // spec.text_heads // 2 and 3 * t == 2 * h == 2 * w


def test_instances_of_a_model_the_server_does_not_host_are_rejected():
    with pytest.raises(ValueError, match="sets instances of 'prefill', which it does not host"):
        Topology(
            model=Path("/m"),
            servers={
                "a": ServerSpec(
                    http_port=1,
                    grpc_port=2,
                    metrics_port=3,
                    stages=["aggregated"],
                    instances={"prefill": 2},
                )
            },
        )


def test_a_host_name_needs_an_ip_to_bind():
    ports = {"http_port": 1, "grpc_port": 2, "metrics_port": 3, "stages": ["epd"]}
    with pytest.raises(ValidationError, match="Triton binds only IP addresses .*bind: 0.0.0.0"):
        ServerSpec(host="encoder.svc", **ports)
    with pytest.raises(ValidationError, match="bind 'eth0' is not an IP address"):
        ServerSpec(host="encoder.svc", bind="eth0", **ports)
    spec = ServerSpec(host="encoder.svc", bind="0.0.0.0", **ports)
    assert (spec.bind_address, spec.grpc_url) == ("0.0.0.0", "encoder.svc:2")


def test_cpu_engines_sleep_between_parallel_regions_unless_the_operator_says(
    tiny_model: Path, monkeypatch
):
    """Spinning OpenMP workers took a core from the encoder and the serving path."""
    from orchestrator.llm import engine_env

    topo = default_topology(tiny_model)
    monkeypatch.delenv("OMP_WAIT_POLICY", raising=False)
    assert engine_env(topo, "llm", "pd")["OMP_WAIT_POLICY"] == "PASSIVE"
    monkeypatch.setenv("OMP_WAIT_POLICY", "ACTIVE")
    assert engine_env(topo, "llm", "pd")["OMP_WAIT_POLICY"] == "ACTIVE"


def test_cpu_engines_leave_a_cpu_to_the_serving_path_unless_the_operator_says(
    tiny_model: Path, monkeypatch
):
    """As ``vllm serve`` binds its CPU worker: every usable CPU but one, at least one."""
    from orchestrator.llm import engine_env

    topo = default_topology(tiny_model)
    monkeypatch.delenv("OMP_NUM_THREADS", raising=False)
    for cpus, threads in (({0}, "1"), ({0, 1}, "1"), (set(range(16)), "15")):
        monkeypatch.setattr("os.sched_getaffinity", lambda pid, cpus=cpus: cpus)
        assert engine_env(topo, "llm", "pd")["OMP_NUM_THREADS"] == threads
    monkeypatch.setenv("OMP_NUM_THREADS", "4")
    assert engine_env(topo, "llm", "pd")["OMP_NUM_THREADS"] == "4"
    monkeypatch.delenv("OMP_NUM_THREADS")
    monkeypatch.setenv("VLLM_CPU_OMP_THREADS_BIND", "2-4,8")
    assert engine_env(topo, "llm", "pd")["OMP_NUM_THREADS"] == "4"  # one per bound CPU


def test_cpu_engines_are_bound_as_vllm_serve_binds_its_worker(monkeypatch):
    """vLLM's ``VLLM_CPU_OMP_THREADS_BIND``, applied to the in-process engine's core."""
    from orchestrator.llm import engine_cpus

    monkeypatch.setattr("os.sched_getaffinity", lambda pid: {0, 1, 2, 3})
    assert engine_cpus("auto") == {0, 1, 2}  # the last CPU kept for the serving path
    assert engine_cpus("nobind") is None
    assert engine_cpus("1-2") == {1, 2}
    assert engine_cpus("0,3") == {0, 3}
    monkeypatch.setattr("os.sched_getaffinity", lambda pid: {5})
    assert engine_cpus("auto") == {5}  # one CPU: shared, not left out
    with pytest.raises(ValueError, match=r"\[7\] are not among"):
        engine_cpus("7")  # not this host's
    ports = {"http_port": 1, "grpc_port": 2, "metrics_port": 3, "stages": ["pd"]}
    for bad, why in (("0|1", "no per-rank"), ("x", "not a CPU list"), ("3-1", "names no CPU")):
        with pytest.raises(ValidationError, match=f"VLLM_CPU_OMP_THREADS_BIND.*{why}"):
            ServerSpec(**ports, env={"VLLM_CPU_OMP_THREADS_BIND": bad})


def test_an_engine_process_started_bound_leaves_its_parent_unbound():
    """A child started in ``processes_started_on`` runs on those CPUs; the parent's threads,
    the one that started it and one started meanwhile, keep theirs."""
    import subprocess
    import threading

    from orchestrator.llm import processes_started_on

    own = os.sched_getaffinity(0)
    cpus = {min(own)}
    started = threading.Event()
    seen: list[set[int]] = []
    with processes_started_on(cpus):
        child = subprocess.run(
            [sys.executable, "-c", "import os; print(sorted(os.sched_getaffinity(0)))"],
            capture_output=True,
            text=True,
            check=True,
        )
        thread = threading.Thread(
            target=lambda: (started.wait(), seen.append(os.sched_getaffinity(0)))
        )
        thread.start()
    started.set()
    thread.join()
    assert child.stdout.strip() == str(sorted(cpus))
    assert os.sched_getaffinity(0) == own
    assert seen == [own]
