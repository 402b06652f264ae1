"""Sparse embedding tables under bad input, limits, restarts and retries: every refusal has its status and a
message a person can act on, and leaves the shard byte-identical (`Shard.state_bytes` covers the tables' rows,
optimizer state and admission counts).

Real shards on 127.0.0.1 (threads, so the tests can look inside them), reached through raw gRPC messages built
from ps_pb2, raw doorbell and data-socket frames (FrameClient with the rows after the dense payload), or PSClient:

1. bad rows in a push, and bad lookups: IDs outside a bounded table, held by another shard, repeated; values of
   another width, NaN or Inf; a table twice, an unknown table; ids bytes that do not match `count`: INVALID_ARGUMENT
   over gRPC, the data socket and the doorbell, nothing applied, the step not spent;
2. the memory cap (max_table_bytes): `refuse` refuses the push that would pass it and never drops a row it took;
   `evict` trains on within the cap;
3. the per-table metrics (rows, bytes, admitted, evicted, IDs seen) match what was pushed;
4. checkpoints keep rows, optimizer state and admission counts: a restored run steps exactly as an uninterrupted one;
5. a push sent twice (same worker, same step) applies once, rows included;
6. GetTopology lists the tables; Init with an invalid table spec is INVALID_ARGUMENT;
7. admission (admit_after) and the per-shard capacity, end to end through PSClient.
"""

from __future__ import annotations

import re
import secrets
from collections.abc import Callable, Iterator, Sequence
from dataclasses import dataclass
from pathlib import Path

import grpc
import numpy as np
import pytest
import torch
from prometheus_client import generate_latest
from torch import nn

from paramserver.config import ServerConfig
from paramserver.errors import InvalidArgument, MalformedStream, PSError, TooLarge
from paramserver.placement import Placement, TensorSpec, place
from paramserver.server.cluster import LocalCluster
from paramserver.shard.state import Shard
from paramserver.tables import TableSpec, initial_rows, shard_of, spec_to_proto
from paramserver.transport import shm
from paramserver.transport.socket_client import FrameClient
from paramserver.v1 import ps_pb2, ps_pb2_grpc
from paramserver.wire.chunks import FLOAT32
from worker import PSClient, SparseEmbedding

pytestmark = pytest.mark.timeout(60)

CALL_TIMEOUT = 10.0  # seconds for any call expected to answer at once (generous: a shared, slow machine)
JOB = "sparse-errors"
WORKER = "worker-0"
DIM = 4
ITEMS = 100  # the bounded table's num_embeddings
USER, ITEM = 0, 1  # table indices: SparseEmbedding modules in named_modules() order
BAD_STEP = 7  # the step every refused push carries; the same step must still apply afterwards
INV = grpc.StatusCode.INVALID_ARGUMENT
EXHAUSTED = grpc.StatusCode.RESOURCE_EXHAUSTED
# Adagrad: the dense part and the rows (the table's default optimizer is the job's counterpart) carry state.
RAW_CONFIG = ServerConfig(mode="async", workers=2, optimizer="adagrad", lr=0.1, job_name=JOB)


class Recommender(nn.Module):
    """Two tables (an unbounded `user`, a bounded `item`) and a linear layer with fixed, non-zero weights, so that
    every row a batch touches gets a non-zero gradient and two runs built alike are identical."""

    def __init__(self, user: dict[str, object] | None = None, item: dict[str, object] | None = None) -> None:
        super().__init__()
        self.user = SparseEmbedding(dim=DIM, **(user or {}))  # type: ignore[arg-type]
        self.item = SparseEmbedding(dim=DIM, num_embeddings=ITEMS, **(item or {}))  # type: ignore[arg-type]
        self.fc = nn.Linear(2 * DIM, 1)
        with torch.no_grad():
            self.fc.weight.copy_(torch.linspace(-1.0, 1.0, 2 * DIM).reshape(1, -1) + 0.0625)
            self.fc.bias.fill_(0.25)

    def forward(self, users: torch.Tensor, items: torch.Tensor) -> torch.Tensor:
        return self.fc(torch.cat([self.user(users), self.item(items)], 1)).squeeze(-1)


def _step(client: PSClient, model: Recommender, users: Sequence[int], items: Sequence[int], **kw: object) -> int:
    """One training step on these IDs (one sample per pair): forward, backward, push_pull."""
    model.zero_grad()
    loss = model(torch.tensor(list(users)), torch.tensor(list(items))).square().sum()
    loss.backward()
    return client.push_pull(model, **kw)  # type: ignore[arg-type]


def _rows(client: PSClient, model: Recommender, table: int, ids: Sequence[int]) -> np.ndarray:
    return client.lookup(model, table, np.asarray(ids, dtype=np.int64))


def _owned(shard: int, num_shards: int, count: int, below: int = 10_000) -> list[int]:
    """The first `count` IDs in [0, below) held by `shard`."""
    ids = np.arange(below, dtype=np.int64)
    out = ids[shard_of(ids, num_shards) == shard][:count]
    assert len(out) == count, f"fewer than {count} IDs below {below} are held by shard {shard}"
    return [int(x) for x in out]


def _f32(values: object) -> bytes:
    return np.ascontiguousarray(values, dtype="<f4").tobytes()


def _i64(ids: object) -> bytes:
    return np.ascontiguousarray(ids, dtype="<i8").tobytes()


def _entry(table: int, ids: Sequence[int], values: np.ndarray | None = None, dim: int = DIM) -> ps_pb2.Rows:
    """A Rows entry with its bytes inline: these IDs and (default) small finite gradients of width `dim`."""
    if values is None:
        values = np.full((len(ids), dim), 0.125, dtype=np.float32)
    return ps_pb2.Rows(table=table, count=len(ids), ids=_i64(ids), values=_f32(values))


def _refused(call: Callable[[], object], code: grpc.StatusCode, *patterns: str) -> str:
    """Assert that `call` raises an RpcError with `code` whose details match every pattern; return the details."""
    with pytest.raises(grpc.RpcError) as info:
        call()
    details = info.value.details() or ""
    assert info.value.code() == code, f"{info.value.code()}: {details}"
    for pattern in patterns:
        assert re.search(pattern, details), f"{pattern!r} not in {details!r}"
    return details


def _sample(shard: Shard, name: str, table: str) -> float | None:
    return shard.metrics.registry.get_sample_value(name, {"shard": str(shard.index), "table": table})


# -- a two-shard job for raw requests ---------------------------------------------------------------------------------


