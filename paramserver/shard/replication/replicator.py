"""What a primary's shard hands its updates to besides its own log: its backup, through the replication link
(paramserver.server.replica_leader implements `Replicator`; paramserver.server.replica_outbox's `Forward` is a
`Forwarded`), and `ReplicaFeed`, the consumer of the shard's updates that hands them over. The shard knows only
these shapes, so paramserver.shard never imports the server package."""

from __future__ import annotations

from collections.abc import Sequence
from typing import TYPE_CHECKING, Protocol

import numpy as np

from paramserver.shard.durability import wal

if TYPE_CHECKING:
    from paramserver.shard.update import Update


class Forwarded(Protocol):
    """A push on its way to the backup while it arrives (paramserver.server.replica_outbox.Forward)."""

    def advance(self, ready: int) -> None:
        """Bytes [0, ready) of the push are final."""

    def complete(self) -> None:
        """The whole push is final."""

    def wait_sent(self) -> bool:
        """Wait until its memory is no longer read (it may change after)."""
        return True

    def abort(self) -> None:
        """It will not apply: the backup drops it."""


class Replicator(Protocol):
    """Where a primary's updates go besides its own log: its backup (paramserver.server.replica_leader)."""

    def send(self, version: int, parts: Sequence[memoryview | bytes]) -> None:
        """Hand over one encoded update (under the shard's lock, in version order, before the version shows)."""

    def forward(self, data: memoryview) -> Forwarded | None:
        """Start sending a push's bytes (a flat float32 gradient, as bytes) as they become final; None where the
        backup cannot take it (none live)."""
        return None

    def send_forwarded(self, version: int, forwards: Sequence[Forwarded], parts: Sequence[memoryview | bytes]) -> bool:
        """Like `send`, for an update whose gradient is the `forwards` combined as a round combines pushes (their
        mean, in order): `parts` is its record without the gradient. False where they cannot name it (another
        connection since): then `send` the whole record."""
        return False

    def wait_acked(self, version: int, timeout: float) -> bool:
        """Wait until every copy that must hold `version` does; False after `timeout` seconds."""
        return True


_NO_GRAD = np.empty(0, dtype=np.float32)  # the gradient of a record whose pushes the backup has (forwarded)


class ReplicaFeed:
    """The consumer of a primary's updates that hands each to its backup (paramserver.shard.update.Consumer):
    before it applies, under the shard's lock, in version order."""

    def __init__(self, replicator: Replicator) -> None:
        self.replicator = replicator

    def logged(self, update: Update) -> None:
        # The backup has every push of this update already (or is receiving them): name them, so only the record's
        # head and rows travel now. Their mean is what a round applies (see SyncPolicy).
        named = [f for f in update.forwards if f is not None]
        if (
            not update.pushes
            or len(named) != len(update.pushes)
            or not self.replicator.send_forwarded(
                update.version,
                named,
                wal.encode(update.version, update.pushes, _NO_GRAD, update.rows, update.wall, update.claims),
            )
        ):
            self.replicator.send(update.version, update.encoded())

    def applied(self, update: Update) -> None:
        """Nothing: the backup acknowledges through `Replicator.wait_acked`."""
