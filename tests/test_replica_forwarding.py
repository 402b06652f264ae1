"""A primary forwards each push to its backup as it arrives (--replicas 2): the backup combines the forwarded
pushes as the round did and ends byte-identical to the primary, over every path a push takes (shared memory, the
data socket in float32 and bf16, compressed, gRPC), with pushes refused midway and with more pushes than the
backup may hold. In-process shard copies (their state read directly), a real etcd, real PSClients in threads."""

from __future__ import annotations

import threading
import time
from collections.abc import Callable
from typing import Any

import numpy as np
import pytest
import torch
from support.waiting import wait_for

from paramserver.config import ServerConfig
from paramserver.errors import InvalidArgument
from paramserver.server.cluster import LocalCluster
from paramserver.shard.state import Shard
from worker import PSClient

pytestmark = pytest.mark.timeout(180)


def _sent(shard: Shard, how: str) -> float:
    value = shard.metrics.registry.get_sample_value(
        "paramserver_replica_backup_updates_total", {"shard": str(shard.index), "how": how}
    )
    return value or 0.0


def _copies(cluster: LocalCluster, shard: int) -> tuple[Shard, Shard]:
    primary = cluster.wait_in_sync(shard).primary
    return cluster.shards[2 * shard + primary], cluster.shards[2 * shard + 1 - primary]


def _same_state(primary: Shard, backup: Shard) -> None:
    wait_for(lambda: backup.version >= primary.version, 20, "the backup to reach the primary's version", 0.01)
    assert backup.version == primary.version
    assert primary.state_bytes() == backup.state_bytes(), "the copies' weights or optimizer state differ"


def _same_dense(primary: Shard, backup: Shard) -> None:
    """The version, the weights and the optimizer's state are byte-identical (the rows aside)."""
    wait_for(lambda: backup.version >= primary.version, 20, "the backup to reach the primary's version", 0.01)
    assert backup.version == primary.version
    assert primary.model is not None and backup.model is not None
    assert primary.model.params.numpy().tobytes() == backup.model.params.numpy().tobytes()
    for a, b in zip(primary.model.optimizer.state.values(), backup.model.optimizer.state.values(), strict=True):
        assert {k: v.numpy().tobytes() for k, v in a.items()} == {k: v.numpy().tobytes() for k, v in b.items()}


def _model() -> torch.nn.Module:
    torch.manual_seed(0)
    return torch.nn.Sequential(torch.nn.Linear(300, 200), torch.nn.ReLU(), torch.nn.Linear(200, 10))


def _train(clients: list[PSClient], models: list[torch.nn.Module], steps: int, seed: int = 1) -> None:
    """Each client pushes its own random gradients for `steps` sync rounds, all at once (threads)."""
    errors: list[BaseException] = []

    def run(k: int) -> None:
        gen = torch.Generator().manual_seed(seed * 100 + k)
        try:
            for _ in range(steps):
                for p in models[k].parameters():
                    p.grad = torch.randn(p.shape, generator=gen)
                clients[k].push_pull(models[k])
        except BaseException as exc:  # raised in the test's thread below
            errors.append(exc)

    threads = [threading.Thread(target=run, args=(k,)) for k in range(len(clients))]
    for t in threads:
        t.start()
    for t in threads:
        t.join(timeout=120)
    assert not errors, errors


PATHS: dict[str, dict[str, Any]] = {
    "shared memory": {},
    "data socket": {"shared_memory": False},
    "data socket bf16": {"shared_memory": False, "dtype": "bf16"},
    "data socket top-k": {"shared_memory": False, "dtype": "bf16", "compress": "topk:0.05:warmup=0"},
    "gRPC": {"shared_memory": False, "data_socket": False},
}


@pytest.mark.parametrize("path", PATHS)
def test_a_backup_of_forwarded_sync_rounds_is_byte_identical(
    ps_etcd: str, ps_cluster_factory: Callable[..., LocalCluster], path: str
) -> None:
    """Two workers, sync, Adam on 2 shards: every round's pushes went to the backup as they arrived and the
    backup combined them itself (no update went whole), ending in the primary's exact state."""
    config = ServerConfig(mode="sync", workers=2, optimizer="adam", lr=0.01, replicas=2, coordinator=ps_etcd)
    cluster = ps_cluster_factory(config, 2)
    models = [_model(), _model()]
    clients = [PSClient(cluster.address, **PATHS[path]) for _ in models]
    try:
        clients[0].register(models[0])
        clients[1].register(models[1])
        copies = [_copies(cluster, s) for s in range(2)]
        _train(clients, models, steps=6)
        for primary, backup in copies:
            _same_state(primary, backup)
            assert primary.version == 6
            assert _sent(primary, "forwarded") == 6 and _sent(primary, "whole") == 0
    finally:
        for c in clients:
            c.close()


