"""One request's identity, deadline and cancellation, carried through every hop.

Every handler's ``generate`` receives the ``RequestContext`` of its request (as Dynamo's
handlers receive a context). The runner that serves a model owns it: it cancels the
handler's task when the client cancels or the deadline passes, so every ``await`` in a
handler is a cancellation point and cleanup runs in ``except``/``finally`` blocks. Stage
calls pass the time left to the next hop, which enforces the same deadline there.
"""

from __future__ import annotations

import time
import uuid
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

from orchestrator.protocol import Cancelled, DeadlineExceeded


@dataclass
class RequestContext:
    request_id: str
    """This request's id, the same in every stage's log (and vLLM's request id)."""
    deadline: float
    """``time.monotonic()`` by which the request must be done, everywhere."""
    idle_timeout_s: float
    """Longest wait for the next response of one stage call."""
    cancelled: bool = False
    """Set before the handler's task is cancelled because the client went away."""
    timed_out: bool = False
    """Set before the handler's task is cancelled because the deadline passed."""
    started: float = field(default_factory=time.monotonic)
    trace: Any = None
    """OpenTelemetry context of this request's span in this process: the parent of the
    spans and stage calls made for it (``None``: not traced here)."""
    client_gone: Callable[[], bool] = lambda: False
    """Asks the server now whether the caller cancelled (cheap, but an IPC round trip: for
    a handler about to answer with something it must take back if nobody listens)."""

    @classmethod
    def create(
        cls,
        timeout_s: float,
        idle_timeout_s: float,
        request_id: str | None = None,
    ) -> RequestContext:
        return cls(
            request_id=request_id or uuid.uuid4().hex,
            deadline=time.monotonic() + timeout_s,
            idle_timeout_s=idle_timeout_s,
        )

    def remaining(self) -> float:
        """Seconds left before the deadline (never negative)."""
        return max(0.0, self.deadline - time.monotonic())

    def expired(self) -> bool:
        return time.monotonic() >= self.deadline

    def stop_error(self) -> Cancelled | DeadlineExceeded | None:
        """Why the runner stopped this request, as the error the client gets (or None)."""
        if self.cancelled:
            return Cancelled(f"request {self.request_id} was cancelled by the client")
        if self.timed_out:
            took = time.monotonic() - self.started
            return DeadlineExceeded(
                f"request {self.request_id} passed its deadline after {took:.1f}s"
            )
        return None
