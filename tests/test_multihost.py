"""Multi-host tests without Kubernetes: shards and workers on separate network namespaces, real faults between them.

Runs only when asked (it needs root and builds network namespaces):

    sudo PS_MULTIHOST=1 .venv/bin/python -m pytest tests/test_multihost.py -v

Each test builds a lab (deploy/netns/netlab.py): a bridge in a namespace of its own, and four "hosts" (shard-0,
shard-1, worker-0, worker-1), each a namespace with a veth onto the bridge, an address on 10.213.77.0/24, and an
/etc/netns/<ns>/hosts file so the host names resolve inside them as pods' do. Shards run
`ps-server --shard-index i --peers shard-0:50051,shard-1:50051 --host 0.0.0.0`, workers `ps-worker --server
shard-0:50051`. A probe in shard-0's namespace asks both shards for their version (GetTopology) four times a second.
Faults are nftables tables inside one worker's namespace (a partition: drop everything; a reset: reject TCP with
tcp reset) and a tbf bandwidth limit on one worker's link. Every process, namespace, /etc/netns folder, bridge and
nftables table is removed after each test, also when it fails; leftovers of a crashed earlier run (psnt<pid>-* with
a dead pid) are removed before each test.
"""

from __future__ import annotations

import importlib.util
import json
import os
import re
import shutil
import signal
import subprocess
import sys
import time
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any, TypeVar

import pytest
from support.waiting import log_events, wait_for

T = TypeVar("T")

if os.environ.get("PS_MULTIHOST") != "1":
    pytest.skip("multi-host tests run only with PS_MULTIHOST=1 (and as root)", allow_module_level=True)

REPO = Path(__file__).resolve().parent.parent
_spec = importlib.util.spec_from_file_location("netlab", REPO / "deploy" / "netns" / "netlab.py")
assert _spec is not None and _spec.loader is not None
netlab = importlib.util.module_from_spec(_spec)
sys.modules["netlab"] = netlab
_spec.loader.exec_module(netlab)

_why_not = netlab.netns_available()
if _why_not:
    pytest.skip(f"multi-host tests: {_why_not}", allow_module_level=True)

needs_nft = pytest.mark.skipif(shutil.which("nft") is None, reason="needs nftables (apt-get install nftables)")
needs_tc = pytest.mark.skipif(shutil.which("tc") is None, reason="needs tc (iproute2)")

BIN = Path(sys.executable).parent
PS_SERVER = str(BIN / "ps-server")
PS_WORKER = str(BIN / "ps-worker")
PEERS = "shard-0:50051,shard-1:50051"
LEASE = 3.0
RESET_SECONDS = 2.0  # the TCP reset outage: shorter than the lease (gRPC's reconnect backoff comes on top)
TARGET = 0.95
# gRPC's default resolver (c-ares in these wheels) reads /etc/hosts, i.e. the bind-mounted /etc/netns/<ns>/hosts,
# as does the native one (getaddrinfo): both were checked, so nothing pins GRPC_DNS_RESOLVER.
CHILD_ENV = {"PYTHONUNBUFFERED": "1"}
# The figures of every test, printed as they come (run with -s to see them) and compared by the bandwidth test.
RESULTS: dict[str, dict[str, Any]] = {}


def _wait_for(probe: Callable[[], T | None], timeout: float, what: Any, interval: float = 0.2) -> T:
    return wait_for(probe, timeout, what, interval)