def test_a_shard_with_rows_alone_replicates_them(ps_etcd: str, ps_cluster_factory: Callable[..., LocalCluster]) -> None:
    """A model whose dense part (one element) lies on shard 0: shard 1's exchanges carry rows alone, nothing to
    forward, and its updates go whole; both shards' backups end identical to their primaries."""
    from worker import SparseEmbedding

    class Users(torch.nn.Module):
        def __init__(self) -> None:
            super().__init__()
            self.bias = torch.nn.Parameter(torch.zeros(1))
            self.user = SparseEmbedding(dim=4, init="uniform", init_scale=0.1, seed=3)

        def forward(self, ids: torch.Tensor) -> torch.Tensor:
            return self.user(ids).sum(1) + self.bias

    config = ServerConfig(mode="sync", workers=1, optimizer="adam", lr=0.01, replicas=2, coordinator=ps_etcd)
    cluster = ps_cluster_factory(config, 2)
    model = Users()
    with PSClient(cluster.address, shared_memory=False) as client:
        client.register(model)
        copies = [_copies(cluster, s) for s in range(2)]
        for step in range(4):
            model(torch.arange(step * 16, step * 16 + 32)).pow(2).sum().backward()
            client.push_pull(model)
    for primary, backup in copies:
        _same_dense(primary, backup)
        assert primary.version == 4
        for ours, theirs in zip(primary.model.tables.tables, backup.model.tables.tables, strict=True):
            a, b = ours.group.state(ours.tag), theirs.group.state(theirs.tag)
            # Each copy keeps the rows' update times on its own clock (for age-based eviction): all else is equal.
            assert a.keys() == b.keys() and a["ids"].size > 0
            for key in a.keys() - {"times"}:
                np.testing.assert_array_equal(a[key], b[key], err_msg=key)
    assert _sent(copies[0][0], "forwarded") == 4 and _sent(copies[1][0], "whole") == 4


def test_refused_pushes_are_dropped_by_the_backup(
    ps_etcd: str, ps_cluster_factory: Callable[..., LocalCluster]
) -> None:
    """A push refused after it was forwarded (a NaN found as the data socket's bytes were checked, or in a
    shared-memory segment) is dropped on both copies: the backup frees it (later pushes are still forwarded:
    it counted against the pushes it may hold) and applies nothing of it."""
    config = ServerConfig(mode="async", workers=2, optimizer="sgd", lr=0.1, replicas=2, coordinator=ps_etcd)
    cluster = ps_cluster_factory(config, 1)
    models = [_model(), _model()]
    clients = [PSClient(cluster.address, shared_memory=False), PSClient(cluster.address)]
    try:
        clients[0].register(models[0])
        clients[1].register(models[1])
        primary, backup = _copies(cluster, 0)
        for _ in range(3):
            for client, model in zip(clients, models, strict=True):
                for p in model.parameters():
                    p.grad = torch.randn(p.shape)
                next(model.parameters()).grad[-1, -1] = float("nan")  # the last bytes: the rest went out first
                with pytest.raises(InvalidArgument):
                    client.push_pull(model)
        assert primary.version == 0
        _train(clients, models, steps=4)
        _same_state(primary, backup)
        assert primary.version == 8 and _sent(primary, "forwarded") == 8 and _sent(primary, "whole") == 0
    finally:
        for c in clients:
            c.close()


def test_more_pushes_than_the_backup_may_hold_go_whole(
    ps_etcd: str, ps_cluster_factory: Callable[..., LocalCluster]
) -> None:
    """Three workers in sync with two scratch buffers a shard: a round's third push finds two held by the
    backup already, so the round goes whole; the copies still agree, and more buffers forward every round."""
    for buffers, forwarded in ((2, False), (3, True)):
        config = ServerConfig(
            mode="sync", workers=3, optimizer="adam", lr=0.01, replicas=2, coordinator=ps_etcd,
            max_concurrent_pushes=buffers, job_name=f"forwarding-{buffers}",
        )  # fmt: skip
        cluster = ps_cluster_factory(config, 1)
        models = [_model() for _ in range(3)]
        clients = [PSClient(cluster.address, job_name=config.job_name, shared_memory=False) for _ in models]
        try:
            for client, model in zip(clients, models, strict=True):
                client.register(model)
            primary, backup = _copies(cluster, 0)
            _train(clients, models, steps=4)
            _same_state(primary, backup)
            assert (_sent(primary, "forwarded"), _sent(primary, "whole")) == ((4, 0) if forwarded else (0, 4))
        finally:
            for c in clients:
                c.close()


def test_a_backup_that_goes_away_mid_push_leaves_the_primary_serving(
    ps_etcd: str, ps_cluster_factory: Callable[..., LocalCluster]
) -> None:
    """The backup stops while pushes are forwarded to it: the primary goes on alone (out of the in-sync set) and
    every push is answered; nothing waits on the forwards the dead link held."""
    config = ServerConfig(
        mode="async", workers=1, optimizer="sgd", lr=0.1, replicas=2, coordinator=ps_etcd, replica_timeout=0.5
    )
    cluster = ps_cluster_factory(config, 1, processes=True)
    model = _model()
    with PSClient(cluster.address, shared_memory=False) as client:
        client.register(model)
        cfg = cluster.wait_in_sync(0)
        done = threading.Event()

        def kill_soon() -> None:
            time.sleep(0.3)  # a moment into training, wherever the pushes are: the kill is the test's fault
            cluster.kill(1 - cfg.primary)
            done.set()

        killer = threading.Thread(target=kill_soon)
        killer.start()
        pushed = 0
        try:
            while not done.is_set() or pushed < 20:
                for p in model.parameters():
                    p.grad = torch.randn(p.shape)
                client.push_pull(model)
                pushed += 1
        finally:
            killer.join()
        assert client.versions == [pushed]
