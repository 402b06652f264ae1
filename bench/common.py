"""What every benchmark shares: figures and medians, schedules, ports, machine facts, and child processes.

Depends on the standard library only (no torch, no grpc), so light children such as the TCP baseline start fast.

Child processes speak JSON lines: the parent writes messages to a child's stdin, the child answers with lines
tagged `BENCH-MSG` on its stdout. Every process is started through a `Processes` group, which stops all of them
(SIGTERM, then SIGKILL) when its `with` block ends, also on errors and Ctrl-C; clusters handed to it are stopped
as well. Children also die with the parent (PR_SET_PDEATHSIG on Linux) should the parent be killed outright.
"""

from __future__ import annotations

import json
import math
import os
import platform
import queue
import signal
import socket
import statistics
import subprocess
import sys
import threading
import time
import traceback
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from paramserver import procs
from paramserver.files import atomic_write

ROOT = Path(__file__).resolve().parents[1]
MB = 1e6  # decimal units throughout: 25 M float32 parameters are 100 MB
GB = 1e9
TAG = "BENCH-MSG"
PARENT_ENV = "BENCH_PARENT_PID"


class BenchError(RuntimeError):
    """A benchmark could not measure what it set out to (a child failed, a wait timed out)."""


# -- figures ----------------------------------------------------------------------------------------------------


@dataclass
class Figure:
    """One measured quantity: every repeat, the median, its unit, and what it is compared with."""

    id: str
    section: str
    title: str
    unit: str
    repeats: list[float]
    params: dict[str, Any] = field(default_factory=dict)
    warmup: int = 0
    compare: list[str] = field(default_factory=list)  # ids of baseline figures; ratio = this median / theirs
    extra: dict[str, Any] = field(default_factory=dict)

    @property
    def median(self) -> float:
        return median(self.repeats)

    def to_json(self) -> dict[str, Any]:
        return {
            "id": self.id,
            "section": self.section,
            "title": self.title,
            "unit": self.unit,
            "median": None if math.isnan(self.median) else self.median,
            "repeats": self.repeats,
            "n": len(self.repeats),
            "warmup": self.warmup,
            "params": self.params,
            "compare": self.compare,
            **({"extra": self.extra} if self.extra else {}),
        }


def median(values: Sequence[float]) -> float:
    """The median, or NaN for no values."""
    return float(statistics.median(values)) if values else float("nan")


def schedule(nbytes: float, repeats: int) -> tuple[int, int]:
    """(warm-up iterations, timed iterations) for a payload: small payloads are cheap, so time more of them."""
    if nbytes >= 50 * MB:
        return 2, repeats  # the first pushes page in the shards' buffers
    if nbytes >= 1 * MB:
        return 2, 4 * repeats
    return 5, 10 * repeats


def ms(seconds: Sequence[float]) -> list[float]:
    return [round(s * 1e3, 4) for s in seconds]


def gbps(nbytes: float, seconds: Sequence[float]) -> list[float]:
    return [round(nbytes / s / GB, 4) for s in seconds if s > 0]


def free_port() -> int:
    """A port the OS considers free now: bind 127.0.0.1:0 and close (for tcp:// init methods that need one)."""
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


def machine_facts() -> dict[str, Any]:
    """Cores, versions and the malloc setting: what a reader needs to compare two result files."""
    facts: dict[str, Any] = {
        "cores": os.cpu_count(),
        "cores_usable": len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else os.cpu_count(),
        "platform": platform.platform(),
        "python": platform.python_version(),
        "glibc_tunables": os.environ.get("GLIBC_TUNABLES", "unset (glibc defaults)"),
        "load_average": list(os.getloadavg()) if hasattr(os, "getloadavg") else None,
    }
    try:
        for line in Path("/proc/cpuinfo").read_text().splitlines():
            if line.startswith("model name"):
                facts["cpu"] = line.split(":", 1)[1].strip()
                break
        for line in Path("/proc/meminfo").read_text().splitlines():
            if line.startswith("MemTotal"):
                facts["memory_gb"] = round(int(line.split()[1]) * 1024 / GB, 1)
                break
    except OSError:
        pass
    for name, module in (("torch", "torch"), ("grpc", "grpc"), ("numpy", "numpy"), ("paramserver", "paramserver")):
        try:
            facts[name] = __import__(module).__version__
        except Exception as exc:  # noqa: BLE001 - a missing package is a fact to record, not a failure
            facts[name] = f"unavailable ({type(exc).__name__})"
    return facts


