"""The shard's side of the doorbell (same host, a Unix socket) and the data socket (any host, TCP, optionally TLS).

A worker first Attaches over its (authenticated) gRPC channel, offering a shared-memory segment or a random nonce
(the ticket), and the shard answers where to connect. The connection then proves itself with its first frame:
that same AttachRequest, whose nonce only travelled over gRPC. After that it speaks for that worker only. The
frames are paramserver.wire.frames.
"""

from __future__ import annotations

import logging
import socket
import ssl
import threading
import uuid
from collections.abc import Callable

from paramserver.errors import PermissionDenied, PSError, Status, TooLarge, status_of
from paramserver.wire.frames import (
    EXCHANGE,
    HELLO,
    Handle,
    Payload,
    Reply,
    Verify,
    decode_message,
    error_body,
    read_request,
    send_reply,
)

log = logging.getLogger(__name__)

HANDSHAKE_TIMEOUT = 10.0


class FrameServer:
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
            frame = read_request(conn)
            if frame is None:
                return
            if frame[2]:
                raise ConnectionError("a hello carries no payload")
            try:
                hello = decode_message(HELLO, frame[1])
                self._verify(hello)
            except PSError as exc:
                self._rejected("Attach (socket hello)", exc)
                send_reply(conn, error_body(exc))
                return
            send_reply(conn, b"\0")
            conn.settimeout(None)  # a proven worker may wait as long as a pull may
            worker_id = hello.worker_id
            while (frame := read_request(conn)) is not None:
                timeout, message, size = frame
                limit = self._payload_limit()
                if size > limit:
                    big = TooLarge(f"a payload of {size} bytes is over this shard's {limit} (its part of the model)")
                    self._rejected("Exchange (socket)", big)
                    send_reply(conn, error_body(big))
                    return  # the rest of the stream cannot be trusted to be in step
                payload = Payload(conn, size)
                body, reply = self._answer(worker_id, message, timeout, payload)
                try:
                    payload.finish()
                    if reply is None:
                        send_reply(conn, body)
                    else:
                        send_reply(conn, body, reply.arrays, reply.dtype)
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
        what = "Exchange (socket)"
        try:
            request = decode_message(EXCHANGE, body)
            if request.worker_id != worker_id:
                raise PermissionDenied(f"this connection speaks for worker {worker_id!r} only")
            reply = self._handle(request, timeout, payload)  # the handler clamps timeout to the pull_timeout
            return b"\0" + reply.message.SerializeToString(), reply
        except PermissionDenied as exc:
            # The connection, not its request, is at fault: no refused request to count, and (as the data-socket
            # tests pin) a status without a type name.
            return _error_body(status_of(exc, what)._replace(name="")), None
        except PSError as exc:
            self._rejected(what, exc)
            return error_body(exc), None
        except (OSError, ConnectionError):
            raise  # the connection itself failed (e.g. mid-payload): nothing to answer on
        except Exception as exc:  # noqa: BLE001 - the boundary, as in errors.rpc_errors
            log.exception("%s failed", what)
            return _error_body(status_of(exc, what)), None

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


def _error_body(status: Status) -> bytes:
    """A reply body for a status that names no PSError type (frames.error_body's layout: u8 status, u8 length +
    type name, message)."""
    name = status.name.encode()[:255]
    return bytes([status.code.value[0], len(name)]) + name + status.details.encode()


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
