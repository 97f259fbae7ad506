"""Start and stop a real ``tritonserver`` process from the nvidia-pytriton wheel.

The wheel carries Triton 2.51 with only the python backend. The stub picks its Python from
the first ``python3`` on PATH, so the current interpreter's ``bin/`` goes first, and
``LD_LIBRARY_PATH`` must name the wheel's libs and this Python's own libpython (else the
stub mixes Debian's libpython with pyenv's stdlib).
"""

from __future__ import annotations

import contextlib
import ctypes
import os
import signal
import subprocess
import sys
import sysconfig
import tempfile
import time
import urllib.request
from collections.abc import Iterator
from dataclasses import dataclass, field
from pathlib import Path

import pytriton

_LIBC = ctypes.CDLL(None, use_errno=True)  # loaded here: the child may only call into it


def _terminate_with_parent() -> None:
    """In the child before exec: SIGTERM it when its parent dies, even by SIGKILL.

    The server runs in its own session (so a terminal's Ctrl-C reaches only us and we stop
    it in order); without this, a killed ``epd serve`` or test would orphan it.
    """
    _LIBC.prctl(1, signal.SIGTERM)  # PR_SET_PDEATHSIG


@dataclass(frozen=True)
class TritonInstall:
    """Paths of the Triton server shipped inside the nvidia-pytriton wheel."""

    root: Path

    @classmethod
    def find(cls) -> TritonInstall:
        return cls(Path(pytriton.__file__).parent / "tritonserver")

    @property
    def binary(self) -> Path:
        return self.root / "bin" / "tritonserver"

    @property
    def libs(self) -> Path:
        return self.root.parent.parent / "nvidia_pytriton.libs"

    def backend_dir(self, scratch: Path) -> Path:
        """A ``backends/`` folder whose python backend uses the stub of this Python."""
        python = scratch / "backends" / "python"
        python.mkdir(parents=True, exist_ok=True)
        ver = f"{sys.version_info.major}.{sys.version_info.minor}"
        links = {
            "libtriton_python.so": self.root / "backends/python/libtriton_python.so",
            "triton_python_backend_utils.py": self.root
            / "backends/python/triton_python_backend_utils.py",
            "triton_python_backend_stub": self.root
            / "python_backend_stubs"
            / ver
            / "triton_python_backend_stub",
        }
        for name, target in links.items():
            link = python / name
            if not link.exists():
                link.symlink_to(target)
        return scratch / "backends"


