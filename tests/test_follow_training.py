"""ps-worker --follow: real servers, real worker processes, a prepared dataset that grows while they train. Each
dataset shard is trained whole by one worker, once, counted from the servers' claims record; a worker SIGKILLed in
the middle of a shard has it trained again by another, from its start, and no shard is skipped; caught up, workers
wait as members of the job; SIGTERM ends one cleanly. Sync, async and SSP."""

from __future__ import annotations

import hashlib
import json
import os
import signal
import subprocess
import sys
from collections.abc import Callable, Iterator
from pathlib import Path

import grpc
import numpy as np
import pyarrow as pa
import pyarrow.parquet as pq
import pytest
from support.waiting import wait_for

from paramserver.config import ServerConfig
from paramserver.server.cluster import LocalCluster
from paramserver.v1 import ps_pb2, ps_pb2_grpc
from worker.data.manifest import MANIFEST, Manifest, ShardFile, Split

pytestmark = pytest.mark.timeout(240)

FEATURES = 8
SLOW = 120.0  # seconds any wait below may take on a loaded machine; each is a condition polled, never a sleep


class GrowingDataset:
    """A prepared dense dataset (the layout ps-prepare writes) to which shards are appended as ps-prepare --follow
    appends them: the shard written first, then the manifest replaced whole (a temporary file renamed)."""

    def __init__(self, root: Path) -> None:
        self.root = root
        root.mkdir(parents=True, exist_ok=True)
        self.shards: list[ShardFile] = []
        self._rng = np.random.default_rng(0)
        self._w = self._rng.normal(size=FEATURES)

    def add(self, *sizes: int) -> None:
        """Append one shard per size (its sample count); ids run on from shard to shard."""
        for n in sizes:
            first = sum(s.samples for s in self.shards)
            x = self._rng.normal(size=(n, FEATURES)).astype(np.float32)
            y = (x @ self._w > 0).astype(np.int64)
            table = pa.table(
                {
                    "id": pa.array(np.arange(first, first + n, dtype=np.int64)),
                    "x": pa.FixedSizeListArray.from_arrays(pa.array(x.reshape(-1)), FEATURES),
                    "y": pa.array(y),
                }
            )
            path = self.root / f"train-{len(self.shards):05d}.parquet"
            pq.write_table(table, path)
            raw = path.read_bytes()
            self.shards.append(ShardFile(path.name, n, len(raw), hashlib.sha256(raw).hexdigest()))
        splits = {"train": Split(sum(s.samples for s in self.shards), tuple(self.shards))}
        manifest = Manifest("growing", "classification", (FEATURES,), 2, splits)
        tmp = self.root / (MANIFEST + ".partial")
        tmp.write_text(manifest.to_json())
        os.replace(tmp, self.root / MANIFEST)


class Workers:
    """ps-worker --follow processes; every one still running is killed when the test ends, whatever happened."""

    def __init__(self, address: str, dataset: Path, out: Path) -> None:
        self.address, self.dataset, self.out = address, dataset, out
        self.procs: list[subprocess.Popen[str]] = []

    def start(self, *extra: str) -> subprocess.Popen[str]:
        k = len(self.procs)
        cmd = [sys.executable, "-m", "worker.cli", "--server", self.address, "--model", "mlp"]
        cmd += ["--dataset", str(self.dataset), "--follow", "--follow-poll-seconds", "0.2", "--batch-size", "8"]
        cmd += ["--no-progress", "--log-level", "INFO", "--metrics-out", str(self.out / f"w{k}.json"), *extra]
        log = open(self.out / f"w{k}.log", "w")  # noqa: SIM115 - closed with the process, in stop()
        proc = subprocess.Popen(cmd, stdout=log, stderr=subprocess.STDOUT, text=True)
        self.procs.append(proc)
        return proc

    def log(self, k: int) -> str:
        return (self.out / f"w{k}.log").read_text(errors="replace")

    def stop(self) -> None:
        for proc in self.procs:
            if proc.poll() is None:
                proc.kill()
            proc.wait(timeout=30)


