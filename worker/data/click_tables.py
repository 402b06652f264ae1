"""Click logs from a CSV or Parquet table: `ps-prepare TABLE --label COL --categorical COLS [--multi-hot COL:SEP]`.

A ClickSource (worker.data.clicks) read in pyarrow record batches (CSV blocks, Parquet row groups), so memory follows
the block, not the table. The label is 0/1. `--categorical` columns become one-hot features: integer values are the
IDs as they are, strings are hashed to a stable non-negative int63 (BLAKE2b of the UTF-8 bytes), once per distinct
value of a block; a null is MISSING_ID. A `--multi-hot COL:SEP` column holds bags: each value is split on SEP and each
token hashed (or parsed, if the column's tokens are integers) the same way; an empty value or a null is an empty bag.
Every other column is a dense feature (numbers; a null as 0), normalised like the rest of ps-prepare's features.
"""

from __future__ import annotations

import hashlib
from collections.abc import Iterator, Sequence
from typing import Any

import numpy as np

from worker.data import storage
from worker.data.manifest import MISSING_ID, Categorical

_MASK = (1 << 63) - 1


def parse_multi_hot(spec: str) -> dict[str, str]:
    """`tags:|,genres:;` -> {"tags": "|", "genres": ";"} (a separator may not be a comma)."""
    out = {}
    for item in filter(None, (part.strip() for part in spec.split(","))):
        name, colon, sep = item.rpartition(":")
        if not colon or not name or not sep:
            raise ValueError(f"--multi-hot {item!r}: expected COLUMN:SEPARATOR, e.g. tags:|")
        out[name] = sep
    return out


def string_ids(values: Any) -> np.ndarray:
    """int64 IDs of a pyarrow string array: each distinct string's BLAKE2b, masked to 63 bits; null: MISSING_ID."""
    import pyarrow.compute as pc

    encoded = (
        pc.dictionary_encode(values).combine_chunks() if hasattr(values, "chunks") else pc.dictionary_encode(values)
    )
    hashed = np.array(
        [
            int.from_bytes(hashlib.blake2b(s.encode(), digest_size=8).digest(), "little") & _MASK
            for s in encoded.dictionary.to_pylist()
        ],
        dtype=np.int64,
    )
    if len(hashed):  # an empty string is a missing value too (a CSV's empty field)
        hashed[np.asarray(encoded.dictionary.to_pylist(), dtype=object) == ""] = MISSING_ID
    codes = encoded.indices.fill_null(-1).to_numpy(zero_copy_only=False)
    return np.where(codes >= 0, hashed[np.maximum(codes, 0)] if len(hashed) else MISSING_ID, MISSING_ID)


class Table:
    """A CSV or Parquet table of click logs as a ClickSource (see the module's docstring)."""

    dense_transform = "none"

    def __init__(self, url: str, label: str, categorical: Sequence[str], multi_hot: dict[str, str]) -> None:
        self.url = url
        self.origin = url
        self.name = url.rstrip("/").rsplit("/", 1)[-1].split(".")[0] or "clicks"
        self.label = label
        self.multi_hot = multi_hot
        fs, path = storage.filesystem(url)
        self.size = int(fs.size(path))
        columns = self._columns()
        wanted = [*categorical, *multi_hot, label]
        missing = [c for c in wanted if c not in columns]
        if missing:
            raise ValueError(f"{url} has no column {', '.join(map(repr, missing))}; its columns: {', '.join(columns)}")
        self.categorical = list(categorical)
        self.features = tuple(Categorical(c) for c in categorical) + tuple(Categorical(c, True) for c in multi_hot)
        self.dense = tuple(c for c in columns if c not in wanted)

    def _parquet(self) -> bool:
        return self.url.split("?")[0].lower().endswith(".parquet")

    def _columns(self) -> list[str]:
        import pyarrow.parquet as pq

        if self._parquet():
            fs, path = storage.filesystem(self.url)
            with fs.open(path, "rb") as f:
                return list(pq.ParquetFile(f).schema_arrow.names)
        return next(self._batches())[1].schema.names

    def _batches(self) -> Iterator[tuple[int, Any]]:
        """(bytes read so far, record batch) over the table."""
        import pyarrow.csv as csv
        import pyarrow.parquet as pq

        fs, path = storage.filesystem(self.url)
        with fs.open(path, "rb") as f:
            if self._parquet():
                for batch in pq.ParquetFile(f).iter_batches(batch_size=65536):
                    yield f.tell(), batch
                return
            reader = csv.open_csv(f, read_options=csv.ReadOptions(block_size=16 << 20))
            for batch in reader:
                yield f.tell(), batch

    def blocks(self, dense_only: bool, bar: Any) -> Iterator[tuple[str, Any]]:
        import pyarrow as pa

        at = 0
        try:
            for now, batch in self._batches():
                if bar is not None:
                    bar.update(max(0, now - at))
                    at = now
                yield self.url, batch
        except pa.ArrowInvalid as exc:
            raise ValueError(f"{self.url}: {exc}") from None

    def dense_values(self, batch: Any) -> np.ndarray:
        if not self.dense:
            return np.zeros((batch.num_rows, 0))
        try:
            return np.stack(
                [batch.column(c).fill_null(0).to_numpy(zero_copy_only=False).astype(np.float64) for c in self.dense], 1
            )
        except (ValueError, TypeError) as exc:
            raise ValueError(
                f"{self.url}: the dense columns must hold numbers ({exc}); name the others with --categorical"
            ) from None

    def labels(self, batch: Any, where: str, first_line: int = 0) -> np.ndarray:
        from worker.data.clicks import checked_labels

        header = 0 if self._parquet() else 1  # a CSV's first line names the columns: a row's line is one further
        return checked_labels(batch.column(self.label), f"{where}, column {self.label}", first_line + header)

    def ids(self, batch: Any, where: str, first_line: int = 0) -> dict[str, Any]:
        out: dict[str, Any] = {
            name: _one_hot(batch.column(name), f"{where}, column {name}") for name in self.categorical
        }
        for name, sep in self.multi_hot.items():
            out[name] = _bags(batch.column(name), sep)
        return out


def _one_hot(column: Any, where: str) -> np.ndarray:
    import pyarrow as pa

    if pa.types.is_integer(column.type):
        return column.cast(pa.int64()).fill_null(MISSING_ID).to_numpy(zero_copy_only=False)
    if pa.types.is_string(column.type) or pa.types.is_large_string(column.type):
        return string_ids(column)
    raise ValueError(f"{where}: a categorical column holds integers or strings, not {column.type}")


def _bags(column: Any, sep: str) -> Any:
    """A string column's values split on `sep`, each token an ID (as `string_ids`), as a list<int64> array; empty
    tokens (an empty value, a doubled separator) dropped."""
    import pyarrow as pa
    import pyarrow.compute as pc

    split = pc.split_pattern(column.cast(pa.string()).fill_null(""), sep)
    tokens = split.flatten()
    keep = pc.not_equal(tokens, "").to_numpy(zero_copy_only=False)
    ids = string_ids(tokens)[keep]
    offsets = split.offsets.to_numpy()
    kept = np.concatenate([[0], np.cumsum(keep)])[offsets]
    return pa.ListArray.from_arrays(pa.array(kept.astype(np.int32)), pa.array(ids, type=pa.int64()))
