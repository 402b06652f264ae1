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
import sys
import tempfile
from collections.abc import Sequence
from dataclasses import dataclass, replace
from pathlib import Path
from typing import Any

import numpy as np

from paramserver.config import add_arguments, config_field, from_arguments
from worker.data import storage
from worker.data.manifest import MANIFEST, TASKS, Manifest, ShardFile, Split

log = logging.getLogger(__name__)

_IMAGE_SUFFIXES = {".png", ".jpg", ".jpeg", ".bmp", ".gif", ".tif", ".tiff", ".webp"}
_ORDER_SEED = 1  # the fixed shuffle of the training samples before they are cut into shards


@dataclass(frozen=True)
class PrepareConfig:
    """How ps-prepare turns a source into shards."""

    out: str = config_field("", "where to write the shards and manifest.json: a directory, file://, s3://, hdfs://")
    shards: int = config_field(
        8, "train shards to write: at least the number of workers that will read them (each reads its own)"
    )
    test_shards: int | None = config_field(None, "test shards to write (default: as many as a tenth of --shards)")
    normalize: bool = config_field(
        True, "normalise each feature (each channel of an image) by the training split's mean and std"
    )
    image_size: int = config_field(32, "image folders: resize every image to this many pixels square")
    color: str = config_field("rgb", "image folders: rgb (3 channels) or gray (1)", choices=("rgb", "gray"))
    label: str = config_field("label", "CSV/Parquet tables: the label column; the other columns are the features")
    task: str = config_field(
        "auto",
        "tables and .npz: classification (integer or string labels) or regression (numeric targets); auto: "
        "regression when the labels are floats",
        choices=("auto", *TASKS),
    )
    test_fraction: float = config_field(
        0.2,
        "sources with no test split of their own: the share held out for test, as asked (to a line; click logs: "
        "spread evenly, 0.2 every fifth line, 0.6 three of each five)",
    )
    seed: int = config_field(0, "seed of the held-out split of sources that have none")
    compression: str = config_field("zstd", "Parquet compression", choices=("zstd", "snappy", "gzip", "none"))
    categorical: str = config_field(
        "",
        "CSV/Parquet tables of click logs: comma-separated columns that are categorical features (integers kept as "
        "IDs, strings hashed; no vocabulary), the label 0/1 and every other column a dense feature; ps-worker then "
        "trains --model dlrm on it",
    )
    multi_hot: str = config_field(
        "",
        "click-log tables: COLUMN:SEPARATOR[,COLUMN:SEPARATOR...], columns holding bags of IDs as text split on "
        "SEPARATOR (e.g. tags:|)",
    )
    format: str = config_field(
        "auto",
        "auto: the source's own kind (a built-in, .npz, an image folder, a .csv/.parquet table); criteo: Criteo day "
        "files (label, 13 integers, 26 hashes, tab-separated, plain or .gz; several at once) into click-log shards "
        "with a schema for ps-worker --model dlrm (worker/data/clicks.py)",
        choices=("auto", "criteo"),
    )
    progress: bool = config_field(True, "show a progress bar")

    def __post_init__(self) -> None:
        if self.shards < 1:
            raise ValueError(f"shards must be at least 1, not {self.shards}")
        if self.test_shards is not None and self.test_shards < 1:
            raise ValueError(f"test-shards must be at least 1, not {self.test_shards}")
        if self.image_size < 1:
            raise ValueError(f"image-size must be at least 1, not {self.image_size}")
        if not 0 < self.test_fraction < 1:
            raise ValueError(f"test-fraction must be between 0 and 1, not {self.test_fraction}")


@dataclass(frozen=True)
class Arrays:
    """A source read into memory, before normalisation."""

    name: str
    task: str
    x_train: np.ndarray  # float32, (N, *in_shape)
    y_train: np.ndarray  # int64 (N,), or float32 (N,) / (N, k)
    x_test: np.ndarray
    y_test: np.ndarray
    num_classes: int
    classes: tuple[str, ...] = ()


def prepare(source: str | Sequence[str], config: PrepareConfig) -> Manifest:
    """Read `source` (several files for --format criteo), preprocess it and write its shards and manifest under
    `config.out`; return the manifest."""
    if not config.out:
        raise ValueError("say where to write the dataset: --out DIR or URL")
    sources = [source] if isinstance(source, str) else list(source)
    clicks = _click_source(sources, config)
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


