"""ps-prepare for click logs: Criteo's day files (`--format criteo`) into shards with a schema (see manifest.py).

Criteo's Kaggle and 1TB layout: one impression a line, tab-separated: the label (0/1), 13 integer features (I1-I13,
negative or empty sometimes) and 26 categorical ones (C1-C26, 8-hex-digit hashes, empty when missing). Plain or
gzip, one or several files, their lines in the order given.

- Dense features: log(1 + x), negative and missing values as 0 (DLRM's preprocessing), then normalised with the
  training lines' mean and standard deviation (the manifest's `normalization`).
- Categorical features: the hash parsed as an integer, kept as the int64 ID with no vocabulary pass (the tables are
  unbounded hash tables); a missing value is MISSING_ID. The manifest's schema counts each feature's distinct IDs in
  the training lines with a k-minimum-values sketch of the IDs' mix64 hashes: exact below 4,096 distinct IDs, an
  estimate above (standard error about 1/sqrt(4,096) = 1.6 %; within 5 % in tests/test_clicks.py); `distinct_exact`
  says which.
- The held-out split is --test-fraction of the lines exactly (to a line), spread evenly: line i (from 0) is held out
  when floor((i + 1) f) > floor(i f), f the fraction as a ratio of integers (0.2: every 5th line; 0.6: 3 lines of
  each 5); deterministic, and spread over the days.
- `prepare_part` (ps-prepare --follow, worker/data/follow.py) prepares one file more of a growing dataset: shards
  named by the file's place, ids running on from the dataset's, each shard's ids consecutive, the dataset's
  normalisation kept; its manifest is the caller's to merge.
- Memory follows the block, not the input: the files are read twice as a stream of pyarrow CSV blocks (4 MiB of
  text each), the first pass for the dense statistics and the line count, the second to write. Each block's
  training lines are cut into `--shards` consecutive pieces, one appended to each shard file (as a Parquet row
  group on local disk), so every shard holds lines of every block; the finished files are then stored one at a time
  with their size and SHA-256, and the manifest last.
"""

from __future__ import annotations

import gzip
import hashlib
import tempfile
from collections.abc import Iterator, Mapping, Sequence
from dataclasses import dataclass
from fractions import Fraction
from pathlib import Path
from typing import Any, Protocol

import numpy as np

from paramserver.tables import mix64
from worker.data import storage
from worker.data.manifest import MANIFEST, MISSING_ID, Categorical, Manifest, Schema, ShardFile, Split

DENSE = tuple(f"I{i}" for i in range(1, 14))
CATEGORICAL = tuple(f"C{i}" for i in range(1, 27))
COLUMNS = ("label", *DENSE, *CATEGORICAL)
# Text per CSV block. pyarrow's reader runs a few dozen blocks ahead, and each block's lines make one row group per
# shard: 4 MiB measured best of 256 KiB-16 MiB (peak RSS 352 MB for 108 MB of Criteo lines and 412 MB for 431 MB,
# against 369 MB at 1 MiB and 952 MB for 216 MB at 16 MiB; smaller blocks were slower: 41.7 s at 256 KiB for 17.6 s).
BLOCK_BYTES = 4 << 20
SKETCH = 4096  # the distinct-count sketch's k

_NIBBLE = np.full(256, 255, dtype=np.uint8)
for _i, _c in enumerate(b"0123456789abcdef"):
    _NIBBLE[_c] = _i
    _NIBBLE[ord(chr(_c).upper())] = _i
_SHIFTS = np.arange(28, -1, -4, dtype=np.int64)


class _Distinct:
    """A k-minimum-values sketch of the distinct IDs seen: the k smallest distinct 64-bit hashes."""

    def __init__(self, k: int = SKETCH) -> None:
        self.k = k
        self.smallest = np.empty(0, dtype=np.uint64)

    def add(self, ids: np.ndarray) -> None:
        hashes = np.union1d(self.smallest, mix64(ids.view(np.uint64)))
        self.smallest = hashes[: self.k]  # union1d sorts

    def count(self) -> tuple[int, bool]:
        """(distinct IDs, exact): exact while fewer than k were seen."""
        if len(self.smallest) < self.k:
            return len(self.smallest), True
        kth = (float(self.smallest[-1]) + 1.0) / 2.0**64
        return round((self.k - 1) / kth), False


