"""A table's initial rows given at Init (make_sparse's converted weights) and a table's rows read back whole
(ExportRows), at the wire: what a shard holds afterwards, what it refuses (INVALID_ARGUMENT, FAILED_PRECONDITION,
RESOURCE_EXHAUSTED, with a message naming the table) leaving it byte-identical and uninitialised, and given rows
surviving a restart from the checkpoint.

Real shards on 127.0.0.1 (threads, so the tests can look inside), reached by raw gRPC messages built from ps_pb2.
"""

from __future__ import annotations

import re
from collections.abc import Callable, Sequence
from pathlib import Path

import grpc
import numpy as np
import pytest

from paramserver.config import ServerConfig
from paramserver.placement import TensorSpec, place
from paramserver.server.cluster import LocalCluster
from paramserver.tables import TableSpec, initial_rows, shard_of, spec_to_proto
from paramserver.v1 import ps_pb2, ps_pb2_grpc

pytestmark = pytest.mark.timeout(60)

CALL_TIMEOUT = 10.0
WORKER = "worker-0"
DIM = 4
SPECS = [TensorSpec("w", (3,))]
TABLES = [TableSpec("item", DIM, num_embeddings=100), TableSpec("user", DIM)]
INV = grpc.StatusCode.INVALID_ARGUMENT
CONFIG = ServerConfig(mode="sync", workers=1, optimizer="adagrad", lr=0.1)


def _rows(table: int, ids: Sequence[int], values: np.ndarray | None = None, **raw: object) -> ps_pb2.InitMessage:
    ids_arr = np.asarray(ids, dtype="<i8")
    vals = np.asarray(values if values is not None else np.outer(ids_arr + 1, np.ones(DIM)), dtype="<f4")
    entry = ps_pb2.Rows(table=table, count=len(ids_arr), ids=ids_arr.tobytes(), values=vals.tobytes())
    for key, value in raw.items():
        setattr(entry, key, value)
    return ps_pb2.InitMessage(rows=entry)


def _stream(shards: int, rows: Sequence[ps_pb2.InitMessage]) -> list[ps_pb2.InitMessage]:
    placement = place(SPECS, shards, tables=TABLES)
    header = ps_pb2.InitHeader(
        worker_id=WORKER,
        specs=[ps_pb2.TensorSpec(name=s.name, shape=s.shape) for s in SPECS],
        num_shards=shards,
        model_digest=placement.digest,
        dtype=ps_pb2.FLOAT32,
        tables=[spec_to_proto(t) for t in TABLES],
    )
    chunks = [
        ps_pb2.InitMessage(chunk=ps_pb2.Chunk(piece=k, offset=0, data=np.full(p.length, 0.5, "<f4").tobytes()))
        for k, p in enumerate(placement.shards[0])
    ]
    return [ps_pb2.InitMessage(header=header), *chunks, *rows]


def _joined(cluster: LocalCluster) -> tuple[grpc.Channel, ps_pb2_grpc.ParameterServerStub]:
    channel = grpc.insecure_channel(cluster.addresses[0])
    stub = ps_pb2_grpc.ParameterServerStub(channel)
    stub.Join(ps_pb2.JoinRequest(worker_id=WORKER), timeout=CALL_TIMEOUT, wait_for_ready=True)
    return channel, stub


def _refused(call: Callable[[], object], code: grpc.StatusCode, pattern: str) -> None:
    with pytest.raises(grpc.RpcError) as info:
        call()
    details = info.value.details() or ""
    assert info.value.code() == code, f"{info.value.code()}: {details}"
    assert re.search(pattern, details), f"{pattern!r} not in {details!r}"


def test_given_rows_are_held_from_the_start_and_the_rest_read_as_their_initial_rule(
    ps_cluster_factory: Callable[..., LocalCluster],
) -> None:
    cluster = ps_cluster_factory(CONFIG, shards=1)
    shard = cluster.shards[0]
    channel, stub = _joined(cluster)
    with channel:
        given = [_rows(0, [3, 1]), _rows(0, [7]), _rows(1, [-5, 2**40])]
        assert stub.Init(iter(_stream(1, given)), timeout=CALL_TIMEOUT).version == 0
    item, user = shard.model.tables.tables
    assert (item.rows, user.rows) == (3, 2)
    assert np.array_equal(item.lookup(np.array([1, 3, 7])), np.outer([2, 4, 8], np.ones(DIM)).astype(np.float32))
    assert np.array_equal(item.lookup(np.array([5])), initial_rows(TABLES[0], np.array([5])))
    state = user.state()
    assert state["ids"].tolist() == [-5, 2**40]
    assert not state["optimizer_state"].any() and not state["versions"].any()


