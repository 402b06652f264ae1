"""A shard's server-side streams under readers that stop reading (issue 36, defect 1; paramserver/server/streams.py
and paramserver/server/export.py):

- more stalled ExportRows and Pull readers than the gRPC pool has threads: past the caps (per host and in all)
  they are RESOURCE_EXHAUSTED at once, and GetTopology, Heartbeat and an Exchange still answer promptly;
- the stalled exports of one table at one version share one copy of it, not one each;
- a stalled stream is cancelled once its message has waited past its deadline, which frees its slot, its share of
  the copy and its thread; afterwards new streams are served again.

A real shard on 127.0.0.1 (a thread, so the test can look inside and shorten the deadline with monkeypatch), reached
by raw gRPC messages, one channel per reader (as separate clients).
"""

from __future__ import annotations

from collections.abc import Callable, Iterator

import grpc
import numpy as np
import pytest
from support.waiting import wait_for

from paramserver.config import ServerConfig
from paramserver.placement import TensorSpec, place
from paramserver.server import streams
from paramserver.server.cluster import LocalCluster
from paramserver.tables import TableSpec, spec_to_proto
from paramserver.v1 import ps_pb2, ps_pb2_grpc

pytestmark = pytest.mark.timeout(240)

WORKER = "worker-0"
PROMPT = 10.0  # seconds a call on an idle-threaded shard answers in, even on a busy machine
PATIENCE = 60.0
ROWS, DIM = 60_000, 64  # about 16 MiB of rows: far more than HTTP/2 lets a stalled reader's stream buffer
ELEMENTS = 4_000_000  # 16 MB of dense weights: a Pull stream of 16 chunk messages
CONFIG = ServerConfig(mode="async", workers=1, optimizer="adagrad", lr=0.1)
SPECS = [TensorSpec("w", (ELEMENTS,))]
TABLES = [TableSpec("t", DIM)]


def _init(stub: ps_pb2_grpc.ParameterServerStub) -> str:
    placement = place(SPECS, 1, tables=TABLES)
    header = ps_pb2.InitHeader(
        worker_id=WORKER,
        specs=[ps_pb2.TensorSpec(name=s.name, shape=s.shape) for s in SPECS],
        num_shards=1,
        model_digest=placement.digest,
        dtype=ps_pb2.FLOAT32,
        tables=[spec_to_proto(t) for t in TABLES],
    )
    step = 1 << 18  # 1 MiB chunks

    def messages() -> Iterator[ps_pb2.InitMessage]:
        yield ps_pb2.InitMessage(header=header)
        for lo in range(0, ELEMENTS, step):
            data = np.full(min(step, ELEMENTS - lo), 0.5, "<f4").tobytes()
            yield ps_pb2.InitMessage(chunk=ps_pb2.Chunk(piece=0, offset=lo, data=data))
        per = 8000
        for lo in range(0, ROWS, per):
            ids = np.arange(lo, min(ROWS, lo + per), dtype="<i8")
            values = np.ones((len(ids), DIM), "<f4")
            rows = ps_pb2.Rows(table=0, count=len(ids), ids=ids.tobytes(), values=values.tobytes())
            yield ps_pb2.InitMessage(rows=rows)

    stub.Init(messages(), timeout=PATIENCE)
    return placement.digest


@pytest.fixture
def shard(ps_cluster_factory: Callable[..., LocalCluster]) -> Iterator[tuple[LocalCluster, str]]:
    cluster = ps_cluster_factory(CONFIG, shards=1)
    with grpc.insecure_channel(cluster.address) as channel:
        stub = ps_pb2_grpc.ParameterServerStub(channel)
        stub.Join(ps_pb2.JoinRequest(worker_id=WORKER), timeout=PATIENCE, wait_for_ready=True)
        digest = _init(stub)
    yield cluster, digest


def _answers_promptly(address: str, digest: str) -> None:
    """GetTopology, Heartbeat and an Exchange (a lookup) answer within PROMPT on a fresh channel."""
    with grpc.insecure_channel(address) as channel:
        stub = ps_pb2_grpc.ParameterServerStub(channel)
        assert stub.GetTopology(ps_pb2.GetTopologyRequest(), timeout=PROMPT).initialized
        stub.Heartbeat(ps_pb2.HeartbeatRequest(worker_id=WORKER), timeout=PROMPT)
        ids = np.arange(3, dtype="<i8").tobytes()
        lookup = ps_pb2.Rows(table=0, count=3, ids=ids)
        reply = stub.Exchange(
            ps_pb2.ExchangeRequest(worker_id=WORKER, model_digest=digest, inline=True, lookup=[lookup]),
            timeout=PROMPT,
        )
        assert len(reply.rows[0].values) == 3 * DIM * 4


