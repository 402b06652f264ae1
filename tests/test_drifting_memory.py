"""Bounded memory over a long run (issue 39): with rows evicted once no update touched them for T versions, a
shard's tables follow the live ID population. IDs drift from version to version (each update trains a window of
IDs that slides on, as a day's click logs do hour by hour); after the first T versions the rows held and the
tables' allocation stay flat, within 10 %, however far the IDs have moved."""

from __future__ import annotations

import numpy as np

from paramserver.config import ServerConfig
from paramserver.placement import TensorSpec, place
from paramserver.shard.sparse.row_blocks import RowBlock
from paramserver.shard.state import Shard
from paramserver.tables import TableSpec, shard_of

T = 40  # versions a row survives untouched
DIM = 16


def _figures(shard: Shard) -> tuple[int, int]:
    model = shard.require_model()
    ((_, figures),) = model.tables.figures()
    return figures.rows, figures.allocated_bytes


def test_rows_and_allocation_stay_flat_while_ids_drift() -> None:
    specs = [TensorSpec("w", (4,))]
    tables = [TableSpec("user", dim=DIM, optimizer="adagrad", evict_after_versions=T)]
    shard = Shard(ServerConfig(mode="async", workers=1, optimizer="sgd", lr=0.1), 0, ("a:1",))
    placement = place(specs, 1, tables=tables)
    model = shard.prepare_init(specs, 1, placement.digest, tables)
    shard.commit_init(model)
    shard.join("w", "")
    rng = np.random.default_rng(0)
    seen: list[tuple[int, int, int]] = []
    for step in range(1, 10 * T + 1):
        # 600 IDs a version from a window of 3,000 that moves on by 150 a version: the population turns over
        # every 20 versions, 20 times in the run.
        ids = np.unique(rng.integers(150 * step, 150 * step + 3000, 600)).astype(np.int64)
        assert (shard_of(ids, 1) == 0).all()
        grad = rng.normal(size=(len(ids), DIM)).astype(np.float32)
        shard.push(
            "w", step, shard.version, np.zeros(model.numel, np.float32), model.digest, rows=[RowBlock(0, ids, grad)]
        )
        if step % 10 == 0:
            seen.append((step, *_figures(shard)))
    settled = [(rows, nbytes) for step, rows, nbytes in seen if step > 2 * T]
    rows = np.array([r for r, _ in settled], dtype=np.float64)
    allocated = np.array([b for _, b in settled], dtype=np.float64)
    assert rows.max() <= 1.1 * rows.mean() and rows.min() >= 0.9 * rows.mean(), seen
    assert allocated.max() <= 1.1 * allocated.mean() and allocated.min() >= 0.9 * allocated.mean(), seen
    ((_, figures),) = model.tables.figures()
    assert figures.rows_evicted > 5 * figures.rows  # the IDs moved on many times over: most rows ever made are gone
    assert figures.ids_seen > 20 * figures.rows
