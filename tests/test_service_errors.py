"""Servicer tests, one per status code: bad requests to a real shard get the right status and change nothing.

Requests are crafted with the raw generated stubs (and raw channel methods for bytes that are no protobuf), so
every malformation the wire allows can be sent. Each refused request must (1) carry the status code of the table in
ARCHITECTURE.md, (2) say in its details what was wrong, and (3) leave the shard's weights, optimizer state and
version byte-identical (`Shard.state_bytes`).
"""

from __future__ import annotations

import re
import threading
import time
from collections.abc import Callable, Iterator, Sequence
from dataclasses import dataclass
from typing import Any

import grpc
import numpy as np
import pytest
import torch
from google.protobuf.descriptor import Descriptor, FieldDescriptor, MethodDescriptor
from google.protobuf.message import Message
from support.messages import chunk, init_messages

from paramserver.config import ServerConfig
from paramserver.errors import (
    ERROR_KEY,
    Aborted,
    AlreadyInitialized,
    FailedPrecondition,
    InvalidArgument,
    ModelMismatch,
    PSError,
    PullTimeout,
    RemoteError,
    TooLarge,
    Unauthenticated,
    UnknownWorker,
    from_rpc_error,
)
from paramserver.placement import Placement, TensorSpec, place
from paramserver.server.cluster import LocalCluster
from paramserver.shard.state import Shard
from paramserver.v1 import ps_pb2, ps_pb2_grpc
from worker.client import PSClient

# Every test here talks to servers on localhost; none should take more than a few seconds.
pytestmark = pytest.mark.timeout(30)

CALL_TIMEOUT = 5.0  # seconds for any RPC that is expected to answer at once
WORKER = "worker-0"
JOB = "errors-test"
# Adam, so a shard holds optimizer state to compare; one scratch buffer, so a later push waits for every earlier
# push's handler to finish (see `_barrier`).
CONFIG = ServerConfig(mode="sync", workers=1, optimizer="adam", lr=0.01, job_name=JOB, max_concurrent_pushes=1)
W, B = "fc.weight", "fc.bias"
SPECS = (TensorSpec(W, (4, 3)), TensorSpec(B, (3,)))
PW, PB = 0, 1  # their piece indices on a one-shard job: placement keeps model order within a shard
assert [p.name for p in place(SPECS, 1).shards[0]] == [W, B]
OTHER_SPECS = (TensorSpec("fc.weight", (5, 3)), TensorSpec("fc.bias", (5,)))
BAD_STEP = 7  # the step every refused push carries; a later valid push with it must still apply
GARBAGE = b"\x0a\x05ab"  # field 1, length 5, but only 2 bytes follow: no valid protobuf message
OVERSIZED = b"\0" * (5 << 20)  # one chunk over the default 4 MiB message limit
PUSH_METHOD = "/paramserver.v1.ParameterServer/Push"
INIT_METHOD = "/paramserver.v1.ParameterServer/Init"

_rng = np.random.default_rng(0)


def _values(n: int, fill: float | None = None) -> np.ndarray:
    """n float32 values: small random ones, or all `fill`."""
    if fill is not None:
        return np.full(n, fill, dtype="<f4")
    return _rng.standard_normal(n).astype("<f4")


def _init(specs: Sequence[TensorSpec] = SPECS, **changes: Any) -> list[ps_pb2.InitMessage]:
    """A correct Init stream of this module's job (WORKER, SPECS unless given), with any part replaced."""
    return init_messages(specs, **{"worker_id": WORKER, **changes})


