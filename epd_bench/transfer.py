"""``epd bench transfer``: how fast one embedding gets from the encoder to prefill, per
transport, against the same-host physical limit.

For each transport a producer and a consumer run as two processes
(``epd_bench.transfer_peer``). Per size, after warm-up, the producer ``put``s an
embedding and the consumer times ``fetch`` of its handle; the producer's cache is off and
each put has a new content hash, so every fetch is a real transfer, and each put first
waits for the last fetch to free its slot, so the pool never fills. The baseline is
``np.copyto`` of the same size into a preallocated array in the consumer process: the most
a same-host transfer could do (up to a few MiB both buffers stay in CPU cache, so small
sizes are held to cache speed; fixed costs dominate there anyway). The transports are
timed the same way: ``fetch_into`` an array reused per size (prefill lands each image in
its engine input); NIXL READs straight into it, Mooncake and inline copy into it from a
receive buffer or decoded bytes. Inline's cost sits mostly outside the fetch: base64
encoding is in ``put`` (reported too) and the 4/3-size handle rides with the request, which
is not measured here.

A benchmark, not a test: it measures, prints and writes JSON, and asserts nothing.
"""

from __future__ import annotations

import argparse
import json
import os
import selectors
import subprocess
import sys
import tempfile
import time
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field
from datetime import UTC, datetime
from pathlib import Path
from typing import Any

import numpy as np

from epd_bench.schema import machine_info

KINDS = ("nixl", "mooncake", "inline")
MEMCPY = "memcpy"
KIB, MIB = 1 << 10, 1 << 20
SIZES = (64 * KIB, 256 * KIB, 1 * MIB, 4 * MIB, 16 * MIB, 64 * MIB)
HEADLINE_SIZE = 16 * MIB
"""The size ``ratio_line`` reports when it was measured (a large image's embedding)."""
MIN_REPEATS = 3
POOL_BYTES = 256 * MIB
PROBES = {"nixl": "nixl._api", "mooncake": "mooncake.engine"}
"""Module each optional transport needs; a transport whose module does not load is skipped."""
DEFAULT_OUT = Path(".cache/bench/transfer.json")


class PeerError(RuntimeError):
    """A peer process died, hung past its timeout or could not start."""


@dataclass
class Timings:
    """Raw seconds of one transport at one size."""

    fetch_s: list[float] = field(default_factory=list)
    """Consumer-side ``fetch_into`` of one handle (for ``memcpy``: one ``np.copyto``)."""
    put_s: list[float] = field(default_factory=list)
    """Producer-side ``put`` of the same embeddings (none for ``memcpy``)."""


@dataclass(frozen=True)
class Row:
    """One transport at one size, summarised."""

    kind: str
    """A transport, or ``memcpy``."""
    bytes: int
    count: int
    median_s: float
    p90_s: float
    bandwidth: float
    """Bytes per second at the median fetch time."""
    ratio_to_memcpy: float | None
    """``bandwidth`` over memcpy's at the same size; None when memcpy was not measured."""
    put_median_s: float | None


# --- statistics ---------------------------------------------------------------------------


def summarize(timings: Mapping[str, Mapping[int, Timings]]) -> list[Row]:
    """One row per transport and size, sizes ascending, memcpy first within a size."""
    memcpy_bw = {n: n / float(np.median(t.fetch_s)) for n, t in timings.get(MEMCPY, {}).items()}
    rows = []
    for transport, by_size in timings.items():
        for nbytes, t in by_size.items():
            if not t.fetch_s:
                continue
            p50, p90 = (float(v) for v in np.percentile(t.fetch_s, [50, 90]))
            bandwidth = nbytes / p50
            rows.append(
                Row(
                    kind=transport,
                    bytes=nbytes,
                    count=len(t.fetch_s),
                    median_s=p50,
                    p90_s=p90,
                    bandwidth=bandwidth,
                    ratio_to_memcpy=bandwidth / memcpy_bw[nbytes] if nbytes in memcpy_bw else None,
                    put_median_s=float(np.median(t.put_s)) if t.put_s else None,
                )
            )
    return sorted(rows, key=lambda r: (r.bytes, r.kind != MEMCPY))


