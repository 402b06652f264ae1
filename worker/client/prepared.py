"""A batch's IDs prepared once for the forward pass and the push (Prepared): their unique IDs grouped by the shard
that holds them, and the inverse into that order; UniqueCache shares them among a model's tables given the same IDs."""

from __future__ import annotations

from collections import OrderedDict
from dataclasses import dataclass

import numpy as np
import torch

from paramserver.tables import shard_of

__all__ = ["Prepared", "UniqueCache", "prepare"]


@dataclass(frozen=True)
class Prepared:
    """A batch's IDs as prefetch prepares them for the forward pass and the push: their unique IDs grouped by the
    shard that holds them (each shard's ascending), so that each shard's rows are one slice of the table's rows,
    received in place and pushed without a copy."""

    given: torch.Tensor  # a copy of the IDs prefetch was given (the caller may reuse its tensor)
    ids: np.ndarray  # the unique IDs, int64, shard by shard (sorted where there is no split)
    inverse: torch.Tensor  # each given ID's position in `ids`
    parts: list[slice | None] | None  # each shard's slice of `ids` (None: holds none); None: not split


class UniqueCache:
    """The prepared IDs of the last few ID tensors the tables of one model prefetched, so that tables given the same
    IDs (a DeepFM's two tables per field) compute them once. An entry counts only while its IDs still equal the copy
    it keeps: memory written in place since (through numpy, say, which torch's version counter does not see) is
    computed again."""

    def __init__(self, num_shards: int = 1, size: int = 64) -> None:
        self._num_shards = num_shards
        self._size = size
        self._entries: OrderedDict[tuple[object, ...], Prepared] = OrderedDict()

    def of(self, ids: torch.Tensor) -> Prepared:
        """These IDs prepared (see Prepared), split by the shards of the model's client."""
        key = (ids.data_ptr(), tuple(ids.shape), tuple(ids.stride()), ids.dtype, ids.device)
        hit = self._entries.get(key)
        if hit is not None and torch.equal(hit.given, ids):
            self._entries.move_to_end(key)
            return hit
        entry = prepare(ids, self._num_shards)
        self._entries[key] = entry
        if len(self._entries) > self._size:
            self._entries.popitem(last=False)
        return entry


def prepare(ids: torch.Tensor, num_shards: int | None) -> Prepared:
    """The unique IDs and inverse of `ids`, grouped by shard_of over `num_shards` shards (None: sorted, not split)."""
    unique, inverse = torch.unique(ids.reshape(-1), return_inverse=True)
    flat = unique.to("cpu", torch.int64).numpy()
    if num_shards is None:
        return Prepared(ids.clone(), flat, inverse, None)
    if num_shards == 1:
        return Prepared(ids.clone(), flat, inverse, [slice(0, len(flat))])
    owner = shard_of(flat, num_shards)
    order = np.argsort(owner, kind="stable")  # stable: each shard's IDs stay ascending
    rank = np.empty(len(order), dtype=np.int64)
    rank[order] = np.arange(len(order))
    bounds = np.searchsorted(owner[order], np.arange(num_shards + 1)).tolist()
    parts = [slice(lo, hi) if hi > lo else None for lo, hi in zip(bounds[:-1], bounds[1:], strict=True)]
    grouped = torch.from_numpy(rank).to(inverse.device)[inverse]
    return Prepared(ids.clone(), flat[order], grouped, parts)
