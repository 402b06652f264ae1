"""The sparse part of one exchange as it arrives: the rows it pushes and the IDs it looks up, in arrays planned
from the request (paramserver.shard.sparse.tables.ShardTables.plan) before any byte of them is read, filled from the
messages (gRPC) or a frame's payload, and the looked-up rows to answer with."""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass, field

import numpy as np

from paramserver.errors import MalformedStream
from paramserver.shard.sparse.row_blocks import RowBlock
from paramserver.v1 import ps_pb2


@dataclass
class SparseIn:
    """The sparse part of one exchange: the rows it pushes and the IDs it looks up, as planned arrays."""

    rows: list[RowBlock]
    lookups: list[RowBlock]
    answers: list[np.ndarray] = field(default_factory=list)  # the looked-up rows, once read (float32 [n, dim])

    def __bool__(self) -> bool:
        return bool(self.rows or self.lookups)

    @property
    def nbytes(self) -> int:
        """Bytes of the rows and IDs (their part of a frame's payload)."""
        return sum(b.nbytes for b in self.rows) + sum(b.nbytes for b in self.lookups)

    def targets(self) -> list[np.ndarray]:
        """The arrays a frame's payload fills after its dense part, in order."""
        return [a for b in self.rows for a in b.arrays()] + [b.ids for b in self.lookups]

    def fill_inline(self, request_rows: Sequence[ps_pb2.Rows], request_lookups: Sequence[ps_pb2.Rows]) -> None:
        """Fill the arrays from the bytes in the messages (gRPC); MalformedStream for bytes of another size."""
        for block, entry in zip(self.rows, request_rows, strict=True):
            _take(block.ids, entry.ids, "ids", block.table)
            assert block.values is not None
            _take(block.values, entry.values, "values", block.table)
        for block, entry in zip(self.lookups, request_lookups, strict=True):
            _take(block.ids, entry.ids, "ids", block.table)
            if entry.values:
                raise MalformedStream(f"a lookup of table {block.table} carries values")

    def answer_inline(self, reply: ps_pb2.ExchangeResponse) -> None:
        """Put the looked-up rows' bytes into the reply's `rows` (gRPC)."""
        for entry, values in zip(reply.rows, self.answers, strict=True):
            entry.values = values.tobytes()


def _take(target: np.ndarray, data: bytes, what: str, table: int) -> None:
    if len(data) != target.nbytes:
        raise MalformedStream(
            f"rows of table {table}: {len(data)} bytes of {what} where their count and the table's dim make "
            f"{target.nbytes}"
        )
    target.reshape(-1).view(np.uint8)[:] = np.frombuffer(data, dtype=np.uint8)
