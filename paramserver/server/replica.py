"""Hot standby (`--replicas 2`): one shard's two copies, the primary streaming every update to its backup.

Roles live in the coordinator (paramserver.coord: the primary, the in-sync copies, the epoch), changed only by
compare-and-swap. The primary serves workers; the backup refuses them (NotPrimary, so they try the other copy).

The stream is chain replication with a chain of two: the primary hands each update, exactly as its write-ahead
log encodes it (paramserver.shard.durability.wal), to the backup over a TCP connection, under the shard's lock
and in version order; the backup logs and applies it and answers with the version. While the backup is in the in-sync
set, a push is acknowledged only once the backup has answered for the version holding it, so every acknowledged update
is on both copies. The primary's end of the link is paramserver.server.replica_leader's; the messages and the
backup's end are paramserver.server.replica_stream's.

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

import logging
import socket
import threading
import time
from collections.abc import Callable

from paramserver.coord import CoordinatorUnavailable, Etcd, PartConfig, PartRegister
from paramserver.security import client_ssl_context, read_token, server_ssl_context
from paramserver.server import standby
from paramserver.server.replica_leader import Edit, Leader
from paramserver.server.replica_stream import Follower
from paramserver.shard.state import Shard

log = logging.getLogger(__name__)

DEPOSED_EXIT = 3  # the status a deposed primary's process exits with, to come back as the backup


class Replication:
    """One copy of a replicated shard: its role, found and changed in the coordinator. The primary's end of the
    link (the shard's Replicator) is a Leader, the backup's a Follower."""

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
        listener = socket.create_server((host, self.config.replication_port))
        self.link = f"{advertise_host}:{listener.getsockname()[1]}"
        self._token = read_token(self.config.auth_token_file) if self.config.auth_token_file else ""
        c = self.config
        server_tls = server_ssl_context(c.tls_cert, c.tls_key, c.tls_ca)
        self._client_tls = client_ssl_context(c.tls_ca, c.tls_cert, c.tls_key) if c.tls_cert else None
        if self._client_tls is not None:
            self._client_tls.check_hostname = False  # the CA vouches for a shard of this job; addresses vary
        self.config_seen: PartConfig | None = None
        self.deposed = threading.Event()  # set once this process must exit DEPOSED_EXIT
        self._stop = threading.Event()
        self._threads: list[threading.Thread] = []
        # The primary's end of the link (paramserver.server.replica_leader), which records what it decides about
        # the backup through `_change`: only the role writes the configuration.
        self._leader = Leader(
            shard,
            copy,
            listener,
            self._token,
            server_tls,
            self._stop,
            self.deposed,
            lambda: self.config_seen,
            self._change,
        )
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
        if self.shard.done.is_set() and self.shard.replicator is self._leader and not self.deposed.is_set():
            self._leader.heartbeat(wait=True)
            self.register.mark_done(self.copy)
        self._stop.set()
        self._leader.close()
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
        self.shard.replicator = self._leader
        standby.take_over(self.shard, complete)
        self._set_ready(True)
        self._leader.start()

    def _change(self, edit: Edit, why: str) -> bool:
        """Apply `edit` to the configuration as this primary, by compare-and-swap, until it lands; False (and
        deposed) when another copy became primary; retries while the coordinator is unreachable."""
        while not self._stop.is_set():
            try:
                cfg = self.register.read()
                if cfg is None or cfg.primary != self.copy or cfg.epoch != (self.config_seen or cfg).epoch:
                    self._depose(cfg)
                    return False
                stored = self.register.swap(cfg, edit(cfg))
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
        self._leader.disconnect()

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
