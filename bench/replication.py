"""Replication: what `--replicas 2` (a hot standby beside each primary) costs, and how fast it recovers.

Public API only: `LocalCluster(ServerConfig(replicas=2, coordinator=URL), shards=1, processes=True)` (2 processes,
copy 0 and copy 1 of the one shard), a real etcd on loopback (`paramserver.testing.EtcdServer`, one for the
section; each cluster a job of its own name in it), the roles read with `PartRegister(...).read()`, and `PSClient`.

- cost: the exchange a training step makes (push_pull) of a dense float32 model, one shard, one worker, sync mode
  (SGD), against the same job with --replicas 1. Both clusters run at once, each with its worker process, and their
  rounds are interleaved (r1, r2, then r2, r1, ...), so a drift of this machine's speed weighs on both sides; the
  ratio is that of the medians (and, in `extra`, the median of each pair's ratio). An exchange with replicas is
  answered once the backup answered for its update; the primary forwards the push to the backup as it arrives
  (data socket) or while it applies it and writes the pull (shared memory), so the copy overlaps the exchange
  instead of following it. The 100 MB case on shared memory and on the data socket, then with --checkpoint-dir on
  both sides (the write-ahead log, --wal-sync write, no checkpoint while timed), and a small model (0.6 MB).
- failover: one worker pushes the small model as fast as it can (push_pull, sync, shared memory); the current
  primary is SIGKILLed at a random moment, restarted 0.5 s later (it comes back as the backup and catches up), and
  again once both copies are in sync. The failover time of each kill: from the SIGKILL to the first acknowledged
  push sent after it (time.monotonic() in both processes). Every push then had to reach the new primary: it holds
  the backup's detection of the broken link, its compare-and-swap in etcd, and the worker's retry of the other
  copy. The catch-up of each restarted copy is timed too (from serving to back in the in-sync set, while the
  worker pushes).
- catch-up: the 100 MB model's backup is SIGKILLed and restarted; from the restart (the process spawned) to both
  copies in the in-sync set in etcd (and, in `extra`, the part until it served): the whole state travels, then the
  updates made meanwhile. With the worker idle, then while it pushes the 100 MB model as fast as it can.

The quick run (PS_BENCH_SMOKE=1) measures a 1 MB model on shared memory, 1 failover and no separate catch-up.
"""

from __future__ import annotations

import random
import statistics
import tempfile
import threading
import time
from pathlib import Path
from typing import Any

from bench.common import Channel, Figure, Processes, log, median, ms, schedule
from bench.plan import Plan

SECTION = "replication"
TIMEOUT = 600.0
LR = 0.01
PATHS = {"shm": "shared memory + doorbell", "socket": "data socket (TCP)"}
SMALL = ("600KB", 150_000)  # float32 parameters of the small model (0.6 MB)
CATCH_UP_LIMIT = 60.0  # a restarted copy not in sync this long after it served: said, and the kills end


def _sizes(plan: Plan) -> dict[str, Any]:
    """What a run measures: (label, parameters) of the large model, its wires, the WAL case, the small model,
    failovers, catch-ups."""
    if plan.quick:
        return {"big": ("1MB", 250_000), "wires": ("shm",), "wal": False, "small": None, "kills": 1, "catch_ups": 0}
    return {"big": ("100MB", 25_000_000), "wires": ("shm", "socket"), "wal": True, "small": SMALL, "kills": 10,
            "catch_ups": 3}  # fmt: skip


def _tensors(numel: int) -> list[tuple[str, int]]:
    return [("weight", numel)]


# -- the worker process -----------------------------------------------------------------------------------------


def _worker(chan: Channel, params: dict[str, Any]) -> None:
    """One worker. Messages: {"do": "register", address, wire} (a new PSClient, the model registered);
    {"do": "rounds", n} (n push_pull exchanges, timed); {"do": "pound", out} (push_pull as fast as it can, each
    push's sent and acknowledged time.monotonic() written to `out`, until the parent's next message)."""
    import torch

    from worker import PSClient

    torch.set_num_threads(1)
    torch.manual_seed(0)
    model = {name: torch.randn(n) for name, n in params["tensors"]}
    grads = {name: torch.full_like(t, 1e-3) for name, t in model.items()}
    client: Any = None
    try:
        while True:
            job = chan.recv()
            if job["do"] == "register":
                if client is not None:
                    client.close()
                wire = job["wire"]
                client = PSClient(job["address"], shared_memory=wire == "shm", data_socket=wire == "socket")
                client.register(model)
                chan.send("registered", transports=[link.transport.kind for link in client.links])
            elif job["do"] == "rounds":
                took = []
                for _ in range(job["n"]):  # the pulled weights land in `grads`: the next push sends them (finite)
                    t0 = time.perf_counter()
                    client.push_pull(grads)
                    took.append(time.perf_counter() - t0)
                chan.send("rounds", took=took)
            elif job["do"] == "pound":
                stop = threading.Event()
                threading.Thread(target=_until_told, args=(chan, stop), daemon=True).start()
                marks: list[str] = []
                while not stop.is_set():
                    sent = time.monotonic()
                    client.push_pull(grads)
                    marks.append(f"{sent:.6f} {time.monotonic():.6f}\n")
                Path(job["out"]).write_text("".join(marks))
                chan.send("pounded", pushes=len(marks))
    finally:
        if client is not None:
            client.close()


