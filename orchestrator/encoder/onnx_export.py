"""Export a checkpoint's vision tower (+ projector) to ONNX, whatever its family.

The family supplies the graph (a torch module over the family's graph inputs, built from the
checkpoint's vision weights only) and an example input; this module traces it with dynamic
axes, stamps the encoder's identity into ``metadata_props`` and writes the file — with ONNX
external data (``<name>.data`` beside it) once the weights pass what one protobuf can hold.

``target`` picks how attention is written: ``onnxruntime`` uses ORT's fused
``MultiHeadAttention`` (flash attention on CPU), ``tensorrt`` plain ops that TensorRT fuses.
"""

from __future__ import annotations

import hashlib
import sys
import time
import warnings
from pathlib import Path
from typing import Any

from orchestrator.families import GraphTarget, ModelFamily, family_for

OUTPUT_NAME = "image_embeds"
OPSET = 18
EXPORTER_VERSION = 4
"""Bumped when this driver changes what it writes (with each family's ``graph_version``,
part of the export cache key). 4: family graphs, one image per call, fused attention."""
EXTERNAL_DATA_BYTES = 1 << 30
"""Weights above this go to a ``.data`` file: one protobuf cannot exceed 2 GB."""
MAX_AXIS = 1 << 20
"""Upper bound of dynamic axes at export (patches of the largest image: 65536 for
Qwen2.5-VL's default max_pixels)."""
META_ENCODER_ID = "epd.encoder_id"
META_WEIGHTS_SHA = "epd.vision_weights_sha256"
META_PREPROCESS = "epd.preprocess"
META_HIDDEN_SIZE = "epd.hidden_size"
META_FAMILY = "epd.family"
META_TARGET = "epd.target"


def vision_weights_sha256(weights: dict[str, Any]) -> str:
    """Hash of the vision weights (names, shapes, float32 bytes), independent of file layout,
    shard boundaries and stored dtype, so exports, TensorRT plans and HF towers made from one
    checkpoint share an identity."""
    import torch

    h = hashlib.sha256()
    for name, tensor in sorted(weights.items()):
        t = tensor.detach().to("cpu", torch.float32).contiguous()
        h.update(f"{name}|{tuple(t.shape)}\0".encode())
        h.update(t.reshape(-1).view(torch.uint8).numpy().tobytes())
    return h.hexdigest()


def export_cache_key(family: ModelFamily, target: GraphTarget, memo: Path | None) -> str:
    """What an export depends on: the checkpoint (config, processor, every weight file's
    content), the family's graph version, this exporter's version and the target."""
    h = hashlib.sha256(family.checkpoint.fingerprint(memo).encode())
    h.update(f"|{family.model_type}|{family.graph_version}|{EXPORTER_VERSION}|{target}".encode())
    return h.hexdigest()


