"""The backup's end of the replication link (paramserver.server.replica): follow the primary named in the
coordinator (taking over when it falls silent while this copy is in sync), connect to it, take its whole state, then
every update it streams, answering for each as soon as it arrived whole (before it applies), and the
primary's heartbeats; and the link's message format, which both ends speak.

Messages, primary to backup:

    b"S" u64 n, n bytes   the whole state (a checkpoint file) a backup starts from
    b"R" record           one update, as the write-ahead log writes it (paramserver.shard.durability.wal)
    b"P" u64 id, u64 offset, u32 n, n bytes
                          a piece of a push forwarded while it arrives (paramserver.server.replica_outbox): bytes
                          [offset, offset + n) of its flat float32 gradient, pieces in order
    b"X" u64 id           a forwarded push that will not apply: drop it
    b"A" u32 k, k u64 ids, record
                          one update whose gradient is the forwarded pushes named, combined as a sync round combines
                          them (summed in this order, then divided by k when k > 1); the record (a write-ahead log
                          record) carries an empty gradient
    b"H" u64 version, u32 finished workers, u8 flags   a heartbeat, every replica_timeout / 4 (flags: 1 the
                          backup is in sync, 2 the job is done: a primary stopping because of it says so last)

and backup to primary a u64 version for every "S", "R", "A" and "H" (not for pieces and drops). A backup holds at
most MAX_FORWARDS forwarded pushes at once; the primary sends at most --max-concurrent-pushes. The backup opens the
connection with a JSON hello (job, shard, copy, the epoch it read, the bearer token when the job has one), sent as
a u64 length and the bytes; the primary answers {"ok": true} or {"error": why} the same way.
"""

from __future__ import annotations

import contextlib
import hmac
import json
import logging
import os
import shutil
import socket
import ssl
import struct
import tempfile
import threading
import time
from collections.abc import Callable
from pathlib import Path

import numpy as np

from paramserver.config import ServerConfig
from paramserver.coord import CoordinatorUnavailable, PartConfig, PartRegister
from paramserver.server import standby
from paramserver.shard.durability import checkpoint, wal
from paramserver.shard.state import Shard
from paramserver.transport.tcp import keep_alive

log = logging.getLogger(__name__)

SNAPSHOT, RECORD, HEARTBEAT = b"S", b"R", b"H"
FORWARD, DROP, APPLY = b"P", b"X", b"A"
# The link's layouts, shared by its two ends (replica_leader.py, replica_outbox.py write what this module reads).
U64 = struct.Struct("<Q")  # a size, a version or a forwarded push's id
U32 = struct.Struct("<I")  # a count
PART = struct.Struct("<QQI")  # a forwarded push's piece: id, offset, length
MAX_FORWARDS = 64  # forwarded pushes a backup holds at once: more is a primary out of step
BEAT = struct.Struct("<QIB")  # a heartbeat: version, finished workers, flags (IN_SYNC, DONE)
IN_SYNC, DONE = 1, 2
MAX_HELLO = 4096
NO_MODEL = "this primary holds no model yet (no worker registered one)"
DONE_GRACE = 20  # a copy that finds its job done waits this many replica timeouts for a new run, then stops


def recv_exact(sock: socket.socket, n: int, into: memoryview | None = None) -> memoryview:
    buf = into if into is not None else memoryview(bytearray(n))
    got = 0
    while got < n:
        k = sock.recv_into(buf[got:n])
        if not k:
            raise ConnectionError("the other copy closed the replication link")
        got += k
    return buf


def send_message(sock: socket.socket, payload: bytes) -> None:
    sock.sendall(U64.pack(len(payload)) + payload)


def recv_message(sock: socket.socket, limit: int) -> bytes:
    (n,) = U64.unpack(recv_exact(sock, U64.size))
    if n > limit:
        raise ConnectionError(f"a replication hello of {n} bytes (at most {limit})")
    return bytes(recv_exact(sock, n))


def hello_refusal(
    hello: dict[str, object], *, job: str, shard: int, copy: int, token: str, epoch: int | None, has_model: bool
) -> str:
    """Why a primary refuses a backup's hello ("" when it does not): another job, shard or copy, no bearer token,
    an epoch other than the primary's, or no model yet to send."""
    if hello.get("job") != job:
        return f"it belongs to job {hello.get('job')!r}, not {job!r}"
    if hello.get("shard") != shard or hello.get("copy") != copy:
        return f"it is shard {hello.get('shard')} copy {hello.get('copy')}, not shard {shard}'s other"
    if token and not hmac.compare_digest(str(hello.get("token", "")), token):
        return "it did not carry this job's bearer token"
    if epoch is None or hello.get("epoch") != epoch:
        return f"it read epoch {hello.get('epoch')}, this primary's is {epoch}"
    if not has_model:
        return NO_MODEL
    return ""


