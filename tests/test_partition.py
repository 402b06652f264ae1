"""Network partitions around a hot standby (`--replicas 2`): one shard's two copies on two hosts, etcd on a third,
the workers on a fourth, and nftables cutting links between them.

Runs only when asked (it needs root and builds network namespaces), like tests/test_multihost.py:

    sudo PS_MULTIHOST=1 .venv/bin/python -m pytest tests/test_partition.py -v -s

Each test builds a lab (deploy/netns/netlab.py) with four hosts: `etcd` (a single-member etcd on its lab address),
`copy-0` and `copy-1` (`ps-server --shard-index 0 --replica-index R --replicas 2 --coordinator http://etcd:2379
--peers copy-0:50051,copy-1:50051 --replication-port 50071`, async, SGD with lr 1) and `worker` (two worker
processes: worker-0 sends its tensors over the data socket, worker-1 over gRPC only). A watcher inside etcd's
namespace logs every change of the shard's configuration (`/paramserver/<job>/shard/0`: epoch, primary, in-sync
set) with its time, and at the end the key's whole history is read back from etcd's multi-version store (every
revision, not only the sampled ones).

Exact arithmetic: every worker pushes a gradient of -1 everywhere with explicit steps 1, 2, ..., so each applied
push adds exactly +1 to every weight; a step is appended to the worker's file (with the times its push_pull began
and returned, and the copy that answered) once it returned, and a step that failed is sent again (a shard applies a
(worker, step) once) until it is acknowledged. At the end the weights, pulled by a fresh client, and both copies'
versions must equal the number of acknowledged steps: nothing lost, nothing applied twice.

The faults (each a test): the primary cut off from its backup only; the primary cut off from everything (its
namespace keeps only loopback); the primary cut off from the workers only; and how soon workers find the new
primary after a full cut (gRPC about 1 s after its own deadline, the data socket within TCP keepalive's 3 s).
`-s` prints one `PARTITION <test>: {...}`
line of figures per test. Every process, namespace, /etc/netns folder and nftables table is removed after each
test, also when it fails.
"""

from __future__ import annotations

import importlib.util
import json
import os
import re
import shutil
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
if "netlab" in sys.modules:  # tests/test_multihost.py loaded it in this session already
    netlab = sys.modules["netlab"]
else:
    _spec = importlib.util.spec_from_file_location("netlab", REPO / "deploy" / "netns" / "netlab.py")
    assert _spec is not None and _spec.loader is not None
    netlab = importlib.util.module_from_spec(_spec)
    sys.modules["netlab"] = netlab
    _spec.loader.exec_module(netlab)

_why_not = netlab.netns_available()
if _why_not:
    pytest.skip(f"partition tests: {_why_not}", allow_module_level=True)
if shutil.which("nft") is None:
    pytest.skip("partition tests need nftables (apt-get install nftables)", allow_module_level=True)

from paramserver.server.replica import DEPOSED_EXIT  # noqa: E402
from paramserver.testing import etcd_binary  # noqa: E402

BIN = Path(sys.executable).parent
PS_SERVER = str(BIN / "ps-server")
HOSTS = {"copy-0": 10, "copy-1": 11, "worker": 20, "etcd": 30}
COPIES = ("copy-0", "copy-1")
PORT, REPLICATION_PORT, ETCD_PORT = 50051, 50071, 2379
PEERS = ",".join(f"{c}:{PORT}" for c in COPIES)
COORDINATOR = f"http://etcd:{ETCD_PORT}"
JOB = "paramserver"  # the default --job-name: the key is /paramserver/paramserver/shard/0
REPLICA_TIMEOUT = 0.5  # the default
WORKERS = 2
# worker-0 sends its tensors over the shard's data socket (what a worker on another host uses by default),
# worker-1 over gRPC only (data_socket=False): they notice a silent copy differently.
TRANSPORTS = ("socket", "grpc")
ELEMENTS = 1000
# The workers' PSClient timeout: a call to a copy that does not answer fails after about this long, so that the
# figures show the failover rather than a long client timeout (ps-worker's default is 120 s).
CLIENT_TIMEOUT = 1.0
CUT_SECONDS = 3.0
# The workers cut off from the primary: longer than CLIENT_TIMEOUT + 5 s (when a data-socket exchange gives up),
# shorter than the lease (10 s), so that the data-socket worker too tries the backup during the cut.
WORKERS_CUT_SECONDS = 7.0
# An acknowledgement that left a copy just before the nft rule went in is written by the worker a little later: the
# losing copy's acknowledgements may be written up to this long after the cut (for pushes begun before it).
ACK_MARGIN = 1.0
CHILD_ENV = {"PYTHONUNBUFFERED": "1"}

