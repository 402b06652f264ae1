"""A table's initial rows given in an Init stream (a converted nn.Embedding's weights: worker.make_sparse), gathered
message by message and checked whole before the model that receives them is adopted.

They are checked as a push's rows are (this shard's IDs, within the table's bound, each once, finite), then held
from the start: version 0, optimizer state zero, as if admitted. A refused Init adopts nothing, so the shard is as
it was.
"""

from __future__ import annotations

import time

import numpy as np

from paramserver.errors import InvalidArgument, MalformedStream, TooLarge
from paramserver.shard.sparse.row_blocks import RowBlock
from paramserver.shard.sparse.tables import ROW_OVERHEAD_BYTES, ShardTables
from paramserver.v1 import ps_pb2


class GivenRows:
    """The rows an Init stream gives, by table, until `finish` puts them into the model's tables."""

    def __init__(self, tables: ShardTables) -> None:
        self._tables = tables
        self._parts: dict[int, list[tuple[np.ndarray, np.ndarray]]] = {}
        self._bytes = 0  # what the memory cap counts of them

    def add(self, entry: ps_pb2.Rows) -> None:
        """Take one message's rows (InvalidArgument for an unknown table or bytes that do not match the count;
        TooLarge once they pass the shard's --max-table-bytes)."""
        specs = self._tables.specs
        if entry.table >= len(specs):
            raise InvalidArgument(f"initial rows for table {entry.table}, but the model has {len(specs)} table(s)")
        spec, n = specs[entry.table], int(entry.count)
        if len(entry.ids) != 8 * n or len(entry.values) != 4 * spec.dim * n:
            raise MalformedStream(
                f"initial rows of table {spec.name!r}: {len(entry.ids)} bytes of IDs and {len(entry.values)} of "
                f"values where {n} rows of dim {spec.dim} make {8 * n} and {4 * spec.dim * n}"
            )
        group = self._tables.groups[self._tables.group_of(entry.table)]
        self._bytes += n * (group.row_bytes + ROW_OVERHEAD_BYTES)
        limit = self._tables.table_bytes_limit()
        if self._bytes > limit:
            raise TooLarge(
                f"the initial rows given take {self._bytes} bytes or more of table memory, over shard "
                f"{self._tables.index}'s limit of {limit} (--max-table-bytes): raise it or add shards"
            )
        ids = np.frombuffer(entry.ids, dtype="<i8").astype(np.int64)
        values = np.frombuffer(entry.values, dtype="<f4").astype(np.float32).reshape(n, spec.dim)
        self._parts.setdefault(int(entry.table), []).append((ids, values))

    def finish(self) -> None:
        """Check every table's rows whole (InvalidArgument: another shard's ID, out of bound, given twice, not
        finite) and put them into the tables."""
        blocks = []
        for table, parts in sorted(self._parts.items()):
            ids = np.concatenate([p[0] for p in parts])
            order = np.argsort(ids, kind="stable")  # ascending: the check proves them distinct in one comparison
            blocks.append(RowBlock(table, ids[order], np.concatenate([p[1] for p in parts])[order]))
        self._parts.clear()
        if blocks:
            self._tables.check(blocks, what="initial rows")
            self._tables.give(blocks, time.monotonic())
