"""The shard's end of a serving copy's feed (the Follow RPC, SPEC.md section 17): what changed since the version a
copy holds, read at the shard's current version, or every row when the copy starts.

A delta is read whole under the shard's lock (the dense part and the changed rows of one version), then sent. A
full state is read a page of rows at a time, the lock taken per page, so a large table is never copied whole and
training goes on between pages; the copy then asks for the changes since the version the state started at, which
makes it whole (a row written meanwhile is among them). Nothing here is kept per copy: a slow or dead copy costs
the shard only the RPC it has open, and at most FOLLOWERS are open at once.
"""

from __future__ import annotations

from collections.abc import Iterator

import numpy as np

from paramserver.errors import ShuttingDown
from paramserver.server.streams import StreamGate
from paramserver.shard.model import ShardModel
from paramserver.shard.sparse.row_blocks import RowBlock
from paramserver.shard.state import Shard
from paramserver.v1 import ps_pb2
from paramserver.wire.chunks import CHUNK_BYTES

MAX_WAIT_MS = 10_000
FOLLOWERS, FOLLOWERS_PER_HOST = 4, 2  # Follow streams at once: 4 of the gRPC pool's 16 threads at most
PAGE_SLOTS = 1 << 16  # slots read under the lock at once in a full state (at dim 64: 16 MiB of values)


class Followers:
    """The Follow RPCs of one shard: their own streams' gate (paramserver.server.streams: capped, a stalled reader
    cancelled), apart from Pull's and ExportRows', so serving copies never take a worker's place."""

    def __init__(self, shard: Shard, total: int = FOLLOWERS, per_host: int = FOLLOWERS_PER_HOST) -> None:
        self.shard = shard
        self.gate = StreamGate(total, per_host)
        self._last: tuple[tuple[str, str, int, int], list[bytes]] | None = None  # the last delta, serialized

    def follow(self, request: ps_pb2.FollowRequest) -> Iterator[bytes]:
        """The messages answering `request`, serialized (checks, and the wait for a newer version, before the first).
        A delta is kept until the next: another copy asking for the same versions gets the same bytes, read once."""
        shard = self.shard
        wait = min(request.wait_ms, MAX_WAIT_MS) / 1000
        with shard.lock:
            model = shard.require_model()  # NotPrimary on a backup: the copy follows the primary
            shard.lock.wait_for(lambda: shard.version > request.since_version or shard.closed, timeout=wait)
            if shard.closed:
                raise ShuttingDown(f"shard {shard.index} is stopping")
            model = shard.require_model()
            full = request.full or not self._continues(request, model)
            version = shard.version
            key = (model.digest, shard.incarnation, request.since_version, version)
            cached = self._last
            if not full and cached is not None and cached[0] == key:
                reused: list[bytes] | None = cached[1]
            else:
                reused = None
                head = ps_pb2.FollowMessage.Header(
                    version=version,
                    full=full,
                    incarnation=shard.incarnation,
                    model_digest=model.digest,
                    dense_elements=model.numel if (full or version > request.since_version) else 0,
                    oldest_applied=0.0 if full else shard.publication.applied_after(request.since_version),
                )
                dense = model.params.detach().numpy().copy() if head.dense_elements else np.empty(0, np.float32)
                changed = [] if full else self._changed(model, request.since_version)
        if reused is not None:  # sent once the lock is let go, as every answer: a slow reader never holds the shard
            yield from reused
            return
        if full:
            yield ps_pb2.FollowMessage(header=head).SerializeToString()
            yield from (m.SerializeToString() for m in _dense(dense))
            yield from (m.SerializeToString() for m in self._pages(model))
            return
        messages = [ps_pb2.FollowMessage(header=head).SerializeToString()]
        messages += [m.SerializeToString() for m in _dense(dense)]
        messages += [m.SerializeToString() for m in _batches(changed)]
        self._last = (key, messages)
        yield from messages

    def _continues(self, request: ps_pb2.FollowRequest, model: ShardModel) -> bool:
        """Whether the copy's state is a past version of this shard's (then only changes need go): the same model,
        and the same incarnation or a durable shard's (which keeps every version it showed), not ahead of it."""
        shard = self.shard
        same_history = request.incarnation == shard.incarnation or shard.durable
        return request.model_digest == model.digest and same_history and request.since_version <= shard.version

    def _changed(self, model: ShardModel, since: int) -> list[tuple[int, np.ndarray, np.ndarray]]:
        """Each table's rows written after `since`, read now (under the lock; a group's tables in one lookup)."""
        tables = model.tables
        if not tables:
            return []
        written = self.shard.publication.written_since(since)
        if written is None:  # past what the record covers: the rows' own versions tell
            written = [v.group.written_since(since, v.tag) for v in tables.tables]
        asked = [RowBlock(t, ids, None) for t, ids in enumerate(written) if len(ids)]
        return [(b.table, b.ids, rows) for b, rows in zip(asked, tables.lookup(asked), strict=True)]

    def _pages(self, model: ShardModel) -> Iterator[ps_pb2.FollowMessage]:
        """Every row of every table, a page of slots under the lock at a time."""
        for t in range(len(model.tables)):
            start = 0
            while True:
                with self.shard.lock:
                    if self.shard.model is not model:
                        raise ShuttingDown(f"shard {self.shard.index} took another state while it was read")
                    view = model.tables.tables[t]
                    if start >= view.group.end_slot:
                        break
                    ids, values, start = view.group.page(view.tag, start, PAGE_SLOTS)
                yield from _rows(t, ids, values)


def _dense(dense: np.ndarray) -> Iterator[ps_pb2.FollowMessage]:
    per = CHUNK_BYTES // 4
    data = dense.astype("<f4", copy=False)
    for lo in range(0, len(data), per):
        chunk = ps_pb2.FollowMessage.Dense(offset=lo, data=data[lo : lo + per].tobytes())
        yield ps_pb2.FollowMessage(dense=chunk)


def _batches(changed: list[tuple[int, np.ndarray, np.ndarray]]) -> Iterator[ps_pb2.FollowMessage]:
    """Tables' rows, several in a message of at most about CHUNK_BYTES (a large table's in several)."""
    batch = ps_pb2.FollowMessage.Batch()
    size = 0
    for table, ids, values in changed:
        for m in _rows(table, ids, values):
            if size and size + len(m.rows.values) > CHUNK_BYTES:
                yield ps_pb2.FollowMessage(batch=batch)
                batch, size = ps_pb2.FollowMessage.Batch(), 0
            batch.rows.append(m.rows)
            size += len(m.rows.ids) + len(m.rows.values)
    if size:
        yield ps_pb2.FollowMessage(batch=batch)


def _rows(table: int, ids: np.ndarray, values: np.ndarray) -> Iterator[ps_pb2.FollowMessage]:
    if not len(ids):
        return
    per = max(1, CHUNK_BYTES // (8 + 4 * values.shape[1]))
    for lo in range(0, len(ids), per):
        hi = lo + per
        yield ps_pb2.FollowMessage(
            rows=ps_pb2.Rows(
                table=table,
                count=len(ids[lo:hi]),
                ids=ids[lo:hi].astype("<i8").tobytes(),
                values=values[lo:hi].astype("<f4").tobytes(),
            )
        )