class Follower:
    """A backup's end of the link: one connection to the primary at a time (`stream`), the buffer updates arrive
    in, and whether this copy answered for an update it could not apply (`damaged`: it must not take over)."""

    def __init__(
        self,
        shard: Shard,
        config: ServerConfig,
        copy: int,
        token: str,
        client_tls: ssl.SSLContext | None,
        stop: threading.Event,
        set_ready: Callable[[bool], None],
    ) -> None:
        self.shard = shard
        self.config = config
        self.copy = copy
        self.timeout = config.replica_timeout
        self._token = token
        self._client_tls = client_tls
        self._stop = stop
        self._set_ready = set_ready
        self._rx = memoryview(b"")  # the receive buffer for updates
        self._pushes = standby.HeldPushes(shard, MAX_FORWARDS)
        self.damaged = False

    def _who(self) -> tuple[int, int]:
        return self.shard.index, self.copy

    def follow(self, register: PartRegister, take_over: Callable[..., bool]) -> None:
        """Follow the primary; take over when it falls silent while this copy is in sync. A copy that started
        after its job was done (and its primary gone) stops after DONE_GRACE replica timeouts, unless a new run
        begins. `take_over(new, old=None)` makes this copy the primary by compare-and-swap (False: it lost)."""
        done_since: float | None = None
        while not self._stop.is_set():
            try:
                cfg = register.read()
            except CoordinatorUnavailable as exc:
                log.warning("shard %d copy %d: the coordinator is unreachable (%s)", *self._who(), exc)
                time.sleep(min(1.0, self.timeout))
                continue
            if cfg is None:
                time.sleep(self.timeout)
                continue
            done_since = (done_since or time.monotonic()) if cfg.done else None
            if done_since is not None and time.monotonic() - done_since > DONE_GRACE * self.timeout:
                log.info("shard %d copy %d: the job is done and its primary gone", *self._who())
                self.shard.done.set()  # with --exit-when-done the process stops
                return
            if cfg.primary == self.copy:  # it handed over to this copy (a restarted primary with nothing)
                if take_over(cfg):
                    return
                continue
            why = self.stream(cfg)
            if self._stop.is_set() or self.shard.done.is_set():
                return
            level = logging.DEBUG if NO_MODEL in why else logging.WARNING
            log.log(level, "shard %d copy %d: the primary's link ended: %s", *self._who(), why)
            self._set_ready(False)
            try:
                now = register.read()
            except CoordinatorUnavailable:
                continue
            if now is not None and now.primary == cfg.primary and self.copy in now.in_sync and not self.damaged:
                new = now.but(epoch=now.epoch + 1, primary=self.copy, in_sync=(self.copy,))
                if take_over(new, now):
                    return
            # Not in sync, or the configuration moved: follow again (soon where the primary only waits for a model).
            time.sleep(0.05 if NO_MODEL in why else min(0.2, self.timeout / 2))

    def stream(self, cfg: PartConfig) -> str:
        """Connect to the primary, take its state and its updates until the link ends; return why it ended."""
        address = cfg.links.get(cfg.primary)
        if not address:
            return "the primary has not said where it listens"
        host, port = address.rsplit(":", 1)
        try:
            sock = socket.create_connection((host, int(port)), timeout=max(1.0, self.timeout))
        except OSError as exc:
            return f"cannot connect to {address}: {exc}"
        try:
            keep_alive(sock)
            sock.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
            if self._client_tls is not None:
                sock = self._client_tls.wrap_socket(sock)
            hello = {
                "job": self.config.job_name,
                "shard": self.shard.index,
                "copy": self.copy,
                "epoch": cfg.epoch,
                "token": self._token,
            }
            send_message(sock, json.dumps(hello).encode())
            answer = json.loads(recv_message(sock, MAX_HELLO))
            if "error" in answer:
                return f"the primary refused: {answer['error']}"
            # The whole state comes first, once the primary has written it out: give that time (it judges the
            # transfer by the bytes flowing); after it, silence longer than replica_timeout means the primary is gone.
            sock.settimeout(max(30.0, self.timeout))
            self._pushes.clear()  # ids are the connection's
            while not self._stop.is_set():
                kind = bytes(recv_exact(sock, 1))
                if kind == SNAPSHOT:
                    self._receive_state(sock)
                    sock.settimeout(self.timeout)
                elif kind == RECORD:
                    self._receive_record(sock)
                    continue  # answered as soon as it arrived whole, before it applied
                elif kind == FORWARD:
                    ident, offset, n = PART.unpack(recv_exact(sock, PART.size))
                    self._pushes.receive(ident, offset, n, lambda view: recv_exact(sock, len(view), view))
                    continue
                elif kind == DROP:
                    self._pushes.drop(U64.unpack(recv_exact(sock, U64.size))[0])
                    continue
                elif kind == APPLY:
                    self._receive_apply(sock)
                    continue
                elif kind == HEARTBEAT:
                    version, finished, flags = BEAT.unpack(recv_exact(sock, BEAT.size))
                    self.shard.finished_workers = max(self.shard.finished_workers, finished)
                    self._set_ready(bool(flags & IN_SYNC))
                    if flags & DONE:
                        self.shard.done.set()  # with --exit-when-done this copy stops too
                else:
                    return f"an unknown message {kind!r}"
                sock.sendall(U64.pack(self.shard.version))
            return "stopping"
        except (OSError, ConnectionError, ValueError, struct.error) as exc:
            return str(exc) or type(exc).__name__
        finally:
            with contextlib.suppress(OSError):
                sock.close()

    def _receive_state(self, sock: socket.socket) -> None:
        (size,) = U64.unpack(recv_exact(sock, U64.size))
        directory = self.config.checkpoint_dir
        if directory:
            Path(directory).mkdir(parents=True, exist_ok=True)
        tmp = Path(tempfile.mkdtemp(prefix="ps-replica-", dir=directory or None))
        try:
            path = tmp / "state.safetensors"
            with open(path, "wb") as f:
                buf = memoryview(bytearray(4 << 20))
                left = size
                while left:
                    k = sock.recv_into(buf[: min(left, len(buf))])
                    if not k:
                        raise ConnectionError("the primary closed the link while sending its state")
                    f.write(buf[:k])
                    left -= k
            snap = checkpoint.load(path)  # its checksum verified
            if directory:  # the state is this copy's newest checkpoint; any other history here is void
                for old in checkpoint.list_checkpoints(directory, self.shard.index):
                    old.unlink(missing_ok=True)
                os.replace(path, checkpoint.path_for(Path(directory), self.shard.index, snap.version))
            standby.install(self.shard, snap)
            self.damaged = False
        except checkpoint.CorruptCheckpoint as exc:
            raise ValueError(f"the primary's state did not verify: {exc}") from None
        finally:
            shutil.rmtree(tmp, ignore_errors=True)
        log.info("shard %d copy %d: took the primary's state at version %d", *self._who(), self.shard.version)

    def _receive_record(self, sock: socket.socket) -> None:
        """Take one update whole, answer for it, then log and apply it. The answer comes before the apply, so the
        primary's acknowledgement does not wait for this copy's optimizer step: this copy holds the update from
        then on, and applies every update it answered for, in this same thread, before it could ever take over."""
        head = bytes(recv_exact(sock, wal.HEAD_BYTES))
        header = bytes(recv_exact(sock, wal.header_size(head)))
        rest = wal.body_size(head, header)
        size = len(head) + len(header) + rest
        if len(self._rx) < size:  # one buffer, reused: an update is applied (and logged) before the next arrives
            self._rx = np.empty(size, dtype=np.uint8).data.cast("B")
        view = self._rx[:size]
        view[: len(head)] = head
        view[len(head) : len(head) + len(header)] = header
        recv_exact(sock, rest, view[len(head) + len(header) :])
        found = wal.decode(view)
        if found is None:
            raise ValueError("an update from the primary does not decode")
        sock.sendall(U64.pack(found[0].version))
        try:
            standby.apply_record(self.shard, found[0], [view])
        except ValueError as exc:
            # Answered but not applied: this copy must not take over; it takes the whole state again.
            self.damaged = True
            raise ValueError(f"an update from the primary does not apply here: {exc}") from None

    def _receive_apply(self, sock: socket.socket) -> None:
        """Take one update made of forwarded pushes: their ids, then the record without its gradient. Answered once
        it arrived (the pushes are here whole: they came first), then combined, logged and applied."""
        (k,) = U32.unpack(recv_exact(sock, U32.size))
        if not 1 <= k <= MAX_FORWARDS:
            raise ValueError(f"an update naming {k} forwarded pushes")
        ids = list(struct.unpack(f"<{k}Q", recv_exact(sock, 8 * k)))
        head = bytes(recv_exact(sock, wal.HEAD_BYTES))
        header = bytes(recv_exact(sock, wal.header_size(head)))
        body = bytes(recv_exact(sock, wal.body_size(head, header)))
        found = wal.decode(memoryview(head + header + body))
        if found is None or found[0].grad.size:
            raise ValueError("an update from the primary does not decode")
        rec = found[0]
        grad = self._pushes.combine(ids)  # ValueError for an id not held whole
        sock.sendall(U64.pack(rec.version))
        rec.grad = grad
        try:
            standby.apply_record(self.shard, rec, rec.encoded())
        except ValueError as exc:
            self.damaged = True
            raise ValueError(f"an update from the primary does not apply here: {exc}") from None
        finally:
            self._pushes.release(ids)
