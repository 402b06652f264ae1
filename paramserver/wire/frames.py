"""The frames of the doorbell and the data socket: a length-prefixed protobuf message, then raw tensor bytes.

gRPC Python handles every message in Python through a thread hand-off on each side, and copies each chunk into a
new `bytes` both ways: on a 2-core machine that is about 1 GB/s per direction and 0.5-1 ms per call. The same
ExchangeRequest sent as a frame over a plain socket (paramserver.transport) avoids both: the gradient follows the
request as raw bytes and the weights follow the reply, each received with `recv_into` straight into float32 arrays.

Frames, little-endian:

    request:  u32 message length, f64 timeout in seconds, u64 payload length, the message, the payload, the end
              (an AttachRequest first, with no payload; then ExchangeRequests)
    reply:    u32 body length, u64 payload length, the body, the payload, the end; the body is u8 status (0: OK,
              else a grpc.StatusCode value), then the ExchangeResponse on OK, or u8 length + error type name +
              UTF-8 message
    end:      the 4 bytes "PSFE", then u32 CRC-32 (zlib's) of the frame's header and message (or body)

The end marker is checked before a frame is acted on (after the payload, before a pushed gradient applies), so a
stream out of step (a frame cut short, two interleaved, a payload of another length than announced) is refused,
never applied: the chance that payload bytes read as a marker whose checksum matches is 2^-64. The payload itself
has no checksum of its own (TCP's, and TLS's MAC where TLS is on, cover it): a CRC over a 100 MB payload would
cost more than the exchange.

A payload is the shard's pieces back to back (see Placement), in the dtype the ExchangeRequest names: the gradient
on a push, the weights on a pull's reply; then, raw, the arrays of the sparse rows the message names (a request's
`rows`: each entry's int64 IDs then its float32 values; then each `lookup` entry's IDs; a reply's `rows`: each
entry's float32 values). A push may send the pieces last first (ExchangeRequest.last_piece_first), each as soon as
backward has made it (`send_frame_as_ready`). A shard refuses a payload of the wrong size (and reads it to the end, so
the connection stays in step); a frame it cannot parse ends the connection. A message with a field past its bound
in ps.proto is refused INVALID_ARGUMENT (OutOfBounds): after a hello the connection then ends, after an Exchange it
goes on.
"""

from __future__ import annotations

import fcntl
import itertools
import select
import socket
import ssl
import struct
import sys
import termios
import time
import zlib
from collections.abc import Callable, Iterator, Sequence
from dataclasses import dataclass, field
from typing import Any

import grpc
import numpy as np

from paramserver.errors import MalformedStream, Status, Undecodable
from paramserver.v1 import ps_pb2
from paramserver.wire import bounds
from paramserver.wire.chunks import CHUNK_BYTES, FLOAT32, decode_into, itemsize, iter_chunks

REQUEST = struct.Struct("<IdQ")
REPLY = struct.Struct("<IQ")
END = struct.Struct("<4sI")
END_MARK = b"PSFE"
MAX_FRAME = 1 << 20  # control messages only: tensor bytes travel as payloads (or through the segment)
# A hello is an AttachRequest, a few hundred bytes within its bounds: a frame announcing more is not one.
MAX_HELLO = 4096
_GROW = 64 * 1024  # a message is read in steps of this much: memory follows what arrived, not what was announced
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
    """Read exactly n bytes (None: a clean end of stream before the first), growing the buffer as they arrive."""
    if n <= _GROW:
        buf = bytearray(n)
        return bytes(buf) if recv_into(sock, memoryview(buf)) else None  # n == 0: an empty read succeeds
    out = bytearray()
    while len(out) < n:
        part = sock.recv(min(_GROW, n - len(out)))
        if not part:
            if not out:
                return None
            raise ConnectionError("frame cut off")
        out += part
    return bytes(out)


def end_of(head: bytes | memoryview) -> bytes:
    """The end marker of a frame whose header and message (or body) are `head`."""
    return END.pack(END_MARK, zlib.crc32(head))


