"""A worker's connection to one shard's doorbell (a Unix socket name) or data socket ((host, port)).

See paramserver.transport.socket_server for the shard's side and paramserver.wire.frames for the frames.
"""

from __future__ import annotations

import fcntl
import ipaddress
import socket
import ssl
import sys
import termios
import time
import zlib
from collections.abc import Callable, Iterator, Sequence

import grpc
import numpy as np

from paramserver.errors import MalformedStream, from_status
from paramserver.transport.tcp import keep_alive, unix_buffers
from paramserver.v1 import ps_pb2
from paramserver.wire.chunks import FLOAT32
from paramserver.wire.frames import (
    CODES,
    END,
    END_MARK,
    MAX_FRAME,
    REPLY,
    REQUEST,
    check_end,
    payload_bytes,
    recv_arrays,
    recv_exact,
    recv_raw,
    send_frame,
    send_frame_as_ready,
)

DRAIN_POLL_S = 0.0005  # how often `drain` asks the kernel: a fraction of a 1 MB part's time on a 10 Gbit/s link


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


def is_loopback(host: str) -> bool:
    """Whether an IP address (v4, v6, v4-mapped v6, with or without a zone) is this host's loopback."""
    address = ipaddress.ip_address(host.partition("%")[0])  # an IPv6 peer may carry a zone
    if isinstance(address, ipaddress.IPv6Address) and address.ipv4_mapped is not None:
        return address.ipv4_mapped.is_loopback
    return address.is_loopback


def split_host(address: str) -> str:
    """The host of "host:port" or "[v6]:port"."""
    host = address.rpartition(":")[0] or address
    return host[1:-1] if host.startswith("[") and host.endswith("]") else host


class FrameClient:
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
        fast_keepalive: bool = False,
    ) -> None:
        self.shard = shard
        if isinstance(address, str):
            self._sock = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
            unix_buffers(self._sock)
            connect: Callable[[], None] = lambda: self._sock.connect(address)  # noqa: E731
        else:
            self._sock = socket.socket(socket.getaddrinfo(*address, type=socket.SOCK_STREAM)[0][0], socket.SOCK_STREAM)
            self._sock.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
            keep_alive(self._sock, fast_keepalive)  # fast: a copy of a replicated shard (see tcp.FAST_KEEPALIVE)
            connect = lambda: self._sock.connect(address)  # noqa: E731
        try:
            self._sock.settimeout(timeout)
            connect()
            # A peer on this host's loopback (or a Unix socket) is reached through memory copies, not a link.
            self.loopback = self._sock.family == socket.AF_UNIX or is_loopback(self._sock.getpeername()[0])
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
        raw: Sequence[np.ndarray] = (),
    ) -> None:
        """Ring: send one request, with `arrays` as its payload in `dtype` and then the `raw` arrays as they are
        (sparse rows and IDs); `receive` its answer before sending another."""
        self._sock.settimeout(timeout + 5.0)  # the shard gives up at `timeout`; the socket a little later
        body = request.SerializeToString()
        size = payload_bytes(arrays, dtype, raw)
        send_frame(self._sock, REQUEST.pack(len(body), timeout, size) + body, arrays, dtype, raw)

    def send_as_ready(
        self, request: ps_pb2.ExchangeRequest, timeout: float, arrays: Iterator[np.ndarray], size: int, dtype: int
    ) -> None:
        """`send` with the payload's float32 arrays (`size` bytes in `dtype`) taken from `arrays` as it yields them
        (it may wait for each): see paramserver.wire.frames.send_frame_as_ready."""
        self._sock.settimeout(timeout + 5.0)
        body = request.SerializeToString()
        send_frame_as_ready(self._sock, REQUEST.pack(len(body), timeout, size) + body, arrays, dtype, size)

    def drain(self, below: int, limit: float) -> None:
        """Wait until fewer than `below` bytes sent are still unacknowledged by the shard (see `drain`)."""
        drain(self._sock, below, limit)

    def receive(
        self, targets: Sequence[np.ndarray] = (), dtype: int = FLOAT32, raw: Sequence[np.ndarray] = ()
    ) -> ps_pb2.ExchangeResponse:
        """The answer to the last `send` (its payload written into `targets`, then into the `raw` arrays as it
        is), or the PSError the shard refused it with. A payload of another size than the targets' raises
        MalformedStream and ends the connection."""
        head = recv_exact(self._sock, REPLY.size)
        if head is None:
            raise ConnectionError(f"shard {self.shard} closed the connection")
        length, size = REPLY.unpack(head)
        if length > MAX_FRAME:
            raise ConnectionError(f"reply frame of {length} bytes from shard {self.shard}")
        # With no payload the end follows the body at once (one system call sent both): read them together.
        whole = recv_exact(self._sock, length + (0 if size else END.size))
        if not whole or len(whole) < (0 if size else END.size) + 1:
            raise ConnectionError(f"shard {self.shard} cut a reply off")
        body = whole[:length]
        crc = zlib.crc32(body, zlib.crc32(head))
        if not size and whole[length:] != END.pack(END_MARK, crc):
            raise ConnectionError(f"a reply's end marker from shard {self.shard} does not match: out of step")
        if body[0] != 0:
            if size:
                raise ConnectionError(f"shard {self.shard} sent a payload with an error")
            code = CODES.get(body[0], grpc.StatusCode.UNKNOWN)
            n = body[1] if len(body) > 1 else 0
            name = body[2 : 2 + n].decode(errors="replace")
            raise from_status(code, body[2 + n :].decode(errors="replace"), name, self.shard)
        reply = ps_pb2.ExchangeResponse.FromString(body[1:])
        expected = payload_bytes(targets, dtype, raw)
        if size != expected:
            self.close()
            raise MalformedStream(f"shard {self.shard} sent {size} payload bytes for {expected} expected")
        recv_arrays(self._sock, targets, dtype)
        recv_raw(self._sock, raw)
        if size:
            check_end(self._sock, crc)  # ConnectionError: out of step (the targets then hold bytes not to be used)
        return reply

    @property
    def peer(self) -> str | tuple[str, int]:
        """The shard's end of the connection: a Unix socket name, or (host, port)."""
        peer = self._sock.getpeername()
        return peer if isinstance(peer, str) else (peer[0], peer[1])

    @property
    def tls(self) -> bool:
        """Whether the connection is encrypted."""
        return isinstance(self._sock, ssl.SSLSocket)

    def fileno(self) -> int:
        """The connection's file descriptor (-1 once closed)."""
        return self._sock.fileno()

    def close(self) -> None:
        self._sock.close()
