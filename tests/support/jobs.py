"""Jobs for end-to-end tests: ps-server as a subprocess, its shards' versions, workers run in threads."""

from __future__ import annotations

import signal
import subprocess
import sys
import threading
from collections.abc import Callable

import grpc
import torch

from paramserver.v1 import ps_pb2, ps_pb2_grpc
from worker import PSClient


def in_threads(fns: list[Callable[[], None]], timeout: float = 60.0) -> None:
    """Run each function in a thread of its own; fail if one hangs past `timeout`, raise the first one's error."""
    errors: list[BaseException] = []

    def run(fn: Callable[[], None]) -> None:
        try:
            fn()
        except BaseException as exc:  # noqa: BLE001 - reported below
            errors.append(exc)

    threads = [threading.Thread(target=run, args=(fn,)) for fn in fns]
    for t in threads:
        t.start()
    for t in threads:
        t.join(timeout)
        assert not t.is_alive(), "a worker thread hung"
    if errors:
        raise errors[0]


def start_ps_server(*args: str) -> tuple[subprocess.Popen[str], str]:
    """Start `ps-server --port 0 ARGS`; return it and the address it prints for workers, once every shard serves."""
    proc = subprocess.Popen(
        [sys.executable, "-m", "paramserver.server.cli", "--port", "0", "--log-level", "WARNING", *args],
        stdout=subprocess.PIPE,
        text=True,
    )
    assert proc.stdout is not None
    for line in proc.stdout:
        if line.startswith("workers: ps-worker --server "):
            return proc, line.split()[-1]
    raise AssertionError(f"ps-server exited with {proc.wait()} before printing its address")


def stop_job(server: subprocess.Popen[str], workers: list[subprocess.Popen[bytes]]) -> None:
    """Kill the workers still running, then stop ps-server, which must exit 0."""
    for w in workers:
        if w.poll() is None:
            w.kill()
            w.wait()
    server.send_signal(signal.SIGTERM)
    assert server.wait(timeout=30) == 0


def shard_versions(address: str) -> list[int]:
    """Every shard's version, as its Topology says (asked of each shard directly)."""
    with PSClient(address, join=False) as reader:
        shards = list(reader.addresses)
    versions = []
    for shard in shards:
        with grpc.insecure_channel(shard) as channel:
            topology = ps_pb2_grpc.ParameterServerStub(channel).GetTopology(ps_pb2.GetTopologyRequest(), timeout=30)
            versions.append(int(topology.version))
    return versions


def push_each(address: str, model: dict[str, torch.Tensor], grads: list[dict[str, torch.Tensor]]) -> list[int]:
    """Register `model` (or adopt the servers'), push each gradient and pull after it; return the versions."""
    with PSClient(address) as client:
        client.register(model)
        for g in grads:
            client.push(g)
            client.pull(model)
        return list(client.versions)
