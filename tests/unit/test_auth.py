"""The deployment credential: call MACs, handle signatures, where the secret comes from,
and what Triton itself is told to restrict. Pure logic; the servers' side of it runs in
``tests/integration/test_lifecycle.py``."""

from __future__ import annotations

import numpy as np
import pytest

from orchestrator.auth import SECRET_ENV, DeploymentKey, new_secret
from orchestrator.protocol import EmbeddingHandle, NixlLocation, Unauthenticated
from orchestrator.triton.deployment import deployment_secret
from orchestrator.triton.server import TritonServer

KEY = DeploymentKey("k" * 64)
INPUTS = {
    "request": np.array([b'{"prompt": "hi"}'], dtype=np.object_),
    "ids": np.arange(6, dtype=np.int64).reshape(2, 3),
}


def test_a_call_mac_verifies_only_for_its_model_id_and_inputs():
    mac = KEY.sign_call("prefill", "r1", INPUTS)
    KEY.verify_call("prefill", "r1", INPUTS, mac)
    other = {**INPUTS, "request": np.array([b'{"prompt": "ho"}'], dtype=np.object_)}
    reshaped = {**INPUTS, "ids": INPUTS["ids"].reshape(3, 2)}
    for model, rid, inputs in (
        ("decode", "r1", INPUTS),
        ("prefill", "r2", INPUTS),
        ("prefill", "r1", other),
        ("prefill", "r1", reshaped),
    ):
        with pytest.raises(Unauthenticated, match="not valid"):
            KEY.verify_call(model, rid, inputs, mac)
    with pytest.raises(Unauthenticated, match="internal stage"):
        KEY.verify_call("prefill", "r1", INPUTS, None)
    with pytest.raises(Unauthenticated, match="not valid"):
        DeploymentKey("x" * 64).verify_call("prefill", "r1", INPUTS, mac)


def test_a_call_mac_binds_where_its_answers_go():
    """A reply channel named by anyone but the caller would send the answer elsewhere."""
    mac = KEY.sign_call("pd", "r1", INPUTS, "10.0.0.1:4000/abc")
    KEY.verify_call("pd", "r1", INPUTS, mac, "10.0.0.1:4000/abc")
    for reply_to in ("", "10.0.0.2:4000/abc", "10.0.0.1:4000/abd"):
        with pytest.raises(Unauthenticated, match="not valid"):
            KEY.verify_call("pd", "r1", INPUTS, mac, reply_to)
    with pytest.raises(Unauthenticated, match="not valid"):  # nor added to an unbound call
        KEY.verify_call("pd", "r1", INPUTS, KEY.sign_call("pd", "r1", INPUTS), "x:1/y")


def test_parts_cannot_be_shifted_between_fields():
    """Length prefixes: ("ab", "c") and ("a", "bc") are different calls."""
    assert KEY.sign_call("ab", "c", {}) != KEY.sign_call("a", "bc", {})


def _handle(**changes) -> EmbeddingHandle:
    location = NixlLocation(
        agent="a", metadata_addr="10.0.0.1:5555", addr=4096, length=96, nonce="ff"
    )
    fields = dict(
        handle_id="h1",
        location=location,
        shape=(4, 8),
        dtype="float32",
        content_hash="c",
        ttl_s=30.0,
    )
    return EmbeddingHandle(**{**fields, **changes})


def test_a_handle_signature_covers_every_field():
    handle = _handle()
    signed = handle.model_copy(update={"signature": KEY.handle_signature(handle)})
    KEY.check_handle_signature(signed, signed.signature)
    for change in (
        {"content_hash": "attacker"},
        {"shape": (4000, 8)},
        {"ttl_s": 3600.0},
        {"location": handle.location.model_copy(update={"metadata_addr": "6.6.6.6:1"})},
    ):
        forged = signed.model_copy(update=change)
        with pytest.raises(Unauthenticated, match="bad signature"):
            KEY.check_handle_signature(forged, forged.signature)


def test_derived_keys_differ_by_purpose():
    handle = _handle()
    assert KEY.handle_signature(handle) != KEY.sign_call("encode", "h1", {})
    assert KEY.edge_token not in (KEY.handle_signature(handle), KEY.sign_call("x", "y", {}))
    assert KEY.edge_token == DeploymentKey("k" * 64).edge_token


