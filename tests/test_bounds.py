"""The bounds of ps.proto's fields (paramserver/bounds.py): every string, bytes and repeated field declares one in the
.proto (the options Bound.max_bytes, Bound.max_items); a shard enforces them while it decodes a request, before
anything else reads it.

- the contract: every such field declares its bound; each bound, generically from the descriptors, takes a message
  at the bound and refuses one past it (UTF-8 bytes, not characters), naming the field and the bound;
- a real shard: one request past each bound of every request message (gRPC unary requests, stream headers, the data
  socket's hello and frames) is INVALID_ARGUMENT (OutOfBounds), counted, and leaves weights, optimizer state,
  version and membership as they were; requests at the bounds are served; a Join refused for a bound takes no
  place in the job; what a shard sends keeps to the bounds too.
"""

from __future__ import annotations

import contextlib
import secrets
from collections.abc import Callable, Iterator
from dataclasses import dataclass

import grpc
import pytest
import torch
from google.protobuf.descriptor import Descriptor, FieldDescriptor
from google.protobuf.message import Message
from support import data_socket as ds
from support.messages import init_messages
from support.raw_job import OK_BYTE, Raw, error

from paramserver.config import ServerConfig
from paramserver.errors import ERROR_KEY, OutOfBounds
from paramserver.placement import TensorSpec, place
from paramserver.server.cluster import LocalCluster
from paramserver.shard.state import Shard
from paramserver.v1 import ps_pb2, ps_pb2_grpc
from paramserver.wire import bounds
from worker.client import PSClient

pytestmark = pytest.mark.timeout(60)

CALL_TIMEOUT = 5.0
WORKER = "worker-0"  # joined by the fixture
JOB = "bounds-test"
# Two places, so that a Join at the bound can take the second; Adam, so that a shard holds optimizer state.
CONFIG = ServerConfig(mode="async", workers=2, optimizer="adam", lr=0.01, job_name=JOB)
SPECS = (TensorSpec("fc.weight", (4, 3)), TensorSpec("fc.bias", (3,)))
INVALID = grpc.StatusCode.INVALID_ARGUMENT
SERVICE = "/paramserver.v1.ParameterServer/"
# Fields whose bound is the size of the message holding them (max_message_bytes, RESOURCE_EXHAUSTED beyond): the
# .proto says so in their comments.
BOUNDED_BY_MESSAGE_SIZE = {"paramserver.v1.Chunk.data", "paramserver.v1.Rows.ids", "paramserver.v1.Rows.values"}
_STRING, _BYTES, _MESSAGE = FieldDescriptor.TYPE_STRING, FieldDescriptor.TYPE_BYTES, FieldDescriptor.TYPE_MESSAGE


def _messages() -> list[Descriptor]:
    return list(ps_pb2.DESCRIPTOR.message_types_by_name.values())


def _bounded_fields() -> list[object]:
    """(message type, field, option, bound) for every bound the .proto declares."""
    out = []
    for message in _messages():
        for field in message.fields:
            max_bytes, max_items = bounds.declared(field)
            for option, bound in (("max_bytes", max_bytes), ("max_items", max_items)):
                if bound is not None:
                    out.append(pytest.param(message, field, option, bound, id=f"{field.full_name}-{option}"))
    return out


# -- the contract -----------------------------------------------------------------------------------------------


def test_every_string_bytes_and_repeated_field_declares_its_bound() -> None:
    missing = []
    for message in _messages():
        for field in message.fields:
            max_bytes, max_items = bounds.declared(field)
            if field.is_repeated and max_items is None:
                missing.append(f"{field.full_name}: max_items")
            sized = field.type in (_STRING, _BYTES)
            if sized and max_bytes is None and field.full_name not in BOUNDED_BY_MESSAGE_SIZE:
                missing.append(f"{field.full_name}: max_bytes")
            if not sized and max_bytes is not None:
                missing.append(f"{field.full_name}: max_bytes on a field that is no string or bytes")
    assert not missing, missing


