"""Continuous training end to end, as a user runs it (the online demo's and `make bench`'s `online` section's
machinery): a log writer drops Criteo-layout files of the planted click world into a directory; `ps-prepare
--follow` prepares each into a growing dataset; `ps-server`, two `ps-worker --follow` and a `ps-serve` copy run
meanwhile. `Timeline` follows each file: landed (the writer's rename) -> prepared (the manifest lists it) ->
trained (the servers' claims record holds every train shard of it done) -> visible in serving (every serving copy
at least at the versions the shards had then).

The files are drawn from one planted world (`make_click_logs`) and cut in turn: each file's users are mostly new
(the Zipf tail: most IDs are seen in one file only) while the head users, items and tags recur, so the IDs drift
from file to file as a day's logs do.
"""

from __future__ import annotations

import contextlib
import itertools
import os
import signal
import subprocess
import sys
import time
from collections.abc import Sequence
from dataclasses import dataclass, field
from pathlib import Path

import grpc
import numpy as np
import torch

from paramserver.v1 import ps_pb2, ps_pb2_grpc
from worker.client.serving import ServingClient, serve
from worker.data.manifest import Manifest, load_manifest
from worker.data.stream import StreamedDataset
from worker.demos.common import address_of, start_server, stop
from worker.demos.planted import Clicks, criteo_lines, make_click_logs
from worker.demos.served import PsServe
from worker.models.clicks import TableOptions, build_click_model
from worker.train.metrics import auc

PREPARE = ["--format", "criteo", "--shards", "1", "--test-fraction", "0.1", "--no-normalize", "--no-progress"]


def day_of_logs(files: int, lines: int, seed: int = 0) -> list[Clicks]:
    """`files` consecutive cuts of `lines` impressions each from one planted click world."""
    logs = make_click_logs(files * lines, 1, seed=seed)
    cuts = []
    for k in range(files):
        lo, hi = k * lines, (k + 1) * lines
        offs = logs.train.tag_offsets[lo : hi + 1]
        cuts.append(
            Clicks(
                dense=logs.train.dense[lo:hi],
                user=logs.train.user[lo:hi],
                item=logs.train.item[lo:hi],
                category=logs.train.category[lo:hi],
                tags=logs.train.tags[offs[0] : offs[-1]],
                tag_offsets=offs - offs[0],
                label=logs.train.label[lo:hi],
                prob=logs.train.prob[lo:hi],
            )
        )
    return cuts


def drop(directory: Path, k: int, clicks: Clicks) -> tuple[str, float]:
    """Write file k whole under a hidden name, then rename it into place (what ps-prepare --follow sees land);
    return its name and the time it landed."""
    name = f"part-{k:05d}.tsv"
    hidden = directory / f".{name}.partial"
    hidden.write_text("\n".join(criteo_lines(clicks)) + "\n")
    os.replace(hidden, directory / name)
    return name, time.time()


def prepare_alone(directory: Path, name: str, clicks: Clicks) -> tuple[str, float]:
    """File `name` prepared by itself (ps-prepare): its samples as the followed dataset has them
    (--no-normalize: the same features whichever file came first); return the dataset and the seconds it took."""
    source = directory / name
    source.parent.mkdir(parents=True, exist_ok=True)
    source.write_text("\n".join(criteo_lines(clicks)) + "\n")
    out = directory / f"{name}.ds"
    began = time.perf_counter()
    args = [str(source), "--out", str(out), *PREPARE]
    subprocess.run([sys.executable, "-m", "worker.data.prepare", *args], check=True, stdout=subprocess.DEVNULL)
    return str(out), time.perf_counter() - began