# One worker process: push -1s with steps 1, 2, ... until the stop file exists, each step sent again until it is
# acknowledged; one JSON line per acknowledged step: when its (last) push_pull began and returned, the copy that
# answered, the version pulled, how many push_pulls it took. Failed tries (with the time) go to stderr, its log,
# with the client library's own INFO lines (a copy that did not answer or refused, and the one tried next).
_WORKER = r"""
import json, logging, os, sys, time, torch
from worker import PSClient
logging.basicConfig(level=logging.INFO, format="%(created).3f %(levelname)s %(name)s: %(message)s")
address, worker_id, out_path, stop_path, timeout, n, transport = sys.argv[1:8]
torch.set_num_threads(1)
model, grad = {"w": torch.zeros(int(n))}, {"w": torch.zeros(int(n))}
def retried(what, fn):  # joining and registering with a short timeout on a loaded machine may take tries
    for attempt in range(1, 31):
        try:
            return fn()
        except Exception as exc:
            print(f"{time.time():.3f} {what} try {attempt}: {type(exc).__name__}: {exc}", file=sys.stderr, flush=True)
            time.sleep(0.5)
    raise SystemExit(f"{what} failed 30 times")
client = retried("join", lambda: PSClient(
    address, worker_id=worker_id, shared_memory=False, data_socket=transport == "socket", timeout=float(timeout)
))
with client as c, open(out_path, "a", buffering=1) as out:
    retried("register", lambda: c.register(model))
    step = 0
    while not os.path.exists(stop_path):
        step += 1
        tries = 0
        while True:
            grad["w"].fill_(-1.0)
            tries += 1
            began = time.time()
            try:
                c.push_pull(grad, step=step)
                break
            except Exception as exc:  # not acknowledged: send the same (worker, step) again
                print(f"{time.time():.3f} step {step} try {tries} at {c.links[0].address}: "
                      f"{type(exc).__name__}: {str(exc)[:300]}", file=sys.stderr, flush=True)
                time.sleep(0.02)
        out.write(json.dumps({"step": step, "t0": began, "t": time.time(), "copy": c.links[0].address,
                              "v": c.versions[0], "tries": tries}) + "\n")
print(f"{time.time():.3f} stopped after step {step}", file=sys.stderr, flush=True)
"""

# Inside etcd's namespace: one line {"t", "cfg"} each time the shard's configuration (as read) changes.
_WATCH = r"""
import json, sys, time
from paramserver.coord import CoordinatorUnavailable, Etcd, PartRegister
register = PartRegister(Etcd(sys.argv[1], timeout=1.0), sys.argv[2], 0)
last = "none yet"
with open(sys.argv[3], "a", buffering=1) as out:
    while True:
        try:
            cfg = register.read()
        except CoordinatorUnavailable:
            time.sleep(0.05)
            continue
        doc = None if cfg is None else {"epoch": cfg.epoch, "primary": cfg.primary, "in_sync": sorted(cfg.in_sync),
                                        "revision": cfg.revision}
        if doc != last:
            out.write(json.dumps({"t": round(time.time(), 3), "cfg": doc}) + "\n")
            last = doc
        time.sleep(0.02)
"""

# Inside etcd's namespace: every value the key ever had (etcd keeps every revision until compacted, and this
# single-member etcd never compacts), oldest first.
_HISTORY = r"""
import base64, json, sys, urllib.request
url, key = sys.argv[1], base64.b64encode(sys.argv[2].encode()).decode()
def post(path, body):
    req = urllib.request.Request(url + path, data=json.dumps(body).encode(),
                                 headers={"Content-Type": "application/json"}, method="POST")
    with urllib.request.urlopen(req, timeout=5) as reply:
        return json.loads(reply.read())
now = int(post("/v3/kv/range", {"key": key})["header"]["revision"])
seen, history = set(), []
for rev in range(1, now + 1):
    for kv in post("/v3/kv/range", {"key": key, "revision": str(rev)}).get("kvs") or []:
        mod = int(kv["mod_revision"])
        if mod not in seen:
            seen.add(mod)
            history.append({"revision": mod, **json.loads(base64.b64decode(kv["value"]))})
print(json.dumps(history))
"""

# Inside the workers' namespace, at the end: each copy's version (GetTopology), and the weights pulled by a client
# that does not join (it finds the primary).
_READ = r"""
import json, sys, grpc, torch
from paramserver.v1 import ps_pb2, ps_pb2_grpc
from worker import PSClient
addresses, n = sys.argv[1].split(","), int(sys.argv[2])
versions = {}
for a in addresses:
    with grpc.insecure_channel(a) as channel:
        try:
            topo = ps_pb2_grpc.ParameterServerStub(channel).GetTopology(ps_pb2.GetTopologyRequest(), timeout=5)
            versions[a] = int(topo.version)
        except grpc.RpcError as err:
            versions[a] = err.code().name
with PSClient(addresses[0], join=False, shared_memory=False, data_socket=False, timeout=30) as reader:
    w = {"w": torch.zeros(n)}
    reader.pull(w)
    print(json.dumps({"versions": versions, "pulled_version": reader.versions[0], "from": reader.links[0].address,
                      "min": float(w["w"].min()), "max": float(w["w"].max())}))
"""

