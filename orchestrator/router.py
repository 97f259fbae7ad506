"""Which server serves a stage call when several host that stage.

Least outstanding work: each call goes to the server with the fewest calls in flight from
this front, ties broken round-robin so an idle cluster still spreads load. (Cache locality
and health tracking build on this.)
"""

from __future__ import annotations

import contextlib
import itertools
from collections.abc import Iterator

from orchestrator.stage_client import StageClient


class StageRoute:
    """The servers hosting one stage, with the calls this process has in flight to each."""

    def __init__(self, stage: str, targets: dict[str, StageClient]) -> None:
        if not targets:
            raise ValueError(f"no server hosts stage {stage!r}")
        self.stage = stage
        self._targets = targets
        self._outstanding = dict.fromkeys(targets, 0)
        self._turn = itertools.count()

    @property
    def outstanding(self) -> dict[str, int]:
        return dict(self._outstanding)

    def choose(self) -> str:
        names = list(self._targets)
        start = next(self._turn) % len(names)
        rotated = names[start:] + names[:start]
        return min(rotated, key=self._outstanding.__getitem__)

    @contextlib.contextmanager
    def pick(self) -> Iterator[StageClient]:
        """The chosen server's client, counted as busy until the block ends."""
        name = self.choose()
        self._outstanding[name] += 1
        try:
            yield self._targets[name]
        finally:
            self._outstanding[name] -= 1