@dataclass
class Job:
    """The running processes of one continuous job, stopped together by `stop`."""

    root: Path
    server: subprocess.Popen[str]
    address: str
    prepare: subprocess.Popen[bytes]
    workers: list[subprocess.Popen[bytes]]
    serving: PsServe
    worker_args: list[str]
    shard0: str = ""

    @property
    def logs(self) -> Path:
        return self.root / "logs"

    @property
    def dataset(self) -> Path:
        return self.root / "ds"

    def add_worker(self) -> subprocess.Popen[bytes]:
        """One more ps-worker --follow (to take a dead one's place)."""
        k = len(self.workers)
        out = ["--metrics-out", str(self.root / f"worker{k}.json")]
        log = open(self.root / f"worker{k}.log", "wb")  # noqa: SIM115 - the process holds it until it ends
        cmd = [sys.executable, "-m", "worker.cli", "--server", self.address, *self.worker_args, *out]
        self.workers.append(subprocess.Popen(cmd, stdout=log, stderr=subprocess.STDOUT))
        return self.workers[-1]

    def wait_workers_waiting(self, timeout: float = 120.0) -> None:
        """Wait until every worker started and waits for the dataset's first shard (torch loaded, flags read)."""
        deadline = time.monotonic() + timeout
        logs = [self.root / f"worker{k}.log" for k in range(len(self.workers))]
        while not all(p.exists() and b"waiting for" in p.read_bytes() for p in logs):
            if time.monotonic() > deadline or any(w.poll() is not None for w in self.workers):
                raise RuntimeError(f"the workers did not start within {timeout:.0f} s (see {self.root}/worker*.log)")
            time.sleep(0.1)

    def holder(self, worker_id: str) -> subprocess.Popen[bytes] | None:
        """The running worker process of this id (its log's first line names it: --log-level INFO)."""
        for k, proc in enumerate(self.workers):
            path = self.root / f"worker{k}.log"
            if proc.poll() is None and path.exists() and f"worker {worker_id[:8]}:" in path.read_text(errors="replace"):
                return proc
        return None

    def restart_prepare(self) -> subprocess.Popen[bytes]:
        """ps-prepare --follow again (after a kill: it resumes from the manifest)."""
        self.prepare = _prepare_follow(self.root)
        return self.prepare

    def claims(self) -> list[ps_pb2.ShardClaim]:
        """The servers' claims record (shard 0's)."""
        with grpc.insecure_channel(self.shard0) as channel:
            stub = ps_pb2_grpc.ParameterServerStub(channel)
            return list(stub.Claims(ps_pb2.ClaimsRequest(), timeout=10).claims)

    def versions(self) -> list[int]:
        """Every shard's version now."""
        with grpc.insecure_channel(self.address) as channel:
            shards = list(ps_pb2_grpc.ParameterServerStub(channel).GetTopology(ps_pb2.GetTopologyRequest()).shards)
        found = []
        for at in shards:
            with grpc.insecure_channel(at) as channel:
                topo = ps_pb2_grpc.ParameterServerStub(channel).GetTopology(ps_pb2.GetTopologyRequest(), timeout=10)
                found.append(int(topo.version))
        return found

    def shard_pids(self) -> list[int]:
        """The shard processes ps-server started (its children)."""
        path = Path(f"/proc/{self.server.pid}/task/{self.server.pid}/children")
        return [int(p) for p in path.read_text().split()] if path.exists() else []

    def stop(self) -> None:
        """Stop every process: workers (SIGTERM: they leave), the preparer, the serving copy, the servers."""
        for w in self.workers:
            stop(w, signal.SIGTERM, timeout=60)
        stop(self.prepare, signal.SIGTERM)
        self.serving.stop()
        stop(self.server, signal.SIGTERM)


def start_job(root: Path, worker_args: Sequence[str], server_args: Sequence[str] = ()) -> Job:
    """ps-server (2 shards, 2 workers, async), ps-prepare --follow, two ps-worker --follow and ps-serve, under
    `root` (logs/ the followed directory, ds/ the dataset); every process is stopped if starting fails."""
    (root / "logs").mkdir(parents=True, exist_ok=True)
    server = start_server(["--shards", "2", "--workers", "2", "--mode", "async", "--port", "0", *server_args])
    job: Job | None = None
    try:
        address = address_of(server)
        with grpc.insecure_channel(address) as channel:
            topo = ps_pb2_grpc.ParameterServerStub(channel).GetTopology(ps_pb2.GetTopologyRequest(), timeout=30)
        dataset = str(root / "ds")
        args = ["--model", "dlrm", "--dataset", dataset, "--follow", "--no-progress", *worker_args]
        job = Job(root, server, address, _prepare_follow(root), [], PsServe(address), args, topo.shards[0])
        for _ in range(2):
            job.add_worker()
        return job
    except BaseException:
        if job is not None:
            job.stop()
        else:
            stop(server)
        raise


