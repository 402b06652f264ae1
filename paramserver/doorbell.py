"""Exchange frames over a plain socket: the doorbell (same host) and the data socket (any host).

gRPC Python handles every message in Python through a thread hand-off on each side, and copies each chunk into a
new `bytes` both ways: on a 2-core machine that is about 1 GB/s per direction and 0.5-1 ms per call. The same
ExchangeRequest sent as a length-prefixed frame over a socket avoids both:

- **Doorbell** (a Unix socket, abstract name): for a worker with a shared-memory segment attached. The tensors stay
  in the segment; a frame only says what to do. A digits-model step took 0.5 ms this way against 1.6-2.2 ms for the
  same Exchange as gRPC calls (2 shards, 2 cores).
- **Data socket** (TCP, optionally TLS): for a worker on another host. The gradient follows the request as raw
  bytes and the weights follow the reply; each side receives them with `recv_into` straight into its float32
  arrays (the worker's model tensors, the shard's scratch buffer), so no chunk object is ever built.

gRPC stays the control plane: a worker first Attaches over its (authenticated) gRPC channel, offering a segment or
a random nonce (the ticket), and the shard answers where to connect. The connection then proves itself with its
first frame: that same AttachRequest, whose nonce only travelled over gRPC. After that it speaks for that worker
only. Frames, little-endian:

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

import fcntl
import ipaddress
import logging
import socket
import ssl
import struct
import sys
import termios
import threading
import time
import uuid
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from typing import Any

import grpc
import numpy as np

from paramserver import bounds
from paramserver.errors import MalformedStream, PSError, TooLarge, Undecodable, from_status
from paramserver.v1 import ps_pb2
from paramserver.wire import CHUNK_BYTES, FLOAT32, decode_into, itemsize, iter_chunks

log = logging.getLogger(__name__)

_REQUEST = struct.Struct("<IdQ")
_REPLY = struct.Struct("<IQ")
MAX_FRAME = 1 << 20  # control messages only: tensor bytes travel as payloads (or through the segment)
_SEND_CHUNK = 8 << 20  # float32 payloads go out as views of this many bytes (the GIL is released meanwhile)
_CODES = {c.value[0]: c for c in grpc.StatusCode}
HANDSHAKE_TIMEOUT = 10.0
_MAX_PARTS = 512  # buffers per sendmsg(), well under the system's IOV_MAX (1024 on Linux)
DRAIN_POLL_S = 0.0005  # how often `drain` asks the kernel: a fraction of a 1 MB part's time on a 10 Gbit/s link


def _recv_into(sock: socket.socket, view: memoryview) -> bool:
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


def _recv_exact(sock: socket.socket, n: int) -> bytes | None:
    buf = bytearray(n)
    return bytes(buf) if _recv_into(sock, memoryview(buf)) else None  # n == 0: an empty read succeeds


def drain(sock: socket.socket, below: int, limit: float) -> bool:
    """Wait until fewer than `below` bytes sent on a TCP socket are still unacknowledged by the peer; False if that
    took over `limit` seconds (or the system cannot tell: no wait then). `sendall` returns once the kernel holds the
    bytes, which for a payload up to the socket's buffer (a few MB) is before most of them have crossed the link."""
    deadline = time.monotonic() + limit
    queued = bytearray(4)
    while True:
        try:
            fcntl.ioctl(sock.fileno(), termios.TIOCOUTQ, queued)
        except OSError:
            return False
        if int.from_bytes(queued, sys.byteorder) < below:
            return True
        if time.monotonic() >= deadline:
            return False
        time.sleep(DRAIN_POLL_S)


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
            if len(t) and not _recv_into(sock, t.data.cast("B")):
                raise ConnectionError("payload cut off")
        return
    size = itemsize(dtype)
    buf = memoryview(bytearray(CHUNK_BYTES))
    step = CHUNK_BYTES // size
    for t in targets:
        for off in range(0, len(t), step):
            n = min(step, len(t) - off)
            if not _recv_into(sock, buf[: n * size]):
                raise ConnectionError("payload cut off")
            decode_into(t[off : off + n], buf[: n * size], dtype)


def _discard(sock: socket.socket, n: int) -> None:
    buf = memoryview(bytearray(min(n, CHUNK_BYTES) or 1))
    while n > 0:
        k = min(n, len(buf))
        if not _recv_into(sock, buf[:k]):
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