@pytest.mark.parametrize(
    ("rows", "code", "said"),
    [
        ([_rows(0, [1, 2]), _rows(0, [2])], INV, r"'item'.*more than once"),
        ([_rows(0, [100])], INV, r"ID 100 is outside table 'item' \(IDs 0\.\.99\)"),
        ([_rows(0, [-1])], INV, r"ID -1 is outside table 'item'"),
        ([_rows(1, [4], np.array([[1.0, float("nan"), 0.0, 0.0]]))], INV, r"'user': NaN or Inf in initial rows"),
        ([_rows(2, [4])], INV, r"initial rows for table 2, but the model has 2 table"),
        ([_rows(0, [4], count=2)], INV, r"'item'.*8 bytes of IDs.*where 2 rows of dim 4 make 16"),
        ([_rows(0, [4], np.ones((1, DIM + 1)))], INV, r"'item'.*20 of values"),
    ],
    ids=["twice", "past-bound", "negative", "nan", "unknown-table", "count", "width"],
)
def test_bad_given_rows_are_refused_and_leave_the_shard_as_it_was(
    ps_cluster_factory: Callable[..., LocalCluster],
    rows: list[ps_pb2.InitMessage],
    code: grpc.StatusCode,
    said: str,
) -> None:
    cluster = ps_cluster_factory(CONFIG, shards=1)
    shard = cluster.shards[0]
    channel, stub = _joined(cluster)
    with channel:
        before = shard.state_bytes()
        _refused(lambda: stub.Init(iter(_stream(1, rows)), timeout=CALL_TIMEOUT), code, said)
        assert shard.model is None and shard.state_bytes() == before
        # The same stream without its bad rows then initialises the shard.
        assert stub.Init(iter(_stream(1, [])), timeout=CALL_TIMEOUT).version == 0


def test_a_row_of_another_shard_or_past_the_table_memory_limit_is_refused(
    ps_cluster_factory: Callable[..., LocalCluster],
) -> None:
    cluster = ps_cluster_factory(CONFIG.replace(max_table_bytes=4096), shards=2)
    shard = cluster.shards[0]
    ids = np.arange(200)
    theirs = int(ids[shard_of(ids, 2) == 1][0])
    mine = ids[shard_of(ids, 2) == 0]
    channel, stub = _joined(cluster)
    with channel:
        before = shard.state_bytes()
        _refused(
            lambda: stub.Init(iter(_stream(2, [_rows(1, [theirs])])), timeout=CALL_TIMEOUT),
            INV,
            rf"'user': ID {theirs} belongs to shard 1, not 0",
        )
        _refused(
            lambda: stub.Init(iter(_stream(2, [_rows(1, mine)])), timeout=CALL_TIMEOUT),
            grpc.StatusCode.RESOURCE_EXHAUSTED,
            r"over shard 0's limit of 4096 \(--max-table-bytes\)",
        )
        assert shard.model is None and shard.state_bytes() == before


def _export(stub: ps_pb2_grpc.ParameterServerStub, digest: str, table: int, state: bool = False) -> list:
    req = ps_pb2.ExportRowsRequest(model_digest=digest, table=table, optimizer_state=state)
    return list(stub.ExportRows(req, timeout=CALL_TIMEOUT))


def test_export_rows_sends_a_table_whole_in_id_order_and_refuses_what_it_cannot(
    ps_cluster_factory: Callable[..., LocalCluster],
) -> None:
    cluster = ps_cluster_factory(CONFIG, shards=1)
    shard = cluster.shards[0]
    digest = place(SPECS, 1, tables=TABLES).digest
    channel, stub = _joined(cluster)
    with channel:
        _refused(lambda: _export(stub, digest, 0), grpc.StatusCode.FAILED_PRECONDITION, "holds no model")
        ids = np.arange(0, 100, 3)[::-1]
        stub.Init(iter(_stream(1, [_rows(0, ids)])), timeout=CALL_TIMEOUT)
        before = shard.state_bytes()
        messages = _export(stub, digest, 0, state=True)
        head = messages[0].header
        assert (head.count, head.dim, head.state_cols, head.version) == (len(ids), DIM, DIM, 0)
        got = np.concatenate([np.frombuffer(m.rows.ids, "<i8") for m in messages[1:]])
        values = np.concatenate([np.frombuffer(m.rows.values, "<f4") for m in messages[1:]]).reshape(-1, DIM)
        assert got.tolist() == sorted(ids.tolist())
        assert np.array_equal(values, np.outer(got + 1, np.ones(DIM)))
        assert [m.header.count for m in _export(stub, digest, 1)] == [0]
        _refused(lambda: _export(stub, digest, 2), INV, r"table 2 asked for, but the model has 2 table")
        _refused(lambda: _export(stub, "0" * 64, 0), grpc.StatusCode.FAILED_PRECONDITION, "model 000000000000")
        assert shard.state_bytes() == before


def test_given_rows_come_back_after_a_restart_from_the_checkpoint(
    ps_cluster_factory: Callable[..., LocalCluster], tmp_path: Path
) -> None:
    config = CONFIG.replace(checkpoint_dir=str(tmp_path), checkpoint_every="1")
    first = ps_cluster_factory(config, shards=1)
    channel, stub = _joined(first)
    with channel:
        stub.Init(iter(_stream(1, [_rows(0, [4, 9]), _rows(1, [-3])])), timeout=CALL_TIMEOUT)
    held = [t.state() for t in first.shards[0].model.tables.tables]
    first.stop()
    second = ps_cluster_factory(config, shards=1)
    for before, after in zip(held, (t.state() for t in second.shards[0].model.tables.tables), strict=True):
        for key in ("ids", "values", "optimizer_state", "versions"):  # last-update times move with the clock
            assert np.array_equal(before[key], after[key]), key
    assert np.array_equal(
        second.shards[0].model.tables.tables[0].lookup(np.array([4, 9])), np.outer([5, 10], np.ones(DIM))
    )