def hex_ids(column: Any, where: str, first_line: int = 0) -> np.ndarray:
    """A pyarrow string column of 8-hex-digit hashes as int64 IDs (empty or null: MISSING_ID), vectorised over the
    column's buffers; ValueError naming `where` and the file's line for anything else (`first_line`: the file's
    lines before the column's first)."""
    import pyarrow as pa

    column = column.combine_chunks() if isinstance(column, pa.ChunkedArray) else column
    if not pa.types.is_string(column.type):
        column = column.cast(pa.string())
    n = len(column)
    offsets = np.frombuffer(column.buffers()[1], dtype=np.int32)[column.offset : column.offset + n + 1]
    data = (
        np.frombuffer(column.buffers()[2], dtype=np.uint8) if column.buffers()[2] is not None else np.empty(0, np.uint8)
    )
    lengths = np.diff(offsets)
    valid = ~column.is_null().to_numpy(zero_copy_only=False) & (lengths > 0)
    if (lengths[valid] != 8).any():
        bad = int(np.flatnonzero(valid & (lengths != 8))[0])
        raise ValueError(f"{where}: line {first_line + bad + 1}: {column[bad]} is not an 8-hex-digit hash")
    starts = offsets[:-1][valid]
    nibbles = _NIBBLE[data[starts[:, None] + np.arange(8)]]
    if (nibbles == 255).any():
        bad = int(np.flatnonzero(valid)[np.flatnonzero((nibbles == 255).any(1))[0]])
        raise ValueError(f"{where}: line {first_line + bad + 1}: {column[bad]} is not an 8-hex-digit hash")
    out = np.full(n, MISSING_ID, dtype=np.int64)
    out[valid] = (nibbles.astype(np.int64) << _SHIFTS).sum(1)
    return out


def _open(url: str) -> Any:
    fs, path = storage.filesystem(url)
    raw = fs.open(path, "rb")
    return raw, (gzip.GzipFile(fileobj=raw) if url.endswith(".gz") else raw)


def _blocks(files: Sequence[str], dense_only: bool, bar: Any) -> Iterator[tuple[str, Any]]:
    """Each file's CSV blocks as pyarrow record batches (only the label and dense columns if `dense_only`)."""
    import pyarrow as pa

    types = {"label": pa.int64(), **{c: pa.int64() for c in DENSE}, **{c: pa.string() for c in CATEGORICAL}}
    for url in files:
        raw, stream = _open(url)
        try:
            for batch, at in _read_csv(stream, raw, types, dense_only, url):
                if bar is not None:
                    bar.update(at)
                yield url, batch
        finally:
            stream.close()
            raw.close()


def _read_csv(stream: Any, raw: Any, types: dict[str, Any], dense_only: bool, url: str) -> Iterator[tuple[Any, int]]:
    """The record batches of one file, each with the bytes of the file read since the last one."""
    import pyarrow as pa
    import pyarrow.csv as csv

    at = 0
    try:
        reader = csv.open_csv(
            stream,
            read_options=csv.ReadOptions(column_names=list(COLUMNS), block_size=BLOCK_BYTES, use_threads=False),
            parse_options=csv.ParseOptions(delimiter="\t", quote_char=False),
            convert_options=csv.ConvertOptions(
                column_types=types,
                strings_can_be_null=True,
                include_columns=["label", *DENSE] if dense_only else list(COLUMNS),
            ),
        )
        for batch in reader:
            now = raw.tell()
            yield batch, now - at
            at = now
    except pa.ArrowInvalid as exc:
        raise ValueError(f"{url} is not a Criteo day file (label, 13 integers, 26 hashes): {exc}") from None


def _dense(batch: Any) -> np.ndarray:
    """log(1 + x) of the 13 integer features, negative and missing values as 0: float64 [n, 13]."""
    values = np.stack([batch.column(c).fill_null(0).to_numpy(zero_copy_only=False) for c in DENSE], 1)
    return np.log1p(np.maximum(values, 0).astype(np.float64))


class ClickSource(Protocol):
    """Where click logs come from, block by block: Criteo day files here, a table (worker.data.click_tables)."""

    name: str
    origin: str  # what was read (the manifest's `source`)
    dense: tuple[str, ...]
    dense_transform: str
    features: tuple[Categorical, ...]  # their names and kinds (the counts come from the data)
    size: int  # bytes to read in one pass (for the progress bar)

    def blocks(self, dense_only: bool, bar: Any) -> Iterator[tuple[str, Any]]:
        """(where, a pyarrow record batch) over the whole input, in order."""

    def dense_values(self, batch: Any) -> np.ndarray:
        """The dense features, transformed, float64 [n, len(dense)]."""

    def labels(self, batch: Any, where: str, first_line: int = 0) -> np.ndarray:
        """int64 0/1 labels; ValueError naming `where` and the file's line for anything else (`first_line`: the
        lines of `where` before the batch's first)."""

    def ids(self, batch: Any, where: str, first_line: int = 0) -> dict[str, Any]:
        """Each feature's int64 IDs (a numpy array), or bags (a pyarrow list<int64> array) for a multi-hot one;
        ValueError naming `where` and the file's line for a value that is no ID."""


