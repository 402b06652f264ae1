"""Kill shards (and workers) at random moments; check by exact arithmetic that every acknowledged push survives, once.

    .venv/bin/python bench/stress_kills.py            # make stress: every scenario, a table, exit 1 on any fault
    .venv/bin/python bench/stress_kills.py --only async-shm --seed 7 --kills 3

The harness: 2 shard processes run plain SGD with lr 1.0 and a --checkpoint-dir; the model is {"a": zeros(4),
"b": zeros(4)}, so each shard holds one tensor. Every worker pushes a gradient of exactly -1 everywhere with
explicit steps 1..K, so each applied push (async) or round (sync: the mean of -1s) adds exactly +1.0 to every
element; float32 counts exactly far beyond these sizes. A worker appends a step to its file once the push_pull of
that step returned (acknowledged). A push refused (Aborted: a round closed without it, or a push computed on a
version a restarted shard no longer has) or whose pull timed out is not acknowledged: the worker pulls and sends
the same (worker, step) again until it is; the shard applies each (worker, step) once, so a resend is safe, and
every step ends acknowledged on every shard (a push half-applied, by one shard and not the other, cannot remain).

Meanwhile shard processes are SIGKILLed at random moments (random points of the job's progress, seeded) and
restarted on the same port with the same command after 0.5-1 s; a worker process may be SIGKILLed too and started
again with its worker id, from the step after the last one its file holds (the one it was killed in is resent:
the shard that had taken it must not apply it again).

At the end every shard is read (a reader that does not join, over gRPC) and checked, element by element:
  async: value == version == the acknowledged pushes of all workers (fewer: lost; more: applied twice);
  sync:  value == version == K on every shard (one round per step; a shard behind lost rounds, ahead applied
         rounds twice or without a worker), and every shard at the same version (skew 0).
A job stuck (no push acknowledged for `stall` seconds, e.g. sync rounds of two shards each waiting for the worker
that waits on the other) is stopped and fails, saying each shard's version and each worker's last lines.

Replicated scenarios (`replicas-*`, --replicas 2 hot standby): each shard runs as two copies (processes
shard * 2 + copy) whose roles live in a real etcd on loopback (paramserver.testing.EtcdServer). The kills
target a shard's primary or its backup, read from the coordinator just before the kill, and workers; a killed
copy is restarted 0.5-1 s later in the background (it comes back as the backup and catches up), so the next
kill may hit the other shard or a worker meanwhile, never the other copy of a shard with a copy down. Without
--checkpoint-dir the backup alone holds what was acknowledged: a primary is killed only once its backup is in
the in-sync set (else the job would lose, by design, what only the primary held). With --checkpoint-dir a
primary may also be killed while its backup is still catching up (it then restarts from its own log). A copy
that exits on its own with DEPOSED_EXIT (a primary whose backup took over, e.g. after a scheduling pause longer
than --replica-timeout) is restarted, as a deployment would, and counted; any other exit is a failure. The
final state is read from the primaries (the reader's links find them); each backup in the in-sync set must
hold the primary's version.

Timing: each line of a worker's steps file is "step sent acked", time.monotonic() (one clock for every process
of the machine) when the step's push was first sent and when it was acknowledged. For each kill of a shard (or
of a copy) the outage is the time from the SIGKILL to the first acknowledgement of a push sent after it: every
push has a part on every shard, so that push was served by the new primary (a failover), the restarted shard
(no replicas), or the primary once it stopped waiting for its dead backup. The table gives its distribution
over the kills of shards (no replicas) or primaries (replicas 2); the summary lines each kill's.

Worker processes run `python bench/stress_kills.py worker ...` (below); tests/test_durability.py runs short
scenarios of this harness inside `make test`.
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import os
import queue
import random
import signal
import statistics
import subprocess
import sys
import tempfile
import threading
import time
from collections.abc import Iterator
from contextlib import ExitStack, contextmanager
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parents[1]
if str(ROOT) not in sys.path:  # run as a script: bench/ is on sys.path, the repository root is not
    sys.path.insert(0, str(ROOT))
if __name__ == "__main__":
    # This process reads the shards over gRPC (at each scenario's end) and goes on forking shards and workers
    # (LocalCluster and the workers use preexec_fn, so a fork, Python code, then exec): with gRPC's fork handlers
    # on, about 1 child in 100 aborts before its exec (SIGABRT, "Epoll1Poller ... epoll_wait error: Bad file
    # descriptor"), which would fail a scenario for nothing it tests.
    os.environ.setdefault("GRPC_ENABLE_FORK_SUPPORT", "0")

import grpc  # noqa: E402
import torch  # noqa: E402

from paramserver import LocalCluster, ServerConfig  # noqa: E402
from paramserver.coord import CoordinatorUnavailable, Etcd, PartConfig, PartRegister  # noqa: E402
from paramserver.errors import Aborted, PullTimeout  # noqa: E402
from paramserver.procs import die_with_parent  # noqa: E402
from paramserver.server.replica import DEPOSED_EXIT  # noqa: E402
from paramserver.testing import EtcdServer  # noqa: E402
from paramserver.v1 import ps_pb2, ps_pb2_grpc  # noqa: E402
from worker import PSClient  # noqa: E402

SHARDS = 2
SIZES = {"a": 4, "b": 4}  # placement puts one tensor on each of the two shards
TRANSPORT = {True: "shared memory", False: "data socket"}
COPY_ROLES = ("primary", "backup")
END_MARGIN = 50  # steps after the last kill, when the job goes on until every kill happened


def _model() -> dict[str, torch.Tensor]:
    return {name: torch.zeros(n) for name, n in SIZES.items()}


# -- the worker process -----------------------------------------------------------------------------------------


def worker_main(argv: list[str]) -> int:
    """One worker: push -1s with steps start..K, appending each acknowledged step to --out (one line each)."""
    p = argparse.ArgumentParser(prog="stress_kills.py worker")
    p.add_argument("--address", required=True)
    p.add_argument("--worker-id", required=True)
    p.add_argument("--steps", type=int, required=True)
    p.add_argument("--start", type=int, default=1)
    p.add_argument("--out", required=True)
    p.add_argument("--summary", required=True)
    p.add_argument("--no-shared-memory", action="store_true")
    p.add_argument("--pace", type=float, default=0.0, help="seconds between a step's acknowledgement and the next")
    p.add_argument("--stop-file", default=None, help="once it exists: the last step (it holds), if before --steps")
    args = p.parse_args(argv)
    torch.set_num_threads(1)
    model, grad = _model(), _model()
    refused = 0
    first_kinds: list[str] = []
    with (
        PSClient(args.address, worker_id=args.worker_id, shared_memory=not args.no_shared_memory, timeout=90) as c,
        open(args.out, "a", buffering=1) as out,
    ):
        c.register(model)  # adopts the shards' weights (or initialises them with zeros, for the first worker)
        last = args.steps
        for step in range(args.start, args.steps + 1):
            if args.stop_file and last == args.steps and os.path.exists(args.stop_file):
                last = min(last, int(Path(args.stop_file).read_text()))
            if step > last:
                break
            if args.pace:
                time.sleep(args.pace)
            sent = time.monotonic()  # the clock the harness reads its kills on (one for every process)
            while True:
                for t in grad.values():
                    t.fill_(-1.0)
                try:
                    c.push_pull(grad, step=step)  # grad's tensors are the gradient, then receive the weights
                    break
                except (Aborted, PullTimeout) as exc:  # not acknowledged: catch up, resend the same (worker, step)
                    refused += 1
                    print(f"step {step} not acknowledged ({type(exc).__name__}: {exc}); resending", file=sys.stderr)
                    try:
                        c.pull(model)
                    except (Aborted, PullTimeout) as again:
                        print(f"catch-up pull failed: {type(again).__name__}: {again}", file=sys.stderr)
            for name, t in model.items():  # what a shard that lost the model is initialised with again
                t.copy_(grad[name])
            out.write(f"{step} {sent:.6f} {time.monotonic():.6f}\n")  # acknowledged: step, sent, acknowledged
            if not first_kinds:
                first_kinds = [link.transport.kind for link in c.links]
        summary = {
            "start": args.start,
            "refused": refused,
            "rank": c.rank,
            "first_transports": first_kinds,
            "last_transports": [link.transport.kind for link in c.links],
            "versions": c.versions,
        }
    with open(args.summary, "a") as f:
        f.write(json.dumps(summary) + "\n")
    return 0


# -- scenarios and outcomes -------------------------------------------------------------------------------------


@dataclass(frozen=True)
class Scenario:
    """One run: a job, how many steps each worker pushes, and how many kills of each kind at random moments."""

    name: str
    mode: str = "async"
    shared_memory: bool = True
    checkpoint_every: str = "50"
    workers: int = 2
    steps: int = 400
    shard_kills: int = 1
    worker_kills: int = 0
    seed: int = 0
    window: tuple[float, float] = (0.15, 0.85)  # kills happen between these fractions of the job's progress
    lease_timeout: float = 10.0
    pull_timeout: float = 20.0
    timeout: float = 300.0  # the whole run (then it is stopped and judged, as a stall)
    # No push acknowledged for this long while workers run: the job is stuck (more than a pull_timeout, so that a
    # worker's resend after a PullTimeout counts as progress): stop it and judge what the shards hold.
    stall: float = 45.0
    # Seconds a worker waits before each step: a job of a length set by its steps, not by how fast the pushes go
    # (kills of copies restart in the background; the job must last for them), on cores left for the restarts.
    pace: float = 0.0
    # The job goes on past `steps` (to at most `steps_cap` x) until every planned kill happened, and then a little
    # (the harness tells the workers the last step, the same for all): the kills of copies restart in the
    # background, so a job of a fixed length on a loaded machine could end before them.
    until_kills_done: bool = False
    steps_cap: int = 10
    # 2: each shard on two copies (hot standby), roles in a real etcd; shard_kills then kill a shard's primary.
    replicas: int = 1
    backup_kills: int = 0  # replicas 2: kills of a shard's backup
    checkpoint_dir: bool = True  # False: no --checkpoint-dir (replicas 2: only the backup keeps what was acknowledged)
    # replicas 2: a shard's copies must be in sync again within this after a restart (before the next kill of its
    # primary that waits for it, and at the end).
    catch_up: float = 60.0

    @property
    def checkpoint(self) -> str:
        return self.checkpoint_every if self.checkpoint_dir else "none"

    @property
    def wait_in_sync(self) -> bool:
        """Kill a primary only once its backup is in the in-sync set: without a log on disk, a primary killed while
        its backup catches up takes acknowledged updates with it (by design)."""
        return not self.checkpoint_dir


@dataclass
class Kill:
    what: str  # "shard 1", "worker w0", "shard 1 primary (copy 0)"
    at_acked: int  # acknowledged pushes (all workers) when it was killed
    down_s: float  # from the kill until it served (shard) or ran (worker) again
    killed_at: float = 0.0  # time.monotonic() of the SIGKILL (the clock of the workers' steps files)
    role: str = ""  # "shard" (no replicas), "primary" or "backup" (a copy), "worker"
    in_sync: bool = False  # replicas 2: both copies were in the in-sync set when it was killed
    outage_s: float | None = None  # from the SIGKILL to the first acknowledgement of a push sent after it
    catch_up_s: float | None = None  # replicas 2: from the restarted copy serving to both copies in sync again
    epochs: tuple[int, int] = (0, 0)  # replicas 2: the shard's epoch when killed, and once in sync again

    def describe(self) -> str:
        parts = [f"down {self.down_s:.1f} s"]
        if self.role in COPY_ROLES and not self.in_sync:
            parts.append("copies not in sync")
        if self.outage_s is not None:
            parts.append(f"first ack after {self.outage_s * 1e3:.0f} ms")
        if self.catch_up_s is not None:  # (none where a copy of the shard was killed again first)
            parts.append(f"in sync {self.catch_up_s:.2f} s after serving, epoch {self.epochs[0]}->{self.epochs[1]}")
        return f"{self.what} at {self.at_acked} acked ({', '.join(parts)})"


@dataclass
class Outcome:
    scenario: Scenario
    kills: list[Kill] = field(default_factory=list)
    acked: dict[str, int] = field(default_factory=dict)  # worker -> acknowledged steps
    versions: list[int] = field(default_factory=list)
    values: list[tuple[float, float]] = field(default_factory=list)  # (min, max) of each shard's elements
    expected: int = 0  # the value (and version) every shard must hold
    lost: list[int] = field(default_factory=list)  # per shard
    twice: list[int] = field(default_factory=list)  # per shard
    skew: int = 0
    refused: int = 0
    transports: list[list[str]] = field(default_factory=list)  # per worker: each link's kind at its first step
    seconds: float = 0.0
    problems: list[str] = field(default_factory=list)
    steps: dict[str, int] = field(default_factory=dict)  # worker -> its last step (`steps`, or later)
    copy_versions: list[int | str] = field(default_factory=list)  # replicas 2: every copy's version at the end
    deposed: list[str] = field(default_factory=list)  # replicas 2: copies that exited DEPOSED_EXIT (restarted)

    @property
    def total_acked(self) -> int:
        return sum(self.acked.values())

    def outages(self, role: str) -> list[float]:
        """The outages after kills of this role ("shard", "primary", "backup"); a primary's only where its
        backup was in sync (a failover, not a restart from disk)."""
        return [
            k.outage_s
            for k in self.kills
            if k.role == role and k.outage_s is not None and (k.in_sync or role != "primary")
        ]

    @property
    def failovers(self) -> list[float]:
        """What the table shows: each kill of a shard (no replicas) or an in-sync primary, SIGKILL to first ack."""
        return self.outages("primary" if self.scenario.replicas > 1 else "shard")

    def summary(self) -> str:
        s = self.scenario
        kills = ", ".join(k.describe() for k in self.kills) or "none"
        steps = self.steps if len(set(self.steps.values())) > 1 else next(iter(self.steps.values()), s.steps)
        ckpt = f"checkpoint_every {s.checkpoint_every!r}" if s.checkpoint_dir else "no checkpoint dir"
        replicated = ""
        if s.replicas > 1:
            catch_up = [k.catch_up_s for k in self.kills if k.catch_up_s is not None]
            replicated = (
                f"replicas {s.replicas}; failover (kill of an in-sync primary -> first ack) {spread(self.failovers)}; "
                f"pause after a backup kill {spread(self.outages('backup'))}; catch-up after a restart "
                f"{spread(catch_up)}; every copy's version at the end {self.copy_versions}; exited deposed "
                f"{self.deposed or 'none'}; "
            )
        return (
            f"[{s.name}] mode {s.mode}, {TRANSPORT[s.shared_memory]}, {ckpt}, "
            f"{s.workers} workers x {steps} steps, seed {s.seed}: kills: {kills}; {replicated}acknowledged pushes "
            f"{self.total_acked} {self.acked}; expected value {self.expected} on every shard; values (min, max) "
            f"per shard {self.values}; versions {self.versions}; lost {self.lost}; applied twice {self.twice}; "
            f"skew {self.skew}; resent after refusal {self.refused}; transports {self.transports}; "
            f"{self.seconds:.1f} s; problems: {self.problems or 'none'}"
        )


def quantile(values: list[float], q: float) -> float:
    """The q-quantile, linear between the order statistics (p90 of a few values lies near the largest)."""
    xs = sorted(values)
    at = q * (len(xs) - 1)
    lo = int(at)
    hi = min(lo + 1, len(xs) - 1)
    return xs[lo] + (xs[hi] - xs[lo]) * (at - lo)


def spread(seconds: list[float]) -> str:
    """min/median/p90/max in milliseconds, and how many ("-" for none)."""
    if not seconds:
        return "-"
    q = [min(seconds), statistics.median(seconds), quantile(seconds, 0.9), max(seconds)]
    return "/".join(f"{x * 1e3:.0f}" for x in q) + f" ms (n={len(seconds)})"


# -- running one scenario ---------------------------------------------------------------------------------------


def _lines(path: Path) -> list[list[str]]:
    """A worker's steps file, split (complete lines only: one being written when it was killed is not)."""
    try:
        text = path.read_text()
    except FileNotFoundError:
        return []
    return [x.split() for x in text.split("\n")[:-1] if x]


