"""Tables of one width and row optimizer share one store on a shard (paramserver.shard.sparse.row_store.RowGroup): a
group of tables must do to each table exactly what a store of its own does, whatever IDs the tables share; and the
blocks of a request are one batch without a copy."""

from __future__ import annotations

from dataclasses import replace

import numpy as np
import pytest

from paramserver.config import ServerConfig
from paramserver.errors import InvalidArgument
from paramserver.shard.sparse.row_blocks import RowBlock, combine, joined, planned
from paramserver.shard.sparse.row_store import RowGroup, RowTable
from paramserver.shard.sparse.tables import ShardTables
from paramserver.tables import TableSpec
from paramserver.v1 import ps_pb2

POLICIES = [
    {},
    {"admit_after": 2},
    {"admit_probability": 0.5, "seed": 4},
    {"capacity": 12},
    {"evict_after_versions": 3},
    {"init": "uniform", "seed": 9},
]


def _specs(dim: int) -> list[TableSpec]:
    return [TableSpec(f"t{k}", dim, **policy) for k, policy in enumerate(POLICIES)]


@pytest.mark.parametrize("direct", [False, True], ids=["hashed", "direct"])
@pytest.mark.parametrize("optimizer", ["sgd", "adagrad", "rowwise_adagrad", "adam"])
def test_a_group_does_to_each_table_what_a_table_of_its_own_does(optimizer: str, direct: bool) -> None:
    # Direct: bounded tables, their rows indexed by position (id_hash.DirectIndex); hashed: any int64 ID.
    specs = [replace(s, num_embeddings=20 + k) for k, s in enumerate(_specs(4))] if direct else _specs(4)
    low = 0 if direct else -20
    group = RowGroup(specs, optimizer, 0.1, direct=direct)
    alone = [RowTable(s, optimizer, 0.1) for s in specs]
    rng = np.random.default_rng(0)
    for version in range(1, 30):
        # The tables share their IDs: a group keys rows by (table, ID).
        per_table = [np.unique(rng.integers(low, 20, size=12)) for _ in specs]
        grads = [rng.standard_normal((len(ids), 4)).astype(np.float32) for ids in per_table]
        order = rng.permutation(len(specs))  # a batch's tables come in any order
        tags = np.concatenate([np.full(len(per_table[k]), k, np.int32) for k in order])
        group.apply(
            np.concatenate([per_table[k] for k in order]),
            np.concatenate([grads[k] for k in order]),
            version,
            float(version),
            tags,
        )
        for k, table in enumerate(alone):
            table.apply(per_table[k], grads[k], version, float(version))
        probe = np.arange(-25, 25)
        for k, table in enumerate(alone):
            np.testing.assert_array_equal(group.lookup(probe, np.full(len(probe), k, np.int32)), table.lookup(probe))
    for k, table in enumerate(alone):
        assert group.state_bytes(k) == table.state_bytes(), specs[k].name
        assert int(group.rows_held[k]) == table.rows
        assert (group.rows_admitted[k], group.rows_evicted[k]) == (table.rows_admitted[0], table.rows_evicted[0])
    restored = RowGroup.from_states(specs, optimizer, 0.1, [group.state(k) for k in range(len(specs))], direct=direct)
    assert all(restored.state_bytes(k) == group.state_bytes(k) for k in range(len(specs)))


def test_a_request_of_many_tables_is_planned_as_one_batch_per_group_and_joined_without_a_copy() -> None:
    ids, starts = planned([3, 0, 2], None)
    values, _ = planned([3, 0, 2], 4)
    blocks = [RowBlock(k, i, v, at) for k, (i, v, at) in enumerate(zip(ids, values, starts, strict=True))]
    whole = joined(blocks)
    assert whole.base is ids[0].base and len(whole) == 5
    assert joined(blocks, values=True).base is values[0].base
    # Out of order, or slices of different buffers: a copy, with the same contents.
    swapped = [blocks[2], blocks[0]]
    assert joined(swapped).base is not ids[0].base
    np.testing.assert_array_equal(joined(swapped), np.concatenate([ids[2], ids[0]]))


def test_a_shard_groups_tables_by_width_optimizer_and_rate_and_answers_each_table_apart() -> None:
    specs = [
        TableSpec("a", 8),
        TableSpec("b", 1),
        TableSpec("c", 8, num_embeddings=100),
        TableSpec("d", 8, optimizer="sgd"),
        TableSpec("e", 1, lr=0.5),
        TableSpec("f", 8),
    ]
    tables = ShardTables(specs, 0, 1, ServerConfig(optimizer="adagrad", lr=0.1))
    assert sorted(len(g.specs) for g in tables.groups) == [1, 1, 1, 3]
    entries = [ps_pb2.Rows(table=k, count=3) for k in range(len(specs))]
    sparse = tables.plan(entries, entries)
    for k, block in enumerate(sparse.rows):
        block.ids[:] = [1, 5, 7]
        assert block.values is not None
        block.values[:] = k + 1
    for block in sparse.lookups:
        block.ids[:] = [1, 5, 7]
    tables.check(sparse.rows)
    tables.apply(sparse.rows, 1)
    answers = tables.lookup(sparse.lookups)
    for k, view in enumerate(tables.tables):
        np.testing.assert_array_equal(answers[k], view.lookup(np.array([1, 5, 7])))
        assert view.rows == 3 and answers[k].shape == (3, specs[k].dim)
    # A bad ID in one table of a group is named by its table, and changes nothing.
    before = tables.state_bytes()
    bad = tables.plan(entries[:3], [])
    for block in bad.rows:
        block.ids[:] = [1, 2, 300]
        assert block.values is not None
        block.values[:] = 0
    with pytest.raises(InvalidArgument, match="ID 300 is outside table 'c'"):
        tables.check(bad.rows)
    assert tables.state_bytes() == before


@pytest.mark.parametrize("low", [0, -(1 << 62)], ids=["keyed", "lexsorted"])
def test_a_round_combines_all_tables_of_a_width_at_once_as_a_loop_per_table_would(low: int) -> None:
    rng = np.random.default_rng(1)
    blocks = []
    for _worker in range(3):
        for table in (0, 1, 2):
            ids = np.unique(np.concatenate([rng.integers(0, 30, size=10), [low]]))
            blocks.append(RowBlock(table, ids, rng.standard_normal((len(ids), 1 + table % 2)).astype(np.float32)))
    got = combine(blocks, 3)
    assert [b.table for b in got] == [0, 1, 2]
    for b in got:
        mine = [x for x in blocks if x.table == b.table]
        unique = np.unique(np.concatenate([x.ids for x in mine]))
        want = np.zeros((len(unique), mine[0].values.shape[1]), np.float32)  # type: ignore[union-attr]
        for x in mine:
            want[np.searchsorted(unique, x.ids)] += x.values
        np.testing.assert_array_equal(b.ids, unique)
        np.testing.assert_array_equal(b.values, want / np.float32(3))
