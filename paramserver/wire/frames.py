"""The frames of the doorbell and the data socket: a length-prefixed protobuf message, then raw tensor bytes.

gRPC Python handles every message in Python through a thread hand-off on each side, and copies each chunk into a
new `bytes` both ways: on a 2-core machine that is about 1 GB/s per direction and 0.5-1 ms per call. The same
ExchangeRequest sent as a frame over a plain socket (paramserver.transport) avoids both: the gradient follows the
request as raw bytes and the weights follow the reply, each received with `recv_into` straight into float32 arrays.

Frames, little-endian:

    request:  u32 message length, f64 timeout in seconds, u64 payload length, the message, the payload
              (an AttachRequest first, with no payload; then ExchangeRequests)
    reply:    u32 body length, u64 payload length, the body, the payload; the body is u8 status (0: OK, else a
              grpc.StatusCode value), then the ExchangeResponse on OK, or u8 length + error type name + UTF-8
              message

A payload is the shard's pieces back to back (see Placement), in the dtype the ExchangeRequest names: the gradient
on a push, the weights on a pull's reply. A shard refuses a payload of the wrong size (and reads it to the end, so
the connection stays in step); a frame it cannot parse ends the connection. A message with a field past its bound
in ps.proto is refused INVALID_ARGUMENT (OutOfBounds): after a hello the connection then ends, after an Exchange it
goes on.
"""

from __future__ import annotations

import socket
import ssl
import struct
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from typing import Any

import grpc
import numpy as np

from paramserver.errors import MalformedStream, PSError, Undecodable
from paramserver.v1 import ps_pb2
from paramserver.wire import bounds
from paramserver.wire.chunks import CHUNK_BYTES, FLOAT32, decode_into, itemsize, iter_chunks

REQUEST = struct.Struct("<IdQ")
REPLY = struct.Struct("<IQ")
MAX_FRAME = 1 << 20  # control messages only: tensor bytes travel as payloads (or through the segment)
_SEND_CHUNK = 8 << 20  # float32 payloads go out as views of this many bytes (the GIL is released meanwhile)
CODES = {c.value[0]: c for c in grpc.StatusCode}
_MAX_PARTS = 512  # buffers per sendmsg(), well under the system's IOV_MAX (1024 on Linux)


def recv_into(sock: socket.socket, view: memoryview) -> bool:
    """Fill `view` from the socket; False on a clean end of stream before the first byte."""
    got, n = 0, len(view)
    while got < n:
        k = sock.recv_into(view[got:])
        if k == 0:
            if got == 0:
                return False
            raise ConnectionError("frame cut off")
        got += k
    return True


def recv_exact(sock: socket.socket, n: int) -> bytes | None:
    buf = bytearray(n)
    return bytes(buf) if recv_into(sock, memoryview(buf)) else None  # n == 0: an empty read succeeds


def payload_bytes(arrays: Sequence[np.ndarray], dtype: int) -> int:
    """The payload length of these float32 arrays in a wire dtype."""
    return sum(len(a) for a in arrays) * itemsize(dtype)


def send_frame(sock: socket.socket, head: bytes, arrays: Sequence[np.ndarray] = (), dtype: int = FLOAT32) -> None:
    """Send a frame: its header and message (`head`), then `arrays` as its payload in `dtype`. A payload of at most
    1 MiB goes out in the same system call as the head (scatter-gather, no copy), so the peer wakes once per
    frame, not twice; a larger one follows it (`send_arrays`)."""
    if payload_bytes(arrays, dtype) > CHUNK_BYTES:
        sock.sendall(head)
        send_arrays(sock, arrays, dtype)
        return
    parts = [memoryview(head), *(data for _, _, data in iter_chunks(arrays, dtype, CHUNK_BYTES))]
    if isinstance(sock, ssl.SSLSocket):  # no sendmsg over TLS: one record stream, one copy of a small frame
        sock.sendall(b"".join(parts))
        return
    while parts:
        sent = sock.sendmsg(parts[:_MAX_PARTS])
        while parts and sent >= len(parts[0]):
            sent -= len(parts.pop(0))
        if sent:
            parts[0] = parts[0][sent:]


def send_arrays(sock: socket.socket, arrays: Sequence[np.ndarray], dtype: int) -> None:
    """Send float32 arrays as a payload in `dtype`: float32 as views of the arrays themselves, half types encoded
    a chunk at a time."""
    chunk = _SEND_CHUNK if dtype == FLOAT32 else CHUNK_BYTES
    for _, _, data in iter_chunks(arrays, dtype, chunk, reuse=True):
        sock.sendall(data)


