"""A wheel (`pip install .`) carries the Triton adapters, and the renderer finds them."""

from __future__ import annotations

import shutil
import subprocess
import sys
import zipfile
from pathlib import Path

import pytest

from orchestrator.triton.repository import SOURCE

ROOT = Path(__file__).resolve().parents[2]


def _files(top: Path) -> list[str]:
    """Files under ``top`` (relative, POSIX), bytecode caches left out."""
    return sorted(
        p.relative_to(top).as_posix()
        for p in top.rglob("*")
        if p.is_file() and "__pycache__" not in p.parts and p.suffix != ".pyc"
    )


@pytest.fixture(scope="module")
def wheel(tmp_path_factory: pytest.TempPathFactory) -> Path:
    # Built from a copy: building in place leaves build/ and *.egg-info in the checkout.
    # No build isolation: setuptools comes from this venv, so no network is needed.
    src = tmp_path_factory.mktemp("src")
    ignore = shutil.ignore_patterns("__pycache__", "*.pyc")
    for name in ("orchestrator", "epd_bench", "epd_plan", "model_repository"):
        shutil.copytree(ROOT / name, src / name, ignore=ignore)
    for name in ("pyproject.toml", "README.md"):
        shutil.copy(ROOT / name, src / name)
    out = tmp_path_factory.mktemp("wheel")
    subprocess.run(
        [sys.executable, "-m", "pip", "wheel", "--no-deps", "--no-build-isolation",
         "--no-index", "-q", "-w", str(out), str(src)],
        check=True, timeout=120,
    )  # fmt: skip
    (whl,) = out.glob("*.whl")
    return whl


def test_wheel_ships_every_adapter_file(wheel: Path) -> None:
    names = set(zipfile.ZipFile(wheel).namelist())
    expected = [f"orchestrator/model_repository/{f}" for f in _files(ROOT / "model_repository")]
    assert "orchestrator/model_repository/epd/1/model.py" in expected
    assert [f for f in expected if f not in names] == []


def test_wheel_ships_every_module(wheel: Path) -> None:
    """pyproject.toml lists the packages by hand: a new subpackage must be added there."""
    names = set(zipfile.ZipFile(wheel).namelist())
    expected = [
        f"{package}/{f}"
        for package in ("orchestrator", "epd_bench", "epd_plan")
        for f in _files(ROOT / package)
    ]
    assert [f for f in expected if f not in names] == []


def test_wheel_install_finds_the_adapters(wheel: Path, tmp_path: Path) -> None:
    """Installed from the wheel, away from the checkout, SOURCE is the wheel's copy."""
    site = tmp_path / "site"
    zipfile.ZipFile(wheel).extractall(site)  # what `pip install --target` does to a wheel
    code = "from orchestrator.triton.repository import SOURCE; print(SOURCE)"
    env = {"PYTHONPATH": str(site), "PATH": "/usr/bin:/bin"}
    run = subprocess.run(
        [sys.executable, "-c", code], cwd=tmp_path, env=env,
        capture_output=True, text=True, check=True, timeout=60,
    )  # fmt: skip
    source = Path(run.stdout.strip())
    assert source == site / "orchestrator" / "model_repository"
    assert (source / "epd" / "config.pbtxt").is_file()
    assert (source / "vision_encoder" / "1" / "model.py").is_file()


def test_source_is_the_checkout_folder_here() -> None:
    """In this (editable) install the renderer copies the top-level model_repository/."""
    assert SOURCE == ROOT / "model_repository"
    assert (SOURCE / "epd" / "config.pbtxt").is_file()
    assert _files(SOURCE) == _files(ROOT / "model_repository")


def test_the_product_imports_no_benchmark_code() -> None:
    """The benchmarks and the planner sit beside the product and register their commands
    through the ``epd.commands`` entry point: nothing in ``orchestrator`` imports them."""
    import ast

    offenders = []
    for path in sorted((ROOT / "orchestrator").rglob("*.py")):
        for node in ast.walk(ast.parse(path.read_text())):
            names = []
            if isinstance(node, ast.Import):
                names = [alias.name for alias in node.names]
            elif isinstance(node, ast.ImportFrom) and node.module:
                names = [node.module]
            if any(n.split(".")[0] in ("epd_bench", "epd_plan") for n in names):
                offenders.append(f"{path.relative_to(ROOT)}:{node.lineno}")
    assert offenders == []