def size_label(nbytes: int) -> str:
    for unit, scale in (("MiB", MIB), ("KiB", KIB)):
        if nbytes >= scale and nbytes % scale == 0:
            return f"{nbytes // scale} {unit}"
    return f"{nbytes} B"


def _fmt(value: float | None, spec: str, scale: float = 1.0) -> str:
    return "-" if value is None else format(value * scale, spec)


def format_table(rows: Sequence[Row]) -> str:
    """Per size and transport: fetch latency in ms, GB/s (10^9 bytes) and the memcpy ratio."""
    lines = [
        f"{'size':>8}  {'transport':<10}{'n':>4}{'fetch ms p50':>14}{'p90':>10}"
        f"{'GB/s':>9}{'x memcpy':>10}{'put ms p50':>12}"
    ]
    for r in rows:
        lines.append(
            f"{size_label(r.bytes):>8}  {r.kind:<10}{r.count:>4}"
            f"{_fmt(r.median_s, '.3f', 1e3):>14}{_fmt(r.p90_s, '.3f', 1e3):>10}"
            f"{_fmt(r.bandwidth, '.2f', 1e-9):>9}{_fmt(r.ratio_to_memcpy, '.2f'):>10}"
            f"{_fmt(r.put_median_s, '.3f', 1e3):>12}"
        )
    return "\n".join(lines)


def ratio_line(rows: Sequence[Row], nbytes: int | None = None) -> str:
    """The one line to read: each transport's bandwidth as a fraction of memcpy's at
    ``nbytes`` (default: 16 MiB if measured, else the largest size measured)."""
    if not rows:
        return "transfer: nothing measured"
    sizes = {r.bytes for r in rows}
    if nbytes is None:
        nbytes = HEADLINE_SIZE if HEADLINE_SIZE in sizes else max(sizes)
    at_size = [r for r in rows if r.bytes == nbytes]
    memcpy = next((r for r in at_size if r.kind == MEMCPY), None)
    parts = []
    for r in at_size:
        if r.kind == MEMCPY:
            continue
        ratio, gbps = _fmt(r.ratio_to_memcpy, ".2f"), _fmt(r.bandwidth, ".2f", 1e-9)
        if parts or memcpy is None:
            parts.append(f"{r.kind} {ratio}x ({gbps} GB/s)")
        else:  # the first one names the baseline
            base = _fmt(memcpy.bandwidth, ".2f", 1e-9)
            parts.append(f"{r.kind} {ratio}x memcpy ({gbps} vs {base} GB/s)")
    return f"transfer {size_label(nbytes)}: " + (", ".join(parts) or "no transport measured")