@dataclass
class Live:
    """One started one-shard cluster and a raw stub to it, with helpers to build push streams."""

    cluster: LocalCluster
    channel: grpc.Channel
    stub: ps_pb2_grpc.ParameterServerStub
    placement: Placement

    @property
    def shard(self) -> Shard:
        return self.cluster.shards[0]

    def header(self, **changes: object) -> ps_pb2.PushMessage:
        """A PushHeader for the shard's current round, with any field changed."""
        fields: dict[str, object] = {
            "worker_id": WORKER,
            "step": BAD_STEP,
            "base_version": self.shard.version,
            "model_digest": self.placement.digest,
            "dtype": ps_pb2.FLOAT32,
        }
        fields.update(changes)
        return ps_pb2.PushMessage(header=ps_pb2.PushHeader(**fields))

    def chunk(self, piece: int, offset: int, count: int, fill: float | None = None) -> ps_pb2.PushMessage:
        """A chunk of `count` float32 values for piece `piece` at element `offset`."""
        return self.raw(piece, offset, _values(count, fill).tobytes())

    def raw(self, piece: int, offset: int, data: bytes) -> ps_pb2.PushMessage:
        """A chunk with exactly these bytes."""
        return ps_pb2.PushMessage(chunk=chunk(piece, offset, data))

    def full(self) -> list[ps_pb2.PushMessage]:
        """Chunks covering every piece of the shard exactly once (a valid gradient)."""
        return [self.chunk(k, 0, p.length) for k, p in enumerate(self.placement.shards[0])]

    def push(self, messages: Sequence[ps_pb2.PushMessage]) -> ps_pb2.PushResponse:
        return self.stub.Push(iter(messages), timeout=CALL_TIMEOUT)


def _raw_stream(channel: grpc.Channel, method: str, response: type) -> Callable[..., object]:
    """A client-stream method that sends bytes as they are (no serialization)."""
    return channel.stream_unary(method, request_serializer=lambda b: b, response_deserializer=response.FromString)


def _barrier(live: Live) -> None:
    """Return once every earlier push's handler has finished (also ones that outlive the status they sent).

    The shard has one scratch buffer (max_concurrent_pushes=1) and a push holds it from before it reads its
    first chunk until its update is done; this push (refused for its NaN) must wait for it.
    """
    with pytest.raises(grpc.RpcError) as info:
        live.push([live.header(), live.chunk(PW, 0, 12, fill=float("nan"))])
    assert info.value.code() == grpc.StatusCode.INVALID_ARGUMENT, info.value.details()


def _stop_bounded(cluster: LocalCluster, timeout: float = 3.0) -> None:
    """Stop the cluster, giving up after `timeout`: a request that wedges gRPC's server must not hang the suite.

    ShardServer.stop marks itself stopped first, so the fixture's own stop afterwards returns at once.
    """
    stopper = threading.Thread(target=cluster.stop, name="bounded-stop", daemon=True)
    stopper.start()
    stopper.join(timeout)


@pytest.fixture
def fresh(ps_cluster_factory: Callable[..., LocalCluster]) -> Iterator[Live]:
    """A started shard that WORKER has joined, not initialised."""
    cluster = ps_cluster_factory(CONFIG, shards=1)
    channel = grpc.insecure_channel(cluster.address)
    try:
        stub = ps_pb2_grpc.ParameterServerStub(channel)
        stub.Join(ps_pb2.JoinRequest(worker_id=WORKER, job_name=JOB), timeout=CALL_TIMEOUT, wait_for_ready=True)
        yield Live(cluster, channel, stub, place(SPECS, 1))
    finally:
        channel.close()


@pytest.fixture
def live(fresh: Live) -> Live:
    """The shard initialised with SPECS and one round applied, so Adam's state exists; at version 1."""
    fresh.stub.Init(iter(_init()), timeout=CALL_TIMEOUT)
    reply = fresh.push([fresh.header(step=1), *fresh.full()])
    assert (reply.version, reply.applied) == (1, True)
    assert fresh.shard.model.optimizer.state, "Adam's state should exist after one step"
    return fresh


# -- one bad request to an initialised shard -------------------------------------------------------------------


@dataclass(frozen=True)
class Case:
    """A bad request, the status it must get and patterns its details must match (all of them)."""

    send: Callable[[Live], object]
    code: grpc.StatusCode
    details: tuple[str, ...]


