"""Shared fixtures for encoder unit tests: one export per family and target per session."""

from __future__ import annotations

from pathlib import Path

import pytest
import skimage.data
from PIL import Image


@pytest.fixture(scope="session")
def exported(tmp_path_factory: pytest.TempPathFactory, hub_checkpoint):
    """``exported(family, target="onnxruntime")``: path of that family's ONNX export."""
    from orchestrator.encoder.onnx_export import export_vision_encoder

    done: dict[tuple[str, str], Path] = {}

    def get(family: str, target: str = "onnxruntime") -> Path:
        if (family, target) not in done:
            out = tmp_path_factory.mktemp(f"onnx-{family}-{target}") / "model.onnx"
            done[family, target] = export_vision_encoder(
                hub_checkpoint(family),
                out,
                target=target,  # type: ignore[arg-type]
            )
        return done[family, target]

    return get


PHOTO_NAMES = (
    "astronaut",
    "coffee",
    "chelsea",
    "strip_30x500",
    "large_1000x700",
    "gray_camera",
    "tiny_12x9",
    "wide_900x40",
)


def photo_named(name: str) -> Image.Image:
    """Real photos plus odd sizes: a 30x500 strip (upscaled), a 1000x700 (downscaled), a
    12x9 thumbnail (below every family's minimum) and a 900x40 strip (windows cut short)."""
    sizes = {
        "strip_30x500": ("coffee", (30, 500)),
        "large_1000x700": ("astronaut", (1000, 700)),
        "tiny_12x9": ("chelsea", (12, 9)),
        "wide_900x40": ("coffee", (900, 40)),
    }
    if name in sizes:
        base, size = sizes[name]
        return photo_named(base).resize(size, Image.Resampling.BILINEAR)
    if name == "gray_camera":
        return Image.fromarray(skimage.data.camera())
    return Image.fromarray(getattr(skimage.data, name)())


@pytest.fixture(scope="session", params=PHOTO_NAMES)
def photo(request: pytest.FixtureRequest) -> Image.Image:
    """Each test using this runs once per photo."""
    return photo_named(request.param)


def pytest_terminal_summary(terminalreporter) -> None:
    """Print the ONNX-vs-HF tower errors measured by test_encoder_parity (when it ran)."""
    import sys

    parity = next(
        (m for n, m in list(sys.modules.items()) if n.endswith("test_encoder_parity")), None
    )
    if parity is None or not parity.ERRORS:
        return
    terminalreporter.section("ONNX vs HF vision tower, 5 images each")
    for name, (abs_err, rel) in sorted(parity.ERRORS.items()):
        terminalreporter.write_line(
            f"{name:26s} max abs error {abs_err:.2e}, relative to max |value| {rel:.2e} "
            f"(bound {parity.REL_TOL:.0e})"
        )
