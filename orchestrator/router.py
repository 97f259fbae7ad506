"""Which server serves a stage call when several host that stage, and which are alive.

Least outstanding work among healthy servers: each call goes to the server with the fewest
calls in flight from this front, ties broken round-robin so an idle cluster still spreads
load; a caller may prefer one server (cache locality) or exclude some (retries). A server
whose call failed at the transport level is taken out at once; a probe of every server's
readiness (Triton's ready endpoint) runs in the background, taking out the ones that stop
answering and re-admitting the ones that are back. A server the front has not called since
its last probe is probed at a slower, idle pace.
"""

from __future__ import annotations

import asyncio
import contextlib
import itertools
import logging
import time
from collections import OrderedDict
from collections.abc import Iterable, Iterator
from typing import NoReturn

from orchestrator.protocol import Unavailable
from orchestrator.stage_client import StageClient

log = logging.getLogger(__name__)


class StageRoute:
    """The servers hosting one stage: their clients, health and calls in flight."""

    def __init__(
        self, stage: str, targets: dict[str, StageClient], misses_to_down: int = 1
    ) -> None:
        if not targets:
            raise ValueError(f"no server hosts stage {stage!r}")
        self.stage = stage
        self.targets = targets
        self.misses_to_down = misses_to_down
        """Probes in a row a server may leave unanswered before it is taken out."""
        self._outstanding = dict.fromkeys(targets, 0)
        self._missed = dict.fromkeys(targets, 0)  # probes unanswered in a row
        self._down: dict[str, str] = {}  # name -> why
        self._turn = itertools.count()
        self._calls = dict.fromkeys(targets, 0)  # calls started, ever
        self._probed: dict[str, tuple[float, int]] = {}  # name -> (when, calls by then)

    @property
    def outstanding(self) -> dict[str, int]:
        return dict(self._outstanding)

    @property
    def healthy(self) -> list[str]:
        return [name for name in self.targets if name not in self._down]

    def choose(self, prefer: str | None = None, exclude: Iterable[str] = ()) -> str:
        """``prefer`` when it is healthy and not excluded, else the least busy healthy one.

        Raises ``Unavailable`` saying which servers are down and why when none is left.
        """
        excluded = set(exclude)
        names = [n for n in self.healthy if n not in excluded]
        if prefer in names:
            return prefer
        if not names:
            self._none_left(excluded)
        start = next(self._turn) % len(names)
        rotated = names[start:] + names[:start]
        return min(rotated, key=self._outstanding.__getitem__)

    async def require(self, probe_timeout_s: float) -> None:
        """Fail fast, before any work is spent on a request, when no server is healthy --
        after probing the ones taken out once more, so a server that just came back (or
        that was still starting when last probed) serves without waiting for the monitor."""
        if not self.healthy:
            await asyncio.gather(*(self.probe(n, probe_timeout_s) for n in self.targets))
        if not self.healthy:
            self._none_left(set())

    def _none_left(self, excluded: set[str]) -> NoReturn:
        down = "; ".join(f"{n}: {why}" for n, why in self._down.items()) or "none down"
        tried = f" (already tried {sorted(excluded)})" if excluded else ""
        raise Unavailable(f"no healthy {self.stage} server left{tried}; {down}")

    @contextlib.contextmanager
    def use(self, name: str) -> Iterator[StageClient]:
        """``name``'s client, counted as busy until the block ends."""
        self._outstanding[name] += 1
        self._calls[name] += 1
        try:
            yield self.targets[name]
        finally:
            self._outstanding[name] -= 1

    def mark_down(self, name: str, why: str) -> None:
        if name not in self._down:
            log.warning("%s server %s taken out: %s", self.stage, name, why)
        self._down[name] = why

    def mark_up(self, name: str) -> None:
        if self._down.pop(name, None) is not None:
            log.warning("%s server %s re-admitted", self.stage, name)

    def is_down(self, name: str) -> bool:
        return name in self._down

    def probe_due(self, name: str, idle_interval_s: float, now: float) -> bool:
        """Whether ``name`` should be probed now, on a tick of the monitor: when it is out
        of rotation (to re-admit it), has never been probed, has been called since its last
        probe (or still is), or has not been probed for ``idle_interval_s``."""
        if name in self._down or name not in self._probed:
            return True
        when, calls = self._probed[name]
        busy = self._outstanding[name] > 0 or self._calls[name] != calls
        return busy or now - when >= idle_interval_s

    async def probe(self, name: str, timeout_s: float) -> bool:
        """Ask ``name`` whether it is ready; update its health; whether it is in rotation.

        A refused connection or an answer of "not healthy" takes the server out at once; a
        probe left unanswered only counts: a server busy enough to answer late is not dead,
        and taking it out would fail requests it would have served. ``misses_to_down`` in a
        row take it out."""
        self._probed[name] = (time.monotonic(), self._calls[name])
        try:
            async with asyncio.timeout(timeout_s):
                ready = await self.targets[name].ready(self.stage)
        except TimeoutError:
            self._missed[name] += 1
            if self._missed[name] < self.misses_to_down:
                return not self.is_down(name)
            ready = False
            why = f"{self._missed[name]} readiness probes in a row unanswered within {timeout_s:g}s"
        except Exception as exc:  # noqa: BLE001 - any other failure means not ready
            ready, why = False, f"readiness probe failed: {str(exc) or type(exc).__name__}"
        else:
            why = "not ready"
        if ready:
            self._missed[name] = 0
            self.mark_up(name)
        else:
            self.mark_down(name, why)
        return ready


