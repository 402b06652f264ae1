"""The primary's end of the replication link (paramserver.server.replica): take a backup's connection, send it the
whole state and then every update, and judge it by its answers.

Kept apart from the role because it is the only part that runs on the push path: `send` is called under the
shard's lock for every update, and `wait_acked` holds each acknowledgement, so its state is guarded by its own
condition and never waits on the coordinator while holding it. What it decides about the backup (into the in-sync
set once caught up, out of it once silent) it asks the role to record by compare-and-swap, and the role alone
says when this copy is primary or deposed. The messages are paramserver.server.replica_stream's.
"""

from __future__ import annotations

import contextlib
import json
import logging
import socket
import ssl
import struct
import tempfile
import threading
import time
from collections.abc import Callable, Sequence
from pathlib import Path

from paramserver.coord import PartConfig
from paramserver.errors import NotPrimary
from paramserver.server.replica_outbox import Forward, Outbox
from paramserver.server.replica_stream import (
    APPLY,
    BEAT,
    DONE,
    HEARTBEAT,
    IN_SYNC,
    MAX_HELLO,
    NO_MODEL,
    RECORD,
    SNAPSHOT,
    U32,
    U64,
    hello_refusal,
    recv_exact,
    recv_message,
    send_message,
)
from paramserver.shard.durability import checkpoint
from paramserver.shard.replication.replicator import Forwarded
from paramserver.shard.state import Shard
from paramserver.transport.tcp import keep_alive

log = logging.getLogger(__name__)

MAX_QUEUED_BYTES = 1 << 30  # updates held for a backup taking the state before it is dropped (and tries again)
MIN_BYTES_PER_S = 20 << 20  # the slowest link (and apply) a large update is given time for before the copy is dropped

# An edit of the part's configuration, and the role's way of recording one as this primary (False: deposed).
Edit = Callable[[PartConfig], PartConfig]
Change = Callable[[Edit, str], bool]