# Inside a copy's namespace, on loopback: that copy's version (GetTopology), -1 if it does not answer.
_VERSION = r"""
import sys, grpc
from paramserver.v1 import ps_pb2, ps_pb2_grpc
with grpc.insecure_channel(sys.argv[1]) as channel:
    try:
        print(int(ps_pb2_grpc.ParameterServerStub(channel).GetTopology(ps_pb2.GetTopologyRequest(), timeout=5).version))
    except grpc.RpcError:
        print(-1)
"""


class SlowFailover(AssertionError):
    """A worker was not acknowledged by the new primary in time (test_workers_find_the_new_primary_...)."""


def _wait_for(probe: Callable[[], T | None], timeout: float, what: Any, interval: float = 0.05) -> T:
    return wait_for(probe, timeout, what, interval)


def _json_lines(path: Path) -> list[dict[str, Any]]:
    if not path.exists():
        return []
    out = []
    for line in path.read_text().splitlines():
        try:
            out.append(json.loads(line))
        except json.JSONDecodeError:
            pass  # a line being written
    return out


class Replicated:
    """etcd, one shard's two copies and the worker processes on the lab's hosts; logs and files under tmp_path."""

    def __init__(self, lab: Any, tmp_path: Path) -> None:
        self.lab = lab
        self.dir = tmp_path
        self.copies: dict[int, subprocess.Popen[bytes]] = {}
        self.starts = {0: 0, 1: 0}  # how many times each copy was started (its logs: copy-R.1.log, copy-R.2.log...)
        self.deposed_restarts: list[str] = []  # copies restarted by `restart_deposed` (what a supervisor does)
        self.workers: dict[str, subprocess.Popen[bytes]] = {}
        self.stop_file = tmp_path / "stop"
        self.watch_file = tmp_path / "etcd-config.jsonl"

    def log(self, name: str) -> Path:
        return self.dir / f"{name}.log"

    def copy_log(self, r: int, start: int | None = None) -> Path:
        return self.log(f"copy-{r}.{start or self.starts[r]}")

    def copy_logs(self, r: int) -> str:
        return "".join(self.copy_log(r, n).read_text(errors="replace") for n in range(1, self.starts[r] + 1))

    def address(self, r: int) -> str:
        return f"{COPIES[r]}:{PORT}"

    def copy_of(self, address: str) -> int:
        return COPIES.index(address.rsplit(":", 1)[0])

    # -- processes ---------------------------------------------------------------------------------------------

    def start_etcd(self) -> None:
        ip = self.lab.address("etcd")
        client, peer = f"http://{ip}:{ETCD_PORT}", "http://127.0.0.1:2380"
        argv = [
            etcd_binary(), "--name", "ps", "--data-dir", str(self.dir / "etcd-data"),
            "--listen-client-urls", client, "--advertise-client-urls", client,
            "--listen-peer-urls", peer, "--initial-advertise-peer-urls", peer, "--initial-cluster", f"ps={peer}",
            "--log-level", "error",
        ]  # fmt: skip
        proc = self.lab.popen("etcd", argv, self.log("etcd"), env=CHILD_ENV)

        def healthy() -> bool:
            assert proc.poll() is None, f"etcd exited with {proc.returncode}:\n{self.log('etcd').read_text()}"
            code = f"import urllib.request as u; print(u.urlopen('{COORDINATOR}/health', timeout=1).read())"
            argv = self.lab.exec_argv("worker", [sys.executable, "-c", code])  # by name, from another host
            return '"true"' in subprocess.run(argv, capture_output=True, text=True, timeout=30).stdout

        _wait_for(healthy, 30, lambda: "etcd to be healthy", interval=0.2)
        argv = [sys.executable, "-c", _WATCH, COORDINATOR, JOB, str(self.watch_file)]
        self.lab.popen("etcd", argv, self.log("etcd-watch"), env=CHILD_ENV)

    def copy_argv(self, r: int) -> list[str]:
        return [
            PS_SERVER, "--shard-index", "0", "--replica-index", str(r), "--replicas", "2",
            "--coordinator", COORDINATOR, "--peers", PEERS, "--host", "0.0.0.0", "--port", str(PORT),
            "--replication-port", str(REPLICATION_PORT), "--replica-timeout", str(REPLICA_TIMEOUT),
            "--mode", "async", "--workers", str(WORKERS), "--optimizer", "sgd", "--lr", "1",
            "--no-shared-memory", "--log-level", "INFO",
        ]  # fmt: skip

    def start_copy(self, r: int) -> None:
        """Start copy r (again: the same command, a new log)."""
        self.starts[r] += 1
        self.copies[r] = self.lab.popen(COPIES[r], self.copy_argv(r), self.copy_log(r), env=CHILD_ENV)

    def wait_serving(self, r: int) -> None:
        proc, log = self.copies[r], self.copy_log(r)

        def ready() -> bool:
            assert proc.poll() is None, f"copy-{r} exited with {proc.returncode}:\n{log.read_text()[-4000:]}"
            return "PARAMSERVER-READY" in log.read_text(errors="replace")

        _wait_for(ready, 90, lambda: f"copy-{r} to serve", interval=0.1)

    def restart_deposed(self) -> list[int]:
        """Start again every copy that exited with DEPOSED_EXIT (what the Kubernetes Job or a supervisor does);
        any other exit fails the test. Return the copies restarted."""
        restarted = []
        for r, proc in self.copies.items():
            code = proc.poll()
            if code is None:
                continue
            assert code == DEPOSED_EXIT, f"copy-{r} exited with {code}:\n{self.copy_log(r).read_text()[-4000:]}"
            self.deposed_restarts.append(f"copy-{r} at {time.time():.3f}")
            self.start_copy(r)
            restarted.append(r)
        return restarted

    def start_workers(self) -> None:
        for i in range(WORKERS):
            name = f"worker-{i}"
            argv = [
                sys.executable, "-c", _WORKER, self.address(0), f"partition-test-{name}", str(self.steps_file(name)),
                str(self.stop_file), str(CLIENT_TIMEOUT), str(ELEMENTS), TRANSPORTS[i],
            ]  # fmt: skip
            self.workers[name] = self.lab.popen("worker", argv, self.log(name), env=CHILD_ENV)

    def stop_workers(self, timeout: float = 60) -> None:
        """Let every worker finish its step (acknowledged) and exit; they must exit 0."""
        self.stop_file.touch()
        for name, proc in self.workers.items():
            try:
                code = proc.wait(timeout=timeout)
            except subprocess.TimeoutExpired:
                raise AssertionError(f"{name} did not stop:\n{self.log(name).read_text()[-4000:]}") from None
            assert code == 0, f"{name} exited with {code}:\n{self.log(name).read_text()[-4000:]}"

    # -- what the workers and etcd say -------------------------------------------------------------------------

    def steps_file(self, name: str) -> Path:
        return self.dir / f"{name}.steps"

    def acks(self) -> list[dict[str, Any]]:
        """Every acknowledged step of every worker (with "worker" and "by", the copy's index), by time."""
        out = [
            dict(doc, worker=name, by=self.copy_of(doc["copy"]))
            for name in self.workers
            for doc in _json_lines(self.steps_file(name))
        ]
        return sorted(out, key=lambda d: d["t"])

    def check_workers(self) -> None:
        for name, proc in self.workers.items():
            assert proc.poll() is None, f"{name} ended early with {proc.returncode}:\n{self.log(name).read_text()}"

    def wait_acks(self, count: int, timeout: float, since: float = 0.0, by: int | None = None) -> float:
        """Wait for `count` acknowledgements after unix time `since` (by copy `by` if given); return the last
        one's time."""

        def enough() -> float:
            self.check_workers()
            got = [a["t"] for a in self.acks() if a["t"] > since and (by is None or a["by"] == by)]
            return got[count - 1] if len(got) >= count else 0.0

        def what() -> str:
            return f"{count} acknowledgements after {since:.3f}" + f" by copy-{by}" * (by is not None)

        return _wait_for(enough, timeout, what)

    def configs(self) -> list[tuple[float, dict[str, Any] | None]]:
        return [(float(d["t"]), d["cfg"]) for d in _json_lines(self.watch_file)]

    def config(self) -> dict[str, Any] | None:
        seen = self.configs()
        return seen[-1][1] if seen else None

    def wait_config(
        self, ok: Callable[[dict[str, Any]], bool], timeout: float, what: str
    ) -> tuple[float, dict[str, Any]]:
        """Wait until the latest configuration satisfies `ok`; return when the watcher saw it, and it."""

        def latest() -> tuple[float, dict[str, Any]] | None:
            seen = self.configs()
            if seen and seen[-1][1] is not None and ok(seen[-1][1]):
                return seen[-1][0], seen[-1][1]
            return None

        return _wait_for(latest, timeout, lambda: f"{what} (configuration now {self.config()})")

    def first_config(
        self, since: float, ok: Callable[[dict[str, Any]], bool], timeout: float, what: str
    ) -> tuple[float, dict[str, Any]]:
        """Wait for a configuration seen after `since` that satisfies `ok`; return the first one (and when)."""

        def first() -> tuple[float, dict[str, Any]] | None:
            self.restart_deposed()
            return next(((t, c) for t, c in self.configs() if t > since and c is not None and ok(c)), None)

        return _wait_for(first, timeout, lambda: f"{what} (configuration now {self.config()})")

    def state_transfers(self, r: int, start: int) -> dict[str, int]:
        """How often copy r (its run number `start`) took the primary's whole state, and how many of those links
        ended because an update after the state did not follow it."""
        text = self.copy_log(r, start).read_text(errors="replace")
        return {"states_taken": text.count("took the primary's state"), "not_following": text.count("for a copy at")}

    def settled(self, timeout: float = 60) -> dict[str, Any]:
        """The configuration once both copies run and are in sync (right before a fault)."""

        def probe() -> dict[str, Any] | None:
            self.restart_deposed()
            cfg = self.config()
            return cfg if cfg is not None and len(cfg["in_sync"]) == 2 else None

        return _wait_for(probe, timeout, lambda: f"both copies in sync (configuration now {self.config()})")

    def history(self) -> list[dict[str, Any]]:
        out = self.lab.exec("etcd", [sys.executable, "-c", _HISTORY, COORDINATOR, f"/paramserver/{JOB}/shard/0"])
        return json.loads(out.stdout)

    def read_back(self) -> dict[str, Any]:
        out = self.lab.exec("worker", [sys.executable, "-c", _READ, PEERS, str(ELEMENTS)])
        return json.loads(out.stdout.strip().splitlines()[-1])

    def version_inside(self, r: int) -> int:
        """Copy r's version, asked on loopback inside its own namespace (works while it is partitioned)."""
        out = self.lab.exec(COPIES[r], [sys.executable, "-c", _VERSION, f"127.0.0.1:{PORT}"])
        return int(out.stdout.strip())

    # -- the job -----------------------------------------------------------------------------------------------

    def start(self) -> dict[str, Any]:
        """etcd, both copies, the workers; return the configuration once both copies are in sync and the workers
        trained a while."""
        self.start_etcd()
        for r in range(2):
            self.start_copy(r)
        for r in range(2):
            self.wait_serving(r)
        self.start_workers()
        self.settled(90)

        def every_worker_trains() -> bool:
            self.check_workers()
            acks = self.acks()
            return len(acks) >= 100 and all(sum(a["worker"] == name for a in acks) >= 20 for name in self.workers)

        _wait_for(every_worker_trains, 120, lambda: f"every worker to train a while ({len(self.acks())} acks)")
        return self.settled()

    def finish(self) -> dict[str, Any]:
        """Stop the workers, then check by exact arithmetic that each acknowledged step was applied exactly once on
        the primary, and that both copies hold that version; return the figures."""
        self.stop_workers()
        acks = self.acks()
        for name in self.workers:  # each worker's steps are 1..K, each acknowledged once
            steps = [a["step"] for a in acks if a["worker"] == name]
            assert steps == list(range(1, len(steps) + 1)), f"{name}'s acknowledged steps are not 1..K"
        total = len(acks)

        def same_versions() -> dict[str, Any] | None:
            self.settled()
            got = self.read_back()
            return got if len(set(got["versions"].values())) == 1 else None

        got = _wait_for(same_versions, 60, lambda: "both copies at the same version", interval=0.5)
        assert got["min"] == got["max"] == float(total), (
            f"{total} acknowledged pushes, but the weights moved by {got['min']}..{got['max']} "
            f"({'lost' if got['min'] < total else 'applied twice'}): {got}"
        )
        assert set(got["versions"].values()) == {total}, (total, got)
        return {"acknowledged": total, "final": got}

    def check_history(self) -> list[dict[str, Any]]:
        """Every value the key ever had: one primary per epoch, epochs never going back, a new primary only with a
        new epoch and from the in-sync set before it; and each worker's acknowledgements moved from one copy to
        the other no more often than the primary changed (at most one copy acknowledges at a time)."""
        history = self.history()
        assert history, "no configuration in etcd"
        primary_of: dict[int, int] = {}
        for h in history:
            assert primary_of.setdefault(h["epoch"], h["primary"]) == h["primary"], f"two primaries: {history}"
            assert h["primary"] in h["in_sync"], history
        changes = 0
        for before, after in zip(history, history[1:], strict=False):
            assert after["epoch"] >= before["epoch"], history
            if after["primary"] != before["primary"]:
                changes += 1
                assert after["epoch"] > before["epoch"], history
                assert after["primary"] in before["in_sync"], f"a copy out of sync became primary: {history}"
        for name in self.workers:
            by = [a["by"] for a in self.acks() if a["worker"] == name]
            switches = sum(1 for x, y in zip(by, by[1:], strict=False) if x != y)
            assert switches <= changes, f"{name} was acknowledged by {switches + 1} copies in turn: {history}"
        return history

    def late_acks(self, loser: int, t_cut: float, until: float) -> list[dict[str, Any]]:
        """The losing copy's acknowledgements, up to `until` (when it was back in sync as the backup), that it must
        not have given: for a push begun after the cut, or written more than ACK_MARGIN after it."""
        return [
            a
            for a in self.acks()
            if a["by"] == loser and a["t"] <= until and (a["t0"] > t_cut or a["t"] > t_cut + ACK_MARGIN)
        ]

    def stalls(self, since: float, until: float) -> dict[str, float]:
        """From `since`: the first acknowledgement of a push begun after it, and the longest gap between
        acknowledgements (all workers; the gap from `since` to the first one included) up to `until`."""
        acks = [a for a in self.acks() if since < a["t"] <= until]
        times = [since] + [a["t"] for a in acks]
        gaps = [b - a for a, b in zip(times, times[1:], strict=False)]
        fresh = [a["t"] for a in acks if a["t0"] > since]
        return {
            "first_fresh_ack_after_s": round(fresh[0] - since, 3) if fresh else -1.0,
            "longest_gap_s": round(max(gaps), 3) if gaps else -1.0,
        }

    def first_ack_by(self, copy: int, since: float) -> dict[str, float | None]:
        """Per worker: seconds from `since` to its first acknowledgement by `copy` (None: none yet)."""
        out: dict[str, float | None] = {}
        for name in self.workers:
            got = [a["t"] for a in self.acks() if a["worker"] == name and a["by"] == copy and a["t"] > since]
            out[f"{name} ({TRANSPORTS[int(name[-1])]})"] = round(got[0] - since, 3) if got else None
        return out

    def worker_errors(self, since: float = 0.0, until: float = float("inf")) -> dict[str, int]:
        """What the workers logged between since and until, counted by kind: failed push_pulls (raised to the worker
        script, which sends the step again) and the client's moves from one copy to the other, with why."""
        kinds: dict[str, int] = {}
        for name in self.workers:
            for line in self.log(name).read_text(errors="replace").splitlines():
                failed = re.match(r"(\d+\.\d+) step \d+ try \d+ at (\S+): (\w+): (.*)", line)
                moved = re.match(
                    r"(\d+\.\d+) INFO \S+: shard \d+: copy (\S+) unavailable \((.*)\); trying copy (\S+)", line
                )
                if failed and since <= float(failed.group(1)) <= until:
                    kind = f"{name}: {failed.group(3)} from {failed.group(2)} ({_why(failed.group(4))})"
                elif moved and since <= float(moved.group(1)) <= until:
                    kind = f"{name}: moved from {moved.group(2)} ({_why(moved.group(3))}) to {moved.group(4)}"
                else:
                    continue
                kinds[kind] = kinds.get(kind, 0) + 1
        return kinds


