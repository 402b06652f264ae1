"""A prepared dataset's manifest: what `ps-prepare` wrote (its shards, their sample counts, sizes and SHA-256
sums, the sample and target shapes, the normalisation applied, the splits), read back by the streaming reader.

The manifest is `manifest.json` beside the shards; shard paths in it are relative to its directory, so a dataset
can be copied or served from anywhere. It is written last: a dataset whose manifest exists is whole.

The shards are Parquet files with three columns: `id` (int64, the sample's index within its split, so a reader's
coverage can be checked), `x` (fixed-size list of float32: one sample flattened; `in_shape` restores it) and `y`
(int64 class labels, or float32 targets, a fixed-size list when a target has several values).

A dataset with categorical features (click logs: `ps-prepare --format criteo`, or a table with `--categorical`) has
a `schema`: `x` then holds its dense features (`schema.dense`, in that order; `in_shape` is `[len(dense)]`), `y` the
int64 0/1 label (a classification of 2 classes), and each categorical feature is one more column, `cat_<name>`:
int64 IDs, or a list of int64 IDs for a multi-hot feature (a bag). IDs are raw (no vocabulary): a missing value is
`MISSING_ID`, the same in every column.

A dataset that `ps-prepare --follow` grows (docs/continuous.md) also lists the source files it took (`files`: each
one's name, size and version, and the shards it became, in the order taken) and those it refused (`rejected`, with
the reason); both are absent from other manifests. Its splits only grow: a later manifest's shard lists start with
the earlier one's, unchanged.
"""

from __future__ import annotations

import json
import math
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any

from worker.data import storage

FORMAT = "paramserver-shards"
VERSION = 1
MANIFEST = "manifest.json"
TASKS = ("classification", "regression")
SPLITS = ("train", "test")


@dataclass(frozen=True)
class ShardFile:
    """One Parquet file of a split."""

    path: str  # relative to the manifest's directory
    samples: int
    bytes: int
    sha256: str


@dataclass(frozen=True)
class Split:
    """The shards of one split, in order (ids run on from one shard to the next)."""

    samples: int
    shards: tuple[ShardFile, ...]


MISSING_ID = -(2**63)  # the ID of a missing categorical value, in every column (an ID of its own per table)
CATEGORICAL_PREFIX = "cat_"  # a categorical feature's Parquet column is this prefix and its name


@dataclass(frozen=True)
class Categorical:
    """One categorical feature of a schema."""

    name: str
    multi_hot: bool = False  # a bag of IDs per sample (a Parquet list column), else one ID
    distinct: int = 0  # distinct IDs seen in the training split (0: not counted)
    distinct_exact: bool = True  # whether `distinct` is exact or an estimate (a sketch's)

    @property
    def column(self) -> str:
        return CATEGORICAL_PREFIX + self.name


@dataclass(frozen=True)
class Schema:
    """The features of a dataset with categorical columns: the dense ones (the `x` column, in this order, after
    `dense_transform`: "log1p" is log(1 + max(x, 0)) as DLRM's Criteo preprocessing, "none" as read) and the
    categorical ones."""

    dense: tuple[str, ...]
    categorical: tuple[Categorical, ...]
    dense_transform: str = "none"


@dataclass(frozen=True)
class SourceFile:
    """A source file `ps-prepare --follow` took, and the shards it became."""

    name: str  # its path under the followed directory or prefix
    size: int  # bytes, when it was taken
    version: str  # its ETag or modification time then (storage.Listed.version)
    landed: float  # Unix time the follower first saw it (its clock; a restarted follower's first listing)
    prepared: float  # Unix time its shards were stored, just before the manifest listing them
    seconds: float  # spent preparing it (reading it, writing and storing its shards)
    train: tuple[str, ...]  # its shards' paths in the train split (consecutive there)
    train_samples: int
    test: tuple[str, ...] = ()  # and in the test split (none where it held no line out)
    test_samples: int = 0


@dataclass(frozen=True)
class Rejected:
    """A source file `ps-prepare --follow` refused: nothing of it is in the dataset; it is judged again if its size
    or version changes."""

    name: str
    size: int
    version: str
    reason: str  # one line: what is wrong with it
    at: float  # Unix time it was refused


@dataclass(frozen=True)
class Manifest:
    """What a prepared dataset holds; `base` is the URL of the directory it was read from (not stored)."""

    name: str
    task: str
    in_shape: tuple[int, ...]
    num_classes: int  # classes, or the number of target values of a regression
    splits: dict[str, Split]
    normalization: dict[str, Any] = field(default_factory=dict)  # {"axis": ..., "mean": [...], "std": [...]}
    source: str = ""
    classes: tuple[str, ...] = ()  # class names, where the source named them (image folders, string labels)
    schema: Schema | None = None  # the features of a dataset with categorical columns (click logs); else None
    files: tuple[SourceFile, ...] = ()  # ps-prepare --follow: the source files taken, in order
    rejected: tuple[Rejected, ...] = ()  # ps-prepare --follow: the source files refused
    base: str = ""

    def url(self, shard: ShardFile) -> str:
        """Where a shard is."""
        return storage.join(self.base, shard.path)

    @property
    def features(self) -> int:
        """Values in one sample."""
        return math.prod(self.in_shape)

    def to_json(self) -> str:
        doc = {"format": FORMAT, "version": VERSION, **asdict(self)}
        del doc["base"]
        if doc["schema"] is None:
            del doc["schema"]  # the manifests of datasets without categorical columns stay as they were
        for key in ("files", "rejected"):
            if not doc[key]:
                del doc[key]  # and those not grown by ps-prepare --follow
        return json.dumps(doc, indent=2) + "\n"