class Criteo:
    """Criteo day files as a ClickSource."""

    name = "criteo"
    dense = DENSE
    dense_transform = "log1p"
    features = tuple(Categorical(c) for c in CATEGORICAL)

    def __init__(self, files: Sequence[str]) -> None:
        if not files:
            raise ValueError("name the Criteo day files to prepare")
        self.files = list(files)
        self.origin = ",".join(self.files)
        self.size = 0
        for url in self.files:
            fs, path = storage.filesystem(url)
            self.size += int(fs.size(path))

    def blocks(self, dense_only: bool, bar: Any) -> Iterator[tuple[str, Any]]:
        return _blocks(self.files, dense_only, bar)

    def dense_values(self, batch: Any) -> np.ndarray:
        return _dense(batch)

    def labels(self, batch: Any, where: str, first_line: int = 0) -> np.ndarray:
        return checked_labels(batch.column("label"), where, first_line)

    def ids(self, batch: Any, where: str, first_line: int = 0) -> dict[str, Any]:
        return {c: hex_ids(batch.column(c), f"{where}, column {c}", first_line) for c in CATEGORICAL}


def checked_labels(column: Any, where: str, first_line: int = 0) -> np.ndarray:
    """A label column as int64 0/1; ValueError naming `where` and the file's line (`first_line`: the file's lines
    before the column's first) for a missing label or any other value."""
    y = column.fill_null(-1).to_numpy(zero_copy_only=False).astype(np.int64)
    wrong = np.flatnonzero((y != 0) & (y != 1))
    if len(wrong):
        bad = int(wrong[0])
        said = "a missing label" if column[bad].as_py() is None else f"the label {column[bad].as_py()}"
        raise ValueError(
            f"{where}: line {first_line + bad + 1}: {said} is not 0 or 1 (a click log's label says whether it was "
            f"clicked; {len(wrong)} line(s) of this block have such labels)"
        )
    return y


def held_out(first: int, n: int, share: Fraction) -> np.ndarray:
    """Which of lines first .. first + n - 1 (counted over all the input, from 0) are held out: line i when
    floor((i + 1) share) > floor(i share), so any run of lines holds out `share` of them, to a line (integers: no
    rounding of the fraction)."""
    i = np.arange(first, first + n + 1, dtype=np.int64) * share.numerator // share.denominator
    return np.diff(i) > 0


@dataclass(frozen=True)
class Scan:
    """Pass 1 over click logs: the training lines' dense statistics, and each block's lines by split."""

    mean: np.ndarray  # float64 [dense features], of the training lines' transformed dense features
    std: np.ndarray  # likewise; 1 where a feature is constant
    train_blocks: tuple[int, ...]  # training lines per block, in order
    test_blocks: tuple[int, ...]  # held-out lines per block


def scan(source: ClickSource, share: Fraction, bar: Any = None) -> Scan:
    """Pass 1: the dense statistics of the training lines (`share` of the lines held out), and the lines per block."""
    width = len(source.dense)
    total, squares, lines = np.zeros(width), np.zeros(width), 0
    train_blocks, test_blocks = [], []
    for _, batch in source.blocks(True, bar):
        train = ~held_out(lines, batch.num_rows, share)
        x = source.dense_values(batch)[train]
        total += x.sum(0)
        squares += np.square(x).sum(0)
        train_blocks.append(len(x))
        test_blocks.append(batch.num_rows - len(x))
        lines += batch.num_rows
    count = max(1, sum(train_blocks))
    mean = total / count
    std = np.sqrt(np.maximum(squares / count - mean**2, 0.0))
    return Scan(mean, np.where(std > 1e-12, std, 1.0), tuple(train_blocks), tuple(test_blocks))


def share_of(test_fraction: float) -> Fraction:
    """--test-fraction as the ratio of integers `held_out` takes."""
    return Fraction(test_fraction).limit_denominator(1 << 20)