@pytest.fixture
def workers(tmp_path: Path) -> Iterator[Callable[[str], Workers]]:
    made: list[Workers] = []

    def make(address: str) -> Workers:
        made.append(Workers(address, tmp_path / "ds", tmp_path))
        return made[-1]

    try:
        yield make
    finally:
        for w in made:
            w.stop()


def _record(address: str) -> list[ps_pb2.ShardClaim]:
    with grpc.insecure_channel(address) as channel:
        return list(ps_pb2_grpc.ParameterServerStub(channel).Claims(ps_pb2.ClaimsRequest(), timeout=10).claims)


def _all_done(address: str, count: int) -> list[ps_pb2.ShardClaim] | None:
    record = _record(address)
    return record if len(record) == count and all(c.state == "done" for c in record) else None


def _metrics(out: Path, k: int) -> dict[str, object]:
    """Worker k's --metrics-out summary (w{k}-RANK.json: a job of two workers numbers them by rank)."""
    (path,) = out.glob(f"w{k}-*.json")
    return dict(json.loads(path.read_text()))


def _start(factory: Callable[..., LocalCluster], mode: str) -> tuple[LocalCluster, str]:
    config = ServerConfig(mode=mode, workers=2, optimizer="sgd", lr=0.05, lease_timeout=2.0, staleness=2)
    cluster = factory(config, 2)
    return cluster, cluster.shards[0].addresses[0]


def test_a_worker_killed_in_a_shard_has_it_trained_again_and_none_is_skipped(
    tmp_path: Path, ps_cluster_factory: Callable[..., LocalCluster], workers: Callable[[str], Workers]
) -> None:
    cluster, shard0 = _start(ps_cluster_factory, "async")
    data = GrowingDataset(tmp_path / "ds")
    data.add(3000, 3000, 400, 400)
    team = workers(cluster.address)
    victim, survivor = team.start(), team.start()

    def victim_mid_shard() -> bool:
        # The victim holds a shard and has pushed from it: it is in the middle of it.
        holders = {c.worker_id for c in _record(shard0) if c.state == "held"}
        return len(holders) == 2 and cluster.shards[0].version > 20 and victim.poll() is None

    wait_for(victim_mid_shard, SLOW, lambda: team.log(0)[-2000:], 0.02)
    victim.kill()
    victim.wait(timeout=30)
    data.add(500, 500)  # the dataset grows while the survivor trains and the victim's claim runs out
    record = wait_for(lambda: _all_done(shard0, 6), SLOW, lambda: f"{_record(shard0)}\n{team.log(1)[-3000:]}", 0.2)

    # Every shard trained whole, once: by its finisher, all its samples; the victim's shard claimed twice.
    assert [c.samples for c in record] == [s.samples for s in data.shards]
    assert sorted(c.tries for c in record) == [1, 1, 1, 1, 1, 2]
    assert all(c.tries == 1 for c in record[4:])  # the shards added later: once each
    # Caught up, the survivor waits in the job, heartbeating, past several leases.
    wait_for(lambda: "caught up" in team.log(1), SLOW, lambda: team.log(1)[-2000:], 0.1)
    lapsed = cluster.shards[0].version
    wait_for(lambda: len(cluster.shards[0].membership.live) == 1, SLOW, "the victim's eviction", 0.1)
    assert survivor.poll() is None and cluster.shards[0].version == lapsed
    survivor.send_signal(signal.SIGTERM)
    assert survivor.wait(timeout=SLOW) == 0, team.log(1)[-3000:]
    metrics = _metrics(tmp_path, 1)
    mine = {t["shard"] for t in metrics["dataset_shards"]}
    assert mine == {c.shard for c in record if c.worker_id == metrics["worker_id"]}
    assert len(mine) >= 3  # the victim's shard among them, and the two added after its death
    assert not cluster.shards[0].membership.live  # it left