def _why(text: str) -> str:
    """A failure's message, in a few words."""
    low = text.lower()
    for needle, why in (("primary", "not primary"), ("backup", "not primary"), ("timed out", "timed out")):
        if needle in low:
            return why
    return low.split(":")[-1].strip()[:60]


def _report(test: str, **figures: Any) -> None:
    print(f"\nPARTITION {test}: {json.dumps(figures, sort_keys=True, default=str)}", flush=True)


def _brief(history: list[dict[str, Any]]) -> list[str]:
    return [f"epoch {h['epoch']} primary {h['primary']} in sync {h['in_sync']}" for h in history]


@pytest.fixture
def lab(tmp_path: Path) -> Iterator[Any]:
    """A fresh lab with the hosts etcd, copy-0, copy-1 and worker, removed after the test whatever happens."""
    with netlab.fresh_lab(HOSTS) as the_lab:
        yield the_lab


@pytest.fixture
def job(lab: Any, tmp_path: Path) -> Replicated:
    return Replicated(lab, tmp_path)


# -- the tests ---------------------------------------------------------------------------------------------------


@pytest.mark.timeout(240)
def test_primary_cut_off_from_its_backup(job: Replicated) -> None:
    """Both copies still reach etcd and the workers; both find the link silent and race: the backup to take over,
    the primary to drop it from the in-sync set. Exactly one compare-and-swap wins; the other copy is deposed
    (exit 3) or out of sync; training goes on on the winner, nothing acknowledged is lost."""
    t0 = time.monotonic()
    cfg = job.start()
    primary, backup = cfg["primary"], 1 - cfg["primary"]
    job.lab.cut(COPIES[primary], [COPIES[backup]])
    t_cut = time.time()
    try:
        t_decided, decided = job.wait_config(lambda c: len(c["in_sync"]) == 1, 15, "one copy going on alone")
        winner = decided["primary"]
        loser = 1 - winner
        assert decided["in_sync"] == [winner], decided
        if loser == primary:  # the backup took over: the old primary finds it lost when it records the drop
            code = job.copies[primary].wait(timeout=15)
            assert code == DEPOSED_EXIT, (code, job.copy_log(primary).read_text()[-3000:])
            assert log_events(job.copy_log(primary), "deposed"), job.copy_log(primary).read_text()[-3000:]
        t_goes_on = job.wait_acks(20, 30, since=t_cut, by=winner)
        time.sleep(max(0.0, t_cut + CUT_SECONDS - time.time()))
        during = job.config()
        assert during is not None and during["primary"] == winner and during["in_sync"] == [winner], during
        if loser == backup:  # out of the in-sync set, still running, refusing workers
            assert job.copies[backup].poll() is None, job.copy_log(backup).read_text()[-3000:]
    finally:
        t_heal = time.time()
        job.lab.heal(COPIES[primary])
    stall = job.stalls(t_cut, t_heal)
    loser_exit = job.copies[loser].poll()
    job.restart_deposed()  # the same command: the deposed copy comes back as the backup
    # The first configuration with both copies in sync again (no takeover can come before it: the winner is alone
    # in the in-sync set until then).
    t_back, back = job.first_config(t_heal, lambda c: len(c["in_sync"]) == 2, 60, "the loser back in sync")
    assert back["primary"] == winner, back
    job.wait_acks(20, 30, since=t_back)
    late = job.late_acks(loser, t_cut, t_back)
    assert not late, f"copy-{loser} (which lost) acknowledged pushes after the cut: {late[:5]}"
    result = job.finish()
    history = job.check_history()
    _report(
        "backup_link_cut",
        primary_before=f"copy-{primary}",
        winner=f"copy-{winner} ({'the primary dropped its backup' if winner == primary else 'the backup took over'})",
        loser_exit=loser_exit if loser_exit is not None else "kept running as the backup, out of sync",
        decided_after_s=round(t_decided - t_cut, 3),
        twenty_acks_by_winner_after_s=round(t_goes_on - t_cut, 3),
        pushes_stalled=stall,
        back_in_sync_after_heal_s=round(t_back - t_heal, 3),
        loser_state_transfers=job.state_transfers(loser, job.starts[loser]),
        acknowledged=result["acknowledged"],
        final_versions=result["final"]["versions"],
        worker_errors_during_cut=job.worker_errors(t_cut, t_heal),
        restarted_after_exit_3=job.deposed_restarts,
        history=_brief(history),
        test_seconds=round(time.monotonic() - t0, 1),
    )