def test_the_secret_comes_from_the_environment_or_is_made_for_a_single_box():
    assert deployment_secret(shared=True, env={SECRET_ENV: "s" * 40}) == "s" * 40
    made = deployment_secret(shared=False, env={})
    assert len(made) >= 32 and made != deployment_secret(shared=False, env={})
    with pytest.raises(ValueError, match="same secret on every host"):
        deployment_secret(shared=True, env={})
    with pytest.raises(ValueError, match="at least 32 characters"):
        deployment_secret(shared=False, env={SECRET_ENV: "short"})
    with pytest.raises(ValueError, match="is not set"):
        DeploymentKey.from_env({})
    assert len(new_secret()) == 64


def _flags(internal_only: bool) -> dict[str, str]:
    server = TritonServer(
        model_repository=None,  # type: ignore[arg-type]
        host="127.0.0.1",
        http_port=1,
        grpc_port=2,
        metrics_port=3,
        log_path=None,  # type: ignore[arg-type]
        edge_token="t0ken",
        internal_only=internal_only,
    )
    flags = [f.split("=", 1) for f in server._restrictions()]
    return dict(flags)


@pytest.mark.parametrize("internal_only", [False, True])
def test_triton_restricts_admin_apis_everywhere_and_inference_on_internal_servers(internal_only):
    flags = _flags(internal_only)
    for flag in ("--grpc-restricted-protocol", "--http-restricted-api"):
        apis, header = flags[flag].split(":", 1)
        assert header == "epd-deployment-key=t0ken"
        expected = {"model-repository", "shared-memory", "trace", "logging"}
        assert set(apis.split(",")) == expected | ({"inference"} if internal_only else set())


def _install(root, version: str | None = "2.59.0", backends=("python", "tensorrt")):
    (root / "bin").mkdir(parents=True)
    (root / "bin" / "tritonserver").write_text("#!/bin/sh\n")
    for backend in backends:
        (root / "backends" / backend).mkdir(parents=True)
    if version:
        (root / "TRITON_VERSION").write_text(version + "\n")
    return root


def test_a_full_triton_install_is_preferred_and_the_wheel_is_the_fallback(tmp_path):
    from orchestrator.triton.server import FULL_INSTALL_ENV, TritonInstall

    absent = tmp_path / "none"
    wheel = TritonInstall.find(env={}, default=absent)
    assert wheel.kind == "wheel" and wheel.version == "2.51.0" and wheel.backends == ["python"]
    container = _install(tmp_path / "opt")
    found = TritonInstall.find(env={}, default=container)
    assert (found.kind, found.root, found.version) == ("full", container, "2.59.0")
    assert found.backend_dir(tmp_path) == container / "backends"
    assert found.libs == [str(container / "lib")]
    assert "Triton 2.59.0 (full: " in found.describe() and "tensorrt" in found.describe()
    other = _install(tmp_path / "custom", version=None, backends=("python",))
    assert TritonInstall.find(env={FULL_INSTALL_ENV: str(other)}, default=container).root == other
    assert TritonInstall.find(other, env={}, default=container).version == "unknown"
    with pytest.raises(ValueError, match="no Triton server at"):
        TritonInstall.find(absent, env={}, default=container)
    with pytest.raises(ValueError, match="needs Triton's tensorrt backend"):
        wheel.require_backend("tensorrt", "server 'encoder' (encoder.runtime tensorrt)")
    found.require_backend("tensorrt", "ok")


def test_a_tensorrt_encoder_on_the_wheel_is_refused_before_anything_starts(tmp_path):
    from orchestrator.config import ServerSpec, Topology
    from orchestrator.triton.deployment import triton_installs
    from orchestrator.triton.server import TritonInstall

    servers = {
        "encoder": ServerSpec(http_port=1, grpc_port=2, metrics_port=3, stages=["encode"]),
        "llm": ServerSpec(http_port=7, grpc_port=8, metrics_port=9, stages=["pd"]),
        "front": ServerSpec(http_port=4, grpc_port=5, metrics_port=6, stages=["epd"]),
    }
    topology = Topology(model=tmp_path, servers=servers, encoder={"runtime": "tensorrt"})
    absent = tmp_path / "none"

    def find(path):
        return TritonInstall.find(path, env={}, default=absent)

    assert set(triton_installs(topology, ["front"], find)) == {"front"}  # no encoder: fine
    with pytest.raises(ValueError, match="encoder.runtime tensorrt"):
        triton_installs(topology, ["encoder", "front"], find)
    full = _install(tmp_path / "full")
    topology.servers["encoder"].triton = full
    assert triton_installs(topology, ["encoder"], find)["encoder"].root == full