def check_end(sock: socket.socket, crc: int) -> None:
    """Read a frame's end marker; ConnectionError unless it is there with the checksum of the frame's head."""
    end = recv_exact(sock, END.size)
    if end is None:
        raise ConnectionError("frame cut off before its end marker")
    mark, got = END.unpack(end)
    if mark != END_MARK or got != crc:
        raise ConnectionError("a frame's end marker does not match: the stream is out of step")


def payload_bytes(arrays: Sequence[np.ndarray], dtype: int, raw: Sequence[np.ndarray] = ()) -> int:
    """The payload length of these float32 arrays in a wire dtype, and of the raw arrays after them."""
    return sum(len(a) for a in arrays) * itemsize(dtype) + sum(int(r.nbytes) for r in raw)


def _bytes_of(array: np.ndarray) -> memoryview:
    return np.ascontiguousarray(array).data.cast("B")


def send_frame(
    sock: socket.socket,
    head: bytes,
    arrays: Sequence[np.ndarray] = (),
    dtype: int = FLOAT32,
    raw: Sequence[np.ndarray] = (),
) -> None:
    """Send a frame: its header and message (`head`), then `arrays` as its payload in `dtype` and the `raw` arrays
    as they are, then its end. A payload of at most 1 MiB goes out in the same system call as the head
    (scatter-gather, no copy), so the peer wakes once per frame, not twice; a larger one follows it
    (`send_arrays`)."""
    end = end_of(head)
    rows = [_bytes_of(r) for r in raw if r.nbytes]
    if payload_bytes(arrays, dtype, raw) > CHUNK_BYTES:
        sock.sendall(head)
        send_arrays(sock, arrays, dtype)
        # The raw arrays (a model's rows: one or two per table) in as few system calls as the system allows.
        _send_parts(sock, [*rows, memoryview(end)])
        return
    parts = [memoryview(head), *(data for _, _, data in iter_chunks(arrays, dtype, CHUNK_BYTES)), *rows]
    _send_parts(sock, [*parts, memoryview(end)])


def send_frame_as_ready(sock: socket.socket, head: bytes, arrays: Iterator[np.ndarray], dtype: int, size: int) -> None:
    """Send a frame whose payload is `arrays` in `dtype` (`size` bytes in all, which `head` announces), each array
    as `arrays` yields it: the head once the first is there, each array as soon as the one before is sent (a push
    that sends each layer's gradient as backward makes it). A payload of another size is a bug: AssertionError,
    the frame cut off."""
    first = next(arrays, None)
    sock.sendall(head)
    sent = 0
    if first is not None:
        for array in itertools.chain([first], arrays):
            send_arrays(sock, [array], dtype)
            sent += len(array) * itemsize(dtype)
    assert sent == size, f"a payload of {sent} bytes where its head announced {size}"
    sock.sendall(end_of(head))


def _send_parts(sock: socket.socket, parts: list[bytes | memoryview]) -> None:
    """Send the buffers in order, scatter-gather (no copy), _MAX_PARTS a system call."""
    if isinstance(sock, ssl.SSLSocket):  # no sendmsg over TLS: one record stream, one copy
        sock.sendall(b"".join(parts))
        return
    first = 0
    while first < len(parts):
        sent = sock.sendmsg(parts[first : first + _MAX_PARTS])
        while first < len(parts) and sent >= len(parts[first]):
            sent -= len(parts[first])
            first += 1
        if sent:
            parts[first] = parts[first][sent:]


def send_arrays(sock: socket.socket, arrays: Sequence[np.ndarray], dtype: int) -> None:
    """Send float32 arrays as a payload in `dtype`: float32 as views of the arrays themselves, half types encoded
    a chunk at a time."""
    chunk = _SEND_CHUNK if dtype == FLOAT32 else CHUNK_BYTES
    for _, _, data in iter_chunks(arrays, dtype, chunk, reuse=True):
        sock.sendall(data)