class Job:
    """Two shards and two workers on the lab's hosts, with their logs and metrics under tmp_path."""

    def __init__(self, lab: Any, tmp_path: Path) -> None:
        self.lab = lab
        self.dir = tmp_path
        self.shards: list[subprocess.Popen[bytes]] = []
        self.workers: dict[str, subprocess.Popen[bytes]] = {}
        self.probe_file = tmp_path / "versions.jsonl"

    def log(self, name: str) -> Path:
        return self.dir / f"{name}.log"

    def text(self, name: str) -> str:
        return self.log(name).read_text(errors="replace")

    def start_shards(self, *extra: str) -> None:
        """Start both shards (sync, 2 workers, a short lease), `extra` flags after these (the last one counts)."""
        for i in range(2):
            argv = [
                PS_SERVER, "--shard-index", str(i), "--peers", PEERS, "--host", "0.0.0.0", "--port", "50051",
                "--mode", "sync", "--workers", "2", "--lease-timeout", str(LEASE), "--log-level", "INFO", *extra,
            ]  # fmt: skip
            self.shards.append(self.lab.popen(f"shard-{i}", argv, self.log(f"shard-{i}"), env=CHILD_ENV))
        for i, proc in enumerate(self.shards):
            name = f"shard-{i}"

            def ready(name: str = name, proc: subprocess.Popen[bytes] = proc) -> bool:
                assert proc.poll() is None, f"{name} exited with {proc.returncode}:\n{self.text(name)}"
                return "PARAMSERVER-READY" in self.text(name)

            _wait_for(ready, 90, f"{name} to serve")
        # The probe asks both shards from inside shard-0's namespace, by name, over the bridge.
        argv = [
            sys.executable, str(REPO / "deploy" / "netns" / "netlab.py"), "probe", "--out", str(self.probe_file),
            "--interval", "0.25", "shard-0:50051", "shard-1:50051",
        ]  # fmt: skip
        self.lab.popen("shard-0", argv, self.log("probe"), env=CHILD_ENV)
        _wait_for(lambda: self.version() >= 0, 60, "the probe to reach both shards")

    def start_worker(self, i: int, epochs: int) -> None:
        name = f"worker-{i}"
        argv = [
            PS_WORKER, "--server", "shard-0:50051", "--no-progress", "--epochs", str(epochs), "--log-level", "INFO",
            "--metrics-out", str(self.dir / f"{name}.json"),
            # The namespaces share one kernel and one /proc, so shared memory would work across them; the point
            # here is the network path that separate hosts use: the shards' data sockets.
            "--no-shared-memory",
        ]  # fmt: skip
        self.workers[name] = self.lab.popen(name, argv, self.log(name), env=CHILD_ENV)

    def samples(self) -> list[tuple[float, float, list[int]]]:
        """(asked, answered, versions) of each probe sample: each version held at some moment in between."""
        if not self.probe_file.exists():
            return []
        out = []
        for line in self.probe_file.read_text().splitlines():
            try:
                doc = json.loads(line)
            except json.JSONDecodeError:
                continue  # a line being written
            out.append((float(doc["t0"]), float(doc["t"]), [int(v) for v in doc["v"]]))
        return out

    def version(self) -> int:
        """The lowest shard version in the probe's latest sample (-1 before both answered)."""
        samples = self.samples()
        return min(samples[-1][2]) if samples else -1

    def version_at(self, t: float) -> int:
        """The lowest shard version of the first sample asked at or after unix time t (so at least that at t)."""
        for asked, _, vs in self.samples():
            if asked >= t and min(vs) >= 0:
                return min(vs)
        return self.version()

    def version_before(self, t: float) -> int:
        """The lowest shard version of the last sample answered before unix time t (so at most that at t)."""
        before = [min(vs) for _, answered, vs in self.samples() if answered < t and min(vs) >= 0]
        return before[-1] if before else -1

    def wait_version(self, at_least: int, timeout: float) -> int:
        def probe() -> int:
            for name, proc in self.workers.items():
                assert proc.poll() is None, f"{name} ended early with {proc.returncode}:\n{self.text(name)}"
            v = self.version()
            return v if v >= at_least else 0

        return _wait_for(probe, timeout, f"shard version {at_least} (now {self.version()})")

    def worker_id(self, name: str) -> str:
        """The worker's id prefix, as its log says it (`worker 1a2b3c4d: rank ...`)."""
        line = _wait_for(lambda: log_events(self.log(name), ": rank "), 60, f"{name} to start training")[0][1]
        m = re.search(r"worker ([0-9a-f]{8}): rank (\d+)", line)
        assert m, line
        return m.group(1)

    def evictions(self, worker_id: str) -> list[tuple[float, str]]:
        """(time, line) of every shard's log line evicting this worker."""
        return [e for i in range(2) for e in log_events(self.log(f"shard-{i}"), f"evicted worker {worker_id}")]

    def finish_worker(self, name: str, timeout: float) -> dict[str, Any]:
        try:
            code = self.workers[name].wait(timeout=timeout)
        except subprocess.TimeoutExpired:
            raise AssertionError(f"{name} still running after {timeout:.0f} s:\n{self.text(name)[-4000:]}") from None
        assert code == 0, f"{name} exited with {code}:\n{self.text(name)[-4000:]}"
        # NAME.json, or NAME-RANK.json in a job of several workers
        found = [p for p in (self.dir / f"{name}.json", *self.dir.glob(f"{name}-[0-9]*.json")) if p.exists()]
        assert len(found) == 1, found
        return json.loads(found[0].read_text())

    def stop_shards(self) -> list[int]:
        """SIGTERM both shards; return their exit codes."""
        for proc in self.shards:
            proc.send_signal(signal.SIGTERM)
        codes = []
        for i, proc in enumerate(self.shards):
            try:
                codes.append(proc.wait(timeout=60))
            except subprocess.TimeoutExpired:
                raise AssertionError(f"shard-{i} ignored SIGTERM:\n{self.text(f'shard-{i}')[-4000:]}") from None
        return codes


