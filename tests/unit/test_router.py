"""Routing among the servers of one stage: load, locality, health (pure logic)."""

from __future__ import annotations

import asyncio
import time

import pytest

from orchestrator.protocol import Unavailable
from orchestrator.router import HealthMonitor, ReuseIndex, StageRoute


class _Client:  # the route only hands clients out; it never calls them
    def __init__(self, name: str) -> None:
        self.name = name


def _route(*names: str) -> StageRoute:
    return StageRoute("encode", {n: _Client(n) for n in names})  # type: ignore[misc]


def test_idle_servers_take_turns():
    route = _route("a", "b", "c")
    picked = []
    for _ in range(6):
        with route.use(route.choose()) as client:
            picked.append(client.name)
    assert sorted(picked) == ["a", "a", "b", "b", "c", "c"]


def test_busy_server_is_avoided_until_it_frees_up():
    route = _route("a", "b")
    with route.use(route.choose()) as held:
        for _ in range(3):
            with route.use(route.choose()) as other:
                assert other.name != held.name
        assert route.outstanding[held.name] == 1
    assert route.outstanding == {"a": 0, "b": 0}


def test_outstanding_is_released_when_the_call_fails():
    route = _route("a")
    with pytest.raises(RuntimeError), route.use(route.choose()):
        raise RuntimeError("stage failed")
    assert route.outstanding == {"a": 0}


def test_a_stage_without_servers_is_an_error():
    with pytest.raises(ValueError, match="no server hosts stage 'encode'"):
        _route()


def test_preferred_server_wins_unless_down_or_excluded():
    route = _route("a", "b")
    with route.use("b"):
        assert route.choose(prefer="b") == "b"  # locality beats load
    assert route.choose(prefer="b", exclude=["b"]) == "a"
    route.mark_down("b", "connection refused")
    assert route.choose(prefer="b") == "a"


def test_no_healthy_server_to_choose_says_why():
    route = _route("a", "b")
    route.mark_down("a", "connection refused")
    with pytest.raises(Unavailable, match=r"already tried \['b'\]\); a: connection refused"):
        route.choose(exclude=["b"])
    route.mark_up("a")
    assert route.choose(exclude=["b"]) == "a"


class _Probed:
    def __init__(self, answer) -> None:
        self.answer = answer
        self.asked: list[str] = []

    async def ready(self, model: str) -> bool:
        self.asked.append(model)
        if isinstance(self.answer, Exception):
            raise self.answer
        return self.answer


def test_probes_take_out_and_readmit():
    clients = {"up": _Probed(True), "down": _Probed(ConnectionError("refused"))}
    route = StageRoute("decode", clients)  # type: ignore[arg-type]
    monitor = HealthMonitor([route], interval_s=60, timeout_s=1)
    asyncio.run(monitor.probe_due())  # never probed: both
    assert route.healthy == ["up"] and "refused" in route._down["down"]
    clients["down"].answer = True
    with route.use("up"):  # called since its probe: due again, as "down" is
        pass
    asyncio.run(monitor.probe_due())
    assert route.healthy == ["up", "down"]
    assert clients["up"].asked == ["decode", "decode"]  # the stage's model is probed


def test_idle_servers_are_probed_at_the_idle_pace():
    """Every tick probes the servers out of rotation and those called since their last
    probe; one nobody called waits for the idle interval."""
    clients = {n: _Probed(True) for n in ("called", "busy", "idle", "down")}
    route = StageRoute("pd", clients)  # type: ignore[arg-type]
    monitor = HealthMonitor([route], interval_s=1, timeout_s=1, idle_interval_s=30)

    def asked() -> dict[str, int]:
        return {name: len(client.asked) for name, client in clients.items()}

    asyncio.run(monitor.probe_due())  # never probed: all of them
    asyncio.run(monitor.probe_due())  # nothing happened since: none
    assert asked() == {"called": 1, "busy": 1, "idle": 1, "down": 1}

    with route.use("called"):
        pass
    clients["down"].answer = False
    route.mark_down("down", "connection refused")  # as a failed call does
    with route.use("busy"):
        asyncio.run(monitor.probe_due())
        asyncio.run(monitor.probe_due())  # a call still in flight keeps it due
    assert asked() == {"called": 2, "busy": 3, "idle": 1, "down": 3}
    clients["down"].answer = True
    asyncio.run(monitor.probe_due())  # out of rotation: probed every tick, so re-admitted
    assert route.healthy == ["called", "busy", "idle", "down"]

    later = time.monotonic() + 30
    assert [n for n in clients if route.probe_due(n, 30, later)] == list(clients)
    slower = HealthMonitor([route], interval_s=10, timeout_s=1, idle_interval_s=5)
    assert slower.idle_interval_s == 10  # never more often than the interval


def test_reuse_index_is_bounded_and_forgets_a_dead_server():
    index = ReuseIndex(max_entries=2)
    index.record("x", "enc1")
    index.record("y", "enc2")
    index.holder("x")  # x is now the most recent
    index.record("z", "enc1")
    assert (index.holder("x"), index.holder("y"), index.holder("z")) == ("enc1", None, "enc1")
    index.forget("x", "enc2")  # someone else's record: kept
    assert index.holder("x") == "enc1"
    assert index.forget_server("enc1") == 2 and len(index) == 0


def test_require_probes_again_before_failing():
    clients = {"d": _Probed(True)}
    route = StageRoute("decode", clients)  # type: ignore[arg-type]
    route.mark_down("d", "refused")
    asyncio.run(route.require(probe_timeout_s=1))  # back: re-admitted on the spot
    assert route.healthy == ["d"]
    clients["d"].answer = False
    route.mark_down("d", "refused")
    with pytest.raises(Unavailable, match="no healthy decode server left; d: not ready"):
        asyncio.run(route.require(probe_timeout_s=1))


def test_a_server_too_busy_to_answer_a_probe_stays_until_it_misses_several():
    class _Slow:
        def __init__(self) -> None:
            self.delay = 5.0

        async def ready(self, model: str) -> bool:
            await asyncio.sleep(self.delay)
            return True

    slow = _Slow()
    route = StageRoute("prefill", {"p": slow}, misses_to_down=3)  # type: ignore[dict-item]

    async def probes(n: int) -> list[bool]:
        return [await route.probe("p", timeout_s=0.01) for _ in range(n)]

    assert asyncio.run(probes(2)) == [True, True] and route.healthy == ["p"]
    assert asyncio.run(probes(1)) == [False]
    assert "3 readiness probes in a row unanswered" in route._down["p"]
    slow.delay = 0
    assert asyncio.run(probes(1)) == [True] and route.healthy == ["p"]
    slow.delay = 5.0
    assert asyncio.run(probes(2)) == [True, True]  # the count starts again after an answer