def recv_raw(sock: socket.socket, targets: Sequence[np.ndarray]) -> None:
    """Receive the raw part of a payload straight into the (C-contiguous) target arrays' memory, in order: many
    targets a system call (scatter-gather), as a model of many tables has two or three per table."""
    views = [t.data.cast("B") for t in targets if t.nbytes]
    if isinstance(sock, ssl.SSLSocket):  # no recvmsg_into over TLS
        for v in views:
            if not recv_into(sock, v):
                raise ConnectionError("payload cut off")
        return
    first = 0
    while first < len(views):
        got = sock.recvmsg_into(views[first : first + _MAX_PARTS])[0]
        if got == 0:
            raise ConnectionError("payload cut off")
        while first < len(views) and got >= len(views[first]):
            got -= len(views[first])
            first += 1
        if got:
            views[first] = views[first][got:]


def recv_arrays(
    sock: socket.socket, targets: Sequence[np.ndarray], dtype: int, progress: Callable[[int], object] | None = None
) -> None:
    """Receive a payload in `dtype` into float32 targets, in order: float32 straight into their memory, half types
    through a 1 MiB buffer. `progress(n)`: told as the first n bytes of the targets (back to back, float32) are
    written, every CHUNK_BYTES or so."""
    done = 0
    if dtype == FLOAT32:
        for t in targets:
            view = t.data.cast("B")
            step = max(1, len(view)) if progress is None else 4 * CHUNK_BYTES  # an empty target takes nothing
            for off in range(0, len(view), step):
                if not recv_into(sock, view[off : off + step]):
                    raise ConnectionError("payload cut off")
                done += min(step, len(view) - off)
                if progress is not None:
                    progress(done)
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
            done += 4 * n
            if progress is not None:
                progress(done)


def _discard(sock: socket.socket, n: int) -> None:
    buf = memoryview(bytearray(min(n, CHUNK_BYTES) or 1))
    while n > 0:
        k = min(n, len(buf))
        if not recv_into(sock, buf[:k]):
            raise ConnectionError("payload cut off")
        n -= k


class Payload:
    """The bytes that follow a request frame, read by the handler into its own arrays (once, whole), and the
    frame's end marker after them. `crc`: the checksum of the frame's header and message. `on_end` is called once
    the end has been read and checked."""

    def __init__(self, sock: socket.socket, size: int, crc: int) -> None:
        self._sock = sock
        self.size = size
        self._crc = crc
        self._read = False
        self.on_end: Callable[[], object] | None = None
        # (seconds, bytes): `wait_arrival` waits up to that long for a payload up to that size; (0, 0): never.
        self.arrival: tuple[float, int] = (0.0, 0)

    def _ended(self) -> None:
        check_end(self._sock, self._crc)
        if self.on_end is not None:
            self.on_end()

    def wait_arrival(self) -> None:
        """Wait until a payload of at most `arrival[1]` bytes is all in this host's socket buffer, so that whoever
        receives it next holds nothing (a scratch buffer) while a slow or stalled peer sends it; ConnectionError
        after `arrival[0]` seconds. A larger payload cannot sit in the buffer whole: it is not waited for."""
        limit, up_to = self.arrival
        if self.size + END.size > up_to or self._read:
            return
        deadline = time.monotonic() + limit
        waiting = bytearray(4)
        hangup: select.poll | None = None  # made only when the payload is not in yet: the usual case has it all
        nap = 0.0005
        while True:
            fcntl.ioctl(self._sock.fileno(), termios.FIONREAD, waiting)
            pending = self._sock.pending() if isinstance(self._sock, ssl.SSLSocket) else 0
            if int.from_bytes(waiting, sys.byteorder) + pending >= self.size + END.size:
                return
            if hangup is None:
                hangup = select.poll()  # tells, without waiting, whether the peer has stopped sending
                hangup.register(self._sock, select.POLLRDHUP)
            if hangup.poll(0):
                raise ConnectionError(f"the peer stopped sending in a payload of {self.size} bytes")
            left = deadline - time.monotonic()
            if left <= 0:
                raise ConnectionError(f"a payload of {self.size} bytes did not arrive within {limit:.0f} s")
            # Not woken by data (a trickle would wake it at every byte): a payload that comes at once is in
            # within the first naps; one that trickles is looked at every 50 ms.
            time.sleep(min(nap, left))
            nap = min(2 * nap, 0.05)

    def read_into(
        self,
        targets: Sequence[np.ndarray],
        dtype: int,
        raw: Sequence[np.ndarray] = (),
        progress: Callable[[int], object] | None = None,
    ) -> None:
        """Receive the payload into float32 targets (then into the `raw` arrays, as they are) and check the frame's
        end; MalformedStream (nothing read) unless the payload is their size, ConnectionError if the end does not
        match (the stream is out of step: the targets then hold bytes that must not be used). `progress`: see
        `recv_arrays`."""
        expected = payload_bytes(targets, dtype, raw)
        if self.size != expected:
            raise MalformedStream(
                f"a payload of {self.size} bytes where this exchange takes {expected} (this shard's pieces back to "
                f"back in the request's dtype, then the rows and IDs the message names)"
            )
        if self._read:  # an empty payload, whose end was checked already (`finish`)
            return
        self._read = True
        recv_arrays(self._sock, targets, dtype, progress)
        recv_raw(self._sock, raw)
        self._ended()

    def finish(self) -> None:
        """Read and drop whatever the handler did not take, and the frame's end, so the next frame starts in
        step (ConnectionError if it does not)."""
        if not self._read:
            self._read = True
            if self.size:
                _discard(self._sock, self.size)
            self._ended()


