"""Memory: peak RSS of each shard process while 1, 2 or 4 workers push a ~25 M-parameter model in sync mode.

The shards' resident memory is sampled every 20 ms from /proc/PID/status, and the kernel's own peak (VmHWM) is
read at the end. What a shard must hold is its parameters and the optimizer's state; with SGD that is the
parameters plus one gradient-sized buffer (the round's running sum). The shard's own memory is its anonymous
resident pages (RssAnon: the heap, its buffers, the model). Left out of it, and reported apart:
- shared-memory pages (RssShmem): on the shared-memory path the workers' segments (two regions of the shard's part
  per same-host worker, created by the workers) are mapped into the shard too;
- file-backed pages (RssFile): the code of Python, torch and gRPC, shared with every process that loads them; it
  grows by a few MB as a process first runs more of that code, whatever the model.
The reported overhead is (peak anonymous RSS - that of the same shard process idle, before any model) /
(parameters + that buffer). A second ratio starts from a working shard (one that holds a 64-element model and has
served a few rounds), which leaves out what every shard pays once whatever its model. Every path is measured:
"shm", the data socket ("socket") and the gRPC streams ("float32").
"""

from __future__ import annotations

import threading
from pathlib import Path

from bench.common import MB, Child, Figure, Processes, log, schedule
from bench.plan import Plan
from bench.transport import dense_tensors

SECTION = "memory"
SHARDS = 2
TIMEOUT = 600.0
SAMPLE_S = 0.02


def rss_parts(pid: int) -> dict[str, int]:
    """VmRSS and its parts (RssAnon, RssFile, RssShmem) of a process, in bytes."""
    fields = {}
    for line in Path(f"/proc/{pid}/status").read_text().splitlines():
        name, _, value = line.partition(":")
        if name in ("VmRSS", "RssAnon", "RssFile", "RssShmem"):
            fields[name] = int(value.split()[0]) * 1024
    return fields


def anon_bytes(pid: int) -> int:
    """Anonymous resident memory of a process (its heap and buffers), in bytes."""
    return _status_kb(pid, "RssAnon") * 1024


def peak_rss_bytes(pid: int) -> int:
    """The kernel's record of the process's peak RSS (VmHWM), or 0 where /proc has none."""
    try:
        return _status_kb(pid, "VmHWM") * 1024
    except OSError:
        return 0


def _status_kb(pid: int, field: str) -> int:
    for line in Path(f"/proc/{pid}/status").read_text().splitlines():
        if line.startswith(field + ":"):
            return int(line.split()[1])
    raise OSError(f"no {field} in /proc/{pid}/status")


class Sampler:
    """Sample the memory of some processes every 20 ms in a thread; remember the peak of each field of
    `rss_parts` (VmRSS, RssAnon, RssFile, RssShmem) for each process."""

    FIELDS = ("VmRSS", "RssAnon", "RssFile", "RssShmem")

    def __init__(self, pids: list[int]) -> None:
        self.pids = pids
        self.peak = {field: {pid: 0 for pid in pids} for field in self.FIELDS}
        self._sample()
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, name="rss-sampler", daemon=True)

    def _sample(self) -> None:
        for pid in self.pids:
            try:
                parts = rss_parts(pid)
            except OSError:  # the shard is gone
                continue
            for field in self.FIELDS:
                self.peak[field][pid] = max(self.peak[field][pid], parts.get(field, 0))

    def _run(self) -> None:
        while not self._stop.wait(SAMPLE_S):
            self._sample()

    def __enter__(self) -> Sampler:
        self._thread.start()
        return self

    def __exit__(self, *exc: object) -> None:
        self._stop.set()
        self._thread.join()


def _idle_anon(pids: list[int]) -> dict[int, int]:
    """Anonymous RSS of freshly started shards holding no model: the largest of a few samples 50 ms apart."""
    idle = {pid: 0 for pid in pids}
    for _ in range(5):
        for pid in pids:
            idle[pid] = max(idle[pid], anon_bytes(pid))
        threading.Event().wait(0.05)
    return idle


def _push_pull(kids: list[Child], address: str, warmup: int, n: int, wire: str = "shm") -> None:
    """Have every worker register, then run warmup + n push + pull rounds together."""
    for k in kids:
        k.send(address=address, wire=wire, warmup=warmup, n=n)
    for k in kids:
        k.expect("registered", TIMEOUT)
    for k in kids:
        k.send(go=True)
    for k in kids:
        k.expect("result", TIMEOUT)