@pytest.mark.parametrize("mode", ["sync", "ssp"])
def test_an_idle_worker_holds_no_round_back_and_both_train_what_lands(
    tmp_path: Path, mode: str, ps_cluster_factory: Callable[..., LocalCluster], workers: Callable[[str], Workers]
) -> None:
    cluster, shard0 = _start(ps_cluster_factory, mode)
    data = GrowingDataset(tmp_path / "ds")
    data.add(1200)  # one shard: one worker trains it, the other is idle from the start
    team = workers(cluster.address)
    first, second = team.start(), team.start()
    wait_for(lambda: _all_done(shard0, 1), SLOW, lambda: team.log(0)[-2000:] + team.log(1)[-2000:], 0.2)
    data.add(600, 600, 600)
    record = wait_for(lambda: _all_done(shard0, 4), SLOW, lambda: f"{_record(shard0)}\n{team.log(1)[-2000:]}", 0.2)
    assert [c.samples for c in record] == [s.samples for s in data.shards]
    assert all(c.tries == 1 for c in record)
    for proc in (first, second):
        proc.send_signal(signal.SIGTERM)
    for k, proc in enumerate((first, second)):
        assert proc.wait(timeout=SLOW) == 0, team.log(k)[-3000:]
    metrics = [_metrics(tmp_path, k) for k in (0, 1)]
    assert sorted(t["shard"] for m in metrics for t in m["dataset_shards"]) == [0, 1, 2, 3]
    assert [m["stale_pushes"] for m in metrics] == [0, 0]  # no batch refused: none lost


def test_a_worker_started_before_the_first_shard_waits_and_stops_when_idle(
    tmp_path: Path, ps_cluster_factory: Callable[..., LocalCluster], workers: Callable[[str], Workers]
) -> None:
    cluster, shard0 = _start(ps_cluster_factory, "async")
    team = workers(cluster.address)
    proc = team.start("--follow-stop-when-idle", "1")
    wait_for(lambda: "waiting for" in team.log(0), SLOW, lambda: team.log(0)[-2000:], 0.1)
    data = GrowingDataset(tmp_path / "ds")
    data.add(300, 300)
    assert proc.wait(timeout=SLOW) == 0, team.log(0)[-3000:]
    record = _all_done(shard0, 2)
    assert record is not None and [c.samples for c in record] == [300, 300]


def test_the_claims_outlive_a_killed_shard_0(
    tmp_path: Path, ps_cluster_factory: Callable[..., LocalCluster], workers: Callable[[str], Workers]
) -> None:
    config = ServerConfig(
        mode="async", workers=2, optimizer="sgd", lr=0.05, lease_timeout=3.0, checkpoint_dir=str(tmp_path / "ckpt")
    )
    cluster = ps_cluster_factory(config, 2, processes=True)
    shard0 = cluster.addresses[0]
    data = GrowingDataset(tmp_path / "ds")
    data.add(2000, 2000, 2000, 2000)
    team = workers(cluster.address)
    team.start()
    team.start()
    # Once a shard is done and another held, shard 0 dies without a word (as a SIGKILL leaves its log) and restarts.
    wait_for(lambda: {"done", "held"} <= {c.state for c in _record(shard0)}, SLOW, lambda: team.log(0)[-2000:], 0.05)
    before = {c.shard: c for c in _record(shard0) if c.state == "done"}
    cluster.kill(0)
    cluster.procs[0].wait(timeout=30)
    cluster.restart(0)
    after = {c.shard: c for c in _record(shard0)}
    assert all(after[i].state == "done" and after[i].samples == c.samples for i, c in before.items())
    data.add(1000, 1000)
    record = wait_for(lambda: _all_done(shard0, 6), SLOW, lambda: f"{_record(shard0)}\n{team.log(0)[-3000:]}", 0.2)
    assert [c.samples for c in record] == [s.samples for s in data.shards]
    # A shard held across the restart is finished by its holder, which joined again; a claim made after the
    # last logged update may be made again (SPEC.md 18): at most the shards held then.
    assert sum(c.tries for c in record) <= 6 + 2
    assert all(p.poll() is None for p in team.procs)  # both workers rode it out