def _pull_first(live: Live, request: ps_pb2.PullRequest, timeout: float = CALL_TIMEOUT) -> ps_pb2.PullMessage:
    return next(live.stub.Pull(request, timeout=timeout))


INVALID = grpc.StatusCode.INVALID_ARGUMENT

CASES = [
    pytest.param(
        Case(lambda s: s.push([s.header(), s.chunk(PW, 0, 13), s.chunk(PB, 0, 3)]), INVALID, (W, "outside")),
        id="push-chunk-longer-than-piece",
    ),
    pytest.param(
        Case(lambda s: s.push([s.header(), *s.full(), s.chunk(9, 0, 1)]), INVALID, ("piece 9",)),
        id="push-unknown-piece",
    ),
    pytest.param(
        Case(lambda s: s.push([s.header(), s.chunk(PW, 0, 12), s.chunk(PB, 100, 1)]), INVALID, (B, "outside")),
        id="push-offset-out-of-range",
    ),
    pytest.param(
        Case(
            lambda s: s.push([s.header(), s.chunk(PW, 0, 8), s.chunk(PW, 4, 8), s.chunk(PB, 0, 3)]),
            INVALID,
            (W, "overlaps"),
        ),
        id="push-overlapping-chunks",
    ),
    pytest.param(
        Case(lambda s: s.push([s.header(), s.chunk(PW, 0, 12)]), INVALID, (B, "truncated or gap")),
        id="push-truncated-stream",
    ),
    pytest.param(
        Case(
            lambda s: s.push([s.header(), s.chunk(PW, 0, 4), s.chunk(PW, 8, 4), s.chunk(PB, 0, 3)]),
            INVALID,
            (W, "gap"),
        ),
        id="push-gap-inside-piece",
    ),
    pytest.param(
        Case(lambda s: s.push([s.header(), s.raw(PW, 0, b"\0" * 7)]), INVALID, (W, "7 bytes", "4-byte")),
        id="push-bytes-not-multiple-of-dtype-width",
    ),
    pytest.param(
        Case(
            lambda s: s.push([s.header(), s.chunk(PW, 0, 12, fill=float("nan")), s.chunk(PB, 0, 3)]),
            INVALID,
            (W, "NaN|Inf"),
        ),
        id="push-nan",
    ),
    pytest.param(
        Case(
            lambda s: s.push([s.header(), s.chunk(PW, 0, 12), s.chunk(PB, 0, 3, fill=float("inf"))]),
            INVALID,
            (B, "NaN|Inf"),
        ),
        id="push-inf",
    ),
    pytest.param(
        Case(lambda s: s.push([*s.full(), s.header()]), INVALID, ("must start with its header",)),
        id="push-chunk-before-header",
    ),
    pytest.param(
        Case(lambda s: s.push([]), INVALID, ("must start with its header",)),
        id="push-empty-stream",
    ),
    pytest.param(
        Case(lambda s: s.push([s.header(), s.header(), *s.full()]), INVALID, ("only chunks may follow",)),
        id="push-second-header",
    ),
    pytest.param(
        Case(lambda s: s.push([s.header(dtype=9), *s.full()]), INVALID, ("dtype 9",)),
        id="push-unknown-dtype",
    ),
    pytest.param(
        Case(
            lambda s: s.push([s.header(model_digest="0" * 64), *s.full()]),
            grpc.StatusCode.FAILED_PRECONDITION,
            ("model 000000000000", "holds"),
        ),
        id="push-other-model-digest",
    ),
    pytest.param(
        Case(
            lambda s: s.push([s.header(worker_id="stranger"), *s.full()]),
            grpc.StatusCode.ABORTED,
            ("'stranger'", "join again"),
        ),
        id="push-unknown-worker",
    ),
    pytest.param(
        Case(
            lambda s: s.push([s.header(base_version=0), *s.full()]),
            grpc.StatusCode.ABORTED,
            ("version 0", "at version 1", "closed"),
        ),
        id="push-for-finished-round",
    ),
    pytest.param(
        Case(
            lambda s: s.stub.Init(iter(_init(OTHER_SPECS)), timeout=CALL_TIMEOUT),
            grpc.StatusCode.FAILED_PRECONDITION,
            ("another model",),
        ),
        id="init-other-model",
    ),
    pytest.param(
        Case(
            lambda s: s.stub.Init(iter(_init()), timeout=CALL_TIMEOUT),
            grpc.StatusCode.ALREADY_EXISTS,
            ("already holds this model",),
        ),
        id="init-same-model-again",
    ),
    pytest.param(
        Case(
            lambda s: s.stub.Join(ps_pb2.JoinRequest(worker_id="intruder", job_name="other-job"), timeout=CALL_TIMEOUT),
            grpc.StatusCode.FAILED_PRECONDITION,
            ("'other-job'", JOB),
        ),
        id="join-other-job",
    ),
    pytest.param(
        # The valid chunks after the oversized one never reach the servicer (see also the test after this table).
        Case(
            lambda s: s.push([s.header(), s.raw(PW, 0, OVERSIZED), *s.full()]),
            grpc.StatusCode.RESOURCE_EXHAUSTED,
            ("5242890 bytes is over the limit of 4194304",),
        ),
        id="push-message-over-size-limit",
    ),
    pytest.param(
        # The client's deadline and the server's wait end together; either side may report it.
        Case(
            lambda s: _pull_first(s, ps_pb2.PullRequest(worker_id=WORKER, min_version=1000), timeout=0.5),
            grpc.StatusCode.DEADLINE_EXCEEDED,
            ("not 1000|Deadline Exceeded",),
        ),
        id="pull-version-not-reached-by-deadline",
    ),
    pytest.param(
        Case(
            lambda s: _pull_first(s, ps_pb2.PullRequest(worker_id=WORKER, dtype=9)),
            INVALID,
            ("dtype 9",),
        ),
        id="pull-unknown-dtype",
    ),
]


