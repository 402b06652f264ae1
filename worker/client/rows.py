"""The sparse part of a push: which shard holds each ID, and each shard's rows of a model's tables for one exchange
(the row gradients their forward passes left, and the rows of the IDs they were told to prefetch); and the rows a
model's tables give the shards when they are first initialised (make_sparse's converted weights)."""

from __future__ import annotations

from collections.abc import Callable, Iterator, Sequence
from dataclasses import dataclass

import numpy as np
import torch

from paramserver.errors import MalformedStream
from paramserver.tables import shard_of
from paramserver.v1 import ps_pb2
from paramserver.wire.chunks import CHUNK_BYTES
from worker.client.binding import Binding
from worker.client.sparse import Prepared, SparseEmbedding


@dataclass
class TableRows:
    """One table's rows in one shard's part of an exchange: pushed (`values`: the gradients) or looked up (`out`:
    where the rows go)."""

    table: int
    ids: np.ndarray  # int64, unique
    values: np.ndarray | None = None  # float32 [n, dim]: a push's row gradients
    out: np.ndarray | None = None  # float32 [n, dim]: a lookup's answer


@dataclass
class SparseJob:
    """The sparse part of one shard's exchange: the rows it pushes and the rows it looks up."""

    rows: list[TableRows]
    lookups: list[TableRows]

    @property
    def nbytes(self) -> int:
        """Bytes on the wire both ways (to choose a transport's path by size)."""
        pushed = sum(r.ids.nbytes + (r.values.nbytes if r.values is not None else 0) for r in self.rows)
        looked = sum(r.ids.nbytes + (r.out.nbytes if r.out is not None else 0) for r in self.lookups)
        return int(pushed + looked)

    def entries(self, inline: bool) -> tuple[list[ps_pb2.Rows], list[ps_pb2.Rows]]:
        """The request's `rows` and `lookup` entries: with their bytes (gRPC), or naming the payload's (frames)."""

        def entry(r: TableRows, values: bool) -> ps_pb2.Rows:
            e = ps_pb2.Rows(table=r.table, count=len(r.ids))
            if inline:
                e.ids = r.ids.tobytes()
                if values and r.values is not None:
                    e.values = r.values.tobytes()
            return e

        return [entry(r, True) for r in self.rows], [entry(r, False) for r in self.lookups]

    def add_to(self, request: ps_pb2.ExchangeRequest, inline: bool) -> None:
        rows, lookups = self.entries(inline)
        request.rows.extend(rows)
        request.lookup.extend(lookups)

    def raw_out(self) -> list[np.ndarray]:
        """What follows the dense payload of a request frame: each pushed table's IDs and values, then each looked
        up table's IDs."""
        out: list[np.ndarray] = []
        for r in self.rows:
            assert r.values is not None
            out += [r.ids, r.values]
        return out + [r.ids for r in self.lookups]

    def raw_in(self) -> list[np.ndarray]:
        """Where the looked-up rows after a reply frame's dense payload go."""
        return [r.out for r in self.lookups if r.out is not None]

    def take(self, reply: ps_pb2.ExchangeResponse, address: str) -> None:
        """Copy the looked-up rows out of a gRPC reply."""
        if len(reply.rows) != len(self.lookups):
            raise MalformedStream(f"shard {address} answered {len(reply.rows)} lookups for {len(self.lookups)}")
        for r, entry in zip(self.lookups, reply.rows, strict=True):
            assert r.out is not None
            if len(entry.values) != r.out.nbytes:
                raise MalformedStream(f"shard {address} sent {len(entry.values)} bytes of rows for {r.out.nbytes}")
            r.out.reshape(-1).view(np.uint8)[:] = np.frombuffer(entry.values, dtype=np.uint8)


def by_shard(ids: np.ndarray, num_shards: int) -> list[np.ndarray | None]:
    """The positions of the IDs each shard holds (None where it holds none of them)."""
    if num_shards == 1:
        return [np.arange(len(ids))]
    owner = shard_of(ids, num_shards)
    order = np.argsort(owner, kind="stable")
    bounds = np.searchsorted(owner[order], np.arange(num_shards + 1))
    return [order[lo:hi] if hi > lo else None for lo, hi in zip(bounds[:-1], bounds[1:], strict=True)]


def _nothing() -> None:
    pass


