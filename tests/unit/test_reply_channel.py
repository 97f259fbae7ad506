"""The reply channel over real loopback sockets: frames reach their call, in order, and
nothing reaches a call from a peer without the deployment's token. The stage's side is the
``ReplyWriter`` the runner's sending thread uses; the caller's the pipeline's listener."""

from __future__ import annotations

import asyncio
import struct
from collections.abc import Awaitable, Callable

import numpy as np
import pytest

from orchestrator.auth import DeploymentKey
from orchestrator.ports import free_ports
from orchestrator.protocol import StageError
from orchestrator.reply_channel import (
    MAX_FRAME_BYTES,
    Reply,
    ReplyListener,
    ReplyWriter,
    decode_frame,
    encode_frame,
    parse_reply_to,
)

TOKEN = DeploymentKey("k" * 64).reply_token


def test_a_frame_carries_numeric_and_bytes_tensors_unchanged():
    outputs = {
        "text_output": np.array(["héllo".encode(), b""], dtype=np.object_),
        "num_output_tokens": np.array([[3]], dtype=np.int32),
        "logits": np.linspace(0, 1, 6, dtype=np.float16).reshape(2, 3),
    }
    frame = encode_frame("c1", outputs, last=True)
    (length,) = struct.unpack(">I", frame[:4])
    assert length == len(frame) - 4
    call, last, decoded = decode_frame(frame[4:])
    assert (call, last) == ("c1", True)
    assert decoded.keys() == outputs.keys()
    for name, value in outputs.items():
        assert decoded[name].dtype == value.dtype and decoded[name].shape == value.shape
        assert decoded[name].tolist() == value.tolist()
    assert decode_frame(encode_frame("c2", {}, last=False)[4:]) == ("c2", False, {})


def test_a_reply_address_parses_or_is_refused_with_its_value():
    assert parse_reply_to("10.1.2.3:4000/abc") == (("10.1.2.3", 4000), "abc")
    assert parse_reply_to("[::1]:4000/abc") == (("::1", 4000), "abc")
    for bad in ("10.1.2.3:4000", "10.1.2.3/abc", "host:port/abc"):
        with pytest.raises(StageError, match="malformed"):
            parse_reply_to(bad)


def with_listener(body: Callable[[ReplyListener], Awaitable[None]]) -> None:
    """Run ``body`` with a started listener on loopback, closed after it."""

    async def main() -> None:
        listener = ReplyListener("127.0.0.1", TOKEN)
        await listener.start()
        try:
            await body(listener)
        finally:
            await listener.close()

    asyncio.run(main())


async def _get(inbox: asyncio.Queue) -> tuple[bool, dict]:
    async with asyncio.timeout(5):
        return await inbox.get()


def test_frames_reach_their_own_call_in_order():
    async def body(listener: ReplyListener) -> None:
        (call_a, inbox_a), (call_b, inbox_b) = listener.open(), listener.open()
        assert call_a != call_b and len(call_a) == 32
        address = ("127.0.0.1", listener.port)
        assert listener.address_toward("127.0.0.1") == f"127.0.0.1:{listener.port}"
        writer = ReplyWriter(TOKEN)
        reply_a, reply_b = Reply(address, call_a), Reply(address, call_b)
        token = {"t": np.array([7], dtype=np.int64)}
        await writer.write(reply_a, encode_frame(call_a, token, False))
        await writer.write(reply_b, encode_frame(call_b, {}, True))
        await writer.write(reply_a, encode_frame(call_a, {}, True))
        last, outputs = await _get(inbox_a)
        assert not last and outputs["t"].tolist() == [7]
        assert (await _get(inbox_a))[0] is True
        assert await _get(inbox_b) == (True, {})
        listener.forget(call_a)  # ended: what still comes for it is dropped
        await writer.write(reply_a, encode_frame(call_a, {}, True))
        await writer.write(reply_b, encode_frame(call_b, {}, True))
        assert await _get(inbox_b) == (True, {})
        assert inbox_a.empty()
        assert not reply_a.broken and not reply_b.broken
        await writer.close()

    with_listener(body)


def test_calls_writing_at_once_on_one_connection_each_get_theirs_in_order():
    """Eight calls write five frames each, all at once (as one engine step wakes every
    request it advanced), over the one connection to their caller: no frame is torn or
    lost, and each call gets its own, in order."""

    async def body(listener: ReplyListener) -> None:
        address = ("127.0.0.1", listener.port)
        writer = ReplyWriter(TOKEN)
        calls = [listener.open() for _ in range(8)]

        async def stream(call: str) -> Reply:
            reply = Reply(address, call)
            for i in range(5):
                tokens = {"t": np.array([i], dtype=np.int64)}
                await writer.write(reply, encode_frame(call, tokens, i == 4))
            return reply

        replies = await asyncio.gather(*(stream(call) for call, _ in calls))
        for _, inbox in calls:
            got = [await _get(inbox) for _ in range(5)]
            assert [(last, out["t"].tolist()) for last, out in got] == [
                (i == 4, [i]) for i in range(5)
            ]
        assert not any(reply.broken for reply in replies)
        await writer.close()

    with_listener(body)


def test_a_peer_without_the_token_is_dropped_before_any_frame_counts():
    async def body(listener: ReplyListener) -> None:
        call, inbox = listener.open()
        address = ("127.0.0.1", listener.port)
        impostor = ReplyWriter(DeploymentKey("x" * 64).reply_token)
        reply = Reply(address, call)
        for _ in range(3):  # dropped each time, on a fresh connection each time
            await impostor.write(reply, encode_frame(call, {}, True))
            await asyncio.sleep(0.1)
        assert inbox.empty()
        await impostor.close()

    with_listener(body)


def test_a_peer_that_claims_a_huge_frame_is_dropped_and_others_still_served():
    async def body(listener: ReplyListener) -> None:
        call, inbox = listener.open()
        address = ("127.0.0.1", listener.port)
        reader, writer = await asyncio.open_connection(*address)
        hello = ReplyWriter(TOKEN)._hello
        writer.write(hello + struct.pack(">I", MAX_FRAME_BYTES + 1))
        await writer.drain()
        async with asyncio.timeout(5):
            assert await reader.read() == b""  # closed by the listener
        writer.close()
        good = ReplyWriter(TOKEN)
        await good.write(Reply(address, call), encode_frame(call, {}, True))
        assert await _get(inbox) == (True, {})
        await good.close()

    with_listener(body)


def test_a_caller_that_is_gone_marks_the_reply_broken():
    (port,) = free_ports(1)  # nobody listens there
    reply = Reply(("127.0.0.1", port), "c")
    asyncio.run(ReplyWriter(TOKEN).write(reply, encode_frame("c", {}, True)))
    assert reply.broken


def test_a_listener_closed_under_open_connections_ends_them_quietly():
    """A front that stops while stages are still connected (every shutdown) closes their
    connections: the loop's exception handler hears nothing of it."""

    async def body(listener: ReplyListener) -> None:
        reported: list[dict] = []
        asyncio.get_running_loop().set_exception_handler(lambda _, ctx: reported.append(ctx))
        call, inbox = listener.open()
        writer = ReplyWriter(TOKEN)
        await writer.write(Reply(("127.0.0.1", listener.port), call), encode_frame(call, {}, True))
        assert await _get(inbox) == (True, {})
        await listener.close()
        for _ in range(5):
            await asyncio.sleep(0)
        await writer.close()
        assert reported == []

    with_listener(body)
