"""``epd bench idle``: what a deployment costs while nothing happens.

Starts the deployment, sends one request through ``epd`` (every stage has then served once),
lets it settle, then measures the CPU time every server's process tree (Triton, its model
stubs, vLLM engine cores) and each OpenAI front spend over a quiet window: cores = CPU
seconds / wall seconds. Health probes, metric refreshes, transfer pollers and engine loops
are what is left to see; the busiest thread names over all servers say which (Linux).
"""

from __future__ import annotations

import collections
import os
import tempfile
import time
from collections.abc import Iterable
from pathlib import Path
from typing import Any

from epd_bench.schema import machine_info
from orchestrator.config import Topology


def _tree(pid: int) -> list[Any]:
    """``pid``'s process and its descendants (psutil)."""
    import psutil

    root = psutil.Process(pid)
    return [root, *root.children(recursive=True)]


def tree_cpu_s(pid: int) -> float:
    """User + system CPU seconds of ``pid`` and its descendants so far."""
    import psutil

    total = 0.0
    for proc in _tree(pid):
        try:
            times = proc.cpu_times()
        except psutil.Error:
            continue  # gone meanwhile
        total += times.user + times.system
    return total


def threads_cpu_s(pids: Iterable[int]) -> dict[str, tuple[int, float]]:
    """CPU seconds so far of the threads of ``pids`` and their descendants, by thread name:
    name -> (threads, seconds). Empty where ``/proc`` has no per-thread stats."""
    tick = os.sysconf("SC_CLK_TCK")
    by_name: dict[str, list] = collections.defaultdict(lambda: [0, 0.0])
    for pid in pids:
        for proc in _tree(pid):
            try:
                tids = os.listdir(f"/proc/{proc.pid}/task")
            except OSError:
                continue  # gone meanwhile, or no /proc
            for tid in tids:
                try:
                    with open(f"/proc/{proc.pid}/task/{tid}/stat") as f:
                        stat = f.read()
                except OSError:
                    continue
                name = stat[stat.index("(") + 1 : stat.rindex(")")]
                utime, stime = stat[stat.rindex(")") + 2 :].split()[11:13]
                entry = by_name[name]
                entry[0] += 1
                entry[1] += (int(utime) + int(stime)) / tick
    return {name: (n, cpu) for name, (n, cpu) in by_name.items()}


def busiest_threads(
    before: dict[str, tuple[int, float]], after: dict[str, tuple[int, float]], wall_s: float
) -> list[dict[str, Any]]:
    """Thread names by the cores they took between two ``threads_cpu_s`` samples."""
    rows = [
        {"thread": name, "threads": n, "cores": (cpu - before.get(name, (0, 0.0))[1]) / wall_s}
        for name, (n, cpu) in after.items()
    ]
    return sorted(rows, key=lambda row: -row["cores"])


def run(topology: Topology, settle_s: float, window_s: float, timeout_s: float) -> dict[str, Any]:
    from orchestrator.client import generate, sample_photo
    from orchestrator.triton.deployment import Deployment, on_free_ports

    topology = on_free_ports(topology)
    with tempfile.TemporaryDirectory(prefix="epd-idle-") as workdir:
        deployment = Deployment(topology, Path(workdir))
        with deployment.running(timeout_s):
            front = topology.server_of("epd")[1]
            generate(front.http_url, "epd", "Describe this image.", [sample_photo("coffee")], 4)
            time.sleep(settle_s)
            pids = {name: server.pid for name, server in deployment.servers.items()}
            pids |= {f"{name} (OpenAI)": api.pid for name, api in deployment.openai.items()}
            before = {name: tree_cpu_s(pid) for name, pid in pids.items()}
            threads_before = threads_cpu_s(pids.values())
            start = time.monotonic()
            time.sleep(window_s)
            wall = time.monotonic() - start
            after = {name: tree_cpu_s(pid) for name, pid in pids.items()}
            threads_after = threads_cpu_s(pids.values())
    cores = {name: (after[name] - before[name]) / wall for name in pids}
    return {
        "command": "epd bench idle",
        "machine": machine_info(),
        "layout": {name: spec.stages for name, spec in topology.servers.items()},
        "settle_s": settle_s,
        "window_s": round(wall, 2),
        "cores": cores,
        "total_cores": sum(cores.values()),
        "threads": busiest_threads(threads_before, threads_after, wall)[:8],
    }


def format_report(report: dict[str, Any]) -> str:
    lines = [f"idle for {report['window_s']:.0f} s after one request: CPU cores per server"]
    for name, cores in report["cores"].items():
        stages = ", ".join(report["layout"].get(name, ["openai"]))
        lines.append(f"  {name:<16} {cores:6.3f}   ({stages})")
    lines.append(f"  {'total':<16} {report['total_cores']:6.3f}")
    lines.append("busiest threads, all servers: cores (threads of that name)")
    for row in report.get("threads", []):
        lines.append(f"  {row['thread']:<16} {row['cores']:6.3f}   ({row['threads']})")
    return "\n".join(lines)
