"""Features: one batch of a dataset with categorical columns (click logs), as a model built from its schema takes it.

A batch of such a dataset is `(Features, y)` where a plain dataset's is `(x, y)`: the dense features as one float32
tensor, and each categorical feature's IDs by its name: int64 `[B]` for a one-hot feature, and for a multi-hot one
(a bag of IDs per sample) the bags' IDs back to back, int64 `[n]`, with `offsets[name]` the position where each of
the B bags starts (what `SparseEmbedding(mode="sum"|"mean")` and `nn.EmbeddingBag` take). It moves and splits as a
tensor does where the training loop needs it (`to`, `chunk`, `len`).
"""

from __future__ import annotations

import itertools
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field

import numpy as np
import torch


@dataclass(frozen=True)
class Features:
    """A batch's dense features and categorical IDs (see the module's docstring)."""

    dense: torch.Tensor  # float32 [B, dense features]
    ids: Mapping[str, torch.Tensor]  # name -> int64 [B] (one-hot) or [n] (multi-hot: the bags back to back)
    offsets: Mapping[str, torch.Tensor] = field(default_factory=dict)  # multi-hot name -> int64 [B], bag starts

    def __len__(self) -> int:
        return len(self.dense)

    @property
    def device(self) -> torch.device:
        return self.dense.device

    def to(self, device: torch.device | str, non_blocking: bool = False) -> Features:
        """The batch on `device` (IDs too: a SparseEmbedding gathers its rows where its IDs are)."""
        return Features(
            self.dense.to(device, non_blocking=non_blocking),
            {k: v.to(device, non_blocking=non_blocking) for k, v in self.ids.items()},
            {k: v.to(device, non_blocking=non_blocking) for k, v in self.offsets.items()},
        )

    def rows(self, lo: int, hi: int) -> Features:
        """Samples lo..hi-1 (a multi-hot feature's bags of those samples, their offsets from 0)."""
        ids, offsets = {}, {}
        for name, values in self.ids.items():
            starts = self.offsets.get(name)
            if starts is None:
                ids[name] = values[lo:hi]
                continue
            first = int(starts[lo]) if lo < len(starts) else len(values)
            last = int(starts[hi]) if hi < len(starts) else len(values)
            ids[name] = values[first:last]
            offsets[name] = starts[lo:hi] - first
        return Features(self.dense[lo:hi], ids, offsets)

    def chunk(self, chunks: int) -> list[Features]:
        """At most `chunks` consecutive parts of (nearly) equal size, as torch.chunk cuts a tensor's rows."""
        n = len(self)
        size = -(-n // max(1, chunks)) if n else 0
        return [self.rows(lo, min(lo + size, n)) for lo in range(0, n, size)] if size else [self]


def concat(batches: Sequence[Features]) -> Features:
    """The batches one after the other (a sync round's combined batch: each worker's in rank order)."""
    ids: dict[str, torch.Tensor] = {}
    offsets: dict[str, torch.Tensor] = {}
    for name in batches[0].ids:
        ids[name] = torch.cat([b.ids[name] for b in batches])
        if name in batches[0].offsets:
            starts = [0, *itertools.accumulate(len(b.ids[name]) for b in batches[:-1])]
            offsets[name] = torch.cat([b.offsets[name] + s for b, s in zip(batches, starts, strict=True)])
    return Features(torch.cat([b.dense for b in batches]), ids, offsets)


def features_of(dense: np.ndarray, columns: Mapping[str, np.ndarray]) -> Features:
    """Features from numpy columns: a one-hot feature's int64 IDs, or a multi-hot one's object array of int64 bags."""
    ids: dict[str, torch.Tensor] = {}
    offsets: dict[str, torch.Tensor] = {}
    for name, column in columns.items():
        if column.dtype == object:  # bags
            lengths = np.fromiter((len(b) for b in column), dtype=np.int64, count=len(column))
            starts = np.zeros(len(column), dtype=np.int64)
            np.cumsum(lengths[:-1], out=starts[1:])
            values = np.concatenate(list(column)).astype(np.int64, copy=False) if len(column) else np.empty(0, np.int64)
            ids[name] = torch.from_numpy(np.ascontiguousarray(values))
            offsets[name] = torch.from_numpy(starts)
        else:
            ids[name] = torch.from_numpy(np.ascontiguousarray(column, dtype=np.int64))
    return Features(torch.from_numpy(np.ascontiguousarray(dense, dtype=np.float32)), ids, offsets)