def recv_arrays(sock: socket.socket, targets: Sequence[np.ndarray], dtype: int) -> None:
    """Receive a payload in `dtype` into float32 targets, in order: float32 straight into their memory, half types
    through a 1 MiB buffer."""
    if dtype == FLOAT32:
        for t in targets:
            if len(t) and not recv_into(sock, t.data.cast("B")):
                raise ConnectionError("payload cut off")
        return
    size = itemsize(dtype)
    buf = memoryview(bytearray(CHUNK_BYTES))
    step = CHUNK_BYTES // size
    for t in targets:
        for off in range(0, len(t), step):
            n = min(step, len(t) - off)
            if not recv_into(sock, buf[: n * size]):
                raise ConnectionError("payload cut off")
            decode_into(t[off : off + n], buf[: n * size], dtype)


def _discard(sock: socket.socket, n: int) -> None:
    buf = memoryview(bytearray(min(n, CHUNK_BYTES) or 1))
    while n > 0:
        k = min(n, len(buf))
        if not recv_into(sock, buf[:k]):
            raise ConnectionError("payload cut off")
        n -= k


class Payload:
    """The bytes that follow a request frame, read by the handler into its own arrays (once, whole)."""

    def __init__(self, sock: socket.socket, size: int) -> None:
        self._sock = sock
        self.size = size
        self._read = False

    def read_into(self, targets: Sequence[np.ndarray], dtype: int) -> None:
        """Receive the payload into float32 targets; MalformedStream (nothing read) unless it is their size."""
        expected = payload_bytes(targets, dtype)
        if self.size != expected:
            raise MalformedStream(
                f"a payload of {self.size} bytes where this shard's part of the model takes {expected} "
                f"(pieces back to back, in the request's dtype)"
            )
        self._read = True
        recv_arrays(self._sock, targets, dtype)

    def finish(self) -> None:
        """Read and drop whatever the handler did not take, so the next frame starts in step."""
        if not self._read and self.size:
            self._read = True
            _discard(self._sock, self.size)


@dataclass
class Reply:
    """What a handler answers: the message, and the float32 arrays to send after it as the payload."""

    message: ps_pb2.ExchangeResponse
    arrays: Sequence[np.ndarray] = field(default_factory=list)
    dtype: int = FLOAT32
    release: Callable[[], object] | None = None  # called once the arrays are sent (or the send failed)


# What a shard does with the frames: check a hello; answer an Exchange (raising PSError to refuse it).
Verify = Callable[[ps_pb2.AttachRequest], None]
Handle = Callable[[ps_pb2.ExchangeRequest, float, Payload], Reply]


def error_body(exc: PSError) -> bytes:
    name = type(exc).__name__.encode()[:255]
    return bytes([exc.code.value[0], len(name)]) + name + str(exc).encode()


def send_reply(sock: socket.socket, body: bytes, arrays: Sequence[np.ndarray] = (), dtype: int = FLOAT32) -> None:
    send_frame(sock, REPLY.pack(len(body), payload_bytes(arrays, dtype)) + body, arrays, dtype)


# The frames' messages, decoded and checked against the bounds of ps.proto as the gRPC requests are.
HELLO = bounds.decoder(ps_pb2.AttachRequest, "Attach (socket hello)")
EXCHANGE = bounds.decoder(ps_pb2.ExchangeRequest, "Exchange (socket)")


def read_request(conn: socket.socket) -> tuple[float, bytes, int] | None:
    """(timeout, message bytes, payload length) of the next request frame, or None at a clean end of stream."""
    head = recv_exact(conn, REQUEST.size)
    if head is None:
        return None
    length, timeout, payload = REQUEST.unpack(head)
    if length > MAX_FRAME:
        raise ConnectionError(f"frame of {length} bytes is over the limit of {MAX_FRAME}")
    body = recv_exact(conn, length)
    if body is None:
        raise ConnectionError("frame cut off")
    return timeout, body, payload


def decode_message(decode: Callable[[bytes], Any], body: bytes) -> Any:
    """A frame's message; OutOfBounds (to answer) for a field past its bound. A frame that is no such message
    ends the connection."""
    try:
        return decode(body)
    except Undecodable as exc:
        raise ConnectionError(str(exc)) from None