def row_jobs(b: Binding, num_shards: int) -> tuple[list[SparseJob | None] | None, Callable[[], None]]:
    """Each shard's sparse part of a push: the row gradients the model's tables gathered since the last push,
    and the rows of the IDs they were told to prefetch (None: nothing); and what hands the prefetched rows to
    their tables once the exchange is over."""
    if not b.tables:  # a dense model: nothing to add to its pushes
        return None, _nothing
    jobs: list[SparseJob | None] = [None] * num_shards
    found = False

    def job_of(k: int) -> SparseJob:
        job = jobs[k] = jobs[k] or SparseJob([], [])
        return job

    fetched: list[tuple[SparseEmbedding, np.ndarray, np.ndarray, list[tuple[np.ndarray, TableRows]], int]] = []
    for index, module in enumerate(b.tables):
        outgoing = module.take_push()
        pushes = module.pushes
        if outgoing.gradients is not None:
            ids, grads, split = outgoing.gradients
            found = True
            # The rows a forward pass touched are usually those a push prefetched: prefetch grouped their IDs by
            # shard, so each shard's part is a slice (a view, not a copy).
            for k, where in enumerate(split if split is not None else by_shard(ids, num_shards)):
                if where is not None:
                    job_of(k).rows.append(TableRows(index, ids[where], values=np.ascontiguousarray(grads[where])))
        planned = outgoing.planned
        if planned is not None and len(planned.ids):
            found = True
            out, scattered = _lookups(job_of, index, module.dim, planned, num_shards)
            fetched.append((module, planned.ids, out, scattered, pushes))

    def deliver() -> None:
        for module, ids, out, scattered, pushes in fetched:
            for where, part in scattered:
                out[where] = part.out
            module.fetched(ids, out, pushes)

    return (jobs if found else None), deliver


def lookup_jobs(
    tables: Sequence[tuple[int, SparseEmbedding, Prepared]], num_shards: int
) -> tuple[list[SparseJob | None], Callable[[], None]]:
    """Each shard's part of one lookup for several tables at once ((index in the model, table, its prepared IDs)),
    and what hands each table its rows once the exchange is over (worker.prefetch's grouped lookup)."""
    jobs: list[SparseJob | None] = [None] * num_shards

    def job_of(k: int) -> SparseJob:
        job = jobs[k] = jobs[k] or SparseJob([], [])
        return job

    found = [
        (table, prepared, *_lookups(job_of, index, table.dim, prepared, num_shards))
        for index, table, prepared in tables
    ]

    def deliver() -> None:
        for table, prepared, out, scattered in found:
            for where, part in scattered:
                out[where] = part.out
            table.fetched(prepared.ids, out)

    return jobs, deliver


def _lookups(
    job_of: Callable[[int], SparseJob], index: int, dim: int, planned: Prepared, num_shards: int
) -> tuple[np.ndarray, list[tuple[np.ndarray, TableRows]]]:
    """Add one table's lookup of `planned`'s IDs to each shard's job: where all its rows land, and the parts that
    land elsewhere first (IDs not grouped by shard), to be scattered into it."""
    out = np.empty((len(planned.ids), dim), dtype=np.float32)
    scattered: list[tuple[np.ndarray, TableRows]] = []
    places: Sequence[slice | np.ndarray | None] = (
        planned.parts if planned.parts is not None else by_shard(planned.ids, num_shards)
    )
    for k, where in enumerate(places):
        if where is None:
            continue
        if isinstance(where, slice):  # a shard's rows land in place
            job_of(k).lookups.append(TableRows(index, planned.ids[where], out=out[where]))
            continue
        part = TableRows(index, planned.ids[where], out=np.empty((len(where), dim), np.float32))
        job_of(k).lookups.append(part)
        scattered.append((where, part))
    return out, scattered


def given_rows(b: Binding, shard: int, num_shards: int, chunk_bytes: int = CHUNK_BYTES) -> Iterator[bytes]:
    """The Init messages giving one shard its rows of the tables that bring initial rows (SparseEmbedding.given:
    the rows of IDs 0..N-1), about `chunk_bytes` each."""
    for index, module in enumerate(b.tables):
        given = module.given
        if given is None:
            continue
        rows = given.detach().to("cpu", dtype=torch.float32).contiguous().numpy()
        ids = np.arange(len(rows), dtype=np.int64)
        if num_shards > 1:
            ids = ids[shard_of(ids, num_shards) == shard]
        per = max(1, chunk_bytes // (8 + 4 * module.dim))
        for lo in range(0, len(ids), per):
            part = ids[lo : lo + per]
            entry = ps_pb2.Rows(table=index, count=len(part), ids=part.tobytes(), values=rows[part].tobytes())
            yield ps_pb2.InitMessage(rows=entry).SerializeToString()