def _until_told(chan: Channel, stop: threading.Event) -> None:
    """Set `stop` at the parent's next message."""
    try:
        chan.recv()
    finally:
        stop.set()


ROLES = {"worker": _worker}


# -- the parent -------------------------------------------------------------------------------------------------


class _Job:
    """One cluster of one shard (1 or 2 copies) and its worker process."""

    def __init__(self, procs: Processes, config: Any, numel: int, name: str) -> None:
        self.config = config
        self.name = name
        self.child = procs.child(SECTION, "worker", {"tensors": _tensors(numel)}, name=f"replication-{name}")
        self.cluster = procs.cluster(config, 1)
        self.register: Any = None
        self.transports: list[str] = []  # each link's kind, as the worker registered
        if config.replicas > 1:
            from paramserver.coord import Etcd, PartRegister

            self.register = PartRegister(Etcd(config.coordinator), config.job_name, 0)

    def connect(self, wire: str) -> None:
        self.child.send(do="register", address=self.cluster.address, wire=wire)

    def registered(self) -> list[str]:
        self.transports = list(self.child.expect("registered", TIMEOUT)["transports"])
        return self.transports

    def in_sync(self, timeout: float = 120.0, wait: bool = True) -> Any:
        """Wait until both copies are in the in-sync set; return the configuration (None after `timeout` s where
        not `wait`: then the copies' configuration is raised)."""
        deadline = time.monotonic() + timeout
        while time.monotonic() < deadline:
            cfg = self.register.read()
            if cfg is not None and len(cfg.in_sync) == 2:
                return cfg
            time.sleep(0.01)
        if not wait:
            return None
        now = self.register.read()
        raise RuntimeError(f"{self.name}: the copies did not get in sync within {timeout:.0f} s: {now}")

    def restart(self, copy: int, delay: float) -> tuple[float, float, float | None]:
        """Wait for the killed copy's exit, `delay` s more, start it again; (spawned, serving, in sync) times, the
        last None where the copies were not in sync CATCH_UP_LIMIT s after it served."""
        self.cluster.procs[copy].wait(timeout=30)
        time.sleep(delay)
        spawned = time.monotonic()
        self.cluster.restart(copy)
        serving = time.monotonic()
        synced = self.in_sync(CATCH_UP_LIMIT, wait=False)
        return spawned, serving, time.monotonic() if synced is not None else None


def run(plan: Plan, procs: Processes) -> list[Figure]:
    """The cost of --replicas 2 on the exchange, failover times, catch-up times."""
    from paramserver.testing import EtcdServer

    sizes = _sizes(plan)
    figures: list[Figure] = []
    rng = random.Random(0)
    with EtcdServer() as etcd, tempfile.TemporaryDirectory(prefix="bench-replication-") as tmp:
        jobs = 0

        def config(replicas: int, wal: bool) -> Any:
            from paramserver import ServerConfig

            nonlocal jobs
            jobs += 1
            c = ServerConfig(mode="sync", workers=1, optimizer="sgd", lr=LR, job_name=f"bench-replication-{jobs}")
            if wal:
                c = c.replace(checkpoint_dir=str(Path(tmp) / f"job{jobs}"), checkpoint_every="0")
            return c.replace(replicas=2, coordinator=etcd.url) if replicas > 1 else c

        label, numel = sizes["big"]
        cases = [(label, numel, sizes["wires"], False)]
        if sizes["wal"]:
            cases.append((label, numel, ("shm",), True))
        if sizes["small"]:
            cases.append((*sizes["small"], ("shm",), False))
        for label, numel, wires, wal in cases:
            one = _Job(procs, config(1, wal), numel, f"{label}.r1")
            two = _Job(procs, config(2, wal), numel, f"{label}.r2")
            try:
                for wire in wires:
                    figures += _cost(plan, one, two, label, numel, wire, wal)
                if label == sizes["big"][0] and not wal and sizes["catch_ups"]:
                    figures += _catch_up(two, label, numel, sizes["catch_ups"], Path(tmp), rng)
                if label == (sizes["small"] or sizes["big"])[0] and not wal:
                    figures += _failover(two, label, numel, sizes["kills"], Path(tmp), rng)
            finally:
                procs.close_children([one.child, two.child])
                procs.stop_soon(one.cluster)
                procs.stop_soon(two.cluster)
                procs.settle()
    return figures