@dataclass
class Raw:
    """A two-shard async job holding a Recommender with rows on both shards (trained one step by a client that then
    left), WORKER joined by raw stubs (one per shard), nothing attached."""

    cluster: LocalCluster
    stubs: list[ps_pb2_grpc.ParameterServerStub]
    placement: Placement
    digest: str

    @property
    def shards(self) -> list[Shard]:
        return self.cluster.shards

    def states(self) -> list[bytes]:
        return [s.state_bytes() for s in self.shards]

    def dense(self, shard: int = 0, value: float = 0.0625) -> list[np.ndarray]:
        """A finite gradient of shard `shard`'s pieces (one array per piece)."""
        return [np.full(p.length, value, dtype=np.float32) for p in self.placement.shards[shard]]

    def push(
        self, rows: Sequence[ps_pb2.Rows], shard: int = 0, step: int = BAD_STEP, **fields: object
    ) -> ps_pb2.ExchangeRequest:
        """An inline push (and pull) of shard `shard`'s dense part, as a worker builds it, with these rows."""
        request = ps_pb2.ExchangeRequest(
            worker_id=WORKER,
            model_digest=self.digest,
            push=True,
            step=step,
            base_version=self.shards[shard].version,
            pull=True,
            inline=True,
            dtype=ps_pb2.FLOAT32,
            **fields,
        )
        for k, grad in enumerate(self.dense(shard)):
            request.chunks.add(piece=k, offset=0, data=_f32(grad))
        request.rows.extend(rows)
        return request

    def exchange(self, request: ps_pb2.ExchangeRequest, shard: int = 0) -> ps_pb2.ExchangeResponse:
        return self.stubs[shard].Exchange(request, timeout=CALL_TIMEOUT)

    def lookup(self, table: int, ids: Sequence[int], shard: int = 0) -> np.ndarray:
        request = ps_pb2.ExchangeRequest(worker_id=WORKER, model_digest=self.digest)
        request.lookup.add(table=table, count=len(ids), ids=_i64(ids))
        reply = self.exchange(request, shard)
        assert len(reply.rows) == 1 and reply.rows[0].count == len(ids)
        return np.frombuffer(reply.rows[0].values, dtype="<f4").reshape(len(ids), DIM)


# IDs of the raw job: held by shard 0 (S0_*) or shard 1 (S1_*) of two, users and items (items below ITEMS).
S0_USERS = _owned(0, 2, 4)
S1_USERS = _owned(1, 2, 2)
S0_ITEMS = _owned(0, 2, 3, below=ITEMS)
S1_ITEMS = _owned(1, 2, 2, below=ITEMS)


@pytest.fixture
def raw(ps_cluster_factory: Callable[..., LocalCluster]) -> Iterator[Raw]:
    cluster = ps_cluster_factory(RAW_CONFIG, shards=2)
    model = Recommender()
    with PSClient(cluster.address, worker_id="registrar", job_name=JOB, timeout=CALL_TIMEOUT) as client:
        client.register(model)
        _step(client, model, S0_USERS[:2] + S1_USERS, S0_ITEMS[:2] + S1_ITEMS)
        placement, digest = client.placement(model), client.digest(model)
    assert all(sum(s.describe().table_rows) > 0 for s in cluster.shards), "the raw job should hold rows on both"
    channels = [grpc.insecure_channel(a) for a in cluster.addresses]
    try:
        stubs = [ps_pb2_grpc.ParameterServerStub(c) for c in channels]
        for stub in stubs:
            stub.Join(ps_pb2.JoinRequest(worker_id=WORKER, job_name=JOB), timeout=CALL_TIMEOUT, wait_for_ready=True)
        yield Raw(cluster, stubs, placement, digest)
    finally:
        for channel in channels:
            channel.close()


# -- 1. bad rows over gRPC -------------------------------------------------------------------------------------------


def _nan_values(n: int) -> np.ndarray:
    values = np.full((n, DIM), 0.125, dtype=np.float32)
    values[-1, 2] = np.nan
    return values


def _inf_values(n: int) -> np.ndarray:
    values = np.full((n, DIM), 0.125, dtype=np.float32)
    values[0, 0] = -np.inf
    return values


def _ids_bytes(count: int, data: bytes, table: int = USER) -> list[ps_pb2.Rows]:
    return [ps_pb2.Rows(table=table, count=count, ids=data, values=_f32(np.zeros((count, DIM))))]


BAD_ROWS: list[object] = [
    pytest.param(
        lambda: [_entry(ITEM, [S0_ITEMS[0], ITEMS])],
        rf"ID {ITEMS} is outside table 'item'.*0\.\.{ITEMS - 1}",
        id="id-past-bound",
    ),
    pytest.param(lambda: [_entry(ITEM, [-1, S0_ITEMS[0]])], r"ID -1 is outside table 'item'", id="negative-id"),
    pytest.param(lambda: [_entry(ITEM, [2**62])], r"outside table 'item'", id="huge-id"),
    pytest.param(
        lambda: [ps_pb2.Rows(table=USER, count=2, ids=_i64(S0_USERS[:2]), values=_f32(np.zeros((2, 3))))],
        r"24 bytes of values.*make 32",
        id="values-of-dim-3",
    ),
    pytest.param(
        lambda: [ps_pb2.Rows(table=USER, count=2, ids=_i64(S0_USERS[:2]), values=_f32(np.zeros((3, DIM))))],
        r"48 bytes of values.*make 32",
        id="values-of-3-rows-for-2",
    ),
    pytest.param(
        lambda: [ps_pb2.Rows(table=USER, count=2, ids=_i64(S0_USERS[:2]))], r"0 bytes of values", id="no-values"
    ),
    pytest.param(lambda: [_entry(USER, S0_USERS[:2], _nan_values(2))], r"'user'.*NaN or Inf", id="nan"),
    pytest.param(lambda: [_entry(ITEM, S0_ITEMS[:2], _inf_values(2))], r"'item'.*NaN or Inf", id="inf"),
    pytest.param(
        lambda: [_entry(USER, [S0_USERS[0], S0_USERS[1], S0_USERS[0]])], r"'user'.*more than once", id="repeated-id"
    ),
    pytest.param(
        lambda: [_entry(USER, S0_USERS[:1]), _entry(ITEM, S0_ITEMS[:1]), _entry(USER, S0_USERS[1:2])],
        r"'user' appears twice in one push",
        id="table-twice",
    ),
    pytest.param(lambda: [_entry(2, S0_USERS[:1])], r"rows for table 2.*2 table\(s\) \(user, item\)", id="table-2"),
    pytest.param(lambda: [_entry(2**31, S0_USERS[:1])], r"rows for table 2147483648", id="table-2**31"),
    pytest.param(
        lambda: [_entry(USER, [S0_USERS[0], S1_USERS[0]])],
        rf"'user': ID {S1_USERS[0]} belongs to shard 1, not 0",
        id="id-of-the-other-shard",
    ),
    pytest.param(
        lambda: [_entry(ITEM, [S1_ITEMS[0]])], rf"'item': ID {S1_ITEMS[0]} belongs to shard 1", id="item-other-shard"
    ),
    pytest.param(lambda: _ids_bytes(2, _i64(S0_USERS[:2])[:-1]), r"15 bytes of ids.*make 16", id="ids-not-8-bytes"),
    pytest.param(lambda: _ids_bytes(3, _i64(S0_USERS[:2])), r"16 bytes of ids.*make 24", id="ids-short-of-count"),
    pytest.param(lambda: _ids_bytes(1, _i64(S0_USERS[:2])), r"16 bytes of ids.*make 8", id="ids-past-count"),
    pytest.param(lambda: _ids_bytes(0, _i64(S0_USERS[:1])), r"8 bytes of ids.*make 0", id="ids-for-count-0"),
]


