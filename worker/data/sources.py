"""What ps-prepare reads and how: its config (PrepareConfig, the flags of `ps-prepare`), a source read into memory
(Arrays), and the click-log source its flags name; shared by the batch preparation (prepare.py), image folders
(images.py) and the follow loop (follow.py), so that none of them imports another."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import numpy as np

from paramserver.config import config_field
from worker.data.manifest import TASKS


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


def click_source(sources: list[str], config: PrepareConfig) -> Any:
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


def held_out_count(n: int, config: PrepareConfig) -> int:
    """How many of a source's n samples a source without a test split of its own holds out."""
    return max(1, round(n * config.test_fraction)) if n > 1 else 0