def _error_body(exc: PSError) -> bytes:
    name = type(exc).__name__.encode()[:255]
    return bytes([exc.code.value[0], len(name)]) + name + str(exc).encode()


def _send_reply(sock: socket.socket, body: bytes, arrays: Sequence[np.ndarray] = (), dtype: int = FLOAT32) -> None:
    send_frame(sock, _REPLY.pack(len(body), payload_bytes(arrays, dtype)) + body, arrays, dtype)


# The frames' messages, decoded and checked against the bounds of ps.proto as the gRPC requests are.
_HELLO = bounds.decoder(ps_pb2.AttachRequest, "Attach (socket hello)")
_EXCHANGE = bounds.decoder(ps_pb2.ExchangeRequest, "Exchange (socket)")


def _read_request(conn: socket.socket) -> tuple[float, bytes, int] | None:
    """(timeout, message bytes, payload length) of the next request frame, or None at a clean end of stream."""
    head = _recv_exact(conn, _REQUEST.size)
    if head is None:
        return None
    length, timeout, payload = _REQUEST.unpack(head)
    if length > MAX_FRAME:
        raise ConnectionError(f"frame of {length} bytes is over the limit of {MAX_FRAME}")
    body = _recv_exact(conn, length)
    if body is None:
        raise ConnectionError("frame cut off")
    return timeout, body, payload


def _decode(decode: Callable[[bytes], Any], body: bytes) -> Any:
    """A frame's message; OutOfBounds (to answer) for a field past its bound. A frame that is no such message
    ends the connection."""
    try:
        return decode(body)
    except Undecodable as exc:
        raise ConnectionError(str(exc)) from None


