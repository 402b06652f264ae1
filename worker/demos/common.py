"""What the demos share: the real commands started as subprocesses, the address ps-server prints, the workers'
metrics files, and stopping every process on the way out."""

from __future__ import annotations

import json
import signal
import subprocess
import sys
import threading
from collections.abc import Sequence
from pathlib import Path
from typing import IO, Any

WORKERS_LINE = "workers: ps-worker --server "  # what ps-server prints once every shard it started serves


def stop(proc: subprocess.Popen[Any], sig: int = signal.SIGTERM, timeout: float = 15.0) -> int:
    """Send `sig` to a process still running, kill it after `timeout` seconds; return its exit status."""
    if proc.poll() is None:
        proc.send_signal(sig)
        try:
            proc.wait(timeout=timeout)
        except subprocess.TimeoutExpired:
            proc.kill()
    return proc.wait()


def start_server(server_args: Sequence[str]) -> subprocess.Popen[str]:
    """Print the ps-server command line as a user would type it, and start it with its output piped."""
    print(f"$ ps-server {' '.join(server_args)}", flush=True)
    command = [sys.executable, "-m", "paramserver.server.cli", *server_args, "--log-level", "WARNING"]
    return subprocess.Popen(command, stdout=subprocess.PIPE, text=True, bufsize=1)


def address_of(server: subprocess.Popen[str], timeout: float = 120.0) -> str:
    """The address ps-server prints once all its shards serve: the demo's own server, never one that happened
    to answer on the port. Its other output is passed through, then and afterwards."""
    if server.stdout is None:
        raise ValueError("ps-server was started without stdout=PIPE")
    stdout = server.stdout
    found: list[str] = []
    ready = threading.Event()

    def relay() -> None:
        for line in stdout:
            if line.startswith(WORKERS_LINE) and not found:
                found.append(line[len(WORKERS_LINE) :].strip())
                ready.set()
            sys.stdout.write(line)
            sys.stdout.flush()
        ready.set()  # ps-server exited (it said why on stderr)

    threading.Thread(target=relay, name="ps-server-output", daemon=True).start()
    if not ready.wait(timeout):
        raise TimeoutError(f"ps-server did not serve within {timeout:.0f} s")
    if not found:
        raise RuntimeError(f"ps-server exited with status {server.wait()} before serving (see above)")
    return found[0]


def start_workers(
    address: str, worker_args: Sequence[str], count: int, metrics_dir: Path, stdout: IO[Any] | int | None = None
) -> list[subprocess.Popen[bytes]]:
    """Start `count` ps-worker processes against `address`, each writing its metrics under `metrics_dir`."""
    # One --metrics-out for all: each rank writes worker-RANK.json (a single worker: worker.json).
    out = ["--metrics-out", str(metrics_dir / "worker.json")]
    command = [sys.executable, "-m", "worker.cli", "--server", address, *worker_args, *out]
    return [subprocess.Popen(command, stdout=stdout) for _ in range(count)]


def worker_metrics(metrics_dir: Path, count: int) -> list[dict[str, Any]]:
    """The metrics every worker of start_workers wrote, by rank."""
    names = ["worker.json"] if count == 1 else [f"worker-{rank}.json" for rank in range(count)]
    return [json.loads((metrics_dir / name).read_text()) for name in names]
