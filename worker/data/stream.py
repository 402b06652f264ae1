"""Stream a prepared dataset (see worker/data/manifest.py) into a worker: the shards of its rank, in an order shuffled
per epoch, fetched and decoded ahead of the step by a background thread, with memory bounded by the prefetch depth
rather than by the dataset.

A worker's place in the data is (epoch, samples taken in it). Every rank takes the same number of samples per
epoch (the smallest rank's share), so in a sync job the servers' version says exactly where each worker is: a
worker that restarts starts at that position, and shards before it are skipped unread.
"""

from __future__ import annotations

import contextlib
import hashlib
import itertools
import queue
import threading
import time
from collections.abc import Generator, Iterator
from dataclasses import dataclass

import numpy as np
import torch

from worker.data import storage
from worker.data.features import Features, features_of
from worker.data.manifest import Manifest, Schema, ShardFile, load_manifest

Batch = torch.Tensor | Features  # a batch's x: Features for a dataset with categorical features


@dataclass(frozen=True)
class Part:
    """What one shard contributes to an epoch: the rows it gives, in the epoch's order."""

    shard: ShardFile
    order: np.ndarray  # row indices within the shard, this epoch's permutation, already past the skipped ones


class StreamedDataset:
    """A prepared dataset read shard by shard from its storage (path, file://, s3://, hdfs://, http(s)://).

    Its training reader runs on into the next epoch until `close()` (or the end of a `with` block) stops it."""

    def __init__(self, spec: str, prefetch: int = 2) -> None:
        if prefetch < 1:
            raise ValueError(f"prefetch must be at least 1 shard, not {prefetch}")
        self.spec = spec
        self.manifest: Manifest = load_manifest(spec)
        self.prefetch = prefetch
        self._reader: _Reader | None = None  # the training split's, running on into the next epoch
        self.waited = 0.0  # seconds the training loop spent waiting for data (storage not keeping up)
        self.fetched = 0  # shards read

    @property
    def name(self) -> str:
        return self.manifest.name

    @property
    def task(self) -> str:
        return self.manifest.task

    @property
    def in_shape(self) -> tuple[int, ...]:
        return self.manifest.in_shape

    @property
    def num_classes(self) -> int:
        return self.manifest.num_classes

    def assignment(self, rank: int, world: int) -> list[int]:
        """The train shards rank `rank` of `world` reads: every world-th one, from its rank on."""
        shards = self.manifest.splits["train"].shards
        if not 0 <= rank < world:
            raise ValueError(f"rank must be in [0, {world}), got {rank}")
        if len(shards) < world:
            raise ValueError(
                f"{self.name} has {len(shards)} train shards and the job {world} workers: each worker reads shards "
                f"of its own, so prepare it with ps-prepare --shards {world} or more"
            )
        return list(range(rank, len(shards), world))

    def samples_per_epoch(self, world: int) -> int:
        """Samples every rank takes per epoch: the smallest rank's share, so that all run the same steps."""
        shards = self.manifest.splits["train"].shards
        return min(sum(shards[i].samples for i in self.assignment(r, world)) for r in range(world))

    def plan(self, rank: int, world: int, *, seed: int, epoch: int, start: int = 0) -> list[Part]:
        """The shards and rows rank `rank` reads in `epoch`, from sample `start` of the epoch on: its shards in
        an order drawn from (seed, epoch), each one's rows permuted by (seed, epoch, shard), cut at the epoch's
        length; the shards wholly before `start` left out."""
        shards = self.manifest.splits["train"].shards
        mine = self.assignment(rank, world)
        limit = self.samples_per_epoch(world)
        if not 0 <= start <= limit:
            raise ValueError(f"start must be in [0, {limit}], got {start}")
        order = np.random.default_rng([seed, epoch]).permutation(len(mine))
        parts, at = [], 0
        for k in order:
            index = mine[k]
            shard = shards[index]
            take = min(shard.samples, limit - at)
            if take <= 0:
                break
            if at + take > start:
                rows = np.random.default_rng([seed, epoch, index]).permutation(shard.samples)[:take]
                parts.append(Part(shard, rows[max(0, start - at) :]))
            at += take
        return parts

    def batches(
        self, rank: int, world: int, batch_size: int, *, seed: int, epoch: int, start: int = 0
    ) -> Generator[tuple[Batch, torch.Tensor], None, None]:
        """(x, y) batches of this rank's samples of `epoch` from sample `start` on; the epoch's last batch may be
        short. Close the generator to stop its prefetch early."""
        return self._pairs(self.batches_with_ids(rank, world, batch_size, seed=seed, epoch=epoch, start=start))

    def batches_with_ids(
        self, rank: int, world: int, batch_size: int, *, seed: int, epoch: int, start: int = 0
    ) -> Generator[tuple[Batch, torch.Tensor, torch.Tensor], None, None]:
        """As `batches`, with each sample's id (its index in the split) after x and y."""
        if batch_size < 1:
            raise ValueError(f"batch_size must be at least 1, got {batch_size}")
        key = (rank, world, seed)
        reader = self._reader
        if reader is None or reader.key != key or reader.next_epoch != epoch or start:
            # Not where the running reader is (the first epoch, a resumed or an abandoned one): start one here.
            first = self.plan(rank, world, seed=seed, epoch=epoch, start=start)  # bad arguments fail here
            self.close()

            def epochs() -> Iterator[tuple[int, Part | None]]:
                for e in itertools.count(epoch):
                    for part in first if e == epoch else self.plan(rank, world, seed=seed, epoch=e):
                        yield e, part
                    yield e, None  # the epoch's end

            reader = self._reader = _Reader(self, key, epochs())
        return self._batches(reader, epoch, batch_size)

    def reload(self) -> int:
        """Read the manifest again (a dataset that grows: ps-prepare --follow replaces it whole, adding shards);
        return the train shards it lists. A reader already running goes on with the shards it was given."""
        self.manifest = load_manifest(self.spec)
        return len(self.manifest.splits["train"].shards)

    def shard_batches(
        self, index: int, batch_size: int, *, seed: int
    ) -> Generator[tuple[Batch, torch.Tensor], None, None]:
        """(x, y) batches of train shard `index` alone, whole, in an order drawn from (seed, index) (read ahead on a
        reader of its own); the last batch may be short."""
        if batch_size < 1:
            raise ValueError(f"batch_size must be at least 1, got {batch_size}")
        shard = self.manifest.splits["train"].shards[index]
        order = np.random.default_rng([seed, index]).permutation(shard.samples)
        reader = _Reader(self, None, iter([(0, Part(shard, order)), (0, None)]))
        return self._pairs(self._batches(reader, 0, batch_size, own=True))

    def test_batches(self, batch_size: int = 1024) -> Generator[tuple[Batch, torch.Tensor], None, None]:
        """(x, y) batches of the whole test split, in order (read ahead on a reader of their own)."""
        test = self.manifest.splits.get("test")
        parts: list[tuple[int, Part | None]] = [(0, Part(s, np.arange(s.samples))) for s in test.shards] if test else []
        reader = _Reader(self, None, iter([*parts, (0, None)]))
        return self._pairs(self._batches(reader, 0, batch_size, own=True))

    def close(self) -> None:
        """Stop the reader that reads ahead (into the next epoch too); a later `batches` starts another."""
        if self._reader is not None:
            self._reader.stop()
            self._reader = None

    def __enter__(self) -> StreamedDataset:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

    @staticmethod
    def _pairs(
        batches: Generator[tuple[Batch, torch.Tensor, torch.Tensor], None, None],
    ) -> Generator[tuple[Batch, torch.Tensor], None, None]:
        with contextlib.closing(batches):
            for x, y, _ in batches:
                yield x, y

    def _batches(
        self, reader: _Reader, epoch: int, batch_size: int, own: bool = False
    ) -> Generator[tuple[Batch, torch.Tensor, torch.Tensor], None, None]:
        """Batches of `epoch`'s parts as the reader brings them, up to the epoch's end; `own`: stop the reader
        then."""
        pending: list[tuple[np.ndarray, ...]] = []
        held = 0
        reader.next_epoch = None  # taken from now on: only a whole epoch taken leaves the reader at the next one
        try:
            while (columns := reader.take(epoch)) is not None:
                pending.append(columns)
                held += len(columns[0])
                while held >= batch_size:
                    batch, pending = _take(pending, batch_size)
                    held -= batch_size
                    yield _tensors(batch, self.manifest.schema)
            reader.next_epoch = epoch + 1
            if held:
                yield _tensors(_take(pending, held)[0], self.manifest.schema)
        finally:
            if own:
                reader.stop()

    def read(self, part: Part) -> tuple[np.ndarray, ...]:
        """One shard's (x, y, id, then each categorical feature's IDs) rows in the part's order, checked against
        the manifest."""
        url = self.manifest.url(part.shard)
        data = storage.read_bytes(url)
        digest = hashlib.sha256(data).hexdigest()
        if len(data) != part.shard.bytes or digest != part.shard.sha256:
            raise ValueError(
                f"{url} is damaged or was replaced: {len(data)} bytes with SHA-256 {digest[:16]}, the manifest says "
                f"{part.shard.bytes} bytes with {part.shard.sha256[:16]} (copy it again, or prepare the dataset again)"
            )
        x, y, ident, *categorical = decode(data, self.manifest, url)
        if len(ident) != part.shard.samples:
            raise ValueError(f"{url} holds {len(ident)} samples, the manifest says {part.shard.samples}")
        return tuple(column[part.order] for column in (x, y, ident, *categorical))