class DoorbellServer:
    """Serve Exchange frames on a listening socket, one thread per connected worker.

    With no `listener`, an abstract Unix socket of its own (no file to clean up): the doorbell. Otherwise the
    bound TCP socket given (the data socket), each connection wrapped in TLS when `tls` is set. `payload_limit`
    says how many payload bytes a request may carry: a frame announcing more ends its connection.
    """

    def __init__(
        self,
        verify: Verify,
        handle: Handle,
        on_reject: Callable[[PSError], None] | None = None,
        name: str = "",
        listener: socket.socket | None = None,
        tls: ssl.SSLContext | None = None,
        payload_limit: Callable[[], int] = lambda: 0,
    ) -> None:
        self._verify = verify
        self._handle = handle
        self._on_reject = on_reject
        self._tls = tls
        self._payload_limit = payload_limit
        if listener is None:
            self.address: str | tuple[str, int] = "\0paramserver-" + (name or uuid.uuid4().hex)
            listener = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
            listener.bind(self.address)
        else:
            self.address = listener.getsockname()[:2]
        self._tcp = listener.family != socket.AF_UNIX
        self._listener = listener
        self._listener.listen(64)
        self._conns: dict[socket.socket, threading.Thread] = {}
        self._lock = threading.Lock()
        self._closed = False
        self._thread = threading.Thread(target=self._accept, name="doorbell-accept", daemon=True)
        self._thread.start()

    @property
    def port(self) -> int:
        """The TCP port (a data socket), or 0 (a doorbell)."""
        return int(self.address[1]) if self._tcp else 0

    def _accept(self) -> None:
        while True:
            try:
                conn, _ = self._listener.accept()
            except OSError:
                return  # closed
            with self._lock:
                if self._closed:
                    conn.close()
                    return
                thread = threading.Thread(target=self._serve, args=(conn,), name="doorbell", daemon=True)
                self._conns[conn] = thread
            thread.start()

    def _serve(self, raw: socket.socket) -> None:
        conn = raw
        try:
            if self._tcp:
                raw.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
            # A peer that does not prove itself within HANDSHAKE_TIMEOUT (TLS handshake and hello) holds no thread.
            raw.settimeout(HANDSHAKE_TIMEOUT)
            if self._tls is not None:
                conn = self._tls.wrap_socket(raw, server_side=True)  # takes over raw's descriptor
                with self._lock:
                    self._conns[conn] = self._conns.pop(raw)  # so that close() shuts the live socket down
            frame = _read_request(conn)
            if frame is None:
                return
            if frame[2]:
                raise ConnectionError("a hello carries no payload")
            try:
                hello = _decode(_HELLO, frame[1])
                self._verify(hello)
            except PSError as exc:
                self._rejected("Attach (socket hello)", exc)
                _send_reply(conn, _error_body(exc))
                return
            _send_reply(conn, b"\0")
            conn.settimeout(None)  # a proven worker may wait as long as a pull may
            worker_id = hello.worker_id
            while (frame := _read_request(conn)) is not None:
                timeout, message, size = frame
                limit = self._payload_limit()
                if size > limit:
                    big = TooLarge(f"a payload of {size} bytes is over this shard's {limit} (its part of the model)")
                    self._rejected("Exchange (socket)", big)
                    _send_reply(conn, _error_body(big))
                    return  # the rest of the stream cannot be trusted to be in step
                payload = Payload(conn, size)
                body, reply = self._answer(worker_id, message, timeout, payload)
                try:
                    payload.finish()
                    if reply is None:
                        _send_reply(conn, body)
                    else:
                        _send_reply(conn, body, reply.arrays, reply.dtype)
                finally:
                    if reply is not None and reply.release is not None:
                        reply.release()
        except (OSError, ConnectionError, ssl.SSLError) as exc:
            log.debug("doorbell connection ended: %s", exc)
        finally:
            with self._lock:
                self._conns.pop(conn, None)
                self._conns.pop(raw, None)
            conn.close()

    def _rejected(self, what: str, exc: PSError) -> None:
        log.info("%s rejected: %s: %s", what, exc.code.name, exc)
        if self._on_reject is not None:
            self._on_reject(exc)

    def _answer(self, worker_id: str, body: bytes, timeout: float, payload: Payload) -> tuple[bytes, Reply | None]:
        try:
            request = _decode(_EXCHANGE, body)
            if request.worker_id != worker_id:
                raise PermissionError(f"this connection speaks for worker {worker_id!r} only")
            reply = self._handle(request, timeout, payload)  # the handler clamps timeout to the pull_timeout
            return b"\0" + reply.message.SerializeToString(), reply
        except PSError as exc:
            self._rejected("Exchange (socket)", exc)
            return _error_body(exc), None
        except PermissionError as exc:
            return bytes([grpc.StatusCode.PERMISSION_DENIED.value[0], 0]) + str(exc).encode(), None
        except (OSError, ConnectionError):
            raise  # the connection itself failed (e.g. mid-payload): nothing to answer on
        except Exception as exc:  # noqa: BLE001 - the boundary, as in errors.rpc_errors
            log.exception("Exchange (socket) failed")
            internal = bytes([grpc.StatusCode.INTERNAL.value[0], 0])
            return internal + f"Exchange failed on the server: {exc}".encode(), None

    def close(self, grace: float = 5.0) -> None:
        """Stop accepting, end every connection (their workers re-attach or fall back to gRPC), and wait up to
        `grace` seconds for the Exchanges in flight to finish."""
        with self._lock:
            self._closed = True
            conns = dict(self._conns)
        try:
            self._listener.shutdown(socket.SHUT_RDWR)  # wakes the accept thread (close alone does not on Linux)
        except OSError:
            pass
        self._listener.close()
        self._thread.join(timeout=5)
        for conn in conns:
            try:
                conn.shutdown(socket.SHUT_RD)  # the answer in flight may still be sent
            except OSError:
                pass
        for thread in conns.values():
            thread.join(timeout=grace)


def tcp_listener(host: str, port: int) -> socket.socket:
    """A bound TCP socket for a data socket (IPv4 or IPv6, as `host` says, with or without the brackets gRPC
    wants; port 0: the OS picks)."""
    if host.startswith("[") and host.endswith("]"):
        host = host[1:-1]
    info = socket.getaddrinfo(host or None, port, type=socket.SOCK_STREAM, flags=socket.AI_PASSIVE)[0]
    sock = socket.socket(info[0], socket.SOCK_STREAM)
    try:
        # A restarted shard must bind its fixed port again while the old connections sit in TIME_WAIT (on Linux
        # this never lets two live listeners share a port).
        sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        sock.bind(info[4])
    except BaseException:
        sock.close()
        raise
    return sock