def _acked_steps(path: Path) -> list[int]:
    """The steps a worker's file holds."""
    return [int(x[0]) for x in _lines(path)]


def _ack_times(path: Path) -> list[tuple[float, float]]:
    """(sent, acknowledged), time.monotonic(), of each step a worker's file holds."""
    return [(float(x[1]), float(x[2])) for x in _lines(path) if len(x) == 3]


def _count_lines(path: Path) -> int:
    try:
        return path.read_bytes().count(b"\n")
    except FileNotFoundError:
        return 0


class _Job:
    """The cluster (and, with replicas, its etcd) and the worker processes of one scenario; stops every process it
    started."""

    def __init__(self, scenario: Scenario, workdir: Path) -> None:
        self.s = scenario
        self.dir = workdir
        self.dir.mkdir(parents=True, exist_ok=True)
        self.config = ServerConfig(
            mode=scenario.mode,
            workers=scenario.workers,
            optimizer="sgd",
            lr=1.0,
            checkpoint_dir=str(workdir / "ckpt") if scenario.checkpoint_dir else None,
            checkpoint_every=scenario.checkpoint_every,
            lease_timeout=scenario.lease_timeout,
            pull_timeout=scenario.pull_timeout,
        )
        # STRESS_LOG_LEVEL=INFO: the shards say what they restore (on stderr).
        self.level = os.environ.get("STRESS_LOG_LEVEL", "WARNING")
        self.cluster = LocalCluster(self.config, shards=SHARDS, processes=True, log_level=self.level)
        self.names = [f"w{i}" for i in range(scenario.workers)]
        self.cap = scenario.steps * (scenario.steps_cap if scenario.until_kills_done else 1)
        self.procs: dict[str, subprocess.Popen[bytes]] = {}
        self.exits: dict[str, list[int]] = {n: [] for n in self.names}  # exit codes of earlier incarnations
        # Replicas: the copies being restarted (killed, or exited), and what the restarts saw.
        self.lock = threading.Lock()
        self.down: set[int] = set()  # server processes (shard * 2 + copy) not serving again yet
        self.kills_of: list[int] = [0] * SHARDS  # copy kills so far per shard (a catch-up is timed until the next)
        # One thread per server restarts it, for the whole job: Linux sends a child its parent-death signal
        # (LocalCluster's die_with_parent) when the *thread* that started it ends.
        self.restarters: dict[int, tuple[threading.Thread, queue.Queue[tuple[float, Kill | None] | None]]] = {}
        self.busy = threading.Condition(self.lock)
        self.restarting = 0  # restarts asked for and not done (with their catch-up timing)
        self.deposed: list[str] = []  # copies that exited DEPOSED_EXIT on their own
        self.errors: list[str] = []  # copies that exited otherwise, restarts that failed
        self.stopping = threading.Event()
        self.registers: list[PartRegister] = []

    @property
    def replicated(self) -> bool:
        return self.s.replicas > 1

    def out(self, name: str) -> Path:
        return self.dir / f"{name}.steps"

    def log(self, name: str) -> Path:
        return self.dir / f"{name}.log"

    def live_address(self) -> str:
        """A server that serves now (a worker finds the job from any copy's address)."""
        with self.lock:
            for i, address in enumerate(self.cluster.addresses):
                if i not in self.down and self.cluster.procs[i].poll() is None:
                    return address
        return self.cluster.address

    def start_worker(self, name: str) -> None:
        out = self.out(name)
        if out.exists():  # drop a line cut short by a kill: the step it names was not written as acknowledged
            data = out.read_bytes()
            out.write_bytes(data[: data.rfind(b"\n") + 1])
        done = _acked_steps(out)
        cmd = [
            sys.executable, str(Path(__file__).resolve()), "worker", "--address", self.live_address(),
            "--worker-id", f"stress-{self.s.name}-{name}", "--steps", str(self.cap),
            "--start", str(max(done, default=0) + 1), "--out", str(out),
            "--summary", str(self.dir / f"{name}.summary"),
        ]  # fmt: skip
        if not self.s.shared_memory:
            cmd.append("--no-shared-memory")
        if self.s.pace:
            cmd += ["--pace", str(self.s.pace)]
        if self.s.until_kills_done:
            cmd += ["--stop-file", str(self.stop_file(name))]
        with open(self.log(name), "ab") as log:
            self.procs[name] = subprocess.Popen(
                cmd,
                stdout=log,
                stderr=subprocess.STDOUT,
                cwd=ROOT,
                start_new_session=True,
                preexec_fn=lambda: die_with_parent(signal.SIGKILL),
            )

    def acked(self) -> int:
        return sum(_count_lines(self.out(n)) for n in self.names)

    def last_steps(self) -> dict[str, int]:
        return {n: max(_acked_steps(self.out(n)), default=0) for n in self.names}

    def stop_file(self, name: str) -> Path:
        return self.dir / f"{name}.last"

    def end_at(self, margin: int) -> dict[str, int]:
        """Tell each worker its last step (at least `steps`): `margin` after the last one it acknowledged (async),
        or after the furthest one any acknowledged (sync: every worker pushes every round)."""
        done = self.last_steps()
        ends = {n: max(self.s.steps, (max(done.values()) if self.s.mode == "sync" else done[n]) + margin) for n in done}
        for name, last in ends.items():
            tmp = self.stop_file(name).with_suffix(".tmp")
            tmp.write_text(str(last))
            tmp.replace(self.stop_file(name))
        return ends

    def steps(self, name: str) -> int:
        """A worker's last step: `steps`, or the one it was told."""
        path = self.stop_file(name)
        return int(path.read_text()) if path.exists() else self.cap

    def running(self) -> list[str]:
        return [n for n, p in self.procs.items() if p.poll() is None]

    def check_workers(self) -> None:
        for n, p in self.procs.items():
            code = p.poll()
            if code not in (None, 0):
                raise RuntimeError(f"worker {n} exited with {code}:\n{self.tail(n)}")

    def tail(self, name: str, chars: int = 4000) -> str:
        try:
            return self.log(name).read_text(errors="replace")[-chars:]
        except FileNotFoundError:
            return ""

    def stop_workers(self) -> None:
        running = [p for p in self.procs.values() if p.poll() is None]
        for p in running:
            p.kill()
        for p in running:
            p.wait()

    # -- replicas ------------------------------------------------------------------------------------------------

    def part(self, shard: int) -> PartConfig | None:
        """The shard's configuration in the coordinator (None where there is none, or etcd did not answer)."""
        try:
            return self.registers[shard].read()
        except CoordinatorUnavailable:
            return None

    def restart_later(self, index: int, delay: float, kill: Kill | None) -> None:
        """In the background: wait until server process `index` exited, `delay` s more, start it again; then time
        how long until both copies of its shard are in sync (`kill.catch_up_s`)."""
        with self.lock:
            self.restarting += 1
            if index not in self.restarters:
                q: queue.Queue[tuple[float, Kill | None] | None] = queue.Queue()
                t = threading.Thread(target=self._restarter, args=(index, q), name=f"restarter-{index}", daemon=True)
                self.restarters[index] = (t, q)
                t.start()
            self.restarters[index][1].put((delay, kill))

    def _restarter(self, index: int, requests: queue.Queue[tuple[float, Kill | None] | None]) -> None:
        while (request := requests.get()) is not None:
            try:
                self._restart(index, *request)
            finally:
                with self.busy:
                    self.restarting -= 1
                    self.busy.notify_all()

    def _restart(self, index: int, delay: float, kill: Kill | None) -> None:
        shard = index // self.cluster.copies
        with self.lock:
            generation = self.kills_of[shard]
        try:
            self.cluster.procs[index].wait(timeout=10)
            if self.stopping.wait(delay):
                return
            self.cluster.restart(index)
            served = time.monotonic()
        except Exception as exc:  # noqa: BLE001 - said at the end, as the scenario's failure
            self.errors.append(f"restarting server {index} failed: {type(exc).__name__}: {exc}")
            return
        finally:
            with self.lock:
                self.down.discard(index)
        if kill is not None:
            kill.down_s = served - kill.killed_at
        while not self.stopping.is_set() and time.monotonic() - served < self.s.catch_up:
            with self.lock:
                if self.kills_of[shard] != generation:  # the shard lost a copy again before it was in sync
                    return
            cfg = self.part(shard)
            if cfg is not None and len(cfg.in_sync) == 2:
                if kill is not None:
                    kill.catch_up_s = time.monotonic() - served
                    kill.epochs = (kill.epochs[0], cfg.epoch)
                return
            time.sleep(0.02)

    def check_copies(self, say: Any) -> None:
        """A copy that exited on its own is started again (as a deployment would): one deposed (DEPOSED_EXIT) is
        counted, any other exit is a failure."""
        for i in range(len(self.cluster.procs)):
            with self.lock:  # (a restart replaces the process, then leaves `down`)
                code = None if i in self.down else self.cluster.procs[i].poll()
                if code is None:
                    continue
                self.down.add(i)
            shard, copy = divmod(i, self.cluster.copies)
            what = f"shard {shard} copy {copy}"
            if code == DEPOSED_EXIT:
                self.deposed.append(what)
                say(f"[{self.s.name}] {what} exited deposed ({DEPOSED_EXIT}); restarting it")
            else:
                self.errors.append(f"{what} exited with status {code} on its own")
                say(f"[{self.s.name}] {what} exited with status {code} on its own; restarting it")
            self.restart_later(i, 0.0, None)

    def settle(self) -> None:
        """Wait until every restart in the background (and its catch-up timing) is done."""
        with self.busy:
            self.busy.wait_for(lambda: self.restarting == 0)

    def close_restarters(self) -> None:
        """End the restart threads (the copies they started get their parent-death signal: stop the cluster
        right after)."""
        for _, q in self.restarters.values():
            q.put(None)
        for t, _ in self.restarters.values():
            t.join()

    def in_sync(self, timeout: float) -> list[str]:
        """Wait until every shard's copies are both in sync; say which are not, after `timeout` s."""
        deadline = time.monotonic() + timeout
        late = list(range(SHARDS))
        while late and time.monotonic() < deadline:
            late = [k for k in late if len(getattr(self.part(k), "in_sync", ())) < 2]
            time.sleep(0.05)
        return [f"shard {k}'s copies are not in sync {timeout:.0f} s after the job: {self.part(k)}" for k in late]

    @contextmanager
    def running_job(self) -> Iterator[_Job]:
        with ExitStack() as stack:
            if self.replicated:
                etcd = stack.enter_context(EtcdServer())
                self.config = self.config.replace(replicas=self.s.replicas, coordinator=etcd.url)
                self.cluster = LocalCluster(self.config, shards=SHARDS, processes=True, log_level=self.level)
                self.registers = [PartRegister(Etcd(etcd.url), self.config.job_name, k) for k in range(SHARDS)]
            stack.enter_context(self.cluster)
            stack.callback(self.close_restarters)  # (runs before the cluster stops: no restart outlives it)
            stack.callback(self.stopping.set)
            stack.callback(self.stop_workers)
            for n in self.names:
                self.start_worker(n)
            yield self