# Write a file via a temporary name and a rename, so a reader never sees half of it (the results, the report).
write_atomic = atomic_write


def log(message: str) -> None:
    """Progress on stderr (stdout is kept for the final table)."""
    print(f"[bench {time.strftime('%H:%M:%S')}] {message}", file=sys.stderr, flush=True)


# -- processes (parent side) ------------------------------------------------------------------------------------


def cpu_seconds(pids: Sequence[int]) -> float:
    """CPU seconds the live threads of these processes have run so far, from the scheduler's nanosecond counts
    (/proc/PID/task/TID/schedstat; /proc/PID/stat counts in 10 ms ticks, too coarse for a round of steps). A thread
    that has ended is not counted: measure processes whose threads live across the window."""
    total = 0
    for pid in pids:
        try:
            tasks = os.listdir(f"/proc/{pid}/task")
        except OSError:
            continue
        for tid in tasks:
            try:
                total += int(Path(f"/proc/{pid}/task/{tid}/schedstat").read_text().split()[0])
            except (OSError, ValueError, IndexError):
                continue
    return total / 1e9


def child_env() -> dict[str, str]:
    """The environment of every child: the repository importable, one torch thread unless told otherwise."""
    env = dict(os.environ)
    env["PYTHONPATH"] = os.pathsep.join([str(ROOT), *filter(None, [env.get("PYTHONPATH")])])
    env.setdefault("OMP_NUM_THREADS", "1")
    env[PARENT_ENV] = str(os.getpid())
    return env


class Child:
    """A `python -m bench.child MODULE ROLE PARAMS` process and its message queue."""

    def __init__(self, module: str, role: str, params: dict[str, Any], name: str) -> None:
        self.name = name
        self.proc = subprocess.Popen(
            [sys.executable, "-m", "bench.child", module, role, json.dumps(params)],
            cwd=ROOT,
            env=child_env(),
            stdin=subprocess.PIPE,
            stdout=subprocess.PIPE,
            text=True,
            bufsize=1,
            start_new_session=True,  # a Ctrl-C reaches only the parent, which then stops its children in order
        )
        self._inbox: queue.Queue[dict[str, Any] | None] = queue.Queue()
        threading.Thread(target=self._read, name=f"{name}-stdout", daemon=True).start()

    def _read(self) -> None:
        assert self.proc.stdout is not None
        for line in self.proc.stdout:
            if line.startswith(TAG):
                self._inbox.put(json.loads(line[len(TAG) :]))
            else:
                sys.stderr.write(f"[{self.name}] {line}")
        self._inbox.put(None)

    def send(self, **message: Any) -> None:
        assert self.proc.stdin is not None
        try:
            self.proc.stdin.write(json.dumps(message) + "\n")
            self.proc.stdin.flush()
        except (BrokenPipeError, OSError) as exc:
            raise BenchError(f"{self.name} (pid {self.proc.pid}) is gone: {exc}") from None

    def expect(self, kind: str, timeout: float) -> dict[str, Any]:
        """Wait for the child's next message of this kind; raise BenchError on its error, exit or a timeout."""
        deadline = time.monotonic() + timeout
        while True:
            left = deadline - time.monotonic()
            try:
                msg = self._inbox.get(timeout=max(0.0, left))
            except queue.Empty:
                raise BenchError(f"{self.name} sent no {kind!r} within {timeout:.0f} s") from None
            if msg is None:
                raise BenchError(f"{self.name} exited with status {self.proc.wait()} before sending {kind!r}")
            if msg.get("kind") == "error":
                raise BenchError(f"{self.name} failed: {msg.get('error')}\n{msg.get('traceback', '')}")
            if msg.get("kind") == kind:
                return msg


