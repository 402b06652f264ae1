"""One shard's serving copy: its values only (the dense part and the rows of its tables, no optimizer state, no
log), at one version, replaced by whole versions as the Follow streams from the shard arrive.

A stream is read whole before anything changes here, then applied under the copy's lock, so a read sees the
version before or the version after, never a mix. A full state (a copy starting, or re-syncing after a restart of
the shard without a log) is built beside the held one, which goes on serving; it starts at a version its rows may
be newer than, so it is swapped in only once the changes since that version applied to it too. A copy starting is
`ready` from then on.
"""

from __future__ import annotations

import threading
import time
from collections import deque
from collections.abc import Iterable, Sequence
from dataclasses import dataclass, field

import numpy as np

from paramserver.errors import InvalidArgument
from paramserver.shard.sparse.row_store import RowGroup
from paramserver.tables import TableSpec
from paramserver.v1 import ps_pb2


@dataclass
class _Received:
    """One Follow stream, read whole."""

    head: ps_pb2.FollowMessage.Header
    dense: np.ndarray
    rows: list[tuple[int, np.ndarray, np.ndarray]] = field(default_factory=list)


@dataclass
class _Next:
    """A whole state taken from the shard, held beside the served one until the changes since it began apply."""

    groups: list[RowGroup]
    dense: np.ndarray
    version: int
    incarnation: str
    digest: str