def _working(procs: Processes) -> dict[int, int]:
    """Anonymous RSS of shard processes that hold a 64-element model and have served a few rounds: what any working
    shard holds whatever its model (torch._dynamo, ~75 MB, which a shard process imports before it serves, is in
    both this and the idle figure)."""
    from paramserver import ServerConfig

    kid = procs.child("transport", "worker", {"tensors": dense_tensors(64)}, name="memory-reference-worker")
    cluster = procs.cluster(ServerConfig(mode="sync", workers=1, optimizer="sgd", lr=0.01), SHARDS)
    procs.settle()
    try:
        _push_pull([kid], cluster.address, 1, 3)
        return {i: anon_bytes(p.pid) for i, p in enumerate(cluster.procs)}
    finally:
        procs.close_children([kid])
        procs.stop_soon(cluster)


def _case(plan: Plan, procs: Processes, workers: int, working: dict[int, int], wire: str) -> list[Figure]:
    from paramserver import ServerConfig
    from paramserver.placement import TensorSpec, place

    tensors = dense_tensors(plan.memory_params)
    placement = place([TensorSpec(n, (k,)) for n, k in tensors], SHARDS)
    kids = [procs.child("transport", "worker", {"tensors": tensors}, name=f"memory-worker{r}") for r in range(workers)]
    cluster = procs.cluster(ServerConfig(mode="sync", workers=workers, optimizer="sgd", lr=0.01), SHARDS)
    procs.settle()
    pids = [p.pid for p in cluster.procs]
    try:
        idle = _idle_anon(pids)
        warmup, n = schedule(4 * plan.memory_params, plan.memory_rounds)
        with Sampler(pids) as sampler:
            _push_pull(kids, cluster.address, warmup, n, wire)
        peaks = {pid: max(sampler.peak["VmRSS"][pid], peak_rss_bytes(pid)) for pid in pids}
        anon = sampler.peak["RssAnon"]
    finally:
        procs.close_children(kids)
        procs.stop_soon(cluster)
    figures = []
    for i, pid in enumerate(pids):
        held = 2 * 4 * placement.shard_elements(i)  # parameters + one gradient-sized buffer (SGD)
        params = {
            "workers": workers,
            "wire": wire,
            "shard": i,
            "shards": SHARDS,
            "mode": "sync",
            "optimizer": "sgd",
            "parameters": plan.memory_params,
            "shard_parameters": placement.shard_elements(i),
            "params_plus_state_mb": round(held / MB, 3),
            "rounds": warmup + n,
        }
        extra = {
            "peak_rss_mb": round(peaks[pid] / MB, 3),
            "peak_anon_mb": round(anon[pid] / MB, 3),
            "peak_shared_mb": round(sampler.peak["RssShmem"][pid] / MB, 3),
            "peak_file_mb": round(sampler.peak["RssFile"][pid] / MB, 3),
            "idle_anon_mb": round(idle[pid] / MB, 3),
            "working_anon_mb": round(working[i] / MB, 3),
            "over_working": round((anon[pid] - working[i]) / held, 3),
        }
        figures.append(
            Figure(
                f"{SECTION}.peak.{wire}.w{workers}.shard{i}",
                SECTION,
                f"peak RSS of shard {i}, {workers} worker(s), {wire}",
                "MB",
                [extra["peak_rss_mb"]],
                params,
                extra={"idle_anon_mb": extra["idle_anon_mb"], "working_anon_mb": extra["working_anon_mb"]},
            )
        )
        figures.append(
            Figure(
                f"{SECTION}.overhead.{wire}.w{workers}.shard{i}",
                SECTION,
                f"(peak anonymous - idle anonymous RSS) / (parameters + optimizer state), shard {i}, {workers} "
                f"worker(s), {wire}",
                "x",
                [round((anon[pid] - idle[pid]) / held, 3)],
                params,
                extra=extra,
            )
        )
    log(
        f"memory {wire}, {workers} worker(s): "
        + ", ".join(f"shard {f.params['shard']} {f.median:.2f}x" for f in figures if f.unit == "x")
    )
    return figures


def run(plan: Plan, procs: Processes) -> list[Figure]:
    """One sync job per worker count; the figures are per shard (a peak is one number per run, not a timing)."""
    working = _working(procs)
    figures: list[Figure] = []
    for wire in ("shm", "socket", "float32"):
        for workers in plan.memory_workers:
            figures += _case(plan, procs, workers, working, wire)
    return figures