def prepare_clicks(
    source: ClickSource,
    out: str,
    *,
    shards: int,
    test_shards: int | None,
    test_fraction: float,
    compression: str,
    progress: bool,
) -> Manifest:
    """Prepare click logs into `shards` train shards and a test split under `out`; return the manifest."""
    share = share_of(test_fraction)
    bar = None
    if progress:
        from tqdm import tqdm

        bar = tqdm(
            total=2 * source.size, desc=f"ps-prepare {source.name}", unit="B", unit_scale=True, dynamic_ncols=True
        )
    try:
        scanned = scan(source, share, bar)
        if sum(scanned.train_blocks) < shards:
            raise ValueError(f"{sum(scanned.train_blocks)} training lines cannot fill {shards} shards")
        test_count = min(test_shards or max(1, shards // 10), max(1, sum(scanned.test_blocks)))
        with tempfile.TemporaryDirectory(prefix="ps-prepare-clicks-") as scratch:
            plan = _Plan(Path(scratch), out, {"train": shards, "test": test_count}, share, compression)
            splits, distinct = _write(source, plan, scanned.mean, scanned.std, bar)
    finally:
        if bar is not None:
            bar.close()
    manifest = _manifest(source, out, splits, scanned.mean, scanned.std, distinct)
    storage.write_bytes(storage.join(out, MANIFEST), manifest.to_json().encode())  # last: the dataset is whole
    return manifest


def prepare_part(
    source: ClickSource,
    out: str,
    *,
    prefix: str,
    first_ids: Mapping[str, int],
    shards: int,
    test_shards: int | None,
    test_fraction: float,
    compression: str,
    stats: tuple[np.ndarray, np.ndarray] | None = None,
) -> Manifest:
    """Prepare one more part of a growing dataset (ps-prepare --follow: one source file) into shards named
    `prefix`SPLIT-I-of-N.parquet, stored durably under `out`, with ids from `first_ids[split]` on, consecutive from
    one shard to the next; the dense features normalised by `stats` (the dataset's mean and std), or by the part's
    own (the first part). Return the part's own manifest, not stored: the caller appends its splits to the dataset's.
    ValueError when the part holds no training line, or is no click log of this source's kind."""
    share = share_of(test_fraction)
    scanned = scan(source, share)
    if not sum(scanned.train_blocks):
        raise ValueError(f"{source.origin} holds no training lines")
    mean, std = stats if stats is not None else (scanned.mean, scanned.std)
    # Each block deals its lines out to the shards (np.array_split): with no more shards than the largest block has
    # lines of a split, none is empty, and each shard's size is known before a line is written.
    counts = {"train": min(shards, max(scanned.train_blocks))}
    blocks = {"train": scanned.train_blocks}
    if sum(scanned.test_blocks):
        counts["test"] = min(test_shards or max(1, shards // 10), max(scanned.test_blocks))
        blocks["test"] = scanned.test_blocks
    sizes = {split: _dealt(blocks[split], n) for split, n in counts.items()}
    with tempfile.TemporaryDirectory(prefix="ps-prepare-part-") as scratch:
        plan = _Plan(Path(scratch), out, counts, share, compression, prefix, sizes, dict(first_ids), durable=True)
        splits, distinct = _write(source, plan, mean, std, None)
    return _manifest(source, out, splits, mean, std, distinct)


def _dealt(blocks: Sequence[int], shards: int) -> list[int]:
    """Each shard's lines when every block's lines are dealt out as np.array_split cuts them."""
    return [sum(n // shards + (k < n % shards) for n in blocks) for k in range(shards)]


def _manifest(
    source: ClickSource,
    out: str,
    splits: dict[str, Split],
    mean: np.ndarray,
    std: np.ndarray,
    distinct: dict[str, _Distinct],
) -> Manifest:
    return Manifest(
        name=source.name,
        task="classification",
        in_shape=(len(source.dense),),
        num_classes=2,
        splits=splits,
        normalization={"axis": "feature", "mean": mean.tolist(), "std": std.tolist()},
        source=source.origin,
        schema=Schema(
            dense=source.dense,
            categorical=tuple(Categorical(f.name, f.multi_hot, *distinct[f.name].count()) for f in source.features),
            dense_transform=source.dense_transform,
        ),
        base=out,
    )


@dataclass(frozen=True)
class _Plan:
    scratch: Path
    out: str
    counts: dict[str, int]  # shards per split
    share: Fraction  # the held-out fraction of the lines (held_out)
    compression: str
    prefix: str = ""  # of the shards' names
    # Each shard's lines, known beforehand (prepare_part): ids then run on from shard to shard, from first_ids on;
    # None: ids in the order of the lines (a shard holds ids of every block).
    sizes: dict[str, list[int]] | None = None
    first_ids: dict[str, int] | None = None
    durable: bool = False  # fsync each stored shard (a local one) before a manifest names it

    def names(self) -> dict[str, list[str]]:
        return {s: [f"{self.prefix}{s}-{i:05d}-of-{n:05d}.parquet" for i in range(n)] for s, n in self.counts.items()}


def _write(
    source: ClickSource, plan: _Plan, mean: np.ndarray, std: np.ndarray, bar: Any
) -> tuple[dict[str, Split], dict[str, _Distinct]]:
    """Pass 2: each block's lines, transformed, appended to the shard files; then the files stored."""
    import pyarrow as pa
    import pyarrow.parquet as pq

    width = len(source.dense)
    schema = pa.schema(
        [("id", pa.int64()), ("x", pa.list_(pa.float32(), width)), ("y", pa.int64())]
        + [(f.column, pa.list_(pa.int64()) if f.multi_hot else pa.int64()) for f in source.features]
    )
    names = plan.names()
    compression = None if plan.compression == "none" else plan.compression
    writers = {
        s: [
            pq.ParquetWriter(
                plan.scratch / name,
                schema,
                compression=compression,
                use_dictionary=False,
                use_byte_stream_split=["x.list.element"],
            )
            for name in names[s]
        ]
        for s in plan.counts
    }
    held = {s: [0] * n for s, n in plan.counts.items()}
    seen = {s: 0 for s in plan.counts}
    starts = None  # each shard's first id, where its size is known
    if plan.sizes is not None:
        firsts = plan.first_ids or {}
        starts = {s: [firsts.get(s, 0) + sum(n[:k]) for k in range(len(n))] for s, n in plan.sizes.items()}
    distinct = {f.name: _Distinct() for f in source.features}
    lines, in_file, file = 0, 0, None  # lines so far; of them, those of the file the block is from
    try:
        for where, batch in source.blocks(False, bar):
            if where != file:
                in_file, file = 0, where
            test = held_out(lines, batch.num_rows, plan.share)
            lines += batch.num_rows
            x = ((source.dense_values(batch) - mean) / std).astype(np.float32)
            y = source.labels(batch, where, in_file)
            ids = source.ids(batch, where, in_file)
            in_file += batch.num_rows
            for split, rows in (("train", np.flatnonzero(~test)), ("test", np.flatnonzero(test))):
                if split == "train":
                    for f in source.features:
                        distinct[f.name].add(_values(ids[f.name], rows))
                for k, part in enumerate(np.array_split(rows, plan.counts[split]) if len(rows) else ()):
                    if not len(part):
                        continue
                    first = seen[split] if starts is None else starts[split][k] + held[split][k]
                    seen[split] += len(part)
                    held[split][k] += len(part)
                    columns = {
                        "id": pa.array(np.arange(first, first + len(part), dtype=np.int64)),
                        "x": pa.FixedSizeListArray.from_arrays(pa.array(x[part].reshape(-1)), width),
                        "y": pa.array(y[part]),
                        **{f.column: _rows(ids[f.name], part) for f in source.features},
                    }
                    writers[split][k].write_table(pa.table(columns, schema=schema))
            pa.default_memory_pool().release_unused()  # hand a block's buffers back, or the peak creeps up
    finally:
        for ws in writers.values():
            for w in ws:
                w.close()
    if plan.sizes is not None and held != plan.sizes:
        raise ValueError(f"{source.origin} changed while it was read: its lines are not those counted first")
    return _store(plan, names, held, seen), distinct


def _store(
    plan: _Plan, names: dict[str, list[str]], held: dict[str, list[int]], seen: dict[str, int]
) -> dict[str, Split]:
    """Store the finished shard files one at a time, with their sizes and SHA-256 sums."""
    splits = {}
    for split, count in plan.counts.items():
        stored = []
        for name, n in zip(names[split], held[split], strict=True):
            if n == 0:
                raise ValueError(f"too few {split} lines for {count} shards: fewer --shards or --test-shards")
            data = (plan.scratch / name).read_bytes()
            storage.write_bytes(storage.join(plan.out, name), data, durable=plan.durable)
            stored.append(ShardFile(name, n, len(data), hashlib.sha256(data).hexdigest()))
            (plan.scratch / name).unlink()
        splits[split] = Split(seen[split], tuple(stored))
    return splits


def _rows(column: Any, rows: np.ndarray) -> Any:
    """These rows of a feature's IDs (numpy) or bags (a pyarrow list array)."""
    import pyarrow as pa

    return pa.array(column[rows]) if isinstance(column, np.ndarray) else column.take(pa.array(rows))


def _values(column: Any, rows: np.ndarray) -> np.ndarray:
    """The IDs of these rows (a bag's one after the other)."""
    if isinstance(column, np.ndarray):
        return column[rows]
    return np.asarray(_rows(column, rows).flatten().to_numpy(zero_copy_only=False), dtype=np.int64)
