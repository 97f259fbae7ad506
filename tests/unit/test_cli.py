"""The `epd` commands that need no server: clear failures, real artifacts."""

from __future__ import annotations

from pathlib import Path

import onnx
import pytest

from orchestrator.cli import main


def test_trt_build_on_a_cpu_machine_says_why_it_cannot(tiny_model: Path, capsys):
    assert main(["encoder", "build", "--trt", str(tiny_model)]) == 2
    assert "TensorRT is not installed" in capsys.readouterr().err
    assert not (tiny_model / "vision_encoder.plan").exists()


def test_encoder_export_writes_onnx_with_identity(tiny_model: Path, tmp_path: Path):
    out = tmp_path / "vision.onnx"
    assert main(["encoder", "export", str(tiny_model), str(out)]) == 0
    meta = {p.key: p.value for p in onnx.load(out, load_external_data=False).metadata_props}
    assert meta["epd.encoder_id"].startswith("qwen2_vl-vision-")


def test_invalid_topology_file_is_one_clear_line(tmp_path: Path):
    bad = tmp_path / "bad.yaml"
    bad.write_text(
        "model: /m\nservers: {a: {http_port: 1, grpc_port: 1, metrics_port: 2, stages: [epd]}}\n"
    )
    with pytest.raises(SystemExit) as exc:
        main(["render", "--topology", str(bad), str(tmp_path / "out")])
    message = str(exc.value)
    assert message.startswith("epd: ") and "uses one port twice" in message
    assert "'epd' needs stage 'encode'" in message


def test_the_embedded_layout_holds_the_model_once_unless_asked_for_the_baseline(
    tiny_model: Path, tmp_path: Path, capsys
):
    """`epd serve`/`epd render` on a checkpoint start one engine (`pd`); `--baseline` adds
    `aggregated`, a second copy of the model, as `make serve` asks for its demo."""
    served = {}
    for flags in ([], ["--baseline"]):
        out = tmp_path / ("baseline" if flags else "plain")
        assert main(["render", "--model", str(tiny_model), *flags, str(out)]) == 0
        served[bool(flags)] = sorted(p.name for p in (out / "front" / "models").iterdir())
    assert served == {False: ["epd"], True: ["aggregated", "epd"]}
    capsys.readouterr()

    topology = tmp_path / "topology.yaml"
    topology.write_text(f"model: {tiny_model}\n")
    with pytest.raises(SystemExit) as exc:
        main(["serve", "--topology", str(topology), "--baseline"])
    assert "a topology file names its front's models itself" in str(exc.value)