@pytest.mark.parametrize(("rows", "said"), BAD_ROWS)
def test_bad_rows_in_an_inline_push_are_invalid_and_change_nothing(
    raw: Raw, rows: Callable[[], list[ps_pb2.Rows]], said: str
) -> None:
    before, version = raw.states(), raw.shards[0].version
    _refused(lambda: raw.exchange(raw.push(rows())), INV, said)
    assert raw.states() == before, "a refused push changed a shard"
    assert raw.shards[0].version == version
    # The refused step was not spent: the same step with good rows applies, and moves exactly its rows.
    good = [_entry(USER, S0_USERS[:3]), _entry(ITEM, S0_ITEMS[:1])]
    held = raw.lookup(USER, S0_USERS[:4])
    reply = raw.exchange(raw.push(good))
    assert reply.applied and reply.version == version + 1
    after = raw.lookup(USER, S0_USERS[:4])
    assert not np.array_equal(after[:3], held[:3]), "the good push did not move its rows"
    assert np.array_equal(after[3], held[3]), "a row no push named moved"


def test_bad_rows_in_a_push_stream_are_invalid_and_change_nothing(raw: Raw) -> None:
    before = raw.states()
    header = ps_pb2.PushHeader(
        worker_id=WORKER, step=BAD_STEP, base_version=raw.shards[0].version, model_digest=raw.digest, dtype=FLOAT32
    )
    chunks = [
        ps_pb2.PushMessage(chunk=ps_pb2.Chunk(piece=k, offset=0, data=_f32(g))) for k, g in enumerate(raw.dense())
    ]
    for rows, said in [
        ([_entry(ITEM, [ITEMS])], "outside table 'item'"),
        ([_entry(USER, [S1_USERS[0]])], "belongs to shard 1"),
        ([_entry(USER, S0_USERS[:1], _nan_values(1))], "NaN or Inf"),
    ]:
        bad = ps_pb2.PushHeader()
        bad.CopyFrom(header)
        bad.rows.extend(rows)
        _refused(
            lambda b=bad: raw.stubs[0].Push(iter([ps_pb2.PushMessage(header=b), *chunks]), timeout=CALL_TIMEOUT),
            INV,
            said,
        )
        assert raw.states() == before
    header.rows.extend([_entry(USER, S0_USERS[:1])])
    reply = raw.stubs[0].Push(iter([ps_pb2.PushMessage(header=header), *chunks]), timeout=CALL_TIMEOUT)
    assert reply.applied


def test_rows_without_push_and_lookups_with_values_are_malformed(raw: Raw) -> None:
    before = raw.states()
    pull = ps_pb2.ExchangeRequest(worker_id=WORKER, model_digest=raw.digest, pull=True, inline=True)
    pull.rows.append(_entry(USER, S0_USERS[:1]))
    _refused(lambda: raw.exchange(pull), INV, "rows are pushed with a push")
    lookup = ps_pb2.ExchangeRequest(worker_id=WORKER, model_digest=raw.digest)
    lookup.lookup.append(_entry(USER, S0_USERS[:1]))  # with values
    _refused(lambda: raw.exchange(lookup), INV, "lookup of table 0 carries values")
    assert raw.states() == before


def test_a_count_past_the_rows_limit_is_resource_exhausted_before_anything_is_allocated(raw: Raw) -> None:
    before = raw.states()
    huge = ps_pb2.Rows(table=USER, count=2**40, ids=_i64(S0_USERS[:1]), values=_f32(np.zeros((1, DIM))))
    _refused(
        lambda: raw.exchange(raw.push([huge])), EXHAUSTED, "bytes of rows and IDs in one request", "smaller batches"
    )
    look = ps_pb2.ExchangeRequest(worker_id=WORKER, model_digest=raw.digest)
    look.lookup.add(table=USER, count=2**62, ids=_i64(S0_USERS[:1]))
    _refused(lambda: raw.exchange(look), EXHAUSTED, "smaller batches")
    assert raw.states() == before


@pytest.mark.parametrize(
    ("table", "ids", "said"),
    [
        (ITEM, [ITEMS], rf"ID {ITEMS} is outside table 'item'"),
        (ITEM, [S0_ITEMS[0], -1], r"ID -1 is outside table 'item'"),
        (USER, [S1_USERS[0]], rf"ID {S1_USERS[0]} belongs to shard 1"),
        (USER, [S0_USERS[0], S0_USERS[0]], r"more than once"),
        (3, [S0_USERS[0]], r"rows for table 3"),
    ],
    ids=["past-bound", "negative", "other-shard", "repeated", "unknown-table"],
)
def test_a_bad_lookup_is_invalid_argument(raw: Raw, table: int, ids: list[int], said: str) -> None:
    before = raw.states()
    request = ps_pb2.ExchangeRequest(worker_id=WORKER, model_digest=raw.digest)
    request.lookup.add(table=table, count=len(ids), ids=_i64(ids))
    _refused(lambda: raw.exchange(request), INV, said)
    # Also with a pull in the same exchange: refused whole.
    request.pull, request.inline = True, True
    _refused(lambda: raw.exchange(request), INV, said)
    assert raw.states() == before


def test_a_client_looking_up_an_id_past_the_bound_gets_invalid_argument(raw: Raw) -> None:
    before = raw.states()
    model = Recommender()
    with PSClient(raw.cluster.address, worker_id="reader", timeout=CALL_TIMEOUT) as client:
        client.register(model)
        with pytest.raises(InvalidArgument, match=rf"ID {ITEMS} is outside table 'item' \(IDs 0\.\.{ITEMS - 1}\)"):
            model(torch.tensor([S0_USERS[0], S1_USERS[0]]), torch.tensor([S0_ITEMS[0], ITEMS]))
        with pytest.raises(InvalidArgument, match=r"ID -3 is outside table 'item'"):
            client.lookup(model, ITEM, np.array([-3, 4]))
    assert raw.states() == before


@pytest.mark.parametrize("transport", [{"data_socket": False}, {}], ids=["grpc", "data-socket"])
def test_rows_travel_as_float32_whatever_the_exchange_dtype(raw: Raw, transport: dict[str, bool]) -> None:
    model = Recommender()
    ids = np.asarray(S0_USERS[:2] + S1_USERS, dtype=np.int64)
    with PSClient(
        raw.cluster.address, worker_id="reader", dtype="bf16", shared_memory=False, timeout=CALL_TIMEOUT, **transport
    ) as client:
        client.register(model)
        got = client.lookup(model, USER, ids)
    for k in (0, 1):
        mine = shard_of(ids, 2) == k
        table = raw.shards[k].model.tables.tables[USER]
        assert np.array_equal(got[mine], table.lookup(ids[mine])), f"shard {k}'s rows were rounded on the way"
    assert (got.view(np.uint32) & 0xFFFF).any(), "the rows are exact in bf16: the test would not see a rounding"