@pytest.mark.parametrize("case", CASES)
def test_bad_request_gets_its_status_and_changes_nothing(live: Live, case: Case) -> None:
    before = live.shard.state_bytes()

    with pytest.raises(grpc.RpcError) as info:
        case.send(live)

    err = info.value
    assert err.code() == case.code, f"{err.code()}: {err.details()}"
    for pattern in case.details:
        assert re.search(pattern, err.details() or ""), f"{pattern!r} not in {err.details()!r}"
    _barrier(live)
    assert live.shard.state_bytes() == before
    # The refused push's step was not recorded: a valid push with it is the next round's update.
    reply = live.push([live.header(), *live.full()])
    assert (reply.version, reply.applied) == (2, True)


# -- bytes that are no protobuf message, messages over the limit (the servicer checks, not gRPC)


@pytest.mark.parametrize(
    "tail",
    [
        pytest.param(False, id="garbage-instead-of-header"),
        pytest.param(True, id="garbage-after-complete-push"),
    ],
)
def test_unparsable_push_message_is_refused_and_changes_nothing(live: Live, tail: bool) -> None:
    before = live.shard.state_bytes()
    messages = [m.SerializeToString() for m in (live.header(), *live.full())] if tail else []
    push = _raw_stream(live.channel, PUSH_METHOD, ps_pb2.PushResponse)
    try:
        with pytest.raises(grpc.RpcError) as info:
            push(iter([*messages, GARBAGE]), timeout=CALL_TIMEOUT)

        assert info.value.code() == grpc.StatusCode.INVALID_ARGUMENT, info.value.details()
        assert "not a valid protobuf message" in info.value.details()
        _barrier(live)
        assert live.shard.state_bytes() == before
    finally:
        _stop_bounded(live.cluster)  # the server may be wedged by a response sent after gRPC's own status


