"""Serving copies (ps-serve): they follow training, answer reads at one version, refuse writes, and keep serving
across their own SIGKILL, a primary's failover and a shard's restart from its checkpoint."""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import threading
import time
from collections.abc import Callable, Iterator
from pathlib import Path

import grpc
import numpy as np
import pytest
import torch
from torch import nn

from paramserver.config import ServerConfig
from paramserver.server.cluster import LocalCluster
from paramserver.serving.copy import ShardCopy
from paramserver.serving.follower import wait_until
from paramserver.serving.server import serve
from paramserver.tables import shard_of, spec_from_proto
from paramserver.v1 import ps_pb2, ps_pb2_grpc
from worker import PSClient, SparseEmbedding
from worker.client.serving import ServingClient
from worker.client.serving import serve as serve_model

pytestmark = pytest.mark.timeout(180)


class Model(nn.Module):
    """An unbounded table, a bounded one and a dense head."""

    def __init__(self) -> None:
        super().__init__()
        self.fc = nn.Linear(16, 1)
        self.user = SparseEmbedding(dim=8)
        self.item = SparseEmbedding(dim=8, num_embeddings=500, init_scale=0.1)

    def forward(self, user: torch.Tensor, item: torch.Tensor) -> torch.Tensor:
        return self.fc(torch.cat([self.user(user), self.item(item)], 1)).squeeze(-1)


def batch(g: torch.Generator, n: int = 64) -> tuple[torch.Tensor, torch.Tensor]:
    return torch.randint(0, 10**12, (n,), generator=g), torch.randint(0, 500, (n,), generator=g)


def step(client: PSClient, model: Model, g: torch.Generator) -> tuple[torch.Tensor, torch.Tensor]:
    user, item = batch(g)
    model.zero_grad(set_to_none=True)
    (model(user, item) ** 2).mean().backward()
    client.push_pull(model)
    return user, item


