"""`epd serve` as users run it: ready, refuses a second copy, answers, stops clean on Ctrl-C."""

from __future__ import annotations

import os
import queue
import signal
import subprocess
import sys
import threading
import time
import urllib.request
from pathlib import Path

import pytest
import yaml

from orchestrator.client import generate, sample_photo
from orchestrator.config import Topology
from tests.conftest import local_topology

pytestmark = pytest.mark.server


class _Lines:
    """stdout of a process read on a thread, so waits for a line can have a deadline."""

    def __init__(self, proc: subprocess.Popen) -> None:
        self.queue: queue.Queue[str | None] = queue.Queue()
        self.seen: list[str] = []
        threading.Thread(target=self._pump, args=(proc.stdout,), daemon=True).start()

    def _pump(self, stream) -> None:
        for line in stream:
            self.queue.put(line)
        self.queue.put(None)

    def until(self, marker: str, timeout: float) -> str:
        deadline = time.monotonic() + timeout
        while (left := deadline - time.monotonic()) > 0:
            try:
                line = self.queue.get(timeout=left)
            except queue.Empty:
                break
            if line is None:
                break
            self.seen.append(line)
            if marker in line:
                return "".join(self.seen)
        pytest.fail(f"no {marker!r} from epd serve; output:\n{''.join(self.seen)}")


def _session_processes(sid: int) -> list[str]:
    out = subprocess.run(
        ["ps", "-ww", "-eo", "pid,sid,args"], capture_output=True, text=True
    ).stdout
    return [ln for ln in out.splitlines()[1:] if ln.split()[1] == str(sid)]


def _serve_command(
    model: Path, tmp_path: Path, layout: dict[str, list[str]]
) -> tuple[Topology, list[str]]:
    """A topology file for ``layout`` on free ports, and the `epd serve` command line for it
    (work directory ``tmp_path/work``)."""
    topology = local_topology(model, layout)
    config = tmp_path / "topology.yaml"
    config.write_text(yaml.safe_dump(topology.model_dump(mode="json")))
    cmd = [sys.executable, "-m", "orchestrator.cli", "serve", "--topology", str(config)]
    return topology, [*cmd, "--workdir", str(tmp_path / "work")]


def test_serve_demo_second_copy_and_ctrl_c(tiny_model: Path, tmp_path: Path):
    # Two servers in the file; `--server front` starts only this "host's" one.
    topology, cmd = _serve_command(
        tiny_model, tmp_path, {"front": ["aggregated"], "elsewhere": ["aggregated"]}
    )
    cmd += ["--server", "front"]
    proc = subprocess.Popen(
        cmd + ["--demo"],
        stdout=subprocess.PIPE,
        stderr=subprocess.STDOUT,
        text=True,
        start_new_session=True,
    )
    try:
        lines = _Lines(proc)
        output = lines.until("serving; Ctrl-C to stop", timeout=400)
        assert "aggregated answered:" in output

        second = subprocess.run(cmd, capture_output=True, text=True, timeout=120)
        assert second.returncode == 2
        assert "another `epd serve`" in second.stderr

        assert "elsewhere" not in output.split("logs:")[0]
        elsewhere = topology.servers["elsewhere"]
        with pytest.raises(OSError):
            urllib.request.urlopen(f"http://{elsewhere.http_url}/v2/health/ready", timeout=5)

        front = topology.servers["front"]
        assert generate(front.http_url, "aggregated", "hello", [sample_photo("chelsea")], 4)

        os.kill(proc.pid, signal.SIGINT)
        assert "stopped" in lines.until("stopped", timeout=120)
        assert proc.wait(timeout=30) == 0
        assert _session_processes(proc.pid) == [], "servers or engines outlived epd serve"
    finally:
        if proc.poll() is None:
            os.killpg(proc.pid, signal.SIGKILL)
            proc.wait(10)


def test_serve_the_default_layout_answers_on_every_entry_point(tiny_model: Path, tmp_path: Path):
    """What `make serve` runs (the embedded E+PD default, on free ports here): the demo's
    photo is answered by `epd`, `aggregated` and the OpenAI API, the same text by all."""
    from orchestrator.config import default_topology
    from orchestrator.triton.deployment import on_free_ports

    topology = on_free_ports(default_topology(tiny_model))
    config = tmp_path / "topology.yaml"
    config.write_text(yaml.safe_dump(topology.model_dump(mode="json")))
    cmd = [sys.executable, "-m", "orchestrator.cli", "serve", "--topology", str(config)]
    proc = subprocess.Popen(
        [*cmd, "--workdir", str(tmp_path / "work"), "--demo"],
        stdout=subprocess.PIPE,
        stderr=subprocess.STDOUT,
        text=True,
        start_new_session=True,
    )
    try:
        output = _Lines(proc).until("serving; Ctrl-C to stop", timeout=500)
        answers = {
            line.split(" answered: ")[0]: line.split(" answered: ")[1]
            for line in output.splitlines()
            if " answered: " in line
        }
        assert set(answers) == {"epd", "aggregated", "OpenAI API"}, output
        assert len(set(answers.values())) == 1, answers
    finally:
        if proc.poll() is None:
            os.killpg(proc.pid, signal.SIGINT)
            try:
                proc.wait(timeout=120)
            except subprocess.TimeoutExpired:
                os.killpg(proc.pid, signal.SIGKILL)
                proc.wait(10)


def _processes_mentioning(text: str) -> list[str]:
    out = subprocess.run(
        ["ps", "-ww", "-eo", "pid,stat,args"], capture_output=True, text=True
    ).stdout
    return [ln for ln in out.splitlines() if text in ln and " Z " not in f" {ln.split()[1]} "]


def test_killed_serve_takes_its_servers_down(tiny_model: Path, tmp_path: Path):
    """Even SIGKILL (no chance to clean up) must not orphan Triton servers or engines."""
    _, cmd = _serve_command(tiny_model, tmp_path, {"front": ["aggregated"]})
    workdir = tmp_path / "work"
    proc = subprocess.Popen(cmd, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)
    try:
        _Lines(proc).until("serving; Ctrl-C to stop", timeout=400)
        assert _processes_mentioning(str(workdir)), "the server should be running"
    finally:
        proc.kill()
        proc.wait(10)
    deadline = time.monotonic() + 60
    while _processes_mentioning(str(workdir)) and time.monotonic() < deadline:
        time.sleep(0.5)
    assert _processes_mentioning(str(workdir)) == []