def repeats_for(nbytes: int, repeats: int, byte_budget: int) -> int:
    """Timed fetches at one size: ``repeats``, fewer for big sizes so that one size moves
    about ``byte_budget`` bytes at most, but never fewer than ``MIN_REPEATS``."""
    return min(repeats, max(MIN_REPEATS, byte_budget // nbytes))


# --- running ------------------------------------------------------------------------------


class Peer:
    """A ``transfer_peer`` process driven over its stdin/stdout; every wait is bounded."""

    def __init__(
        self, role: str, kind: str, env: Mapping[str, str], timeout_s: float, **cfg: Any
    ) -> None:
        self.name = f"{kind} {role}"
        self.timeout_s = timeout_s
        self._stderr = tempfile.TemporaryFile()
        self.proc = subprocess.Popen(
            [sys.executable, "-m", "epd_bench.transfer_peer", role, kind, json.dumps(cfg)],
            stdin=subprocess.PIPE,
            stdout=subprocess.PIPE,
            stderr=self._stderr,
            env=dict(env),
            start_new_session=True,  # Ctrl-C reaches the driver only, which kills us
        )
        os.set_blocking(self.proc.stdin.fileno(), False)  # an inline handle can be ~90 MB
        self._buf = bytearray()
        self._scanned = 0
        self._reply(time.monotonic() + timeout_s)  # {"ready": true}

    def request(self, op: str, **args: Any) -> dict:
        deadline = time.monotonic() + self.timeout_s
        self._send((json.dumps({"op": op, **args}) + "\n").encode(), deadline)
        return self._reply(deadline)

    def _wait(self, stream: Any, event: int, deadline: float) -> None:
        with selectors.DefaultSelector() as sel:
            sel.register(stream, event)
            if not sel.select(max(0.0, deadline - time.monotonic())):
                self._fail(f"did not answer within {self.timeout_s}s")

    def _send(self, data: bytes, deadline: float) -> None:
        view = memoryview(data)
        while view:
            self._wait(self.proc.stdin, selectors.EVENT_WRITE, deadline)
            try:
                view = view[os.write(self.proc.stdin.fileno(), view) :]
            except BlockingIOError:
                continue
            except BrokenPipeError:
                self._fail(f"exited with status {self.proc.wait(5)}")

    def _reply(self, deadline: float) -> dict:
        """The next ``@@`` line, skipping library noise; scans each byte for a newline once."""
        while True:
            end = self._buf.find(b"\n", self._scanned)
            if end < 0:
                self._scanned = len(self._buf)
                self._wait(self.proc.stdout, selectors.EVENT_READ, deadline)
                chunk = os.read(self.proc.stdout.fileno(), 1 << 20)
                if not chunk:
                    self._fail(f"exited with status {self.proc.wait(5)}")
                self._buf += chunk
                continue
            line = bytes(self._buf[:end])
            del self._buf[: end + 1]
            self._scanned = 0
            if line.startswith(b"@@ "):
                return json.loads(line[3:])

    def _fail(self, why: str) -> None:
        self.kill()
        self._stderr.seek(0)
        tail = self._stderr.read()[-2000:].decode(errors="replace").strip()
        raise PeerError(f"{self.name} {why}; stderr tail:\n{tail}")

    def kill(self) -> None:
        if self.proc.poll() is None:
            self.proc.kill()
        self.proc.wait(10)


def unavailable(kind: str, env: Mapping[str, str], timeout_s: float) -> str | None:
    """Why ``kind`` cannot run here (its optional module does not load), or None."""
    module = PROBES.get(kind)
    if module is None:
        return None
    try:
        probe = subprocess.run(
            [sys.executable, "-c", f"import {module}"],
            capture_output=True,
            text=True,
            env=dict(env),
            timeout=timeout_s,
        )
    except subprocess.TimeoutExpired:
        return f"{kind} skipped: importing {module} took over {timeout_s}s"
    if probe.returncode:
        last = (probe.stderr.strip().splitlines() or ["no output"])[-1]
        return f"{kind} skipped: {module} does not load ({last})"
    return None


def measure(
    kind: str,
    sizes: Sequence[int],
    repeats: int,
    env: Mapping[str, str],
    timings: dict[str, dict[int, Timings]],
    *,
    warmup: int,
    byte_budget: int,
    timeout_s: float,
) -> None:
    """Time ``kind`` at every size into ``timings[kind]``, and memcpy in the same consumer
    process right after each size (same load) into ``timings[MEMCPY]``."""
    peers: list[Peer] = []
    try:
        pool_bytes = max(POOL_BYTES, 4 * max(sizes))
        peers.append(Peer("producer", kind, env, timeout_s, pool_bytes=pool_bytes, cache=False))
        peers.append(Peer("consumer", kind, env, timeout_s, xfer_timeout_s=timeout_s / 2))
        producer, consumer = peers
        for nbytes in sizes:
            n = repeats_for(nbytes, repeats, byte_budget)
            print(f"  {kind} {size_label(nbytes)}: {warmup} + {n} fetches", file=sys.stderr)
            t = timings.setdefault(kind, {}).setdefault(nbytes, Timings())
            for serial in range(warmup + n):
                put = producer.request("put", nbytes=nbytes, serial=serial)
                got = consumer.request("fetch", handle=put["handle"])
                if got["nbytes"] != nbytes:
                    raise PeerError(f"{kind}: fetched {got['nbytes']} bytes of {nbytes}")
                if serial >= warmup:
                    t.put_s.append(put["seconds"])
                    t.fetch_s.append(got["seconds"])
            copies = consumer.request("memcpy", nbytes=nbytes, repeats=n)["seconds"]
            timings.setdefault(MEMCPY, {}).setdefault(nbytes, Timings()).fetch_s.extend(copies)
    finally:
        for peer in peers:
            peer.kill()


def run(
    kinds: Sequence[str],
    sizes: Sequence[int],
    repeats: int,
    env: Mapping[str, str],
    *,
    warmup: int = 2,
    byte_budget: int = 512 * MIB,
    timeout_s: float = 60.0,
) -> dict[str, Any]:
    """Measure each transport in turn; the report: ``rows`` summarised (what
    ``epd bench report`` reads, with ``table``), ``timings`` raw.

    ``env`` is added to the peers' environment (``UCX_TLS=tcp`` makes NIXL use TCP as it
    would across hosts without RDMA). ``UCX_MODULES`` defaults to ``^ib`` for hosts with
    the verbs libraries but no RDMA NIC. A transport that cannot load or fails is left out
    with a note; the others still run.
    """
    from epd_bench.schema import package_version

    peer_env = {"UCX_MODULES": "^ib", **os.environ, **env}
    timings: dict[str, dict[int, Timings]] = {}
    notes: list[str] = []
    load_before = os.getloadavg()
    for kind in kinds:
        if why := unavailable(kind, peer_env, timeout_s):
            notes.append(why)
            print(why, file=sys.stderr, flush=True)
            continue
        print(f"measuring {kind} ...", file=sys.stderr, flush=True)
        try:
            measure(
                kind,
                sizes,
                repeats,
                peer_env,
                timings,
                warmup=warmup,
                byte_budget=byte_budget,
                timeout_s=timeout_s,
            )
        except PeerError as exc:
            timings.pop(kind, None)
            notes.append(f"{kind} failed: {exc}")
            print(notes[-1], file=sys.stderr, flush=True)
    rows = summarize(timings)
    return {
        "timestamp": datetime.now(UTC).isoformat(timespec="seconds"),
        "machine": machine_info(load_before),
        "versions": {"nixl": package_version("nixl"), "mooncake": package_version("mooncake")},
        "settings": {
            "kinds": list(kinds),
            "sizes": list(sizes),
            "repeats": repeats,
            "warmup": warmup,
            "byte_budget": byte_budget,
            "peer_env": {k: v for k, v in peer_env.items() if k.startswith(("UCX_", "MC_"))},
        },
        "notes": notes,
        "rows": rows,
        "table": format_table(rows),
        "timings": timings,
    }


# --- command line ---------------------------------------------------------------------------


def _at_least(minimum: int, cast: type = int) -> Any:
    """An argparse ``type`` that refuses values below ``minimum``."""

    def parse(text: str) -> Any:
        value = cast(text)
        if value < minimum:
            raise argparse.ArgumentTypeError(f"must be at least {minimum}: {text}")
        return value

    return parse


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--kinds", nargs="+", choices=KINDS, default=list(KINDS))
    parser.add_argument(
        "--sizes-kib",
        nargs="+",
        type=_at_least(1),
        default=[n // KIB for n in SIZES],
        metavar="KIB",
    )
    parser.add_argument("--repeats", type=_at_least(1), default=20, help="timed fetches per size")
    parser.add_argument(
        "--warmup", type=_at_least(0), default=2, help="untimed fetches per size first"
    )
    parser.add_argument(
        "--budget-mib",
        type=_at_least(1),
        default=512,
        help="bytes one size may move per transport: fewer repeats for big sizes "
        f"(at least {MIN_REPEATS})",
    )
    parser.add_argument(
        "--tcp",
        action="store_true",
        help="UCX_TLS=tcp: NIXL over TCP, as across hosts without RDMA (Mooncake is always TCP)",
    )
    parser.add_argument(
        "--timeout", type=_at_least(1, float), default=60, help="seconds for one peer step"
    )
    parser.add_argument("--out", default=str(DEFAULT_OUT), help="JSON report path")


def run_cli(args: argparse.Namespace) -> int:
    """Measure, print the table and the ratio line, write the JSON report; 1 when no
    transport could be measured."""
    from epd_bench.quick import write_report

    report = run(
        args.kinds,
        [kib * KIB for kib in args.sizes_kib],
        args.repeats,
        {"UCX_TLS": "tcp"} if args.tcp else {},
        warmup=args.warmup,
        byte_budget=args.budget_mib * MIB,
        timeout_s=args.timeout,
    )
    print(report["table"])
    print(ratio_line(report["rows"]))
    write_report(report, Path(args.out))
    print(f"wrote {args.out}")
    return 0 if any(r.kind != MEMCPY for r in report["rows"]) else 1
