"""Checkpoints as users have them: hub layout accepted, broken downloads refused with a
message naming the file, the export cache following every shard."""

from __future__ import annotations

import json
import shutil
from pathlib import Path

import pytest

from orchestrator.cli import main
from orchestrator.config import default_topology
from orchestrator.model.checkpoint import INDEX, Checkpoint, CheckpointError


@pytest.fixture
def hub_copy(hub_checkpoint, tmp_path: Path) -> Path:
    """A private copy of the Qwen2.5-VL hub checkpoint, free to damage."""
    return Path(shutil.copytree(hub_checkpoint("qwen2_5_vl"), tmp_path / "qwen2_5_vl"))


def _shards(path: Path) -> list[Path]:
    return sorted(path.glob("model-*.safetensors"))


def test_hub_layout_is_read_and_only_vision_shards_are_opened(hub_checkpoint):
    from orchestrator.families import family_for

    family = family_for(hub_checkpoint("qwen2_5_vl"))
    checkpoint = family.checkpoint
    assert len(checkpoint.weight_files) >= 3 and (checkpoint.path / INDEX).exists()
    assert json.loads((checkpoint.path / "config.json").read_text())["dtype"] == "bfloat16"
    opened: list[Path] = []

    def progress(files):
        for file in files:
            opened.append(file)
            yield file

    weights = checkpoint.load(family.vision_prefixes, progress=progress)
    vision_files = {f for n, f in checkpoint.tensor_files.items() if n.startswith("visual.")}
    assert set(opened) == vision_files and len(vision_files) < len(checkpoint.weight_files)
    assert all(t.dtype.is_floating_point and t.dtype.itemsize == 4 for t in weights.values())
    assert not any(name.startswith(("visual.", "model.")) for name in weights)


def test_not_a_directory_or_not_a_checkpoint(tmp_path: Path):
    with pytest.raises(CheckpointError, match="no such directory"):
        Checkpoint.open(tmp_path / "missing")
    with pytest.raises(CheckpointError, match="has no config.json .*Hugging Face download"):
        Checkpoint.open(tmp_path)
    (tmp_path / "config.json").write_text("{not json")
    with pytest.raises(CheckpointError, match="config.json: not valid JSON"):
        Checkpoint.open(tmp_path)
    (tmp_path / "config.json").write_text("{}")
    with pytest.raises(CheckpointError, match="no 'model_type'"):
        Checkpoint.open(tmp_path)
    (tmp_path / "config.json").write_text('{"model_type": "qwen2_vl"}')
    (tmp_path / "pytorch_model.bin").write_bytes(b"x")
    with pytest.raises(CheckpointError, match="found pytorch_model.bin: only safetensors"):
        Checkpoint.open(tmp_path)


def test_a_missing_shard_is_named(hub_copy: Path):
    victim = _shards(hub_copy)[1]
    victim.unlink()
    with pytest.raises(CheckpointError, match=f"shard\\(s\\) {victim.name} named in {INDEX}"):
        Checkpoint.open(hub_copy)


def test_a_truncated_shard_is_named(hub_copy: Path):
    victim = _shards(hub_copy)[0]
    victim.write_bytes(victim.read_bytes()[:-100])
    with pytest.raises(CheckpointError, match=f"{victim.name}: truncated: tensor"):
        Checkpoint.open(hub_copy)


def test_a_corrupt_shard_is_named(hub_copy: Path):
    victim = _shards(hub_copy)[0]
    victim.write_bytes(b"\xff" * 64)
    with pytest.raises(CheckpointError, match=f"{victim.name}: corrupt safetensors header"):
        Checkpoint.open(hub_copy)


def test_a_shard_without_the_tensors_the_index_promises(hub_copy: Path):
    shards = _shards(hub_copy)
    shutil.copyfile(shards[0], shards[1])
    with pytest.raises(CheckpointError, match=f"{shards[1].name}: lacks .* tensor"):
        Checkpoint.open(hub_copy)


def test_the_fingerprint_follows_every_shard_and_memoises_hashes(hub_copy: Path, tmp_path):
    memo = tmp_path / "digests.json"
    before = Checkpoint.open(hub_copy).fingerprint(memo)
    assert len(json.loads(memo.read_text())) == len(_shards(hub_copy))
    assert Checkpoint.open(hub_copy).fingerprint(memo) == before
    victim = _shards(hub_copy)[-1]  # holds no vision weights, still part of the checkpoint
    data = bytearray(victim.read_bytes())
    data[-1] ^= 0xFF
    victim.write_bytes(bytes(data))
    assert Checkpoint.open(hub_copy).fingerprint(memo) != before


def test_the_export_cache_is_invalidated_when_a_shard_changes(hub_copy: Path, tmp_path):
    from orchestrator.triton.repository import vision_encoder_onnx

    topology = default_topology(hub_copy)
    first, encoder_id = vision_encoder_onnx(topology, tmp_path / "cache")
    again, _ = vision_encoder_onnx(topology, tmp_path / "cache")
    assert again == first and first.stat().st_mtime_ns == again.stat().st_mtime_ns
    vision = Checkpoint.open(hub_copy).tensor_files["visual.blocks.0.attn.qkv.weight"]
    data = bytearray(vision.read_bytes())
    data[-2] ^= 0x01
    vision.write_bytes(bytes(data))
    changed, changed_id = vision_encoder_onnx(topology, tmp_path / "cache")
    assert changed != first and changed.exists()


@pytest.mark.parametrize(
    ("damage", "message"),
    [
        ("not_a_checkpoint", "is not a checkpoint: it has no config.json"),
        ("unsupported", "'gemma3' is not supported; supported families: qwen2_vl, "),
        ("pool_too_small", "transfer.pool_bytes=65536 cannot hold one image's embeddings"),
    ],
)
def test_serve_refuses_before_any_server_starts(damage, message, hub_copy, tmp_path, capsys):
    args = ["serve", "--workdir", str(tmp_path / "work"), "--model", str(hub_copy)]
    if damage == "not_a_checkpoint":
        args[-1] = str(tmp_path)
    elif damage == "unsupported":
        config = json.loads((hub_copy / "config.json").read_text())
        (hub_copy / "config.json").write_text(json.dumps({**config, "model_type": "gemma3"}))
    else:
        topology = default_topology(hub_copy).model_dump(mode="json")
        topology["transfer"]["pool_bytes"] = 65536
        (tmp_path / "t.yaml").write_text(json.dumps(topology))
        args[-2:] = ["--topology", str(tmp_path / "t.yaml")]
    assert main(args) == 2
    err = capsys.readouterr().err
    assert err.startswith("epd serve: ") and message in err
    assert not (tmp_path / "work" / "logs").exists()