def test_unparsable_message_after_complete_init_leaves_shard_uninitialised(fresh: Live) -> None:
    init = _raw_stream(fresh.channel, INIT_METHOD, ps_pb2.InitResponse)
    try:
        with pytest.raises(grpc.RpcError) as info:
            init(iter([*(m.SerializeToString() for m in _init()), GARBAGE]), timeout=CALL_TIMEOUT)

        assert info.value.code() == grpc.StatusCode.INVALID_ARGUMENT, info.value.details()
        assert "not a valid protobuf message" in info.value.details()
        # The handler may still run after the status went out; give it time to (wrongly) commit.
        deadline = time.monotonic() + 1.0
        while fresh.shard.model is None and time.monotonic() < deadline:
            time.sleep(0.02)
        assert fresh.shard.model is None
    finally:
        _stop_bounded(fresh.cluster)


def test_oversized_message_after_complete_push_changes_nothing(live: Live) -> None:
    # When gRPC itself refused the message, whether the handler saw the refusal was a race; the servicer now
    # checks the size itself, so every one of several attempts must be refused.
    try:
        for attempt in range(8):
            before = live.shard.state_bytes()
            with pytest.raises(grpc.RpcError) as info:
                live.push([live.header(step=1000 + attempt), *live.full(), live.raw(PW, 0, OVERSIZED)])

            assert info.value.code() == grpc.StatusCode.RESOURCE_EXHAUSTED, info.value.details()
            _barrier(live)
            assert live.shard.state_bytes() == before, f"attempt {attempt}: the refused push was applied"
    finally:
        _stop_bounded(live.cluster)


# -- bytes that are no request message, to every RPC (the servicer decodes every request itself) --------------------

SERVICE = ps_pb2.DESCRIPTOR.services_by_name["ParameterServer"]


def _sample(descriptor: Descriptor) -> Message:
    """A message of this type with every field set (a oneof: its first member), so that it serializes non-empty
    whenever the type has a field, its last field holding at least one byte of its own."""
    message = getattr(ps_pb2, descriptor.name)()
    for f in descriptor.fields:
        if f.containing_oneof is not None and f is not f.containing_oneof.fields[0]:
            continue
        if f.type == FieldDescriptor.TYPE_MESSAGE:
            target = getattr(message, f.name).add() if f.is_repeated else getattr(message, f.name)
            target.CopyFrom(_sample(f.message_type))
            if not f.is_repeated and not target.ByteSize():
                target.SetInParent()
        elif f.type == FieldDescriptor.TYPE_STRING:
            value: object = "abc"
        elif f.type == FieldDescriptor.TYPE_BYTES:
            value = b"abc"
        elif f.type == FieldDescriptor.TYPE_BOOL:
            value = True
        elif f.type == FieldDescriptor.TYPE_ENUM:
            value = 1
        elif f.type in (FieldDescriptor.TYPE_DOUBLE, FieldDescriptor.TYPE_FLOAT):
            value = 1.5
        else:
            value = 3
        if f.type != FieldDescriptor.TYPE_MESSAGE:
            if f.is_repeated:
                getattr(message, f.name).append(value)
            else:
                setattr(message, f.name, value)
    return message


def _bad_utf8(descriptor: Descriptor) -> bytes | None:
    """The wire bytes of a message of this type whose first string field (maybe nested) is not UTF-8, or None."""
    for f in descriptor.fields:
        if f.type == FieldDescriptor.TYPE_STRING:
            inner = b"\xff\xfe"
        elif f.type == FieldDescriptor.TYPE_MESSAGE and (nested := _bad_utf8(f.message_type)) is not None:
            inner = nested
        else:
            continue
        assert f.number < 16 and len(inner) < 128  # one-byte tag and length
        return bytes([f.number << 3 | 2, len(inner)]) + inner
    return None


def _undecodable_cases() -> list[object]:
    """(RPC, bytes) for every RPC of the service: garbage, a tag of no valid wire type, a valid request cut short,
    a string that is not UTF-8; a new RPC is covered as soon as it is in the .proto."""
    cases = []
    for method in SERVICE.methods:
        sample = _sample(method.input_type).SerializeToString()
        payloads = {"garbage": GARBAGE, "bad-wire-type": b"\x0f\x00", "truncated": sample[:-1] if sample else None}
        payloads["not-utf8"] = _bad_utf8(method.input_type)
        for name, payload in payloads.items():
            if payload is not None:
                cases.append(pytest.param(method, payload, id=f"{method.name}-{name}"))
    return cases


