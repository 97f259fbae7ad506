"""A real-size vision tower: export cost and encoder time per image, ONNX Runtime vs torch.

``epd bench encoder`` builds a tower-only checkpoint with Qwen2.5-VL-7B's vision config
(random weights, ~670M parameters, bf16 shards as a download has them), exports it the way
``epd serve`` does (external data: the float32 tower is 2.7 GB), then times one image per
call at each size through the ONNX Runtime export and through HF's torch tower on the same
threads. Every step runs in its own process so its peak RSS is its own (``VmHWM``).
"""

from __future__ import annotations

import json
import subprocess
import sys
import time
from pathlib import Path
from typing import Any

# Qwen2.5-VL-7B-Instruct's vision_config (as published), plus what the processor ships.
QWEN2_5_VL_7B_VISION = {
    "depth": 32,
    "hidden_size": 1280,
    "intermediate_size": 3420,
    "num_heads": 16,
    "out_hidden_size": 3584,
    "patch_size": 14,
    "spatial_merge_size": 2,
    "temporal_patch_size": 2,
    "window_size": 112,
    "fullatt_block_indexes": [7, 15, 23, 31],
    "hidden_act": "silu",
    "tokens_per_second": 2,
}
PROCESSOR = {"min_pixels": 3136, "max_pixels": 12845056, "patch_size": 14, "merge_size": 2}


def _peak_rss_mib() -> float:
    for line in Path("/proc/self/status").read_text().splitlines():
        if line.startswith("VmHWM:"):
            return int(line.split()[1]) / 1024
    return float("nan")


def build(out: Path) -> dict[str, Any]:
    """Tower-only checkpoint: config, processor settings, ``visual.*`` weights in bf16 shards."""
    import torch
    from transformers import Qwen2_5_VLConfig, Qwen2VLImageProcessorPil
    from transformers.models.qwen2_5_vl.modeling_qwen2_5_vl import (
        Qwen2_5_VisionTransformerPretrainedModel,
    )

    start = time.perf_counter()
    config = Qwen2_5_VLConfig(
        vision_config=QWEN2_5_VL_7B_VISION,
        text_config={"hidden_size": 3584, "num_hidden_layers": 1, "vocab_size": 1024},
    )
    torch.manual_seed(0)
    tower = Qwen2_5_VisionTransformerPretrainedModel._from_config(
        config.vision_config, dtype=torch.bfloat16
    )
    out.mkdir(parents=True, exist_ok=True)
    config.save_pretrained(out)
    image = Qwen2VLImageProcessorPil(
        min_pixels=PROCESSOR["min_pixels"], max_pixels=PROCESSOR["max_pixels"]
    )
    image.save_pretrained(out)
    _save_sharded({f"visual.{k}": v for k, v in tower.state_dict().items()}, out, 1 << 30)
    params = sum(p.numel() for p in tower.parameters())
    return {"parameters": params, "build_s": time.perf_counter() - start}


def _save_sharded(tensors: dict, out: Path, shard_bytes: int) -> None:
    from safetensors.torch import save_file

    shards: list[dict] = [{}]
    size = 0
    for name, tensor in tensors.items():
        nbytes = tensor.numel() * tensor.element_size()
        if size + nbytes > shard_bytes and shards[-1]:
            shards.append({})
            size = 0
        shards[-1][name] = tensor.contiguous()
        size += nbytes
    weight_map = {}
    for i, shard in enumerate(shards, start=1):
        name = f"model-{i:05d}-of-{len(shards):05d}.safetensors"
        save_file(shard, out / name, metadata={"format": "pt"})
        weight_map.update(dict.fromkeys(shard, name))
    index = {"metadata": {}, "weight_map": weight_map}
    (out / "model.safetensors.index.json").write_text(json.dumps(index, indent=1))


def export(model: Path, out: Path) -> dict[str, Any]:
    from orchestrator.encoder.onnx_export import export_vision_encoder, onnx_files

    start = time.perf_counter()
    path = export_vision_encoder(model, out / "model.onnx", progress=True)
    return {
        "export_s": time.perf_counter() - start,
        "files": {p.name: p.stat().st_size for p in onnx_files(path)},
    }


def _image(side: int):
    from PIL import Image

    from orchestrator.client import sample_photo
    from orchestrator.encoder.preprocess import decode_image

    return decode_image(sample_photo("astronaut")).resize((side, side), Image.Resampling.BICUBIC)


def run_ort(model: Path, onnx: Path, sides: list[int], threads: int, repeats: int) -> dict:
    from orchestrator.encoder.runtime import OnnxRuntimeEncoder
    from orchestrator.families import family_for

    family = family_for(model)
    encoder = OnnxRuntimeEncoder(onnx, intra_op_threads=threads)
    return {str(side): _time(lambda f: encoder.run(f), family, side, repeats) for side in sides}