def export_vision_encoder(
    model_dir: str | Path,
    out_path: str | Path,
    target: GraphTarget = "onnxruntime",
    progress: bool = False,
) -> Path:
    """Write the vision encoder of the checkpoint in ``model_dir`` to ``out_path`` (ONNX).

    Inputs: the family's ``graph_inputs``; output ``image_embeds`` float32
    ``[tokens, hidden_size]``. The encoder identity, weight hash, preprocessing settings and
    embedding width go into ``metadata_props``. ``progress`` draws a bar on stderr.
    """
    import onnx
    import torch
    from tqdm import tqdm

    from orchestrator.families import graph_ops

    family = family_for(model_dir)
    out_path = Path(out_path)
    checkpoint = family.checkpoint
    bar = tqdm(
        total=len(checkpoint.weight_files) + 3,
        desc=f"exporting {family.model_type} vision encoder",
        unit="step",
        file=sys.stderr,
        disable=not progress,
    )
    start = time.monotonic()
    with bar:

        def shards_read(files):
            for file in files:
                bar.set_postfix_str(f"reading {file.name}")
                yield file
                bar.update(1)

        weights = checkpoint.load(family.vision_prefixes, progress=shards_read)
        bar.update(len(checkpoint.weight_files) - bar.n)  # shards without vision weights
        weights_sha = vision_weights_sha256(weights)
        bar.set_postfix_str("building the graph")
        graph = family.vision_graph(weights, target)
        example = family.example_input()
        inputs = family.graph_inputs
        args = tuple(torch.from_numpy(example.feeds[i.name]) for i in inputs)
        dims = _dims(family)
        dynamic_shapes = _shaped_like(
            graph.forward, [{axis: dims[name] for axis, name in i.dynamic} for i in inputs]
        )
        bar.update(1)
        bar.set_postfix_str("tracing")
        with torch.no_grad(), warnings.catch_warnings():
            # torch 2.13's exporter warns about its own pytree internals and about inputs
            # sharing one axis name (which is the intent).
            warnings.filterwarnings("ignore", message=".*LeafSpec.*", category=FutureWarning)
            warnings.filterwarnings("ignore", message="# The axis name", category=UserWarning)
            program = torch.onnx.export(
                graph,
                args,
                dynamo=True,
                opset_version=OPSET,
                input_names=[i.name for i in inputs],
                output_names=[OUTPUT_NAME],
                dynamic_shapes=dynamic_shapes,
                custom_translation_table=graph_ops.translation_table(target),
                optimize=True,
                verbose=False,
            )
        bar.update(1)
        bar.set_postfix_str(f"writing {out_path.name}")
        meta = {
            META_ENCODER_ID: family.encoder_id(weights_sha),
            META_WEIGHTS_SHA: weights_sha,
            META_PREPROCESS: family.preprocess_fingerprint(),
            META_HIDDEN_SIZE: str(family.hidden_size),
            META_FAMILY: family.model_type,
            META_TARGET: target,
        }
        program.model.metadata_props.clear()
        program.model.metadata_props.update(meta)
        weight_bytes = sum(t.numel() * 4 for t in weights.values())
        del weights, graph
        out_path.parent.mkdir(parents=True, exist_ok=True)
        for stale in (out_path, external_data_path(out_path)):
            stale.unlink(missing_ok=True)
        program.save(out_path, external_data=weight_bytes > EXTERNAL_DATA_BYTES)
        onnx.checker.check_model(str(out_path))
        bar.update(1)
    if progress:
        bar.write(f"exported in {time.monotonic() - start:.1f} s", file=sys.stderr)
    return out_path


def describe(onnx_path: Path) -> str:
    """One line saying where an export is and how big: for users to find their artefacts."""
    size = sum(p.stat().st_size for p in onnx_files(onnx_path)) / 2**20
    files = " + ".join(p.name for p in onnx_files(onnx_path))
    return f"{onnx_path.parent}/ ({files}, {size:.1f} MiB)"


def _dims(family: ModelFamily) -> dict[str, Any]:
    """One ``torch.export.Dim`` per dynamic axis name (times its multiple, if any)."""
    import torch

    names = {name for i in family.graph_inputs for _, name in i.dynamic}
    multiples = family.dim_multiples()
    dims = {}
    for name in sorted(names):
        multiple = multiples.get(name, 1)
        base = torch.export.Dim(name if multiple == 1 else f"{name}_groups", min=1, max=MAX_AXIS)
        dims[name] = base * multiple if multiple > 1 else base
    return dims


def _shaped_like(forward, specs: list[dict]) -> list:
    """Per-input dynamic shapes in the structure of ``forward``'s arguments: graphs take a
    family's extra inputs as ``*extras``, which torch.export sees as one tuple argument."""
    import inspect

    params = list(inspect.signature(forward).parameters.values())
    named = [p for p in params if p.kind is p.POSITIONAL_OR_KEYWORD]
    if any(p.kind is p.VAR_POSITIONAL for p in params) and len(specs) > len(named):
        return [*specs[: len(named)], tuple(specs[len(named) :])]
    return specs


def external_data_path(onnx_path: Path) -> Path:
    """Where ``program.save(external_data=True)`` puts the weights of ``onnx_path``."""
    return onnx_path.with_name(onnx_path.name + ".data")


def onnx_files(onnx_path: Path) -> list[Path]:
    """The ONNX file and its external data file, if it has one."""
    data = external_data_path(onnx_path)
    return [onnx_path, data] if data.exists() else [onnx_path]


def read_metadata(onnx_path: Path) -> dict[str, str]:
    import onnx

    proto = onnx.load(str(onnx_path), load_external_data=False)
    return {p.key: p.value for p in proto.metadata_props}
