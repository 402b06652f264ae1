"""Publication to serving copies: which rows the recent versions wrote, so that a copy following the shard (ps-serve)
asks for the changes since the version it holds and gets only those rows, read at the shard's current version.

A consumer of the shard's updates (paramserver.shard.update): once a copy has asked, `applied` notes each version's
written IDs per table, newest last, within a bound on bytes; older versions fall off. A copy that asks about a
version the record no longer covers is answered from the rows' own last-update versions (a scan of the tables:
slower, never wrong), and a copy never makes the shard wait: it asks, it is never pushed to. So a slow or dead copy
costs training nothing and the primary's memory for followers is this record's bound, however many copies follow.
"""

from __future__ import annotations

from collections import deque

import numpy as np

from paramserver.shard.update import Update

DEFAULT_LIMIT_BYTES = 32 << 20  # about 4 M IDs: seconds of a fast job's updates, minutes of a slow one's


class Publication:
    """The IDs each recent version wrote, per table (no values: those are read when a copy asks)."""

    def __init__(self, tables: int, version: int, limit_bytes: int = DEFAULT_LIMIT_BYTES) -> None:
        self.tables = tables
        self.limit_bytes = limit_bytes
        self._floor = version  # changes after this version are all recorded
        # Nothing is recorded until a copy first asks: a job that no copy follows pays nothing per update.
        self._active = False
        self._versions: deque[tuple[int, float, list[tuple[int, np.ndarray]]]] = deque()  # version, wall, IDs
        self._bytes = 0

    @property
    def floor(self) -> int:
        """The oldest version whose later changes are all here."""
        return self._floor

    def reset(self, version: int) -> None:
        """Forget every recorded version: the shard now holds `version` by other means (a restore's replay)."""
        self._versions.clear()
        self._bytes = 0
        self._floor = version

    def logged(self, update: Update) -> None:
        """Nothing before an update applies: a copy reads only versions that show."""

    def applied(self, update: Update) -> None:
        """Note the IDs `update` wrote (copied: a push's blocks are views of buffers reused later), once a copy
        follows."""
        if not self._active:
            self._floor = update.version  # what a first question is answered from
            return
        written = [(b.table, b.ids.copy()) for b in update.rows if len(b.ids)]
        self._versions.append((update.version, update.wall, written))
        self._bytes += sum(ids.nbytes for _, ids in written)
        while self._bytes > self.limit_bytes and self._versions:
            version, _, dropped = self._versions.popleft()
            self._bytes -= sum(ids.nbytes for _, ids in dropped)
            self._floor = version

    def applied_after(self, version: int) -> float:
        """When the first version after `version` applied (time.time() on this shard); 0.0 where not recorded."""
        self._active = True
        found = 0.0
        for v, wall, _ in reversed(self._versions):
            if v <= version:
                break
            found = wall
        return found

    def written_since(self, version: int) -> list[np.ndarray] | None:
        """Each table's unique IDs written after `version` (ascending); None where this record no longer covers
        it (the caller scans the tables' last-update versions instead). The first question starts the record."""
        self._active = True
        if version < self._floor:
            return None
        parts: list[list[np.ndarray]] = [[] for _ in range(self.tables)]
        for v, _, written in reversed(self._versions):
            if v <= version:
                break
            for table, ids in written:
                parts[table].append(ids)
        return [np.unique(np.concatenate(p)) if p else np.empty(0, np.int64) for p in parts]
