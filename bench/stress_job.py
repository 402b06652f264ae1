"""One stress scenario's processes (bench/stress_kills.py): its shards (and, with replicas, their etcd), its worker
processes (`stress_kills.py worker`) and their steps files, and the kills of each kind."""

from __future__ import annotations

import os
import queue
import random
import signal
import subprocess
import sys
import threading
import time
from collections.abc import Iterator
from contextlib import ExitStack, contextmanager
from pathlib import Path
from typing import Any

import grpc
import torch

from bench.stress_outcomes import Kill, Scenario
from paramserver import LocalCluster, ServerConfig
from paramserver.coord import CoordinatorUnavailable, Etcd, PartConfig, PartRegister
from paramserver.procs import die_with_parent
from paramserver.server.replica import DEPOSED_EXIT
from paramserver.testing import EtcdServer
from paramserver.v1 import ps_pb2, ps_pb2_grpc
from worker import PSClient

SHARDS = 2
SIZES = {"a": 4, "b": 4}  # placement puts one tensor on each of the two shards
ROOT = Path(__file__).resolve().parents[1]
WORKER_SCRIPT = Path(__file__).resolve().with_name("stress_kills.py")  # its `worker` command: one worker process


def stress_model() -> dict[str, torch.Tensor]:
    return {name: torch.zeros(n) for name, n in SIZES.items()}


def file_lines(path: Path) -> list[list[str]]:
    """A worker's steps file, split (complete lines only: one being written when it was killed is not)."""
    try:
        text = path.read_text()
    except FileNotFoundError:
        return []
    return [x.split() for x in text.split("\n")[:-1] if x]


def acked_steps(path: Path) -> list[int]:
    """The steps a worker's file holds."""
    return [int(x[0]) for x in file_lines(path)]


def ack_times(path: Path) -> list[tuple[float, float]]:
    """(sent, acknowledged), time.monotonic(), of each step a worker's file holds."""
    return [(float(x[1]), float(x[2])) for x in file_lines(path) if len(x) == 3]


def count_lines(path: Path) -> int:
    try:
        return path.read_bytes().count(b"\n")
    except FileNotFoundError:
        return 0


class Job:
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
        done = acked_steps(out)
        cmd = [
            sys.executable, str(WORKER_SCRIPT), "worker", "--address", self.live_address(),
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
        return sum(count_lines(self.out(n)) for n in self.names)

    def last_steps(self) -> dict[str, int]:
        return {n: max(acked_steps(self.out(n)), default=0) for n in self.names}

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
    def running_job(self) -> Iterator[Job]:
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


def plan_kills(s: Scenario, rng: random.Random) -> list[tuple[float, str, int]]:
    """(progress fraction, "shard" | "primary" | "backup" | "worker", index) for each kill, in order of progress;
    the index of a shard's (or of a copy's: its shard's) or of a worker."""
    shard = ["primary", "backup"] if s.replicas > 1 else ["shard"]
    kinds = [shard[0]] * s.shard_kills + [shard[-1]] * s.backup_kills * (s.replicas > 1) + ["worker"] * s.worker_kills
    rng.shuffle(kinds)
    lo, hi = s.window
    points = sorted(rng.uniform(lo, hi) for _ in kinds)
    return [(x, k, rng.randrange(s.workers if k == "worker" else SHARDS)) for x, k in zip(points, kinds, strict=True)]


def shard_versions(addresses: list[str]) -> list[int | str]:
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


def read_shards(address: str) -> tuple[list[int], list[torch.Tensor]]:
    """Every shard's version and its elements, read by a client that does not join (gRPC); with replicas, from
    each shard's primary (a backup refuses: the reader's link tries the other copy)."""
    with PSClient(address, join=False, shared_memory=False, data_socket=False, timeout=30) as reader:
        weights = stress_model()
        reader.pull(weights)
        placement = reader.placement(weights)
        per_shard = [
            torch.cat([weights[p.name].reshape(-1)[p.start : p.start + p.length] for p in pieces])
            if pieces
            else torch.empty(0)
            for pieces in placement.shards
        ]
        return list(reader.versions), per_shard


def kill_shard(job: Job, index: int, rng: random.Random, acked: int) -> Kill:
    """SIGKILL shard process `index`, wait 0.5-1 s, start it again on its port with the same command."""
    job.cluster.kill(index)
    killed_at = time.monotonic()
    job.cluster.procs[index].wait(timeout=10)
    time.sleep(rng.uniform(0.5, 1.0))
    job.cluster.restart(index)
    return Kill(f"shard {index}", acked, time.monotonic() - killed_at, killed_at, "shard")


def copy_waits(job: Job, shard: int, role: str) -> str:
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


def kill_copy(job: Job, shard: int, role: str, rng: random.Random, acked: int) -> Kill | None:
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


def kill_worker(job: Job, index: int, rng: random.Random, acked: int) -> Kill | None:
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
