"""Click logs from the command line's trainer: a prepared dataset with categorical features streams as Features,
ps-worker's trainer builds DLRM or DeepFM from its schema, prefetches the tables' rows by itself, and reports the
AUC and log loss.

The dataset is written here in the layout worker/data/manifest.py defines (planted clicks: a logistic model over 3
dense features, a user, an item, a site with missing values and a bag of tags), so these tests do not depend on
ps-prepare's parsing of Criteo files (tests/test_clicks.py covers that).
"""

from __future__ import annotations

import hashlib
from pathlib import Path

import numpy as np
import pytest
import torch

from paramserver import LocalCluster, ServerConfig
from worker.data.features import Features
from worker.data.manifest import MISSING_ID, Categorical, Manifest, Schema, ShardFile, Split
from worker.data.stream import StreamedDataset
from worker.train.config import CLICK_BATCH, DENSE_BATCH
from worker.train.metrics import auc
from worker.train.trainer import TrainConfig, train

pytestmark = pytest.mark.timeout(240)

SCHEMA = Schema(
    dense=("d0", "d1", "d2"),
    categorical=(
        Categorical("user", distinct=500),
        Categorical("item", distinct=200),
        Categorical("site", distinct=11),
        Categorical("tags", multi_hot=True, distinct=50),
    ),
)


def _planted(n: int, seed: int) -> dict[str, object]:
    """n samples of the planted world (the same effects for every seed: seed 0 trains, seed 1 tests)."""
    effects = np.random.default_rng(42)
    w, user_b, item_b, tag_b = (
        effects.normal(size=3),
        effects.normal(size=500),
        effects.normal(size=200),
        effects.normal(size=50),
    )
    rng = np.random.default_rng(seed)
    dense = rng.normal(size=(n, 3)).astype(np.float32)
    user = np.minimum(rng.zipf(1.3, n), 500) - 1
    item = np.minimum(rng.zipf(1.3, n), 200) - 1
    site = rng.integers(0, 10, n)
    bags = [rng.choice(50, size=rng.integers(1, 4), replace=False) for _ in range(n)]
    logit = dense @ w + user_b[user] + item_b[item] + np.array([tag_b[b].sum() for b in bags]) - 0.5
    y = (rng.random(n) < 1 / (1 + np.exp(-logit))).astype(np.int64)
    return {
        "x": dense,
        "y": y,
        "user": user * 7_919 + 10**12,  # raw IDs far from 0..N-1: the tables are unbounded
        "item": item,
        "site": np.where(rng.random(n) < 0.2, MISSING_ID, site),
        "tags": bags,
    }


def write_clicks(root: Path, train_shards: int = 2, n_train: int = 2000, n_test: int = 400) -> Path:
    """A prepared click dataset at `root` (the layout of worker/data/manifest.py); returns root."""
    import pyarrow as pa
    import pyarrow.parquet as pq

    root.mkdir(parents=True, exist_ok=True)
    splits = {}
    for split, n, shards, seed in (("train", n_train, train_shards, 0), ("test", n_test, 1, 1)):
        data = _planted(n, seed)
        files = []
        for k, rows in enumerate(np.array_split(np.arange(n), shards)):
            x = np.asarray(data["x"])[rows]
            table = pa.table(
                {
                    "id": pa.array(rows.astype(np.int64)),
                    "x": pa.FixedSizeListArray.from_arrays(pa.array(x.reshape(-1)), 3),
                    "y": pa.array(np.asarray(data["y"])[rows]),
                    **{
                        f"cat_{c}": pa.array(np.asarray(data[c])[rows].astype(np.int64))
                        for c in ("user", "item", "site")
                    },
                    "cat_tags": pa.array([list(map(int, data["tags"][r])) for r in rows], type=pa.list_(pa.int64())),  # type: ignore[index]
                }
            )
            path = root / f"{split}-{k}.parquet"
            pq.write_table(table, path)
            raw = path.read_bytes()
            files.append(ShardFile(path.name, len(rows), len(raw), hashlib.sha256(raw).hexdigest()))
        splits[split] = Split(n, tuple(files))
    manifest = Manifest("planted-clicks", "classification", (3,), 2, splits, schema=SCHEMA)
    (root / "manifest.json").write_text(manifest.to_json())
    return root


