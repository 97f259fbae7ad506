"""Render one Triton model repository per server from the topology.

The adapters in ``model_repository/`` are copied as they are; what differs per deployment
goes into each ``config.pbtxt`` as parameters (the topology file and the server's name),
so ``model.py`` files stay generic and every setting lives in one validated place.
"""

from __future__ import annotations

import hashlib
import json
import re
import shutil
from pathlib import Path

from orchestrator.config import StageName, Topology
from orchestrator.llm import engine_args

_PACKAGE = Path(__file__).resolve().parents[1]
SOURCE = _PACKAGE / "model_repository"
"""The adapters (config.pbtxt + 1/model.py per model). A wheel has them here: pyproject.toml
maps the top-level ``model_repository/`` into the package."""
if not SOURCE.is_dir():
    # An editable install or a checkout: the folder itself. (setuptools' editable finder
    # cannot import the mapped orchestrator.model_repository, which has no __init__.py:
    # pypa/setuptools#4943, so importlib.resources cannot find it either.)
    SOURCE = _PACKAGE.parent / "model_repository"

MODELS: dict[StageName, tuple[str, ...]] = {
    "encode": ("encode", "vision_encoder"),
    "prefill": ("prefill",),
    "decode": ("decode",),
    "epd": ("epd",),
    "aggregated": ("aggregated",),
}
"""Triton models each stage brings into its server."""


def _parameters(params: dict[str, str]) -> str:
    return "".join(
        f'parameters {{ key: "{k}", value: {{ string_value: "{v}" }} }}\n'
        for k, v in params.items()
    )


def vision_encoder_onnx(topology: Topology, cache_dir: Path) -> tuple[Path, str]:
    """The vision tower exported to ONNX (cached by config + weights) and its encoder id."""
    import onnx

    from orchestrator.encoder.onnx_export import (
        GRAPH_VERSION,
        META_ENCODER_ID,
        export_vision_encoder,
    )

    digest = hashlib.sha256(f"graph-{GRAPH_VERSION}".encode())
    for name in ("config.json", "model.safetensors"):
        path = topology.model / name
        if path.exists():
            digest.update(path.read_bytes())
    out = cache_dir / f"vision_encoder-{digest.hexdigest()[:16]}.onnx"
    if not out.exists():
        cache_dir.mkdir(parents=True, exist_ok=True)
        tmp = out.with_suffix(".tmp.onnx")
        export_vision_encoder(topology.model, tmp)
        tmp.replace(out)
    meta = {p.key: p.value for p in onnx.load(out, load_external_data=False).metadata_props}
    return out, meta[META_ENCODER_ID]


def _vision_encoder(topology: Topology, model_dir: Path, out_dir: Path) -> dict[str, str]:
    """Put the encoder artifact in place; return parameters for the server's models."""
    onnx_path, encoder_id = vision_encoder_onnx(topology, out_dir / "artifacts")
    if topology.encoder.runtime == "tensorrt":
        # A plan is specific to the GPU that builds it: `epd encoder build --trt` makes it
        # on the encoder host; here we only declare the TensorRT backend's config.
        shutil.copyfile(
            SOURCE / "vision_encoder" / "config.tensorrt.pbtxt", model_dir / "config.pbtxt"
        )
        (model_dir / "1" / "model.py").unlink()
        plan = topology.model / "vision_encoder.plan"
        if plan.exists():
            shutil.copyfile(plan, model_dir / "1" / "model.plan")
    else:
        shutil.copyfile(onnx_path, model_dir / "1" / "model.onnx")
    return {"encoder_id": encoder_id, "intra_op_threads": str(topology.encoder.threads)}


def render(topology: Topology, out_dir: Path) -> dict[str, Path]:
    """Write ``out_dir/<server>/models`` for every server; return their paths by server."""
    out_dir = out_dir.resolve()
    out_dir.mkdir(parents=True, exist_ok=True)
    topology_file = out_dir / "topology.json"
    topology_file.write_text(topology.model_dump_json(indent=2))
    repos: dict[str, Path] = {}
    for name, server in topology.servers.items():
        repo = out_dir / name / "models"
        if repo.exists():
            shutil.rmtree(repo)
        for stage in server.stages:
            for model in MODELS[stage]:
                shutil.copytree(
                    SOURCE / model,
                    repo / model,
                    ignore=shutil.ignore_patterns("__pycache__", "config.*.pbtxt"),
                )
        for role in ("prefill", "decode", "aggregated"):
            if role in server.stages:
                args = json.dumps(engine_args(topology, name, role), indent=2)
                (repo / role / "1" / "model.json").write_text(args + "\n")
        params = {"topology": str(topology_file), "server": name}
        if "encode" in server.stages:
            params.update(_vision_encoder(topology, repo / "vision_encoder", out_dir))
        for config in repo.glob("*/config.pbtxt"):
            text = config.read_text()
            count = server.instances.get(config.parent.name)
            if count is not None:
                text, n = re.subn(r"count: \d+", f"count: {count}", text)
                if n != 1:
                    raise ValueError(f"{config}: expected one instance_group count")
            config.write_text(text + _parameters(params))
        repos[name] = repo
    return repos
