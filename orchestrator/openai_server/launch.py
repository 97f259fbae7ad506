"""Start and stop the OpenAI front of a server as a child process beside its Triton."""

from __future__ import annotations

import contextlib
import os
import signal
import subprocess
import sys
import time
import urllib.request
from dataclasses import dataclass
from pathlib import Path

from orchestrator.config import ServerSpec
from orchestrator.triton.server import spawn


@dataclass
class OpenAIFront:
    """``python -m orchestrator.openai_server`` for one server, in its own session (and
    the server's network namespace and CPUs, if it has them)."""

    topology_file: Path
    server: str
    spec: ServerSpec
    log_path: Path
    env: dict[str, str]
    _proc: subprocess.Popen | None = None

    @property
    def pid(self) -> int:
        """The running front's process id."""
        if self._proc is None:
            raise RuntimeError("the OpenAI front is not running")
        return self._proc.pid

    @property
    def url(self) -> str:
        host = self.spec.bind_address
        host = "127.0.0.1" if host in ("0.0.0.0", "::") else host
        return f"http://{host}:{self.spec.openai_port}"

    def start(self) -> None:
        netns = ["ip", "netns", "exec", self.spec.netns] if self.spec.netns else []
        pin = ["taskset", "-c", self.spec.cpus] if self.spec.cpus else []
        cmd = [
            *netns,
            *pin,
            sys.executable,
            "-m",
            "orchestrator.openai_server",
            f"--topology={self.topology_file}",
            f"--server={self.server}",
        ]
        self._proc = spawn(cmd, {**os.environ, **self.env}, self.log_path)

    def wait_ready(self, timeout_s: float) -> None:
        """Block until ``/health`` answers 200 (its Triton models are ready too)."""
        deadline = time.monotonic() + timeout_s
        while time.monotonic() < deadline:
            if self._proc is not None and self._proc.poll() is not None:
                raise RuntimeError(
                    f"the OpenAI front of {self.server} exited with {self._proc.returncode}; "
                    f"see {self.log_path}"
                )
            with contextlib.suppress(OSError):
                with urllib.request.urlopen(f"{self.url}/health", timeout=2) as resp:
                    if resp.status == 200:
                        return
            time.sleep(0.5)
        raise TimeoutError(f"the OpenAI front of {self.server} not ready after {timeout_s}s")

    def stop(self) -> None:
        proc, self._proc = self._proc, None
        if proc is None:
            return
        with contextlib.suppress(ProcessLookupError):
            os.killpg(proc.pid, signal.SIGTERM)
        try:
            proc.wait(timeout=10)
        except subprocess.TimeoutExpired:
            with contextlib.suppress(ProcessLookupError):
                os.killpg(proc.pid, signal.SIGKILL)
            proc.wait(timeout=10)