def _filled(field: FieldDescriptor, option: str, n: int) -> Message:
    """A message of the field's type whose field holds n bytes (max_bytes: in one element if repeated, as
    two-byte characters where n is even, to count UTF-8 bytes) or n elements (max_items)."""
    message = getattr(ps_pb2, field.containing_type.name)()
    target = getattr(message, field.name)
    if option == "max_items":
        for _ in range(n):
            if field.type == _MESSAGE:
                target.add()
            else:
                target.append({_STRING: "", _BYTES: b""}.get(field.type, 1))
        return message
    if field.type == _BYTES:
        value: str | bytes = b"\xab" * n
    else:
        value = "é" * (n // 2) if n % 2 == 0 else "a" * n
    if field.is_repeated:
        target.append(value)
    else:
        setattr(message, field.name, value)
    return message


@pytest.mark.parametrize(("message", "field", "option", "bound"), _bounded_fields())
def test_each_bound_takes_a_message_at_it_and_refuses_one_past_it(
    message: Descriptor, field: FieldDescriptor, option: str, bound: int
) -> None:
    decode = bounds.decoder(getattr(ps_pb2, message.name), "Test")
    at = _filled(field, option, bound)
    assert decode(at.SerializeToString()) == at

    over = _filled(field, option, bound + 1).SerializeToString()
    with pytest.raises(OutOfBounds) as info:
        decode(over)
    path = f"{message.name}.{field.name}" + ("[0]" if field.is_repeated and option == "max_bytes" else "")
    unit = "bytes" if option == "max_bytes" else "items"
    assert str(info.value).startswith(f"Test: {path} ")
    assert f"{bound + 1} {unit}, over its bound of {bound}" in str(info.value)
    assert f"({option} in ps.proto)" in str(info.value)


def test_a_bound_counts_utf8_bytes_not_characters() -> None:
    decode = bounds.decoder(ps_pb2.JoinRequest, "Join")
    assert decode(ps_pb2.JoinRequest(worker_id="€" * 42).SerializeToString()).worker_id == "€" * 42  # 126 bytes
    with pytest.raises(OutOfBounds, match=r"JoinRequest\.worker_id is 129 bytes, over its bound of 128"):
        decode(ps_pb2.JoinRequest(worker_id="€" * 43).SerializeToString())  # 43 characters


def test_nested_fields_are_checked_and_named_by_their_path() -> None:
    header = ps_pb2.InitHeader(specs=[ps_pb2.TensorSpec(name="a"), ps_pb2.TensorSpec(name="b", shape=[1] * 33)])
    decode = bounds.stream_decoder(ps_pb2.InitMessage, "Init")
    with pytest.raises(OutOfBounds, match=r"^Init: InitMessage\.header\.specs\[1\]\.shape holds 33 items, over its"):
        decode(ps_pb2.InitMessage(header=header).SerializeToString())
    # A chunk takes codec's fast path and holds no bounded field: no check at all.
    chunk = decode(ps_pb2.InitMessage(chunk=ps_pb2.Chunk(piece=1, data=b"\0" * 8)).SerializeToString())
    assert not isinstance(chunk, Message) and chunk.piece == 1


def test_a_count_is_checked_before_the_elements() -> None:
    specs = [ps_pb2.TensorSpec(name="x" * 300)] * 65537  # each past its own bound too
    raw = ps_pb2.InitHeader(specs=specs).SerializeToString()
    with pytest.raises(OutOfBounds, match=r"InitHeader\.specs holds 65537 items, over its bound of 65536"):
        bounds.decoder(ps_pb2.InitHeader, "Init")(raw)


# -- a real shard ---------------------------------------------------------------------------------------------------


@dataclass
class Env:
    """A started one-shard job that WORKER joined, and a raw stub to it."""

    cluster: LocalCluster
    channel: grpc.Channel
    stub: ps_pb2_grpc.ParameterServerStub

    @property
    def shard(self) -> Shard:
        return self.cluster.shards[0]

    @property
    def digest(self) -> str:
        return place(SPECS, 1).digest

    def snapshot(self) -> tuple[bytes, frozenset[str], bool]:
        """Weights, optimizer state and version; the live workers; whether a model is held."""
        return self.shard.state_bytes(), frozenset(self.shard.membership.live), self.shard.model is not None

    def rejected(self) -> float:
        labels = {"shard": "0", "reason": "OutOfBounds"}
        return self.shard.metrics.registry.get_sample_value("paramserver_rejected_total", labels) or 0.0

    def pull(self, **fields: object) -> list[ps_pb2.PullMessage]:
        return list(self.stub.Pull(ps_pb2.PullRequest(**fields), timeout=CALL_TIMEOUT))

    def push(self, header: ps_pb2.PushHeader) -> ps_pb2.PushResponse:
        chunks = [ps_pb2.Chunk(piece=k, data=b"\0" * 4 * p.length) for k, p in enumerate(place(SPECS, 1).shards[0])]
        messages = [ps_pb2.PushMessage(header=header), *(ps_pb2.PushMessage(chunk=c) for c in chunks)]
        return self.stub.Push(iter(messages), timeout=CALL_TIMEOUT)


@contextlib.contextmanager
def _started(factory: Callable[..., LocalCluster], config: ServerConfig = CONFIG) -> Iterator[Env]:
    """A one-shard job that WORKER joined (naming the config's job), no model yet."""
    cluster = factory(config, shards=1)
    channel = grpc.insecure_channel(cluster.address)
    try:
        stub = ps_pb2_grpc.ParameterServerStub(channel)
        join = ps_pb2.JoinRequest(worker_id=WORKER, job_name=config.job_name)
        stub.Join(join, timeout=CALL_TIMEOUT, wait_for_ready=True)
        yield Env(cluster, channel, stub)
    finally:
        channel.close()


@pytest.fixture
def fresh(ps_cluster_factory: Callable[..., LocalCluster]) -> Iterator[Env]:
    """WORKER joined, no model yet."""
    with _started(ps_cluster_factory) as e:
        yield e


@pytest.fixture
def env(fresh: Env) -> Env:
    """The model initialised and one update applied (Adam's state exists): at version 1."""
    fresh.stub.Init(iter(init_messages(SPECS, worker_id=WORKER)), timeout=CALL_TIMEOUT)
    assert fresh.push(ps_pb2.PushHeader(worker_id=WORKER, step=1, model_digest=fresh.digest)).version == 1
    return fresh


def _over(bound: int) -> str:
    return "x" * (bound + 1)


def _init(e: Env, **changes: object) -> object:
    header = init_messages(SPECS, worker_id=WORKER)[0].header
    for key, value in changes.items():
        if key in ("specs", "tables"):
            del getattr(header, key)[:]
            getattr(header, key).extend(value)  # type: ignore[arg-type]
        else:
            setattr(header, key, value)
    return e.stub.Init(iter([ps_pb2.InitMessage(header=header)]), timeout=CALL_TIMEOUT)


def _attach_grpc(e: Env, **changes: object) -> object:
    fields: dict[str, object] = {
        "worker_id": WORKER,
        "nonce": secrets.token_bytes(16),
        "elements": 15,
        "model_digest": e.digest,
        "data_socket": ps_pb2.DataSocket(),
    }
    fields.update(changes)
    return e.stub.Attach(ps_pb2.AttachRequest(**fields), timeout=CALL_TIMEOUT)


def _exchange(e: Env, **changes: object) -> object:
    fields: dict[str, object] = {"worker_id": WORKER, "model_digest": e.digest, "pull": True, "inline": True}
    fields.update(changes)
    return e.stub.Exchange(ps_pb2.ExchangeRequest(**fields), timeout=CALL_TIMEOUT)


def _push_header(e: Env, **changes: object) -> object:
    fields: dict[str, object] = {"worker_id": WORKER, "step": 2, "base_version": 1, "model_digest": e.digest}
    fields.update(changes)
    return e.push(ps_pb2.PushHeader(**fields))


# (field as the refusal names it, its bound, the request past it). Init's run on a shard with no model yet.
OVER: list[tuple[str, int, Callable[[Env], object]]] = [
    ("JoinRequest.worker_id", 128, lambda e: e.stub.Join(ps_pb2.JoinRequest(worker_id=_over(128), job_name=JOB))),
    ("JoinRequest.job_name", 128, lambda e: e.stub.Join(ps_pb2.JoinRequest(worker_id="w", job_name=_over(128)))),
    ("HeartbeatRequest.worker_id", 128, lambda e: e.stub.Heartbeat(ps_pb2.HeartbeatRequest(worker_id=_over(128)))),
    ("LeaveRequest.worker_id", 128, lambda e: e.stub.Leave(ps_pb2.LeaveRequest(worker_id=_over(128)))),
    ("ClaimRequest.worker_id", 128, lambda e: e.stub.Claim(ps_pb2.ClaimRequest(worker_id=_over(128), dataset="d"))),
    ("ClaimRequest.job_name", 128, lambda e: e.stub.Claim(ps_pb2.ClaimRequest(worker_id="w", job_name=_over(128)))),
    ("ClaimRequest.dataset", 256, lambda e: e.stub.Claim(ps_pb2.ClaimRequest(worker_id="w", dataset=_over(256)))),
    ("PullRequest.worker_id", 128, lambda e: e.pull(worker_id=_over(128))),
    ("PullRequest.incarnation", 64, lambda e: e.pull(worker_id=WORKER, incarnation=_over(64))),
    (
        "ExportRowsRequest.model_digest",
        64,
        lambda e: list(e.stub.ExportRows(ps_pb2.ExportRowsRequest(model_digest=_over(64)), timeout=CALL_TIMEOUT)),
    ),
    ("InitMessage.header.worker_id", 128, lambda e: _init(e, worker_id=_over(128))),
    ("InitMessage.header.model_digest", 64, lambda e: _init(e, model_digest=_over(64))),
    ("InitMessage.header.specs", 65536, lambda e: _init(e, specs=[ps_pb2.TensorSpec(name="t", shape=[1])] * 65537)),
    (
        "InitMessage.header.specs[1].name",
        256,
        lambda e: _init(e, specs=[ps_pb2.TensorSpec(name="a"), ps_pb2.TensorSpec(name=_over(256))]),
    ),
    ("InitMessage.header.specs[0].shape", 32, lambda e: _init(e, specs=[ps_pb2.TensorSpec(name="a", shape=[1] * 33)])),
    ("PushMessage.header.worker_id", 128, lambda e: _push_header(e, worker_id=_over(128))),
    ("PushMessage.header.model_digest", 64, lambda e: _push_header(e, model_digest=_over(64))),
    ("AttachRequest.worker_id", 128, lambda e: _attach_grpc(e, worker_id=_over(128))),
    (
        "AttachRequest.shared_memory.name",
        64,
        lambda e: _attach_grpc(e, data_socket=None, shared_memory=ps_pb2.SharedMemory(name=_over(64))),
    ),
    ("AttachRequest.nonce", 16, lambda e: _attach_grpc(e, nonce=secrets.token_bytes(17))),
    ("AttachRequest.model_digest", 64, lambda e: _attach_grpc(e, model_digest=_over(64))),
    (
        "FollowRequest.model_digest",
        64,
        lambda e: list(e.stub.Follow(ps_pb2.FollowRequest(model_digest=_over(64)), timeout=CALL_TIMEOUT)),
    ),
    (
        "FollowRequest.incarnation",
        64,
        lambda e: list(e.stub.Follow(ps_pb2.FollowRequest(incarnation=_over(64)), timeout=CALL_TIMEOUT)),
    ),
    ("ExchangeRequest.worker_id", 128, lambda e: _exchange(e, worker_id=_over(128))),
    ("ExchangeRequest.model_digest", 64, lambda e: _exchange(e, model_digest=_over(64))),
    ("ExchangeRequest.incarnation", 64, lambda e: _exchange(e, incarnation=_over(64))),
    ("ExchangeRequest.chunks", 131072, lambda e: _exchange(e, push=True, chunks=[ps_pb2.Chunk()] * 131073)),
    ("ExchangeRequest.rows", 1024, lambda e: _exchange(e, push=True, rows=[ps_pb2.Rows()] * 1025)),
    ("ExchangeRequest.lookup", 1024, lambda e: _exchange(e, lookup=[ps_pb2.Rows()] * 1025)),
    ("PushMessage.header.rows", 1024, lambda e: _push_header(e, rows=[ps_pb2.Rows()] * 1025)),
    ("InitMessage.header.tables", 1024, lambda e: _init(e, tables=[ps_pb2.TableSpec(name="t", dim=1)] * 1025)),
    ("InitMessage.header.tables[0].name", 256, lambda e: _init(e, tables=[ps_pb2.TableSpec(name=_over(256))])),
    ("InitMessage.header.tables[0].init", 16, lambda e: _init(e, tables=[ps_pb2.TableSpec(name="t", init=_over(16))])),
    (
        "InitMessage.header.tables[0].optimizer",
        32,
        lambda e: _init(e, tables=[ps_pb2.TableSpec(name="t", optimizer=_over(32))]),
    ),
]


def test_every_bounded_request_field_has_a_case_here() -> None:
    """Each bounded field of a request message (by the service's input types, and their headers) is sent past its
    bound below, or the table misses it."""
    service = ps_pb2.DESCRIPTOR.services_by_name["ParameterServer"]
    roots = {m.input_type for m in service.methods} | {
        ps_pb2.AttachRequest.DESCRIPTOR,
        ps_pb2.ExchangeRequest.DESCRIPTOR,
    }
    wanted: set[str] = set()

    def walk(message: Descriptor, prefix: str) -> None:
        for field in message.fields:
            max_bytes, max_items = bounds.declared(field)
            if max_bytes is not None or max_items is not None:
                wanted.add(prefix + field.name)
            if field.type == _MESSAGE:
                walk(field.message_type, prefix + field.name + ".")

    for root in roots:
        walk(root, root.name + ".")
    covered = {name.replace("[0]", "").replace("[1]", "") for name, _, _ in OVER}
    assert wanted <= covered, sorted(wanted - covered)


@pytest.mark.parametrize(("field", "bound", "send"), [pytest.param(*case, id=case[0]) for case in OVER])
def test_a_request_past_a_bound_is_invalid_argument_and_changes_nothing(
    request: pytest.FixtureRequest, field: str, bound: int, send: Callable[[Env], object]
) -> None:
    e: Env = request.getfixturevalue("fresh" if field.startswith("InitMessage") else "env")
    before, rejected = e.snapshot(), e.rejected()

    with pytest.raises(grpc.RpcError) as info:
        send(e)

    err = info.value
    assert err.code() == INVALID, f"{err.code()}: {err.details()}"
    assert dict(err.trailing_metadata() or ()).get(ERROR_KEY) == "OutOfBounds"
    details = err.details() or ""
    assert f": {field} " in details and f"over its bound of {bound}" in details, details
    assert e.rejected() == rejected + 1
    assert e.snapshot() == before


def test_requests_at_their_bounds_are_served(env: Env) -> None:
    worker = "é" * 64  # 128 bytes
    joined = env.stub.Join(ps_pb2.JoinRequest(worker_id=worker, job_name=JOB), timeout=CALL_TIMEOUT)
    assert joined.rank == 1
    assert env.stub.Heartbeat(ps_pb2.HeartbeatRequest(worker_id=worker), timeout=CALL_TIMEOUT).version == 1
    # Another incarnation's version (64 bytes of it) is not waited for: the current weights come at once.
    header = env.pull(worker_id=worker, min_version=99, incarnation="i" * 64)[0].header
    assert header.version == 1 and header.model_digest == env.digest
    reply = _push_header(env, worker_id=worker, step=1)
    assert reply.applied and reply.version == 2  # type: ignore[attr-defined]
    env.stub.Leave(ps_pb2.LeaveRequest(worker_id=worker), timeout=CALL_TIMEOUT)
    assert env.shard.membership.live == {WORKER}


def test_a_model_at_the_bounds_of_names_and_shapes_is_initialised(fresh: Env) -> None:
    specs = (TensorSpec("n" * 256, (2,) + (1,) * 31), TensorSpec("b", (3,)))
    assert fresh.stub.Init(iter(init_messages(specs, worker_id=WORKER)), timeout=CALL_TIMEOUT).version == 0
    topology = fresh.stub.GetTopology(ps_pb2.GetTopologyRequest(), timeout=CALL_TIMEOUT)
    assert [(s.name, tuple(s.shape)) for s in topology.specs] == [(s.name, s.shape) for s in specs]


def test_a_job_name_at_its_bound_is_served(ps_cluster_factory: Callable[..., LocalCluster]) -> None:
    with _started(ps_cluster_factory, CONFIG.replace(job_name="j" * 128)) as e:  # WORKER's Join names it
        assert e.shard.membership.live == {WORKER}


def test_a_join_refused_for_a_bound_takes_no_place_in_the_job(ps_cluster_factory: Callable[..., LocalCluster]) -> None:
    cluster = ps_cluster_factory(CONFIG.replace(workers=1), shards=1)
    with grpc.insecure_channel(cluster.address) as channel:
        join = channel.unary_unary(SERVICE + "Join", response_deserializer=ps_pb2.JoinResponse.FromString)
        huge = ps_pb2.JoinRequest(worker_id="w" * (1 << 20), job_name=JOB).SerializeToString()  # 1 MiB, a UUID's 32
        for _ in range(3):
            with pytest.raises(grpc.RpcError) as info:
                join(huge, timeout=CALL_TIMEOUT, wait_for_ready=True)
            assert info.value.code() == INVALID, info.value.details()
            assert "JoinRequest.worker_id is 1048576 bytes, over its bound of 128" in (info.value.details() or "")
    assert cluster.shards[0].membership.live == set()
    # The job's one place is still free: a real worker joins and trains.
    with PSClient(cluster.address, job_name=JOB, timeout=CALL_TIMEOUT) as client:
        assert client.rank == 0
        client.register({"w": torch.ones(3)})
        assert client.push_pull({"w": torch.ones(3)}) == 1


def test_what_a_shard_sends_keeps_to_the_bounds(raw: Raw) -> None:
    """The bounds on responses are the shard's promise: a real shard's answers keep to them."""
    topology = raw.stub.GetTopology(ps_pb2.GetTopologyRequest(), timeout=CALL_TIMEOUT)
    joined = raw.stub.Join(ps_pb2.JoinRequest(worker_id="worker-a", job_name=topology.job.job_name))
    pulled = next(raw.stub.Pull(ps_pb2.PullRequest(worker_id="worker-a"), timeout=CALL_TIMEOUT))
    assert pulled.WhichOneof("kind") == "header"
    attached = raw.attach(raw.segment())
    exchanged = raw.exchange(pull=True)
    for message in (topology, joined, pulled, attached, exchanged):
        bounds.check(message, "the shard's answer")
    assert attached.doorbell and exchanged.pulled.incarnation == joined.incarnation


# -- the data socket's frames ---------------------------------------------------------------------------------------


def test_a_hello_past_a_bound_is_refused_and_ends_its_connection(raw: Raw) -> None:
    ticket = ds.ticket(raw)
    ds.attach(raw, ticket)
    before = raw.shard.state_bytes()
    too_long = ps_pb2.AttachRequest()
    too_long.CopyFrom(ticket)
    too_long.model_digest = _over(64)
    with ds.bell(ds.port(raw)) as bell:
        status, kind, message = error(bell.call(too_long))
        assert (status, kind) == (INVALID.value[0], "OutOfBounds"), message
        assert "AttachRequest.model_digest is 65 bytes, over its bound of 64" in message
        assert bell.closed_by_peer(), "a refused hello must end the connection"
    assert raw.shard.state_bytes() == before
    with ds.session(raw, ticket) as bell:  # the ticket itself still holds
        assert bell.call(raw.request(pull=True))[0] == OK_BYTE


def test_an_exchange_frame_past_a_bound_is_refused_and_the_connection_goes_on(raw: Raw) -> None:
    with ds.session(raw) as bell:
        before = raw.shard.state_bytes()
        grad = b"\0" * 4 * raw.elements
        status, kind, message = error(bell.call(raw.request(push=True, step=1, incarnation=_over(64)), payload=grad))
        assert (status, kind) == (INVALID.value[0], "OutOfBounds"), message
        assert "Exchange (socket): ExchangeRequest.incarnation is 65 bytes, over its bound of 64" in message
        assert raw.shard.state_bytes() == before
        # The payload was read to its end: the next frame is understood.
        body = bell.call(raw.request(pull=True))
        assert body[0] == OK_BYTE and ps_pb2.ExchangeResponse.FromString(body[1:]).pulled.version == 0


def test_a_server_job_name_past_the_wire_bound_is_refused_at_start() -> None:
    # No worker could name such a job (its Join would be refused), so the server refuses to run it.
    ServerConfig(job_name="j" * 128)
    with pytest.raises(ValueError, match=r"job_name must be at most 128 bytes"):
        ServerConfig(job_name="j" * 129)
