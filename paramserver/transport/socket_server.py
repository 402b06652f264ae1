"""The shard's side of the doorbell (same host, a Unix socket) and the data socket (any host, TCP, optionally TLS).

A worker first Attaches over its (authenticated) gRPC channel, offering a shared-memory segment or a random nonce
(the ticket), and the shard answers where to connect. The connection then proves itself with its first frame:
that same AttachRequest, whose nonce only travelled over gRPC. After that it speaks for that worker only. The
frames are paramserver.wire.frames.
"""

from __future__ import annotations

import functools
import logging
import socket
import ssl
import threading
import time
import uuid
from collections.abc import Callable

from paramserver.errors import NotAttached, PermissionDenied, PSError, TooLarge, status_of
from paramserver.transport.tcp import keep_alive, unix_buffers
from paramserver.v1 import ps_pb2
from paramserver.wire.frames import (
    EXCHANGE,
    HELLO,
    MAX_HELLO,
    Handle,
    Payload,
    Reply,
    Verify,
    decode_message,
    error_body,
    payload_bytes,
    read_request,
    send_reply,
)

log = logging.getLogger(__name__)

# A connection has this long for all of its handshake (TLS and the hello), however its bytes trickle in.
HANDSHAKE_TIMEOUT = 10.0
# Once a frame has begun, it must arrive whole within FRAME_FLOOR_S plus its payload at MIN_BYTES_PER_S (a
# 100 MB push: 110 s), and a reply must be taken by the peer in as long: a peer that stalls mid-frame (a link gone
# without a FIN, or on purpose) loses its connection, and whatever the frame held (a scratch buffer, lent weights)
# is released. Between frames a connection may wait as long as it likes: it holds nothing then.
FRAME_FLOOR_S = 10.0
MIN_BYTES_PER_S = 1 << 20
# A payload up to this size (and the socket's receive buffer) is waited for until it is all in this host's socket
# buffer before a scratch buffer is taken for it, so a stalled small push holds no buffer at all.
WAIT_WHOLE_BYTES = 1 << 20
WATCH_S = 0.1  # how often the watchdog looks for connections past their deadline


def _shutdown(sock: socket.socket) -> None:
    """End a connection from any thread: its reader and writer fail at once."""
    try:
        sock.shutdown(socket.SHUT_RDWR)
    except OSError:
        pass


