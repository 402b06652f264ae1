"""A shard's checkpoints and write-ahead log: when a checkpoint is due, the snapshot it takes, the model a restarted
shard resumes from and the logged updates replayed over it.

The file format and the background writer are paramserver.shard.durability.checkpoint, the log's
paramserver.shard.durability.wal; this module ties them to a shard's state, handed in (it never takes the Shard itself).
"""

from __future__ import annotations

import logging
import time
from collections.abc import Callable, Sequence

import torch

from paramserver.config import ServerConfig
from paramserver.placement import place
from paramserver.shard.claims import Claims
from paramserver.shard.durability import checkpoint, wal
from paramserver.shard.membership import AppliedLog
from paramserver.shard.model import ShardModel, build_model
from paramserver.shard.optimizers import take_run_settings
from paramserver.shard.update import Update, apply_update

log = logging.getLogger(__name__)


class Checkpoints:
    """A shard's checkpoint schedule (every N versions, or every N seconds), its background writer, and its
    write-ahead log (neither without a checkpoint_dir: then nothing is written, but the schedule still runs).

    A consumer of the shard's updates (paramserver.shard.update). With a log, every applied version is logged
    (`logged`) before the pushes it holds are acknowledged (`durable`),
    a checkpoint starts a new log segment, and the segments it covers are deleted once it is on disk."""

    def __init__(self, config: ServerConfig) -> None:
        self.config = config
        self.every_versions, self.every_seconds = config.checkpoint_schedule()
        self.writer = (
            checkpoint.CheckpointWriter(config.checkpoint_dir, on_saved=self._saved) if config.checkpoint_dir else None
        )
        self.wal: wal.WriteAheadLog | None = None
        self._last = time.monotonic()
        self._final_written = False

    # -- the write-ahead log ------------------------------------------------------------------------------------

    def open_log(self, index: int, version: int) -> None:
        """Start logging the versions after `version` (the shard's own, once restored)."""
        if self.config.checkpoint_dir and self.wal is None:
            self.wal = wal.WriteAheadLog(self.config.checkpoint_dir, index, version, self.config.wal_sync == "fsync")

    def close_log(self) -> None:
        """Stop logging (a backup about to take a whole new state from its primary)."""
        if self.wal is not None:
            self.wal.close()
            self.wal = None

    def forget_log(self, index: int, replaced: bool = False) -> None:
        """Delete a log no checkpoint can be replayed under (a shard that restored nothing), or, `replaced`, one a
        state taken from a primary replaces (a backup's)."""
        if self.config.checkpoint_dir:
            for _, path in wal.segments(self.config.checkpoint_dir, index):
                if replaced:
                    log.info("shard %d: %s is replaced by the primary's state: deleted", index, path)
                else:
                    log.warning("shard %d: %s has no checkpoint to replay it over: deleted", index, path)
                path.unlink(missing_ok=True)

    def logged(self, update: Update) -> None:
        """Log what `update` applies (a consumer of the shard's updates: under its lock, in version order, before
        the version shows)."""
        if self.wal is not None:
            self.wal.append(update.version, update.encoded())

    def applied(self, update: Update) -> None:
        """Nothing: a checkpoint is taken when the shard's version shows (Shard.advance_locked)."""

    def log_full(self, model_bytes: int) -> bool:
        """Whether the log has grown past what a checkpoint costs (4x the shard's part, and at least 64 MB): then
        a checkpoint is due, whatever the schedule, so that a restart never replays more than that."""
        return self.wal is not None and self.wal.bytes > max(4 * model_bytes, 64 << 20)

    def wait_durable(self, version: int, timeout: float) -> bool:
        """Wait until `version`'s record is as durable as --wal-sync promises (at once without a log)."""
        return self.wal is None or self.wal.wait_durable(version, timeout)

    def _saved(self, snap: checkpoint.Snapshot) -> None:
        if self.wal is not None:
            self.wal.drop_before(snap.version)

    # -- checkpoints ----------------------------------------------------------------------------------------------

    def due_at(self, version: int) -> bool:
        """Whether applying `version` calls for a checkpoint: the same versions on every shard, so that in sync
        mode a set of shard checkpoints is one consistent model."""
        return bool(self.every_versions) and version % self.every_versions == 0

    def due_now(self) -> bool:
        """Whether the time-based schedule calls for a checkpoint."""
        return bool(self.every_seconds) and time.monotonic() - self._last >= self.every_seconds

    def take(self, snapshot: Callable[[], checkpoint.Snapshot | None]) -> bool:
        """Hand the writer what `snapshot` copies of the shard (None: it holds no model; called under the shard's
        lock, and only where a writer will take it); return whether one was."""
        self._last = time.monotonic()
        snap = snapshot() if self.writer is not None else None
        if self.writer is None or snap is None:
            return False
        if self.wal is not None:
            self.wal.rotate(snap.version)
        self.writer.submit(snap)
        return True

    def flush(self) -> None:
        """Wait until every checkpoint taken so far is on disk."""
        if self.writer is not None:
            self.writer.flush()

    def take_final(self, snapshot: Callable[[], checkpoint.Snapshot | None]) -> bool:
        """Take the one final checkpoint of a closing shard (under its lock); False if taken before or none."""
        if self.writer is None or self._final_written:
            return False
        self._final_written = True
        return self.take(snapshot)

    def close(self) -> None:
        """Write what is queued and stop the writer, then the log."""
        if self.writer is not None:
            self.writer.close()
        if self.wal is not None:
            self.wal.close()