def _click_source(sources: list[str], config: PrepareConfig) -> Any:
    """The click-log source these sources and flags name (worker.data.clicks.ClickSource), or None for the rest."""
    if config.format == "criteo":
        from worker.data.clicks import Criteo

        return Criteo(sources)
    if not (config.categorical or config.multi_hot):
        return None
    if len(sources) != 1:
        raise ValueError(f"one table at a time, not {len(sources)}")
    from worker.data.click_tables import Table, parse_multi_hot

    columns = [c.strip() for c in config.categorical.split(",") if c.strip()]
    return Table(sources[0], config.label, columns, parse_multi_hot(config.multi_hot))


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
        return _image_folder(Path(source), config, scratch)
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
    n_test = _test_count(len(x), config)
    test, train = order[:n_test], order[n_test:]
    return x[train], y[train], x[test], y[test]


def _test_count(n: int, config: PrepareConfig) -> int:
    """How many of a source's n samples a source without a test split of its own holds out."""
    return max(1, round(n * config.test_fraction)) if n > 1 else 0


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


def _image_folder(root: Path, config: PrepareConfig, scratch: Path) -> Arrays:
    try:
        from PIL import Image
    except ImportError:
        raise ImportError("image folders need Pillow: pip install pillow") from None
    splits = [root / "train", root / "test"] if (root / "train").is_dir() and (root / "test").is_dir() else [root]
    classes = tuple(sorted(p.name for p in splits[0].iterdir() if p.is_dir()))
    if not classes:
        raise ValueError(f"{root} has no class folders: expected {root}/CLASS/IMAGE (or train/ and test/ above them)")
    mode, channels = ("RGB", 3) if config.color == "rgb" else ("L", 1)
    size = config.image_size

    def listed(folder: Path) -> list[tuple[int, Path]]:
        files = [
            (label, p)
            for label, name in enumerate(classes)
            if (folder / name).is_dir()
            for p in sorted((folder / name).iterdir())
            if p.suffix.lower() in _IMAGE_SUFFIXES
        ]
        if not files:
            raise ValueError(f"{folder} holds no images ({', '.join(sorted(_IMAGE_SUFFIXES))})")
        return files

    def load(files: list[tuple[int, Path]], name: str) -> tuple[np.ndarray, np.ndarray]:
        """The images' pixels, resized, as uint8 (N, C, H, W) in a file mapped from disk: a quarter of float32's
        size, and out of memory, however many images there are."""
        pixels = np.lib.format.open_memmap(
            scratch / f"{name}.npy", mode="w+", dtype=np.uint8, shape=(len(files), channels, size, size)
        )
        todo = files
        if config.progress:  # decoding and resizing is the slow part of preparing an image folder
            from tqdm import tqdm

            todo = tqdm(files, desc=f"reading {name}", unit="image", dynamic_ncols=True)
        for i, (_, p) in enumerate(todo):
            try:
                with Image.open(p) as img:
                    a = np.asarray(img.convert(mode).resize((size, size), Image.Resampling.BILINEAR))
            except OSError as exc:
                raise ValueError(f"{p} is not an image Pillow can read: {exc}") from None
            pixels[i] = a[None] if a.ndim == 2 else a.transpose(2, 0, 1)
        return pixels, np.array([label for label, _ in files], dtype=np.int64)

    if len(splits) == 2:
        (x_train, y_train), (x_test, y_test) = load(listed(splits[0]), "train"), load(listed(splits[1]), "test")
    else:
        files = listed(root)
        order = np.random.default_rng(config.seed).permutation(len(files))
        n_test = _test_count(len(files), config)
        x_test, y_test = load([files[i] for i in sorted(order[:n_test])], "test")
        x_train, y_train = load([files[i] for i in sorted(order[n_test:])], "train")
    return Arrays(root.name, "classification", x_train, y_train, x_test, y_test, len(classes), classes)


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

Then train from it: ps-worker --server HOST:PORT --dataset /data/digits (or the URL of its manifest.json, e.g.
http://files/digits/manifest.json); each worker streams the shards of its rank.
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
        nargs="+",
        help="digits, synthetic, a .npz with x_train/y_train/x_test/y_test, a folder of class folders of images, "
        "or a .csv/.parquet table (path or URL); with --format criteo, Criteo day files (one or more)",
    )
    add_arguments(parser, PrepareConfig)
    return parser


def main(argv: Sequence[str] | None = None) -> int:
    """Entry point of ps-prepare."""
    args = build_parser().parse_args(argv)
    logging.basicConfig(level="WARNING", format="%(asctime)s %(levelname)s %(name)s: %(message)s")
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


if __name__ == "__main__":
    sys.exit(main())