def _plan(s: Scenario, rng: random.Random) -> list[tuple[float, str, int]]:
    """(progress fraction, "shard" | "primary" | "backup" | "worker", index) for each kill, in order of progress;
    the index of a shard's (or of a copy's: its shard's) or of a worker."""
    shard = ["primary", "backup"] if s.replicas > 1 else ["shard"]
    kinds = [shard[0]] * s.shard_kills + [shard[-1]] * s.backup_kills * (s.replicas > 1) + ["worker"] * s.worker_kills
    rng.shuffle(kinds)
    lo, hi = s.window
    points = sorted(rng.uniform(lo, hi) for _ in kinds)
    return [(x, k, rng.randrange(s.workers if k == "worker" else SHARDS)) for x, k in zip(points, kinds, strict=True)]


def _versions(addresses: list[str]) -> list[int | str]:
    """Each shard's version (GetTopology), or why it did not answer."""
    out: list[int | str] = []
    for address in addresses:
        channel = grpc.insecure_channel(address)
        try:
            stub = ps_pb2_grpc.ParameterServerStub(channel)
            out.append(int(stub.GetTopology(ps_pb2.GetTopologyRequest(), timeout=5).version))
        except grpc.RpcError as err:
            out.append(f"({err.code().name})")
        finally:
            channel.close()
    return out


