"""The runner's sending thread: order, the final flag, and waiting for a response to leave.

The Triton pieces are the two the thread touches (a response sender, the final flag's
value and the logger); the sender here blocks until the test lets it go, as a busy server
holds the stub's ``send``.
"""

import asyncio
import threading
from types import SimpleNamespace

import pytest

from orchestrator.reply_channel import Reply
from orchestrator.triton.runner import ResponseSendThread

FINAL = 1


class HeldSender:
    """A response sender whose ``send`` returns only when ``release`` is set."""

    def __init__(self, fail_on: object = None) -> None:
        self.release = threading.Event()
        self.sent: list[tuple[object, int]] = []
        self.fail_on = fail_on

    def send(self, response: object, flags: int = 0) -> None:
        self.release.wait(5)
        if response is self.fail_on:
            raise RuntimeError("the server refused it")
        self.sent.append((response, flags))


def pb_utils(errors: list[str]) -> SimpleNamespace:
    return SimpleNamespace(
        TRITONSERVER_RESPONSE_COMPLETE_FINAL=FINAL,
        Logger=SimpleNamespace(log_error=errors.append),
    )


@pytest.fixture
def loop():
    loop = asyncio.new_event_loop()
    thread = threading.Thread(target=loop.run_forever, daemon=True)
    thread.start()
    yield loop
    loop.call_soon_threadsafe(loop.stop)
    thread.join(5)
    loop.close()


def run(loop, coro, timeout_s: float = 5):
    return asyncio.run_coroutine_threadsafe(coro, loop).result(timeout_s)


def test_responses_leave_in_order_and_the_last_carries_the_final_flag(loop):
    sender, errors = HeldSender(), []
    thread = ResponseSendThread("m", pb_utils(errors), loop)
    sender.release.set()
    tickets = [thread.send(sender, f"r{i}") for i in range(5)]
    thread.send(sender, "last", final=True)
    run(loop, thread.wait_sent(tickets[-1]))
    thread.stop()
    assert sender.sent == [(f"r{i}", 0) for i in range(5)] + [("last", FINAL)]
    assert errors == []


def test_waiting_for_a_response_returns_only_once_it_has_left(loop):
    sender = HeldSender()
    thread = ResponseSendThread("m", pb_utils([]), loop)
    ticket = thread.send(sender, "r0")
    waiting = asyncio.run_coroutine_threadsafe(thread.wait_sent(ticket), loop)
    with pytest.raises(TimeoutError):
        waiting.result(0.3)  # the server still holds the send
    assert sender.sent == []
    sender.release.set()
    waiting.result(5)
    assert sender.sent == [("r0", 0)]
    run(loop, thread.wait_sent(ticket))  # already sent: returns at once
    thread.stop()


def test_a_request_that_stops_waiting_leaves_the_thread_serving(loop):
    sender, errors = HeldSender(), []
    thread = ResponseSendThread("m", pb_utils(errors), loop)
    ticket = thread.send(sender, "r0")
    waiting = asyncio.run_coroutine_threadsafe(thread.wait_sent(ticket), loop)
    with pytest.raises(TimeoutError):
        waiting.result(0.2)
    waiting.cancel()  # the request was cancelled while its response was queued
    sender.release.set()
    run(loop, thread.wait_sent(thread.send(sender, "r1")))
    thread.stop()
    assert sender.sent == [("r0", 0), ("r1", 0)]
    assert errors == []


def test_a_failed_send_is_logged_and_still_counts_as_sent(loop):
    bad = object()
    sender, errors = HeldSender(fail_on=bad), []
    thread = ResponseSendThread("m", pb_utils(errors), loop)
    sender.release.set()
    ticket = thread.send(sender, bad)
    run(loop, thread.wait_sent(ticket))
    thread.send(sender, "last", final=True)
    thread.stop()
    assert sender.sent == [("last", FINAL)]
    assert len(errors) == 1 and "the server refused it" in errors[0]


def test_a_call_whose_reply_channel_failed_ends_in_an_error_not_a_clean_final(loop):
    """Its answer never reached the caller: a clean final flag would read as an empty
    answer there, so the final carries the failure instead."""
    errors: list[str] = []
    pb = pb_utils(errors)
    pb.TritonError = TritonError
    pb.InferenceResponse = lambda error: ("error", error.message, error.code)
    sender = HeldSender(fail_on=object())  # a clean final's response is None
    sender.release.set()
    thread = ResponseSendThread("m", pb, loop)
    broken = Reply(("127.0.0.1", 4000), "c1", broken=True)
    thread.send(sender, final=True, reply=broken)
    run(loop, thread.wait_sent(thread.send(sender, final=True, reply=Reply(("h", 1), "c2"))))
    thread.stop()
    assert errors == []
    (error, flags), clean = sender.sent
    assert flags == FINAL and error[0] == "error" and error[2] == TritonError.INTERNAL
    assert error[1] == "INTERNAL: the reply channel to 127.0.0.1:4000 failed"
    assert clean == (None, FINAL)


class TritonError:
    INTERNAL = 13

    def __init__(self, message: str, code: int) -> None:
        self.message, self.code = message, code