def test_a_good_lookup_reads_held_rows_and_initial_rows(raw: Raw) -> None:
    """The baseline of the refusals above: the same request shape with good IDs answers."""
    spec = Recommender().item.spec("item")
    never = [i for i in S0_ITEMS if i not in S0_ITEMS[:2]]
    rows = raw.lookup(ITEM, never)
    assert np.array_equal(rows, initial_rows(spec, np.asarray(never)))
    held = raw.lookup(ITEM, S0_ITEMS[:2])
    assert not np.array_equal(held, initial_rows(spec, np.asarray(S0_ITEMS[:2]))), "the trained rows read as initial"


# -- 1b. bad rows in frames (data socket, doorbell) --------------------------------------------------------------------


def _frame_push(raw: Raw, rows: Sequence[tuple[int, int]], step: int = BAD_STEP) -> ps_pb2.ExchangeRequest:
    """A frame's push (and pull): `rows` as (table, count) entries, their bytes in the payload."""
    request = ps_pb2.ExchangeRequest(
        worker_id=WORKER,
        model_digest=raw.digest,
        push=True,
        step=step,
        base_version=raw.shards[0].version,
        pull=True,
        dtype=FLOAT32,
    )
    for table, count in rows:
        request.rows.add(table=table, count=count)
    return request


def _socket(raw: Raw) -> FrameClient:
    elements = raw.placement.shard_elements(0)
    hello = ps_pb2.AttachRequest(
        worker_id=WORKER,
        nonce=secrets.token_bytes(16),
        elements=elements,
        model_digest=raw.digest,
        data_socket=ps_pb2.DataSocket(),
    )
    port = raw.stubs[0].Attach(hello, timeout=CALL_TIMEOUT).data_port
    assert port, "shard 0 serves no data socket"
    return FrameClient(("127.0.0.1", port), hello, raw.cluster.addresses[0], timeout=CALL_TIMEOUT)


def _frame_refused(bell: FrameClient, kind: type[PSError], *patterns: str, targets: Sequence[np.ndarray] = ()) -> None:
    with pytest.raises(PSError) as info:
        bell.receive(targets)
    assert isinstance(info.value, kind), f"{type(info.value).__name__}: {info.value}"
    for pattern in patterns:
        assert re.search(pattern, str(info.value)), f"{pattern!r} not in {info.value}"


def test_bad_rows_over_the_data_socket_are_refused_and_the_connection_stays_in_step(raw: Raw) -> None:
    before = raw.states()
    dense = raw.dense()
    weights = [np.empty(p.length, dtype=np.float32) for p in raw.placement.shards[0]]
    user_ids = np.asarray(S0_USERS[:2], dtype=np.int64)
    good_values = np.full((2, DIM), 0.125, dtype=np.float32)
    nan = good_values.copy()
    nan[1, 3] = np.nan
    cases: list[tuple[list[tuple[int, int]], list[np.ndarray], type[PSError], str]] = [
        ([(ITEM, 1)], [np.array([ITEMS], np.int64), good_values[:1]], InvalidArgument, f"ID {ITEMS} is outside"),
        ([(USER, 2)], [user_ids, nan], InvalidArgument, "NaN or Inf"),
        ([(USER, 1)], [np.array(S1_USERS[:1], np.int64), good_values[:1]], InvalidArgument, "belongs to shard 1"),
        ([(USER, 2)], [np.array([user_ids[0]] * 2), good_values], InvalidArgument, "more than once"),
        (
            [(USER, 1), (USER, 1)],
            [user_ids[:1], good_values[:1], user_ids[1:], good_values[1:]],
            InvalidArgument,
            "twice",
        ),
        # the payload one row short of what the message names (values of dim 3 would be the same bytes)
        ([(USER, 2)], [user_ids, good_values[:, :3].copy()], MalformedStream, r"payload of \d+ bytes"),
        ([(5, 1)], [user_ids[:1], good_values[:1]], InvalidArgument, "rows for table 5"),
    ]
    bell = _socket(raw)
    try:
        for entries, arrays, kind, said in cases:
            bell.send(_frame_push(raw, entries), CALL_TIMEOUT, dense, FLOAT32, arrays)
            _frame_refused(bell, kind, said, targets=weights)
            assert raw.states() == before, (entries, said)
        # Rows whose bytes sit in the message, not the payload: refused too.
        inline_rows = _frame_push(raw, [])
        inline_rows.rows.append(_entry(USER, S0_USERS[:2]))
        bell.send(inline_rows, CALL_TIMEOUT, dense, FLOAT32)
        _frame_refused(bell, MalformedStream, "travel in its payload", targets=weights)
        assert raw.states() == before
        # A count whose rows would pass the limit of one request: refused before anything is allocated or read.
        bell.send(_frame_push(raw, [(USER, 2**40)]), CALL_TIMEOUT, dense, FLOAT32, [user_ids, good_values])
        _frame_refused(bell, TooLarge, "smaller batches", targets=weights)
        assert raw.states() == before
        # A bad lookup on the same connection.
        look = ps_pb2.ExchangeRequest(worker_id=WORKER, model_digest=raw.digest)
        look.lookup.add(table=ITEM, count=1)
        bell.send(look, CALL_TIMEOUT, (), FLOAT32, [np.array([-1], np.int64)])
        _frame_refused(bell, InvalidArgument, "ID -1 is outside")
        # In step: the same step with good rows applies, and a lookup answers in the payload.
        bell.send(_frame_push(raw, [(USER, 2)]), CALL_TIMEOUT, dense, FLOAT32, [user_ids, good_values])
        reply = bell.receive(weights)
        assert reply.applied and reply.pulled.version == raw.shards[0].version
        got = np.empty((2, DIM), dtype=np.float32)
        look = ps_pb2.ExchangeRequest(worker_id=WORKER, model_digest=raw.digest)
        look.lookup.add(table=USER, count=2)
        bell.send(look, CALL_TIMEOUT, (), FLOAT32, [user_ids])
        bell.receive((), FLOAT32, [got])
        assert np.array_equal(got, raw.lookup(USER, S0_USERS[:2]))
    finally:
        bell.close()


