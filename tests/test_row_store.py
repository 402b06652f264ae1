"""A shard's sparse table rows (paramserver.shard.sparse.row_store.RowTable) and their optimizers
(paramserver.shard.sparse.row_optimizers), through their public API: the row optimizers against torch's own
optimizers on an `nn.Embedding(sparse=True)`, admission, eviction, slot reuse, any int64 ID, a million IDs, checkpoints'
state, and memory."""

from __future__ import annotations

from collections.abc import Callable, Iterator
from typing import Any

import numpy as np
import pytest
import torch

from paramserver.shard.sparse.row_optimizers import ROW_OPTIMIZER_KINDS, row_optimizer
from paramserver.shard.sparse.row_store import RowTable
from paramserver.tables import ROW_OPTIMIZERS, TableSpec, initial_rows


@pytest.fixture(autouse=True)
def one_thread() -> Iterator[None]:
    """torch on one thread: the batches here are small, and on a busy 2-core machine a second thread's wake-up can
    cost more than the work."""
    before = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(before)


def summed(ids: np.ndarray, grads: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
    """Unique IDs and their gradients summed, as torch's coalesced sparse gradient has them."""
    unique, inverse = np.unique(ids, return_inverse=True)
    out = np.zeros((len(unique), grads.shape[1]), dtype=np.float32)
    np.add.at(out, inverse, grads)
    return unique, out


def sgd_table(**fields: Any) -> RowTable:
    return RowTable(TableSpec("t", 4, **fields), "sgd", 0.5)


def test_registry_matches_the_table_optimizer_names() -> None:
    assert set(ROW_OPTIMIZER_KINDS) == set(ROW_OPTIMIZERS)
    assert {name: row_optimizer(name).state_cols(8) for name in ROW_OPTIMIZERS} == {
        "sgd": 0,
        "adagrad": 8,
        "rowwise_adagrad": 1,
        "adam": 16,
    }
    with pytest.raises(ValueError, match="row optimizer must be one of"):
        row_optimizer("momentum")
    with pytest.raises(ValueError):
        RowTable(TableSpec("t", 4), "lamb", 0.1)


def test_lookup_of_unseen_ids_reads_initial_rows_and_makes_no_row() -> None:
    spec = TableSpec("t", 8, seed=7)
    table = RowTable(spec, "adagrad", 0.1)
    before = table.nbytes
    ids = np.array([5, -3, 5, 1 << 40], dtype=np.int64)
    np.testing.assert_array_equal(table.lookup(ids), initial_rows(spec, ids))
    assert table.rows == 0 and table.missing(ids) == 4 and table.nbytes == before
    assert len(table.state()["ids"]) == 0


@pytest.mark.filterwarnings("ignore:Sparse invariant checks")
@pytest.mark.parametrize(
    ("name", "make", "lr"),
    [
        ("sgd", lambda p, lr: torch.optim.SGD(p, lr=lr), 0.3),
        ("adagrad", lambda p, lr: torch.optim.Adagrad(p, lr=lr), 0.3),
        ("adam", lambda p, lr: torch.optim.SparseAdam(p, lr=lr), 0.05),
    ],
)
def test_updates_equal_torch_on_a_sparse_embedding(
    name: str, make: Callable[[Iterator[torch.nn.Parameter], float], torch.optim.Optimizer], lr: float
) -> None:
    n, dim = 40, 6
    spec = TableSpec("t", dim, seed=3)
    table = RowTable(spec, name, lr)
    emb = torch.nn.Embedding(n, dim, sparse=True)
    with torch.no_grad():
        emb.weight.copy_(torch.from_numpy(initial_rows(spec, np.arange(n))))
    opt = make(emb.parameters(), lr)
    rng = np.random.default_rng(0)
    for step in range(8):
        # Repeated IDs within a batch, IDs seen before and new ones (the range widens).
        ids = rng.integers(0, 10 + 4 * step, size=25)
        # The first step's gradients are tiny, so that where eps goes (after the square root) shows.
        upstream = rng.standard_normal((len(ids), dim)).astype(np.float32) * (1e-6 if step == 0 else 1.0)
        opt.zero_grad()
        (emb(torch.from_numpy(ids)) * torch.from_numpy(upstream)).sum().backward()
        opt.step()
        unique, grads = summed(ids, upstream)
        table.apply(unique, grads, version=step + 1, now=float(step))
        np.testing.assert_allclose(table.lookup(np.arange(n)), emb.weight.detach().numpy(), rtol=0, atol=1e-5)
    assert table.rows == len(np.unique(table.state()["ids"])) <= n


def test_rowwise_adagrad_matches_a_reference() -> None:
    dim, lr, eps = 5, 0.2, 1e-10
    spec = TableSpec("t", dim, seed=1)
    table = RowTable(spec, "rowwise_adagrad", lr)
    weights: dict[int, np.ndarray] = {}
    acc: dict[int, float] = {}
    rng = np.random.default_rng(1)
    for step in range(6):
        ids = rng.choice(12, size=7, replace=False)
        grads = rng.standard_normal((len(ids), dim)).astype(np.float32)
        table.apply(ids, grads, version=step, now=0.0)
        for i, g in zip(ids.tolist(), grads.astype(np.float64), strict=True):
            w = weights.get(i, initial_rows(spec, np.array([i]))[0].astype(np.float64))
            acc[i] = acc.get(i, 0.0) + float(np.mean(g * g))
            weights[i] = w - lr * g / (np.sqrt(acc[i]) + eps)
    ids = np.array(sorted(weights))
    np.testing.assert_allclose(table.lookup(ids), np.stack([weights[i] for i in ids]), rtol=0, atol=1e-5)
    state = table.state()
    np.testing.assert_allclose(state["optimizer_state"][:, 0], [acc[i] for i in ids], rtol=1e-5)


def test_an_id_is_admitted_at_its_kth_update_and_earlier_gradients_are_dropped() -> None:
    spec = TableSpec("t", 4, admit_after=3)
    table = RowTable(spec, "sgd", 0.5)
    ids = np.array([11, 12], dtype=np.int64)
    start = initial_rows(spec, ids)
    for step in (1, 2):
        table.apply(ids[:1] if step == 2 else ids, np.ones((2 if step == 1 else 1, 4), np.float32), step, 0.0)
        assert table.rows == 0 and table.missing(ids) == 2
        np.testing.assert_array_equal(table.lookup(ids), start)
    assert table.state()["count_ids"].tolist() == [11, 12] and table.state()["counts"].tolist() == [2, 1]
    table.apply(ids, np.full((2, 4), 2.0, np.float32), 3, 0.0)
    # 11 reaches its third update: a row at its initial value, then this update's step; 12 is at its second.
    assert table.rows == 1 and table.rows_admitted == 1 and table.ids_seen == 5
    np.testing.assert_allclose(table.lookup(ids), np.stack([start[0] - 1.0, start[1]]))
    assert table.state()["count_ids"].tolist() == [12]
    # An evicted row's ID is counted from zero again.
    assert table.evict_lru(0) == 1
    for step in (4, 5, 6):
        table.apply(ids[:1], np.ones((1, 4), np.float32), step, 0.0)
        assert table.rows == (1 if step == 6 else 0)
    assert table.state()["count_ids"].tolist() == [12] and table.state()["counts"].tolist() == [2]


def test_admission_probability_admits_about_p_and_is_deterministic() -> None:
    spec = TableSpec("t", 2, admit_probability=0.25, seed=5)
    ids = np.arange(20_000, dtype=np.int64)
    grads = np.ones((len(ids), 2), np.float32)
    tables = [RowTable(spec, "sgd", 0.1, seed_rng=r) for r in (0, 0, 1)]
    for table in tables:
        table.apply(ids, grads, 1, 0.0)
    assert abs(tables[0].rows - 5000) < 400  # binomial: sd 61
    assert tables[0].state_bytes() == tables[1].state_bytes()
    assert tables[0].state_bytes() != tables[2].state_bytes()
    assert len(tables[0].state()["count_ids"]) == 0  # admit_after 0: nothing to count
    held = tables[0].state()["ids"]
    dropped = np.setdiff1d(ids, held)[:100]
    np.testing.assert_array_equal(tables[0].lookup(dropped), initial_rows(spec, dropped))
    # The second update of the rest admits about a quarter of them again.
    tables[0].apply(np.setdiff1d(ids, held), np.ones((len(ids) - len(held), 2), np.float32), 2, 0.0)
    assert abs(tables[0].rows - 5000 - 3750) < 500


def test_capacity_evicts_least_recently_updated_rows() -> None:
    table = sgd_table(capacity=40)
    last: dict[int, int] = {}
    rng = np.random.default_rng(2)
    for version in range(1, 400):
        i = int(rng.integers(0, 90))
        table.apply(np.array([i]), np.ones((1, 4), np.float32), version, 0.0)
        last[i] = version
        assert table.rows == min(40, len(last))
    newest = sorted(last, key=last.__getitem__)[-40:]
    assert sorted(table.state()["ids"].tolist()) == sorted(newest)
    assert table.rows_evicted == table.rows_admitted - 40
    # evict_lru drops the oldest of those, down to the number asked for.
    assert table.evict_lru(15) == 25 and table.evict_lru(20) == 0
    assert sorted(table.state()["ids"].tolist()) == sorted(newest[-15:])


def test_eviction_by_versions() -> None:
    spec = TableSpec("t", 4, evict_after_versions=5)
    table = RowTable(spec, "sgd", 0.5)
    g = np.ones((1, 4), np.float32)
    table.apply(np.array([1]), g, 1, 0.0)
    table.apply(np.array([2]), g, 4, 0.0)
    assert table.expire(6, 0.0) == 0  # 6 - 1 is not more than 5
    assert table.expire(7, 0.0) == 1 and table.state()["ids"].tolist() == [2]
    np.testing.assert_array_equal(table.lookup(np.array([1])), initial_rows(spec, np.array([1])))
    # A row too old when its next update comes starts again from its initial value, swept or not.
    table.apply(np.array([2]), g, 20, 0.0)
    np.testing.assert_allclose(table.lookup(np.array([2])), initial_rows(spec, np.array([2])) - 0.5)
    assert table.rows_evicted == 2


def test_eviction_by_seconds_also_runs_within_applies() -> None:
    spec = TableSpec("t", 4, evict_after_seconds=10.0)
    table = RowTable(spec, "sgd", 0.5)
    g = np.ones((1, 4), np.float32)
    table.apply(np.array([1]), g, 1, 100.0)
    table.apply(np.array([2]), g, 2, 105.0)
    assert table.expire(3, 110.0) == 0
    assert table.expire(3, 112.0) == 1 and table.state()["ids"].tolist() == [2]
    for step in range(20):  # the amortised sweep runs on its own
        table.apply(np.array([3]), g, 10 + step, 200.0 + step)
    assert table.state()["ids"].tolist() == [3]


def test_evicted_rows_slots_are_reused() -> None:
    table = RowTable(TableSpec("t", 64, init="zeros"), "adagrad", 0.1)
    table.apply(np.arange(1500), np.ones((1500, 64), np.float32), 1, 0.0)  # slabs of exactly 1500 rows
    grown = table.nbytes
    sizes = []
    for cycle in range(6):
        assert table.evict_lru(1400) == 100
        new = np.arange(10_000 + 100 * cycle, 10_100 + 100 * cycle)
        table.apply(new, np.ones((100, 64), np.float32), 2 + cycle, 0.0)
        assert table.rows == 1500
        sizes.append(table.nbytes)
    # The first cycle adds bookkeeping (a free-slot stack, the LRU queue), far less than the 100 rows' bytes a
    # slab growth would add; later cycles add nothing.
    assert sizes[0] - grown < 100 * table.row_bytes and len(set(sizes)) == 1


def test_negative_and_extreme_ids() -> None:
    spec = TableSpec("t", 4, seed=9)
    table = RowTable(spec, "sgd", 1.0)
    ids = np.array([-1, -(1 << 63), (1 << 63) - 1, 0, 123_456_789_012_345], dtype=np.int64)
    grads = np.arange(20, dtype=np.float32).reshape(5, 4)
    table.apply(ids, grads, 1, 0.0)
    np.testing.assert_allclose(table.lookup(ids), initial_rows(spec, ids) - grads)
    assert table.state()["ids"].tolist() == sorted(ids.tolist())
    others = np.array([1, -2, (1 << 63) - 2])
    np.testing.assert_array_equal(table.lookup(others), initial_rows(spec, others))


def test_a_million_ids() -> None:
    spec = TableSpec("t", 2, init="zeros")
    table = RowTable(spec, "sgd", 1.0)
    rng = np.random.default_rng(4)
    ids = np.unique(rng.integers(-(1 << 63), (1 << 63) - 1, size=1_000_100, dtype=np.int64))[:1_000_000]
    ids = rng.permutation(ids)
    old, new = ids[:500_000], ids[500_000:]
    values = (ids % 100_003).astype(np.float32)
    table.apply(old, -np.stack([values[:500_000]] * 2, axis=1), 1, 0.0)
    table.apply(new, -np.stack([values[500_000:]] * 2, axis=1), 2, 0.0)
    assert table.rows == 1_000_000
    expected = dict(zip(ids.tolist(), values.tolist(), strict=True))
    absent = rng.integers(-(1 << 62), 1 << 62, size=1000)
    probe = np.concatenate([rng.choice(ids, 3096), absent])
    want = np.array([expected.get(i, 0.0) for i in probe.tolist()], dtype=np.float32)
    np.testing.assert_array_equal(table.lookup(probe)[:, 1], want)
    assert table.missing(probe) == sum(i not in expected for i in absent.tolist())
    # Half of them evicted (the older version) leaves tombstones the other half's probes must pass over.
    assert table.evict_lru(500_000) == 500_000
    kept = set(new.tolist())
    want = np.array([expected[i] if i in kept else 0.0 for i in probe.tolist()], dtype=np.float32)
    np.testing.assert_array_equal(table.lookup(probe)[:, 1], want)
    table.apply(old[:1000], np.ones((1000, 2), np.float32), 3, 0.0)  # back into tombstoned cells
    np.testing.assert_array_equal(table.lookup(old[:1000]), np.full((1000, 2), -1.0, np.float32))
    assert table.rows == 501_000


def test_random_updates_and_evictions_match_a_model() -> None:
    """Many rounds of updates and LRU evictions over a small universe of IDs: the index's tombstones, rebuilds and
    slot reuse against a dict."""
    spec = TableSpec("t", 1, init="zeros")
    table = RowTable(spec, "sgd", 1.0)
    rng = np.random.default_rng(8)
    universe = rng.integers(-(1 << 63), (1 << 63) - 1, size=3000, dtype=np.int64)
    value: dict[int, float] = {}
    last: dict[int, int] = {}
    for version in range(1, 150):
        ids = np.unique(rng.choice(universe, size=int(rng.integers(1, 400))))
        table.apply(ids, -np.ones((len(ids), 1), np.float32), version, float(version))
        for i in ids.tolist():
            value[i] = value.get(i, 0.0) + 1.0
            last[i] = version
        if version % 7 == 0:
            keep = int(rng.integers(0, len(value) + 1))
            assert table.evict_lru(keep) == len(value) - keep
            for i in sorted(value, key=lambda i: (last[i], i))[: len(value) - keep]:
                del value[i], last[i]
        assert table.rows == len(value)
    want = np.array([value.get(i, 0.0) for i in universe.tolist()], dtype=np.float32)
    np.testing.assert_array_equal(table.lookup(universe)[:, 0], want)
    assert table.state()["ids"].tolist() == sorted(value)


def test_state_round_trip_and_order_independence() -> None:
    spec = TableSpec("t", 3, admit_after=2, capacity=30, seed=2)
    table = RowTable(spec, "adam", 0.01)
    rng = np.random.default_rng(6)
    for version in range(1, 12):
        ids = np.unique(rng.integers(-50, 50, size=20))
        table.apply(ids, rng.standard_normal((len(ids), 3)).astype(np.float32), version, version * 0.5)
    state = table.state()
    assert len(state["count_ids"]) and table.rows == 30 and state["step"].tolist() == [11]
    restored = RowTable.from_state(spec, "adam", 0.01, state)
    assert restored.state_bytes() == table.state_bytes()
    probe = np.arange(-60, 60)
    np.testing.assert_array_equal(restored.lookup(probe), table.lookup(probe))
    ids = np.unique(rng.integers(-50, 50, size=20))
    grads = rng.standard_normal((len(ids), 3)).astype(np.float32)
    for t in (table, restored):
        t.apply(ids, grads, 12, 6.0)
    assert restored.state_bytes() == table.state_bytes()

    # The same rows reached in another order (other slots) give the same state.
    a, b = RowTable(TableSpec("u", 2), "adagrad", 0.1), RowTable(TableSpec("u", 2), "adagrad", 0.1)
    ids, grads = np.array([3, -7, 10]), np.arange(6, dtype=np.float32).reshape(3, 2)
    a.apply(ids, grads, 1, 0.0)
    b.apply(ids[::-1], grads[::-1], 1, 0.0)
    assert a.state_bytes() == b.state_bytes()


def test_from_state_refuses_inconsistent_arrays() -> None:
    spec = TableSpec("t", 3, admit_after=2)
    table = RowTable(spec, "adagrad", 0.1)
    table.apply(np.array([1, 2, 3]), np.ones((3, 3), np.float32), 1, 0.0)
    table.apply(np.array([1, 2, 4]), np.ones((3, 3), np.float32), 2, 0.0)
    good = table.state()
    bad = [
        {**good, "values": good["values"][:1]},
        {**good, "optimizer_state": np.zeros((2, 1), np.float32)},
        {**good, "ids": good["ids"][::-1].copy()},
        {**good, "times": good["times"].astype(np.float32)},
        {**good, "count_ids": np.array([1, 3]), "counts": np.array([1, 1])},  # 1 has a row
        {k: v for k, v in good.items() if k != "step"},
    ]
    for state in bad:
        with pytest.raises(ValueError):
            RowTable.from_state(spec, "adagrad", 0.1, state)
    assert RowTable.from_state(spec, "adagrad", 0.1, good).state_bytes() == table.state_bytes()


def test_a_refused_update_changes_nothing() -> None:
    table = sgd_table()
    table.apply(np.array([1, 2]), np.ones((2, 4), np.float32), 1, 0.0)
    before = table.state_bytes()
    with pytest.raises(ValueError):
        table.apply(np.array([1, 2, 3]), np.ones((2, 4), np.float32), 2, 0.0)
    table.lookup(np.array([5, 1]))
    assert table.missing(np.array([5, 1, 2])) == 1
    assert table.state_bytes() == before
    table.apply(np.array([2]), torch.ones(1, 4), 3, 0.0)  # torch gradients work too
    assert table.state_bytes() != before


def test_memory_overhead() -> None:
    dim, rows = 64, 200_000
    table = RowTable(TableSpec("t", dim, init="zeros"), "adagrad", 0.01)
    assert table.row_bytes == 8 * dim
    table.apply(np.arange(rows), np.zeros((rows, dim), np.float32), 1, 0.0)
    assert table.nbytes / (rows * table.row_bytes) <= 1.3
    # Growing a batch at a time, the slabs hold up to 1.25x the rows right after a growth; with the per-slot
    # bookkeeping (ID, version, time: 25 bytes) and the hash index (12 bytes a cell, 2 to 4 cells a row) the
    # worst case for dim 64 is about 1.4.
    table = RowTable(TableSpec("t", dim, init="zeros"), "adagrad", 0.01)
    worst = 0.0
    for begin in range(0, rows, 8192):
        ids = np.arange(begin, min(rows, begin + 8192))
        table.apply(ids, np.zeros((len(ids), dim), np.float32), 1, 0.0)
        if table.rows >= 50_000:
            worst = max(worst, table.nbytes / (table.rows * table.row_bytes))
    assert worst <= 1.4