def decode(data: bytes, manifest: Manifest, where: str) -> tuple[np.ndarray, ...]:
    """A shard's Parquet bytes as numpy: x shaped by the manifest, y, id, then each categorical feature of its schema
    (int64 IDs, or an object array of int64 bags for a multi-hot one)."""
    import pyarrow as pa
    import pyarrow.parquet as pq

    features = manifest.schema.categorical if manifest.schema is not None else ()
    try:
        table = pq.read_table(pa.BufferReader(data))
        x = table.column("x").combine_chunks().flatten().to_numpy()
        y_column = table.column("y").combine_chunks()
        ident = table.column("id").to_numpy()
        categorical = [
            table.column(f.column).combine_chunks().to_numpy(zero_copy_only=False)
            if f.multi_hot
            else table.column(f.column).to_numpy()
            for f in features
        ]
    except (pa.ArrowException, KeyError) as exc:
        raise ValueError(f"{where} is not a shard of this format: {exc}") from None
    n = len(ident)
    if x.size != n * manifest.features:
        raise ValueError(f"{where}: samples of {x.size // max(n, 1)} values, the manifest says {manifest.in_shape}")
    if pa.types.is_fixed_size_list(y_column.type):
        y = y_column.flatten().to_numpy().reshape(n, -1)
    else:
        y = y_column.to_numpy()
    for f, column in zip(features, categorical, strict=True):
        if len(column) != n or (column.dtype != object and column.dtype != np.int64):
            raise ValueError(f"{where}: column {f.column} holds {len(column)} {column.dtype} values for {n} samples")
    return (x.reshape(n, *manifest.in_shape), y, ident, *categorical)