@pytest.mark.skipif(not shm.available(), reason="shared memory needs Linux memfd and /proc")
def test_bad_rows_through_the_doorbell_are_refused_and_change_nothing(raw: Raw) -> None:
    before = raw.states()
    segment = shm.Segment.create(raw.placement.shard_elements(0))
    try:
        hello = ps_pb2.AttachRequest(
            worker_id=WORKER,
            shared_memory=ps_pb2.SharedMemory(name=segment.name),
            nonce=segment.nonce,
            elements=segment.elements,
            model_digest=raw.digest,
        )
        doorbell = raw.stubs[0].Attach(hello, timeout=CALL_TIMEOUT).doorbell
        assert doorbell, "shard 0 offers no doorbell"
        segment.grad[:] = 0.0625
        bell = FrameClient(doorbell, hello, raw.cluster.addresses[0], timeout=CALL_TIMEOUT)
        try:
            ids = np.asarray(S0_USERS[:2], dtype=np.int64)
            values = np.full((2, DIM), 0.125, dtype=np.float32)
            nan = values.copy()
            nan[0, 0] = np.nan
            for entries, arrays, said in [
                ([(USER, 2)], [ids, nan], "NaN or Inf"),
                ([(ITEM, 1)], [np.array([ITEMS], np.int64), values[:1]], f"ID {ITEMS} is outside"),
                ([(USER, 1)], [np.array(S1_USERS[:1], np.int64), values[:1]], "belongs to shard 1"),
            ]:
                bell.send(_frame_push(raw, entries), CALL_TIMEOUT, raw=arrays)
                _frame_refused(bell, InvalidArgument, said)
                assert raw.states() == before, said
            bell.send(_frame_push(raw, [(USER, 2)]), CALL_TIMEOUT, raw=[ids, values])
            assert bell.receive().applied
            assert raw.states() != before
        finally:
            bell.close()
    finally:
        segment.close()


def test_the_same_inline_push_twice_applies_once(raw: Raw) -> None:
    request = raw.push([_entry(USER, S0_USERS[:2]), _entry(ITEM, S0_ITEMS[:1])], step=3)
    first = raw.exchange(request)
    assert first.applied
    after_first = raw.states()
    again = raw.exchange(request)
    assert not again.applied and again.version == first.version
    assert raw.states() == after_first, "a retried push (same worker and step) was applied twice"


# -- 2. the memory cap ------------------------------------------------------------------------------------------------


class UserModel(nn.Module):
    """One unbounded table of DIM-wide rows and a fixed linear layer."""

    def __init__(self, **options: object) -> None:
        super().__init__()
        self.user = SparseEmbedding(dim=DIM, **options)  # type: ignore[arg-type]
        self.fc = nn.Linear(DIM, 1)
        with torch.no_grad():
            self.fc.weight.copy_(torch.tensor([[0.5, -0.25, 0.75, 1.0]]))
            self.fc.bias.zero_()

    def forward(self, users: torch.Tensor) -> torch.Tensor:
        return self.fc(self.user(users)).squeeze(-1)


def _user_step(client: PSClient, model: UserModel, ids: Sequence[int], **kw: object) -> int:
    model.zero_grad()
    model(torch.tensor(list(ids))).sum().backward()
    return client.push_pull(model, **kw)  # type: ignore[arg-type]


CAP = 20_000  # bytes of table memory per shard: a few hundred DIM-wide rows with their index


def _table_bytes(shard: Shard) -> float:
    value = _sample(shard, "paramserver_table_bytes", "user")
    assert value is not None
    return value


def test_refuse_mode_refuses_pushes_past_the_cap_and_never_drops_a_row(
    ps_cluster_factory: Callable[..., LocalCluster],
) -> None:
    config = ServerConfig(mode="sync", workers=1, optimizer="sgd", lr=0.1, max_table_bytes=CAP, table_overflow="refuse")
    cluster = ps_cluster_factory(config, shards=1)
    shard = cluster.shards[0]
    model = UserModel()
    with PSClient(cluster.address, timeout=CALL_TIMEOUT) as client:
        client.register(model)
        _user_step(client, model, range(20))
        # Far past the cap at once: refused whole, dense part and rows.
        before = shard.state_bytes()
        with pytest.raises(TooLarge, match=r"max-table-bytes") as info:
            _user_step(client, model, range(1000, 3000))
        assert info.value.code == EXHAUSTED
        assert shard.state_bytes() == before
        # Rows already held make no new row: taken.
        _user_step(client, model, range(20))
        # Then new rows, a batch at a time, until the cap refuses one: every push taken keeps all its rows.
        pushed, refused = 20, 0
        # (However the shard counts a row's memory, at least its 16 bytes of values: 200 batches pass the cap.)
        for batch in range(200):
            if refused >= 3:
                break
            ids = range(10_000 + 20 * batch, 10_000 + 20 * batch + 20)
            before = shard.state_bytes()
            try:
                _user_step(client, model, ids)
            except TooLarge:
                refused += 1
                assert shard.state_bytes() == before, "a refused push changed the shard"
            else:
                pushed += 20
            rows = shard.describe().table_rows[0]
            assert rows == pushed, f"batch {batch}: the shard holds {rows} rows of the {pushed} it took"
            assert _sample(shard, "paramserver_table_rows_evicted_total", "user") == 0
            assert _table_bytes(shard) <= CAP, f"batch {batch}: the tables take {_table_bytes(shard)} bytes"
        assert refused, "no push was ever refused"
        # The rows taken are all there, moved from their initial values.
        spec = model.user.spec("user")
        assert not (_rows(client, model, USER, range(20)) == initial_rows(spec, np.arange(20))).all(axis=1).any()


def test_evict_mode_trains_on_within_the_cap(ps_cluster_factory: Callable[..., LocalCluster]) -> None:
    config = ServerConfig(mode="sync", workers=1, optimizer="sgd", lr=0.1, max_table_bytes=CAP, table_overflow="evict")
    cluster = ps_cluster_factory(config, shards=1)
    shard = cluster.shards[0]
    model = UserModel()
    spec = model.user.spec("user")
    with PSClient(cluster.address, timeout=CALL_TIMEOUT) as client:
        client.register(model)
        # 20 new IDs a batch until the cap made room a few times (200 batches would be 64 KB of values alone).
        batches, over = 0, 0
        for batch in range(200):
            if over >= 5:
                break
            batches += 1
            ids = list(range(20 * batch, 20 * batch + 20))
            assert _user_step(client, model, ids) == batch + 1
            rows = shard.describe().table_rows[0]
            assert 20 <= rows <= 20 * (batch + 1), f"batch {batch}: {rows} rows held"
            assert _table_bytes(shard) <= CAP, f"batch {batch}: the tables take {_table_bytes(shard)} bytes"
            # The batch just pushed is held (it is the most recently updated).
            now = _rows(client, model, USER, ids)
            assert not (now == initial_rows(spec, np.asarray(ids))).all(axis=1).any(), f"batch {batch} was evicted"
            over += bool(_sample(shard, "paramserver_table_rows_evicted_total", "user"))
        evicted = _sample(shard, "paramserver_table_rows_evicted_total", "user")
        admitted = _sample(shard, "paramserver_table_rows_admitted_total", "user")
        assert evicted, "the cap never made room"
        assert admitted == 20 * batches and admitted - evicted == shard.describe().table_rows[0]
        # The oldest IDs were evicted: they read as initial again.
        assert np.array_equal(_rows(client, model, USER, range(5)), initial_rows(spec, np.arange(5)))


# -- 3. metrics --------------------------------------------------------------------------------------------------------


