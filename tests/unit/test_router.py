"""Least-outstanding routing among the servers of one stage (pure logic)."""

from __future__ import annotations

import pytest

from orchestrator.router import StageRoute


class _Client:  # the route only hands clients out; it never calls them
    def __init__(self, name: str) -> None:
        self.name = name


def _route(*names: str) -> StageRoute:
    return StageRoute("encode", {n: _Client(n) for n in names})  # type: ignore[misc]


def test_idle_servers_take_turns():
    route = _route("a", "b", "c")
    picked = []
    for _ in range(6):
        with route.pick() as client:
            picked.append(client.name)
    assert sorted(picked) == ["a", "a", "b", "b", "c", "c"]


def test_busy_server_is_avoided_until_it_frees_up():
    route = _route("a", "b")
    with route.pick() as held:
        for _ in range(3):
            with route.pick() as other:
                assert other.name != held.name
        assert route.outstanding[held.name] == 1
    assert route.outstanding == {"a": 0, "b": 0}


def test_outstanding_is_released_when_the_call_fails():
    route = _route("a")
    with pytest.raises(RuntimeError), route.pick():
        raise RuntimeError("stage failed")
    assert route.outstanding == {"a": 0}


def test_a_stage_without_servers_is_an_error():
    with pytest.raises(ValueError, match="no server hosts stage 'encode'"):
        _route()