class ShardCopy:
    """A serving copy of shard `index` of a model with these tables."""

    def __init__(self, index: int, tables: Sequence[TableSpec]) -> None:
        self.index = index
        self.specs = tuple(tables)
        self.version = 0
        self.incarnation = ""
        self.digest = ""
        self.ready = False  # holds one version whole
        self.heard = time.monotonic()  # when its shard last answered
        self.lock = threading.Lock()
        # Seconds from when the oldest version of each answer applied on the shard to when it applied here (the
        # newest answers' first; the same host's clocks, or NTP's accuracy between hosts).
        self.freshness: deque[float] = deque(maxlen=4096)
        self._dense = np.empty(0, np.float32)
        widths = sorted({t.dim for t in self.specs})
        self._members = [[k for k, t in enumerate(self.specs) if t.dim == w] for w in widths]
        # Each table's (group, tag): its tag is its place among its group's tables.
        self._where = {k: (g, members.index(k)) for g, members in enumerate(self._members) for k in members}
        self._group_of = np.array([self._where[k][0] for k in range(len(self.specs))], np.int64)
        self._tag_of = np.array([self._where[k][1] for k in range(len(self.specs))], np.int32)
        self._groups = self._new_groups()
        self._next: _Next | None = None  # a whole state taken, not whole yet (see `position`)
        self._start_over = False

    def _new_groups(self) -> list[RowGroup]:
        # Values only, the tables of one width in one group (as on the shard: one probe, one gather, one scatter per
        # group, whatever the number of tables): plain SGD keeps no state, and a lookup of an ID without a row reads
        # its initial row by its table's own rule, as the shard's does. No per-row update version or time.
        return [RowGroup([self.specs[t] for t in members], "sgd", 0.0, updates=False) for members in self._members]

    def position(self) -> tuple[str, int, str, bool, bool]:
        """What to ask the shard for next: (model digest, since version, incarnation, full, catching up). While a
        whole state taken is not yet whole (`catching up`: the changes since it began have to follow), the copy
        goes on serving the state it held before."""
        n = self._next
        if n is not None:
            return n.digest, n.version, n.incarnation, False, True
        return self.digest, self.version, self.incarnation, self._start_over or not self.digest, False

    def start_over(self) -> None:
        """Take a whole state again at the next answer (a stream that did not fit); serve the held one meanwhile."""
        self._next = None
        self._start_over = True

    def seed(
        self, dense: np.ndarray, rows: list[tuple[int, np.ndarray, np.ndarray]], version: int, digest: str
    ) -> None:
        """Serve these values (a model file's: paramserver.serving.seed) until the shard's whole state has arrived:
        ready now, and the next question asks for a whole state, built beside this one."""
        groups = self._new_groups()
        self._put(groups, rows)
        with self.lock:
            self._groups, self._dense = groups, dense
            self.version, self.digest, self.incarnation = version, digest, ""
            self.ready = True
            self._next, self._start_over = None, True

    # -- taking the shard's stream -------------------------------------------------------------------------------

    def take(self, messages: Iterable[ps_pb2.FollowMessage]) -> int:
        """Apply one Follow stream (read whole first); return the version served after it. A whole state is built
        beside the served one and swapped in once the changes since it began applied to it too."""
        got = self._receive(messages)
        head = got.head
        if head.full:
            groups = self._new_groups()
            self._put(groups, got.rows)
            self._next = _Next(groups, got.dense, head.version, head.incarnation, head.model_digest)
            self._start_over = False
        elif self._next is not None:
            n, self._next = self._next, None
            self._put(n.groups, got.rows)  # nobody reads it yet: no lock
            with self.lock:
                self._groups, self._dense = n.groups, got.dense if head.dense_elements else n.dense
                self.version, self.incarnation, self.digest = head.version, head.incarnation, n.digest
                self.ready = True
        else:
            with self.lock:
                self._put(self._groups, got.rows)
                if head.dense_elements:
                    self._dense = got.dense
                self.version, self.incarnation = head.version, head.incarnation
                self.ready = True
        self.heard = time.monotonic()
        if head.oldest_applied and not head.full:
            self.freshness.append(time.time() - head.oldest_applied)
        return self.version

    def _receive(self, messages: Iterable[ps_pb2.FollowMessage]) -> _Received:
        it = iter(messages)
        first = next(it, None)
        if first is None or first.WhichOneof("kind") != "header":
            raise ValueError(f"shard {self.index}'s Follow stream does not start with its header")
        head = first.header
        got = _Received(head, np.empty(head.dense_elements, np.float32))
        filled = 0
        for m in it:
            kind = m.WhichOneof("kind")
            if kind == "dense":
                data = np.frombuffer(m.dense.data, "<f4")
                got.dense[m.dense.offset : m.dense.offset + len(data)] = data
                filled += len(data)
            elif kind in ("rows", "batch"):
                for r in [m.rows] if kind == "rows" else m.batch.rows:
                    if r.table >= len(self.specs):
                        raise ValueError(f"shard {self.index} sent rows of table {r.table} of {len(self.specs)}")
                    ids = np.frombuffer(r.ids, "<i8")
                    values = np.frombuffer(r.values, "<f4").reshape(len(ids), self.specs[r.table].dim)
                    got.rows.append((r.table, ids, values))
        if filled != head.dense_elements:
            raise ValueError(f"shard {self.index} sent {filled} of {head.dense_elements} dense elements")
        return got

    def _put(self, groups: list[RowGroup], rows: list[tuple[int, np.ndarray, np.ndarray]]) -> None:
        """Place an answer's rows, a group's tables in one call."""
        by_group: dict[int, list[tuple[int, np.ndarray, np.ndarray]]] = {}
        for table, ids, values in rows:
            by_group.setdefault(self._where[table][0], []).append((table, ids, values))
        for g, entries in by_group.items():
            group = groups[g]
            ids = np.concatenate([e[1] for e in entries])
            values = np.concatenate([e[2] for e in entries])
            tags = self._tags([(e[0], len(e[1])) for e in entries]) if group.tagged else None
            group.put(ids, values, tags)

    def _tags(self, counts: list[tuple[int, int]]) -> np.ndarray:
        return np.concatenate([np.full(n, self._where[t][1], np.int32) for t, n in counts])

    # -- reads ---------------------------------------------------------------------------------------------------

    def lookup(self, table: int, ids: np.ndarray) -> np.ndarray:
        """The rows of one table's IDs (initial rows for IDs without one); call under `lock`."""
        if table not in self._where:
            raise InvalidArgument(f"table {table}: the model has {len(self.specs)} table(s)")
        out = np.empty((len(ids), self.specs[table].dim), np.float32)
        for at, rows in self.lookup_tagged(np.full(len(ids), table, np.int64), np.asarray(ids, np.int64)):
            out[at] = rows
        return out

    def lookup_tagged(self, tables: np.ndarray, ids: np.ndarray) -> list[tuple[np.ndarray, np.ndarray]]:
        """The rows of IDs of several tables (`tables[k]` is ID k's table, each known to the model), a width's in one
        lookup whatever the number of tables: [(positions in `ids`, their rows)], one entry per width present.
        Call under `lock`."""
        out = []
        groups = self._group_of[tables]
        present = np.unique(groups) if len(self._groups) > 1 else range(1 if len(ids) else 0)
        for g in present:
            at = np.flatnonzero(groups == g) if len(self._groups) > 1 else np.arange(len(ids))
            group = self._groups[int(g)]
            tags = self._tag_of[tables[at]] if group.tagged else None
            out.append((at, group.lookup(ids[at], tags)))
        return out

    def dense(self) -> np.ndarray:
        """The dense part (replaced, never changed in place: safe to read after the lock is let go)."""
        return self._dense

    @property
    def nbytes(self) -> int:
        """Bytes held: the dense part and every table's rows with their index."""
        return int(self._dense.nbytes + sum(g.nbytes for g in self._groups))

    @property
    def rows(self) -> int:
        return int(sum(g.rows for g in self._groups))