class Processes:
    """Owns every process and cluster of a benchmark; `with Processes() as procs:` stops them all at the end."""

    def __init__(self) -> None:
        self.children: list[Child] = []
        self.clusters: list[Any] = []
        self._stopping: list[threading.Thread] = []

    def child(self, module: str, role: str, params: dict[str, Any] | None = None, name: str = "") -> Child:
        c = Child(module, role, params or {}, name or f"{module}.{role}#{len(self.children)}")
        self.children.append(c)
        return c

    def cluster(self, config: Any, shards: int) -> Any:
        """Start a LocalCluster of shard processes (stopped with the group, or earlier by `stop_soon`)."""
        from paramserver import LocalCluster

        cluster = LocalCluster(config, shards=shards, processes=True)
        self.clusters.append(cluster)
        cluster.start()
        return cluster

    def stop_soon(self, cluster: Any) -> None:
        """Stop a cluster in the background (its shards take ~1 s to drain and exit); `settle` waits for it."""
        t = threading.Thread(target=cluster.stop, name="cluster-stop", daemon=True)
        t.start()
        self._stopping.append(t)

    def settle(self) -> None:
        """Wait until every cluster stopped with `stop_soon` is gone, so nothing stale competes for the cores."""
        for t in self._stopping:
            t.join()
        self._stopping.clear()

    def close_children(self, children: Sequence[Child], timeout: float = 10.0) -> None:
        """Let children finish on their own (stdin closed), then stop what is left."""
        for c in children:
            if c.proc.stdin is not None and not c.proc.stdin.closed:
                try:
                    c.proc.stdin.close()
                except OSError:
                    pass
        deadline = time.monotonic() + timeout
        for c in children:
            try:
                c.proc.wait(timeout=max(0.1, deadline - time.monotonic()))
            except subprocess.TimeoutExpired:
                _terminate(c.proc)

    def stop_all(self) -> None:
        for c in self.children:
            if c.proc.poll() is None:
                try:
                    c.proc.send_signal(signal.SIGTERM)
                except ProcessLookupError:
                    pass
        for c in self.children:
            _terminate(c.proc)
            for stream in (c.proc.stdin, c.proc.stdout):
                try:
                    if stream is not None:
                        stream.close()
                except OSError:
                    pass
        self.children.clear()
        for cluster in self.clusters:
            cluster.stop()
        self.clusters.clear()
        self.settle()

    def __enter__(self) -> Processes:
        return self

    def __exit__(self, *exc: object) -> None:
        self.stop_all()


def _terminate(proc: subprocess.Popen[str], timeout: float = 5.0) -> None:
    if proc.poll() is None:
        try:
            proc.send_signal(signal.SIGTERM)
            proc.wait(timeout=timeout)
        except subprocess.TimeoutExpired:
            proc.kill()
        except ProcessLookupError:
            pass
    proc.wait()


# -- processes (child side) -------------------------------------------------------------------------------------


class Channel:
    """A child's end of the JSON-lines conversation with the parent."""

    def __init__(self) -> None:
        self._out = sys.stdout
        self._lock = threading.Lock()

    def send(self, kind: str, **data: Any) -> None:
        with self._lock:
            self._out.write(f"{TAG}{json.dumps({'kind': kind, **data})}\n")
            self._out.flush()

    def recv(self) -> dict[str, Any]:
        """The parent's next message; SystemExit when the parent closed stdin (nothing more to do)."""
        line = sys.stdin.readline()
        if not line:
            raise SystemExit(0)
        return json.loads(line)


def die_with_parent() -> None:
    """Ask Linux to SIGKILL this process when the parent dies, so no child outlives a killed benchmark."""
    parent = int(os.environ.get(PARENT_ENV, "0"))
    procs.die_with_parent(signal.SIGKILL)
    if parent and os.getppid() != parent:  # the parent died before the request took effect
        os._exit(1)


def child_main(roles: dict[str, Callable[[Channel, dict[str, Any]], None]], role: str, params: dict[str, Any]) -> int:
    """Run one role; report an exception to the parent as an 'error' message."""
    die_with_parent()
    chan = Channel()
    try:
        roles[role](chan, params)
    except SystemExit as exc:
        return int(exc.code or 0)
    except BaseException as exc:  # noqa: BLE001 - every failure goes back to the parent, with its traceback
        chan.send("error", error=f"{type(exc).__name__}: {exc}", traceback=traceback.format_exc())
        return 1
    return 0


# -- what a run measures ----------------------------------------------------------------------------------------
