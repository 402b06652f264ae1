"""Prepared datasets: ps-prepare's shards and manifest, and the streaming reader over local disk, a real HTTP
server and a real S3-compatible server (moto's), with its per-rank shares, shuffles, resume and prefetch bound."""

from __future__ import annotations

import csv
import hashlib
import json
import logging
import os
import subprocess
import sys
import threading
import time
import uuid
from collections.abc import Iterator
from pathlib import Path

import numpy as np
import pytest
import torch
from support.waiting import wait_for

from paramserver.config import ServerConfig
from worker.data.fileserver import FileServer
from worker.data.manifest import is_prepared, load_manifest
from worker.data.prepare import PrepareConfig, prepare
from worker.data.stream import StreamedDataset
from worker.train.trainer import TrainConfig, train


def _ids(data: StreamedDataset, rank: int, world: int, *, epoch: int = 0, start: int = 0, batch: int = 32) -> list:
    out: list[int] = []
    for _, _, ids in data.batches_with_ids(rank, world, batch, seed=0, epoch=epoch, start=start):
        out += ids.tolist()
    return out


@pytest.fixture(scope="module")
def digits(tmp_path_factory: pytest.TempPathFactory) -> Path:
    out = tmp_path_factory.mktemp("digits")
    prepare("digits", PrepareConfig(out=str(out), shards=6, progress=False))
    return out


def test_prepare_writes_checked_shards_and_the_training_statistics(digits: Path) -> None:
    manifest = load_manifest(str(digits))
    train, test = manifest.splits["train"], manifest.splits["test"]
    assert (manifest.task, manifest.in_shape, manifest.num_classes) == ("classification", (1, 8, 8), 10)
    assert (train.samples, test.samples, len(train.shards)) == (1437, 360, 6)
    for shard in (*train.shards, *test.shards):
        data = (digits / shard.path).read_bytes()
        assert (len(data), hashlib.sha256(data).hexdigest()) == (shard.bytes, shard.sha256)
    assert manifest.normalization["axis"] == "channel"
    x = torch.cat([b[0] for b in StreamedDataset(str(digits)).batches(0, 1, 500, seed=0, epoch=0)])
    assert len(x) == 1437
    assert abs(float(x.mean())) < 1e-4 and float(x.std()) == pytest.approx(1.0, abs=1e-3)  # the train split's
    assert is_prepared(str(digits)) and not is_prepared("digits") and not is_prepared("data.npz")


def test_ranks_take_disjoint_equal_shares_in_a_new_order_each_epoch(digits: Path) -> None:
    data = StreamedDataset(str(digits))
    per_epoch = data.samples_per_epoch(3)
    shares = [_ids(data, rank, 3) for rank in range(3)]
    assert [len(s) for s in shares] == [per_epoch] * 3
    assert not set(shares[0]) & set(shares[1]) and not set(shares[1]) & set(shares[2])
    assert len(set(shares[0])) == per_epoch  # no sample twice
    again = _ids(data, 0, 3, epoch=1)
    assert sorted(again) == sorted(shares[0]) and again != shares[0]  # the same samples, shuffled anew
    assert _ids(data, 0, 3) == shares[0]  # the order is a function of (seed, epoch): a restart sees the same
    with pytest.raises(ValueError, match="prepare it with ps-prepare --shards 7 or more"):
        data.assignment(0, 7)


def test_a_restart_mid_epoch_neither_rereads_nor_skips(digits: Path) -> None:
    whole = _ids(StreamedDataset(str(digits)), 1, 2, epoch=3)
    for start in (0, 1, 100, 301, len(whole) - 1, len(whole)):
        data = StreamedDataset(str(digits))
        assert _ids(data, 1, 2, epoch=3, start=start) == whole[start:]
        data.close()
        # The reader reads the plan's shards, then runs on into the next epoch: the shards wholly before the
        # position are not in the plan, so never fetched.
        planned = data.plan(1, 2, seed=0, epoch=3, start=start)
        full = data.plan(1, 2, seed=0, epoch=3)
        assert sum(len(p.order) for p in planned) == len(whole) - start
        assert [p.shard for p in planned] == [p.shard for p in full][len(full) - len(planned) :]
        if start >= len(full[0].order):
            assert len(planned) < len(full)