def _read_shards(address: str) -> tuple[list[int], list[torch.Tensor]]:
    """Every shard's version and its elements, read by a client that does not join (gRPC); with replicas, from
    each shard's primary (a backup refuses: the reader's link tries the other copy)."""
    with PSClient(address, join=False, shared_memory=False, data_socket=False, timeout=30) as reader:
        weights = _model()
        reader.pull(weights)
        placement = reader.placement(weights)
        per_shard = [
            torch.cat([weights[p.name].reshape(-1)[p.start : p.start + p.length] for p in pieces])
            if pieces
            else torch.empty(0)
            for pieces in placement.shards
        ]
        return list(reader.versions), per_shard


def _kill_shard(job: _Job, index: int, rng: random.Random, acked: int) -> Kill:
    """SIGKILL shard process `index`, wait 0.5-1 s, start it again on its port with the same command."""
    job.cluster.kill(index)
    killed_at = time.monotonic()
    job.cluster.procs[index].wait(timeout=10)
    time.sleep(rng.uniform(0.5, 1.0))
    job.cluster.restart(index)
    return Kill(f"shard {index}", acked, time.monotonic() - killed_at, killed_at, "shard")


def _copy_waits(job: _Job, shard: int, role: str) -> str:
    """Why a kill of the shard's primary or backup must wait ("" where it can happen now): a copy of the shard is
    still restarting (two copies down: the shard would be gone), or (without a checkpoint dir) a primary's backup
    is not in sync yet."""
    with job.lock:
        if any(shard * job.cluster.copies + c in job.down for c in range(job.cluster.copies)):
            return f"a copy of shard {shard} is restarting"
    cfg = job.part(shard)
    if cfg is None:
        return f"shard {shard} has no configuration in etcd"
    if role == "primary" and job.s.wait_in_sync and len(cfg.in_sync) < 2:
        return f"shard {shard}'s backup is not in sync: {cfg}"
    return ""