def _cost(plan: Plan, one: _Job, two: _Job, label: str, numel: int, wire: str, wal: bool) -> list[Figure]:
    """Exchanges on both clusters in turn; a figure per side, the replicated one compared with the other."""
    nbytes = 4 * numel
    warmup, n = schedule(nbytes, plan.repeats)
    if nbytes >= 50e6:
        n = max(n, 3 * plan.repeats)  # a ratio of two medians of a handful of rounds moves with one slow round
    for job in (one, two):
        job.connect(wire)
    kinds = [one.registered(), two.registered()]
    two.in_sync()
    rt: dict[int, list[float]] = {1: [], 2: []}
    for i in range(warmup + n):
        order = (one, two) if i % 2 == 0 else (two, one)
        for job in order:
            job.child.send(do="rounds", n=1)
            got = job.child.expect("rounds", TIMEOUT)
            if i >= warmup:
                rt[job.config.replicas] += got["took"]
    variant = f"{wire}{'-wal' if wal else ''}"
    pairs = [b / a for a, b in zip(rt[1], rt[2], strict=True) if a > 0]
    figures = []
    for side in (1, 2):
        fid = f"{SECTION}.rt.{label}.{variant}.r{side}"
        figures.append(
            Figure(
                id=fid,
                section=SECTION,
                title=f"push_pull, {label}, 1 shard, 1 worker, {PATHS[wire]}"
                + (", --checkpoint-dir (log)" if wal else "")
                + f", --replicas {side}",
                unit="ms",
                repeats=ms(rt[side]),
                params={"payload": label, "bytes": nbytes, "wire": wire, "wal": wal, "replicas": side, "mode": "sync"},
                warmup=warmup,
                compare=[f"{SECTION}.rt.{label}.{variant}.r1"] if side == 2 else [],
                extra={
                    "transports": kinds[side - 1],
                    **({"paired_ratio_median": round(median(pairs), 4), "target": 1.3} if side == 2 else {}),
                },
            )
        )
    r = figures[1].median / figures[0].median if figures[0].median > 0 else float("nan")
    log(f"replication {label} {variant}: r1 {figures[0].median:.2f} ms, r2 {figures[1].median:.2f} ms ({r:.2f}x)")
    return figures


def _restart_loop(
    job: _Job, label: str, kills: int, rng: random.Random, target: str, pushing: bool, workdir: Path
) -> tuple[list[float], list[tuple[float, float, float | None]], int]:
    """Kill the `target` ("primary" or "backup") copy `kills` times, each once both copies are in sync, restart it
    0.5 s later; with `pushing`, while the worker pushes as fast as it can. Return each kill's time, each restart's
    (spawned, serving, in sync) times and the pushes made. A copy not in sync CATCH_UP_LIMIT s after it served ends
    the kills (its in-sync time None), and they wait for it with the worker idle."""
    out = workdir / f"{job.name}-{target}-marks"
    if pushing:
        job.child.send(do="pound", out=str(out))
    killed: list[float] = []
    restarts: list[tuple[float, float, float | None]] = []
    try:
        for _ in range(kills):
            cfg = job.in_sync()
            time.sleep(rng.uniform(0.2, 0.5))  # a random moment of the pushes
            cfg = job.register.read() or cfg
            copy = cfg.primary if target == "primary" else 1 - cfg.primary
            job.cluster.kill(copy)
            killed.append(time.monotonic())
            restarts.append(job.restart(copy, 0.5))
            if restarts[-1][2] is None:
                log(f"replication {label}: the restarted {target} not in sync {CATCH_UP_LIMIT:.0f} s after it served")
                break
    finally:
        if pushing:
            job.child.send(do="stop")
    pushes = job.child.expect("pounded", TIMEOUT)["pushes"] if pushing else 0
    job.in_sync()  # (with the worker idle now)
    log(f"replication {label}: {len(killed)} kills of the {target}, {pushes} pushes meanwhile")
    return killed, restarts, pushes


