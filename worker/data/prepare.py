"""ps-prepare: preprocess a dataset once into Parquet shards and a manifest, for workers to stream.

Sources: a built-in dataset (digits, synthetic, ...), an .npz file, a folder of images in the class-per-folder
layout (optionally with train/ and test/ folders above the classes), or a CSV or Parquet table with a label column.
The preprocessing is done here, once: images are resized and scaled to 0..1, then every feature (every channel of
an image) is normalised with the mean and standard deviation of the training split, which the manifest records.

Why Parquet (through pyarrow) rather than WebDataset's tar of one file per sample: a sample here is a float tensor
and a label, which Parquet stores as two columns, compressed and read back into numpy without a copy per sample;
pyarrow reads from every fsspec storage (s3fs, HTTP, HDFS); and a row count per file in the manifest lets a worker
resume inside an epoch by skipping whole files unread.
"""

from __future__ import annotations

import argparse
import hashlib
import logging
import signal
import sys
import tempfile
from collections.abc import Sequence
from dataclasses import replace
from pathlib import Path

import numpy as np

from paramserver.config import add_arguments, from_arguments
from worker.data import storage
from worker.data.manifest import MANIFEST, Manifest, ShardFile, Split
from worker.data.sources import Arrays, PrepareConfig, click_source, held_out_count

log = logging.getLogger(__name__)

_ORDER_SEED = 1  # the fixed shuffle of the training samples before they are cut into shards


def prepare(source: str | Sequence[str], config: PrepareConfig) -> Manifest:
    """Read `source` (several files for --format criteo), preprocess it and write its shards and manifest under
    `config.out`; return the manifest."""
    if not config.out:
        raise ValueError("say where to write the dataset: --out DIR or URL")
    sources = [source] if isinstance(source, str) else list(source)
    clicks = click_source(sources, config)
    if clicks is not None:
        from worker.data.clicks import prepare_clicks

        return prepare_clicks(
            clicks,
            config.out,
            shards=config.shards,
            test_shards=config.test_shards,
            test_fraction=config.test_fraction,
            compression=config.compression,
            progress=config.progress,
        )
    if len(sources) != 1:
        raise ValueError(f"one source at a time, not {len(sources)} (only --format criteo takes several files)")
    source = sources[0]
    with tempfile.TemporaryDirectory(prefix="ps-prepare-") as scratch:
        return _prepare(source, config, read_source(source, config, Path(scratch)))