@pytest.mark.timeout(240)
def test_primary_cut_off_from_everything(job: Replicated) -> None:
    """The primary's namespace keeps only loopback: the backup takes over within about a second; the old primary,
    which cannot reach etcd either, changes no role and acknowledges nothing; healed, it finds itself deposed and
    exits 3; restarted with the same command it comes back as the backup and gets in sync."""
    t0 = time.monotonic()
    cfg = job.start()
    old, new = cfg["primary"], 1 - cfg["primary"]
    job.lab.partition(COPIES[old], keep_loopback=True)
    t_cut = time.time()
    acked_before = len(job.acks())
    try:
        t_taken, taken = job.wait_config(lambda c: c["primary"] == new, 15, f"copy-{new} to take over")
        assert taken["in_sync"] == [new] and taken["epoch"] > cfg["epoch"], (cfg, taken)
        took_over = log_events(job.copy_log(new), "took over as primary")
        assert took_over, job.copy_log(new).read_text()[-3000:]
        # "Within about a second": the backup's replica_timeout (0.5 s), then a read and a compare-and-swap.
        assert t_taken - t_cut < 2.0, (t_cut, t_taken)
        job.wait_acks(20, 30, since=t_cut, by=new)  # the data-socket worker found it (see the xfail test below)
        time.sleep(max(0.0, t_cut + CUT_SECONDS - time.time()))
        # Cut off from etcd too, the old primary changes no role: it still runs, not knowing it was replaced, and
        # holds at most the pushes that were in flight at the cut (applied, never acknowledged).
        assert job.copies[old].poll() is None, job.copy_log(old).read_text()[-3000:]
        v_old = job.version_inside(old)
        first_ack_by_new_during_cut = job.first_ack_by(new, t_cut)
    finally:
        t_heal = time.time()
        job.lab.heal(COPIES[old])
    # Every push it acknowledged is in its version, and besides those at most one push per worker that was in
    # flight at the cut (applied, its answer lost).
    acked_by_old = len([a for a in job.acks() if a["by"] == old and a["t"] <= t_heal])
    assert acked_by_old <= v_old <= acked_by_old + WORKERS, (acked_by_old, v_old, acked_before)
    # Healed, it reads etcd, finds the other copy primary at a newer epoch, and exits DEPOSED_EXIT.
    try:
        code = job.copies[old].wait(timeout=30)
    except subprocess.TimeoutExpired:
        raise AssertionError(
            f"the old primary still runs after the heal:\n{job.copy_log(old).read_text()[-3000:]}"
        ) from None
    t_exit = time.time()
    assert code == DEPOSED_EXIT, (code, job.copy_log(old).read_text()[-3000:])
    deposed = log_events(job.copy_log(old), "deposed")
    assert deposed, job.copy_log(old).read_text()[-3000:]
    job.restart_deposed()  # the same command: it comes back as the backup, takes the state, and catches up
    t_back, back = job.first_config(t_exit, lambda c: len(c["in_sync"]) == 2, 60, "the old primary back in sync")
    assert back["primary"] == new, back
    restarted_log = job.copy_log(old)
    assert not [e for e in log_events(restarted_log, "took over") if e[0] <= t_back], restarted_log.read_text()
    assert log_events(restarted_log, "took the primary's state"), restarted_log.read_text()[-3000:]
    job.wait_acks(20, 30, since=t_back)
    late = job.late_acks(old, t_cut, t_back)
    assert not late, f"the old primary acknowledged pushes after the cut: {late[:5]}"
    result = job.finish()
    history = job.check_history()
    _report(
        "primary_isolated",
        old_primary=f"copy-{old}",
        takeover_in_etcd_after_s=round(t_taken - t_cut, 3),
        takeover_logged_after_s=round(took_over[0][0] - t_cut, 3),
        first_ack_by_new_primary_after_s=job.first_ack_by(new, t_cut),
        first_ack_by_new_primary_during_cut=first_ack_by_new_during_cut,
        heal_after_cut_s=round(t_heal - t_cut, 3),
        pushes_stalled=job.stalls(t_cut, t_heal),
        acked_before_cut=acked_before,
        acked_by_old_primary=acked_by_old,
        old_primary_version_during_cut=v_old,
        old_primary_deposed_logged_after_heal_s=round(deposed[0][0] - t_heal, 3),
        old_primary_exit=code,
        old_primary_exited_after_heal_s=round(t_exit - t_heal, 3),
        restarted_in_sync_after_s=round(t_back - t_exit, 3),
        restarted_state_transfers=job.state_transfers(old, 2),
        acknowledged=result["acknowledged"],
        final_versions=result["final"]["versions"],
        worker_errors_during_cut=job.worker_errors(t_cut, t_heal),
        restarted_after_exit_3=job.deposed_restarts,
        history=_brief(history),
        test_seconds=round(time.monotonic() - t0, 1),
    )


