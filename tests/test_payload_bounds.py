"""The data socket's payload bound and the lookup reply cap (issue 36, defects 4 and 6), at the wire:

- a frame's payload is at most the shard's part in float32 plus the rows and IDs its own request announces (SPEC
  10.3 and 16): a TOP_K push whose count is every element of the part, on a model with tables and with no rows in
  the request, is RESOURCE_EXHAUSTED and ends the connection, nothing applied (today's code allowed 64 MiB of rows
  on top whenever the model had tables, and applied it); a push with its rows, at the bound, applies;
- looked-up rows in one reply are capped (sparse.MAX_LOOKUP_BYTES) on the data socket and over gRPC:
  RESOURCE_EXHAUSTED before anything is read or applied, the connection in step.

A real shard on 127.0.0.1 (a thread, so the test can compare Shard.state_bytes), reached by raw frames.
"""

from __future__ import annotations

from collections.abc import Callable, Iterator
from pathlib import Path

import grpc
import numpy as np
import pytest
from support import data_socket as ds
from support.raw_job import CALL_TIMEOUT, JOB, RAW_CONFIG, WORKER, Raw, error

from paramserver.placement import TensorSpec, place
from paramserver.server.cluster import LocalCluster
from paramserver.shard.sparse.tables import MAX_LOOKUP_BYTES
from paramserver.tables import TableSpec, spec_to_proto
from paramserver.v1 import ps_pb2, ps_pb2_grpc
from paramserver.wire import compression

pytestmark = pytest.mark.timeout(120)

RE = grpc.StatusCode.RESOURCE_EXHAUSTED.value[0]
ELEMENTS = 1000
DIM = 8
WIDE = 4096  # a table whose rows are 16 KiB: a reply past the cap from a request of 128 KiB of IDs
SPECS = [TensorSpec("w", (ELEMENTS,))]
TABLES = [TableSpec("t", DIM), TableSpec("wide", WIDE, init="zeros")]


@pytest.fixture
def tabled(ps_cluster_factory: Callable[..., LocalCluster], tmp_path: Path) -> Iterator[Raw]:
    """A one-shard async job holding a dense tensor of ELEMENTS and two unbounded tables, WORKER joined."""
    cluster = ps_cluster_factory(RAW_CONFIG, shards=1)
    placement = place(SPECS, 1, tables=TABLES)
    header = ps_pb2.InitHeader(
        worker_id=WORKER,
        specs=[ps_pb2.TensorSpec(name=s.name, shape=s.shape) for s in SPECS],
        num_shards=1,
        model_digest=placement.digest,
        dtype=ps_pb2.FLOAT32,
        tables=[spec_to_proto(t) for t in TABLES],
    )
    chunk = ps_pb2.Chunk(piece=0, offset=0, data=np.zeros(ELEMENTS, "<f4").tobytes())
    channel = grpc.insecure_channel(cluster.address)
    stub = ps_pb2_grpc.ParameterServerStub(channel)
    try:
        stub.Join(ps_pb2.JoinRequest(worker_id=WORKER, job_name=JOB), timeout=CALL_TIMEOUT, wait_for_ready=True)
        stub.Init(iter([ps_pb2.InitMessage(header=header), ps_pb2.InitMessage(chunk=chunk)]), timeout=CALL_TIMEOUT)
        yield Raw(cluster, stub, placement.digest, ELEMENTS, tmp_path)
    finally:
        channel.close()


def _ids(n: int) -> np.ndarray:
    return np.arange(n, dtype="<i8")


def test_a_top_k_push_of_every_element_is_resource_exhausted_and_ends_the_connection(tabled: Raw) -> None:
    """Its payload (values and indices: 8 bytes an element) is twice the part's float32 bytes, and the request
    carries no rows: over SPEC's bound, whatever allowance the model's tables would have."""
    before = tabled.shard.state_bytes()
    every = ps_pb2.Compression(kind=compression.TOP_K, count=ELEMENTS)
    payload = ds.f32(np.ones(ELEMENTS)) + np.arange(ELEMENTS, dtype="<u4").tobytes()
    request = tabled.request(push=True, step=1, base_version=0, compression=every)
    with ds.session(tabled) as bell:
        status, kind, text = error(bell.call(request, payload=payload))
        assert (status, kind) == (RE, "TooLarge") and str(ELEMENTS * 4) in text, text
        assert bell.reply() is None  # the connection ended
    assert tabled.shard.state_bytes() == before


def test_a_push_with_its_rows_at_the_bound_applies(tabled: Raw) -> None:
    """The allowance is the request's own rows: a TOP_K push of half the part plus its rows applies."""
    half = ps_pb2.Compression(kind=compression.TOP_K, count=ELEMENTS // 2)
    ids = _ids(10)
    rows = [ps_pb2.Rows(table=0, count=len(ids))]
    payload = (
        ds.f32(np.ones(ELEMENTS // 2))
        + np.arange(0, ELEMENTS, 2, dtype="<u4").tobytes()
        + ids.tobytes()
        + ds.f32(np.ones((len(ids), DIM)))
    )
    assert len(payload) == ELEMENTS * 4 + len(ids) * (8 + 4 * DIM)  # exactly at the bound
    request = tabled.request(push=True, step=1, base_version=0, compression=half, rows=rows)
    with ds.session(tabled) as bell:
        reply = ds.ok(bell.call(request, payload=payload))
        assert (reply.version, reply.applied) == (1, True)
        # One byte of rows more than the request announces is over the bound: refused, the connection ended.
        more = tabled.request(push=True, step=2, base_version=1, compression=half, rows=rows)
        before = tabled.shard.state_bytes()
        status, kind, _ = error(bell.call(more, payload=payload + b"\0"))
        assert (status, kind) == (RE, "TooLarge")
        assert bell.reply() is None
    assert tabled.shard.state_bytes() == before


def _past_the_cap() -> list[ps_pb2.Rows]:
    n = MAX_LOOKUP_BYTES // (4 * WIDE) + 1
    return [ps_pb2.Rows(table=1, count=n)]


def test_a_lookup_reply_past_the_cap_is_resource_exhausted_on_the_data_socket(tabled: Raw) -> None:
    lookup = _past_the_cap()
    ids = _ids(lookup[0].count)
    before = tabled.shard.state_bytes()
    with ds.session(tabled) as bell:
        status, kind, text = error(bell.call(tabled.request(lookup=lookup), payload=ids.tobytes()))
        assert (status, kind) == (RE, "TooLarge") and str(MAX_LOOKUP_BYTES) in text and "fewer IDs" in text, text
        # The connection stays in step: a lookup within the cap is answered.
        small = [ps_pb2.Rows(table=1, count=3)]
        ds.ok(bell.call(tabled.request(lookup=small), payload=_ids(3).tobytes()))
        assert len(bell.payload) == 3 * WIDE * 4
    assert tabled.shard.state_bytes() == before


def test_a_lookup_reply_past_the_cap_is_resource_exhausted_over_grpc(tabled: Raw) -> None:
    lookup = _past_the_cap()
    lookup[0].ids = _ids(lookup[0].count).tobytes()
    before = tabled.shard.state_bytes()
    code, _, text = tabled.refused(lambda: tabled.exchange(inline=True, lookup=lookup))
    assert code == grpc.StatusCode.RESOURCE_EXHAUSTED and "fewer IDs" in text, text
    assert tabled.shard.state_bytes() == before