def _call_raw(channel: grpc.Channel, method: MethodDescriptor, payload: bytes) -> object:
    """Send `payload` as it is (no serialization) as the request, or the stream's only message, of `method`."""
    path = f"/{SERVICE.full_name}/{method.name}"
    if method.client_streaming:
        return channel.stream_unary(path)(iter([payload]), timeout=CALL_TIMEOUT)
    if method.server_streaming:
        return list(channel.unary_stream(path)(payload, timeout=CALL_TIMEOUT))
    return channel.unary_unary(path)(payload, timeout=CALL_TIMEOUT)


def _rejected(live: Live, reason: str) -> float:
    value = live.shard.metrics.registry.get_sample_value("paramserver_rejected_total", {"shard": "0", "reason": reason})
    return value or 0.0


@pytest.mark.parametrize(("method", "payload"), _undecodable_cases())
def test_undecodable_request_to_any_rpc_is_invalid_argument_and_changes_nothing(
    live: Live, method: MethodDescriptor, payload: bytes
) -> None:
    before, members, rejected = (
        live.shard.state_bytes(),
        set(live.shard.membership.live),
        _rejected(live, "Undecodable"),
    )

    with pytest.raises(grpc.RpcError) as info:
        _call_raw(live.channel, method, payload)

    err = info.value
    assert err.code() == INVALID, f"{err.code()}: {err.details()}"
    assert dict(err.trailing_metadata() or ()).get(ERROR_KEY) == "Undecodable"
    details = err.details() or ""
    for said in (f"{method.name}:", method.input_type.full_name, "not a valid protobuf message"):
        assert said in details, details
    assert _rejected(live, "Undecodable") == rejected + 1
    _barrier(live)
    assert live.shard.state_bytes() == before
    assert live.shard.membership.live == members
    # The shard serves on: the next round's push applies.
    reply = live.push([live.header(), *live.full()])
    assert (reply.version, reply.applied) == (2, True)


def test_unary_request_over_the_message_limit_is_resource_exhausted(live: Live) -> None:
    before = live.shard.state_bytes()
    oversized = ps_pb2.JoinRequest(worker_id="w" * (5 << 20), job_name=JOB).SerializeToString()
    _assert_refused(
        lambda: _call_raw(live.channel, SERVICE.methods_by_name["Join"], oversized),
        grpc.StatusCode.RESOURCE_EXHAUSTED,
        f"Join: a JoinRequest of {len(oversized)} bytes is over the limit of 4194304",
    )
    assert live.shard.state_bytes() == before
    assert live.shard.membership.live == {WORKER}


# -- a shard that holds no model yet -------------------------------------------------------------------------------


def _assert_refused(call: Callable[[], object], code: grpc.StatusCode, *patterns: str) -> None:
    with pytest.raises(grpc.RpcError) as info:
        call()
    assert info.value.code() == code, f"{info.value.code()}: {info.value.details()}"
    for pattern in patterns:
        assert re.search(pattern, info.value.details() or ""), f"{pattern!r} not in {info.value.details()!r}"


def test_push_before_init_is_failed_precondition(fresh: Live) -> None:
    before = fresh.shard.state_bytes()
    _assert_refused(
        lambda: fresh.push([fresh.header(), *fresh.full()]), grpc.StatusCode.FAILED_PRECONDITION, "no model"
    )
    assert fresh.shard.state_bytes() == before
    assert fresh.shard.model is None


def test_pull_before_init_is_failed_precondition(fresh: Live) -> None:
    before = fresh.shard.state_bytes()
    _assert_refused(
        lambda: _pull_first(fresh, ps_pb2.PullRequest(worker_id=WORKER)),
        grpc.StatusCode.FAILED_PRECONDITION,
        "no model",
    )
    assert fresh.shard.state_bytes() == before


