"""Start and stop a real ``tritonserver`` process: a full install when there is one, else
the one inside the nvidia-pytriton wheel.

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
from collections.abc import Iterator, Mapping
from dataclasses import dataclass, field
from pathlib import Path
from typing import Literal

import pytriton

_LIBC = ctypes.CDLL(None, use_errno=True)  # loaded here: the child may only call into it


def _terminate_with_parent() -> None:
    """In the child before exec: SIGTERM it when its parent dies, even by SIGKILL.

    The server runs in its own session (so a terminal's Ctrl-C reaches only us and we stop
    it in order); without this, a killed ``epd serve`` or test would orphan it.
    """
    _LIBC.prctl(1, signal.SIGTERM)  # PR_SET_PDEATHSIG


def spawn(cmd: list[str], env: Mapping[str, str], log_path: Path) -> subprocess.Popen:
    """A server process in its own session (so one signal stops its whole group), its
    output appended to ``log_path``, SIGTERMed should we die."""
    log_path.parent.mkdir(parents=True, exist_ok=True)
    with open(log_path, "ab") as log:  # the child keeps its own descriptor
        return subprocess.Popen(
            cmd,
            env=dict(env),
            stdout=log,
            stderr=subprocess.STDOUT,
            start_new_session=True,
            preexec_fn=_terminate_with_parent,
        )


FULL_INSTALL_ENV = "EPD_TRITON_PATH"
FULL_INSTALL_DEFAULT = Path("/opt/tritonserver")
"""Where NVIDIA's Triton containers install the server."""


@dataclass(frozen=True)
class TritonInstall:
    """A ``tritonserver`` to run: a full install (NVIDIA's container or a path given), or
    the 2.51 server inside the nvidia-pytriton wheel (python backend only: the CPU
    fallback, what CI and ``make serve`` run)."""

    root: Path
    """Folder holding ``bin/tritonserver``."""
    kind: Literal["full", "wheel"]

    @classmethod
    def find(
        cls,
        configured: Path | None = None,
        env: Mapping[str, str] = os.environ,
        default: Path = FULL_INSTALL_DEFAULT,
    ) -> TritonInstall:
        """``configured`` (a server's ``triton`` in the topology), else ``$EPD_TRITON_PATH``,
        else ``/opt/tritonserver`` when it holds a server, else the wheel's. A path that
        is given but holds no ``bin/tritonserver`` is an error, not a silent fallback."""
        given = configured or (Path(env[FULL_INSTALL_ENV]) if env.get(FULL_INSTALL_ENV) else None)
        if given is not None:
            if not (given / "bin" / "tritonserver").is_file():
                raise ValueError(f"no Triton server at {given} (expected bin/tritonserver)")
            return cls(given, "full")
        if (default / "bin" / "tritonserver").is_file():
            return cls(default, "full")
        return cls(Path(pytriton.__file__).parent / "tritonserver", "wheel")

    @property
    def binary(self) -> Path:
        return self.root / "bin" / "tritonserver"

    @property
    def version(self) -> str:
        """From the install's ``TRITON_VERSION`` file; the wheel has none (it is 2.51)."""
        with contextlib.suppress(OSError):
            return (self.root / "TRITON_VERSION").read_text().strip()
        return "2.51.0" if self.kind == "wheel" else "unknown"

    @property
    def backends(self) -> list[str]:
        return sorted(p.name for p in (self.root / "backends").iterdir() if p.is_dir())

    def describe(self) -> str:
        return (
            f"Triton {self.version} ({self.kind}: {self.root}), "
            f"backends: {', '.join(self.backends) or 'none'}"
        )

    def require_backend(self, backend: str, why: str) -> None:
        if backend not in self.backends:
            raise ValueError(
                f"{why} needs Triton's {backend} backend; {self.describe()}. Point the "
                f"server's `triton` (or ${FULL_INSTALL_ENV}) at a full install, e.g. "
                "NVIDIA's tritonserver container's /opt/tritonserver"
            )

    @property
    def libs(self) -> list[str]:
        """Library folders the server needs on ``LD_LIBRARY_PATH``."""
        if self.kind == "wheel":
            return [str(self.root.parent.parent / "nvidia_pytriton.libs")]
        return [str(self.root / "lib")]

    def backend_dir(self, scratch: Path) -> Path:
        """The backends folder to run with. The wheel's python backend gets a folder whose
        stub is the one built for this Python; a full install's is used as it is."""
        if self.kind == "full":
            return self.root / "backends"
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
    install: TritonInstall = field(default_factory=TritonInstall.find)
    exit_timeout_s: int = 15
    _proc: subprocess.Popen | None = None
    _scratch: tempfile.TemporaryDirectory | None = None

    def start(self) -> None:
        install = self.install
        self._scratch = tempfile.TemporaryDirectory(prefix="epd-triton-")
        backends = install.backend_dir(Path(self._scratch.name))
        bindir = str(Path(sys.executable).parent)
        env = {
            **os.environ,
            "PATH": bindir + os.pathsep + os.environ.get("PATH", ""),
            "LD_LIBRARY_PATH": os.pathsep.join(
                [*install.libs, sysconfig.get_config_var("LIBDIR") or ""]
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
        self._proc = spawn(cmd, env, self.log_path)

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
    def pid(self) -> int:
        """The running server's process id (its process group: stubs, engine cores)."""
        if self._proc is None:
            raise RuntimeError("the server is not running")
        return self._proc.pid

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
        stubs = self.dump_stacks()
        raise TimeoutError(
            f"tritonserver not ready after {timeout_s}s ({stubs} python stubs dumped their "
            f"threads' stacks into the log):\n{self.log_tail(200)}"
        )

    def dump_stacks(self) -> int:
        """Have every python-backend stub of this server write all its threads' stacks to
        the log (``runner`` registers SIGUSR1 for that): where a stalled start is stuck."""
        if self._proc is None:
            return 0
        stubs = 0
        for proc in Path("/proc").glob("[0-9]*"):
            with contextlib.suppress(OSError, ValueError, IndexError):
                pid = int(proc.name)
                if os.getpgid(pid) != self._proc.pid:
                    continue
                if b"python_backend_stub" in (proc / "cmdline").read_bytes():
                    os.kill(pid, signal.SIGUSR1)
                    stubs += 1
        time.sleep(1.0)
        return stubs

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
