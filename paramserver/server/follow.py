"""The shard's end of a serving copy's feed (the Follow RPC, SPEC.md section 17): what changed since the version a
copy holds, read at the shard's current version, or every row when the copy starts.

A delta is read whole under the shard's lock (the dense part and the changed rows of one version), then sent. A
full state is read a page of rows at a time, the lock taken per page, so a large table is never copied whole and
training goes on between pages; the copy then asks for the changes since the version the state started at, which
makes it whole (a row written meanwhile is among them). Nothing here is kept per copy: a slow or dead copy costs
the shard only the RPC it has open, and at most FOLLOWERS are open at once.

Several copies cost about one: the last delta (the changes from version a to version b, read at b) is kept for
REUSE_S, and answers any copy holding a version from a up to b, since it holds every change after that copy's
version too (and some it has: rewritten at b's values, which are newer). Such a copy then holds b, as the first
does, so copies that follow one shard fall into step and each delta is read and serialized once for all of them.
"""

from __future__ import annotations

import time
from collections.abc import Iterator
from dataclasses import dataclass

import numpy as np

from paramserver.errors import ShuttingDown
from paramserver.server import reads
from paramserver.server.streams import StreamGate
from paramserver.shard.model import ShardModel
from paramserver.shard.sparse.row_blocks import RowBlock
from paramserver.shard.state import Shard
from paramserver.v1 import ps_pb2
from paramserver.wire.chunks import CHUNK_BYTES

MAX_WAIT_MS = 10_000
FOLLOWERS, FOLLOWERS_PER_HOST = 4, 2  # Follow streams at once: 4 of the gRPC pool's 16 threads at most
PAGE_SLOTS = 1 << 16  # slots read under the lock at once in a full state (at dim 64: 16 MiB of values)
# How long the last delta answers other copies: at most this much fresher data is passed over for a copy it serves.
# Copies ask every 0.1 s (paramserver.serving.follower.INTERVAL_S); a copy a step behind another is caught in this.
REUSE_S = 0.05


@dataclass(frozen=True)
class _Delta:
    """The last delta sent: the changes after `since` read at `version`, serialized (its header first)."""

    history: tuple[str, str]  # model digest and incarnation
    since: int
    version: int
    made: float  # time.monotonic()
    head: ps_pb2.FollowMessage.Header
    rest: list[bytes]  # the messages after the header

    def answers(self, history: tuple[str, str], since: int, now: float) -> bool:
        return history == self.history and self.since <= since < self.version and now - self.made <= REUSE_S


class Followers:
    """The Follow RPCs of one shard: their own streams' gate (paramserver.server.streams: capped, a stalled reader
    cancelled), apart from Pull's and ExportRows', so serving copies never take a worker's place."""

    def __init__(self, shard: Shard, total: int = FOLLOWERS, per_host: int = FOLLOWERS_PER_HOST) -> None:
        self.shard = shard
        self.gate = StreamGate(total, per_host)
        self._last: _Delta | None = None

    def follow(self, request: ps_pb2.FollowRequest) -> Iterator[bytes]:
        """The messages answering `request`, serialized (checks, and the wait for a newer version, before the first).
        The last delta answers every copy it covers for REUSE_S (see the module's docstring)."""
        shard = self.shard
        wait = min(request.wait_ms, MAX_WAIT_MS) / 1000
        since = request.since_version
        with shard.lock:
            model = shard.require_model()  # NotPrimary on a backup: the copy follows the primary
            history = (model.digest, shard.incarnation)
            last = self._last
            now = time.monotonic()
            if (
                last is not None
                and not request.full
                and last.answers(history, since, now)
                and self._continues(request, model)
            ):
                # Its header anew: when the oldest change this copy lacks applied (its freshness).
                head = ps_pb2.FollowMessage.Header()
                head.CopyFrom(last.head)
                head.oldest_applied = shard.publication.applied_after(since)
                reused = [ps_pb2.FollowMessage(header=head).SerializeToString(), *last.rest]
            else:
                reused = None
                shard.lock.wait_for(lambda: shard.version > since or shard.closed, timeout=wait)
                if shard.closed:
                    raise ShuttingDown(f"shard {shard.index} is stopping")
                model = shard.require_model()
                history = (model.digest, shard.incarnation)
                full = request.full or not self._continues(request, model)
                version = shard.version
                head = ps_pb2.FollowMessage.Header(
                    version=version,
                    full=full,
                    incarnation=shard.incarnation,
                    model_digest=model.digest,
                    dense_elements=model.numel if (full or version > since) else 0,
                    oldest_applied=0.0 if full else shard.publication.applied_after(since),
                )
                dense = model.params.detach().numpy().copy() if head.dense_elements else np.empty(0, np.float32)
                changed = [] if full else self._changed(model, since)
        if reused is not None:  # sent once the lock is let go, as every answer: a slow reader never holds the shard
            yield from reused
            return
        if full:
            yield ps_pb2.FollowMessage(header=head).SerializeToString()
            yield from (m.SerializeToString() for m in _dense(dense))
            yield from (m.SerializeToString() for m in self._pages(model))
            return
        rest = [m.SerializeToString() for m in _dense(dense)]
        rest += [m.SerializeToString() for m in _batches(changed)]
        if head.version > since:
            self._last = _Delta(history, since, head.version, time.monotonic(), head, rest)
        yield ps_pb2.FollowMessage(header=head).SerializeToString()
        yield from rest

    def _continues(self, request: ps_pb2.FollowRequest, model: ShardModel) -> bool:
        """Whether the copy's state is a past version of this shard's (then only changes need go): the same model,
        and the same incarnation or a durable shard's (which keeps every version it showed), not ahead of it."""
        shard = self.shard
        continues = request.since_version <= shard.version and reads.same_history(shard, request.incarnation)
        return request.model_digest == model.digest and continues

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
