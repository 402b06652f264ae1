"""Hot standby (`--replicas 2`): one shard's two copies, the primary streaming every update to its backup.

Roles live in the coordinator (paramserver.coord: the primary, the in-sync copies, the epoch), changed only by
compare-and-swap. The primary serves workers; the backup refuses them (NotPrimary, so they try the other copy).

The stream is chain replication with a chain of two: the primary hands each update, exactly as its write-ahead
log encodes it (paramserver.shard.wal), to the backup over a TCP connection, under the shard's lock and in version
order; the backup logs and applies it and answers with the version. While the backup is in the in-sync set, a
push is acknowledged only once the backup has answered for the version holding it, so every acknowledged update
is on both copies. The messages and the backup's end of the link are paramserver.server.replica_stream's.

Failures, decided in the coordinator:

- the primary dies or falls silent for replica_timeout: the backup, if in sync, makes itself primary (epoch + 1)
  and serves; the workers' retries find it. The restarted process sees another primary and becomes the backup:
  it takes the whole state and then the stream, and joins the in-sync set once it has caught up.
- the backup dies or falls silent: the primary takes it out of the in-sync set and goes on alone.
- both at once (a partition between them): both try, one compare-and-swap wins. The loser, if it was the
  primary, is deposed: it refuses workers and its process exits with status 3 (restarted, it becomes the
  backup). It never acknowledged anything its rival lacks: its acknowledgements needed the backup's answer or
  the compare-and-swap it lost.
- a copy cut off from the coordinator changes no role: a primary that must drop its backup waits (and its
  pushes wait), a backup that lost its primary waits.
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

from paramserver.coord import CoordinatorUnavailable, Etcd, PartConfig, PartRegister
from paramserver.errors import NotPrimary
from paramserver.security import client_ssl_context, read_token, server_ssl_context
from paramserver.server.replica_stream import (
    _BEAT,
    _U64,
    DONE,
    HEARTBEAT,
    IN_SYNC,
    MAX_HELLO,
    NO_MODEL,
    RECORD,
    SNAPSHOT,
    Follower,
    hello_refusal,
    recv_exact,
    recv_message,
    send_message,
)
from paramserver.shard import checkpoint, standby
from paramserver.shard.state import Shard
from paramserver.transport.tcp import keep_alive

log = logging.getLogger(__name__)

MAX_QUEUED_BYTES = 1 << 30  # updates held for a backup taking the state before it is dropped (and tries again)
MIN_BYTES_PER_S = 20 << 20  # the slowest link (and apply) a large update is given time for before the copy is dropped
DEPOSED_EXIT = 3  # the status a deposed primary's process exits with, to come back as the backup


class Replication:
    """One copy of a replicated shard: its role, and its end of the replication link. Also the shard's
    Replicator while it is the primary (`send`, `wait_acked`)."""

    def __init__(
        self,
        shard: Shard,
        copy: int,
        coordinator: Etcd,
        host: str,
        advertise_host: str,
        on_ready: Callable[[bool], None] = lambda ready: None,
    ) -> None:
        self.shard = shard
        # Told whether this copy counts (a primary, or a backup in the in-sync set): its readiness, so that a
        # disruption budget never lets a drain take the only copy that holds everything.
        self._on_ready = on_ready
        self.ready = False
        self.config = shard.config
        self.copy = copy
        self.other = 1 - copy
        self.register = PartRegister(coordinator, self.config.job_name, shard.index)
        self.timeout = self.config.replica_timeout
        self._listener = socket.create_server((host, self.config.replication_port))
        self.link = f"{advertise_host}:{self._listener.getsockname()[1]}"
        self._token = read_token(self.config.auth_token_file) if self.config.auth_token_file else ""
        c = self.config
        self._server_tls = server_ssl_context(c.tls_cert, c.tls_key, c.tls_ca)
        self._client_tls = client_ssl_context(c.tls_ca, c.tls_cert, c.tls_key) if c.tls_cert else None
        if self._client_tls is not None:
            self._client_tls.check_hostname = False  # the CA vouches for a shard of this job; addresses vary
        self.config_seen: PartConfig | None = None
        self.deposed = threading.Event()  # set once this process must exit DEPOSED_EXIT
        self._stop = threading.Event()
        self._threads: list[threading.Thread] = []
        # The primary's side of the link (guarded by the shard's lock where `send` runs under it).
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
        # The backup's end of the link (paramserver.server.replica_stream).
        self._follower = Follower(
            shard, self.config, copy, self._token, self._client_tls, self._stop, lambda ready: self._set_ready(ready)
        )

    # -- start and stop ------------------------------------------------------------------------------------------

    def start(self) -> None:
        """Find this copy's role in the coordinator and take it: restore and serve (primary) or follow."""
        while not self._stop.is_set():
            try:
                role = self._claim()
            except CoordinatorUnavailable as exc:
                log.warning("shard %d copy %d: the coordinator is unreachable (%s); retrying", *self._who(), exc)
                time.sleep(min(1.0, self.timeout))
                continue
            if role == "primary":
                self.shard.restore()  # a lone primary's own disk holds every update it acknowledged
                self._become_primary(complete=False)
                return
            if role == "backup":
                self._become_backup()
                return
            time.sleep(0.05)  # lost a race: read again

    def _who(self) -> tuple[int, int]:
        return self.shard.index, self.copy

    def _claim(self) -> str:
        """Read the configuration and take this process's role in it ("" where a compare-and-swap lost)."""
        cfg = self.register.read()
        me, links = self.copy, {self.copy: self.link}
        if cfg is None:
            new = PartConfig(epoch=1, primary=me, in_sync=(me,), links=links)
            return self._commit(None, new, "primary")
        links = {**cfg.links, me: self.link}
        if cfg.primary == me:
            others = [r for r in cfg.in_sync if r != me]
            if not others or self.config.checkpoint_dir:
                # The only copy with everything, or one whose own log holds every update it acknowledged (each was
                # logged before it was sent): go on from its own disk; the other copy takes the state anew. (A job
                # that was done runs again.)
                new = cfg.but(epoch=cfg.epoch + 1, in_sync=(me,), links=links, done=False)
                return self._commit(cfg, new, "primary")
            # This process restarted with nothing in memory while its backup holds every acknowledged update.
            new = cfg.but(epoch=cfg.epoch + 1, primary=others[0], in_sync=tuple(others), links=links)
            return self._commit(cfg, new, "") or ""
        # Another copy is primary: this one lost its state, so it leaves the in-sync set until it catches up.
        new = cfg.but(in_sync=tuple(r for r in cfg.in_sync if r != me), links=links)
        return self._commit(cfg, new, "backup")

    def _commit(self, old: PartConfig | None, new: PartConfig, role: str) -> str:
        stored = self.register.swap(old, new)
        if stored is None:
            return ""
        self.config_seen = stored
        return role

    def stop(self) -> None:
        """Close the link and the listener; the threads end. A primary whose job is done tells its backup first,
        which then stops too instead of taking over, and the coordinator, for a copy that starts again later."""
        if self.shard.done.is_set() and self.shard.replicator is self and not self.deposed.is_set():
            self._heartbeat()
            self.register.mark_done(self.copy)
        self._stop.set()
        with self._cond:
            self._drop_backup_locked()
            self._cond.notify_all()
        with contextlib.suppress(OSError):
            self._listener.close()
        for t in self._threads:
            t.join(timeout=5)

    def _thread(self, target: object, name: str) -> None:
        t = threading.Thread(target=target, name=f"shard{self.shard.index}-{name}", daemon=True)  # type: ignore[arg-type]
        t.start()
        self._threads.append(t)

    # -- primary ---------------------------------------------------------------------------------------------------

    def _become_primary(self, complete: bool) -> None:
        """Serve workers (`complete`: this copy took over from its rival, so it holds every acknowledged update)."""
        cfg = self.config_seen
        assert cfg is not None
        log.info("shard %d copy %d: primary (epoch %d)", *self._who(), cfg.epoch)
        self.shard.metrics.primary.set(1)
        self.shard.metrics.backup_in_sync.set(int(self.other in cfg.in_sync))
        self.shard.replicator = self
        standby.take_over(self.shard, complete)
        self._set_ready(True)
        self._thread(self._accept_loop, "replication-accept")
        self._thread(self._watch_backup, "replication-watch")

    def send(self, version: int, parts: Sequence[memoryview | bytes]) -> None:
        """Hand one update to the backup (under the shard's lock, in version order): straight onto the link once
        it is live, else queued (copied) behind the state being sent."""
        with self._cond:
            sock = self._backup
            if sock is None or self._failed:
                return
            total = sum(len(p) for p in parts)
            if not self._live:
                self._queue.append((version, b"".join(parts)))
                self._queued_bytes += total
                if self._queued_bytes > max(MAX_QUEUED_BYTES, 4 * total):
                    self._failed = f"it fell {self._queued_bytes} bytes of updates behind while taking the state"
                    self._cond.notify_all()
                return
            try:
                sock.settimeout(self.timeout + total / MIN_BYTES_PER_S)
                sock.sendall(RECORD + bytes(parts[0]))  # the tag and the record's head in one segment
                for p in parts[1:]:
                    sock.sendall(p)
            except OSError as exc:
                self._failed = f"sending version {version} failed: {exc}"
                self._cond.notify_all()
                return
            self._sent = version
            self._unacked_bytes += total

    def wait_acked(self, version: int, timeout: float) -> bool:
        """Wait until the backup holds `version`, where it must (in the in-sync set, or catching up live);
        NotPrimary once this copy was deposed."""
        with self._cond:
            self._cond.wait_for(
                lambda: self.deposed.is_set() or not self._need_acks or self._acked >= version, timeout=timeout
            )
            if self.deposed.is_set():
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
            cfg = self.config_seen
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
        if self.deposed.is_set():
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
            conn.sendall(SNAPSHOT + _U64.pack(size))
            with open(path, "rb") as f:
                conn.sendfile(f)
        log.info("shard %d copy %d: sent the backup its state (%d bytes)", *self._who(), size)
        # The updates made meanwhile, then live: under the shard's lock no update is in flight.
        while True:
            with self.shard.lock, self._cond:
                if ident != self._backup_id or self._failed:
                    return
                if not self._queue:
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
                (version,) = _U64.unpack(recv_exact(conn, _U64.size))
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
        while not self._stop.is_set() and not self.deposed.is_set():
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
            self._heartbeat()
            cfg = self.config_seen
            if live and cfg is not None and self.other not in cfg.in_sync and acked >= sent:
                if self._change(lambda c: c.but(in_sync=(self.copy, self.other)), "the backup caught up"):
                    self.shard.metrics.backup_in_sync.set(1)

    def _heartbeat(self) -> None:
        with self.shard.lock, self._cond:
            sock = self._backup
            if sock is None or self._failed or not self._live:
                return
            try:
                sock.settimeout(self.timeout)
                cfg = self.config_seen
                flags = IN_SYNC if cfg is not None and self.other in cfg.in_sync else 0
                flags |= DONE if self.shard.done.is_set() else 0
                sock.sendall(HEARTBEAT + _BEAT.pack(self.shard.version, self.shard.finished_workers, flags))
            except OSError as exc:
                self._failed = f"a heartbeat failed: {exc}"
                self._cond.notify_all()

    def _drop_backup_locked(self) -> None:
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
        cfg = self.config_seen
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

    def _change(self, edit: object, why: str) -> bool:
        """Apply `edit` to the configuration as this primary, by compare-and-swap, until it lands; False (and
        deposed) when another copy became primary; retries while the coordinator is unreachable."""
        while not self._stop.is_set():
            try:
                cfg = self.register.read()
                if cfg is None or cfg.primary != self.copy or cfg.epoch != (self.config_seen or cfg).epoch:
                    self._depose(cfg)
                    return False
                stored = self.register.swap(cfg, edit(cfg))  # type: ignore[operator]
            except CoordinatorUnavailable as exc:
                log.warning("shard %d copy %d: cannot reach the coordinator (%s) to record: %s", *self._who(), exc, why)
                time.sleep(min(1.0, self.timeout))
                continue
            if stored is not None:
                self.config_seen = stored
                log.info("shard %d copy %d: %s: in sync %s", *self._who(), why, list(stored.in_sync))
                return True
        return False

    def _depose(self, cfg: PartConfig | None) -> None:
        log.error(
            "shard %d copy %d: deposed: copy %s is primary now (epoch %s); exiting to come back as the backup",
            *self._who(),
            cfg.primary if cfg else None,
            cfg.epoch if cfg else None,
        )
        standby.set_standby(
            self.shard, f"shard {self.shard.index} copy {self.copy} was deposed: its other copy is primary"
        )
        self.shard.metrics.primary.set(0)
        self._set_ready(False)
        self.deposed.set()
        with self._cond:
            self._drop_backup_locked()
            self._cond.notify_all()

    # -- backup ----------------------------------------------------------------------------------------------------

    def _set_ready(self, ready: bool) -> None:
        if ready != self.ready:
            self.ready = ready
            self._on_ready(ready)

    def _become_backup(self) -> None:
        self.shard.metrics.primary.set(0)
        self._set_ready(False)
        standby.set_standby(
            self.shard, f"shard {self.shard.index} copy {self.copy} is the backup; its other copy is the primary"
        )
        self._thread(lambda: self._follower.follow(self.register, self._take_over), "replication-follow")

    def _take_over(self, new: PartConfig, old: PartConfig | None = None) -> bool:
        try:
            stored = self.register.swap(old, new) if old is not None else new
        except CoordinatorUnavailable:
            return False
        if stored is None:
            return False
        self.config_seen = stored
        self.shard.metrics.takeovers.inc()
        log.warning("shard %d copy %d: took over as primary (epoch %d)", *self._who(), stored.epoch)
        self._become_primary(complete=True)
        return True
