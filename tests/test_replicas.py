"""Hot standby (--replicas 2): each shard's two copies, their roles in a real etcd, real processes killed.

Exact arithmetic as in test_durability: SGD with lr 1 and every gradient -1, so each applied push adds exactly +1
to every weight; after any failure, every weight must have moved by exactly the number of acknowledged pushes.
"""

from __future__ import annotations

import signal
import threading
from collections.abc import Callable
from pathlib import Path

import grpc
import pytest
import torch
from support.waiting import wait_for

from paramserver.config import ServerConfig
from paramserver.coord import Etcd, PartConfig, PartRegister
from paramserver.server.cluster import LocalCluster
from paramserver.server.replica import DEPOSED_EXIT
from paramserver.v1 import ps_pb2, ps_pb2_grpc
from worker import PSClient

pytestmark = pytest.mark.timeout(180)


def _register(url: str, shard: int) -> PartRegister:
    return PartRegister(Etcd(url), ServerConfig().job_name, shard)


def _push(client: PSClient, model: torch.nn.Module) -> None:
    for p in model.parameters():
        p.grad = torch.full_like(p, -1.0)
    client.push_pull(model)


def _moved_exactly(client: PSClient, model: torch.nn.Module, start: list[torch.Tensor], pushes: int) -> None:
    client.pull(model)
    for p, p0 in zip(model.parameters(), start, strict=True):
        moved = p.detach() - p0
        assert torch.allclose(moved, torch.full_like(moved, float(pushes)), atol=1e-3), (
            f"{pushes} acknowledged pushes, but the weights moved by {float(moved.min())}..{float(moved.max())}"
        )


def _exact_config(url: str, mode: str) -> ServerConfig:
    return ServerConfig(mode=mode, workers=1, optimizer="sgd", lr=1.0, replicas=2, coordinator=url)


def test_replicas_need_a_coordinator() -> None:
    with pytest.raises(ValueError, match="--coordinator"):
        ServerConfig(replicas=2)
    with pytest.raises(ValueError, match="1 or 2"):
        ServerConfig(replicas=3, coordinator="http://127.0.0.1:2379")
    with pytest.raises(ValueError, match="http://"):
        Etcd("127.0.0.1:2379")


def test_the_configuration_changes_only_by_compare_and_swap(ps_etcd: str) -> None:
    register = _register(ps_etcd, 0)
    assert register.read() is None
    first = register.swap(None, PartConfig(epoch=1, primary=0, in_sync=(0,), links={0: "a:1"}))
    assert first is not None and first.revision > 0
    assert register.swap(None, PartConfig(epoch=1, primary=1, in_sync=(1,))) is None, "created twice"
    taken = register.swap(first, first.but(epoch=2, primary=1, in_sync=(1,)))
    assert taken is not None
    assert register.swap(first, first.but(in_sync=(0, 1))) is None, "a change from a stale read landed"
    assert register.read() == taken


def test_both_copies_hold_the_same_state_and_the_backup_refuses_workers(
    ps_etcd: str, ps_cluster_factory: Callable[..., LocalCluster]
) -> None:
    config = ServerConfig(
        mode="async", workers=1, optimizer="adam", lr=0.01, replicas=2, coordinator=ps_etcd,
        lr_schedule="cosine", warmup_versions=3, decay_versions=10,
    )  # fmt: skip
    cluster = ps_cluster_factory(config, 2)
    assert len(cluster.servers) == 4 and len(cluster.addresses) == 4
    model = torch.nn.Sequential(torch.nn.Linear(20, 30), torch.nn.ReLU(), torch.nn.Linear(30, 5))
    with PSClient(cluster.addresses[1]) as client:  # any copy's address finds the job
        client.register(model)
        for shard in range(2):
            cluster.wait_in_sync(shard)
        for _ in range(15):
            loss = model(torch.randn(8, 20)).pow(2).mean()
            model.zero_grad()
            loss.backward()
            client.push_pull(model)
        # A push is acknowledged once both copies hold it; the backup applies what it holds right after it answered.
        for shard in range(2):
            primary, backup = (cluster.shards[2 * shard + copy] for copy in (0, 1))
            wait_for(lambda b=backup, p=primary: b.version >= p.version, 30, "the backup to apply what it holds", 0.01)
            assert primary.version == backup.version == 15
            assert primary.state_bytes() == backup.state_bytes(), "the copies' weights or Adam state differ"
            assert backup.standby and not primary.standby
    backup_address = cluster.addresses[1]
    with grpc.insecure_channel(backup_address) as channel:
        stub = ps_pb2_grpc.ParameterServerStub(channel)
        topo = stub.GetTopology(ps_pb2.GetTopologyRequest(), timeout=10)
        assert list(topo.replicas) == cluster.addresses and list(topo.shards) == cluster.addresses[::2]
        with pytest.raises(grpc.RpcError) as refused:
            stub.Join(ps_pb2.JoinRequest(worker_id="w" * 32), timeout=10)
        assert refused.value.code() == grpc.StatusCode.UNAVAILABLE
        assert "backup" in (refused.value.details() or "")


