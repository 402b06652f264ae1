"""What a primary's shard hands its updates to besides its own log: its backup, through the replication link
(paramserver.server.replica_leader implements `Replicator`; paramserver.server.replica_outbox's `Forward` is a
`Forwarded`). The shard knows only these shapes, so paramserver.shard never imports the server package."""

from __future__ import annotations

from collections.abc import Sequence
from typing import Protocol


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