def test_a_click_dataset_streams_as_features_with_bags_and_missing_ids(tmp_path: Path) -> None:
    with StreamedDataset(str(write_clicks(tmp_path / "clicks"))) as data:
        assert data.manifest.schema == SCHEMA
        xb, yb = next(iter(data.batches(0, 1, 64, seed=0, epoch=0)))
    assert isinstance(xb, Features) and len(xb) == 64 and xb.dense.shape == (64, 3) and yb.shape == (64,)
    assert set(xb.ids) == {"user", "item", "site", "tags"} and set(xb.offsets) == {"tags"}
    assert xb.ids["user"].dtype == torch.int64 and xb.ids["user"].min() >= 10**12
    lengths = torch.diff(torch.cat([xb.offsets["tags"], torch.tensor([len(xb.ids["tags"])])]))
    assert lengths.min() >= 1 and lengths.max() <= 3
    # Micro-batches split bags with their samples.
    parts = xb.chunk(3)
    assert [len(p) for p in parts] == [22, 22, 20]
    assert torch.equal(torch.cat([p.ids["tags"] for p in parts]), xb.ids["tags"])
    assert all(int(p.offsets["tags"][0]) == 0 for p in parts)
    with StreamedDataset(str(tmp_path / "clicks")) as data:
        sites = torch.cat([x.ids["site"] for x, _ in data.test_batches(100)])
    assert (sites == MISSING_ID).any() and len(sites) == 400


def _lookups(cluster: LocalCluster) -> int:
    return sum(
        int(s.metrics.registry.get_sample_value("paramserver_lookups_total", {"shard": str(s.index)}) or 0)
        for s in cluster.shards
    )


@pytest.mark.parametrize("model", ["dlrm", "deepfm"])
def test_the_trainer_builds_a_click_model_prefetches_its_tables_and_reports_auc(tmp_path: Path, model: str) -> None:
    """One sync worker, 2 shards: the model comes from the schema, each step's exchange brings the next batch's rows
    (the only lookups of their own are the first batch's and the test split's), and the metrics carry the held-out
    AUC and log loss, well above chance on the planted clicks."""
    dataset = write_clicks(tmp_path / "clicks")
    steps, batch = 30, 64
    config = ServerConfig(mode="sync", workers=1, optimizer="adagrad", lr=0.05)
    with LocalCluster(config, shards=2) as cluster:
        metrics = train(
            TrainConfig(
                server=cluster.address,
                dataset=str(dataset),
                model=model,
                steps=steps,
                batch_size=batch,
                embedding_dim=8,
                progress=False,
            )
        )
        lookups = _lookups(cluster)
    tables = 4 if model == "dlrm" else 8
    # The first forward pass looks every table up on both shards, the test split's one batch again; every other
    # step's rows came with the exchange before it (one lookup per shard each). Without the trainer's prefetch it
    # would be a lookup per table per shard per step.
    assert lookups == 2 * tables + 2 * (steps - 1) + 2 * tables, lookups
    assert metrics["loss"] == "bce" and metrics["steps"] == steps
    assert 0.7 < metrics["test_auc"] <= 1 and metrics["test_logloss"] == metrics["test_loss"] < 0.69
    assert 0 < metrics["test_accuracy"] <= 1


def test_bounded_tables_hash_ids_and_an_overlapped_async_worker_trains_them(tmp_path: Path) -> None:
    """--table-size bounds every table (an ID to row ID mod N, MISSING_ID too); --overlap in an async job
    prefetches two batches ahead. Both still learn the planted clicks."""
    dataset = write_clicks(tmp_path / "clicks")
    config = ServerConfig(mode="async", workers=1, optimizer="adagrad", lr=0.05)
    with LocalCluster(config, shards=2) as cluster:
        metrics = train(
            TrainConfig(
                server=cluster.address,
                dataset=str(dataset),
                model="dlrm",
                steps=40,
                batch_size=64,
                embedding_dim=8,
                table_size=97,
                overlap=True,
                progress=False,
            )
        )
    assert metrics["test_auc"] > 0.7 and metrics["steps"] == 40


def test_the_auc_equals_the_rank_sum_definition_with_ties() -> None:
    labels = np.array([0, 1, 1, 0, 1, 0, 0, 1])
    scores = np.array([0.1, 0.4, 0.35, 0.8, 0.8, 0.2, 0.2, 0.9])
    pairs = [(p, q) for p in scores[labels == 1] for q in scores[labels == 0]]
    expected = sum(1.0 if p > q else 0.5 if p == q else 0.0 for p, q in pairs) / len(pairs)
    assert auc(labels, scores) == pytest.approx(expected)
    assert auc(np.ones(3), np.arange(3.0)) == 0.5