def _prepare(source: str, config: PrepareConfig, arrays: Arrays) -> Manifest:
    if config.shards > len(arrays.x_train):
        raise ValueError(f"{len(arrays.x_train)} training samples cannot fill {config.shards} shards")
    stats = _statistics(arrays.x_train) if config.normalize else None
    order = np.random.default_rng(_ORDER_SEED).permutation(len(arrays.x_train))  # shards of mixed classes
    test_shards = config.test_shards or max(1, config.shards // 10)
    test_shards = min(test_shards, max(1, len(arrays.x_test)))
    plan = [("train", arrays.x_train, arrays.y_train, order, config.shards)]
    if len(arrays.x_test):
        plan.append(("test", arrays.x_test, arrays.y_test, np.arange(len(arrays.x_test)), test_shards))
    bar = None
    if config.progress:
        from tqdm import tqdm

        bar = tqdm(total=sum(n for *_, n in plan), desc="ps-prepare", unit="shard", dynamic_ncols=True)
    splits: dict[str, Split] = {}
    try:
        for split, x, y, rows, count in plan:
            files = []
            for i, (lo, hi) in enumerate(_cuts(len(rows), count)):
                # One shard's rows at a time (in file order: an image folder's pixels are a file on disk), so
                # memory holds a shard, not the split.
                mine = np.sort(rows[lo:hi])
                xs = _values(x[mine])
                if stats is not None:
                    xs = _normalise(xs, *stats)
                name = f"{split}-{i:05d}-of-{count:05d}.parquet"
                data = _encode(np.arange(lo, hi, dtype=np.int64), xs, y[mine], config.compression)
                storage.write_bytes(storage.join(config.out, name), data)
                files.append(ShardFile(name, hi - lo, len(data), hashlib.sha256(data).hexdigest()))
                if bar is not None:
                    bar.update(1)
            splits[split] = Split(len(rows), tuple(files))
    finally:
        if bar is not None:
            bar.close()
    normalization = {}
    if stats is not None:
        normalization = {
            "axis": "channel" if arrays.x_train.ndim == 4 else "feature",
            "mean": [float(v) for v in stats[0].reshape(-1)],
            "std": [float(v) for v in stats[1].reshape(-1)],
        }
    manifest = Manifest(
        name=arrays.name,
        task=arrays.task,
        in_shape=tuple(int(d) for d in arrays.x_train.shape[1:]),
        num_classes=arrays.num_classes,
        splits=splits,
        normalization=normalization,
        source=source,
        classes=arrays.classes,
        base=config.out,
    )
    storage.write_bytes(storage.join(config.out, MANIFEST), manifest.to_json().encode())  # last: the dataset is whole
    return manifest


def read_source(source: str, config: PrepareConfig, scratch: Path) -> Arrays:
    """Read a source: an image folder (its resized pixels into files under the directory `scratch`, which the
    caller removes, as uint8 arrays mapped from disk), a .csv/.parquet table or anything `load_dataset` knows (in
    memory)."""
    suffix = Path(source.split("?")[0]).suffix.lower()
    if suffix in (".csv", ".parquet"):
        return _table(source, config)
    if "://" not in source and Path(source).is_dir():
        from worker.data.images import read_image_folder

        return read_image_folder(Path(source), config, scratch)
    from worker.data.datasets import load_dataset

    data = load_dataset(source)
    task = getattr(data, "task", "classification")
    arrays = Arrays(
        data.name,
        task,
        data.x_train.numpy(),
        data.y_train.numpy(),
        data.x_test.numpy(),
        data.y_test.numpy(),
        data.num_classes,
    )
    return arrays if config.task in ("auto", task) else _as_task(arrays, config.task, source)


def _as_task(arrays: Arrays, task: str, source: str) -> Arrays:
    if task == "regression":
        return replace(arrays, task=task, y_train=_floats(arrays.y_train), y_test=_floats(arrays.y_test), num_classes=1)
    raise ValueError(f"{source} holds regression targets; it cannot be prepared as a classification")


def _floats(y: np.ndarray) -> np.ndarray:
    return np.ascontiguousarray(y, dtype=np.float32)


def _split(
    x: np.ndarray, y: np.ndarray, config: PrepareConfig
) -> tuple[np.ndarray, np.ndarray, np.ndarray, np.ndarray]:
    order = np.random.default_rng(config.seed).permutation(len(x))
    n_test = held_out_count(len(x), config)
    test, train = order[:n_test], order[n_test:]
    return x[train], y[train], x[test], y[test]


def _labels(values: np.ndarray, task: str, where: str) -> tuple[str, np.ndarray, int, tuple[str, ...]]:
    """(task, labels or targets, classes or outputs, class names) from a label column."""
    if task == "auto":
        task = "regression" if np.issubdtype(values.dtype, np.floating) else "classification"
    if task == "regression":
        if not np.issubdtype(values.dtype, np.number):
            raise ValueError(f"{where}: regression targets must be numbers, not {values.dtype}")
        return task, _floats(values), 1, ()
    if np.issubdtype(values.dtype, np.integer):
        if len(values) and values.min() < 0:
            raise ValueError(f"{where}: class labels must be 0 or more")
        return task, values.astype(np.int64), int(values.max()) + 1, ()
    if np.issubdtype(values.dtype, np.floating):
        raise ValueError(f"{where}: float labels are regression targets (say --task regression, or give integers)")
    names = tuple(sorted({str(v) for v in values}))
    index = {n: i for i, n in enumerate(names)}
    return task, np.array([index[str(v)] for v in values], dtype=np.int64), len(names), names


def _table(source: str, config: PrepareConfig) -> Arrays:
    import pyarrow.csv
    import pyarrow.parquet as pq

    fs, path = storage.filesystem(source)
    with fs.open(path, "rb") as f:
        table = pq.read_table(f) if path.lower().endswith(".parquet") else pyarrow.csv.read_csv(f)
    if config.label not in table.column_names:
        raise ValueError(
            f"{source} has no column {config.label!r} (columns: {', '.join(table.column_names)}); "
            "name the label column with --label"
        )
    features = [c for c in table.column_names if c != config.label]
    if not features:
        raise ValueError(f"{source} has no feature columns besides {config.label!r}")
    try:
        x = np.stack([table[c].to_numpy(zero_copy_only=False).astype(np.float32) for c in features], axis=1)
    except (ValueError, TypeError) as exc:
        raise ValueError(f"{source}: every feature column must be numeric ({exc})") from None
    if np.isnan(x).any():
        raise ValueError(f"{source}: the features hold empty or NaN values; fill or drop them first")
    labels = table[config.label].to_numpy(zero_copy_only=False)
    task, y, outputs, classes = _labels(labels, config.task, source)
    return Arrays(Path(path).stem, task, *_split(x, y, config), outputs, classes)


def _values(x: np.ndarray) -> np.ndarray:
    """Samples as float32: an image folder's uint8 pixels scaled to 0..1."""
    return x.astype(np.float32) / 255.0 if x.dtype == np.uint8 else np.asarray(x, dtype=np.float32)


def _statistics(x: np.ndarray, chunk_values: int = 1 << 23) -> tuple[np.ndarray, np.ndarray]:
    """Mean and std per channel of images (N, C, H, W), else per feature, over the training split, a chunk of
    about `chunk_values` values (64 MB as float64) at a time, as an image folder's split is on disk; the chunks are
    merged as Chan et al. merge means and sums of squared deviations. A constant feature keeps std 1 (it is only
    centred)."""
    rows = max(1, chunk_values // max(1, int(np.prod(x.shape[1:]))))
    count, mean, m2 = 0, None, None
    for start in range(0, len(x), rows):
        part = _values(x[start : start + rows]).astype(np.float64)
        # (samples, features, values of each): a channel's pixels, or a feature's one value
        part = part.reshape(len(part), part.shape[1], -1) if part.ndim == 4 else part.reshape(len(part), -1, 1)
        n = part.shape[0] * part.shape[2]
        m = part.mean(axis=(0, 2))
        s = ((part - m[None, :, None]) ** 2).sum(axis=(0, 2))
        if mean is None or m2 is None:
            count, mean, m2 = n, m, s
            continue
        delta = m - mean
        total = count + n
        mean = mean + delta * n / total
        m2 = m2 + s + delta**2 * count * n / total
        count = total
    assert mean is not None and m2 is not None, "statistics of an empty split"
    std = np.sqrt(m2 / count)
    std[std < 1e-8] = 1.0
    return mean.astype(np.float32), std.astype(np.float32)


def _normalise(x: np.ndarray, mean: np.ndarray, std: np.ndarray) -> np.ndarray:
    if x.ndim == 4:
        return (x - mean[None, :, None, None]) / std[None, :, None, None]
    return ((x.reshape(len(x), -1) - mean) / std).reshape(x.shape).astype(np.float32)


def _cuts(n: int, count: int) -> list[tuple[int, int]]:
    """`count` contiguous ranges covering 0..n, their sizes differing by at most one."""
    edges = [n * i // count for i in range(count + 1)]
    return list(zip(edges[:-1], edges[1:], strict=True))


def _encode(ids: np.ndarray, x: np.ndarray, y: np.ndarray, compression: str) -> bytes:
    """One shard as Parquet bytes (the columns manifest.py describes)."""
    import pyarrow as pa
    import pyarrow.parquet as pq

    flat = np.ascontiguousarray(x, dtype=np.float32).reshape(len(x), -1)
    columns = {
        "id": pa.array(ids),
        "x": pa.FixedSizeListArray.from_arrays(pa.array(flat.reshape(-1)), flat.shape[1]),
    }
    if y.ndim == 2:
        columns["y"] = pa.FixedSizeListArray.from_arrays(pa.array(np.ascontiguousarray(y).reshape(-1)), y.shape[1])
    else:
        columns["y"] = pa.array(np.ascontiguousarray(y))
    # Floats rarely repeat: a dictionary only grows the file (3x32x32 samples: 12.6 KB a sample against 11.4) and
    # slows decoding (54 ms a 512-sample shard against 16). Byte-stream-split puts the floats' exponent bytes side
    # by side, where the compressor finds them alike: 10.4 KB, 8 ms.
    floats = ["x.list.element"]
    if y.dtype.kind == "f":
        floats.append("y.list.element" if y.ndim == 2 else "y")
    sink = pa.BufferOutputStream()
    pq.write_table(
        pa.table(columns),
        sink,
        compression=None if compression == "none" else compression,
        use_dictionary=False,
        use_byte_stream_split=floats,
    )
    return bytes(sink.getvalue())


EPILOG = """\
examples:
  ps-prepare digits --out /data/digits --shards 8             the built-in digits, 8 train shards
  ps-prepare ./photos --out s3://bucket/photos --image-size 64  class-per-folder images, resized to 64x64
  ps-prepare table.csv --label price --task regression --out hdfs://nn:8020/data/prices
  ps-prepare day_0.tsv.gz day_1.tsv.gz --format criteo --out s3://bucket/criteo --shards 64   click logs
  ps-prepare clicks.csv --label clicked --categorical user,item --multi-hot tags:'|' --out /data/clicks
  ps-prepare --follow s3://bucket/logs --format criteo --out s3://bucket/live --shards 4   click logs as they land

Then train from it: ps-worker --server HOST:PORT --dataset /data/digits (or the URL of its manifest.json, e.g.
http://files/digits/manifest.json); each worker streams the shards of its rank.

--follow SOURCE watches a directory or prefix (a path, s3://, hdfs://, or http(s):// with an index page) and
prepares each file of click logs that lands there once, as it lands, into a dataset that grows: --shards and
--test-shards count per file, --test-fraction holds out that share of each file, and the first file fixes the schema
and the normalisation. A file is whole at once where its directory holds a _SUCCESS marker, else once its size and
mtime (or ETag) stay the same for --settle-seconds (a plain-text file must also end with a newline); hidden files
(.x, _x) are never taken. A damaged file, or one of another schema, is refused and listed in manifest.json's
"rejected"; the source is never changed. The manifest lists each file taken, so a restarted --follow goes on where
the last one stopped. docs/continuous.md tells more.
"""


def build_parser() -> argparse.ArgumentParser:
    """The ps-prepare argument parser."""
    parser = argparse.ArgumentParser(
        prog="ps-prepare",
        description="Preprocess a dataset once (resize images, normalise with the training split's statistics) "
        "into Parquet shards and a manifest.json, on local disk or object storage, for ps-worker --dataset to "
        "stream.",
        epilog=EPILOG,
        formatter_class=argparse.RawDescriptionHelpFormatter,
    )
    parser.add_argument(
        "source",
        nargs="*",
        help="digits, synthetic, a .npz with x_train/y_train/x_test/y_test, a folder of class folders of images, "
        "or a .csv/.parquet table (path or URL); with --format criteo, Criteo day files (one or more)",
    )
    add_arguments(parser, PrepareConfig)
    from worker.data.follow import FollowConfig

    watch = parser.add_argument_group("following a source as files land in it (--follow)")
    watch.add_argument(
        "--follow",
        metavar="SOURCE",
        default="",
        help="a directory or prefix to watch instead of sources to prepare once: each file of click logs (--format "
        "criteo, or --categorical for CSV/Parquet tables) landing under it is prepared once, into the dataset at "
        "--out, which grows; runs until Ctrl-C, SIGTERM or --stop-when-idle",
    )
    add_arguments(watch, FollowConfig)
    return parser


def main(argv: Sequence[str] | None = None) -> int:
    """Entry point of ps-prepare."""
    parser = build_parser()
    args = parser.parse_args(argv)
    logging.basicConfig(level="WARNING", format="%(asctime)s %(levelname)s %(name)s: %(message)s")
    if bool(args.follow) == bool(args.source):
        parser.error("name the sources to prepare, or one --follow SOURCE (not both)")
    if args.follow:
        return _main_follow(args)
    try:
        config = from_arguments(PrepareConfig, args)
        manifest = prepare(args.source, config)
    except KeyboardInterrupt:
        print(
            "ps-prepare: interrupted; no manifest was written, so no worker reads the partial dataset", file=sys.stderr
        )
        return 130
    except (ValueError, TypeError, FileNotFoundError, ImportError, PermissionError) as exc:
        print(f"ps-prepare: {exc}", file=sys.stderr)
        return 2
    train = manifest.splits["train"]
    test = manifest.splits.get("test")
    print(
        f"ps-prepare: {manifest.name}: {train.samples} train samples in {len(train.shards)} shards"
        + (f", {test.samples} test samples in {len(test.shards)}" if test else "")
        + f", samples of shape {manifest.in_shape}, {manifest.task}; manifest at "
        f"{storage.join(config.out, MANIFEST)}",
        flush=True,
    )
    return 0


def _main_follow(args: argparse.Namespace) -> int:
    """ps-prepare --follow SOURCE: follow until idle, Ctrl-C or SIGTERM; the exit status."""
    from worker.data.follow import FollowConfig, describe, follow
    from worker.data.manifest import Rejected, SourceFile

    def say(record: SourceFile | Rejected, manifest: Manifest | None) -> None:
        refused = isinstance(record, Rejected)
        print(f"ps-prepare: {describe(record, manifest)}", file=sys.stderr if refused else sys.stdout, flush=True)

    def terminated(signum: int, frame: object) -> None:
        raise KeyboardInterrupt("SIGTERM")  # a supervisor's stop: the same clean end as Ctrl-C

    previous = signal.signal(signal.SIGTERM, terminated)
    try:
        config = from_arguments(PrepareConfig, args)
        watch = from_arguments(FollowConfig, args)
        if not config.out:
            raise ValueError("say where the dataset grows: --out DIR or URL")
        manifest = follow(args.follow, config.out, config, watch, on_file=say)
    except KeyboardInterrupt:
        print(
            "ps-prepare: stopped; the manifest lists every file prepared whole, and ps-prepare --follow goes on "
            "from there",
            file=sys.stderr,
        )
        return 130
    except (ValueError, TypeError, FileNotFoundError, ImportError, PermissionError) as exc:
        print(f"ps-prepare: {exc}", file=sys.stderr)
        return 2
    finally:
        signal.signal(signal.SIGTERM, previous)
    if manifest is None:
        print(f"ps-prepare: idle for {watch.stop_when_idle} s; no file prepared yet", flush=True)
        return 0
    train = manifest.splits["train"]
    print(
        f"ps-prepare: idle for {watch.stop_when_idle} s: {len(manifest.files)} files, {train.samples} train samples "
        f"in {len(train.shards)} shards, {len(manifest.rejected)} files refused; manifest at "
        f"{storage.join(config.out, MANIFEST)}",
        flush=True,
    )
    return 0


if __name__ == "__main__":
    sys.exit(main())