def _failovers(killed: list[float], out: Path) -> list[float]:
    """For each kill: from the SIGKILL to the first acknowledgement of a push sent after it."""
    marks = [tuple(map(float, line.split())) for line in out.read_text().splitlines() if line]
    found = []
    for t in killed:
        after = [acked for sent, acked in marks if sent >= t]
        if after:
            found.append(min(after) - t)
    return found


def _failover(job: _Job, label: str, numel: int, kills: int, workdir: Path, rng: random.Random) -> list[Figure]:
    transports = job.transports  # (connected by the cost case, on shared memory)
    killed, restarts, pushes = _restart_loop(job, label, kills, rng, "primary", True, workdir)
    failovers = _failovers(killed, workdir / f"{job.name}-primary-marks")
    if len(failovers) < len(killed):
        raise RuntimeError(f"{len(killed) - len(failovers)} of {len(killed)} kills saw no acknowledged push after them")
    params = {"payload": label, "bytes": 4 * numel, "wire": "shm", "mode": "sync", "replicas": 2, "kills": kills}
    log(f"replication {label}: failover {_spread(failovers)}")
    failover = Figure(
        id=f"{SECTION}.failover.{label}",
        section=SECTION,
        title=f"failover: SIGKILL of the primary to the first acknowledged push sent after it, {label}, "
        "1 worker pushing as fast as it can",
        unit="ms",
        repeats=ms(failovers),
        params=params,
        extra={**_quantiles(failovers), "pushes": pushes, "transports": transports},
    )
    return [failover, _catch_up_figure(label, numel, restarts, True, pushes, "primary")]


def _catch_up(job: _Job, label: str, numel: int, repeats: int, workdir: Path, rng: random.Random) -> list[Figure]:
    """The backup of the large model killed and restarted, the worker idle, then pushing."""
    figures = []
    for pushing in (False, True):
        _, restarts, pushes = _restart_loop(job, label, repeats, rng, "backup", pushing, workdir)
        figures.append(_catch_up_figure(label, numel, restarts, pushing, pushes, "backup"))
    return figures


def _catch_up_figure(
    label: str, numel: int, restarts: list[tuple[float, float, float | None]], pushing: bool, pushes: int, killed: str
) -> Figure:
    """From each restart (the process spawned) to both copies in sync; in `extra`, the part after it served, and
    the restarts not in sync within CATCH_UP_LIMIT s (left out of the repeats)."""
    done = [(spawned, served, synced) for spawned, served, synced in restarts if synced is not None]
    total = [synced - spawned for spawned, _, synced in done]
    serving = [synced - served for _, served, synced in done]
    how = "while the worker pushes" if pushing else "the worker idle"
    log(f"replication {label}: catch-up {how}: from the restart {_spread(total)}, from serving {_spread(serving)}")
    return Figure(
        id=f"{SECTION}.catchup.{label}.{'pushing' if pushing else 'idle'}",
        section=SECTION,
        title=f"catch-up of a restarted copy (the {killed} killed), {label}: from the restart to both copies in sync, "
        + how,
        unit="s",
        repeats=[round(x, 4) for x in total],
        params={"payload": label, "bytes": 4 * numel, "replicas": 2, "pushing": pushing, "killed": killed},
        extra={
            "serving_to_in_sync_s": [round(x, 4) for x in serving],
            "process_start_s": [round(s - t, 3) for t, s, _ in restarts],
            "pushes": pushes,
            "not_in_sync": len(restarts) - len(done),
            "limit_s": CATCH_UP_LIMIT,
        },
    )


def _quantiles(seconds: list[float]) -> dict[str, float]:
    xs = sorted(seconds)
    at = 0.9 * (len(xs) - 1)
    lo = int(at)
    p90 = xs[lo] + (xs[min(lo + 1, len(xs) - 1)] - xs[lo]) * (at - lo)
    return {
        "min_ms": round(xs[0] * 1e3, 2),
        "median_ms": round(statistics.median(xs) * 1e3, 2),
        "p90_ms": round(p90 * 1e3, 2),
        "max_ms": round(xs[-1] * 1e3, 2),
    }


def _spread(seconds: list[float]) -> str:
    if not seconds:
        return "-"
    q = _quantiles(seconds)
    return f"{q['min_ms']:.0f}/{q['median_ms']:.0f}/{q['p90_ms']:.0f}/{q['max_ms']:.0f} ms (n={len(seconds)})"
