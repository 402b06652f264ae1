"""Rows as they travel through a shard: one table's block of IDs (and gradients) per request, and a sync round's
blocks combined.

A request carries one `RowBlock` per table. A shard's tables of one width and row optimizer are one store
(paramserver.shard.sparse.row_store.RowGroup), which takes all its tables' rows of a request as one batch: `joined`
makes that batch from blocks that are consecutive slices of one buffer (what ShardTables.plan allocates, and what
`combine` returns) without a copy, and copies only where they are not.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

import numpy as np
import torch


@dataclass
class RowBlock:
    """One table's rows in one request: IDs (int64), and values (float32 [count, dim]) unless it is a lookup."""

    table: int
    ids: np.ndarray
    values: np.ndarray | None = None
    at: int = -1  # where the block starts in the buffer its arrays are slices of (`planned`, `combine`), else -1

    @property
    def nbytes(self) -> int:
        return int(self.ids.nbytes) + (int(self.values.nbytes) if self.values is not None else 0)

    def arrays(self) -> list[np.ndarray]:
        """The arrays in payload order: the IDs, then the values."""
        return [self.ids] if self.values is None else [self.ids, self.values]


def joined(blocks: Sequence[RowBlock], values: bool = False) -> np.ndarray:
    """The blocks' IDs (or values) one after the other: a view when the blocks are consecutive slices of one buffer
    (their `at` says where each starts), else a copy."""
    parts: list[np.ndarray] = [b.values if values else b.ids for b in blocks]  # type: ignore[misc]
    if len(parts) == 1:
        return parts[0]
    base = parts[0].base
    if isinstance(base, np.ndarray) and blocks[0].at >= 0:
        end = blocks[0].at
        for b, p in zip(blocks, parts, strict=True):
            if p.base is not base or b.at != end:
                return np.concatenate(parts)
            end += len(p)
        return base[blocks[0].at : end]
    return np.concatenate(parts)


def planned(counts: Sequence[int], dim: int | None) -> tuple[list[np.ndarray], list[int]]:
    """Arrays for consecutive blocks of these counts, as slices of one buffer (int64 IDs when `dim` is None, else
    float32 [count, dim] values), and where each starts, so that `joined` takes them back without a copy."""
    total = sum(counts)
    buffer = np.empty(total, dtype=np.int64) if dim is None else np.empty((total, dim), dtype=np.float32)
    out, starts, at = [], [], 0
    for n in counts:
        out.append(buffer[at : at + n])
        starts.append(at)
        at += n
    return out, starts


def combine(blocks: Sequence[RowBlock], divide_by: int) -> list[RowBlock]:
    """One block per table from a round's blocks (several workers'), in table order: the gradients of an ID summed,
    then all divided by the round's number of gradients, as the dense sum is.

    The blocks of all tables of one width are summed at once (one sort over (table, ID), one index_add), so a round
    costs the same few calls however many tables the model has; an ID's gradients are added in the order the
    blocks came, as a loop per table would add them."""
    by_dim: dict[int, list[RowBlock]] = {}
    for b in blocks:
        assert b.values is not None
        by_dim.setdefault(b.values.shape[1], []).append(b)
    out: list[RowBlock] = []
    for dim, group in by_dim.items():
        tables = [b.table for b in group]
        if len(set(tables)) == len(tables):  # each table once: its rows are already unique
            for b in group:
                values = b.values
                assert values is not None
                out.append(RowBlock(b.table, b.ids, values / np.float32(divide_by) if divide_by > 1 else values))
            continue
        ids = np.concatenate([b.ids for b in group])
        tags = np.repeat(np.array(tables, dtype=np.int64), [len(b.ids) for b in group])
        order, first = _sorted_pairs(ids, tags)
        inverse = np.empty(len(ids), dtype=np.int64)
        inverse[order] = np.cumsum(first) - 1
        unique_ids, unique_tags = ids[order][first], tags[order][first]
        summed = torch.zeros((len(unique_ids), dim), dtype=torch.float32)
        summed.index_add_(0, torch.from_numpy(inverse), torch.from_numpy(np.concatenate([b.values for b in group])))  # type: ignore[misc]
        if divide_by > 1:
            summed.div_(divide_by)
        values = summed.numpy()
        present = np.unique(unique_tags)
        bounds = np.searchsorted(unique_tags, present, side="left").tolist() + [len(unique_ids)]
        for k, table in enumerate(present.tolist()):
            lo, hi = bounds[k], bounds[k + 1]
            out.append(RowBlock(table, unique_ids[lo:hi], values[lo:hi], lo))
    out.sort(key=lambda b: b.table)
    return out


def _sorted_pairs(ids: np.ndarray, tags: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
    """The order that sorts the (table, ID) pairs, and which sorted pairs come first among their equals.

    Where every ID is in 0..M, (table rank, ID) is one int64 key, rank * (M + 1) + ID, and a round's keys are runs
    already sorted (a worker's blocks come in table order, each block's IDs ascending), which a stable sort merges
    in linear time; otherwise a lexsort of the two."""
    ranks = np.unique(tags)
    span = int(ids.max()) + 1 if len(ids) else 1
    if len(ids) and int(ids.min()) >= 0 and len(ranks) * span < 1 << 62:
        keys = np.searchsorted(ranks, tags) * span + ids
        order = np.argsort(keys, kind="stable")
        keys = keys[order]
        first = np.empty(len(keys), dtype=bool)
        first[:1] = True
        np.not_equal(keys[1:], keys[:-1], out=first[1:])
        return order, first
    order = np.lexsort((ids, tags))
    ids_sorted, tags_sorted = ids[order], tags[order]
    first = np.empty(len(ids), dtype=bool)
    first[:1] = True
    np.not_equal(ids_sorted[1:], ids_sorted[:-1], out=first[1:])
    first[1:] |= tags_sorted[1:] != tags_sorted[:-1]
    return order, first
