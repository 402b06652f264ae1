"""ps-reshard's reading of the source set: every shard's newest checkpoint, brought to its newest logged version
by replaying its write-ahead log through the same optimizer (as a restarted shard does), and checked to be one
model's set of N shards. It only reads the source directory."""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from paramserver.config import ServerConfig
from paramserver.placement import place
from paramserver.shard.claims import Claims
from paramserver.shard.durability import checkpoint, persistence, wal
from paramserver.shard.durability.checkpoint import Snapshot
from paramserver.shard.membership import AppliedLog


class ReshardError(ValueError):
    """A checkpoint set that cannot be resharded as asked (what is wrong, in one sentence)."""


@dataclass
class Part:
    """One source shard's state at its newest version."""

    snap: Snapshot
    replayed: int


# -- reading the source set --------------------------------------------------------------------------------------


def replay_config(snap: Snapshot, source: Path, config: ServerConfig | None) -> ServerConfig:
    """The config a source shard's log is replayed under: the caller's (as a restarted shard, its flags win over
    the saved hyperparameters), or else the hyperparameters saved in the checkpoint and the defaults for the rest."""
    if config is not None:
        return config.replace(checkpoint_dir=str(source))
    groups = snap.optimizer_state.get("param_groups") or [{}]
    group = groups[0]
    changes: dict[str, Any] = {"optimizer": snap.optimizer, "checkpoint_dir": str(source)}
    for key in ("lr", "weight_decay"):
        if isinstance(group.get(key), int | float):
            changes[key] = float(group[key])
    if snap.optimizer == "momentum" and isinstance(group.get("momentum"), int | float):
        changes["momentum"] = float(group["momentum"])
    # --no-weight-decay: the group's own weight_decay is 0, the job's decay and its exempt patterns beside it
    if isinstance(group.get("masked_weight_decay"), int | float) and isinstance(group.get("no_weight_decay"), str):
        changes["weight_decay"] = float(group["masked_weight_decay"])
        changes["no_weight_decay"] = group["no_weight_decay"]
    return ServerConfig(**changes)


def _has_log(source: Path, index: int, after: int) -> bool:
    """Whether shard `index` logged a version after `after` (reads only the first such record)."""
    return next(iter(wal.records(source, index, after)), None) is not None


def _replayed(source: Path, index: int, num_shards: int, version: int, config: ServerConfig) -> Part:
    """Shard `index` at its newest logged version: its checkpoint of `version` with its write-ahead log replayed over
    it through the same optimizer (persistence.restored and replay, as a restarted shard does). Reads, never writes,
    `source`."""
    try:
        found = persistence.restored(config, index, ["-"] * num_shards)
    except ValueError as exc:
        raise ReshardError(str(exc)) from None
    if found is None or found[1].version != version:
        raise ReshardError(f"the checkpoints of shard {index} in {source} changed while they were read")
    model, snap = found
    applied = AppliedLog.restore(snap.applied)
    claims = Claims.restore(snap.claims)  # shard 0's dataset claims (ps-worker --follow), as of the last record
    reached = persistence.replay(config, index, model, applied, version, claims)
    state = model.optimizer.state_dict()
    after = dataclasses.replace(
        snap,
        version=reached,
        params=model.params.detach(),
        optimizer_state={"state": state["state"], "param_groups": state["param_groups"]},
        applied=applied.dump(),
        tables=model.tables.snapshot(),
        claims=claims.dump() if claims.dataset else {},
    )
    return Part(after, reached - version)


def read_source(source: Path, config: ServerConfig | None) -> list[Part]:
    """Every source shard's newest checkpoint, brought to its newest logged version; ReshardError for a set that
    is not one model's set of N shards."""
    if not source.is_dir():
        raise ReshardError(f"{source} is not a directory")
    first = checkpoint.load_latest(source, 0)
    if first is None:
        raise ReshardError(f"{source} holds no valid checkpoint of shard 0")
    n = first.num_shards
    if checkpoint.list_checkpoints(source, n):
        raise ReshardError(
            f"{source} holds checkpoints of shard {n}, but shard 0's say the job had {n} shards (0..{n - 1}): "
            "it mixes the sets of two jobs"
        )
    if place(first.specs, n, tables=first.table_specs).digest != first.digest:
        raise ReshardError(f"the checkpoint of shard 0 in {source} does not match its own placement digest")
    expect = (first.digest, first.optimizer, first.specs, first.table_specs)
    parts: list[Part] = []
    pending: Snapshot | None = first
    del first  # shard 0's part may be replaced by its replayed state: hold no other reference to it
    for k in range(n):
        snap = pending if k == 0 else checkpoint.load_latest(source, k)
        pending = None
        if snap is None:
            raise ReshardError(f"{source} holds no valid checkpoint of shard {k}, and the set is of {n} shards")
        if snap.num_shards != n:
            raise ReshardError(
                f"shard {k}'s checkpoint in {source} was written by a job of {snap.num_shards} shards, shard 0's by "
                f"one of {n}: it mixes the sets of two jobs"
            )
        if (snap.digest, snap.optimizer, snap.specs, snap.table_specs) != expect:
            raise ReshardError(
                f"shard {k}'s checkpoint in {source} describes another model or optimizer than shard 0's: it mixes "
                "the sets of two jobs"
            )
        if not _has_log(source, k, snap.version):
            parts.append(Part(snap, 0))
            continue
        # restored() reads the checkpoint again, to build the shard's model from it: drop this copy first.
        version, cfg = snap.version, replay_config(snap, source, config)
        snap = None
        parts.append(_replayed(source, k, n, version, cfg))
    return parts