class Leader:
    """A primary's end of the link: one backup connection at a time, the updates queued while it takes the
    state, and how far it has answered. The shard's Replicator while this copy is the primary (`send`,
    `wait_acked`)."""

    def __init__(
        self,
        shard: Shard,
        copy: int,
        listener: socket.socket,
        token: str,
        tls: ssl.SSLContext | None,
        stop: threading.Event,
        deposed: threading.Event,
        seen: Callable[[], PartConfig | None],
        change: Change,
    ) -> None:
        self.shard = shard
        self.config = shard.config
        self.copy = copy
        self.other = 1 - copy
        self.timeout = self.config.replica_timeout
        self._listener = listener
        self._token = token
        self._server_tls = tls
        self._stop = stop
        self._deposed = deposed
        self._seen = seen  # the configuration as the role last read or wrote it
        self._change = change
        self._threads: list[threading.Thread] = []
        # Guarded by the shard's lock where `send` runs under it.
        self._cond = threading.Condition()
        self._backup: socket.socket | None = None
        self._backup_id = 0  # which connection the fields below belong to
        self._live = False  # the backup has caught up: updates go straight to it
        self._queue: list[tuple[int, bytes]] = []  # updates made while its state was being sent
        self._queued_bytes = 0
        self._need_acks = False  # acknowledgements wait for the backup (from the moment it is live)
        self._sent = 0
        self._acked = 0
        self._heard = 0.0
        self._unacked_bytes = 0
        self._failed = ""  # why the backup link broke ("" while it holds)
        self._outbox: Outbox | None = None  # what writes to the live backup, in order

    def _who(self) -> tuple[int, int]:
        return self.shard.index, self.copy

    def start(self) -> None:
        """Take backups' connections and watch the one held (this copy just became the primary)."""
        for target, name in ((self._accept_loop, "replication-accept"), (self._watch_backup, "replication-watch")):
            t = threading.Thread(target=target, name=f"shard{self.shard.index}-{name}", daemon=True)
            t.start()
            self._threads.append(t)

    def disconnect(self) -> None:
        """Close the backup's connection and wake every waiter (this copy stops or was deposed)."""
        with self._cond:
            self._drop_backup_locked()
            self._cond.notify_all()

    def close(self) -> None:
        """Disconnect, close the listener, and wait for the threads (once `stop` is set)."""
        self.disconnect()
        with contextlib.suppress(OSError):
            self._listener.close()
        for t in self._threads:
            t.join(timeout=5)

    def send(self, version: int, parts: Sequence[memoryview | bytes]) -> None:
        """Hand one update to the backup (under the shard's lock, in version order): onto the link once it is
        live (written before this returns: `parts` are views of buffers that change after), else queued (copied)
        behind the state being sent."""
        with self._cond:
            if self._backup is None or self._failed:
                return
            total = sum(len(p) for p in parts)
            if not self._live:
                self._queue.append((version, b"".join(parts)))
                self._queued_bytes += total
                if self._queued_bytes > max(MAX_QUEUED_BYTES, 4 * total):
                    self._failed = f"it fell {self._queued_bytes} bytes of updates behind while taking the state"
                    self._cond.notify_all()
                return
            box = self._outbox
            assert box is not None
        if box.post([RECORD, *parts], wait=True):  # the sender's failure is recorded by `_sender_failed`
            self._sent_update(version, total)
            self.shard.metrics.sent_backup("whole")

    def forward(self, data: memoryview) -> Forward | None:
        """Start sending a push's bytes to a live backup as they become final (Replicator.forward); None where
        none is live, or as many pushes as the shard has scratch buffers (--max-concurrent-pushes) are
        held there already: the backup's memory for them is bounded as the primary's is."""
        if not len(data):  # a part with no dense elements (rows only): its record is as small as a name
            return None
        with self._cond:
            box = self._outbox if self._live and not self._failed else None
        return box.forward(data, self.config.max_concurrent_pushes) if box is not None else None

    def send_forwarded(self, version: int, forwards: Sequence[Forwarded], parts: Sequence[memoryview | bytes]) -> bool:
        """Hand the backup an update made of pushes it was forwarded (Replicator.send_forwarded): their ids and
        the record without its gradient. False (the forwards dropped there) where they went over an earlier
        connection or one was aborted: the caller then sends the whole record."""
        with self._cond:
            box = self._outbox if self._live and not self._failed else None
        ours = [f for f in forwards if isinstance(f, Forward) and f.outbox is box and not f.aborted]
        if box is None or len(ours) != len(forwards):
            for f in forwards:
                f.abort()
            return False
        head = APPLY + U32.pack(len(ours)) + b"".join(U64.pack(f.id) for f in ours)
        if not box.post([head, *parts], needs=ours):
            return False
        box.settle(ours)
        self._sent_update(version, sum(f.nbytes for f in ours) + sum(len(p) for p in parts))
        self.shard.metrics.sent_backup("forwarded")
        return True

    def _sent_update(self, version: int, nbytes: int) -> None:
        with self._cond:
            self._sent = version
            self._unacked_bytes += nbytes

    def _sender_failed(self, ident: int, why: str) -> None:
        with self._cond:
            if ident == self._backup_id and not self._failed:
                self._failed = why
                self._cond.notify_all()

    def wait_acked(self, version: int, timeout: float) -> bool:
        """Wait until the backup holds `version`, where it must (in the in-sync set, or catching up live);
        NotPrimary once this copy was deposed."""
        with self._cond:
            self._cond.wait_for(
                lambda: self._deposed.is_set() or not self._need_acks or self._acked >= version, timeout=timeout
            )
            if self._deposed.is_set():
                raise NotPrimary(f"shard {self.shard.index} copy {self.copy} is no longer the primary")
            return not self._need_acks or self._acked >= version

    def _accept_loop(self) -> None:
        with contextlib.suppress(OSError):
            self._listener.settimeout(0.2)  # a closed listener does not wake a blocked accept: look at _stop instead
        while not self._stop.is_set():
            try:
                conn, _ = self._listener.accept()
            except TimeoutError:
                continue
            except OSError:
                return
            conn.settimeout(None)
            threading.Thread(target=self._adopt_backup, args=(conn,), name="replication-hello", daemon=True).start()

    def _adopt_backup(self, conn: socket.socket) -> None:
        """Check a backup's hello, send it the whole state, then the updates made meanwhile; it is live after."""
        try:
            conn.settimeout(max(2.0, self.timeout))
            keep_alive(conn)
            conn.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
            if self._server_tls is not None:
                conn = self._server_tls.wrap_socket(conn, server_side=True)
            hello = json.loads(recv_message(conn, MAX_HELLO))
            cfg = self._seen()
            why = hello_refusal(
                hello,
                job=self.config.job_name,
                shard=self.shard.index,
                copy=self.other,
                token=self._token,
                epoch=cfg.epoch if cfg else None,
                has_model=self.shard.model is not None,
            )
            if why:
                level = logging.DEBUG if why == NO_MODEL else logging.WARNING
                log.log(level, "shard %d copy %d: refused a backup: %s", *self._who(), why)
                send_message(conn, json.dumps({"error": why}).encode())
                conn.close()
                return
            send_message(conn, json.dumps({"ok": True}).encode())
        except (OSError, ValueError, ssl.SSLError) as exc:
            log.info("shard %d copy %d: a replication connection failed its hello: %s", *self._who(), exc)
            conn.close()
            return
        # A new connection starts out of sync (a restarted backup holds nothing; a reconnecting one is sent the
        # whole state again): out of the in-sync set before anything else, then acknowledgements stop waiting.
        self._drop_backup("a new connection from the backup")
        if self._deposed.is_set():
            conn.close()
            return
        with self._cond:
            self._backup_id += 1
            ident = self._backup_id
            self._backup, self._live, self._queue, self._failed = conn, False, [], ""
            self._queued_bytes = self._sent = self._acked = self._unacked_bytes = 0
            self._heard = time.monotonic()
        threading.Thread(target=self._read_acks, args=(conn, ident), name="replication-acks", daemon=True).start()
        try:
            self._send_state(conn, ident)
        except (OSError, ValueError) as exc:
            with self._cond:
                if ident == self._backup_id and not self._failed:
                    self._failed = f"sending the state failed: {exc}"
                    self._cond.notify_all()

    def _send_state(self, conn: socket.socket, ident: int) -> None:
        with self.shard.lock, self._cond:
            snap = self.shard.snapshot()  # ValueError without a model (the hello refused that already)
            # What was queued before this moment is in the state; what is queued from now on follows it.
            self._queue, self._queued_bytes = [], 0
        with tempfile.TemporaryDirectory(prefix="ps-replica-") as tmp:
            path = Path(tmp) / "state.safetensors"
            checkpoint.save_as(path, snap, durable=False)
            del snap
            size = path.stat().st_size
            conn.settimeout(self.timeout + size / MIN_BYTES_PER_S)
            conn.sendall(SNAPSHOT + U64.pack(size))
            with open(path, "rb") as f:
                conn.sendfile(f)
        log.info("shard %d copy %d: sent the backup its state (%d bytes)", *self._who(), size)
        # The updates made meanwhile, then live: under the shard's lock no update is in flight.
        while True:
            with self.shard.lock, self._cond:
                if ident != self._backup_id or self._failed:
                    return
                if not self._queue:
                    self._outbox = Outbox(conn, self.timeout, lambda why: self._sender_failed(ident, why))
                    self._live = True
                    self._heard = time.monotonic()
                    self._need_acks = True  # from now on an acknowledgement waits for the backup
                    self._sent = max(self._sent, self.shard.version)
                    return
                batch, self._queue = self._queue, []
            for version, data in batch:
                conn.settimeout(self.timeout + len(data) / MIN_BYTES_PER_S)
                conn.sendall(RECORD + data)
                with self._cond:
                    self._sent = version
                    self._unacked_bytes += len(data)

    def _read_acks(self, conn: socket.socket, ident: int) -> None:
        try:
            conn.settimeout(None)  # the watcher judges silence; this thread only reads
            while True:
                (version,) = U64.unpack(recv_exact(conn, U64.size))
                with self._cond:
                    if ident != self._backup_id:
                        return
                    self._acked = max(self._acked, version)
                    self._heard = time.monotonic()
                    self._unacked_bytes = 0 if self._acked >= self._sent else self._unacked_bytes
                    self._cond.notify_all()
        except (OSError, ConnectionError, struct.error) as exc:
            with self._cond:
                if ident == self._backup_id and not self._failed:
                    self._failed = f"the link broke: {exc}"
                    self._cond.notify_all()

    def _watch_backup(self) -> None:
        """Heartbeats when idle; the backup into the in-sync set once caught up, out of it once silent."""
        beat = self.timeout / 4
        while not self._stop.is_set() and not self._deposed.is_set():
            with self._cond:
                self._cond.wait(beat)
                failed, live, acked, sent, ident = self._failed, self._live, self._acked, self._sent, self._backup_id
                silent = time.monotonic() - self._heard
                slack = self.timeout + self._unacked_bytes / MIN_BYTES_PER_S
                # Judged once live: while it takes the whole state, the send's own deadline judges the backup.
                if self._backup is not None and self._live and not failed and silent > slack:
                    failed = self._failed = f"no answer for {silent:.2f} s"
            if failed:
                self._drop_backup(failed, ident)
                continue
            if self._backup is None:
                continue
            self.heartbeat()
            cfg = self._seen()
            if live and cfg is not None and self.other not in cfg.in_sync and acked >= sent:
                if self._change(lambda c: c.but(in_sync=(self.copy, self.other)), "the backup caught up"):
                    self.shard.metrics.backup_in_sync.set(1)

    def heartbeat(self, wait: bool = False) -> None:
        """Tell a live backup the version, the finished workers, whether it is in sync and whether the job is
        done (a primary stopping because it is says so last: `wait` until it is written)."""
        with self.shard.lock, self._cond:
            box = self._outbox
            if box is None or self._failed or not self._live:
                return
            cfg = self._seen()
            flags = IN_SYNC if cfg is not None and self.other in cfg.in_sync else 0
            flags |= DONE if self.shard.done.is_set() else 0
            beat = HEARTBEAT + BEAT.pack(self.shard.version, self.shard.finished_workers, flags)
        box.post([beat], wait=wait)  # in order behind the updates before it; a failure is `_sender_failed`'s

    def _drop_backup_locked(self) -> None:
        if self._outbox is not None:
            self._outbox.close()
            self._outbox = None
        sock, self._backup = self._backup, None
        self._backup_id += 1
        self._live, self._queue = False, []
        if sock is not None:
            with contextlib.suppress(OSError):
                sock.shutdown(socket.SHUT_RDWR)
            sock.close()

    def _drop_backup(self, why: str, ident: int | None = None) -> None:
        """Go on without the backup (`ident`: only if still that connection): out of the in-sync set first (its
        acknowledgements were promised), then acknowledgements stop waiting for it."""
        with self._cond:
            if ident is not None and ident != self._backup_id:
                return
            self._drop_backup_locked()
        cfg = self._seen()
        if cfg is not None and self.other in cfg.in_sync:
            log.warning("shard %d copy %d: going on without the backup: %s", *self._who(), why)
            if not self._change(lambda c: c.but(in_sync=(self.copy,)), f"the backup is out of sync ({why})"):
                return
            self.shard.metrics.backup_lost.inc()
            self.shard.metrics.backup_in_sync.set(0)
        with self._cond:
            self._need_acks = False
            self._failed = ""
            self._cond.notify_all()