class HealthMonitor:
    """Probes the servers of some routes on the running loop: every ``interval_s`` those
    out of rotation or called since their last probe, every ``idle_interval_s`` (never more
    often than ``interval_s``) the others."""

    def __init__(
        self,
        routes: Iterable[StageRoute],
        interval_s: float,
        timeout_s: float,
        idle_interval_s: float | None = None,
    ):
        self.routes = list(routes)
        self.interval_s = interval_s
        self.idle_interval_s = max(interval_s, idle_interval_s or interval_s)
        self.timeout_s = timeout_s
        self._task: asyncio.Task | None = None

    async def probe_due(self) -> None:
        """One tick: probe the servers whose turn it is (``StageRoute.probe_due``)."""
        now = time.monotonic()
        await asyncio.gather(
            *(
                route.probe(name, self.timeout_s)
                for route in self.routes
                for name in route.targets
                if route.probe_due(name, self.idle_interval_s, now)
            )
        )

    def start(self) -> None:
        async def loop() -> None:
            while True:
                await asyncio.sleep(self.interval_s)
                await self.probe_due()

        self._task = asyncio.get_running_loop().create_task(loop())

    async def stop(self) -> None:
        if self._task is not None:
            self._task.cancel()
            with contextlib.suppress(asyncio.CancelledError):
                await self._task


class ReuseIndex:
    """Which encoder last took each image (by a digest of its bytes), LRU-bounded.

    Routing an image to the encoder that holds it turns a would-be duplicate encode into a
    cache hit there. Entries are recorded when a request is routed, before its encode
    finishes, so concurrent requests for a new image meet on one encoder (which encodes
    it once). An entry may be stale -- the encoder evicted the image -- which costs one
    encode there, never a wrong answer: the encoder keys its cache by decoded pixels.
    """

    def __init__(self, max_entries: int) -> None:
        self.max_entries = max_entries
        self._holders: OrderedDict[str, str] = OrderedDict()

    def __len__(self) -> int:
        return len(self._holders)

    def holder(self, key: str) -> str | None:
        found = self._holders.get(key)
        if found is not None:
            self._holders.move_to_end(key)
        return found

    def record(self, key: str, server: str) -> None:
        self._holders[key] = server
        self._holders.move_to_end(key)
        while len(self._holders) > self.max_entries:
            self._holders.popitem(last=False)

    def forget(self, key: str, server: str) -> None:
        if self._holders.get(key) == server:
            del self._holders[key]

    def forget_server(self, server: str) -> int:
        """Drop every image recorded on ``server`` (it died or restarted: its cache is gone)."""
        keys = [k for k, s in self._holders.items() if s == server]
        for key in keys:
            del self._holders[key]
        return len(keys)
