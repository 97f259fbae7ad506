"""Stage responses straight back to the caller, beside Triton (as Dynamo streams a
worker's responses over its own TCP connection to the caller).

A stage call's request, its cancellation and its errors go through Triton; with a reply
channel, its responses do not. Through Triton each streamed token crossed the stage's
python-backend stub, its IPC to the server, the server's gRPC frontend and the caller's
gRPC stream: 1.6-2.2 ms per response at p50 on an idle box, more under load, and a
request's last token arrives that much later. The stage's event loop writes it to a
socket instead, and the caller's event loop reads it.

How a call uses it:
- The caller (``ReplyListener``, one per process that calls stages) gives the call
  a fresh, unguessable id and sends ``host:port/id`` as the call's ``REPLY_PARAMETER``,
  bound into the call's MAC (``DeploymentKey.sign_call``).
- The stage (``ReplyWriter``, on the runner's event loop) writes each response as a frame
  on one connection per caller address, the last one marked; a call that ends without a
  marked response gets an empty marked frame. Only then does it send Triton's final flag,
  so the caller can finish at the marked frame without waiting for Triton (and a caller
  that sees the final flag first waits for the frames, which left before it).
  A write that fails turns the call's Triton final into an ``INTERNAL`` error.
- A connection opens with a token derived from the deployment secret; the listener
  drops any connection without it, and frames for a call it does not know (ended,
  cancelled) are dropped.
- A model honours it only on a call whose MAC covers it: a public model, which takes
  anyone's call, connects only where a holder of the secret (the OpenAI front) said.
"""

from __future__ import annotations

import asyncio
import hmac
import ipaddress
import logging
import secrets
import socket
import struct
from dataclasses import dataclass
from typing import TYPE_CHECKING

import msgspec
import numpy as np

from orchestrator.protocol import StageError, Tensors

if TYPE_CHECKING:
    from orchestrator.auth import DeploymentKey
    from orchestrator.config import Topology

log = logging.getLogger(__name__)


REPLY_PARAMETER = "epd-reply-to"
"""Triton request parameter: where the stage writes the call's responses."""
MAX_FRAME_BYTES = 64 * 2**20
"""Largest frame a listener reads (a stage's response is text, token counts or a handle:
far below; a peer that claims more is dropped)."""
CONNECT_TIMEOUT_S = 2.0
"""How long a stage waits to connect to a caller (then the call fails)."""
WRITE_TIMEOUT_S = 10.0
"""How long one write may wait for a caller that stopped reading: then the call fails
instead of holding up every other call on that connection."""

_LENGTH = struct.Struct(">I")


class _Frame(msgspec.Struct, array_like=True):
    call: str
    last: bool
    outputs: dict[str, tuple[str, list[int], bytes | list[bytes]]]


_encoder = msgspec.msgpack.Encoder()
_decoder = msgspec.msgpack.Decoder(_Frame)
_hello_decoder = msgspec.msgpack.Decoder(str)


def encode_frame(call: str, outputs: Tensors, last: bool) -> bytes:
    """One length-prefixed frame: a response's tensors (numeric as raw bytes, BYTES as a
    list of byte strings)."""
    packed = {}
    for name, value in outputs.items():
        if value.dtype == np.object_:
            data: bytes | list[bytes] = [
                v if isinstance(v, bytes) else str(v).encode() for v in value.reshape(-1)
            ]
        else:
            data = np.ascontiguousarray(value).tobytes()
        packed[name] = (value.dtype.str, list(value.shape), data)
    body = _encoder.encode(_Frame(call, last, packed))
    return _LENGTH.pack(len(body)) + body


def decode_frame(body: bytes) -> tuple[str, bool, Tensors]:
    frame = _decoder.decode(body)
    outputs = {}
    for name, (dtype, shape, data) in frame.outputs.items():
        if isinstance(data, list):
            array = np.empty(len(data), dtype=np.object_)
            array[:] = data
        else:
            array = np.frombuffer(data, dtype=np.dtype(dtype))
        outputs[name] = array.reshape(shape)
    return frame.call, frame.last, outputs


def _hello(token: str) -> bytes:
    body = _encoder.encode(token)
    return _LENGTH.pack(len(body)) + body


def parse_reply_to(value: object) -> tuple[tuple[str, int], str]:
    """``(host, port), call id`` of a ``REPLY_PARAMETER``; ``StageError`` when malformed."""
    try:
        address, call = str(value).rsplit("/", 1)
        host, port = address.rsplit(":", 1)
        return (host.strip("[]"), int(port)), call
    except ValueError:
        raise StageError(f"malformed {REPLY_PARAMETER} parameter: {value!r}") from None