def test_join_without_a_worker_id_is_invalid_and_takes_no_place(fresh: Live) -> None:
    before = fresh.shard.state_bytes()
    _assert_refused(
        lambda: fresh.stub.Join(ps_pb2.JoinRequest(worker_id="", job_name=JOB), timeout=CALL_TIMEOUT),
        grpc.StatusCode.INVALID_ARGUMENT,
        "a worker id is required",
    )
    assert fresh.shard.state_bytes() == before and fresh.shard.membership.live == {WORKER}


def test_join_beyond_worker_count_is_resource_exhausted(fresh: Live) -> None:
    before = fresh.shard.state_bytes()
    _assert_refused(
        lambda: fresh.stub.Join(ps_pb2.JoinRequest(worker_id="one-too-many", job_name=JOB), timeout=CALL_TIMEOUT),
        grpc.StatusCode.RESOURCE_EXHAUSTED,
        "already has its 1 workers",
    )
    assert fresh.shard.state_bytes() == before
    assert fresh.shard.membership.live == {WORKER}
    # The worker already in may renew its membership.
    reply = fresh.stub.Join(ps_pb2.JoinRequest(worker_id=WORKER, job_name=JOB), timeout=CALL_TIMEOUT)
    assert reply.rank == 0


_WEIGHT_ONLY = [chunk(PW, 0, _values(12).tobytes())]
_NAN_WEIGHT = [chunk(PW, 0, _values(12, float("nan")).tobytes()), chunk(PB, 0, _values(3).tobytes())]


@pytest.mark.parametrize(
    ("messages", "code", "pattern"),
    [
        pytest.param(lambda: _init(chunks=_WEIGHT_ONLY), INVALID, "fc.bias.*truncated", id="truncated"),
        pytest.param(lambda: _init(chunks=_NAN_WEIGHT), INVALID, "fc.weight.*NaN", id="nan"),
        pytest.param(lambda: _init()[1:], INVALID, "must start with its header", id="chunk-before-header"),
        pytest.param(lambda: _init(()), INVALID, "no tensors", id="no-tensors"),
        pytest.param(lambda: _init(worker_id="stranger"), grpc.StatusCode.ABORTED, "'stranger'", id="unknown-worker"),
        pytest.param(
            lambda: _init(num_shards=2), grpc.StatusCode.FAILED_PRECONDITION, "2 shards", id="wrong-shard-count"
        ),
        pytest.param(lambda: _init(digest="0" * 64), grpc.StatusCode.FAILED_PRECONDITION, "digest", id="wrong-digest"),
    ],
)
def test_bad_init_leaves_shard_uninitialised(
    fresh: Live, messages: Callable[[], list[ps_pb2.InitMessage]], code: grpc.StatusCode, pattern: str
) -> None:
    before = fresh.shard.state_bytes()

    _assert_refused(lambda: fresh.stub.Init(iter(messages()), timeout=CALL_TIMEOUT), code, pattern)

    assert fresh.shard.state_bytes() == before
    assert fresh.shard.model is None
    assert fresh.stub.Init(iter(_init()), timeout=CALL_TIMEOUT).version == 0


def test_init_over_model_limit_is_resource_exhausted(ps_cluster_factory: Callable[..., LocalCluster]) -> None:
    cluster = ps_cluster_factory(CONFIG.replace(max_model_bytes=32), shards=1)  # the model is 60 bytes
    with grpc.insecure_channel(cluster.address) as channel:
        stub = ps_pb2_grpc.ParameterServerStub(channel)
        stub.Join(ps_pb2.JoinRequest(worker_id=WORKER, job_name=JOB), timeout=CALL_TIMEOUT, wait_for_ready=True)
        _assert_refused(
            lambda: stub.Init(iter(_init()), timeout=CALL_TIMEOUT),
            grpc.StatusCode.RESOURCE_EXHAUSTED,
            "60 bytes",
            "max_model_bytes",
        )
    assert cluster.shards[0].model is None


