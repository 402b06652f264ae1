"""Lookups over a plain TCP socket beside ps-serve's gRPC port (SPEC.md section 17): the Serving service's
LookupRequest and LookupReply, each framed by its length, for the request rates at which gRPC's Python server
spends more time per call than the lookup itself (measured: about 270 us of CPU per unary call against about 200
for a 26-ID lookup).

A request frame is a u32 little-endian length and that many bytes of LookupRequest. Each is answered in order on
its connection (a client may send the next before the answer: a pipeline): a u32 length, then a u8 kind, 0 and the
LookupReply's bytes, or 1 and an error body (paramserver.wire.frames.error_body: the gRPC status code, the error
type's name and the message). A frame past MAX_MESSAGE_BYTES, or one that stalls past FRAME_TIMEOUT_S once begun,
ends its connection; an undecodable request is refused (INVALID_ARGUMENT) and the connection goes on. At most
MAX_CONNECTIONS at once, each on a thread of its own; the reads hold the copies' locks as the gRPC Lookup does.
"""

from __future__ import annotations

import logging
import socket
import struct
import threading
from collections.abc import Callable

from paramserver.errors import TooLarge, status_of
from paramserver.transport.socket_server import tcp_listener
from paramserver.v1 import ps_pb2
from paramserver.wire import bounds
from paramserver.wire.frames import error_body, recv_exact

log = logging.getLogger(__name__)

LENGTH = struct.Struct("<I")
OK, ERROR = 0, 1
MAX_CONNECTIONS = 64
FRAME_TIMEOUT_S = 10.0  # a begun frame's bytes must all arrive within this; between frames a connection may idle


class LookupSocket:
    """The lookup socket of one serving process: `answer(request)` gives each LookupRequest's LookupReply."""

    def __init__(
        self, answer: Callable[[ps_pb2.LookupRequest], ps_pb2.LookupReply], host: str, port: int, limit: int
    ) -> None:
        self._answer = answer
        self._limit = limit
        self._decode = bounds.decoder(ps_pb2.LookupRequest, "Lookup (socket)")
        self._listener = tcp_listener(host, port)
        self._listener.listen(MAX_CONNECTIONS)
        self.port: int = self._listener.getsockname()[1]
        self._open: set[socket.socket] = set()
        self._lock = threading.Lock()
        self._closed = False
        threading.Thread(target=self._accept, name="lookup-socket", daemon=True).start()

    def _accept(self) -> None:
        while True:
            try:
                conn, _ = self._listener.accept()
            except OSError:
                return  # closed
            with self._lock:
                if self._closed or len(self._open) >= MAX_CONNECTIONS:
                    conn.close()
                    continue
                self._open.add(conn)
            conn.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
            threading.Thread(target=self._serve, args=(conn,), name="lookup-conn", daemon=True).start()

    def _serve(self, conn: socket.socket) -> None:
        try:
            while self._one(conn):
                pass
        except (OSError, ConnectionError) as exc:
            log.debug("lookup socket: a connection ended: %s", exc)
        finally:
            with self._lock:
                self._open.discard(conn)
            conn.close()

    def _one(self, conn: socket.socket) -> bool:
        """Answer the next frame; False at a clean end of the connection."""
        conn.settimeout(None)
        head = recv_exact(conn, LENGTH.size)
        if head is None:
            return False
        conn.settimeout(FRAME_TIMEOUT_S)
        (length,) = LENGTH.unpack(head)
        if length > self._limit:
            big = TooLarge(f"Lookup: a request of {length} bytes is over the limit of {self._limit}")
            self._send(conn, ERROR, error_body(status_of(big, "Lookup (socket)")))
            return False  # its bytes are not read: the stream cannot go on
        body = recv_exact(conn, length)
        if body is None:
            raise ConnectionError("frame cut off")
        try:
            reply = self._answer(self._decode(body)).SerializeToString()
        except Exception as exc:  # noqa: BLE001 - every failure is answered, as the gRPC Lookup's is
            self._send(conn, ERROR, error_body(status_of(exc, "Lookup (socket)")))
            return True
        self._send(conn, OK, reply)
        return True

    @staticmethod
    def _send(conn: socket.socket, kind: int, body: bytes) -> None:
        conn.sendall(LENGTH.pack(len(body) + 1) + bytes([kind]) + body)

    def close(self) -> None:
        """Stop taking connections and end the open ones."""
        with self._lock:
            self._closed = True
            conns = list(self._open)
        self._listener.close()
        for conn in conns:
            try:
                conn.shutdown(socket.SHUT_RDWR)
            except OSError:
                pass