def _kill_copy(job: _Job, shard: int, role: str, rng: random.Random, acked: int) -> Kill | None:
    """SIGKILL the shard's primary or backup (as the coordinator says now); it is started again 0.5-1 s later in
    the background. None where the shard has no configuration."""
    cfg = job.part(shard)
    if cfg is None:
        return None
    copy = cfg.primary if role == "primary" else 1 - cfg.primary
    index = shard * job.cluster.copies + copy
    with job.lock:
        job.down.add(index)
        job.kills_of[shard] += 1
    job.cluster.kill(index)
    killed_at = time.monotonic()
    kill = Kill(
        f"shard {shard} {role} (copy {copy})", acked, 0.0, killed_at, role, len(cfg.in_sync) == 2, epochs=(cfg.epoch, 0)
    )
    job.restart_later(index, rng.uniform(0.5, 1.0), kill)
    return kill


def _kill_worker(job: _Job, index: int, rng: random.Random, acked: int) -> Kill | None:
    """SIGKILL worker `index` (or another still running, if it finished), start it again 0.2-1 s later with its
    worker id, from the step after the last one acknowledged; None when every worker has finished."""
    name = job.names[index]
    if job.procs[name].poll() is not None:
        live = job.running()
        if not live:
            return None
        name = live[0]
    proc = job.procs[name]
    proc.send_signal(signal.SIGKILL)
    killed_at = time.monotonic()
    job.exits[name].append(proc.wait(timeout=10))
    time.sleep(rng.uniform(0.2, 1.0))
    job.start_worker(name)
    return Kill(f"worker {name}", acked, time.monotonic() - killed_at, killed_at, "worker")


