"""A replicated shard's copy as paramserver.server.replica drives it: taking the primary's whole state, applying the
updates it streams (each logged first), standing by (workers refused with NotPrimary) and taking over.

Functions of the Shard they act on, under its lock: the replication link owns when each happens; the shard owns
its state."""

from __future__ import annotations

from collections.abc import Sequence
from typing import TYPE_CHECKING

from paramserver.shard import persistence, wal
from paramserver.shard.checkpoint import Snapshot
from paramserver.shard.membership import AppliedLog

if TYPE_CHECKING:
    from paramserver.shard.state import Shard


def install(shard: Shard, snap: Snapshot) -> None:
    """Take the state a primary sent (a backup catching up): the model, the applied pushes and the version,
    replacing whatever this copy held. With a checkpoint_dir the snapshot is already this copy's newest
    checkpoint (the caller saved it there) and the log starts after it."""
    model = persistence.model_of(shard.config, shard.index, snap)
    with shard.lock:
        shard.adopt_locked(model, snap.version)
        shard.applied = AppliedLog.restore(snap.applied)
        shard.finished_workers = snap.finished_workers
        shard.metrics.version.set(shard.version)
        shard.checkpoints.close_log()
        shard.checkpoints.forget_log(shard.index, replaced=True)
        shard.checkpoints.open_log(shard.index, shard.version)


def apply_record(shard: Shard, rec: wal.Record, parts: Sequence[memoryview | bytes]) -> None:
    """Apply one update a primary streamed (a backup), logging it first; ValueError where it does not follow
    this copy's version or fit its model."""
    with shard.lock:
        model = shard.model
        if model is None:
            raise ValueError("an update before the state it applies to")
        if rec.version != shard.version + 1:
            raise ValueError(f"an update to version {rec.version} for a copy at version {shard.version}")
        shard.checkpoints.log(rec.version, parts)
        if not persistence.apply_logged(shard, model, rec):
            raise ValueError(f"the update to version {rec.version} does not fit this copy's model")
        shard.advance_locked(rec.version, model)


def set_standby(shard: Shard, why: str) -> None:
    """Refuse workers from now on with NotPrimary(why) (empty: serve them); every waiting pull is told."""
    with shard.lock:
        shard.standby = why
        if why:
            shard.attachments.clear()
        shard.lock.notify_all()


def take_over(shard: Shard, complete: bool) -> None:
    """Serve workers as the part's primary (`complete`: this copy holds every acknowledged update, as a backup
    that took over does). In sync mode the first round waits for the job's workers to join here, as after a
    restore."""
    with shard.lock:
        shard.replicated = complete
        if shard.model is not None:
            shard.membership.rejoin_all(shard.finished_workers)
            shard.policy.reset(shard.model.numel)
        shard.standby = ""
        shard.lock.notify_all()