def run_torch(model: Path, sides: list[int], threads: int, repeats: int) -> dict:
    import torch
    from transformers import AutoConfig
    from transformers.models.qwen2_5_vl.modeling_qwen2_5_vl import (
        Qwen2_5_VisionTransformerPretrainedModel,
    )

    from orchestrator.families import family_for

    torch.set_num_threads(threads)
    family = family_for(model)
    config = AutoConfig.from_pretrained(model).vision_config
    tower = Qwen2_5_VisionTransformerPretrainedModel._from_config(
        config, dtype=torch.float32, attn_implementation="sdpa"
    ).eval()
    tower.load_state_dict(family.checkpoint.load(family.vision_prefixes), strict=True)

    def forward(feeds):
        with torch.no_grad():
            grid = torch.tensor([family.image_layout(*feeds["_size"]).grid_thw])
            return tower(torch.from_numpy(feeds["pixel_values"]), grid_thw=grid).pooler_output

    return {str(side): _time(forward, family, side, repeats) for side in sides}


def _time(forward, family, side: int, repeats: int) -> dict[str, Any]:
    feeds = dict(family.encoder_input(_image(side)).feeds)
    feeds["_size"] = (side, side)
    forward(feeds)  # warm-up: first-call allocations and kernel selection
    times = []
    for _ in range(repeats):
        start = time.perf_counter()
        forward(feeds)
        times.append(time.perf_counter() - start)
    tokens = family.image_layout(side, side).tokens
    return {"ms": [t * 1000 for t in times], "tokens": tokens, "patches": tokens * 4}


def _child(step: str, *args: str, timeout_s: float = 3600) -> dict[str, Any]:
    """Run one step in a fresh interpreter; its result plus its own peak RSS."""
    proc = subprocess.run(
        [sys.executable, "-m", "epd_bench.encoder", step, *args],
        capture_output=True,
        text=True,
        timeout=timeout_s,
    )
    lines = [ln for ln in proc.stdout.splitlines() if ln.startswith("@@ ")]
    if proc.returncode or not lines:
        raise RuntimeError(
            f"bench encoder {step} failed ({proc.returncode}):\n{proc.stderr[-3000:]}"
        )
    return json.loads(lines[-1][3:])


def run(workdir: Path, sides: list[int], threads: int, repeats: int) -> dict[str, Any]:
    from epd_bench.schema import machine_info

    model, onnx = workdir / "checkpoint", workdir / "onnx"
    report: dict[str, Any] = {"machine": machine_info(), "threads": threads, "sides": sides}
    report["build"] = _child("build", str(model))
    report["export"] = _child("export", str(model), str(onnx))
    common = [str(model), ",".join(map(str, sides)), str(threads), str(repeats)]
    report["onnxruntime"] = _child("ort", str(onnx / "model.onnx"), *common)
    report["torch"] = _child("torch", *common)
    return report


def summary(report: dict[str, Any]) -> str:
    export = report["export"]
    size = sum(export["files"].values()) / 2**30
    lines = [
        f"tower: {report['build']['parameters'] / 1e6:.0f}M parameters (Qwen2.5-VL-7B vision)",
        f"export: {export['export_s']:.0f} s, {size:.2f} GiB ({', '.join(export['files'])}), "
        f"peak RSS {export['peak_rss_mib'] / 1024:.1f} GiB",
    ]
    for side in map(str, report["sides"]):
        ort, pt = report["onnxruntime"][side], report["torch"][side]
        o, t = min(ort["ms"]), min(pt["ms"])
        lines.append(
            f"{side}x{side} ({ort['tokens']} tokens): ONNX Runtime {o:.0f} ms, torch {t:.0f} ms "
            f"(ORT/torch {o / t:.2f}x, best of {len(ort['ms'])})"
        )
    lines.append(
        f"peak RSS: ONNX Runtime {report['onnxruntime']['peak_rss_mib'] / 1024:.1f} GiB, "
        f"torch {report['torch']['peak_rss_mib'] / 1024:.1f} GiB"
    )
    return "\n".join(lines)


if __name__ == "__main__":
    step, args = sys.argv[1], sys.argv[2:]
    if step == "build":
        result = build(Path(args[0]))
    elif step == "export":
        result = export(Path(args[0]), Path(args[1]))
    else:
        onnx = [Path(args.pop(0))] if step == "ort" else []
        model, sides, threads, repeats = Path(args[0]), args[1], int(args[2]), int(args[3])
        sizes = [int(s) for s in sides.split(",")]
        if step == "ort":
            result = run_ort(model, onnx[0], sizes, threads, repeats)
        else:
            result = run_torch(model, sizes, threads, repeats)
    result["peak_rss_mib"] = _peak_rss_mib()
    print("@@ " + json.dumps(result), flush=True)