class FrameServer:
    """Serve Exchange frames on a listening socket, one thread per connected worker.

    With no `listener`, an abstract Unix socket of its own (no file to clean up): the doorbell, which takes hellos
    of shared-memory attachments. Otherwise the bound TCP socket given (the data socket), which takes data-socket
    tickets, each connection wrapped in TLS when `tls` is set. `payload_limit` says how many payload bytes a
    request may carry (given the decoded request, or None where it could not be decoded): a frame announcing more
    ends its connection. At most `max_pending` connections may be
    still proving themselves at once; more are closed at once and counted through `on_refused(reason)`, as are
    handshakes that run out of time.
    """

    def __init__(
        self,
        verify: Verify,
        handle: Handle,
        on_reject: Callable[[PSError], None] | None = None,
        name: str = "",
        listener: socket.socket | None = None,
        tls: ssl.SSLContext | None = None,
        payload_limit: Callable[[ps_pb2.ExchangeRequest | None], int] = lambda request: 0,
        max_pending: int = 64,
        on_refused: Callable[[str], None] | None = None,
    ) -> None:
        self._verify = verify
        self._handle = handle
        self._on_reject = on_reject
        self._on_refused = on_refused
        self._tls = tls
        self._payload_limit = payload_limit
        self._max_pending = max_pending
        if listener is None:
            self.address: str | tuple[str, int] = "\0paramserver-" + (name or uuid.uuid4().hex)
            listener = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
            listener.bind(self.address)
        else:
            self.address = listener.getsockname()[:2]
        self._tcp = listener.family != socket.AF_UNIX
        self.kind = "data_socket" if self._tcp else "shared_memory"  # the AttachRequest kind its hellos present
        self._listener = listener
        self._listener.listen(64)
        self._conns: dict[socket.socket, threading.Thread] = {}
        self._pending: set[socket.socket] = set()  # accepted, not yet proven
        # Connection -> when it must be done with what it is sending or receiving (see FRAME_FLOOR_S); the
        # watchdog ends the connections past theirs.
        self._deadlines: dict[socket.socket, float] = {}
        self._lock = threading.Lock()
        self._closed = threading.Event()
        self._thread = threading.Thread(target=self._accept, name="doorbell-accept", daemon=True)
        self._thread.start()
        self._watchdog = threading.Thread(target=self._watch, name="doorbell-watchdog", daemon=True)
        self._watchdog.start()

    @property
    def port(self) -> int:
        """The TCP port (a data socket), or 0 (a doorbell)."""
        return int(self.address[1]) if self._tcp else 0

    @property
    def pending(self) -> int:
        """Connections accepted that have not proven themselves yet."""
        with self._lock:
            return len(self._pending)

    def _accept(self) -> None:
        while True:
            try:
                conn, _ = self._listener.accept()
            except OSError:
                return  # closed
            with self._lock:
                if self._closed.is_set():
                    conn.close()
                    return
                if len(self._pending) >= self._max_pending:
                    conn.close()
                    full = True
                else:
                    full = False
                    thread = threading.Thread(target=self._serve, args=(conn,), name="doorbell", daemon=True)
                    self._conns[conn] = thread
                    self._pending.add(conn)
                    self._deadlines[conn] = time.monotonic() + HANDSHAKE_TIMEOUT
            if full:
                waiting = len(self._pending)
                log.warning("%s: %d connections still proving themselves: refused another", self.kind, waiting)
                self._refused("pending_cap")
                continue
            thread.start()

    def _refused(self, reason: str) -> None:
        if self._on_refused is not None:
            self._on_refused(reason)

    def _watch(self) -> None:
        while not self._closed.wait(WATCH_S):
            now = time.monotonic()
            with self._lock:
                late = [c for c, deadline in self._deadlines.items() if deadline < now]
                for conn in late:
                    del self._deadlines[conn]
                handshakes = [c for c in late if c in self._pending]
            for conn in late:
                _shutdown(conn)
            for _ in handshakes:
                self._refused("handshake_timeout")
            if late:
                log.info("%s: ended %d connection(s) past their deadline", self.kind, len(late))

    def _until(self, conn: socket.socket, seconds: float | None) -> None:
        """Give `conn` until `seconds` from now to finish what it is doing (None: no deadline)."""
        with self._lock:
            if seconds is None:
                self._deadlines.pop(conn, None)
            else:
                self._deadlines[conn] = time.monotonic() + seconds

    def _begun(self, conn: socket.socket, payload: int) -> None:
        """A frame's header is in: all of it, payload and end included, must be in by its deadline."""
        self._until(conn, FRAME_FLOOR_S + payload / MIN_BYTES_PER_S)

    def _replace(self, old: socket.socket, new: socket.socket) -> None:
        """`new` (TLS) took over `old`'s descriptor: track it instead."""
        with self._lock:
            self._conns[new] = self._conns.pop(old)
            if old in self._pending:
                self._pending.discard(old)
                self._pending.add(new)
            if old in self._deadlines:
                self._deadlines[new] = self._deadlines.pop(old)

    def _serve(self, raw: socket.socket) -> None:
        conn = raw
        try:
            if self._tcp:
                raw.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
                keep_alive(raw)
            else:
                unix_buffers(raw)
            raw.settimeout(HANDSHAKE_TIMEOUT)  # each wait; the watchdog bounds the whole handshake
            if self._tls is not None:
                conn = self._tls.wrap_socket(raw, server_side=True)  # takes over raw's descriptor
                self._replace(raw, conn)
            worker_id = self._hello(conn)
            if worker_id is None:
                return
            conn.settimeout(None)  # a proven worker may wait as long as a pull may
            begun = functools.partial(self._begun, conn)
            unwatch = functools.partial(self._until, conn, None)
            # Between frames: no deadline (nothing is held); once a frame's header is in, the rest has one.
            while (frame := read_request(conn, on_head=begun)) is not None:
                self._frame(conn, worker_id, *frame, unwatch)
        except (OSError, ConnectionError, ssl.SSLError) as exc:
            log.debug("doorbell connection ended: %s", exc)
        finally:
            with self._lock:
                for c in (conn, raw):
                    self._conns.pop(c, None)
                    self._pending.discard(c)
                    self._deadlines.pop(c, None)
            conn.close()

    @staticmethod
    def _receive_buffer(conn: socket.socket) -> int:
        """The kernel's receive buffer of a connection (Linux reports twice what it grants user data)."""
        try:
            return int(conn.getsockopt(socket.SOL_SOCKET, socket.SO_RCVBUF))
        except OSError:
            return 0

    def _hello(self, conn: socket.socket) -> str | None:
        """Read and check a connection's hello; the worker it speaks for, or None (refused, or no hello)."""
        frame = read_request(conn, MAX_HELLO)
        if frame is None:
            return None
        _, body, payload = frame
        if payload.size:
            raise ConnectionError("a hello carries no payload")
        try:
            hello = decode_message(HELLO, body)  # garbage ends the connection at once
        except PSError as exc:  # a field past its bound: answered, once the frame's end is in
            payload.finish()
            self._rejected("Attach (socket hello)", exc)
            send_reply(conn, error_body(status_of(exc, "Attach (socket hello)")))
            return None
        payload.finish()
        try:
            kind = hello.WhichOneof("kind")
            if kind != self.kind:
                raise NotAttached(
                    f"this socket takes {self.kind.replace('_', ' ')} attachments, not {str(kind).replace('_', ' ')}"
                )
            self._verify(hello, functools.partial(_shutdown, conn))
        except PSError as exc:
            self._rejected("Attach (socket hello)", exc)
            send_reply(conn, error_body(status_of(exc, "Attach (socket hello)")))
            return None
        with self._lock:
            self._pending.discard(conn)
            self._deadlines.pop(conn, None)
        send_reply(conn, b"\0")
        return str(hello.worker_id)

    def _frame(
        self,
        conn: socket.socket,
        worker_id: str,
        timeout: float,
        message: bytes,
        payload: Payload,
        unwatch: Callable[[], None],
    ) -> None:
        """Answer one request frame (its head read, its deadline set; its payload and end still to come)."""
        try:
            request: ps_pb2.ExchangeRequest | PSError = decode_message(EXCHANGE, message)  # garbage ends it now
        except PSError as exc:  # a field past its bound: answered
            request = exc
        if payload.size:
            # The shard's part in float32 and the rows and IDs this request announces (SPEC 10.3 and 16).
            limit = self._payload_limit(None if isinstance(request, PSError) else request)
            if payload.size > limit:
                big = TooLarge(
                    f"a payload of {payload.size} bytes is over the {limit} this request may carry (the shard's part "
                    "of the model in float32, and the rows and IDs the request announces)"
                )
                self._rejected("Exchange (socket)", big)
                send_reply(conn, error_body(status_of(big, "Exchange (socket)")))
                raise ConnectionError("payload over the limit")  # the rest of the stream cannot be trusted
            if payload.size <= WAIT_WHOLE_BYTES:
                payload.arrival = (FRAME_FLOOR_S, min(WAIT_WHOLE_BYTES, self._receive_buffer(conn) // 2))
        payload.on_end = unwatch  # a pull may then wait as long as it must
        if not payload.size:
            payload.finish()  # the end of a frame without payload is checked before the frame is acted on
        body, reply = self._answer(worker_id, request, timeout, payload)
        try:
            payload.finish()
            if reply is None or not (reply.arrays or reply.raw):
                send_reply(conn, body)  # a few bytes: into the socket's buffer at once
                return
            # Weights lent until sent: a peer that does not take them loses its connection at the deadline.
            self._until(conn, FRAME_FLOOR_S + payload_bytes(reply.arrays, reply.dtype, reply.raw) / MIN_BYTES_PER_S)
            send_reply(conn, body, reply.arrays, reply.dtype, reply.raw)
            unwatch()
        finally:
            if reply is not None and reply.release is not None:
                reply.release()

    def _rejected(self, what: str, exc: PSError) -> None:
        log.info("%s rejected: %s: %s", what, exc.code.name, exc)
        if self._on_reject is not None:
            self._on_reject(exc)

    def _answer(
        self, worker_id: str, request: ps_pb2.ExchangeRequest | PSError, timeout: float, payload: Payload
    ) -> tuple[bytes, Reply | None]:
        what = "Exchange (socket)"
        try:
            if isinstance(request, PSError):
                raise request
            if request.worker_id != worker_id:
                raise PermissionDenied(f"this connection speaks for worker {worker_id!r} only")
            reply = self._handle(request, timeout, payload)  # the handler clamps timeout to the pull_timeout
            return b"\0" + reply.message.SerializeToString(), reply
        except PermissionDenied as exc:
            # The connection, not its request, is at fault: no refused request to count, and (as the data-socket
            # tests pin) a status without a type name.
            return error_body(status_of(exc, what)._replace(name="")), None
        except PSError as exc:
            self._rejected(what, exc)
            return error_body(status_of(exc, what)), None
        except (OSError, ConnectionError):
            raise  # the connection itself failed (e.g. mid-payload): nothing to answer on
        except Exception as exc:  # noqa: BLE001 - the boundary, as in errors.rpc_errors
            log.exception("%s failed", what)
            return error_body(status_of(exc, what)), None

    def close(self, grace: float = 5.0) -> None:
        """Stop accepting, end every connection (their workers re-attach or fall back to gRPC), and wait up to
        `grace` seconds for the Exchanges in flight to finish."""
        with self._lock:
            self._closed.set()
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
