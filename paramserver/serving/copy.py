"""One shard's serving copy: its values only (the dense part and the rows of its tables, no optimizer state, no
log), at one version, replaced by whole versions as the Follow streams from the shard arrive.

A stream is read whole before anything changes here, then applied under the copy's lock, so a read sees the
version before or the version after, never a mix. A full state (a copy starting, or re-syncing after a restart of
the shard without a log) is built beside the held one and swapped in; it starts at a version its rows may be newer
than, so the copy is not `ready` until the changes since that version applied too.
"""

from __future__ import annotations

import threading
import time
from collections import deque
from collections.abc import Iterable, Sequence
from dataclasses import dataclass, field

import numpy as np

from paramserver.errors import InvalidArgument
from paramserver.shard.row_store import RowGroup
from paramserver.tables import TableSpec
from paramserver.v1 import ps_pb2


@dataclass
class _Received:
    """One Follow stream, read whole."""

    head: ps_pb2.FollowMessage.Header
    dense: np.ndarray
    rows: list[tuple[int, np.ndarray, np.ndarray]] = field(default_factory=list)


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
        self._groups = self._new_groups()

    def _new_groups(self) -> list[RowGroup]:
        # Values only, the tables of one width in one group (as on the shard: one probe, one gather, one scatter per
        # group, whatever the number of tables): plain SGD keeps no state, and a lookup of an ID without a row reads
        # its initial row by its table's own rule, as the shard's does.
        return [RowGroup([self.specs[t] for t in members], "sgd", 0.0) for members in self._members]

    @property
    def has_state(self) -> bool:
        return bool(self.digest)

    # -- taking the shard's stream -------------------------------------------------------------------------------

    def take(self, messages: Iterable[ps_pb2.FollowMessage]) -> int:
        """Apply one Follow stream (read whole first); return the version held after it."""
        got = self._receive(messages)
        head = got.head
        if head.full:
            groups = self._new_groups()
            self._put(groups, got.rows)
            with self.lock:
                self._groups, self._dense = groups, got.dense
                self.version, self.incarnation, self.digest = head.version, head.incarnation, head.model_digest
                self.ready = False  # its rows may be newer than its version: whole once the changes since apply
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
        """The rows of these IDs (initial rows for IDs without one); call under `lock`."""
        return self.lookup_many([(table, ids)])[0]

    def lookup_many(self, asked: list[tuple[int, np.ndarray]]) -> list[np.ndarray]:
        """The rows of several tables' IDs, a group's in one lookup; call under `lock`."""
        for table, _ in asked:
            if table not in self._where:
                raise InvalidArgument(f"table {table}: the model has {len(self.specs)} table(s)")
        out: list[np.ndarray] = [np.empty((0, 0), np.float32)] * len(asked)
        by_group: dict[int, list[int]] = {}
        for k, (table, _) in enumerate(asked):
            by_group.setdefault(self._where[table][0], []).append(k)
        for g, ks in by_group.items():
            group = self._groups[g]
            ids = np.concatenate([asked[k][1] for k in ks]) if len(ks) > 1 else asked[ks[0]][1]
            tags = self._tags([(asked[k][0], len(asked[k][1])) for k in ks]) if group.tagged else None
            rows = group.lookup(ids, tags)
            at = 0
            for k in ks:
                n = len(asked[k][1])
                out[k] = rows[at : at + n]
                at += n
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