@pytest.mark.parametrize(("mode", "shared_memory"), [("sync", False)])  # async and shared memory: make stress
def test_a_killed_primary_loses_nothing(
    ps_etcd: str, ps_cluster_factory: Callable[..., LocalCluster], mode: str, shared_memory: bool, tmp_path: Path
) -> None:
    """SIGKILL the primary mid-training: its backup takes over, nothing acknowledged is lost or applied twice,
    and the restarted process catches up as the backup; then the new primary is killed too. Each copy also keeps
    its own log and checkpoints (copy-R under the directory), the backup's starting from the state it took."""
    config = _exact_config(ps_etcd, mode).replace(
        exit_when_done=True, checkpoint_dir=str(tmp_path), checkpoint_every="7", replica_timeout=0.25
    )
    cluster = ps_cluster_factory(config, 1, processes=True)
    model = torch.nn.Linear(64, 32)
    start = [p.detach().clone() for p in model.parameters()]
    pushes = 0
    with PSClient(cluster.address, shared_memory=shared_memory, data_socket=True) as client:
        client.register(model)
        for _kill in range(2):
            primary = cluster.wait_in_sync(0).primary
            for _ in range(10):
                _push(client, model)
                pushes += 1
            cluster.kill(primary)  # its pushes were acknowledged by both copies
            for _ in range(10):
                _push(client, model)
                pushes += 1
            cluster.procs[primary].wait(timeout=10)
            cluster.restart(primary)
            assert _register(ps_etcd, 0).read().primary == 1 - primary  # type: ignore[union-attr]
        _moved_exactly(client, model, start, pushes)
        assert client.versions == [pushes]
        client.leave(finished=True)
    # The job is done: the primary stops, and tells its backup, which stops too instead of taking over.
    assert [p.wait(timeout=30) for p in cluster.procs] == [0, 0]
    # The backup restarted after its job is done (a pod rescheduled late) stops on its own.
    done = _register(ps_etcd, 0).read()
    assert done is not None and done.done
    cluster.restart(1 - done.primary)
    assert cluster.procs[1 - done.primary].wait(timeout=60) == 0
    for copy in (0, 1):
        assert list((tmp_path / f"copy-{copy}").glob("shard-000-v*")), f"copy {copy} wrote no checkpoint"


def test_a_silent_primary_is_deposed_and_exits(ps_etcd: str, ps_cluster_factory: Callable[..., LocalCluster]) -> None:
    """SIGSTOP shard 0's primary (a primary cut off from everything): its backup takes over after
    replica_timeout; once the old primary runs again it finds itself deposed, refuses workers and exits with
    DEPOSED_EXIT, having acknowledged nothing its rival lacks."""
    cluster = ps_cluster_factory(_exact_config(ps_etcd, "async"), 1, processes=True)
    model = torch.nn.Linear(16, 8)
    start = [p.detach().clone() for p in model.parameters()]
    pushes = 0
    with PSClient(cluster.address) as client:
        client.register(model)
        old = cluster.wait_in_sync(0)
        for _ in range(5):
            _push(client, model)
            pushes += 1
        cluster.kill(old.primary, signal.SIGSTOP)
        resume = threading.Timer(1.5, cluster.kill, args=(old.primary, signal.SIGCONT))
        resume.start()
        try:
            for _ in range(20):  # the first waits on the stopped primary until it wakes up deposed
                _push(client, model)
                pushes += 1
        finally:
            resume.join()
        assert cluster.procs[old.primary].wait(timeout=30) == DEPOSED_EXIT
        now = _register(ps_etcd, 0).read()
        assert now is not None and now.primary == 1 - old.primary and now.epoch > old.epoch
        cluster.restart(old.primary)
        cluster.wait_in_sync(0)
        for _ in range(5):
            _push(client, model)
            pushes += 1
        _moved_exactly(client, model, start, pushes)
