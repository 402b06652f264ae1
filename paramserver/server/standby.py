"""A replicated shard's copy as paramserver.server.replica drives it: taking the primary's whole state, applying the
updates it streams (each logged first) and holding the pushes it forwards until an update names them, standing by
(workers refused with NotPrimary) and taking over.

Functions of the Shard they act on, under its lock: the replication link owns when each happens; the shard owns
its state."""

from __future__ import annotations

from collections.abc import Callable, Sequence
from typing import TYPE_CHECKING

import numpy as np
import torch

from paramserver.shard.claims import Claims
from paramserver.shard.durability import persistence
from paramserver.shard.durability.checkpoint import Snapshot
from paramserver.shard.membership import AppliedLog
from paramserver.shard.update import Update

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
        shard.claims = Claims.restore(snap.claims)
        shard.metrics.version.set(shard.version)
        shard.checkpoints.close_log()
        shard.checkpoints.forget_log(shard.index, replaced=True)
        shard.checkpoints.open_log(shard.index, shard.version)


def apply_record(shard: Shard, update: Update, parts: Sequence[memoryview | bytes]) -> None:
    """Apply one update a primary streamed (a backup) as the shard applies its own (`Shard.commit_locked`: logged
    first, as the bytes `parts` that arrived); ValueError where it does not follow this copy's version or fit its
    model."""
    with shard.lock:
        if shard.model is None:
            raise ValueError("an update before the state it applies to")
        if update.version != shard.version + 1:
            raise ValueError(f"an update to version {update.version} for a copy at version {shard.version}")
        update.set_encoded(parts)
        shard.commit_locked(update, record_pushes=True)


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
            shard.claims.hold_off(shard.config.lease_timeout)  # claims the primary had not streamed: re-asserted
        shard.standby = ""
        shard.lock.notify_all()


class HeldPushes:
    """The pushes a primary forwarded while they arrived, held until the update naming them applies: one buffer of
    the model's size each (reused), filled piece by piece in order."""

    def __init__(self, shard: Shard, limit: int) -> None:
        self.shard = shard
        self.limit = limit
        self._held: dict[int, tuple[np.ndarray, int]] = {}  # id -> (buffer, bytes received)
        self._free: list[np.ndarray] = []

    def clear(self) -> None:
        """Drop every held push (a new connection: ids are the connection's)."""
        for ident in list(self._held):
            self.drop(ident)

    def receive(self, ident: int, offset: int, n: int, read_into: Callable[[memoryview], object]) -> None:
        """Take bytes [offset, offset + n) of forwarded push `ident` (pieces come in order), read by `read_into`
        straight into its buffer; ValueError for a piece out of step or a push past the limit."""
        if ident not in self._held:
            model = self.shard.model
            if model is None:
                raise ValueError("a forwarded push before the state it applies to")
            if len(self._held) >= self.limit:
                raise ValueError(f"more than {self.limit} forwarded pushes held at once")
            buf = self._free.pop() if self._free and self._free[-1].size == model.numel else None
            self._held[ident] = (buf if buf is not None else np.empty(model.numel, np.float32), 0)
        buf, got = self._held[ident]
        view = buf.data.cast("B")
        if offset != got or offset + n > len(view):
            raise ValueError(f"a piece [{offset}, {offset + n}) of forwarded push {ident}, which has {got} bytes")
        read_into(view[offset : offset + n])
        self._held[ident] = (buf, got + n)

    def drop(self, ident: int) -> None:
        """Let go of a push (dropped by the primary, or applied); its buffer serves the next one."""
        held = self._held.pop(ident, None)
        if held is not None and len(self._free) < 4:  # kept for the next pushes: a fresh one faults in its pages
            self._free.append(held[0])

    def combine(self, ids: list[int]) -> np.ndarray:
        """The pushes' mean, computed as the primary's round computed it (SyncPolicy: the first, plus each other in
        order, divided by their count), so the two copies apply bit-identical gradients."""
        bufs = []
        for ident in ids:
            buf, got = self._held.get(ident, (None, 0))
            if buf is None or got != buf.nbytes:
                raise ValueError(f"an update names forwarded push {ident}, which is not here whole")
            bufs.append(buf)
        if len(bufs) == 1:
            return bufs[0]
        total = torch.from_numpy(bufs[0])
        for buf in bufs[1:]:
            total.add_(torch.from_numpy(buf))
        total.div_(len(bufs))
        return bufs[0]

    def release(self, ids: list[int]) -> None:
        """Let go of the pushes an update applied."""
        for ident in ids:
            self.drop(ident)