def manifest_url(spec: str) -> str:
    """The manifest's URL for a dataset named by its manifest or by its directory."""
    return spec if spec.endswith(".json") else storage.join(spec, MANIFEST)


def is_prepared(spec: str) -> bool:
    """Whether a --dataset value names a prepared dataset (a URL, a manifest, or a directory holding one) rather
    than a built-in dataset or an .npz file."""
    return "://" in spec or spec.endswith(".json") or Path(spec, MANIFEST).is_file()


def load_manifest(spec: str) -> Manifest:
    """Read and check the manifest of the dataset at `spec` (its manifest's URL or its directory's)."""
    url = manifest_url(spec)
    raw = storage.read_bytes(url)
    try:
        doc = json.loads(raw)
    except (UnicodeDecodeError, json.JSONDecodeError) as exc:
        raise ValueError(f"{url} is not a JSON manifest: {exc}") from None
    return parse(doc, base=url.rsplit("/", 1)[0] if "/" in url else ".", where=url)


def parse(doc: Any, *, base: str, where: str) -> Manifest:
    """A Manifest from its JSON document; ValueError saying what is wrong with it."""

    def fail(what: str) -> ValueError:
        return ValueError(f"{where}: {what} (prepare the dataset again with ps-prepare)")

    if not isinstance(doc, dict) or doc.get("format") != FORMAT:
        raise fail(f"not a {FORMAT} manifest")
    if doc.get("version") != VERSION:
        raise fail(f"manifest version {doc.get('version')!r}; this paramserver reads version {VERSION}")
    try:
        splits = {
            name: Split(
                int(s["samples"]),
                tuple(
                    ShardFile(str(f["path"]), int(f["samples"]), int(f["bytes"]), str(f["sha256"])) for f in s["shards"]
                ),
            )
            for name, s in doc["splits"].items()
        }
        manifest = Manifest(
            name=str(doc["name"]),
            task=str(doc["task"]),
            in_shape=tuple(int(d) for d in doc["in_shape"]),
            num_classes=int(doc["num_classes"]),
            splits=splits,
            normalization=dict(doc.get("normalization") or {}),
            source=str(doc.get("source", "")),
            classes=tuple(str(c) for c in doc.get("classes") or ()),
            schema=_schema(doc["schema"]) if doc.get("schema") is not None else None,
            files=tuple(_source_file(f) for f in doc.get("files") or ()),
            rejected=tuple(
                Rejected(str(r["name"]), int(r["size"]), str(r["version"]), str(r["reason"]), float(r["at"]))
                for r in doc.get("rejected") or ()
            ),
            base=base,
        )
    except (KeyError, TypeError, ValueError, AttributeError) as exc:
        raise fail(f"malformed manifest ({type(exc).__name__}: {exc})") from None
    if manifest.task not in TASKS:
        raise fail(f"task {manifest.task!r} is not one of {', '.join(TASKS)}")
    if "train" not in splits or not splits["train"].shards:
        raise fail("no train shards")
    for name, split in splits.items():
        if sum(f.samples for f in split.shards) != split.samples:
            raise fail(f"the {name} shards' sample counts do not add up to {split.samples}")
        if any(f.samples < 1 or ".." in f.path.split("/") or f.path.startswith("/") for f in split.shards):
            raise fail(f"a {name} shard is empty or lies outside the dataset's directory")
    if manifest.schema is not None:
        schema = manifest.schema
        if manifest.in_shape != (len(schema.dense),) or manifest.task != "classification":
            raise fail(f"a schema of {len(schema.dense)} dense features with samples of shape {manifest.in_shape}")
        names = [c.name for c in schema.categorical]
        if not names or len(set(names)) != len(names) or schema.dense_transform not in DENSE_TRANSFORMS:
            raise fail("a schema needs categorical features of distinct names and a known dense transform")
    elif not manifest.in_shape or min(manifest.in_shape) < 1 or manifest.num_classes < 1:
        raise fail(f"sample shape {manifest.in_shape} or {manifest.num_classes} outputs")
    paths = {name: {f.path for f in split.shards} for name, split in splits.items()}
    for f in manifest.files:
        if not set(f.train) <= paths["train"] or not set(f.test) <= paths.get("test", set()):
            raise fail(f"the shards of source file {f.name} are not all in the splits")
    return manifest


DENSE_TRANSFORMS = ("none", "log1p")


def _schema(doc: Any) -> Schema:
    return Schema(
        dense=tuple(str(d) for d in doc["dense"]),
        categorical=tuple(
            Categorical(
                str(c["name"]),
                bool(c.get("multi_hot", False)),
                int(c.get("distinct", 0)),
                bool(c.get("distinct_exact", True)),
            )
            for c in doc["categorical"]
        ),
        dense_transform=str(doc.get("dense_transform", "none")),
    )


def _source_file(doc: Any) -> SourceFile:
    return SourceFile(
        name=str(doc["name"]),
        size=int(doc["size"]),
        version=str(doc["version"]),
        landed=float(doc["landed"]),
        prepared=float(doc["prepared"]),
        seconds=float(doc["seconds"]),
        train=tuple(str(p) for p in doc["train"]),
        train_samples=int(doc["train_samples"]),
        test=tuple(str(p) for p in doc.get("test") or ()),
        test_samples=int(doc.get("test_samples", 0)),
    )
