"""Stream a prepared dataset (see worker/manifest.py) into a worker: the shards of its rank, in an order shuffled
per epoch, fetched and decoded ahead of the step by a background thread, with memory bounded by the prefetch depth
rather than by the dataset.

A worker's place in the data is (epoch, samples taken in it). Every rank takes the same number of samples per
epoch (the smallest rank's share), so in a sync job the servers' version says exactly where each worker is: a
worker that restarts starts at that position, and shards before it are skipped unread.
"""

from __future__ import annotations

import hashlib
import queue
import threading
import time
from collections.abc import Iterator
from dataclasses import dataclass

import numpy as np
import torch

from worker import storage
from worker.manifest import Manifest, ShardFile, load_manifest


@dataclass(frozen=True)
class Part:
    """What one shard contributes to an epoch: its samples from `skip` on, in the epoch's order."""

    shard: ShardFile
    order: np.ndarray  # row indices within the shard, this epoch's permutation, already past the skipped ones


class StreamedDataset:
    """A prepared dataset read shard by shard from its storage (path, file://, s3://, hdfs://, http(s)://)."""

    def __init__(self, spec: str, prefetch: int = 2) -> None:
        if prefetch < 1:
            raise ValueError(f"prefetch must be at least 1 shard, not {prefetch}")
        self.manifest: Manifest = load_manifest(spec)
        self.prefetch = prefetch
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

    @property
    def num_test(self) -> int:
        test = self.manifest.splits.get("test")
        return test.samples if test else 0

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
        self, rank: int, world: int, batch_size: int, *, seed: int, epoch: int, start: int = 0, ids: bool = False
    ) -> Iterator[tuple[torch.Tensor, ...]]:
        """(x, y) batches (with each sample's id after them when `ids`) of this rank's samples of `epoch` from
        sample `start` on; the epoch's last batch may be short."""
        if batch_size < 1:
            raise ValueError(f"batch_size must be at least 1, got {batch_size}")
        return self._batches(self.plan(rank, world, seed=seed, epoch=epoch, start=start), batch_size, ids)

    def test_batches(self, batch_size: int = 1024) -> Iterator[tuple[torch.Tensor, ...]]:
        """(x, y) batches of the whole test split, in order."""
        test = self.manifest.splits.get("test")
        parts = [Part(s, np.arange(s.samples)) for s in test.shards] if test else []
        return self._batches(parts, batch_size, False)

    def _batches(self, parts: list[Part], batch_size: int, ids: bool) -> Iterator[tuple[torch.Tensor, ...]]:
        pending: list[tuple[np.ndarray, ...]] = []
        held = 0
        with _Prefetcher(self, parts) as fetched:
            for columns in fetched:
                pending.append(columns)
                held += len(columns[0])
                while held >= batch_size:
                    batch, pending = _take(pending, batch_size)
                    held -= batch_size
                    yield _tensors(batch, ids)
            if held:
                yield _tensors(_take(pending, held)[0], ids)

    def read(self, part: Part) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
        """One shard's (x, y, id) rows in the part's order, checked against the manifest."""
        url = self.manifest.url(part.shard)
        data = storage.read_bytes(url)
        digest = hashlib.sha256(data).hexdigest()
        if len(data) != part.shard.bytes or digest != part.shard.sha256:
            raise ValueError(
                f"{url} is damaged or was replaced: {len(data)} bytes with SHA-256 {digest[:16]}, the manifest says "
                f"{part.shard.bytes} bytes with {part.shard.sha256[:16]} (copy it again, or prepare the dataset again)"
            )
        x, y, ident = decode(data, self.manifest, url)
        if len(ident) != part.shard.samples:
            raise ValueError(f"{url} holds {len(ident)} samples, the manifest says {part.shard.samples}")
        return x[part.order], y[part.order], ident[part.order]


def decode(data: bytes, manifest: Manifest, where: str) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    """A shard's Parquet bytes as numpy (x shaped by the manifest, y, id)."""
    import pyarrow as pa
    import pyarrow.parquet as pq

    try:
        table = pq.read_table(pa.BufferReader(data))
        x = table.column("x").combine_chunks().flatten().to_numpy()
        y_column = table.column("y").combine_chunks()
        ident = table.column("id").to_numpy()
    except (pa.ArrowException, KeyError) as exc:
        raise ValueError(f"{where} is not a shard of this format: {exc}") from None
    n = len(ident)
    if x.size != n * manifest.features:
        raise ValueError(f"{where}: samples of {x.size // max(n, 1)} values, the manifest says {manifest.in_shape}")
    if pa.types.is_fixed_size_list(y_column.type):
        y = y_column.flatten().to_numpy().reshape(n, -1)
    else:
        y = y_column.to_numpy()
    return x.reshape(n, *manifest.in_shape), y, ident


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


def _tensors(pieces: list[tuple[np.ndarray, ...]], ids: bool) -> tuple[torch.Tensor, ...]:
    x = np.concatenate([p[0] for p in pieces]) if len(pieces) > 1 else pieces[0][0]
    y = np.concatenate([p[1] for p in pieces]) if len(pieces) > 1 else pieces[0][1]
    out = (torch.from_numpy(np.ascontiguousarray(x, dtype=np.float32)), torch.from_numpy(np.ascontiguousarray(y)))
    if ids:
        return (*out, torch.from_numpy(np.concatenate([p[2] for p in pieces])))
    return out


_DONE = object()


class _Prefetcher:
    """Reads the parts in order on a background thread, at most `prefetch` shards ahead of the consumer."""

    def __init__(self, dataset: StreamedDataset, parts: list[Part]) -> None:
        self._dataset = dataset
        self._parts = parts
        self._queue: queue.Queue[object] = queue.Queue(maxsize=dataset.prefetch)
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, name="ps-prefetch", daemon=True)

    def __enter__(self) -> Iterator[tuple[np.ndarray, ...]]:
        self._thread.start()
        return self._items()

    def __exit__(self, *exc: object) -> None:
        self._stop.set()
        while self._thread.is_alive():  # free a put blocked on a full queue
            try:
                self._queue.get_nowait()
            except queue.Empty:
                self._thread.join(0.05)

    def _items(self) -> Iterator[tuple[np.ndarray, ...]]:
        while True:
            began = time.perf_counter()
            item = self._queue.get()
            self._dataset.waited += time.perf_counter() - began
            if item is _DONE:
                return
            if isinstance(item, BaseException):
                raise item
            yield item  # type: ignore[misc]

    def _run(self) -> None:
        try:
            for part in self._parts:
                if self._stop.is_set():
                    return
                item: object = self._dataset.read(part)
                self._dataset.fetched += 1
                self._put(item)
        except BaseException as exc:  # handed to the training loop, which raises it
            self._put(exc)
            return
        self._put(_DONE)

    def _put(self, item: object) -> None:
        while not self._stop.is_set():
            try:
                self._queue.put(item, timeout=0.1)
                return
            except queue.Full:
                continue