def _report(test: str, **figures: Any) -> None:
    RESULTS[test] = figures
    print(f"\nMULTIHOST {test}: {json.dumps(figures, sort_keys=True)}", flush=True)


@pytest.fixture
def lab(tmp_path: Path) -> Iterator[Any]:
    """A fresh lab, removed after the test whatever happens (SIGTERM to pytest included)."""
    with netlab.fresh_lab() as the_lab:
        yield the_lab


@pytest.fixture
def job(lab: Any, tmp_path: Path) -> Job:
    return Job(lab, tmp_path)


def _names_resolve(lab: Any) -> None:
    """Inside a worker's namespace, the C library and gRPC both resolve the hosts file's names."""
    code = (
        "import socket, grpc; print(socket.getaddrinfo('shard-1', 50051)[0][4][0]); "
        "grpc.channel_ready_future(grpc.insecure_channel('shard-1:50051')).result(timeout=30); print('grpc ok')"
    )
    out = lab.exec("worker-1", [sys.executable, "-c", code]).stdout
    assert lab.address("shard-1") in out and "grpc ok" in out, out


# -- the tests ---------------------------------------------------------------------------------------------------


@pytest.mark.timeout(600)
def test_training_across_namespaces(job: Job) -> None:
    """Two shards and two workers on four hosts train the CNN to the target; SIGTERM stops the shards with 0."""
    t0 = time.monotonic()
    job.start_shards()
    _names_resolve(job.lab)
    for i in range(2):
        job.start_worker(i, epochs=10)
    m = [job.finish_worker(f"worker-{i}", timeout=420) for i in range(2)]
    codes = job.stop_shards()
    assert codes == [0, 0], codes
    for i in range(2):
        assert m[i]["test_accuracy"] >= TARGET, m[i]
    for i in range(2):
        assert "stopped at version" in job.text(f"shard-{i}")
    _report(
        "training",
        accuracy=[x["test_accuracy"] for x in m],
        steps=[x["steps"] for x in m],
        worker_seconds=[x["seconds"] for x in m],
        samples_per_second=[x["samples_per_second"] for x in m],
        server_version=[x["server_version"] for x in m],
        test_seconds=round(time.monotonic() - t0, 1),
    )