# -- the client's view: typed errors ------------------------------------------------------------------------------


def _model(specs: Sequence[TensorSpec]) -> dict[str, torch.Tensor]:
    gen = torch.Generator().manual_seed(1)
    return {s.name: torch.randn(s.shape, generator=gen) for s in specs}


def test_register_of_another_model_raises_actionable_model_mismatch(
    ps_cluster_factory: Callable[..., LocalCluster],
) -> None:
    cluster = ps_cluster_factory(CONFIG.replace(workers=2), shards=2)
    with PSClient(cluster.address, job_name=JOB, timeout=CALL_TIMEOUT) as first:
        first.register(_model(SPECS))
        before = [s.state_bytes() for s in cluster.shards]
        with PSClient(cluster.address, job_name=JOB, timeout=CALL_TIMEOUT) as second:
            with pytest.raises(ModelMismatch) as info:
                second.register(_model(OTHER_SPECS))
    message = str(info.value)
    assert "another model" in message
    assert "restart the servers" in message
    assert place(OTHER_SPECS, 2).digest[:12] in message
    assert [s.state_bytes() for s in cluster.shards] == before


def test_client_push_of_nan_gradient_raises_invalid_argument(live: Live) -> None:
    model = _model(SPECS)
    with PSClient(live.cluster.address, worker_id=WORKER, job_name=JOB, timeout=CALL_TIMEOUT) as client:
        assert client.register(model) == 1
        before = live.shard.state_bytes()
        model["fc.bias"][1] = float("nan")
        with pytest.raises(InvalidArgument) as info:
            client.push(model)
        assert info.value.code == grpc.StatusCode.INVALID_ARGUMENT
        assert "fc.bias" in str(info.value) and "NaN" in str(info.value)
        assert live.cluster.address in str(info.value)
        assert live.shard.state_bytes() == before


def test_from_rpc_error_on_a_real_refusal(live: Live) -> None:
    with pytest.raises(grpc.RpcError) as info:
        live.push([live.header(worker_id="stranger"), *live.full()])

    err = from_rpc_error(info.value, live.cluster.address)

    # The servicer names the exact type in trailing metadata: the client knows to re-join, not just re-pull.
    assert type(err) is UnknownWorker and isinstance(err, Aborted)
    assert err.code == grpc.StatusCode.ABORTED
    assert str(err).startswith(f"shard {live.cluster.address}: ")
    assert "'stranger'" in str(err)


class _FakeRpcError(grpc.RpcError):
    def __init__(self, code: grpc.StatusCode, details: str) -> None:
        self._code, self._details = code, details

    def code(self) -> grpc.StatusCode:
        return self._code

    def details(self) -> str:
        return self._details


@pytest.mark.parametrize(
    ("code", "kind"),
    [
        (grpc.StatusCode.INVALID_ARGUMENT, InvalidArgument),
        (grpc.StatusCode.FAILED_PRECONDITION, FailedPrecondition),
        (grpc.StatusCode.ALREADY_EXISTS, AlreadyInitialized),
        (grpc.StatusCode.ABORTED, Aborted),
        (grpc.StatusCode.DEADLINE_EXCEEDED, PullTimeout),
        (grpc.StatusCode.RESOURCE_EXHAUSTED, TooLarge),
        (grpc.StatusCode.UNAUTHENTICATED, Unauthenticated),
        (grpc.StatusCode.UNAVAILABLE, RemoteError),
        (grpc.StatusCode.INTERNAL, RemoteError),
    ],
    ids=lambda v: v.name if isinstance(v, grpc.StatusCode) else v.__name__,
)
def test_from_rpc_error_maps_codes_to_typed_errors(code: grpc.StatusCode, kind: type[PSError]) -> None:
    err = from_rpc_error(_FakeRpcError(code, "what went wrong"), "host:1")

    assert type(err) is kind
    assert err.code == code
    assert str(err).startswith("shard host:1: ")
    assert "what went wrong" in str(err)
