"""Render one Triton model repository per server from the topology.

The adapters in ``model_repository/`` are copied as they are; what differs per deployment
goes into each ``config.pbtxt`` as parameters (the topology file and the server's name),
so ``model.py`` files stay generic and every setting lives in one validated place.
"""

from __future__ import annotations

import json
import os
import re
import shutil
from pathlib import Path

from orchestrator.config import StageName, Topology
from orchestrator.families import ModelFamily
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
    "pd": ("pd",),
    "epd": ("epd",),
    "aggregated": ("aggregated",),
}
"""Triton models each stage brings into its server."""


def _parameters(params: dict[str, str]) -> str:
    return "".join(
        f'parameters {{ key: "{k}", value: {{ string_value: "{v}" }} }}\n'
        for k, v in params.items()
    )


def vision_encoder_onnx(
    topology: Topology, cache_dir: Path, progress: bool = False, family: ModelFamily | None = None
) -> tuple[Path, str]:
    """The vision encoder exported to ONNX and its encoder id.

    Exports are cached in ``cache_dir`` under a key covering the checkpoint (config,
    processor settings, every weight file's content), the family's graph version, the
    exporter's version and the target runtime; a changed shard means a new export.
    """
    from orchestrator.encoder.onnx_export import (
        META_ENCODER_ID,
        describe,
        export_cache_key,
        export_vision_encoder,
        read_metadata,
    )
    from orchestrator.families import family_for

    target = topology.encoder.runtime
    family = family or family_for(topology.model)
    key = export_cache_key(family, target, cache_dir / "weight-digests.json")
    out = cache_dir / f"vision_encoder-{key[:16]}" / "model.onnx"
    cached = out.exists()
    if not cached:
        tmp = out.parent.with_name(out.parent.name + f".tmp{os.getpid()}")
        shutil.rmtree(tmp, ignore_errors=True)
        export_vision_encoder(topology.model, tmp / out.name, target=target, progress=progress)
        shutil.rmtree(out.parent, ignore_errors=True)
        tmp.replace(out.parent)
    if progress:
        print(f"vision encoder{' (cached)' if cached else ''}: {describe(out)}", flush=True)
    return out, read_metadata(out)[META_ENCODER_ID]


def _vision_encoder(
    topology: Topology, model_dir: Path, out_dir: Path, progress: bool
) -> dict[str, str]:
    """Put the encoder artifact in place; return parameters for the server's models."""
    from orchestrator.encoder.onnx_export import OUTPUT_NAME, onnx_files
    from orchestrator.families import family_for

    family = family_for(topology.model)
    onnx_path, encoder_id = vision_encoder_onnx(topology, out_dir / "artifacts", progress, family)
    version = model_dir / "1"
    if topology.encoder.runtime == "tensorrt":
        # A plan is specific to the GPU that builds it: `epd encoder build --trt` makes it
        # on the encoder host; here we only declare the TensorRT backend's config.
        shutil.copyfile(
            SOURCE / "vision_encoder" / "config.tensorrt.pbtxt", model_dir / "config.pbtxt"
        )
        (version / "model.py").unlink()
        plan = topology.model / "vision_encoder.plan"
        if plan.exists():
            shutil.copyfile(plan, version / "model.plan")
    else:
        for file in onnx_files(onnx_path):  # links: a 2.6 GB tower is not copied per server
            (version / file.name).symlink_to(file)
    config = model_dir / "config.pbtxt"
    config.write_text(config.read_text() + _io_config(family, OUTPUT_NAME))
    return {"encoder_id": encoder_id, "intra_op_threads": str(topology.encoder.threads)}


def _io_config(family: ModelFamily, output: str) -> str:
    """The ``input``/``output`` sections of ``vision_encoder``'s config: the family's graph."""
    types = {"float32": "TYPE_FP32", "int64": "TYPE_INT64"}
    rows = ",\n".join(
        f'  {{ name: "{i.name}", data_type: {types[i.dtype]}, dims: {list(i.dims)} }}'
        for i in family.graph_inputs
    )
    return (
        f"input [\n{rows}\n]\n"
        f'output [\n  {{ name: "{output}", data_type: TYPE_FP32, '
        f"dims: [-1, {family.hidden_size}] }}\n]\n"
    )


def render(topology: Topology, out_dir: Path, progress: bool = False) -> dict[str, Path]:
    """Write ``out_dir/<server>/models`` for every server; return their paths by server.
    ``progress``: show the encoder export's progress and say where it went."""
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
        for role in ("prefill", "decode", "pd", "aggregated"):
            if role in server.stages:
                args = json.dumps(engine_args(topology, name, role), indent=2)
                (repo / role / "1" / "model.json").write_text(args + "\n")
        params = {"topology": str(topology_file), "server": name}
        if "encode" in server.stages:
            params.update(_vision_encoder(topology, repo / "vision_encoder", out_dir, progress))
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
