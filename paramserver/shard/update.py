"""One update: a version's whole effect on a shard, the one function that applies it, and the consumers hooked
around that apply.

An `Update` is what a version changes: the flat gradient the optimizer gets (a sync round's mean, once), the row
gradients of the sparse tables, the (worker, step) pushes it holds and when it applied. Every path that changes a
shard's model goes through `apply_update`: the live apply (the consistency policy closing a round or taking an
async push), the write-ahead log's replay after a restart, and a backup applying what its primary streams. So the
copies end bit-identical: the same gradient through the same optimizer at the rate of the same version.

Whatever else must see each update is a `Consumer`, hooked around the apply in the order it was added:
`logged(update)` runs before the update applies and before its version shows (the write-ahead log, the replica
link: nothing may be acknowledged that they lack), `applied(update)` once the version shows (metrics, publication
to serving copies). Consumers run under the shard's lock, in version order; one that can fall behind (a serving
copy) keeps a bounded record of its own and never waits there.
"""

from __future__ import annotations

import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any, Protocol

import numpy as np
import torch

from paramserver.shard.model import ShardModel
from paramserver.shard.sparse.row_blocks import RowBlock

if TYPE_CHECKING:
    from paramserver.shard.replication.replicator import Forwarded


@dataclass
class Update:
    """One version's whole effect. `grad` may be empty in a record a backup gets without its gradient (the pushes
    it was forwarded stand for it); every other field is what the write-ahead log keeps."""

    version: int
    pushes: list[tuple[str, int]]  # the (worker_id, step) pushes this update holds
    grad: np.ndarray  # flat float32: what the optimizer gets (a buffer's elements carry values: ShardModel.step)
    rows: list[RowBlock]  # each table's unique IDs and their summed row gradients
    wall: float  # when it first applied (time.time()): the rows' last update time, for age-based eviction
    # The dataset claims changed since the previous update (paramserver.shard.claims events; shard 0 of a
    # --follow job): logged and replicated with it, applied by whoever applies it.
    claims: list[dict[str, Any]] = field(default_factory=list)
    # Live only (never logged): how the update came to be, for the consumers that report or forward it.
    forwards: list[Forwarded | None] = field(default_factory=list)  # per push: its bytes on the way to the backup
    waited: float | None = None  # how long the round was open
    staleness: int | None = None  # versions between the push's base and this one (async, ssp)
    straggler: int | None = None  # the rank of the worker whose push closed the round
    started: float = field(default_factory=time.perf_counter)
    _encoded: list[memoryview | bytes] | None = field(default=None, repr=False)

    def encoded(self) -> list[memoryview | bytes]:
        """The record as the log writes and the replica link streams it (paramserver.shard.durability.wal.encode), made
        once however many consumers ask."""
        if self._encoded is None:
            from paramserver.shard.durability import wal  # wal decodes into Updates: imported late, not in a circle

            self._encoded = wal.encode(self.version, self.pushes, self.grad, self.rows, self.wall, self.claims)
        return self._encoded

    def set_encoded(self, parts: Sequence[memoryview | bytes]) -> None:
        """Take the record's bytes as they arrived (a backup logs what its primary sent, not a re-encoding)."""
        self._encoded = list(parts)


def apply_update(model: ShardModel, update: Update, lr_at: Callable[[int], float]) -> None:
    """Apply `update` to `model`: the optimizer's step on the dense part at the rate of the version it makes, then
    the tables' rows. Deterministic on the CPU, so a replay or a backup reaches exactly the state the live apply
    did. ValueError (nothing applied) for an update of another model's size."""
    if update.grad.size != model.numel:
        raise ValueError(f"version {update.version} has {update.grad.size} elements, the model {model.numel}")
    grad = update.grad if update.grad.flags.writeable else update.grad.copy()
    model.step(torch.from_numpy(grad), lr_at(update.version))
    if model.tables:
        rows = [b if _writeable(b) else RowBlock(b.table, b.ids.copy(), _copy(b.values)) for b in update.rows]
        model.tables.apply(rows, update.version, update.wall)


def _writeable(block: RowBlock) -> bool:
    """Whether a block's arrays may go to torch as they are (a replayed record's are views of the mapped log)."""
    return bool(block.ids.flags.writeable and (block.values is None or block.values.flags.writeable))


def _copy(values: np.ndarray | None) -> np.ndarray | None:
    return None if values is None else values.copy()


class Consumer(Protocol):
    """Something that must see every update of a shard, in version order, under its lock."""

    def logged(self, update: Update) -> None:
        """Before `update` applies and before its version shows: keep what acknowledging it needs."""

    def applied(self, update: Update) -> None:
        """Once `update` applied and its version shows."""


class Consumers:
    """A shard's consumers of updates, run in the order added."""

    def __init__(self) -> None:
        self._all: list[Consumer] = []

    def add(self, consumer: Consumer, after: Consumer | None = None) -> None:
        """Hook `consumer` in last, or right after `after`."""
        if consumer in self._all:
            return
        at = self._all.index(after) + 1 if after is not None and after in self._all else len(self._all)
        self._all.insert(at, consumer)

    def remove(self, consumer: Consumer) -> None:
        if consumer in self._all:
            self._all.remove(consumer)

    def logged(self, update: Update) -> None:
        for c in self._all:
            c.logged(update)

    def applied(self, update: Update) -> None:
        for c in self._all:
            c.applied(update)


class PendingPushes:
    """The (worker, step) pushes the next update will hold, in the order taken, and those of them forwarded to the
    backup as they arrived."""

    def __init__(self) -> None:
        self._pushes: list[tuple[str, int]] = []
        self._forwards: dict[tuple[str, int], Forwarded] = {}

    def add(self, key: tuple[str, int], forward: Forwarded | None) -> None:
        self._pushes.append(key)
        if forward is not None:
            self._forwards[key] = forward

    def forget(self, key: tuple[str, int]) -> None:
        """Take a push out (its submit failed; the caller aborts its forward)."""
        if key in self._pushes:
            self._pushes.remove(key)
        self._forwards.pop(key, None)

    def drop(self) -> None:
        """The open round is dropped unapplied: the backup drops its forwarded pushes too."""
        forwards, self._forwards, self._pushes = self._forwards, {}, []
        for f in forwards.values():
            f.abort()

    def take(self) -> tuple[list[tuple[str, int]], list[Forwarded | None]]:
        """The pushes and, for each, its forward (None: not forwarded), for the update about to apply; empty after."""
        pushes, forwards = self._pushes, self._forwards
        self._pushes, self._forwards = [], {}
        return pushes, [forwards.get(p) for p in pushes]
