"""A table's rows read out of a shard whole (ExportRows, for worker's PSClient.save): copied under the shard's lock,
so that they are one version's, then sent in messages of about 1 MiB while training goes on.

The copy is one table's rows on this shard (and its optimizer state when asked), not the shard's whole model: a save
asks for one table after another. Readers of one table at one version share one copy (`Exports`: a reader that
stops reading holds a share of it, not a table of its own), and the copies held at once take at most
--max-table-bytes beyond the first (TooLarge past it, before anything is copied).
"""

from __future__ import annotations

import contextlib
import threading
from collections.abc import Iterator
from dataclasses import dataclass
from typing import TYPE_CHECKING

import numpy as np

from paramserver.errors import InvalidArgument, TooLarge
from paramserver.v1 import ps_pb2
from paramserver.wire.chunks import CHUNK_BYTES

if TYPE_CHECKING:
    from paramserver.shard.state import Shard


@dataclass
class _Copy:
    """One table's rows at one version, in ascending ID order, and how many streams read it."""

    header: ps_pb2.ExportRowsMessage.Header
    ids: np.ndarray
    values: np.ndarray
    extra: np.ndarray
    readers: int = 0

    @property
    def nbytes(self) -> int:
        return int(self.ids.nbytes + self.values.nbytes + self.extra.nbytes)


class Exports:
    """One shard's table copies being exported, shared by the streams that read the same table at one version."""

    def __init__(self) -> None:
        self._lock = threading.Lock()
        self._copies: dict[tuple[str, int, bool, int], _Copy] = {}

    @property
    def nbytes(self) -> int:
        """Bytes of the copies held now."""
        with self._lock:
            return sum(c.nbytes for c in self._copies.values())

    @property
    def copies(self) -> int:
        with self._lock:
            return len(self._copies)

    @contextlib.contextmanager
    def rows(self, shard: Shard, digest: str, table: int, optimizer_state: bool) -> Iterator[_Copy]:
        """The rows of `table` at the shard's current version, shared while the block runs."""
        with shard.lock:
            model = shard.require_model(digest)
            tables = model.tables
            if table >= len(tables):
                raise InvalidArgument(f"table {table} asked for, but the model has {len(tables)} table(s)")
            key = (model.digest, table, optimizer_state, shard.version)
            with self._lock:
                copy = self._copies.get(key)
                if copy is None:
                    view = tables.tables[table]
                    cols = view.group.state_cols if optimizer_state else 0
                    cost = view.rows * (8 + 4 * (view.spec.dim + cols))
                    held = sum(c.nbytes for c in self._copies.values())
                    limit = shard.config.max_table_bytes
                    if held and held + cost > limit:
                        raise TooLarge(
                            f"exporting table {view.spec.name!r} takes a copy of {cost} bytes, and other exports "
                            f"hold {held} of this shard's {limit} (--max-table-bytes): retry once they finish"
                        )
                copy = copy or self._copy(shard, table, optimizer_state)
                self._copies[key] = copy
                copy.readers += 1
        try:
            yield copy
        finally:
            with self._lock:
                copy.readers -= 1
                if not copy.readers:
                    self._copies.pop(key, None)

    @staticmethod
    def _copy(shard: Shard, table: int, optimizer_state: bool) -> _Copy:
        """Under the shard's lock: the table's rows, copied."""
        assert shard.model is not None
        state = shard.model.tables.tables[table].state()  # copies, in ascending ID order
        ids, values = state["ids"], state["values"]
        extra = state["optimizer_state"] if optimizer_state else np.empty((len(ids), 0), np.float32)
        header = ps_pb2.ExportRowsMessage.Header(
            count=len(ids), dim=values.shape[1], state_cols=extra.shape[1], version=shard.version
        )
        return _Copy(header, ids, values, extra)


def export_rows(
    shard: Shard,
    digest: str,
    table: int,
    optimizer_state: bool,
    header_only: bool = False,
    chunk_bytes: int = CHUNK_BYTES,
    exports: Exports | None = None,
) -> Iterator[ps_pb2.ExportRowsMessage]:
    """The ExportRows stream of one table: a header, then (unless `header_only`) its rows in ascending ID order.
    Checks (FAILED_PRECONDITION for another model or none, InvalidArgument for a table past the model's, TooLarge
    where `exports` holds too much already) before the first message."""
    if header_only:
        with shard.lock:
            model = shard.require_model(digest)
            tables = model.tables
            if table >= len(tables):
                raise InvalidArgument(f"table {table} asked for, but the model has {len(tables)} table(s)")
            view = tables.tables[table]
            cols = view.group.state_cols if optimizer_state else 0
            head = ps_pb2.ExportRowsMessage.Header(
                count=view.rows, dim=view.spec.dim, state_cols=cols, version=shard.version
            )
        return iter([ps_pb2.ExportRowsMessage(header=head)])
    return _messages(exports or Exports(), shard, digest, table, optimizer_state, chunk_bytes)


def _messages(
    exports: Exports, shard: Shard, digest: str, table: int, optimizer_state: bool, chunk_bytes: int
) -> Iterator[ps_pb2.ExportRowsMessage]:
    # The checks and the copy run on the first next(), before the header is sent; the share is released however
    # the stream ends (read whole, cancelled, or dropped).
    with exports.rows(shard, digest, table, optimizer_state) as copy:
        yield ps_pb2.ExportRowsMessage(header=copy.header)
        per = max(1, chunk_bytes // (8 + 4 * (copy.header.dim + copy.header.state_cols)))
        ids, values, extra = copy.ids, copy.values, copy.extra
        for lo in range(0, len(ids), per):
            hi = lo + per
            yield ps_pb2.ExportRowsMessage(
                rows=ps_pb2.ExportRowsMessage.Rows(
                    count=len(ids[lo:hi]),
                    ids=ids[lo:hi].astype("<i8").tobytes(),
                    values=values[lo:hi].astype("<f4").tobytes(),
                    state=extra[lo:hi].astype("<f4").tobytes(),
                )
            )