@pytest.mark.timeout(240)
def test_primary_cut_off_from_the_workers(job: Replicated) -> None:
    """The copies and etcd still see each other, so no role changes and training stalls until the partition heals
    (reported, not asserted). Seen: the gRPC-only worker's calls to the primary end DEADLINE_EXCEEDED and it asks
    the primary again; the data-socket worker's exchange gives up after its timeout + 5 s, it tries the backup,
    which answers NotPrimary, and goes back to the primary. Safety is asserted: one primary per epoch in etcd, at
    most one copy acknowledging, and exact arithmetic after the heal."""
    t0 = time.monotonic()
    cfg = job.start()
    primary = cfg["primary"]
    job.lab.cut(COPIES[primary], ["worker"])
    t_cut = time.time()
    try:
        time.sleep(WORKERS_CUT_SECONDS)
        during = [c for t, c in job.configs() if t >= t_cut]
    finally:
        t_heal = time.time()
        job.lab.heal(COPIES[primary])
    t_resumed = job.wait_acks(1, 60, since=t_heal)
    job.wait_acks(50, 60, since=t_heal)
    acks = job.acks()
    in_cut = [a for a in acks if t_cut + ACK_MARGIN < a["t"] <= t_heal]
    acknowledging = sorted({a["by"] for a in acks})
    result = job.finish()
    history = job.check_history()
    _report(
        "workers_cut_from_primary",
        primary=f"copy-{primary}",
        cut_s=round(t_heal - t_cut, 3),
        acked_during_cut=len(in_cut),
        first_ack_after_heal_s=round(t_resumed - t_heal, 3),
        pushes_stalled=job.stalls(t_cut, t_resumed),
        etcd_changed_during_cut=during,
        acknowledging_copies=[f"copy-{c}" for c in acknowledging],
        acknowledged=result["acknowledged"],
        final_versions=result["final"]["versions"],
        worker_errors_during_cut=job.worker_errors(t_cut, t_heal),
        restarted_after_exit_3=job.deposed_restarts,
        history=_brief(history),
        test_seconds=round(time.monotonic() - t0, 1),
    )