@dataclass
class Reply:
    """What a handler answers: the message, and the float32 arrays to send after it as the payload."""

    message: ps_pb2.ExchangeResponse
    arrays: Sequence[np.ndarray] = field(default_factory=list)
    dtype: int = FLOAT32
    raw: Sequence[np.ndarray] = field(default_factory=list)  # sent as they are after `arrays`: looked-up rows
    release: Callable[[], object] | None = None  # called once the arrays are sent (or the send failed)


# What a shard does with the frames: check a hello, given what closes its connection (when the worker's
# attachment ends); answer an Exchange (raising PSError to refuse it).
Verify = Callable[[ps_pb2.AttachRequest, Callable[[], None]], None]
Handle = Callable[[ps_pb2.ExchangeRequest, float, Payload], Reply]


def error_body(status: Status) -> bytes:
    """A refused request's reply body: u8 status code, u8 length + the error type's name, the UTF-8 message."""
    name = status.name.encode()[:255]
    return bytes([status.code.value[0], len(name)]) + name + status.details.encode()


def send_reply(
    sock: socket.socket,
    body: bytes,
    arrays: Sequence[np.ndarray] = (),
    dtype: int = FLOAT32,
    raw: Sequence[np.ndarray] = (),
) -> None:
    send_frame(sock, REPLY.pack(len(body), payload_bytes(arrays, dtype, raw)) + body, arrays, dtype, raw)


# The frames' messages, decoded and checked against the bounds of ps.proto as the gRPC requests are.
HELLO = bounds.decoder(ps_pb2.AttachRequest, "Attach (socket hello)")
EXCHANGE = bounds.decoder(ps_pb2.ExchangeRequest, "Exchange (socket)")


def read_request(
    conn: socket.socket, limit: int = MAX_FRAME, on_head: Callable[[int], object] | None = None
) -> tuple[float, bytes, Payload] | None:
    """(timeout, message bytes, the payload to follow) of the next request frame, or None at a clean end of
    stream; `on_head(payload length)` is called once its header is in (the frame has begun). A message over
    `limit` bytes ends the connection (ConnectionError). The frame's end is read and checked by the payload
    (`Payload.read_into` or `finish`): call `finish` before acting on a frame that has no payload."""
    head = recv_exact(conn, REQUEST.size)
    if head is None:
        return None
    length, timeout, size = REQUEST.unpack(head)
    if on_head is not None:
        on_head(size)
    if length > limit:
        raise ConnectionError(f"frame of {length} bytes is over the limit of {limit}")
    body = recv_exact(conn, length)
    if body is None:
        raise ConnectionError("frame cut off")
    return timeout, body, Payload(conn, size, zlib.crc32(body, zlib.crc32(head)))


def decode_message(decode: Callable[[bytes], Any], body: bytes) -> Any:
    """A frame's message; OutOfBounds (to answer) for a field past its bound. A frame that is no such message
    ends the connection."""
    try:
        return decode(body)
    except Undecodable as exc:
        raise ConnectionError(str(exc)) from None