def test_table_metrics_count_what_was_pushed(ps_cluster_factory: Callable[..., LocalCluster]) -> None:
    config = ServerConfig(mode="sync", workers=1, optimizer="sgd", lr=0.1)
    cluster = ps_cluster_factory(config, shards=2)
    model = Recommender(item={"capacity": 2})
    batches = [
        ([1, 2, 3, 4, 5], [10, 11, 12, 13, 14]),
        ([4, 5, 6, 7, 8], [15, 20, 21, 22, 23]),  # items distinct across batches: capacity 2 evicts
        ([1, 100, 200, 300, 400], [30, 31, 32, 33, 34]),
    ]
    with PSClient(cluster.address, timeout=CALL_TIMEOUT) as client:
        client.register(model)
        for users, items in batches:
            _step(client, model, users, items)
    for shard in cluster.shards:
        k = shard.index
        text = generate_latest(shard.metrics.registry).decode()
        for name in (
            "paramserver_table_rows",
            "paramserver_table_bytes",
            "paramserver_table_rows_admitted_total",
            "paramserver_table_rows_evicted_total",
            "paramserver_table_ids_seen_total",
        ):
            for table in ("user", "item"):
                assert re.search(rf'^{name}\{{shard="{k}",table="{table}"\}} ', text, re.M), (name, table, text)
        for table, index, column in (("user", USER, 0), ("item", ITEM, 1)):
            mine = [np.asarray(sorted(set(b[column])), dtype=np.int64) for b in batches]
            mine = [ids[shard_of(ids, 2) == k] for ids in mine]
            distinct = len(set(np.concatenate(mine).tolist()))
            seen = sum(len(ids) for ids in mine)
            rows = shard.describe().table_rows[index]
            assert _sample(shard, "paramserver_table_ids_seen_total", table) == seen, table
            assert _sample(shard, "paramserver_table_rows_admitted_total", table) == distinct, table
            if table == "user":
                assert rows == distinct and _sample(shard, "paramserver_table_rows_evicted_total", table) == 0
            else:  # capacity 2 per shard
                assert rows == min(2, distinct)
                assert _sample(shard, "paramserver_table_rows_evicted_total", table) == distinct - rows
            assert _sample(shard, "paramserver_table_rows", table) == rows
            table_bytes = _sample(shard, "paramserver_table_bytes", table)
            assert table_bytes and table_bytes >= rows * DIM * 4


def test_a_refused_push_leaves_the_table_metrics_alone(raw: Raw) -> None:
    shard = raw.shards[0]
    names = ("paramserver_table_rows", "paramserver_table_rows_admitted_total", "paramserver_table_ids_seen_total")
    before = [_sample(shard, n, t) for n in names for t in ("user", "item")]
    _refused(lambda: raw.exchange(raw.push([_entry(USER, S0_USERS[:2], _nan_values(2))])), INV, "NaN")
    assert [_sample(shard, n, t) for n in names for t in ("user", "item")] == before
    rejected = shard.metrics.registry.get_sample_value(
        "paramserver_rejected_total", {"shard": "0", "reason": "InvalidArgument"}
    )
    assert rejected == 1


# -- 4. checkpoints ----------------------------------------------------------------------------------------------------


CKPT_STEPS = [  # (users, items), one sample per pair
    ([1, 2, 3], [5, 6, 5]),
    ([1, 4, 5], [5, 7, 7]),
    ([2, 6, 7], [8, 9, 8]),
]
FINAL_STEP = ([1, 3, 6, 8, 9], [6, 7, 9, 10, 6])
PROBE_USERS = [1, 2, 3, 4, 5, 6, 7, 8, 9, 123_456, -42]  # 8, 9, 123_456 and -42 never pushed before the restart
PROBE_ITEMS = [5, 6, 7, 8, 9, 10, 11, 99]


def _ckpt_config(tmp_path: Path | None) -> ServerConfig:
    config = ServerConfig(mode="sync", workers=1, optimizer="adagrad", lr=0.1, job_name=JOB)
    if tmp_path is None:
        return config
    return config.replace(checkpoint_dir=str(tmp_path), checkpoint_every="1")


def _ckpt_model() -> Recommender:
    return Recommender(user={"admit_after": 2}, item={"optimizer": "rowwise_adagrad"})


def _probe(client: PSClient, model: Recommender) -> tuple[np.ndarray, np.ndarray]:
    return _rows(client, model, USER, PROBE_USERS), _rows(client, model, ITEM, PROBE_ITEMS)


@pytest.mark.timeout(90)
def test_a_restored_run_holds_the_same_rows_and_steps_exactly_as_an_uninterrupted_one(
    ps_cluster_factory: Callable[..., LocalCluster], tmp_path: Path
) -> None:
    # The uninterrupted reference.
    reference = ps_cluster_factory(_ckpt_config(None), shards=2)
    model = _ckpt_model()
    with PSClient(reference.address, worker_id="trainer", job_name=JOB, timeout=CALL_TIMEOUT) as client:
        client.register(model)
        for users, items in CKPT_STEPS:
            _step(client, model, users, items)
        ref_before = _probe(client, model)
        assert _step(client, model, *FINAL_STEP) == len(CKPT_STEPS) + 1
        ref_after = _probe(client, model)
        ref_dense = {k: v.clone() for k, v in model.fc.state_dict().items()}  # the dense head (user is unbounded)
    reference.stop()
    # The final step is one that tells: users 3 and 6 (once before) get their rows in it, 8 and 9 (never) do not.
    initial_users = initial_rows(model.user.spec("user"), np.asarray(PROBE_USERS))
    moved = ~(ref_after[0] == initial_users).all(axis=1)
    assert [u for u, m in zip(PROBE_USERS, moved, strict=True) if m] == [1, 2, 3, 6]
    three = PROBE_USERS.index(3)
    assert (ref_before[0][three] == initial_users[three]).all(), "user 3 had a row before the final step"

    first = ps_cluster_factory(_ckpt_config(tmp_path), shards=2)
    model = _ckpt_model()
    with PSClient(first.address, worker_id="trainer", job_name=JOB, timeout=CALL_TIMEOUT) as client:
        client.register(model)
        for users, items in CKPT_STEPS:
            _step(client, model, users, items)
        saved = _probe(client, model)
    held = [s.describe().table_rows for s in first.shards]
    assert any(sum(len(t.state()["count_ids"]) for t in s.model.tables.tables) for s in first.shards), (
        "no ID is waiting for admission: the test would not show that admission counts are restored"
    )
    first.stop()

    second = ps_cluster_factory(_ckpt_config(tmp_path), shards=2)
    assert [s.describe().version for s in second.shards] == [len(CKPT_STEPS)] * 2, (
        "the shards did not restore their checkpoints (the log says why: a file skipped as damaged?)"
    )
    assert [s.describe().table_rows for s in second.shards] == held
    model = _ckpt_model()
    with PSClient(second.address, worker_id="trainer", job_name=JOB, timeout=CALL_TIMEOUT) as client:
        assert client.register(model) == len(CKPT_STEPS)
        restored = _probe(client, model)
        for got, want in zip(restored, saved, strict=True):
            assert np.array_equal(got, want)
        for got, want in zip(restored, ref_before, strict=True):
            assert np.array_equal(got, want)
        never = [i for i in PROBE_USERS if i in (8, 9, 123_456, -42)]
        spec = model.user.spec("user")
        assert np.array_equal(_rows(client, model, USER, never), initial_rows(spec, np.asarray(never)))
        # One more step, the same as the reference's: identical rows (Adagrad's sums and the admission counts came
        # back: users 3 and 6 were pushed once before, so admit_after=2 makes their rows now).
        assert _step(client, model, *FINAL_STEP, step=len(CKPT_STEPS) + 1) == len(CKPT_STEPS) + 1
        after = _probe(client, model)
        for got, want in zip(after, ref_after, strict=True):
            assert np.array_equal(got, want)
        for k, v in model.fc.state_dict().items():
            assert torch.equal(v, ref_dense[k]), k