@pytest.mark.timeout(240)
def test_workers_find_the_new_primary_within_about_a_second(job: Replicated) -> None:
    """The primary cut off from everything: the backup takes over after replica_timeout (0.5 s). A gRPC worker is
    acknowledged by the new primary within about a second more than its own timeout (CLIENT_TIMEOUT: a deadline
    no shard named counts as silence, and pings end a call to a silent copy); a data-socket worker once TCP
    keepalive (paramserver/transport/tcp.py FAST_KEEPALIVE, about 3 s) ended its connection to the silent copy."""
    cfg = job.start()
    old, new = cfg["primary"], 1 - cfg["primary"]
    bounds = {"grpc": CLIENT_TIMEOUT + 1.0, "socket": CLIENT_TIMEOUT + 3.5}
    bound = max(bounds.values())
    job.lab.partition(COPIES[old], keep_loopback=True)
    t_cut = time.time()
    try:
        job.wait_config(lambda c: c["primary"] == new, 15, f"copy-{new} to take over")
        time.sleep(max(0.0, t_cut + bound + 0.5 - time.time()))
        first = job.first_ack_by(new, t_cut)
    finally:
        job.lab.heal(COPIES[old])
    _report("workers_find_new_primary", bound_s=bounds, first_ack_by_new_primary_after_s=first)
    late = {
        name: t
        for name, t in first.items()
        if t is None or t > next(b for kind, b in bounds.items() if f"({kind})" in name)
    }
    if late:
        raise SlowFailover(f"workers not acknowledged by the new primary within {bound} s of the cut: {late}")