def test_prefetch_holds_a_bounded_number_of_shards(tmp_path: Path) -> None:
    prepare("synthetic", PrepareConfig(out=str(tmp_path), shards=24, progress=False))
    data = StreamedDataset(str(tmp_path), prefetch=2)
    batches = data.batches(0, 1, 8, seed=0, epoch=0)
    next(batches)
    time.sleep(1.0)  # the time under test: the reader runs ahead as far as it may, and no further
    assert data.fetched <= 2 + 2, data.fetched  # the one being taken, `prefetch` queued, one waiting to be queued
    rest = [x for x, _ in batches]
    assert rest and data.fetched >= 24  # and on into the next epoch, up to its bound
    batches.close()
    # Its 8,192 samples' statistics came in two chunks, merged: every feature is centred and scaled.
    x = torch.cat([x for x, _ in StreamedDataset(str(tmp_path)).batches(0, 1, 4096, seed=0, epoch=0)]).double()
    assert len(x) == 8192 and float(x.mean(0).abs().max()) < 1e-5 and float((x.std(0) - 1).abs().max()) < 1e-3


def test_the_reader_runs_on_into_the_next_epoch_and_reads_nothing_twice(digits: Path) -> None:
    def readers() -> int:
        return sum(t.name == "ps-prefetch" and t.is_alive() for t in threading.enumerate())

    before = readers()
    data = StreamedDataset(str(digits), prefetch=2)
    first = _ids(data, 0, 2, epoch=0)
    # The reader reads the next epoch's first shards meanwhile (rank 0 of 2 reads 3 of the 6 shards an epoch).
    wait_for(lambda: data.fetched - 3 >= 1, 30, "the reader to run into the next epoch", 0.02)
    second = _ids(data, 0, 2, epoch=1)
    with StreamedDataset(str(digits)) as fresh:
        assert second == _ids(fresh, 0, 2, epoch=1) and sorted(second) == sorted(first)
    data.close()
    assert data.fetched <= 3 + 3 + 2 + 1, data.fetched  # two epochs' shards once each, and the bound ahead of them
    assert readers() == before  # closed: no reader left reading ahead


