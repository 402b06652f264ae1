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

    def follow(self, request: ps_pb2.FollowRequest) -> Iterator[ps_pb2.FollowMessage]:
        """The messages answering `request` (checks, and the wait for a newer version, before the first)."""
        return self._follow(request)

    def _follow(self, request: ps_pb2.FollowRequest) -> Iterator[ps_pb2.FollowMessage]:
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
            head = ps_pb2.FollowMessage.Header(
                version=version,
                full=full,
                incarnation=shard.incarnation,
                model_digest=model.digest,
                dense_elements=model.numel if (full or version > request.since_version) else 0,
            )
            dense = model.params.detach().numpy().copy() if head.dense_elements else np.empty(0, np.float32)
            changed = [] if full else self._changed(model, request.since_version)
        yield ps_pb2.FollowMessage(header=head)
        yield from _dense(dense)
        if full:
            yield from self._pages(model)
        else:
            for table, ids, values in changed:
                yield from _rows(table, ids, values)

    def _continues(self, request: ps_pb2.FollowRequest, model: ShardModel) -> bool:
        """Whether the copy's state is a past version of this shard's (then only changes need go): the same model,
        and the same incarnation or a durable shard's (which keeps every version it showed), not ahead of it."""
        shard = self.shard
        same_history = request.incarnation == shard.incarnation or shard.durable
        return request.model_digest == model.digest and same_history and request.since_version <= shard.version

    def _changed(self, model: ShardModel, since: int) -> list[tuple[int, np.ndarray, np.ndarray]]:
        """Each table's rows written after `since`, read now (under the lock)."""
        tables = model.tables
        if not tables:
            return []
        views = tables.tables
        written = self.shard.publication.written_since(since)
        if written is None:  # past what the record covers: the rows' own versions tell
            written = [v.group.written_since(since, v.tag) for v in views]
        out = []
        for t, ids in enumerate(written):
            if len(ids):
                view = views[t]
                tags = None if not view.group.tagged else np.full(len(ids), view.tag, np.int32)
                out.append((t, ids, view.group.lookup(ids, tags)))
        return out

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