class ReplyListener:
    """The caller's side: one TCP listener per process that calls stages, on its loop."""

    def __init__(self, bind_host: str, token: str) -> None:
        self._bind_host = bind_host
        self._token = token
        self._calls: dict[str, asyncio.Queue] = {}
        self._server: asyncio.Server | None = None
        self._connections: dict[asyncio.Task, asyncio.StreamWriter] = {}
        self.port = 0

    @classmethod
    def for_server(cls, topology: Topology, server: str, key: DeploymentKey) -> ReplyListener:
        """The listener of a process that calls stages from ``server`` (not started)."""
        return cls(topology.servers[server].bind_address, key.reply_token)

    async def start(self) -> None:
        self._server = await asyncio.start_server(self._serve, self._bind_host, 0)
        self.port = self._server.sockets[0].getsockname()[1]

    def address_toward(self, peer_host: str) -> str:
        """``host:port`` a stage at ``peer_host`` reaches this listener at: the bind
        address, or (bound to every interface) this host's address on the route to it."""
        host = self._bind_host
        if host in ("0.0.0.0", "::"):
            host = _local_address_toward(peer_host)
        return f"[{host}]:{self.port}" if ":" in host else f"{host}:{self.port}"

    def open(self) -> tuple[str, asyncio.Queue]:
        """A new call's id and the queue its frames arrive on, as ``(last, tensors)``."""
        call = secrets.token_hex(16)
        inbox: asyncio.Queue = asyncio.Queue()
        self._calls[call] = inbox
        return call, inbox

    def forget(self, call: str) -> None:
        self._calls.pop(call, None)

    async def _serve(self, reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        task = asyncio.current_task()
        assert task is not None
        self._connections[task] = writer
        try:
            hello = _hello_decoder.decode(await _read_frame(reader))
            if not hmac.compare_digest(hello, self._token):
                log.warning("reply channel: refused a connection without the deployment's token")
                return
            while True:
                call, last, outputs = decode_frame(await _read_frame(reader))
                inbox = self._calls.get(call)
                if inbox is not None:
                    inbox.put_nowait((last, outputs))
        except (asyncio.IncompleteReadError, ConnectionError):
            pass  # the stage closed the connection (it stopped, or restarts)
        except (msgspec.DecodeError, ValueError, TypeError) as exc:
            log.warning("reply channel: dropped a connection that sent a bad frame: %s", exc)
        finally:
            self._connections.pop(task, None)
            writer.close()

    async def close(self) -> None:
        """Stop listening and close every connection: each one's read ends at end of file
        and its task returns. (Cancelling the tasks instead makes asyncio's stream
        machinery report a CancelledError to the loop's exception handler on 3.11, a
        traceback in the log at every shutdown.)"""
        if self._server is not None:
            self._server.close()
        tasks = list(self._connections)
        for writer in self._connections.values():
            writer.close()
        await asyncio.gather(*tasks, return_exceptions=True)
        self._calls.clear()


async def _read_frame(reader: asyncio.StreamReader) -> bytes:
    (length,) = _LENGTH.unpack(await reader.readexactly(_LENGTH.size))
    if length > MAX_FRAME_BYTES:
        raise ValueError(f"frame of {length} bytes (limit {MAX_FRAME_BYTES})")
    return await reader.readexactly(length)


def _local_address_toward(peer_host: str) -> str:
    """This host's source address for packets to ``peer_host`` (no packet is sent)."""
    family = socket.AF_INET6 if _is_ipv6(peer_host) else socket.AF_INET
    with socket.socket(family, socket.SOCK_DGRAM) as probe:
        probe.connect((peer_host, 9))
        return probe.getsockname()[0]


def _is_ipv6(host: str) -> bool:
    try:
        return ipaddress.ip_address(host).version == 6
    except ValueError:
        return False


@dataclass
class Reply:
    """Where one call's responses go, and whether writing them has failed."""

    address: tuple[str, int]
    call: str
    broken: bool = False


class ReplyWriter:
    """The stage's side: one connection per caller address, written from the runner's
    event loop. A write is a non-blocking send (the kernel takes it, or asyncio buffers
    it), not a round trip: no thread hand-off per response, as Triton's ``send`` needs."""

    def __init__(self, token: str) -> None:
        self._hello = _hello(token)
        self._connections: dict[
            tuple[str, int], tuple[asyncio.StreamReader, asyncio.StreamWriter]
        ] = {}
        self._connecting: dict[tuple[str, int], asyncio.Lock] = {}

    async def write(self, reply: Reply, frame: bytes) -> None:
        """Write ``frame``, waiting while the caller is behind (TCP's own backpressure);
        on failure mark ``reply`` broken and drop the connection (the next call to that
        address opens a fresh one)."""
        if reply.broken:
            return
        try:
            writer = await self._connection(reply.address)
            writer.write(frame)
            async with asyncio.timeout(WRITE_TIMEOUT_S):
                await writer.drain()
        except (OSError, TimeoutError) as exc:
            log.warning("reply channel to %s:%d failed: %r", *reply.address, exc)
            reply.broken = True
            connection = self._connections.pop(reply.address, None)
            if connection is not None:
                connection[1].close()

    async def _connection(self, address: tuple[str, int]) -> asyncio.StreamWriter:
        """The open connection to ``address``, or a new one. One the caller closed (its
        end of file has come in; the caller never sends) is replaced, so no frame is
        written into a socket whose peer is gone."""
        connection = self._connections.get(address)
        if connection is not None and _usable(*connection):
            return connection[1]
        async with self._connecting.setdefault(address, asyncio.Lock()):
            connection = self._connections.get(address)
            if connection is None or not _usable(*connection):
                if connection is not None:
                    connection[1].close()
                async with asyncio.timeout(CONNECT_TIMEOUT_S):
                    connection = await asyncio.open_connection(*address)
                sock = connection[1].get_extra_info("socket")
                sock.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
                connection[1].write(self._hello)
                self._connections[address] = connection
            return connection[1]

    async def close(self) -> None:
        for _, writer in self._connections.values():
            writer.close()
        self._connections.clear()


def _usable(reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> bool:
    return not (reader.at_eof() or writer.is_closing())
