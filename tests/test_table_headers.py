"""Tables declared by an InitHeader, checked from the header alone before anything is allocated (issue 36, defects
2 and 3): a bounded table too large for a direct index (paramserver/shard/sparse/tables.py, direct_index) is indexed by
hashing, which grows with the rows held, so a header of a few hundred bytes declaring 2^62 or 2^26 IDs commits no
memory for them, and direct indexes together stay within a quarter of --max-table-bytes.

Real shards on 127.0.0.1 (threads, so the tests can look inside), reached by raw gRPC messages.
"""

from __future__ import annotations

from collections.abc import Callable

import grpc
import numpy as np
import pytest

from paramserver.config import ServerConfig
from paramserver.placement import TensorSpec, place
from paramserver.server.cluster import LocalCluster
from paramserver.shard.sparse.id_hash import DirectIndex, IdHash
from paramserver.shard.sparse.tables import ShardTables
from paramserver.tables import TableSpec, shard_of, spec_to_proto
from paramserver.v1 import ps_pb2, ps_pb2_grpc

pytestmark = pytest.mark.timeout(120)

CALL_TIMEOUT = 30.0
WORKER = "worker-0"
SPECS = [TensorSpec("w", (3,))]


def _init(cluster: LocalCluster, tables: list[TableSpec], shards: int) -> ps_pb2.InitResponse:
    """Init shard 0 of a `shards`-shard model holding these tables (over raw gRPC, as any client would)."""
    placement = place(SPECS, shards, tables=tables)
    header = ps_pb2.InitHeader(
        worker_id=WORKER,
        specs=[ps_pb2.TensorSpec(name=s.name, shape=s.shape) for s in SPECS],
        num_shards=shards,
        model_digest=placement.digest,
        dtype=ps_pb2.FLOAT32,
        tables=[spec_to_proto(t) for t in tables],
    )
    chunks = [
        ps_pb2.InitMessage(chunk=ps_pb2.Chunk(piece=k, offset=0, data=np.full(p.length, 0.5, "<f4").tobytes()))
        for k, p in enumerate(placement.shards[0])
    ]
    with grpc.insecure_channel(cluster.addresses[0]) as channel:
        stub = ps_pb2_grpc.ParameterServerStub(channel)
        stub.Join(ps_pb2.JoinRequest(worker_id=WORKER), timeout=CALL_TIMEOUT, wait_for_ready=True)
        return stub.Init(iter([ps_pb2.InitMessage(header=header), *chunks]), timeout=CALL_TIMEOUT)


def _lookup(cluster: LocalCluster, table: int, ids: np.ndarray) -> np.ndarray:
    shard = cluster.shards[0]
    with grpc.insecure_channel(cluster.addresses[0]) as channel:
        stub = ps_pb2_grpc.ParameterServerStub(channel)
        reply = stub.Exchange(
            ps_pb2.ExchangeRequest(
                worker_id=WORKER,
                model_digest=shard.model.digest,
                inline=True,
                lookup=[ps_pb2.Rows(table=table, count=len(ids), ids=ids.astype("<i8").tobytes())],
            ),
            timeout=CALL_TIMEOUT,
        )
    return np.frombuffer(reply.rows[0].values, "<f4")


@pytest.mark.parametrize("ids", [1 << 62, (1 << 63) - 1])
def test_a_table_of_2_62_ids_is_initialised_with_a_hash_index_not_internal(
    ps_cluster_factory: Callable[..., LocalCluster], ids: int
) -> None:
    """Today's code built a direct index of 2^62 int32 cells and answered INTERNAL (array is too big)."""
    cluster = ps_cluster_factory(ServerConfig(mode="async", workers=1, optimizer="adagrad", lr=0.1), shards=2)
    table = TableSpec("huge", 64, num_embeddings=ids)
    _init(cluster, [table], shards=2)
    tables = cluster.shards[0].model.tables
    assert isinstance(tables.groups[0]._index, IdHash)
    assert tables.groups[0].nbytes < 1 << 20
    mine = np.array([i for i in range(200) if shard_of(np.array([i]), 2)[0] == 0][:3] + [ids - 1], np.int64)
    mine = mine[shard_of(mine, 2) == 0]
    assert len(_lookup(cluster, 0, mine)) == len(mine) * 64  # initial rows, read without holding any


def test_a_table_of_2_26_ids_commits_nothing_past_max_table_bytes(
    ps_cluster_factory: Callable[..., LocalCluster],
) -> None:
    """Today's code committed a 256 MiB direct index for a header of a few hundred bytes, against a 32 MiB cap."""
    config = ServerConfig(mode="async", workers=1, optimizer="adagrad", lr=0.1, max_table_bytes=32 << 20)
    cluster = ps_cluster_factory(config, shards=2)
    _init(cluster, [TableSpec("big", 64, num_embeddings=1 << 26)], shards=2)
    group = cluster.shards[0].model.tables.groups[0]
    assert isinstance(group._index, IdHash)
    assert group.nbytes < 1 << 20


def test_direct_indexes_share_a_quarter_of_max_table_bytes() -> None:
    """Small bounded tables keep their direct index; past the budget the next group hashes. Nothing is allocated
    for a group that hashes."""
    config = ServerConfig(optimizer="sgd", lr=0.1, max_table_bytes=4 << 20)  # 1 MiB for direct indexes
    specs = [
        TableSpec("a", 8, num_embeddings=200_000),  # 800 kB: direct
        TableSpec("b", 16, num_embeddings=200_000),  # another 800 kB: over what is left, hashed
        TableSpec("c", 32, num_embeddings=1000),  # 4 kB: direct
    ]
    tables = ShardTables(specs, 0, 1, config)
    kinds = [type(g._index) for g in tables.groups]
    assert kinds == [DirectIndex, IdHash, DirectIndex]
    assert sum(g.nbytes for g in tables.groups) < 1 << 20
