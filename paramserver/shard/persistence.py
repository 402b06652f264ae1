"""A shard's checkpoints: when one is due, the snapshot it takes, and the model a restarted shard resumes from.

The file format and the background writer are paramserver.shard.checkpoint; this module ties them to a Shard.
"""

from __future__ import annotations

import logging
import time
from collections.abc import Sequence
from typing import TYPE_CHECKING

import torch

from paramserver.config import ServerConfig
from paramserver.placement import place
from paramserver.shard import checkpoint
from paramserver.shard.model import ShardModel, build_model
from paramserver.shard.optimizers import take_run_settings

if TYPE_CHECKING:
    from paramserver.shard.state import Shard

log = logging.getLogger(__name__)


class Checkpoints:
    """A shard's checkpoint schedule (every N versions, or every N seconds) and its background writer (none
    without a checkpoint_dir: then nothing is written, but the schedule still runs)."""

    def __init__(self, config: ServerConfig) -> None:
        self.every_versions, self.every_seconds = config.checkpoint_schedule()
        self.writer = checkpoint.CheckpointWriter(config.checkpoint_dir) if config.checkpoint_dir else None
        self._last = time.monotonic()
        self._final_written = False

    def due_at(self, version: int) -> bool:
        """Whether applying `version` calls for a checkpoint: the same versions on every shard, so that in sync
        mode a set of shard checkpoints is one consistent model."""
        return bool(self.every_versions) and version % self.every_versions == 0

    def due_now(self) -> bool:
        """Whether the time-based schedule calls for a checkpoint."""
        return bool(self.every_seconds) and time.monotonic() - self._last >= self.every_seconds

    def take(self, shard: Shard) -> bool:
        """Hand a snapshot of `shard` to the writer (call under the shard's lock); return whether one was."""
        self._last = time.monotonic()
        if self.writer is None or shard.model is None:
            return False
        self.writer.submit(snapshot(shard))
        return True

    def take_final(self, shard: Shard) -> bool:
        """Take the one final checkpoint of a closing shard (under its lock); False if taken before or none."""
        if self.writer is None or shard.model is None or self._final_written:
            return False
        self._final_written = True
        return self.take(shard)

    def close(self) -> None:
        """Write what is queued and stop the writer."""
        if self.writer is not None:
            self.writer.close()


def snapshot(shard: Shard) -> checkpoint.Snapshot:
    """Copy everything needed to resume (call under the shard's lock, or on a quiet shard)."""
    model = shard.require_model()
    state = model.optimizer.state_dict()
    copied = {
        "state": {
            k: {n: v.clone() if isinstance(v, torch.Tensor) else v for n, v in st.items()}
            for k, st in state["state"].items()
        },
        "param_groups": [dict(g) for g in state["param_groups"]],
    }
    return checkpoint.Snapshot(
        shard_index=shard.index,
        num_shards=model.placement.num_shards,
        specs=model.placement.specs,
        digest=model.digest,
        version=shard.version,
        optimizer=shard.config.optimizer,
        params=model.params.detach().clone(),
        optimizer_state=copied,
        ever_full=shard.membership.ever_full,
        applied=shard.applied.dump(),
        finished_workers=shard.finished_workers,
        table_specs=model.placement.tables,
        tables=model.tables.snapshot(),
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
    if snap.optimizer != config.optimizer:
        raise ValueError(
            f"the checkpoint in {config.checkpoint_dir} holds {snap.optimizer} state, but this shard runs "
            f"--optimizer {config.optimizer}; use the same optimizer or another --checkpoint-dir"
        )
    placement = place(snap.specs, snap.num_shards, tables=snap.table_specs)
    if placement.digest != snap.digest:
        raise ValueError(f"the checkpoint of shard {index} does not match its own placement digest")
    model = build_model(placement, index, config)
    model.params.copy_(snap.params)
    model.optimizer.load_state_dict(snap.optimizer_state)
    model.tables.restore(snap.tables)
    take_run_settings(model.optimizer, config)  # the flags of this run win over the saved hyperparameters
    return model, snap