def snapshot(
    model: ShardModel,
    *,
    index: int,
    version: int,
    optimizer: str,
    ever_full: bool,
    applied: AppliedLog,
    finished_workers: int,
    claims: Claims | None = None,
) -> checkpoint.Snapshot:
    """Copy everything needed to resume a shard holding `model` at `version` (under its lock, or on a quiet shard)."""
    state = model.optimizer.state_dict()
    copied = {
        "state": {
            k: {n: v.clone() if isinstance(v, torch.Tensor) else v for n, v in st.items()}
            for k, st in state["state"].items()
        },
        "param_groups": [dict(g) for g in state["param_groups"]],
    }
    return checkpoint.Snapshot(
        shard_index=index,
        num_shards=model.placement.num_shards,
        specs=model.placement.specs,
        digest=model.digest,
        version=version,
        optimizer=optimizer,
        params=model.params.detach().clone(),
        optimizer_state=copied,
        ever_full=ever_full,
        applied=applied.dump(),
        finished_workers=finished_workers,
        table_specs=model.placement.tables,
        tables=model.tables.snapshot(),
        claims=claims.dump() if claims is not None and claims.dataset else {},
    )


def restored(
    config: ServerConfig, index: int, addresses: Sequence[str]
) -> tuple[ShardModel, checkpoint.Snapshot] | None:
    """The model of shard `index`'s newest valid checkpoint in checkpoint_dir, and the snapshot it came from (None:
    no checkpoint). ValueError for one this job cannot resume: another shard count, another optimizer."""
    if not config.checkpoint_dir:
        return None
    snap = checkpoint.load_latest(config.checkpoint_dir, index)
    if snap is None:
        log.info("shard %d: no checkpoint in %s, starting empty", index, config.checkpoint_dir)
        return None
    if snap.num_shards != len(addresses):
        raise ValueError(
            f"the checkpoint in {config.checkpoint_dir} was written by a job of {snap.num_shards} shards, "
            f"this one has {len(addresses)}; use another --checkpoint-dir"
        )
    return model_of(config, index, snap), snap


def model_of(config: ServerConfig, index: int, snap: checkpoint.Snapshot) -> ShardModel:
    """The model a snapshot holds (a checkpoint, or the state a backup received from its primary); ValueError
    where this shard cannot hold it."""
    if snap.optimizer != config.optimizer:
        raise ValueError(
            f"the checkpoint in {config.checkpoint_dir} holds {snap.optimizer} state, but this shard runs "
            f"--optimizer {config.optimizer}; use the same optimizer or another --checkpoint-dir"
        )
    placement = place(snap.specs, snap.num_shards, tables=snap.table_specs)
    if placement.digest != snap.digest or snap.shard_index != index:
        raise ValueError(f"the snapshot of shard {snap.shard_index} does not match shard {index}'s placement digest")
    model = build_model(placement, index, config)
    model.params.copy_(snap.params)
    snap.params = torch.empty(0)  # copied: not held beside the model's own while the restore goes on
    model.optimizer.load_state_dict(snap.optimizer_state)
    model.tables.restore(snap.tables)
    take_run_settings(model.optimizer, config)  # the flags of this run win over the saved hyperparameters
    return model


def replay(
    config: ServerConfig, index: int, model: ShardModel, applied: AppliedLog, after: int, claims: Claims | None = None
) -> int:
    """Apply shard `index`'s logged versions after `after` to `model` (restored from the checkpoint of `after`)
    through `apply_update`, as they first applied, recording their pushes in `applied` (and the dataset claims
    they changed in `claims`); return the version reached. A record of another model's size ends the replay."""
    version = after
    if not config.checkpoint_dir:
        return version
    for update in wal.records(config.checkpoint_dir, index, after):
        try:
            apply_update(model, update, config.lr_at)
        except ValueError as exc:
            log.error("shard %d: the log does not fit the model: %s", index, exc)
            break
        for worker_id, step in update.pushes:
            applied.record(worker_id, step)
        if claims is not None:
            claims.apply_events(update.claims)
        version = update.version
    if version > after:
        log.info("shard %d: replayed versions %d..%d from the write-ahead log", index, after + 1, version)
    return version