@needs_nft
@pytest.mark.timeout(900)
def test_partitioned_worker_is_evicted_and_rejoins(job: Job) -> None:
    """worker-1 cut off for longer than the lease: evicted, worker-0 trains on; healed: worker-1 re-joins."""
    t0 = time.monotonic()
    job.start_shards()
    for i in range(2):
        job.start_worker(i, epochs=40)
    ids = {name: job.worker_id(name) for name in ("worker-0", "worker-1")}
    job.wait_version(50, timeout=300)

    t_cut = time.time()
    job.lab.partition("worker-1")
    # The cut is whole once nft returns, which on a loaded machine can be a second or more after t_cut, while
    # the rounds go on: the version at the cut is the one sampled after that.
    t_whole = time.time()
    assert "psnt" in job.lab.nft_tables("worker-1")
    try:
        # Every shard evicts worker-1 once its lease (3 s) runs out ...
        evictions = _wait_for(
            lambda: job.evictions(ids["worker-1"]) if len(job.evictions(ids["worker-1"])) >= 2 else None,
            60,
            "both shards to evict worker-1",
        )
        assert len(evictions) == 2 and not job.evictions(ids["worker-0"]), (evictions, job.evictions(ids["worker-0"]))
        t_evicted = max(t for t, _ in evictions)
        v_before = job.version_at(t_whole)  # the round in flight may still close: sampled after the cut
        v_stalled = job.version_before(t_evicted)  # a sync round waits for worker-1 until its lease runs out
        v_evicted = job.version_at(t_evicted)
        # ... and worker-0 goes on alone: the version keeps rising while worker-1 is still cut off.
        _wait_for(
            lambda: time.time() - t_cut >= 2 * LEASE and job.version() >= v_evicted + 20,
            120,
            f"the version to rise past {v_evicted + 20} during the partition (now {job.version()})",
        )
        assert job.workers["worker-0"].poll() is None or job.workers["worker-0"].returncode == 0
    finally:
        v_heal = job.version()
        t_heal = time.time()
        job.lab.heal("worker-1")
    assert "psnt" not in job.lab.nft_tables("worker-1")

    def rejoined() -> dict[str, float]:
        first: dict[str, float] = {}
        for t, line in log_events(job.log("worker-1"), "re-joined shard"):
            first.setdefault(line.split("re-joined shard ")[1].split()[0], t)
        return first if len(first) == 2 else {}

    rejoins = _wait_for(rejoined, 120, "worker-1 to re-join both shards after the partition")
    assert set(rejoins) == {"shard-0:50051", "shard-1:50051"}, rejoins
    m0 = job.finish_worker("worker-0", timeout=600)
    m1 = job.finish_worker("worker-1", timeout=600)
    codes = job.stop_shards()
    assert codes == [0, 0], codes
    assert m0["test_accuracy"] >= TARGET, m0
    assert v_heal > v_evicted >= v_before, (v_before, v_evicted, v_heal)
    assert v_stalled <= v_before + 1, (v_before, v_stalled, job.version_at(t_cut), round(t_whole - t_cut, 2))
    _report(
        "partition",
        cut_took_seconds=round(t_whole - t_cut, 2),
        version_at_partition=v_before,
        version_just_before_eviction=v_stalled,
        version_just_after_eviction=v_evicted,
        version_at_heal=v_heal,
        partition_seconds=round(t_heal - t_cut, 1),
        eviction_after_seconds=[round(t - t_cut, 2) for t, _ in evictions],
        rejoin_after_heal_seconds={k: round(t - t_heal, 2) for k, t in sorted(rejoins.items())},
        accuracy=[m0["test_accuracy"], m1["test_accuracy"]],
        stale_pushes=[m0["stale_pushes"], m1["stale_pushes"]],
        steps=[m0["steps"], m1["steps"]],
        final_version=max(m0["server_version"], m1["server_version"]),
        test_seconds=round(time.monotonic() - t0, 1),
    )