@dataclass
class TritonServer:
    """One ``tritonserver`` process in its own process group (so we can always reap it)."""

    model_repository: Path
    host: str
    http_port: int
    grpc_port: int
    metrics_port: int
    log_path: Path
    env: dict[str, str] = field(default_factory=dict)
    netns: str | None = None
    cpus: str | None = None
    """``taskset -c`` CPU list for the server and everything it starts."""
    probe_host: str | None = None
    """Where to check readiness when ``host`` (the bind address) is a wildcard."""
    edge_token: str | None = None
    """Value of ``auth.EDGE_HEADER`` that Triton demands on restricted APIs (None: none)."""
    internal_only: bool = False
    """The server hosts no public entry point: inference needs the header too."""
    exit_timeout_s: int = 15
    _proc: subprocess.Popen | None = None
    _scratch: tempfile.TemporaryDirectory | None = None

    def start(self) -> None:
        install = TritonInstall.find()
        self._scratch = tempfile.TemporaryDirectory(prefix="epd-triton-")
        backends = install.backend_dir(Path(self._scratch.name))
        bindir = str(Path(sys.executable).parent)
        env = {
            **os.environ,
            "PATH": bindir + os.pathsep + os.environ.get("PATH", ""),
            "LD_LIBRARY_PATH": os.pathsep.join(
                [str(install.libs), sysconfig.get_config_var("LIBDIR") or ""]
            ),
            **self.env,
        }
        netns = ["ip", "netns", "exec", self.netns] if self.netns else []
        pin = ["taskset", "-c", self.cpus] if self.cpus else []
        cmd = [
            *netns,
            *pin,
            str(install.binary),
            f"--model-repository={self.model_repository}",
            f"--backend-directory={backends}",
            f"--http-address={self.host}",
            f"--grpc-address={self.host}",
            f"--metrics-address={self.host}",
            f"--http-port={self.http_port}",
            f"--grpc-port={self.grpc_port}",
            f"--metrics-port={self.metrics_port}",
            f"--exit-timeout-secs={self.exit_timeout_s}",
            "--disable-auto-complete-config",
            "--log-verbose=0",
            *self._restrictions(),
        ]
        self.log_path.parent.mkdir(parents=True, exist_ok=True)
        log = open(self.log_path, "ab")  # noqa: SIM115 - owned by the child from here on
        try:
            self._proc = subprocess.Popen(
                cmd,
                env=env,
                stdout=log,
                stderr=subprocess.STDOUT,
                start_new_session=True,
                preexec_fn=_terminate_with_parent,
            )
        finally:
            log.close()

    def _restrictions(self) -> list[str]:
        """Triton's own header check on the APIs nobody outside the deployment may use:
        loading models, registering shared memory, traces and log settings everywhere;
        inference too where only internal stages live (health stays open for probes)."""
        if self.edge_token is None:
            return []
        from orchestrator.auth import EDGE_HEADER

        apis = ["model-repository", "shared-memory", "trace", "logging"]
        if self.internal_only:
            apis.append("inference")
        rule = f"{','.join(apis)}:{EDGE_HEADER}={self.edge_token}"
        return [f"--grpc-restricted-protocol={rule}", f"--http-restricted-api={rule}"]

    @property
    def url(self) -> str:
        host = self.host
        if host in ("0.0.0.0", "::"):
            host = self.probe_host or "127.0.0.1"
        return f"http://{host}:{self.http_port}"

    def is_ready(self) -> bool:
        try:
            with urllib.request.urlopen(f"{self.url}/v2/health/ready", timeout=2) as resp:
                return resp.status == 200
        except OSError:
            return False

    def wait_ready(self, timeout_s: float) -> None:
        """Block until ``/v2/health/ready``; raise with the log's tail if it dies or stalls."""
        deadline = time.monotonic() + timeout_s
        while time.monotonic() < deadline:
            if self._proc is not None and self._proc.poll() is not None:
                raise RuntimeError(
                    f"tritonserver exited with {self._proc.returncode}:\n{self.log_tail()}"
                )
            if self.is_ready():
                return
            time.sleep(0.5)
        raise TimeoutError(f"tritonserver not ready after {timeout_s}s:\n{self.log_tail()}")

    def log_tail(self, lines: int = 40) -> str:
        with contextlib.suppress(OSError):
            return "\n".join(self.log_path.read_text(errors="replace").splitlines()[-lines:])
        return ""

    def stop(self) -> None:
        """SIGTERM, give Triton its exit timeout, then kill the whole group (vLLM children)."""
        if self._proc is not None:
            with contextlib.suppress(ProcessLookupError):
                os.killpg(self._proc.pid, signal.SIGTERM)
            with contextlib.suppress(subprocess.TimeoutExpired):
                self._proc.wait(timeout=self.exit_timeout_s + 10)
        self.kill()

    def kill(self) -> None:
        """SIGKILL the whole group at once, as a crashed host would go; ``start`` again works."""
        proc, self._proc = self._proc, None
        if proc is not None:
            with contextlib.suppress(ProcessLookupError):
                os.killpg(proc.pid, signal.SIGKILL)
            with contextlib.suppress(subprocess.TimeoutExpired):
                proc.wait(timeout=10)
        if self._scratch is not None:
            self._scratch.cleanup()
            self._scratch = None

    @contextlib.contextmanager
    def running(self, timeout_s: float = 180) -> Iterator[TritonServer]:
        self.start()
        try:
            self.wait_ready(timeout_s)
            yield self
        finally:
            self.stop()