def trained_rows(model: Model, user: torch.Tensor, item: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """The rows the training shards hold now (a lookup through the trainer's client)."""
    with torch.no_grad():
        return model.user(user).clone(), model.item(item).clone()


def same_as_training(served: ServingClient, model: Model, seen: list[tuple[torch.Tensor, torch.Tensor]]) -> None:
    """Every row the training touched and the dense head are served exactly as the shards hold them."""
    users = torch.cat([u for u, _ in seen])
    items = torch.cat([i for _, i in seen])
    want_user, want_item = trained_rows(model, users, items)
    assert torch.equal(served.lookup(model, "user", users), want_user)
    assert torch.equal(served.lookup(model, model.item, items), want_item)
    copy = Model()
    served.pull(copy)
    assert torch.equal(copy.fc.weight, model.fc.weight) and torch.equal(copy.fc.bias, model.fc.bias)


@pytest.fixture
def job(ps_cluster_factory: Callable[..., LocalCluster]) -> Iterator[tuple[LocalCluster, PSClient, Model]]:
    cluster = ps_cluster_factory(ServerConfig(mode="async", workers=1, optimizer="adagrad", lr=0.1), shards=2)
    torch.manual_seed(0)
    model = Model()
    with PSClient(cluster.address) as client:
        client.register(model)
        yield cluster, client, model


@pytest.fixture
def copies(job: tuple[LocalCluster, PSClient, Model]) -> Iterator[tuple[str, object]]:
    server, held, port = serve(job[0].address)
    try:
        yield f"127.0.0.1:{port}", held
    finally:
        held.stop()
        server.stop(0)


def caught_up(served: ServingClient, client: PSClient) -> bool:
    status = served.status()
    return status.ready and list(status.versions) == list(client.versions)


def test_a_serving_copy_follows_training_and_answers_at_one_version(
    job: tuple[LocalCluster, PSClient, Model], copies: tuple[str, object]
) -> None:
    _, client, model = job
    g = torch.Generator().manual_seed(1)
    seen = [step(client, model, g) for _ in range(5)]
    with ServingClient(copies[0]) as served:
        assert wait_until(lambda: caught_up(served, client), 30)
        same_as_training(served, model, seen)
        seen += [step(client, model, g) for _ in range(20)]
        assert wait_until(lambda: caught_up(served, client), 30)
        same_as_training(served, model, seen)
        # An ID no update touched reads as its initial row, as on the shards.
        fresh = torch.tensor([123456789012345])
        assert torch.equal(served.lookup(model, "user", fresh), trained_rows(model, fresh, torch.tensor([0]))[0])


def test_a_model_served_through_serve_predicts_as_the_trained_one(
    job: tuple[LocalCluster, PSClient, Model], copies: tuple[str, object]
) -> None:
    _, client, model = job
    g = torch.Generator().manual_seed(2)
    seen = [step(client, model, g) for _ in range(10)]
    with ServingClient(copies[0]) as served:
        assert wait_until(lambda: caught_up(served, client), 30)
        inference = serve_model(Model(), served)
        asked: list[list[str]] = []
        lookup_many = served.lookup_many
        served.lookup_many = lambda tables: asked.append(sorted(tables)) or lookup_many(tables)  # type: ignore[method-assign]
        with torch.no_grad():
            for user, item in seen[-3:]:
                assert torch.equal(inference(user, item), model(user, item))
            # Both tables' rows in one request a forward pass; none for rows the caches hold at this version.
            assert asked == [["item", "user"]] * 3
            assert torch.equal(inference(*seen[-1]), model(*seen[-1])) and len(asked) == 3


def test_writes_are_refused_and_change_nothing(
    job: tuple[LocalCluster, PSClient, Model], copies: tuple[str, object]
) -> None:
    _, client, model = job
    step(client, model, torch.Generator().manual_seed(3))
    with ServingClient(copies[0]) as served, grpc.insecure_channel(copies[0]) as channel:
        assert wait_until(lambda: caught_up(served, client), 30)
        before = served.status().versions, served.lookup(model, "item", torch.arange(500))
        stub = ps_pb2_grpc.ParameterServerStub(channel)
        for call in (
            lambda: stub.Join(ps_pb2.JoinRequest(worker_id="w")),
            lambda: stub.Exchange(ps_pb2.ExchangeRequest(worker_id="w", push=True)),
            lambda: stub.Init(iter([ps_pb2.InitMessage()])),
            lambda: stub.Push(iter([ps_pb2.PushMessage()])),
            lambda: stub.Attach(ps_pb2.AttachRequest()),
        ):
            with pytest.raises(grpc.RpcError) as err:
                call()
            assert err.value.code() == grpc.StatusCode.FAILED_PRECONDITION
            assert "serving copy" in err.value.details()
        topology = stub.GetTopology(ps_pb2.GetTopologyRequest())
        assert list(topology.shards) == [copies[0], copies[0]]  # a worker sent here is refused, not sent on
        assert served.status().versions == before[0]
        assert torch.equal(served.lookup(model, "item", torch.arange(500)), before[1])
        with pytest.raises(Exception, match="no table named 'nope'"):
            served.lookup(model, "nope", torch.arange(3))


def test_a_copy_past_the_shards_record_of_changes_catches_up_from_the_rows_versions(
    job: tuple[LocalCluster, PSClient, Model],
) -> None:
    """A copy that fell behind further than the shard's record of written rows reaches (a few IDs here) is answered
    from the rows' own last-update versions, and ends exactly as the shard."""
    cluster, client, model = job
    for shard in cluster.shards:
        shard.publication.limit_bytes = 64
    g = torch.Generator().manual_seed(4)
    seen = [step(client, model, g) for _ in range(3)]
    channels = [grpc.insecure_channel(a) for a in cluster.addresses]
    try:
        stubs = [ps_pb2_grpc.ParameterServerStub(c) for c in channels]
        topology = stubs[0].GetTopology(ps_pb2.GetTopologyRequest())
        held = [ShardCopy(i, [spec_from_proto(t) for t in topology.tables]) for i in range(2)]

        def follow(copy: ShardCopy) -> None:
            digest, since, incarnation, full, _ = copy.position()
            request = ps_pb2.FollowRequest(model_digest=digest, since_version=since, incarnation=incarnation, full=full)
            copy.take(stubs[copy.index].Follow(request, timeout=30))

        for copy in held:
            follow(copy)  # a whole state
            follow(copy)  # the changes since it started: whole
            assert copy.ready and copy.version == 3
        seen += [step(client, model, g) for _ in range(15)]
        assert all(shard.publication.floor > 3 for shard in cluster.shards)
        for copy in held:
            follow(copy)
            assert copy.version == client.versions[copy.index]
        users = torch.cat([u for u, _ in seen]).numpy()
        owner = shard_of(users, 2)
        want = trained_rows(model, torch.from_numpy(users), torch.zeros(len(users), dtype=torch.long))[0].numpy()
        for copy in held:
            mine = np.flatnonzero(owner == copy.index)
            with copy.lock:
                assert np.array_equal(copy.lookup(0, users[mine]), want[mine])
    finally:
        for c in channels:
            c.close()


def _ps_serve(address: str) -> tuple[subprocess.Popen[str], str]:
    proc = subprocess.Popen(
        [sys.executable, "-m", "paramserver.serving.cli", "--server", address, "--port", "0"],
        stdout=subprocess.PIPE,
        text=True,
    )
    assert proc.stdout is not None
    for line in proc.stdout:
        if line.startswith("PS-SERVE-READY"):
            return proc, f"127.0.0.1:{line.split()[1]}"
    raise AssertionError(f"ps-serve exited with {proc.wait()} before it was ready")


def _stop(proc: subprocess.Popen[str]) -> None:
    if proc.poll() is None:
        proc.terminate()
        try:
            proc.wait(timeout=10)
        except subprocess.TimeoutExpired:
            proc.kill()
            proc.wait()


def test_ps_serve_killed_and_started_again_serves_the_trained_rows(job: tuple[LocalCluster, PSClient, Model]) -> None:
    cluster, client, model = job
    g = torch.Generator().manual_seed(5)
    seen = [step(client, model, g) for _ in range(5)]
    proc, address = _ps_serve(cluster.address)
    try:
        os.kill(proc.pid, signal.SIGKILL)
        proc.wait(timeout=10)
        seen += [step(client, model, g) for _ in range(5)]
        proc, address = _ps_serve(cluster.address)
        with ServingClient(address) as served:
            assert wait_until(lambda: caught_up(served, client), 30)
            same_as_training(served, model, seen)
    finally:
        _stop(proc)


def _trainer(address: str, steps: int, seed: int, out: list[object], **kwargs: object) -> None:
    try:
        torch.manual_seed(0)
        model = Model()
        g = torch.Generator().manual_seed(seed)
        with PSClient(address, **kwargs) as client:  # type: ignore[arg-type]
            client.register(model)
            seen = [step(client, model, g) for _ in range(steps)]
            out.append((client.versions, seen))
    except BaseException as exc:  # noqa: BLE001 - the test reports it
        out.append(exc)


def test_a_copy_follows_a_failover_and_a_restart_from_checkpoint(
    ps_etcd: str, ps_cluster_factory: Callable[..., LocalCluster], tmp_path: Path
) -> None:
    """--replicas 2: the primary is SIGKILLed while training goes on; the copy follows the new primary. Then both
    copies of the shard restart from their checkpoints and logs (a durable shard: the copy's versions stay valid)."""
    config = ServerConfig(
        mode="async", workers=1, optimizer="adagrad", lr=0.1, replicas=2, coordinator=ps_etcd, replica_timeout=0.25
    ).replace(checkpoint_dir=str(tmp_path), checkpoint_every="5")
    cluster = ps_cluster_factory(config, 1, processes=True)
    torch.manual_seed(0)
    model = Model()
    g = torch.Generator().manual_seed(6)
    with PSClient(cluster.address) as client:
        client.register(model)
        seen = [step(client, model, g) for _ in range(5)]
        proc, address = _ps_serve(cluster.address)
        try:
            with ServingClient(address) as served:
                assert wait_until(lambda: caught_up(served, client), 30)
                primary = cluster.wait_in_sync(0).primary
                cluster.kill(primary)
                seen += [step(client, model, g) for _ in range(10)]  # on the new primary
                assert wait_until(lambda: caught_up(served, client), 30), (served.status(), client.versions)
                same_as_training(served, model, seen)
                cluster.procs[primary].wait(timeout=10)
                cluster.restart(primary)
                cluster.wait_in_sync(0)
                seen += [step(client, model, g) for _ in range(5)]
                assert wait_until(lambda: caught_up(served, client), 30), (served.status(), client.versions)
                same_as_training(served, model, seen)
        finally:
            _stop(proc)


@pytest.mark.parametrize("durable", [False, True], ids=["no-log", "checkpoint-and-log"])
def test_a_copy_keeps_serving_across_a_shard_restart(
    ps_cluster_factory: Callable[..., LocalCluster], tmp_path: Path, durable: bool
) -> None:
    """A shard process SIGKILLed and started again. With a checkpoint directory it resumes its history (its log)
    and the copy goes on with the changes since its version; without, it starts another history (a new incarnation
    at version 0) and the copy takes its whole state again instead of mixing the two."""
    # Two places: without a log the old worker joins the restarted shard again beside the new one (async: no round
    # waits for either).
    config = ServerConfig(mode="async", workers=2, optimizer="adagrad", lr=0.1)
    if durable:
        config = config.replace(checkpoint_dir=str(tmp_path), checkpoint_every="5")
    cluster = ps_cluster_factory(config, 1, processes=True)
    torch.manual_seed(0)
    model = Model()
    g = torch.Generator().manual_seed(7)
    with PSClient(cluster.address) as client:
        client.register(model)
        seen = [step(client, model, g) for _ in range(8)]
        proc, address = _ps_serve(cluster.address)
        try:
            with ServingClient(address) as served, ServingClient(address) as reader:
                assert wait_until(lambda: caught_up(served, client), 30)
                # Reads go on while the shard is down and while the copy takes its state again: it serves the
                # state it held until the new one is whole.
                stop, failed = threading.Event(), []
                answered = threading.Thread(target=_read_until, args=(reader, model, stop, failed))
                answered.start()
                cluster.kill(0)
                cluster.procs[0].wait(timeout=10)
                cluster.restart(0)  # from this thread: the process lives as long as the thread that started it
                # Without a log the job starts over: a new worker registers the model on the empty shard.
                worker = client if durable else PSClient(cluster.address)
                if not durable:
                    worker.register(model)
                seen += [step(worker, model, g) for _ in range(3)]
                assert (worker.versions[0] == 11) if durable else (worker.versions[0] == 3)
                assert wait_until(lambda: caught_up(served, worker), 30), (served.status(), worker.versions)
                stop.set()
                answered.join(timeout=30)
                assert not failed, failed[:3]
                # Rows only the lost history wrote read as the restarted shard reads them (initial rows) too.
                same_as_training(served, model, seen)
        finally:
            _stop(proc)


def _read_until(reader: ServingClient, model: Model, stop: threading.Event, failed: list[BaseException]) -> None:
    while not stop.is_set():
        try:
            reader.lookup(model, "item", torch.arange(20))
        except BaseException as exc:  # noqa: BLE001 - the test reports it
            failed.append(exc)
        time.sleep(0.01)


def test_the_publication_record_is_bounded_and_says_what_it_no_longer_covers() -> None:
    from paramserver.shard.publication import Publication
    from paramserver.shard.sparse.row_blocks import RowBlock
    from paramserver.shard.update import Update

    pub = Publication(tables=2, version=0, limit_bytes=8 * 8)
    pub.applied(Update(1, [], np.empty(0, np.float32), [RowBlock(0, np.array([7]), None)], 0.0))
    assert pub.floor == 1  # nobody asked yet: nothing recorded, answers start after the last version
    assert [a.tolist() for a in pub.written_since(1) or []] == [[], []]  # the first question starts the record
    for v in range(2, 7):
        ids = np.array([v, v + 100], np.int64)
        pub.applied(Update(v, [], np.empty(0, np.float32), [RowBlock(v % 2, ids, None)], 0.0))
    assert pub.floor == 2  # room for 8 IDs: version 2's fell off when version 6's came
    assert pub.written_since(1) is None
    since = pub.written_since(3)
    assert since is not None
    assert since[0].tolist() == [4, 6, 104, 106] and since[1].tolist() == [5, 105]
    assert [a.tolist() for a in pub.written_since(6) or []] == [[], []]


def test_a_copy_of_one_shard_answers_its_ids_and_refuses_the_others(job: tuple[LocalCluster, PSClient, Model]) -> None:
    """ps-serve --shard-index 1 (one pod per shard): it holds shard 1's rows; a lookup of another shard's IDs is
    refused with FAILED_PRECONDITION, and a shard the job lacks is refused at the start."""
    cluster, client, model = job
    g = torch.Generator().manual_seed(8)
    seen = [step(client, model, g) for _ in range(5)]
    users = torch.cat([u for u, _ in seen])
    owner = torch.from_numpy(shard_of(users.numpy(), 2))
    with pytest.raises(Exception, match="no shard 5: the job has 2"):
        serve(cluster.address, shards=[5])
    server, held, port = serve(cluster.address, shards=[1])
    try:
        with ServingClient(f"127.0.0.1:{port}") as served:
            assert wait_until(lambda: served.status().ready and served.status().versions[1] == client.versions[1], 30)
            mine = users[owner == 1]
            assert torch.equal(served.lookup(model, "user", mine), trained_rows(model, mine, mine % 500)[0])
            with pytest.raises(Exception, match=r"holds a copy of shard\(s\) \[0\]") as err:
                served.lookup(model, "user", users[owner == 0][:3])
            assert getattr(err.value, "code", None) == grpc.StatusCode.FAILED_PRECONDITION
    finally:
        held.stop()
        server.stop(0).wait()