@needs_nft
@pytest.mark.timeout(900)
def test_tcp_reset_is_retried(job: Job) -> None:
    """worker-0's TCP answered with resets for 2 s: it notices (retries, or eviction and re-join), and training
    completes."""
    t0 = time.monotonic()
    job.start_shards()
    for i in range(2):
        job.start_worker(i, epochs=20)
    ids = {name: job.worker_id(name) for name in ("worker-0", "worker-1")}
    job.wait_version(50, timeout=300)

    t_cut = time.time()
    job.lab.reset_tcp("worker-0")
    try:
        time.sleep(RESET_SECONDS)
    finally:
        t_heal = time.time()
        v_heal = job.version()
        job.lab.heal("worker-0")

    m0 = job.finish_worker("worker-0", timeout=600)
    m1 = job.finish_worker("worker-1", timeout=600)
    codes = job.stop_shards()
    assert codes == [0, 0], codes
    assert m0["test_accuracy"] >= TARGET, m0
    assert m1["test_accuracy"] >= TARGET, m1
    v_before = job.version_at(t_cut)
    retries = log_events(job.log("worker-0"), "unavailable")
    evicted = [t for t, _ in job.evictions(ids["worker-0"])]
    assert not job.evictions(ids["worker-1"]), job.evictions(ids["worker-1"])
    rejoined = log_events(job.log("worker-0"), "re-joined shard")
    outage = [e for e in log_events(job.log("worker-0"), "heartbeat to shard") if "failed" in e[1]]
    # The resets reach whatever worker-0 sends meanwhile: a gRPC call fails UNAVAILABLE and is retried, and its
    # heartbeats fail (a warning when the outage starts), even while its step waits on an idle data-socket
    # connection that sees no packet, hence no reset.
    assert retries or outage, f"worker-0 never noticed the resets:\n{job.text('worker-0')[-4000:]}"
    if evicted:
        assert rejoined, f"worker-0 was evicted and never re-joined:\n{job.text('worker-0')[-4000:]}"
    noticed = retries + outage + rejoined
    assert all(t_cut - 1 <= t <= t_heal + 60 for t, _ in noticed), (retries, outage, rejoined)
    if retries:
        # A reset shows as ECONNRESET, or as a plain end of stream where the socket had already reported the reset
        # to an earlier call (a send, or the shard's side closing its half first).
        signs = ("Connection reset", "Connection refused", "closed the connection")
        assert any(any(s in line for s in signs) for _, line in retries), retries
    _report(
        "reset",
        reset_seconds=round(t_heal - t_cut, 1),
        version_at_reset=v_before,
        version_at_heal=v_heal,
        unavailable_retries_logged=len(retries),
        first_retry_after_seconds=round(retries[0][0] - t_cut, 2) if retries else None,
        last_retry_after_heal_seconds=round(retries[-1][0] - t_heal, 2) if retries else None,
        evicted_after_seconds=[round(t - t_cut, 2) for t in evicted],
        rejoin_after_heal_seconds=[round(t - t_heal, 2) for t, _ in rejoined],
        heartbeat_outage_logged_after_seconds=[round(t - t_cut, 2) for t, _ in outage],
        accuracy=[m0["test_accuracy"], m1["test_accuracy"]],
        stale_pushes=[m0["stale_pushes"], m1["stale_pushes"]],
        test_seconds=round(time.monotonic() - t0, 1),
    )


