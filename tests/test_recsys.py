"""Unit tests of the recsys workload's local parts (worker/demos/recsys.py): the click logs and their planted model, the
local model's starting rows, the batching that makes local and distributed steps see the same samples, and a
small local training run. The distributed run needs a server: `python -m worker.demos.recsys` is its check."""

from __future__ import annotations

from collections.abc import Iterator

import numpy as np
import pytest
import torch

from paramserver.tables import initial_rows
from worker.demos import recsys
from worker.demos.recsys import ClickLogs, Recommender, local_batches, make_click_logs, rank_batches


@pytest.fixture(scope="module")
def logs() -> ClickLogs:
    return make_click_logs(200_000, 20_000, seed=0)


@pytest.fixture
def one_thread() -> Iterator[None]:
    """Train on one torch thread, as the CLI does: on shared cores two threads stall each other (several times
    slower)."""
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(threads)


# --- the click logs -------------------------------------------------------------------------------------------


def test_shapes_and_dtypes(logs: ClickLogs) -> None:
    for clicks, n in ((logs.train, 200_000), (logs.test, 20_000)):
        assert len(clicks) == n
        assert clicks.dense.shape == (n, recsys.NUM_DENSE) and clicks.dense.dtype == np.float32
        for ids in (clicks.user, clicks.item, clicks.category, clicks.tags, clicks.tag_offsets):
            assert ids.dtype == np.int64
        assert clicks.user.shape == clicks.item.shape == clicks.category.shape == (n,)
        assert clicks.label.dtype == np.float32 and set(np.unique(clicks.label)) <= {0.0, 1.0}
        assert clicks.prob.shape == (n,) and 0 < clicks.prob.min() and clicks.prob.max() < 1
        assert 0 <= clicks.item.min() and clicks.item.max() < recsys.NUM_ITEMS
        assert 0 <= clicks.category.min() and clicks.category.max() < recsys.NUM_CATEGORIES
        assert 0 <= clicks.tags.min() and clicks.tags.max() < recsys.NUM_TAGS
        sizes = np.diff(clicks.tag_offsets)
        assert clicks.tag_offsets[0] == 0 and clicks.tag_offsets[-1] == len(clicks.tags)
        assert sizes.min() >= 1 and sizes.max() <= recsys.MAX_TAGS
    # User IDs look like hashes: spread over all of int64, negative ones included.
    assert logs.train.user.min() < -(2**60) and logs.train.user.max() > 2**60
    # An item has one category, in both splits.
    item = np.concatenate([logs.train.item, logs.test.item])
    category = np.concatenate([logs.train.category, logs.test.category])
    pairs = np.unique(np.stack([item, category]), axis=1)
    assert len(np.unique(pairs[0])) == pairs.shape[1]
    assert np.array_equal(logs.user_vocab, np.unique(np.concatenate([logs.train.user, logs.test.user])))


def test_same_seed_same_logs_other_seed_other_logs() -> None:
    a, b, c = (make_click_logs(3000, 500, seed=s) for s in (5, 5, 6))
    for name in ("dense", "user", "item", "category", "tags", "tag_offsets", "label", "prob"):
        assert np.array_equal(getattr(a.train, name), getattr(b.train, name)), name
        assert np.array_equal(getattr(a.test, name), getattr(b.test, name)), name
    assert a.ceiling_auc == b.ceiling_auc
    assert not np.array_equal(a.train.user, c.train.user)
    assert not np.array_equal(a.train.label, c.train.label)


