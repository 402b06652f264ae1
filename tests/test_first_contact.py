"""What a new user meets first: a port that is taken, a server that is not there, --help, Ctrl-C, the demo.

Every case runs the real commands (ps-server, ps-worker, the demo) as a user would, against real servers.
"""

from __future__ import annotations

import re
import signal
import socket
import subprocess
import sys
import time
from collections.abc import Iterator
from pathlib import Path

import grpc
import pytest
from support.waiting import wait_for

from paramserver import LocalCluster, ServerConfig
from paramserver.errors import Unreachable
from paramserver.server.cli import build_parser as server_parser
from paramserver.v1 import ps_pb2, ps_pb2_grpc
from worker import PSClient
from worker.cli import build_parser as worker_parser

ROOT = Path(__file__).resolve().parents[1]


@pytest.fixture
def taken_port() -> Iterator[int]:
    """A port on 127.0.0.1 that something else listens on for the whole test."""
    sock = socket.socket()
    sock.bind(("127.0.0.1", 0))
    sock.listen()
    try:
        yield sock.getsockname()[1]
    finally:
        sock.close()


def _closed_port() -> int:
    """A port nothing listens on (bound once by the OS, then let go)."""
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return int(sock.getsockname()[1])


def _run(*args: str, timeout: float = 120) -> subprocess.CompletedProcess[str]:
    return subprocess.run([sys.executable, *args], capture_output=True, text=True, timeout=timeout, cwd=ROOT)


def _one_clear_line(stderr: str, port: int, flag: str) -> None:
    lines = [line for line in stderr.splitlines() if line.strip()]
    assert "Traceback" not in stderr, stderr
    said = [line for line in lines if line.startswith("ps-server:")]
    assert len(said) == 1, stderr
    assert f":{port}" in said[0] and "in use" in said[0] and flag in said[0], said[0]


@pytest.mark.parametrize("how", [["--shards", "2"], ["--shard-index", "0"]])
def test_ps_server_on_a_taken_port_says_so_in_one_line(taken_port, how):
    extra = ["--peers", f"127.0.0.1:{taken_port}"] if "--shard-index" in how else ["--port", str(taken_port)]
    result = _run("-m", "paramserver.server.cli", *how, *extra)
    assert result.returncode != 0
    _one_clear_line(result.stderr, taken_port, "--port")


def test_the_second_shards_port_taken_names_it(taken_port):
    # --shards 2 --port P takes P and P + 1: here P + 1 is the one in use.
    result = _run("-m", "paramserver.server.cli", "--shards", "2", "--port", str(taken_port - 1))
    assert result.returncode != 0
    _one_clear_line(result.stderr, taken_port, "--port")


@pytest.mark.parametrize("flag", ["--metrics-port", "--data-port"])
def test_a_taken_metrics_or_data_port_names_its_flag(taken_port, flag):
    result = _run("-m", "paramserver.server.cli", "--shards", "1", "--port", "0", flag, str(taken_port))
    assert result.returncode != 0
    _one_clear_line(result.stderr, taken_port, flag)


def test_a_taken_port_fails_a_local_cluster_with_the_reason(taken_port):
    with pytest.raises(OSError, match=rf"127.0.0.1:{taken_port}: the port is in use.*--port"):
        LocalCluster(ServerConfig(), shards=1, port=taken_port).start()


def test_the_demo_never_trains_on_a_server_it_did_not_start():
    config = ServerConfig(mode="sync", workers=1)
    with LocalCluster(config, shards=1, port=0) as foreign:
        port = int(foreign.address.rsplit(":", 1)[1])
        result = _run("-m", "worker.demos.demo", "--port", str(port), "--no-progress")
        assert result.returncode == 1
        assert "in use" in result.stderr and f":{port}" in result.stderr, result.stderr
        assert "Traceback" not in result.stderr
        status = foreign.shards[0].describe()
        assert not status.initialized and status.version == 0, "the demo's workers reached the foreign server"


def test_the_demo_takes_free_ports_by_default(taken_port):
    # Whatever else listens on this host, the demo's own servers (and its HTTP server) get ports of their own. The
    # run streams the digits as shards from that HTTP server: make demo DATA=sharded.
    result = _run(
        "-m", "worker.demos.demo", "--no-progress", "--data", "sharded", "--epochs", "4", "--model", "mlp", timeout=240
    )
    assert "servers stopped with status 0" in result.stdout, result.stdout + result.stderr
    address = re.search(r"workers: ps-worker --server (\S+)", result.stdout)
    assert address and address.group(1) != f"127.0.0.1:{taken_port}"
    served = re.search(r"serving (http://127.0.0.1:(\d+)/manifest.json)", result.stdout)
    assert served and served.group(2) != str(taken_port), result.stdout
    assert "--lr-schedule cosine --warmup-versions" in result.stdout