def _prepare_follow(root: Path) -> subprocess.Popen[bytes]:
    """ps-prepare --follow from root/logs into root/ds, its output appended to root/prepare.log."""
    args = ["--follow", str(root / "logs"), "--out", str(root / "ds"), *PREPARE, "--poll-seconds", "0.25"]
    args += ["--settle-seconds", "0"]  # files land whole (a rename), as on an object store
    log = open(root / "prepare.log", "ab")  # noqa: SIM115 - the process holds it until it ends
    return subprocess.Popen([sys.executable, "-m", "worker.data.prepare", *args], stdout=log, stderr=subprocess.STDOUT)


@dataclass
class FileTimes:
    """One file's way through the job, in Unix seconds (0: not yet)."""

    name: str
    landed: float
    prepared: float = 0.0
    trained: float = 0.0
    visible: float = 0.0
    shards: list[int] = field(default_factory=list)  # its train shards' indices in the dataset
    prepare_seconds: float = 0.0  # what ps-prepare --follow spent on it (its manifest's record)
    target: list[int] = field(default_factory=list)  # the shards' versions once it was trained


class Timeline:
    """Each dropped file's times, followed by polling the manifest, the claims record and the serving copy."""

    def __init__(self, job: Job) -> None:
        self.job = job
        self.files: dict[str, FileTimes] = {}
        self._serving: ServingClient | None = None

    def landed(self, name: str, at: float) -> None:
        self.files[name] = FileTimes(name, at)

    def serving(self) -> str:
        """The serving copy's address, once it holds a whole version."""
        return self.job.serving.wait_ready()

    def poll(self) -> list[FileTimes]:
        """Look once; return the files that became visible in serving now."""
        manifest = _manifest(self.job.dataset)
        if manifest is not None:
            index = {s.path: i for i, s in enumerate(manifest.splits["train"].shards)}
            for source in manifest.files:
                times = self.files.get(source.name)
                if times is not None and not times.prepared:
                    times.prepared, times.prepare_seconds = source.prepared, source.seconds
                    times.shards = [index[p] for p in source.train]
        waiting = [t for t in self.files.values() if t.prepared and not t.trained]
        if waiting:
            done = {c.shard for c in self.job.claims() if c.state == "done"}
            for t in waiting:
                if set(t.shards) <= done:
                    t.trained, t.target = time.time(), self.job.versions()
        return self._visible()

    def _visible(self) -> list[FileTimes]:
        pending = [t for t in self.files.values() if t.trained and not t.visible]
        if not pending:
            return []
        if self._serving is None:
            self._serving = ServingClient(self.job.serving.wait_ready())
        versions = list(self._serving.status().versions)
        now, shown = time.time(), []
        for t in pending:
            if all(v >= w for v, w in zip(versions, t.target, strict=True)):
                t.visible = now
                shown.append(t)
        return shown

    def close(self) -> None:
        if self._serving is not None:
            self._serving.close()


def _manifest(dataset: Path) -> Manifest | None:
    with contextlib.suppress(FileNotFoundError, ValueError):
        return load_manifest(str(dataset))
    return None


def model_auc(model: torch.nn.Module, dataset: str) -> float:
    """The AUC of a click model on every sample of a prepared dataset (its train and test splits)."""
    data = StreamedDataset(dataset)
    try:
        labels, scores = [], []
        with torch.no_grad():
            for x, y in itertools.chain(data.batches(0, 1, 8192, seed=0, epoch=0), data.test_batches(8192)):
                scores.append(torch.sigmoid(model(x)).reshape(-1).numpy())
                labels.append(y.reshape(-1).numpy())
        return auc(np.concatenate(labels), np.concatenate(scores))
    finally:
        data.close()


def served_auc(serving: str, dataset: str, tables: TableOptions, seed: int) -> float:
    """The AUC, on every sample of a prepared dataset, of the DLRM as the serving copy holds it now."""
    schema = load_manifest(dataset).schema
    assert schema is not None
    torch.manual_seed(seed)
    with ServingClient(serving) as client:
        return model_auc(serve(build_click_model("dlrm", schema, tables), client), dataset)