def test_recipes_reach_the_tables_rows_accumulation_clipping_and_float16_scaling(tmp_path: Path) -> None:
    """compute_gradients treats the touched rows as parameters: micro-batches give the whole batch's row gradients,
    clipping counts and scales them, and float16's loss scaling unscales them."""
    from worker import PSClient
    from worker.client.sparse import tables_of, touched_rows
    from worker.models.clicks import DLRM, TableOptions
    from worker.train.gradients import compute_gradients
    from worker.train.losses import LossStep, resolve_loss
    from worker.train.precision import MixedPrecision

    with StreamedDataset(str(write_clicks(tmp_path / "clicks"))) as data:
        xb, yb = next(iter(data.batches(0, 1, 48, seed=0, epoch=0)))
    step = LossStep(resolve_loss("bce", "classification"))
    config = ServerConfig(mode="async", workers=1, optimizer="sgd", lr=0.1)
    with LocalCluster(config, shards=2) as cluster, PSClient(cluster.address) as client:
        torch.manual_seed(0)
        model = DLRM(SCHEMA, TableOptions(dim=4))
        client.register(model)

        def grads(**kwargs: object) -> list[torch.Tensor]:
            compute_gradients(model, xb, yb, step=step, **kwargs)  # type: ignore[arg-type]
            dense = [p.grad.clone() for p in model.parameters()]
            # Each table's rows' gradients summed over its forward passes (one leaf per micro-batch).
            return dense + [sum(r.grad.sum(0) for r in touched_rows(table)) for _, table in tables_of(model)]

        whole = grads()
        assert len(touched_rows(model)) == 4  # a step computed again forgets the last one's rows
        for got, want in zip(grads(accumulate=3), whole, strict=True):
            torch.testing.assert_close(got, want, rtol=1e-5, atol=1e-6)
        compute_gradients(model, xb, yb, step=step, clip_grad_norm=1e-3)
        every = [*model.parameters(), *touched_rows(model)]
        assert torch.linalg.vector_norm(torch.stack([torch.linalg.vector_norm(t.grad) for t in every])) == (
            pytest.approx(1e-3, rel=1e-4)
        )
        scaled = grads(precision=MixedPrecision.for_device("float16", torch.device("cpu")))
        for got, want in zip(scaled, whole, strict=True):  # unscaled: close to float32's, not 2^16 times it
            torch.testing.assert_close(got, want, rtol=0.05, atol=1e-3)


def test_two_ps_workers_train_what_one_process_trains_on_the_same_samples(tmp_path: Path) -> None:
    """Two ps-worker processes (sync, 2 shards, Adagrad) against worker.demos.recsys.train_reference, the same DLRM
    trained locally with torch's sparse embeddings on the concatenation of the workers' batches: the held-out
    metrics agree to float rounding."""
    import json
    import subprocess
    import sys

    from worker.demos.recsys import train_reference
    from worker.models.clicks import TableOptions

    dataset = write_clicks(tmp_path / "clicks", train_shards=4)
    lr, batch = 0.05, 50
    config = ServerConfig(mode="sync", workers=2, optimizer="adagrad", lr=lr)
    with LocalCluster(config, shards=2) as cluster:
        common = ["--dataset", str(dataset), "--model", "dlrm", "--batch-size", str(batch), "--epochs", "1"]
        procs = [
            subprocess.Popen(
                [
                    sys.executable,
                    "-m",
                    "worker.cli",
                    "--server",
                    cluster.address,
                    *common,
                    "--embedding-dim",
                    "8",
                    "--metrics-out",
                    str(tmp_path / "worker.json"),  # each rank's: worker-0.json, worker-1.json
                    "--no-progress",
                ]
            )
            for k in range(2)
        ]
        try:
            assert [p.wait(timeout=200) for p in procs] == [0, 0]
        finally:
            for p in procs:
                if p.poll() is None:
                    p.kill()
                    p.wait()
    served = [json.loads((tmp_path / f"worker-{k}.json").read_text()) for k in range(2)]
    local = train_reference(str(dataset), tables=TableOptions(dim=8), batch_size=batch, lr=lr)
    assert served[0]["steps"] == served[1]["steps"] == 2000 // 2 // batch
    assert served[0]["test_auc"] == pytest.approx(local["test_auc"], abs=1e-4)
    assert served[0]["test_logloss"] == pytest.approx(local["test_logloss"], abs=1e-4)
    assert local["test_auc"] > 0.7


def test_a_click_model_trains_thousands_of_samples_a_step_unless_told(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    """No --batch-size: click logs train at CLICK_BATCH a step (the first line says so), other data at DENSE_BATCH."""
    dataset = write_clicks(tmp_path / "clicks")
    config = ServerConfig(mode="async", workers=1, optimizer="adagrad", lr=0.05)
    with LocalCluster(config, shards=1) as cluster:
        metrics = train(TrainConfig(server=cluster.address, dataset=str(dataset), model="dlrm", steps=1))
    assert metrics["batch_size"] == CLICK_BATCH
    assert f"click logs: {CLICK_BATCH} samples a step (--batch-size to change)" in capsys.readouterr().err
    with LocalCluster(config, shards=1) as cluster:
        metrics = train(TrainConfig(server=cluster.address, steps=1, progress=False))
    assert metrics["batch_size"] == DENSE_BATCH