def test_users_are_zipf_distributed(logs: ClickLogs) -> None:
    _, counts = np.unique(logs.train.user, return_counts=True)
    counts = np.sort(counts)[::-1]
    top = counts[: len(counts) // 100].sum() / counts.sum()
    assert top > 0.3, f"the top 1 % of users have only {top:.2f} of the impressions"
    assert (counts == 1).mean() > 0.8, "most users are in the tail, seen once"
    assert counts[0] > 1000


def test_distinct_ids_grow_with_the_logs() -> None:
    small, large = make_click_logs(50_000, 100, seed=1), make_click_logs(400_000, 100, seed=1)
    # Eight times the impressions: over four times the users (the Zipf tail keeps bringing new ones).
    ratio = large.train.distinct_ids()["user"] / small.train.distinct_ids()["user"]
    assert 4 < ratio < 8
    # Extrapolated at that rate, the demo's 2.4 M impressions bring more than a million distinct users alone
    # (1,098,373 for seed 0; python -m worker.demos.recsys prints the count).
    per_doubling = ratio ** (1 / 3)
    assert large.train.distinct_ids()["user"] * per_doubling ** np.log2(2_400_000 / 400_000) > 1_000_000


def test_ceiling_auc(logs: ClickLogs) -> None:
    assert 0.7 < logs.ceiling_auc < 0.9
    assert logs.ceiling_auc == recsys.auc(logs.test.label, logs.test.prob)


def test_batch_gathers_each_sample_and_its_tags(logs: ClickLogs) -> None:
    idx = np.array([17, 3, 199_999, 3, 0])
    batch = logs.train.batch(idx)
    assert len(batch) == 5
    assert torch.equal(batch.user, torch.from_numpy(logs.train.user[idx]))
    assert torch.equal(batch.dense, torch.from_numpy(logs.train.dense[idx]))
    assert torch.equal(batch.label, torch.from_numpy(logs.train.label[idx]))
    offs = logs.train.tag_offsets
    expected = np.concatenate([logs.train.tags[offs[i] : offs[i + 1]] for i in idx])
    assert torch.equal(batch.tags, torch.from_numpy(expected))
    bounds = [*batch.tag_offsets.tolist(), len(batch.tags)]
    for k, i in enumerate(idx):
        assert bounds[k + 1] - bounds[k] == offs[i + 1] - offs[i]


# --- batching -------------------------------------------------------------------------------------------------


@pytest.mark.parametrize("n", [1000, 1001, 37])
def test_rank_batches_concatenate_to_the_local_batches(n: int) -> None:
    world, size = 2, 64
    for epoch in range(2):
        mine = [list(rank_batches(n, size, r, world, seed=3, epoch=epoch)) for r in range(world)]
        local = list(local_batches(n, size, world, seed=3, epoch=epoch))
        assert len(mine[0]) == len(mine[1]) == len(local) == recsys.steps_per_epoch(n, size, world)
        for t, batch in enumerate(local):
            assert np.array_equal(batch, np.concatenate([mine[0][t], mine[1][t]]))
            for r in range(world):
                assert (mine[r][t] % world == r).all(), "sample i belongs to rank i % world"
                assert len(mine[r][t]) == len(mine[1 - r][t])
        # An epoch is every sample of the first world * (n // world) once.
        assert np.array_equal(np.sort(np.concatenate(local)), np.arange(world * (n // world)))
    first = np.concatenate(list(local_batches(n, size, world, seed=3, epoch=0)))
    again = np.concatenate(list(local_batches(n, size, world, seed=3, epoch=0)))
    other = np.concatenate(list(local_batches(n, size, world, seed=3, epoch=1)))
    assert np.array_equal(first, again) and not np.array_equal(first, other)


def test_rank_batches_refuse_a_rank_outside_the_world() -> None:
    with pytest.raises(ValueError):
        next(rank_batches(10, 2, 2, 2, seed=0, epoch=0))


# --- the model ------------------------------------------------------------------------------------------------


@pytest.fixture(scope="module")
def local_model(logs: ClickLogs) -> Recommender:
    return Recommender(local=True, user_vocab=logs.user_vocab, seed=4)


def test_local_tables_start_at_the_initial_rows(logs: ClickLogs, local_model: Recommender) -> None:
    specs = {spec.name: spec for spec in local_model.specs()}
    assert specs["user"].num_embeddings == 0 and specs["item"].num_embeddings == recsys.NUM_ITEMS
    assert len({spec.seed for spec in specs.values()}) == len(specs), "each table has its own rows"
    users = np.concatenate([logs.train.user[:3], logs.test.user[-2:], logs.user_vocab[[0, -1]]])
    with torch.no_grad():
        got = local_model.get_submodule("user")(torch.from_numpy(users))
        assert torch.equal(got, torch.from_numpy(initial_rows(specs["user"], users)))
        for name in ("item", "category"):
            ids = np.array([0, 1, 7, specs[name].num_embeddings - 1])
            got = local_model.get_submodule(name)(torch.from_numpy(ids))
            assert torch.equal(got, torch.from_numpy(initial_rows(specs[name], ids)))
        tags, offsets = np.array([5, 9, 9999, 42]), np.array([0, 3])
        got = local_model.get_submodule("tags")(torch.from_numpy(tags), torch.from_numpy(offsets))
        rows = torch.from_numpy(initial_rows(specs["tags"], tags))
        assert torch.allclose(got, torch.stack([rows[:3].mean(0), rows[3]]))


def test_dense_weights_come_from_the_seed_alone(logs: ClickLogs, local_model: Recommender) -> None:
    torch.manual_seed(123)  # the caller's RNG state changes nothing, and is left as it was
    state = torch.get_rng_state()
    again = Recommender(local=True, user_vocab=logs.user_vocab[:10], seed=4)
    assert torch.equal(torch.get_rng_state(), state)
    for a, b in zip(local_model.dense_parameters(), again.dense_parameters(), strict=True):
        assert torch.equal(a, b)
    other = Recommender(local=True, user_vocab=logs.user_vocab[:10], seed=5)
    assert not torch.equal(local_model.dense_parameters()[0], other.dense_parameters()[0])


def test_distributed_model_has_the_local_dense_weights_and_specs(local_model: Recommender) -> None:
    sparse = pytest.importorskip("worker.client.sparse")
    remote = Recommender(local=False, seed=4)
    assert [spec for _, spec in [(n, m.spec(n)) for n, m in sparse.tables_of(remote)]] == local_model.specs()
    names = [name for name, _ in remote.named_parameters()]
    assert all(name.startswith(("bottom.", "top.")) for name in names)
    for a, b in zip(local_model.dense_parameters(), remote.parameters(), strict=True):
        assert torch.equal(a, b)


def test_forward_gives_one_logit_per_sample(logs: ClickLogs, local_model: Recommender) -> None:
    batch = logs.train.batch(np.arange(100))
    out = local_model(batch)
    assert out.shape == (100,) and out.dtype == torch.float32
    out.sum().backward()
    assert all(p.grad is not None and p.grad.is_sparse for p in local_model.sparse_parameters())
    local_model.zero_grad(set_to_none=True)


def test_local_training_learns(logs: ClickLogs, one_thread: None) -> None:
    model = recsys.train_local(logs, epochs=1, batch_size=2048, lr=0.05, seed=0)
    auc = recsys.evaluate_auc(model, logs)
    # 200 k impressions are a twelfth of the demo's: well on the way, not all of it.
    assert recsys.fraction_of_ceiling(auc, logs.ceiling_auc) > 0.6


def test_cli_local_only(capsys: pytest.CaptureFixture[str], one_thread: None) -> None:
    code = recsys.main(["--local-only", "--train-samples", "20000", "--test-samples", "5000", "--no-progress"])
    out = capsys.readouterr().out
    assert code in (0, 1)
    assert "ceiling AUC" in out and "local: AUC" in out and "distinct IDs" in out