def run_scenario(s: Scenario, workdir: Path, say: Any = print) -> Outcome:
    """Run one scenario with its kills; return what the shards hold against what was acknowledged."""
    rng = random.Random(s.seed)
    plan = _plan(s, rng)
    result = Outcome(scenario=s)
    total = s.workers * s.steps
    began = time.monotonic()
    job = _Job(s, workdir)
    with job.running_job():
        say(
            f"[{s.name}] seed {s.seed}: kills at progress "
            + (", ".join(f"{x:.2f} ({k} {i})" for x, k, i in plan) or "none")
            + f"; started in {time.monotonic() - began:.1f} s"
        )
        last_acked, moved_at, after_restart = 0, time.monotonic(), 0
        pending = list(plan)
        waiting: tuple[float, str] | None = None  # since when, and why, the next kill waits (replicas)
        while job.running() or pending:
            job.check_workers()
            if job.replicated:
                job.check_copies(say)
            now = time.monotonic()
            acked = job.acked()
            if acked != last_acked:
                last_acked, moved_at = acked, now
            if now - moved_at > s.stall or now - began > s.timeout:
                why = f"no push acknowledged for {now - moved_at:.0f} s" if now - moved_at > s.stall else "timeout"
                last = {n: max(_acked_steps(job.out(n)), default=0) for n in job.names}
                stalled = (
                    f"the job stalled ({why}) at {acked}/{total} acknowledged, shard versions "
                    f"{_versions(job.cluster.addresses)}, last step acknowledged per worker {last}"
                )
                if job.replicated:
                    stalled += f", configurations {[job.part(k) for k in range(SHARDS)]}"
                say(f"[{s.name}] {stalled}; the workers' last lines:")
                for n in job.names:
                    say(f"--- {n}:\n" + "\n".join(job.tail(n).strip().splitlines()[-6:]))
                result.problems.append(stalled)
                job.stop_workers()
                break
            if s.until_kills_done and not pending and not job.stop_file(job.names[0]).exists():
                last = job.end_at(END_MARGIN)
                say(f"[{s.name}] every kill happened ({now - began:.1f} s): the workers' last steps {last}")
            # The next kill once the job reached its point and made progress since the last restart (and, for a
            # copy, once the shard can lose it).
            if pending and acked >= pending[0][0] * total and acked >= after_restart + 2 * s.workers:
                _, kind, index = pending[0]
                why = ""
                if kind in COPY_ROLES:  # the planned shard, else the other one if it can lose a copy now
                    for k in (index, *(k for k in range(SHARDS) if k != index)):
                        why = _copy_waits(job, k, kind)
                        if not why:
                            index = k
                            break
                if not why:
                    pending.pop(0)
                    waiting = None
                    if kind in COPY_ROLES:
                        kill = _kill_copy(job, index, kind, rng, acked)
                    elif kind == "shard":
                        kill = _kill_shard(job, index, rng, acked)
                    else:
                        kill = _kill_worker(job, index, rng, acked)
                    if kill is not None:
                        result.kills.append(kill)
                        back = "restarting" if kind in COPY_ROLES else f"back after {kill.down_s:.1f} s"
                        say(
                            f"[{s.name}] killed {kill.what} at {acked}/{total} acknowledged "
                            f"({kill.killed_at - began:.1f} s); {back}"
                        )
                    after_restart = job.acked()
                    moved_at = time.monotonic()
                    continue
                if waiting is None:
                    waiting = (now, why)
                elif now - waiting[0] > s.catch_up:
                    result.problems.append(f"a kill of shard {index}'s {kind} waited {s.catch_up:.0f} s: {why}")
                    say(f"[{s.name}] {result.problems[-1]}")
                    pending.pop(0)
                    waiting = None
            if not job.running() and pending:  # the job ended before its last kills: they cannot happen
                last = {n: max(_acked_steps(job.out(n)), default=0) for n in job.names}
                say(f"[{s.name}] the job finished before {len(pending)} planned kill(s) (last steps {last})")
                break
            time.sleep(0.01)
        if not result.problems:  # (workers stopped after a stall were SIGKILLed)
            job.check_workers()
        if job.replicated:
            job.settle()  # every killed copy serves again (and its catch-up was timed)
            result.problems += job.in_sync(s.catch_up)
            say(f"[{s.name}] the workers ended, every copy serves and is in sync ({time.monotonic() - began:.1f} s)")
        versions, shards = _read_shards(job.cluster.address)
        if job.replicated:
            result.copy_versions = _versions(job.cluster.addresses)
            result.deposed = list(job.deposed)
            result.problems += job.errors
    result.seconds = time.monotonic() - began
    _outages(result, job)
    return _judge(result, job, versions, shards)


