"""What a shard holds and what it refused, as plain values (for Topology, logs, metrics and tests)."""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass
from typing import TYPE_CHECKING

import torch

from paramserver.placement import TensorSpec
from paramserver.tables import TableSpec

if TYPE_CHECKING:
    from paramserver.shard.model import ShardModel


@dataclass
class ShardStats:
    """Counters of what a shard refused or dropped (for logs, metrics and tests)."""

    late_pushes: int = 0  # pushes for a round that had closed (stragglers with backup workers, or slow workers)
    duplicate_pushes: int = 0  # retried (worker, step) pairs taken once, not applied again
    evictions: int = 0  # workers whose lease ran out
    checkpoints: int = 0  # snapshots handed to the writer


@dataclass(frozen=True)
class ShardStatus:
    """What a shard holds, at one instant."""

    initialized: bool
    digest: str
    specs: tuple[TensorSpec, ...]
    version: int
    live_workers: int
    stats: ShardStats
    tables: tuple[TableSpec, ...] = ()
    table_rows: tuple[int, ...] = ()  # rows this shard holds, per table


def describe(model: ShardModel | None, version: int, live_workers: int, stats: ShardStats) -> ShardStatus:
    """What a shard holding `model` at `version` holds now (call under its lock, for one consistent answer)."""
    return ShardStatus(
        initialized=model is not None,
        digest=model.digest if model else "",
        specs=model.placement.specs if model else (),
        version=version,
        live_workers=live_workers,
        stats=dataclasses.replace(stats),
        tables=model.placement.tables if model else (),
        table_rows=tuple(t.rows for t in model.tables.tables) if model else (),
    )


def state_bytes(model: ShardModel | None, version: int) -> bytes:
    """Weights, optimizer state and version as bytes (call under the shard's lock): equal before and after a
    request shows that it changed nothing."""
    parts = [str(version).encode()]
    if model is not None:
        parts.append(model.params.numpy().tobytes())
        for state in model.optimizer.state.values():
            for key in sorted(state):
                value = state[key]
                parts.append(value.numpy().tobytes() if isinstance(value, torch.Tensor) else repr(value).encode())
        parts.append(model.tables.state_bytes())
    return b"|".join(parts)