def _take(pending: list[tuple[np.ndarray, ...]], n: int) -> tuple[list[tuple[np.ndarray, ...]], list]:
    """The first n rows of the pending pieces, and what is left of them."""
    out, rest, need = [], [], n
    for piece in pending:
        if need == 0:
            rest.append(piece)
            continue
        size = len(piece[0])
        if size <= need:
            out.append(piece)
            need -= size
        else:
            out.append(tuple(c[:need] for c in piece))
            rest.append(tuple(c[need:] for c in piece))
            need = 0
    return out, rest


def _tensors(pieces: list[tuple[np.ndarray, ...]], schema: Schema | None) -> tuple[Batch, torch.Tensor, torch.Tensor]:
    """One batch from its pieces: (x, y, id), x as Features for a dataset with categorical features."""
    x, y, ident, *categorical = (np.concatenate(c) if len(c) > 1 else c[0] for c in zip(*pieces, strict=True))
    features: Batch
    if schema is None:
        features = torch.from_numpy(np.ascontiguousarray(x, dtype=np.float32))
    else:
        features = features_of(x, {f.name: column for f, column in zip(schema.categorical, categorical, strict=True)})
    return features, torch.from_numpy(np.ascontiguousarray(y)), torch.from_numpy(np.ascontiguousarray(ident))


class _Reader:
    """Reads parts in order on a background thread, at most `prefetch` shards ahead of the consumer: from one
    position on through consecutive epochs (each part tagged with its epoch, each epoch closed by a None), so that
    a new epoch's first shards are read while the last one's batches train (no stall at each epoch's start).
    `next_epoch`: the epoch whose first part the next `take` returns, once a consumer took an epoch whole."""

    def __init__(self, dataset: StreamedDataset, key: object, parts: Iterator[tuple[int, Part | None]]) -> None:
        self.key = key
        self.next_epoch: int | None = None
        self._dataset = dataset
        self._parts = parts
        self._queue: queue.Queue[tuple[int, object]] = queue.Queue(maxsize=dataset.prefetch)
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, name="ps-prefetch", daemon=True)
        self._thread.start()

    def take(self, epoch: int) -> tuple[np.ndarray, np.ndarray, np.ndarray] | None:
        """The next part's rows of `epoch`, or None at its end (waiting for them, the wait counted in the
        dataset's `waited`)."""
        began = time.perf_counter()
        got, item = self._queue.get()
        self._dataset.waited += time.perf_counter() - began
        if isinstance(item, BaseException):
            raise item
        if got != epoch:
            raise RuntimeError(f"the dataset's reader is out of step: a part of epoch {got}, expected {epoch}")
        return item  # type: ignore[return-value]

    def stop(self) -> None:
        self._stop.set()
        while self._thread.is_alive():  # free a put blocked on a full queue
            try:
                self._queue.get_nowait()
            except queue.Empty:
                self._thread.join(0.05)

    def _run(self) -> None:
        epoch = -1
        try:
            for epoch, part in self._parts:
                if self._stop.is_set():
                    return
                rows = None if part is None else self._dataset.read(part)
                self._dataset.fetched += part is not None
                self._put(epoch, rows)
        except BaseException as exc:  # handed to the training loop, which raises it
            self._put(epoch, exc)

    def _put(self, epoch: int, item: object) -> None:
        while not self._stop.is_set():
            try:
                self._queue.put((epoch, item), timeout=0.1)
                return
            except queue.Full:
                continue
