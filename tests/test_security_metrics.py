"""TLS, mutual TLS and the bearer token against real shards; Prometheus metrics; the job ending by itself."""

from __future__ import annotations

import subprocess
import sys
import urllib.request

import grpc
import pytest
import torch
from grpc_health.v1 import health_pb2, health_pb2_grpc

from paramserver import LocalCluster, ServerConfig
from paramserver.errors import PSError, Unauthenticated
from worker import PSClient

pytestmark = pytest.mark.timeout(120)


def _train_one_step(client: PSClient) -> torch.Tensor:
    model = {"w": torch.ones(4)}
    client.register(model)
    client.push({"w": torch.ones(4)})
    client.pull(model)
    return model["w"]


CONFIG = ServerConfig(mode="sync", workers=1, optimizer="sgd", lr=0.5)


def test_tls_trains_and_a_plaintext_client_cannot_talk(ps_cluster_factory, pki):
    config = CONFIG.replace(tls_cert=pki["server_cert"], tls_key=pki["server_key"])
    cluster = ps_cluster_factory(config, shards=2)
    with PSClient(cluster.address, tls_ca=pki["ca"]) as client:
        torch.testing.assert_close(_train_one_step(client), torch.full((4,), 0.5))
    with pytest.raises(PSError) as info:
        PSClient(cluster.address, connect_timeout=2)
    assert info.value.code in (grpc.StatusCode.UNAVAILABLE, grpc.StatusCode.DEADLINE_EXCEEDED)


def test_mutual_tls_requires_a_client_certificate_from_the_ca(ps_cluster_factory, pki):
    config = CONFIG.replace(tls_cert=pki["server_cert"], tls_key=pki["server_key"], tls_ca=pki["ca"])
    cluster = ps_cluster_factory(config, shards=2)
    with PSClient(cluster.address, tls_ca=pki["ca"], tls_cert=pki["client_cert"], tls_key=pki["client_key"]) as c:
        torch.testing.assert_close(_train_one_step(c), torch.full((4,), 0.5))
    # No client certificate, or one from another CA: the handshake fails, no RPC ever reaches the servicer.
    for cert, key in ((None, None), (pki["stranger_cert"], pki["stranger_key"])):
        with pytest.raises(PSError) as info:
            PSClient(cluster.address, tls_ca=pki["ca"], tls_cert=cert, tls_key=key, connect_timeout=2)
        assert info.value.code in (grpc.StatusCode.UNAVAILABLE, grpc.StatusCode.DEADLINE_EXCEEDED)
    assert all(s.describe().version == 1 for s in cluster.shards)


def test_bearer_token_is_required_except_for_health_checks(ps_cluster_factory, tmp_path):
    token_file = tmp_path / "token"
    token_file.write_text("s3cret-token\n")
    cluster = ps_cluster_factory(CONFIG.replace(auth_token_file=str(token_file)), shards=2)
    with PSClient(cluster.address, auth_token="s3cret-token") as client:
        torch.testing.assert_close(_train_one_step(client), torch.full((4,), 0.5))
    for token in (None, "wrong-token"):
        with pytest.raises(Unauthenticated, match="bearer token"):
            PSClient(cluster.address, auth_token=token, connect_timeout=5)
    with grpc.insecure_channel(cluster.address) as channel:
        reply = health_pb2_grpc.HealthStub(channel).Check(health_pb2.HealthCheckRequest(), timeout=5)
    assert reply.status == health_pb2.HealthCheckResponse.SERVING


def test_token_never_appears_in_the_logs(tmp_path):
    token_file = tmp_path / "token"
    token_file.write_text("do-not-log-me")
    config = CONFIG.replace(auth_token_file=str(token_file))
    script = (
        "import logging, sys\n"
        "logging.basicConfig(level=logging.DEBUG, stream=sys.stderr)\n"
        "from paramserver import LocalCluster\n"
        "from paramserver.config import ServerConfig\n"
        "from worker import PSClient\n"
        "from paramserver.errors import Unauthenticated\n"
        f"config = ServerConfig(**{config.__dict__!r})\n"
        "with LocalCluster(config, shards=1) as c:\n"
        "    try:\n"
        "        PSClient(c.address, auth_token='wrong', connect_timeout=5)\n"
        "    except Unauthenticated as exc:\n"
        "        print('refused', exc)\n"
        "    with PSClient(c.address, auth_token='do-not-log-me') as ok:\n"
        "        print('rank', ok.rank)\n"
    )
    result = subprocess.run([sys.executable, "-c", script], capture_output=True, text=True, timeout=90)
    assert result.returncode == 0, result.stderr
    assert "refused" in result.stdout and "rank 0" in result.stdout
    assert "do-not-log-me" not in result.stdout + result.stderr


