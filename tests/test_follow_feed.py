"""The shard's Follow feed shared by several serving copies: the last delta answers every copy it covers, which
then holds exactly the version it was read at, so copies fall into step and a delta is read once for all."""

from __future__ import annotations

from collections.abc import Callable, Iterator

import grpc
import numpy as np
import pytest
import torch
from torch import nn

from paramserver.config import ServerConfig
from paramserver.server import follow as feed
from paramserver.server.cluster import LocalCluster
from paramserver.serving.copy import ShardCopy
from paramserver.tables import spec_from_proto
from paramserver.v1 import ps_pb2, ps_pb2_grpc
from worker import PSClient, SparseEmbedding

pytestmark = pytest.mark.timeout(120)


class Model(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.user = SparseEmbedding(dim=8)
        self.fc = nn.Linear(8, 1)

    def forward(self, user: torch.Tensor) -> torch.Tensor:
        return self.fc(self.user(user)).squeeze(-1)


@pytest.fixture
def job(ps_cluster_factory: Callable[..., LocalCluster]) -> Iterator[tuple[LocalCluster, PSClient, Model]]:
    cluster = ps_cluster_factory(ServerConfig(mode="async", workers=1, optimizer="adagrad", lr=0.1), shards=1)
    torch.manual_seed(0)
    model = Model()
    with PSClient(cluster.address) as client:
        client.register(model)
        yield cluster, client, model


def test_the_last_delta_answers_a_copy_it_covers_and_brings_it_to_its_version(
    job: tuple[LocalCluster, PSClient, Model], monkeypatch: pytest.MonkeyPatch
) -> None:
    cluster, client, model = job
    monkeypatch.setattr(feed, "REUSE_S", 3600.0)  # reuse decided by versions alone here, not by the clock
    g = torch.Generator().manual_seed(1)
    users: list[torch.Tensor] = []

    def steps(n: int) -> None:
        for _ in range(n):
            u = torch.randint(0, 10**9, (32,), generator=g)
            users.append(u)
            model.zero_grad(set_to_none=True)
            (model(u) ** 2).mean().backward()
            client.push_pull(model)

    with grpc.insecure_channel(cluster.address) as channel:
        stub = ps_pb2_grpc.ParameterServerStub(channel)
        tables = [spec_from_proto(t) for t in stub.GetTopology(ps_pb2.GetTopologyRequest()).tables]

        def follow(copy: ShardCopy) -> ps_pb2.FollowMessage.Header:
            digest, since, incarnation, full, _ = copy.position()
            request = ps_pb2.FollowRequest(model_digest=digest, since_version=since, incarnation=incarnation, full=full)
            messages = list(stub.Follow(request, timeout=30))
            copy.take(iter(messages))
            return messages[0].header

        a, b = ShardCopy(0, tables), ShardCopy(0, tables)
        steps(2)
        for _ in range(2):  # a whole state, then the changes since it began
            follow(a)
        steps(1)
        for _ in range(2):
            follow(b)
        assert (a.version, b.version) == (2, 3)
        steps(2)
        assert follow(a).version == 5  # read now: the changes after 2, at 5
        steps(1)
        head = follow(b)  # at 3, covered by the delta 2 -> 5: given it, though 6 is there
        assert (head.version, b.version) == (5, 5) and not head.full
        ids = torch.cat(users).numpy()
        with a.lock, b.lock:
            assert np.array_equal(a.lookup(0, ids), b.lookup(0, ids))
            assert np.array_equal(a.dense(), b.dense())
        assert follow(b).version == 6  # past what the delta covers: read anew
        with torch.no_grad():
            want = model.user(torch.from_numpy(ids)).numpy()
        with b.lock:
            assert np.array_equal(b.lookup(0, ids), want)
        # A copy of another history is never given a delta, whatever is kept.
        other = ps_pb2.FollowRequest(model_digest=a.digest, since_version=3, incarnation="another")
        assert next(iter(stub.Follow(other, timeout=30))).header.full
