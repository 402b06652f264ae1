"""A table's rows read out of a shard whole (ExportRows, for worker's PSClient.save): copied under the shard's lock,
so that they are one version's, then sent in messages of about 1 MiB while training goes on.

The copy is one table's rows on this shard (and its optimizer state when asked), not the shard's whole model: a save
asks for one table after another.
"""

from __future__ import annotations

from collections.abc import Iterator
from typing import TYPE_CHECKING

import numpy as np

from paramserver.errors import InvalidArgument
from paramserver.v1 import ps_pb2
from paramserver.wire.chunks import CHUNK_BYTES

if TYPE_CHECKING:
    from paramserver.shard.state import Shard


def export_rows(
    shard: Shard,
    digest: str,
    table: int,
    optimizer_state: bool,
    header_only: bool = False,
    chunk_bytes: int = CHUNK_BYTES,
) -> Iterator[ps_pb2.ExportRowsMessage]:
    """The ExportRows stream of one table: a header, then (unless `header_only`) its rows in ascending ID order.
    Checks (FAILED_PRECONDITION for another model or none, InvalidArgument for a table past the model's) before the
    first message."""
    with shard.lock:
        model = shard.require_model(digest)
        tables = model.tables
        if table >= len(tables):
            raise InvalidArgument(f"table {table} asked for, but the model has {len(tables)} table(s)")
        if header_only:
            view = tables.tables[table]
            cols = view.group.state_cols if optimizer_state else 0
            head = ps_pb2.ExportRowsMessage.Header(
                count=view.rows, dim=view.spec.dim, state_cols=cols, version=shard.version
            )
            return iter([ps_pb2.ExportRowsMessage(header=head)])
        state = tables.tables[table].state()  # copies, in ascending ID order
        version = shard.version
    ids, values = state["ids"], state["values"]
    extra = state["optimizer_state"] if optimizer_state else np.empty((len(ids), 0), np.float32)
    dim, cols = values.shape[1], extra.shape[1]
    header = ps_pb2.ExportRowsMessage.Header(count=len(ids), dim=dim, state_cols=cols, version=version)
    return _messages(header, ids, values, extra, max(1, chunk_bytes // (8 + 4 * (dim + cols))))


def _messages(
    header: ps_pb2.ExportRowsMessage.Header, ids: np.ndarray, values: np.ndarray, extra: np.ndarray, per: int
) -> Iterator[ps_pb2.ExportRowsMessage]:
    yield ps_pb2.ExportRowsMessage(header=header)
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