@needs_tc
@pytest.mark.timeout(900)
def test_bandwidth_limited_worker(job: Job) -> None:
    """worker-1's link limited to 50 Mbit/s both ways (tbf): training still completes to the target."""
    t0 = time.monotonic()
    job.lab.limit_bandwidth("worker-1", rate="50mbit", burst="32kbit", latency="400ms")
    assert "tbf" in job.lab.qdiscs("worker-1")
    job.start_shards()
    for i in range(2):
        job.start_worker(i, epochs=10)
    m = [job.finish_worker(f"worker-{i}", timeout=600) for i in range(2)]
    codes = job.stop_shards()
    assert codes == [0, 0], codes
    for x in m:
        assert x["test_accuracy"] >= TARGET, x
    figures: dict[str, Any] = {
        "accuracy": [x["test_accuracy"] for x in m],
        "worker_seconds": [x["seconds"] for x in m],
        "samples_per_second": [x["samples_per_second"] for x in m],
        "test_seconds": round(time.monotonic() - t0, 1),
    }
    base = RESULTS.get("training")
    if base:
        figures["slowdown_vs_unlimited"] = round(max(figures["worker_seconds"]) / max(base["worker_seconds"]), 2)
    _report("bandwidth", **figures)


# A worker that pushes and pulls a 16 MB model (8 MB per shard: over the size a shard waits for whole before it
# takes a scratch buffer) as fast as it can, printing the time of each step.
_PUSHER = """
import json, sys, time, torch
from worker import PSClient
with PSClient(sys.argv[1], shared_memory=False, timeout=300.0) as client:
    model = {"w": torch.zeros(4_000_000)}
    client.register(model)
    for step in range(100_000):
        client.push_pull({"w": torch.full((4_000_000,), 1e-3)})
        print(json.dumps({"t": time.time(), "step": step}), flush=True)
"""


def _steps(job: Job, name: str) -> list[float]:
    out = []
    for line in job.text(name).splitlines():
        if line.startswith('{"t"'):
            out.append(json.loads(line)["t"])
    return out


@needs_nft
@needs_tc
@pytest.mark.timeout(900)
def test_a_link_dropped_mid_push_holds_the_shard_only_until_the_frame_deadline(job: Job) -> None:
    """worker-1's link (20 Mbit/s, so that its 8 MB pushes take seconds) is dropped mid-push, without a FIN: its
    shard holds the push's scratch buffer (--max-concurrent-pushes 1) only until the frame's deadline (10 s + 1 s
    per MiB), then ends the connection, and worker-0's pushes go on. The lease is long, so eviction cannot be
    what frees it."""
    t0 = time.monotonic()
    job.lab.limit_bandwidth("worker-1", rate="20mbit", burst="32kbit", latency="400ms")
    job.start_shards("--mode", "async", "--lease-timeout", "600", "--max-concurrent-pushes", "1")
    for i in range(2):
        argv = [sys.executable, "-c", _PUSHER, "shard-0:50051"]
        job.workers[f"worker-{i}"] = job.lab.popen(f"worker-{i}", argv, job.log(f"worker-{i}"), env=CHILD_ENV)
    _wait_for(lambda: len(_steps(job, "worker-1")) >= 2, 300, "worker-1 to take two steps over its slow link")
    time.sleep(1.0)  # well into its next push (each takes about 3 s per shard at 20 Mbit/s)
    t_cut = time.time()
    job.lab.partition("worker-1")
    try:
        done = len([t for t in _steps(job, "worker-0") if t < t_cut])
        _wait_for(
            lambda: len(_steps(job, "worker-0")) >= done + 10,
            180,
            "worker-0 to take 10 more steps after worker-1's link was dropped",
        )
        ended = _wait_for(
            lambda: [e for i in range(2) for e in log_events(job.log(f"shard-{i}"), "past their deadline")] or None,
            60,
            "a shard to end the stalled connection",
        )
    finally:
        job.lab.heal("worker-1")
    after = [t for t in _steps(job, "worker-0") if t >= t_cut]
    gaps = [b - a for a, b in zip([t_cut, *after], after, strict=False)]
    assert max(gaps) < 120, gaps  # the client's own timeout would have failed the step long before
    _report(
        "dropped_mid_push",
        longest_wait_of_worker0_after_the_cut_s=round(max(gaps), 1),
        connection_ended_after_s=round(min(t for t, _ in ended) - t_cut, 1),
        steps_after_cut=len(after),
        test_seconds=round(time.monotonic() - t0, 1),
    )