def test_a_model_whose_tables_wait_for_no_admission_restores_from_its_checkpoint(
    ps_cluster_factory: Callable[..., LocalCluster], tmp_path: Path
) -> None:
    """The plainest case: admit_after 0, so no table holds admission counts (empty arrays in the checkpoint)."""
    config = ServerConfig(
        mode="sync", workers=1, optimizer="sgd", lr=0.1, checkpoint_dir=str(tmp_path), checkpoint_every="0"
    )
    first = ps_cluster_factory(config, shards=1)
    model = UserModel()
    with PSClient(first.address, worker_id="trainer", timeout=CALL_TIMEOUT) as client:
        client.register(model)
        _user_step(client, model, [1, 2, 3])
        saved = _rows(client, model, USER, [1, 2, 3, 4])
    first.stop()  # checkpoint_every "0": written at stop
    second = ps_cluster_factory(config, shards=1)
    assert second.shards[0].describe().version == 1, "the shard did not restore its checkpoint"
    assert second.shards[0].describe().table_rows == (3,)
    model = UserModel()
    with PSClient(second.address, worker_id="trainer", timeout=CALL_TIMEOUT) as client:
        client.register(model)
        assert np.array_equal(_rows(client, model, USER, [1, 2, 3, 4]), saved)


# -- 5. exactly once ------------------------------------------------------------------------------------------------


@pytest.mark.parametrize(
    "transport",
    [
        pytest.param({}, id="shared-memory"),
        pytest.param({"shared_memory": False}, id="data-socket"),
        pytest.param({"shared_memory": False, "data_socket": False}, id="grpc"),
    ],
)
def test_the_same_push_twice_moves_the_rows_once(
    ps_cluster_factory: Callable[..., LocalCluster], transport: dict[str, bool]
) -> None:
    cluster = ps_cluster_factory(ServerConfig(mode="sync", workers=1, optimizer="sgd", lr=0.1), shards=2)
    model = Recommender()
    users, items = [1, 2, 3, 4], [5, 6, 7, 8]
    with PSClient(cluster.address, timeout=CALL_TIMEOUT, **transport) as client:
        client.register(model)
        assert _step(client, model, users, items, step=1) == 1
        once = _probe_of(client, model, users, items)
        states = [s.state_bytes() for s in cluster.shards]
        # The same step again, the same rows and gradients (computed on the weights step 1 left).
        _step(client, model, users, items, step=1)
        assert [s.state_bytes() for s in cluster.shards] == states, "the retried push was applied again"
        assert all(np.array_equal(a, b) for a, b in zip(_probe_of(client, model, users, items), once, strict=True))
        assert [s.describe().stats.duplicate_pushes for s in cluster.shards] == [1, 1]
        # A new step moves them.
        assert _step(client, model, users, items, step=2) == 2
        assert not np.array_equal(_probe_of(client, model, users, items)[0], once[0])


def _probe_of(client: PSClient, model: Recommender, users: list[int], items: list[int]) -> tuple[np.ndarray, ...]:
    return _rows(client, model, USER, users), _rows(client, model, ITEM, items)


# -- 6. topology and Init ------------------------------------------------------------------------------------------


def test_get_topology_lists_the_tables_with_their_options(ps_cluster_factory: Callable[..., LocalCluster]) -> None:
    cluster = ps_cluster_factory(ServerConfig(mode="sync", workers=1, optimizer="adam", lr=0.01), shards=2)
    model = Recommender(
        user={"admit_after": 3, "capacity": 50, "init": "uniform", "init_scale": 0.5, "seed": 9},
        item={"optimizer": "rowwise_adagrad", "lr": 0.25, "evict_after_versions": 7, "admit_probability": 0.5},
    )
    with PSClient(cluster.address, timeout=CALL_TIMEOUT) as client:
        client.register(model)
        digest = client.digest(model)
    want = [spec_to_proto(model.user.spec("user")), spec_to_proto(model.item.spec("item"))]
    for address in cluster.addresses:
        with grpc.insecure_channel(address) as channel:
            topo = ps_pb2_grpc.ParameterServerStub(channel).GetTopology(
                ps_pb2.GetTopologyRequest(), timeout=CALL_TIMEOUT
            )
        assert topo.initialized and topo.model_digest == digest
        assert list(topo.tables) == want
        user, item = topo.tables
        assert (user.name, user.dim, user.num_embeddings, user.admit_after, user.capacity) == ("user", DIM, 0, 3, 50)
        assert (user.init, user.init_scale, user.seed) == ("uniform", 0.5, 9)
        assert (item.name, item.dim, item.num_embeddings, item.optimizer, item.lr) == (
            "item",
            DIM,
            ITEMS,
            "rowwise_adagrad",
            0.25,
        )
        assert (item.evict_after_versions, item.admit_probability) == (7, 0.5)


INIT_SPECS = (TensorSpec("fc.weight", (1, 2 * DIM)), TensorSpec("fc.bias", (1,)))


def _init_stream(tables: Sequence[ps_pb2.TableSpec], digest: str) -> list[ps_pb2.InitMessage]:
    placement = place(INIT_SPECS, 1)
    header = ps_pb2.InitHeader(
        worker_id=WORKER,
        specs=[ps_pb2.TensorSpec(name=s.name, shape=s.shape) for s in INIT_SPECS],
        num_shards=1,
        model_digest=digest,
        dtype=ps_pb2.FLOAT32,
        tables=tables,
    )
    chunks = [
        ps_pb2.InitMessage(chunk=ps_pb2.Chunk(piece=k, offset=0, data=_f32(np.full(p.length, 0.5))))
        for k, p in enumerate(placement.shards[0])
    ]
    return [ps_pb2.InitMessage(header=header), *chunks]


_GOOD_TABLE = TableSpec(name="user", dim=DIM)