def _outages(result: Outcome, job: _Job) -> None:
    """For each kill of a shard or a copy: from the SIGKILL to the first acknowledgement of a push sent after it
    (over every worker; each push has a part on every shard)."""
    times = [t for n in job.names for t in _ack_times(job.out(n))]
    for k in result.kills:
        if k.role == "worker":
            continue
        after = [acked for sent, acked in times if sent >= k.killed_at]
        k.outage_s = min(after) - k.killed_at if after else None


def _judge(result: Outcome, job: _Job, versions: list[int], shards: list[torch.Tensor]) -> Outcome:
    s = result.scenario
    problems = result.problems
    # A stalled job's pushes were in flight and its sync rounds open: no exact count to check against.
    stalled = any(p.startswith("the job stalled") for p in problems)
    result.steps = {n: job.steps(n) for n in job.names}
    for n in job.names:
        steps = _acked_steps(job.out(n))
        result.acked[n] = len(set(steps))
        if steps != list(range(1, result.steps[n] + 1)) and not stalled:
            problems.append(
                f"worker {n} acknowledged {len(steps)} of steps 1..{result.steps[n]} (not each once, in order)"
            )
        path = job.dir / f"{n}.summary"  # a line per run of the worker that ended (none if stopped after a stall)
        summaries = [json.loads(line) for line in path.read_text().splitlines() if line] if path.exists() else []
        result.refused += job.tail(n, chars=10**9).count(" not acknowledged (")  # every run of it, killed ones too
        first = [x["first_transports"] for x in summaries if x["first_transports"]]
        result.transports.append(first[0] if first else [])
        if first and any(kind != TRANSPORT[s.shared_memory] for kind in first[0]):
            problems.append(f"worker {n} did not start on {TRANSPORT[s.shared_memory]}: {first[0]}")
    result.versions = versions
    result.values = [(float(t.min()), float(t.max())) if t.numel() else (float("nan"),) * 2 for t in shards]
    # async: each acknowledged push adds +1 once; sync: each of the K rounds adds the mean of -1s, +1.
    result.expected = result.total_acked if s.mode != "sync" else max(result.steps.values())
    result.skew = max(versions) - min(versions)
    if s.replicas > 1 and len(result.copy_versions) == SHARDS * s.replicas:
        for k in range(SHARDS):  # both in sync: the backup holds every update its primary acknowledged
            held = result.copy_versions[k * s.replicas : (k + 1) * s.replicas]
            if any(v != versions[k] for v in held):
                problems.append(f"shard {k}'s copies hold versions {held}; its primary served {versions[k]}")
    if stalled:
        return result
    for i, (lo, hi) in enumerate(result.values):
        if shards[i].numel() == 0:
            problems.append(f"shard {i} holds no element: the check needs a piece on every shard")
            continue
        result.lost.append(max(0, round(result.expected - lo)))
        result.twice.append(max(0, round(hi - result.expected)))
        if lo != hi:
            problems.append(f"shard {i}'s elements differ: {shards[i].tolist()}")
        if (lo, hi) != (versions[i], versions[i]):
            problems.append(f"shard {i} holds {lo, hi} at version {versions[i]}: one +1 per version expected")
    if sum(result.lost):
        problems.append(f"lost {result.lost} (per shard)")
    if sum(result.twice):
        problems.append(f"applied twice {result.twice} (per shard)")
    if result.skew:
        problems.append(f"shard versions differ by {result.skew}: {versions}")
    if any(v != result.expected for v in versions) and not sum(result.lost) and not sum(result.twice):
        problems.append(f"versions {versions}, expected {result.expected}")
    return result


# -- the stress run ---------------------------------------------------------------------------------------------


def scenarios(
    seed: int,
    kills: int,
    worker_kills: int,
    steps: int,
    copy_kills: int = 8,
    replica_worker_kills: int = 2,
    replica_steps: int = 1200,
) -> list[Scenario]:
    """The stress run: async and sync, over shared memory and the data socket, with several checkpoint
    schedules (the log alone, every 50 versions, every second); then the same with --replicas 2, with and without
    a checkpoint dir, `copy_kills` split between primaries (the larger half) and backups."""
    common = {"shard_kills": kills, "worker_kills": worker_kills, "steps": steps, "timeout": 600.0}
    primaries = (copy_kills + 1) // 2
    replicated = {
        "replicas": 2,
        "shard_kills": primaries,
        "backup_kills": copy_kills - primaries,
        "worker_kills": replica_worker_kills,
        "steps": replica_steps,
        "timeout": 600.0,
        "window": (0.1, 0.9),
        "pace": 0.005,
        "until_kills_done": True,
    }
    return [
        Scenario("async-shm", "async", True, "50", seed=seed, **common),
        Scenario("async-socket", "async", False, "0", seed=seed + 1, **common),
        Scenario("sync-shm", "sync", True, "0", seed=seed + 2, **common),
        Scenario("sync-socket", "sync", False, "1s", seed=seed + 3, **common),
        # The log on disk too: a primary may be killed while its backup catches up (it restarts from its log).
        Scenario("replicas-async-shm", "async", True, "50", seed=seed + 4, **replicated),  # type: ignore[arg-type]
        # Memory only: what was acknowledged survives on the backup alone.
        Scenario("replicas-sync-socket", "sync", False, "0", checkpoint_dir=False, seed=seed + 5, **replicated),  # type: ignore[arg-type]
    ]