def _scrape(port: int) -> str:
    with urllib.request.urlopen(f"http://127.0.0.1:{port}/metrics", timeout=5) as reply:
        return reply.read().decode()


def _value(text: str, name: str, **labels: str) -> float:
    want = ",".join(f'{k}="{v}"' for k, v in labels.items())
    for line in text.splitlines():
        if line.startswith(name + "{") and all(part in line for part in want.split(",")):
            return float(line.rsplit(" ", 1)[1])
        if line.startswith(name + " ") and not labels:
            return float(line.rsplit(" ", 1)[1])
    raise AssertionError(f"{name}{{{want}}} not in the metrics")


def test_prometheus_metrics_count_what_happened(ps_cluster_factory):
    config = ServerConfig(mode="sync", workers=2, optimizer="sgd", lr=1.0, metrics_port=0)
    cluster = ps_cluster_factory(config, shards=1)
    port = cluster.servers[0].metrics_port
    assert port
    a, b = PSClient(cluster.address), PSClient(cluster.address)
    try:
        model = {"w": torch.zeros(3)}
        a.register(model)
        b.register({"w": torch.zeros(3)})
        a.push({"w": torch.ones(3)})
        b.push({"w": torch.ones(3)})  # b arrives last: the straggler of round 0
        a.pull(model)
        with pytest.raises(PSError):
            a.push({"w": torch.tensor([float("nan"), 0.0, 0.0])})
        text = _scrape(port)
    finally:
        a.close()
        b.close()
    assert _value(text, "paramserver_pushes_total", shard="0", result="applied") == 2
    assert _value(text, "paramserver_version", shard="0") == 1
    assert _value(text, "paramserver_live_workers", shard="0") == 2
    assert _value(text, "paramserver_rejected_total", shard="0", reason="NonFiniteGradient") == 1
    assert _value(text, "paramserver_straggler_rounds_total", shard="0", rank=str(b.rank)) == 1
    assert _value(text, "paramserver_last_straggler_rank", shard="0") == b.rank
    assert _value(text, "paramserver_round_wait_seconds_count", shard="0") == 1
    assert _value(text, "paramserver_apply_seconds_count", shard="0") == 1
    assert _value(text, "paramserver_received_bytes_total", shard="0") >= 2 * 12
    assert _value(text, "paramserver_sent_bytes_total", shard="0") >= 12


def test_shards_with_exit_when_done_stop_once_every_worker_finished(tmp_path):
    config = ServerConfig(
        mode="sync", workers=2, exit_when_done=True, checkpoint_dir=str(tmp_path / "ckpt"), checkpoint_every="0"
    )
    cluster = LocalCluster(config, shards=2, processes=True)
    with cluster:
        workers = [
            subprocess.Popen(
                [
                    sys.executable,
                    "-m",
                    "worker.cli",
                    "--server",
                    cluster.address,
                    "--no-progress",
                    "--model",
                    "mlp",
                    "--steps",
                    "15",
                ],
                stdout=subprocess.DEVNULL,
            )
            for _ in range(2)
        ]
        try:
            assert [w.wait(timeout=120) for w in workers] == [0, 0]
            # No signal sent: the shards see both workers finish and leave, checkpoint and exit 0 on their own.
            assert [p.wait(timeout=30) for p in cluster.procs] == [0, 0]
        finally:
            for w in workers:
                if w.poll() is None:
                    w.kill()
                    w.wait()
    names = sorted(p.name for p in (tmp_path / "ckpt").iterdir())
    # The Init's checkpoint and the final one; the write-ahead log holds nothing after the final one.
    assert names == [f"shard-00{i}-v0000000000{v:02d}.ckpt" for i in (0, 1) for v in (0, 15)]


def test_a_crashed_worker_does_not_end_the_job(ps_cluster_factory):
    cluster = ps_cluster_factory(ServerConfig(mode="async", workers=1, exit_when_done=True), shards=1)
    client = PSClient(cluster.address)
    client.register({"w": torch.zeros(2)})
    client.close()  # left without finishing (interrupted): the job is not done
    assert not cluster.shards[0].done.is_set()
    with PSClient(cluster.address) as again:
        again.leave(finished=True)
    assert cluster.shards[0].done.is_set()