def test_a_damaged_or_missing_shard_is_named(tmp_path: Path) -> None:
    prepare("digits", PrepareConfig(out=str(tmp_path), shards=2, progress=False))
    manifest = load_manifest(str(tmp_path))
    victim = tmp_path / manifest.splits["train"].shards[1].path
    blob = bytearray(victim.read_bytes())
    blob[len(blob) // 2] ^= 0xFF
    victim.write_bytes(bytes(blob))
    with pytest.raises(ValueError, match="damaged or was replaced"):
        list(StreamedDataset(str(tmp_path)).batches(0, 1, 64, seed=0, epoch=0))
    victim.unlink()
    with pytest.raises(FileNotFoundError, match="does not exist"):
        list(StreamedDataset(str(tmp_path)).batches(0, 1, 64, seed=0, epoch=0))
    with pytest.raises(FileNotFoundError, match="manifest.json does not exist"):
        StreamedDataset(str(tmp_path / "elsewhere"))
    (tmp_path / "manifest.json").write_text(json.dumps({"format": "something else"}))
    with pytest.raises(ValueError, match="not a paramserver-shards manifest"):
        StreamedDataset(str(tmp_path))


def test_image_folders_and_tables_become_shards(tmp_path: Path) -> None:
    from PIL import Image

    rng = np.random.default_rng(0)
    for name, colour in (("cats", 0), ("dogs", 2)):
        (tmp_path / "images" / name).mkdir(parents=True)
        for i in range(10):
            pixels = rng.integers(0, 60, (20, 24, 3), dtype=np.uint8)
            pixels[..., colour] += 180
            Image.fromarray(pixels).save(tmp_path / "images" / name / f"{i}.png")
    (tmp_path / "images" / "cats" / "notes.txt").write_text("not an image")
    images = prepare(
        str(tmp_path / "images"), PrepareConfig(out=str(tmp_path / "a"), shards=2, image_size=8, progress=False)
    )
    assert (images.in_shape, images.num_classes, images.classes) == ((3, 8, 8), 2, ("cats", "dogs"))
    assert images.splits["train"].samples + images.splits["test"].samples == 20
    assert len(images.normalization["mean"]) == 3

    with open(tmp_path / "flowers.csv", "w", newline="") as f:
        out = csv.writer(f)
        out.writerow(["petal", "sepal", "species"])
        for i in range(40):
            out.writerow([i * 0.1, 1 - i * 0.05, "setosa" if i % 2 else "virginica"])
    table = prepare(
        str(tmp_path / "flowers.csv"), PrepareConfig(out=str(tmp_path / "b"), shards=2, label="species", progress=False)
    )
    assert (table.task, table.in_shape, table.classes) == ("classification", (2,), ("setosa", "virginica"))

    import pyarrow as pa
    import pyarrow.parquet as pq

    pq.write_table(
        pa.table({"a": np.arange(30.0), "b": np.ones(30), "label": np.arange(30.0) * 2}), tmp_path / "prices.parquet"
    )
    reg = prepare(str(tmp_path / "prices.parquet"), PrepareConfig(out=str(tmp_path / "c"), shards=3, progress=False))
    assert (reg.task, reg.num_classes) == ("regression", 1)
    x, y = next(StreamedDataset(str(tmp_path / "c")).batches(0, 1, 100, seed=0, epoch=0))
    assert y.dtype == torch.float32 and len(y) == 24
    with pytest.raises(ValueError, match="no column 'price'"):
        prepare(str(tmp_path / "prices.parquet"), PrepareConfig(out=str(tmp_path / "d"), label="price"))


def test_a_dataset_streams_alike_from_disk_and_a_real_http_server(digits: Path) -> None:
    local = _ids(StreamedDataset(str(digits)), 0, 2, epoch=1)
    with FileServer(digits) as server:
        over_http = StreamedDataset(f"{server.url}/manifest.json")
        assert _ids(over_http, 0, 2, epoch=1) == local
        assert sum(len(y) for _, y in over_http.test_batches(100)) == 360


@pytest.fixture
def s3(monkeypatch: pytest.MonkeyPatch) -> Iterator[str]:
    """A real S3-compatible server (moto's, on a free loopback port; s3fs finds it through AWS_ENDPOINT_URL) and
    an empty bucket on it: "ENDPOINT BUCKET"."""
    from moto.server import ThreadedMotoServer

    logging.getLogger("werkzeug").setLevel(logging.WARNING)
    server = ThreadedMotoServer(ip_address="127.0.0.1", port=0, verbose=False)
    server.start()
    try:
        host, port = server.get_host_and_port()
        endpoint = f"http://{host}:{port}"
        for key, value in (
            ("AWS_ENDPOINT_URL", endpoint),
            ("AWS_ACCESS_KEY_ID", "test"),
            ("AWS_SECRET_ACCESS_KEY", "test"),
            ("AWS_DEFAULT_REGION", "us-east-1"),
        ):
            monkeypatch.setenv(key, value)
        import s3fs

        s3fs.S3FileSystem.clear_instance_cache()
        bucket = f"datasets-{uuid.uuid4().hex[:12]}"  # moto's buckets outlive its server: one of its own a test
        s3fs.S3FileSystem().mkdir(bucket)
        yield f"{endpoint} {bucket}"
    finally:
        server.stop()


def test_prepare_writes_to_s3_and_workers_stream_from_it(s3: str, digits: Path) -> None:
    bucket = s3.split()[1]
    prepare("digits", PrepareConfig(out=f"s3://{bucket}/digits", shards=6, progress=False))
    assert _ids(StreamedDataset(f"s3://{bucket}/digits"), 1, 3) == _ids(StreamedDataset(str(digits)), 1, 3)


def test_s3_settings_from_the_sdks_files_as_the_kubernetes_component_mounts_them(
    s3: str, digits: Path, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """deploy/k8s/components/dataset-s3 gives the workers no environment but the paths of the AWS SDK's
    credentials and config files (endpoint_url in the config, for a store other than AWS)."""
    (tmp_path / "credentials").write_text("[default]\naws_access_key_id = test\naws_secret_access_key = test\n")
    endpoint, bucket = s3.split()
    (tmp_path / "config").write_text(f"[default]\nregion = us-east-1\nendpoint_url = {endpoint}\n")
    for key in ("AWS_ENDPOINT_URL", "AWS_ACCESS_KEY_ID", "AWS_SECRET_ACCESS_KEY", "AWS_DEFAULT_REGION"):
        monkeypatch.delenv(key)
    monkeypatch.setenv("AWS_SHARED_CREDENTIALS_FILE", str(tmp_path / "credentials"))
    monkeypatch.setenv("AWS_CONFIG_FILE", str(tmp_path / "config"))
    import s3fs

    s3fs.S3FileSystem.clear_instance_cache()
    prepare("digits", PrepareConfig(out=f"s3://{bucket}/digits", shards=6, progress=False))
    assert _ids(StreamedDataset(f"s3://{bucket}/digits"), 2, 3) == _ids(StreamedDataset(str(digits)), 2, 3)


def test_storage_that_cannot_be_reached_is_said_plainly(tmp_path: Path) -> None:
    with pytest.raises(ImportError, match="hdfs:// needs a JVM and Hadoop's libhdfs"):
        StreamedDataset("hdfs://127.0.0.1:9/data/digits")
    with pytest.raises(ValueError, match="read only"):
        prepare("digits", PrepareConfig(out="http://127.0.0.1:9/digits", progress=False))


def test_ps_prepare_command(tmp_path: Path) -> None:
    env = {**os.environ, "PYTHONWARNINGS": "ignore"}
    done = subprocess.run(
        [
            sys.executable,
            "-m",
            "worker.data.prepare",
            "synthetic",
            "--out",
            str(tmp_path / "s"),
            "--shards",
            "3",
            "--no-progress",
        ],
        capture_output=True,
        text=True,
        env=env,
        timeout=120,
    )
    assert done.returncode == 0, done.stderr
    assert "8192 train samples in 3 shards" in done.stdout
    bad = subprocess.run(
        [sys.executable, "-m", "worker.data.prepare", "nonsense", "--out", str(tmp_path / "t")],
        capture_output=True,
        text=True,
        env=env,
        timeout=120,
    )
    assert bad.returncode == 2 and "ps-prepare: unknown dataset 'nonsense'" in bad.stderr
    assert not (tmp_path / "t").exists()


class _Died(Exception):
    pass


def test_a_worker_that_restarts_resumes_where_the_sync_job_is(digits: Path, ps_cluster_factory) -> None:
    """A worker dies after 7 steps; the one started in its place begins at step 7 of the same epoch order (the
    servers' version), so that together they read each sample of each epoch once."""
    cluster = ps_cluster_factory(ServerConfig(mode="sync", workers=1, lr=1e-2), 2)
    config = TrainConfig(server=cluster.address, dataset=str(digits), model="logreg", epochs=2, progress=False)

    def die(step: int, loss: float) -> None:
        if step == 7:
            raise _Died

    with pytest.raises(_Died):
        train(config, on_step=die)
    metrics = train(config)
    per_epoch = -(-StreamedDataset(str(digits)).samples_per_epoch(1) // metrics["batch_size"])
    assert (metrics["first_step"], metrics["steps"]) == (7, 2 * per_epoch - 7)
    assert metrics["server_version"] == 2 * per_epoch
    assert 0 < metrics["input_wait_seconds"] < metrics["seconds"] and metrics["test_accuracy"] > 0.8
    again = train(config)  # the job is done: a worker that joins now has nothing left to read
    assert again["steps"] == 0 and again["first_step"] == 2 * per_epoch


def test_a_prepared_regression_streams_and_reports_its_test_loss(tmp_path: Path, ps_cluster_factory) -> None:
    prepare("diabetes", PrepareConfig(out=str(tmp_path), shards=2, progress=False))
    cluster = ps_cluster_factory(ServerConfig(mode="sync", workers=1, lr=3e-3), 1)
    metrics = train(TrainConfig(server=cluster.address, dataset=str(tmp_path), model="mlp", epochs=3, progress=False))
    assert metrics["task"] == "regression" and metrics["test_accuracy"] is None
    assert 0 < metrics["test_loss"] < 1.0