def _open_stalled(address: str, call: str, request: object, n: int) -> tuple[list[object], list[grpc.RpcError]]:
    """n streams on n channels, each read for one message and then left unread: (the admitted streams with
    their channels, the refusals)."""
    held: list[object] = []
    refused: list[grpc.RpcError] = []
    for _ in range(n):
        channel = grpc.insecure_channel(address)
        stream = getattr(ps_pb2_grpc.ParameterServerStub(channel), call)(request, timeout=4 * PATIENCE)
        try:
            next(stream)
            held.append((channel, stream))
        except grpc.RpcError as exc:
            refused.append(exc)
            channel.close()
    return held, refused


def _close(held: list[object]) -> None:
    for channel, stream in held:  # type: ignore[misc]
        stream.cancel()
        channel.close()


@pytest.mark.parametrize("call", ["ExportRows", "Pull"])
def test_stalled_readers_past_the_pool_leave_topology_heartbeats_and_exchanges_answering(
    shard: tuple[LocalCluster, str], call: str
) -> None:
    cluster, digest = shard
    servicer = cluster.servers[0].servicer
    pool = max(16, 4 * CONFIG.workers + 8)
    if call == "ExportRows":
        request: object = ps_pb2.ExportRowsRequest(model_digest=digest, table=0, optimizer_state=True)
    else:
        request = ps_pb2.PullRequest()  # a reader that never joined may pull (a copy of the weights)
    held, refused = _open_stalled(cluster.address, call, request, pool + 4)
    try:
        total, per_host = streams.caps(CONFIG.workers)
        # At most the cap open at once. How many are refused depends on timing: a stream whose whole reply fit the
        # HTTP/2 windows ends and frees its slot for the next reader (a Pull of a small model, often).
        assert len(held) >= min(total, per_host) and refused
        assert servicer.streams.streams <= min(total, per_host)
        for exc in refused:
            assert exc.code() == grpc.StatusCode.RESOURCE_EXHAUSTED, exc
            assert "per host" in (exc.details() or "")
        _answers_promptly(cluster.address, digest)
        # One copy, shared by every stalled reader (a Pull's is not one of the push scratch buffers).
        assert (servicer.exports.copies if call == "ExportRows" else servicer.streams.weights.copies) <= 1
    finally:
        _close(held)


def test_a_stalled_stream_is_cancelled_at_its_deadline_and_frees_what_it_held(
    shard: tuple[LocalCluster, str], monkeypatch: pytest.MonkeyPatch
) -> None:
    cluster, digest = shard
    servicer = cluster.servers[0].servicer
    monkeypatch.setattr(streams, "STALL_FLOOR_S", 1.0)
    monkeypatch.setattr(streams, "MIN_BYTES_PER_S", 1 << 30)
    export = ps_pb2.ExportRowsRequest(model_digest=digest, table=0, optimizer_state=True)
    held, refused = _open_stalled(cluster.address, "ExportRows", export, 2)
    try:
        assert len(held) == 2 and not refused
        wait_for(
            lambda: servicer.streams.streams == 0 and servicer.exports.copies == 0,
            PATIENCE,
            "the stalled streams to be cancelled and their copies freed",
            0.1,
        )
        assert servicer.streams.cancelled >= 2
        for _, stream in held:  # type: ignore[misc]
            with pytest.raises(grpc.RpcError) as info:
                for _ in stream:  # what was buffered, then the cancellation
                    pass
            assert info.value.code() == grpc.StatusCode.CANCELLED
    finally:
        _close(held)
    # A reader that reads gets the whole table.
    with grpc.insecure_channel(cluster.address) as channel:
        messages = list(ps_pb2_grpc.ParameterServerStub(channel).ExportRows(export, timeout=PATIENCE))
    raw = [ps_pb2.ExportRowsMessage.FromString(m) if isinstance(m, bytes) else m for m in messages]
    assert raw[0].header.count == ROWS and sum(m.rows.count for m in raw[1:]) == ROWS