@pytest.mark.parametrize(
    ("table", "said"),
    [
        (ps_pb2.TableSpec(name="user", dim=0), r"dim must be in 1\.\.65536, not 0"),
        (ps_pb2.TableSpec(name="user", dim=70_000), r"dim must be in 1\.\.65536"),
        (ps_pb2.TableSpec(name="user", dim=DIM, optimizer="foo"), r"optimizer must be one of .*not 'foo'"),
        (ps_pb2.TableSpec(name="user", dim=DIM, init="gaussian"), r"init must be one of .*not 'gaussian'"),
        (ps_pb2.TableSpec(name="", dim=DIM), r"name"),
        (ps_pb2.TableSpec(name="user", dim=DIM, admit_probability=1.5), r"admit_probability must be in \(0, 1\]"),
        (ps_pb2.TableSpec(name="user", dim=DIM, admit_probability=-0.5), r"admit_probability"),
        (ps_pb2.TableSpec(name="user", dim=DIM, lr=float("nan")), r"lr must be finite"),
        (ps_pb2.TableSpec(name="user", dim=DIM, init_scale=-1.0), r"init_scale must be finite and >= 0"),
        (ps_pb2.TableSpec(name="user", dim=DIM, evict_after_seconds=float("inf")), r"evict_after_seconds"),
        (ps_pb2.TableSpec(name="user", dim=DIM, num_embeddings=2**63), r"num_embeddings"),
    ],
    ids=[
        "dim-0",
        "dim-70000",
        "optimizer-foo",
        "init-gaussian",
        "no-name",
        "admit-1.5",
        "admit-negative",
        "lr-nan",
        "scale-negative",
        "evict-seconds-inf",
        "num-embeddings-2**63",
    ],
)
def test_init_with_an_invalid_table_spec_is_invalid_argument(
    ps_cluster_factory: Callable[..., LocalCluster], table: ps_pb2.TableSpec, said: str
) -> None:
    cluster = ps_cluster_factory(ServerConfig(mode="sync", workers=1, optimizer="sgd", lr=0.1, job_name=JOB), shards=1)
    shard = cluster.shards[0]
    with grpc.insecure_channel(cluster.address) as channel:
        stub = ps_pb2_grpc.ParameterServerStub(channel)
        stub.Join(ps_pb2.JoinRequest(worker_id=WORKER, job_name=JOB), timeout=CALL_TIMEOUT, wait_for_ready=True)
        before = shard.state_bytes()
        # Whatever digest: the spec is refused before the digest is looked at.
        for digest in (place(INIT_SPECS, 1).digest, "0" * 64):
            _refused(
                lambda d=digest: stub.Init(iter(_init_stream([table], d)), timeout=CALL_TIMEOUT), INV, "table", said
            )
            assert shard.model is None and shard.state_bytes() == before
        # A valid table spec then initialises the shard.
        good = place(INIT_SPECS, 1, tables=[_GOOD_TABLE]).digest
        assert stub.Init(iter(_init_stream([spec_to_proto(_GOOD_TABLE)], good)), timeout=CALL_TIMEOUT).version == 0
        assert shard.describe().tables == (_GOOD_TABLE,)


def test_init_with_two_tables_of_one_name_or_a_digest_without_tables_is_refused(
    ps_cluster_factory: Callable[..., LocalCluster],
) -> None:
    cluster = ps_cluster_factory(ServerConfig(mode="sync", workers=1, optimizer="sgd", lr=0.1, job_name=JOB), shards=1)
    shard = cluster.shards[0]
    with grpc.insecure_channel(cluster.address) as channel:
        stub = ps_pb2_grpc.ParameterServerStub(channel)
        stub.Join(ps_pb2.JoinRequest(worker_id=WORKER, job_name=JOB), timeout=CALL_TIMEOUT, wait_for_ready=True)
        twice = [spec_to_proto(_GOOD_TABLE), spec_to_proto(_GOOD_TABLE)]
        _refused(lambda: stub.Init(iter(_init_stream(twice, "0" * 64)), timeout=CALL_TIMEOUT), INV, "unique")
        # The dense-only digest does not name a model with tables: another model.
        dense_only = place(INIT_SPECS, 1).digest
        _refused(
            lambda: stub.Init(iter(_init_stream([spec_to_proto(_GOOD_TABLE)], dense_only)), timeout=CALL_TIMEOUT),
            grpc.StatusCode.FAILED_PRECONDITION,
            "digest",
        )
        assert shard.model is None


# -- 7. admission and eviction end to end ----------------------------------------------------------------------------


def test_a_row_is_made_on_the_third_update_of_its_id_with_admit_after_3(
    ps_cluster_factory: Callable[..., LocalCluster],
) -> None:
    cluster = ps_cluster_factory(ServerConfig(mode="sync", workers=1, optimizer="sgd", lr=0.1), shards=2)
    model = UserModel(admit_after=3)
    spec = model.user.spec("user")
    ids = [7, 8, 9, 10]  # on both shards of two
    assert len(set(shard_of(np.asarray(ids), 2).tolist())) == 2
    initial = initial_rows(spec, np.asarray(ids))
    with PSClient(cluster.address, timeout=CALL_TIMEOUT) as client:
        client.register(model)
        for update in (1, 2):
            _user_step(client, model, ids)
            assert np.array_equal(_rows(client, model, USER, ids), initial), f"a row moved on update {update}"
            assert sum(s.describe().table_rows[0] for s in cluster.shards) == 0
        # SGD: the first update a row takes moves it from its initial value by lr times its gradient: fc's weight
        # as the third step reads it.
        grad = model.fc.weight.detach().clone().numpy().reshape(-1)
        _user_step(client, model, ids[:2])  # a third update of 7 and 8 only
        now = _rows(client, model, USER, ids)
        assert np.allclose(now[:2], initial[:2] - 0.1 * grad, rtol=0, atol=1e-6)
        assert np.array_equal(now[2:], initial[2:]), "IDs in two updates only got rows"
        assert sum(s.describe().table_rows[0] for s in cluster.shards) == 2


def test_a_capacity_of_5_keeps_the_5_most_recently_updated_rows(
    ps_cluster_factory: Callable[..., LocalCluster],
) -> None:
    cluster = ps_cluster_factory(ServerConfig(mode="sync", workers=1, optimizer="sgd", lr=0.1), shards=1)
    shard = cluster.shards[0]
    model = UserModel(capacity=5)
    spec = model.user.spec("user")
    ids = list(range(100, 110))
    with PSClient(cluster.address, timeout=CALL_TIMEOUT) as client:
        client.register(model)
        for n, i in enumerate(ids, start=1):
            _user_step(client, model, [i])
            assert shard.describe().table_rows[0] == min(n, 5)
        rows = _rows(client, model, USER, ids)
    initial = initial_rows(spec, np.asarray(ids))
    assert np.array_equal(rows[:5], initial[:5]), "the oldest rows were not evicted"
    assert not (rows[5:] == initial[5:]).all(axis=1).any(), "a recent row was evicted"
    assert _sample(shard, "paramserver_table_rows_evicted_total", "user") == 5