def _kills(o: Outcome) -> str:
    """Kills by kind: "6s+2w" of shards (no replicas) and workers; "4p+4b+2w" of primaries, backups, workers."""
    count = {role: sum(k.role == role for k in o.kills) for role in ("shard", "primary", "backup", "worker")}
    if o.scenario.replicas > 1:
        return f"{count['primary']}p+{count['backup']}b+{count['worker']}w"
    return f"{count['shard']}s+{count['worker']}w"


def _table(outcomes: list[Outcome]) -> str:
    """One row per scenario; `outage ms`: from the SIGKILL of a shard (no replicas: until it restarted) or of an
    in-sync primary (replicas: the failover) to the first acknowledged push sent after it, min/median/p90/max."""
    head = (
        f"{'scenario':<20} {'ckpt':>5} {'kills':>9} {'acked':>6} {'versions':>11} {'lost':>4} {'twice':>5} "
        f"{'skew':>4} {'resent':>6} {'secs':>6} {'outage ms min/med/p90/max':>27}  result"
    )
    rows = [head, "-" * len(head)]
    for o in outcomes:
        s = o.scenario
        outage = spread(o.failovers).removesuffix(")").replace(" ms (n=", " n=")
        verdict = "ok" if not o.problems else "STALL" if "stalled" in o.problems[0] else "FAIL"
        rows.append(
            f"{s.name:<20} {s.checkpoint:>5} {_kills(o):>9} {o.total_acked:>6} "
            f"{'/'.join(map(str, o.versions)):>11} {sum(o.lost):>4} {sum(o.twice):>5} {o.skew:>4} {o.refused:>6} "
            f"{o.seconds:>6.1f} {outage:>27}  {verdict}"
        )
    return "\n".join(rows)


def main(argv: list[str]) -> int:
    if argv[:1] == ["worker"]:
        return worker_main(argv[1:])
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--seed", type=int, default=None, help="random seed (default: from the clock, printed)")
    p.add_argument("--kills", type=int, default=6, help="shard kills per scenario")
    p.add_argument("--worker-kills", type=int, default=2, help="worker kills per scenario")
    p.add_argument("--steps", type=int, default=1500, help="steps per worker")
    p.add_argument(
        "--copy-kills", type=int, default=8, help="replicas scenarios: kills of copies (primaries, then backups)"
    )
    p.add_argument("--replica-worker-kills", type=int, default=2, help="replicas scenarios: worker kills")
    p.add_argument("--replica-steps", type=int, default=1200, help="replicas scenarios: steps per worker")
    p.add_argument("--checkpoint-every", default=None, help="this --checkpoint-every in every scenario")
    p.add_argument("--only", action="append", default=[], help="run only this scenario (repeatable)")
    p.add_argument("--workdir", default=None, help="keep each scenario's files here (default: a temporary folder)")
    args = p.parse_args(argv)
    seed = args.seed if args.seed is not None else int(time.time()) % 100000
    print(f"stress_kills: seed {seed} (rerun with --seed {seed})", flush=True)
    chosen = [
        s
        for s in scenarios(
            seed,
            args.kills,
            args.worker_kills,
            args.steps,
            args.copy_kills,
            args.replica_worker_kills,
            args.replica_steps,
        )
        if not args.only or s.name in args.only
    ]
    if not chosen:
        p.error(f"no scenario named {args.only}")
    if args.checkpoint_every is not None:
        chosen = [dataclasses.replace(s, checkpoint_every=args.checkpoint_every) for s in chosen]
    outcomes: list[Outcome] = []
    errors: list[str] = []
    with tempfile.TemporaryDirectory(prefix="stress-kills-") as tmp:
        base = Path(args.workdir) if args.workdir else Path(tmp)
        for s in chosen:
            try:
                o = run_scenario(s, base / s.name, say=lambda m: print(m, flush=True))
            except Exception as exc:  # noqa: BLE001 - one scenario's failure must not hide the others' figures
                errors.append(f"[{s.name}] {type(exc).__name__}: {exc}")
                print(errors[-1], flush=True)
                continue
            outcomes.append(o)
            print(o.summary(), flush=True)
    print()
    print(_table(outcomes))
    bad = [o for o in outcomes if o.problems]
    for o in bad:
        print(f"FAIL {o.scenario.name}: {'; '.join(o.problems)}")
    for e in errors:
        print(f"ERROR {e.splitlines()[0]}")
    kills = sum(len(o.kills) for o in outcomes)
    replicated = [o for o in outcomes if o.scenario.replicas > 1]
    if replicated:
        failovers = [x for o in replicated for x in o.failovers]
        pauses = [x for o in replicated for x in o.outages("backup")]
        print(
            f"replicas: {sum(len(o.kills) for o in replicated)} kills in {len(replicated)} scenarios; failover "
            f"(SIGKILL of an in-sync primary -> first acknowledged push sent after it) min/median/p90/max "
            f"{spread(failovers)}; after a backup's SIGKILL {spread(pauses)}"
        )
    print(f"{kills} kills in {len(outcomes)} scenarios: {'FAIL' if bad or errors else 'ok'}")
    return 1 if bad or errors else 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