def _is_loopback(host: str) -> bool:
    address = ipaddress.ip_address(host.partition("%")[0])  # an IPv6 peer may carry a zone
    if isinstance(address, ipaddress.IPv6Address) and address.ipv4_mapped is not None:
        return address.ipv4_mapped.is_loopback
    return address.is_loopback


def split_host(address: str) -> str:
    """The host of "host:port" or "[v6]:port"."""
    host = address.rpartition(":")[0] or address
    return host[1:-1] if host.startswith("[") and host.endswith("]") else host


class DoorbellClient:
    """A worker's connection to one shard's doorbell (a Unix socket name) or data socket ((host, port)), proven
    with the AttachRequest it attached with."""

    def __init__(
        self,
        address: str | tuple[str, int],
        hello: ps_pb2.AttachRequest,
        shard: str,
        timeout: float = 10.0,
        tls: ssl.SSLContext | None = None,
        server_hostname: str | None = None,
    ) -> None:
        self.shard = shard
        if isinstance(address, str):
            self._sock = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
            connect: Callable[[], None] = lambda: self._sock.connect(address)  # noqa: E731
        else:
            self._sock = socket.socket(socket.getaddrinfo(*address, type=socket.SOCK_STREAM)[0][0], socket.SOCK_STREAM)
            self._sock.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
            connect = lambda: self._sock.connect(address)  # noqa: E731
        try:
            self._sock.settimeout(timeout)
            connect()
            # A peer on this host's loopback (or a Unix socket) is reached through memory copies, not a link.
            self.loopback = self._sock.family == socket.AF_UNIX or _is_loopback(self._sock.getpeername()[0])
            if tls is not None:
                self._sock = tls.wrap_socket(self._sock, server_hostname=server_hostname or address[0])
            self.send(hello, timeout)
            self.receive()
        except BaseException:
            self._sock.close()
            raise

    def send(
        self,
        request: ps_pb2.ExchangeRequest | ps_pb2.AttachRequest,
        timeout: float,
        arrays: Sequence[np.ndarray] = (),
        dtype: int = FLOAT32,
    ) -> None:
        """Ring: send one request, with `arrays` as its payload in `dtype`; `receive` its answer before sending
        another."""
        self._sock.settimeout(timeout + 5.0)  # the shard gives up at `timeout`; the socket a little later
        body = request.SerializeToString()
        send_frame(self._sock, _REQUEST.pack(len(body), timeout, payload_bytes(arrays, dtype)) + body, arrays, dtype)

    def drain(self, below: int, limit: float) -> None:
        """Wait until fewer than `below` bytes sent are still unacknowledged by the shard (see `drain`)."""
        drain(self._sock, below, limit)

    def receive(self, targets: Sequence[np.ndarray] = (), dtype: int = FLOAT32) -> ps_pb2.ExchangeResponse:
        """The answer to the last `send` (its payload written into `targets`), or the PSError the shard refused
        it with. A payload of another size than the targets' raises MalformedStream and ends the connection."""
        head = _recv_exact(self._sock, _REPLY.size)
        if head is None:
            raise ConnectionError(f"shard {self.shard} closed the connection")
        length, size = _REPLY.unpack(head)
        if length > MAX_FRAME:
            raise ConnectionError(f"reply frame of {length} bytes from shard {self.shard}")
        body = _recv_exact(self._sock, length)
        if not body:
            raise ConnectionError(f"shard {self.shard} cut a reply off")
        if body[0] != 0:
            if size:
                raise ConnectionError(f"shard {self.shard} sent a payload with an error")
            code = _CODES.get(body[0], grpc.StatusCode.UNKNOWN)
            n = body[1] if len(body) > 1 else 0
            name = body[2 : 2 + n].decode(errors="replace")
            raise from_status(code, body[2 + n :].decode(errors="replace"), name, self.shard)
        reply = ps_pb2.ExchangeResponse.FromString(body[1:])
        if size != payload_bytes(targets, dtype):
            self.close()
            raise MalformedStream(
                f"shard {self.shard} sent {size} payload bytes for {payload_bytes(targets, dtype)} expected"
            )
        recv_arrays(self._sock, targets, dtype)
        return reply

    def close(self) -> None:
        self._sock.close()