def test_an_unreachable_server_is_said_at_once_and_each_retry_shown():
    port = _closed_port()
    result = _run("-m", "worker.cli", "--server", f"127.0.0.1:{port}", "--connect-timeout", "6", "--no-progress")
    assert result.returncode == 1
    retries = [line for line in result.stderr.splitlines() if "cannot connect to" in line and "trying again" in line]
    # A refused connection is known at the first try: several tries fit in 6 s (at 0, 1 and 3 s), each with its reason.
    assert len(retries) >= 2, result.stderr
    assert all("connection refused" in line and "giving up in" in line for line in retries), retries
    last = result.stderr.strip().splitlines()[-1]
    assert last.startswith("ps-worker: Unreachable: cannot connect to") and "connection refused" in last, last
    assert "gave up after" in last and "Timeout" not in last


def test_psclient_raises_unreachable_with_the_reason():
    began = time.monotonic()
    with pytest.raises(Unreachable, match="connection refused"):
        PSClient(f"127.0.0.1:{_closed_port()}", connect_timeout=1.5)
    assert time.monotonic() - began < 60  # gives up, however slow the machine: no hang


@pytest.mark.parametrize("parser", [server_parser, worker_parser])
def test_help_gives_the_default_of_every_on_off_flag(parser):
    import argparse

    switches = [a for a in parser()._actions if isinstance(a, argparse.BooleanOptionalAction)]
    assert switches
    for action in switches:
        assert re.search(r"\(default: (on|off)\)", action.help or ""), action.option_strings


def test_one_ctrl_c_is_said_once_per_process():
    server = subprocess.Popen(
        [sys.executable, "-m", "paramserver.server.cli", "--shards", "2", "--port", "0"],
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        text=True,
        cwd=ROOT,
    )
    try:
        assert server.stdout is not None
        assert any(line.startswith("workers: ") for line in server.stdout)
        server.send_signal(signal.SIGINT)
        _, stderr = server.communicate(timeout=60)
    finally:
        if server.poll() is None:
            server.kill()
            server.wait()
    assert server.returncode == 0, stderr
    said = [line.split(": ", 1)[1] for line in stderr.splitlines() if "received SIG" in line]
    assert len(said) == 3, stderr  # ps-server itself, then shard 0 and shard 1, each telling its own
    assert len(set(said)) == 3, said
    assert said[0] == "received SIGINT, stopping"


def test_a_worker_started_while_a_dead_ones_lease_runs_waits_for_its_place(ps_cluster_factory, caplog):
    # A one-worker job whose place is held by a worker that joined and went silent (crashed, or a Join that never
    # came back): a new worker waits, saying why, until the lease runs out, and then takes the place.
    config = ServerConfig(mode="async", workers=1, optimizer="sgd", lr=0.1, lease_timeout=1.0)
    cluster = ps_cluster_factory(config, shards=2)
    for address in cluster.addresses:  # joins, then is never heard of again: no heartbeat, no Leave
        with grpc.insecure_channel(address) as channel:
            ps_pb2_grpc.ParameterServerStub(channel).Join(ps_pb2.JoinRequest(worker_id="gone"), timeout=30)
    with caplog.at_level("WARNING", logger="worker.client"), PSClient(cluster.address) as client:
        assert client.rank == 0
    assert any(
        "already has its 1 workers" in r.getMessage() and "trying again" in r.getMessage() for r in caplog.records
    )


def test_sigterm_stops_a_worker_as_ctrl_c_does_it_leaves_the_job(ps_cluster_factory):
    """A supervisor's stop (a pod deleted, systemd, a benchmark) is SIGTERM: the worker leaves the job at once, as
    on Ctrl-C, instead of being killed mid-step and evicted only when its lease runs out."""
    cluster = ps_cluster_factory(ServerConfig(mode="async", workers=1), shards=1)
    worker = subprocess.Popen(
        [sys.executable, "-m", "worker.cli", "--server", cluster.address, "--epochs", "200", "--no-progress"],
        stderr=subprocess.PIPE,
        text=True,
        cwd=ROOT,
    )
    try:
        shard = cluster.shards[0]

        def trained() -> bool:
            assert worker.poll() is None, "the worker exited before it trained"
            return shard.describe().version >= 3

        wait_for(trained, 120, "the worker to train 3 steps", 0.05)
        worker.send_signal(signal.SIGTERM)
        _, stderr = worker.communicate(timeout=60)
    finally:
        if worker.poll() is None:
            worker.kill()
            worker.wait()
    assert worker.returncode == 130, stderr
    assert "interrupted" in stderr and "Traceback" not in stderr, stderr
    assert shard.describe().live_workers == 0  # it left: no lease to wait out
