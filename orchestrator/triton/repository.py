"""Render one Triton model repository per server from the topology.

The adapters in ``model_repository/`` are copied as they are; what differs per deployment
goes into each ``config.pbtxt`` as parameters (the topology file and the server's name),
so ``model.py`` files stay generic and every setting lives in one validated place.
"""

from __future__ import annotations

import hashlib
import shutil
from pathlib import Path

from orchestrator.config import StageName, Topology

SOURCE = Path(__file__).resolve().parents[2] / "model_repository"
"""The adapters shipped with the package (config.pbtxt + 1/model.py per model)."""

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


def vision_encoder_onnx(topology: Topology, cache_dir: Path) -> Path:
    """The vision tower exported to ONNX, cached by the model's config and weights."""
    from orchestrator.encoder.onnx_export import export_vision_encoder

    digest = hashlib.sha256()
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
    return out


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
                dest = repo / model
                shutil.copytree(SOURCE / model, dest, ignore=shutil.ignore_patterns("__pycache__"))
                config = dest / "config.pbtxt"
                params = {"topology": str(topology_file), "server": name}
                config.write_text(config.read_text() + _parameters(params))
        if "encode" in server.stages:
            onnx = vision_encoder_onnx(topology, out_dir / "artifacts")
            shutil.copyfile(onnx, repo / "vision_encoder" / "1" / "model.onnx")
        repos[name] = repo
    return repos
