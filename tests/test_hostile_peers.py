"""The data socket and the doorbell under broken or hostile peers (paramserver/transport/socket_server.py and
paramserver/wire/frames.py), each case as a raw client that follows no rules:

1. a push that stalls mid-frame holds nothing another worker needs, and loses its connection at its deadline;
2. a handshake has one deadline for all of it, and a hello's buffer follows what arrived;
3. connections still proving themselves are capped, and the refusals counted;
4. a ticket proves one connection, on its own kind of socket, and a worker that leaves loses its connection;
5. step 0 (or any step that cannot name a push) is refused on every transport;
6. a stream out of step (two pushes interleaved) is refused by the frame's end marker, never applied.

Deadlines are shortened or lengthened per test with monkeypatch (the shards run in this process), so nothing here
depends on how fast the machine is.
"""

from __future__ import annotations

import socket
import time
from collections.abc import Callable

import grpc
import pytest
import torch
from support import data_socket as ds
from support.data_socket import GRAD
from support.raw_job import CALL_TIMEOUT, JOB, OK_BYTE, OTHER, WORKER, Bell, Raw, error

from paramserver.config import ServerConfig
from paramserver.server.cluster import LocalCluster
from paramserver.transport import socket_server
from paramserver.v1 import ps_pb2, ps_pb2_grpc
from paramserver.wire import frames
from worker.client import PSClient

INV = grpc.StatusCode.INVALID_ARGUMENT.value[0]
FP = grpc.StatusCode.FAILED_PRECONDITION.value[0]
PATIENCE = 60.0  # how long a test waits for something the shard must do by itself (a deadline, a close)
ELEMENTS = 400_000  # a model of 1.6 MB: over the payload size a shard waits for whole (1 MiB)


def _closed_within(bell: Bell, seconds: float = PATIENCE) -> bool:
    """Whether the shard ends the connection within `seconds` (whatever it sends before is read and dropped)."""
    bell.sock.settimeout(seconds)
    try:
        while bell.sock.recv(65536):
            pass
    except (ConnectionResetError, BrokenPipeError):
        return True
    except TimeoutError:
        return False
    return True


def _refused(registry: object, socket_name: str, reason: str) -> float:
    value = registry.get_sample_value(  # type: ignore[attr-defined]
        "paramserver_socket_connections_refused_total", {"shard": "0", "socket": socket_name, "reason": reason}
    )
    return value or 0.0


def _stall(
    stub: ps_pb2_grpc.ParameterServerStub, port: int, digest: str, worker_id: str, elements: int, sent: int
) -> Bell:
    """A data-socket connection for a joined `worker_id` that announces a push of the whole model (`elements`
    float32) and sends `sent` bytes of it, then nothing."""
    hello = ps_pb2.AttachRequest(
        worker_id=worker_id,
        nonce=worker_id.encode().ljust(16, b"."),
        elements=elements,
        model_digest=digest,
        data_socket=ps_pb2.DataSocket(),
    )
    stub.Attach(hello, timeout=CALL_TIMEOUT)
    bell = Bell(("127.0.0.1", port))
    assert bell.call(hello) == bytes([OK_BYTE])
    body = ps_pb2.ExchangeRequest(
        worker_id=worker_id, model_digest=digest, push=True, step=1, base_version=0
    ).SerializeToString()
    bell.sock.sendall(frames.REQUEST.pack(len(body), CALL_TIMEOUT, elements * 4) + body + b"\0" * sent)
    return bell


# -- 1. stalled pushes ------------------------------------------------------------------------------------------------


def test_stalled_small_pushes_hold_no_buffer_and_a_real_worker_trains_through_them(
    ps_cluster_factory: Callable[..., LocalCluster], monkeypatch: pytest.MonkeyPatch
) -> None:
    """Two connections each announce a push and send half of it, holding their frames open past the end of the
    test (the deadline is lengthened): with the default two scratch buffers, a real worker still trains, because a
    small payload is waited for whole before a buffer is taken."""
    monkeypatch.setattr(socket_server, "FRAME_FLOOR_S", 600.0)
    config = ServerConfig(mode="async", workers=3, optimizer="sgd", lr=0.5, job_name=JOB, lease_timeout=600.0)
    cluster = ps_cluster_factory(config, shards=1)
    model = {"fc.weight": torch.zeros(4, 3), "fc.bias": torch.zeros(3)}
    stalls: list[Bell] = []
    with grpc.insecure_channel(cluster.address) as channel:
        stub = ps_pb2_grpc.ParameterServerStub(channel)
        with PSClient(cluster.address, job_name=JOB, shared_memory=False, timeout=PATIENCE) as client:
            client.register(model)
            for worker in (WORKER, OTHER):
                stub.Join(ps_pb2.JoinRequest(worker_id=worker, job_name=JOB), timeout=CALL_TIMEOUT)
                port = cluster.servers[0].data_port
                stalls.append(_stall(stub, port, client.digest(model), worker, 15, 30))
            try:
                assert client.links[0].transport.kind == "data socket"
                for _ in range(5):
                    client.push_pull({k: torch.ones_like(v) for k, v in model.items()})
                assert cluster.shards[0].version == 5, "the stalled pushes were applied, or the worker's were not"
                for bell in stalls:  # still stalled, still open: they never held the worker back
                    bell.sock.settimeout(0.0)
                    with pytest.raises(BlockingIOError):
                        bell.sock.recv(1)
            finally:
                for bell in stalls:
                    bell.close()


def test_a_large_push_that_stalls_loses_its_connection_and_its_buffer_at_its_deadline(
    ps_cluster_factory: Callable[..., LocalCluster], monkeypatch: pytest.MonkeyPatch
) -> None:
    """A push too large to be waited for whole (1.6 MB) stalls halfway while it holds the shard's only scratch
    buffer: at its deadline the shard ends the connection, frees the buffer, and a real worker's push goes on."""
    monkeypatch.setattr(socket_server, "FRAME_FLOOR_S", 1.0)
    monkeypatch.setattr(socket_server, "MIN_BYTES_PER_S", 1 << 40)  # the deadline is the floor alone
    config = ServerConfig(mode="async", workers=2, optimizer="sgd", lr=0.5, job_name=JOB, max_concurrent_pushes=1)
    cluster = ps_cluster_factory(config, shards=1)
    model = {"w": torch.zeros(ELEMENTS)}
    with PSClient(cluster.address, job_name=JOB, shared_memory=False, timeout=PATIENCE) as client:
        client.register(model)
        digest, shard = client.digest(model), cluster.shards[0]
        with grpc.insecure_channel(cluster.address) as channel:
            stub = ps_pb2_grpc.ParameterServerStub(channel)
            stub.Join(ps_pb2.JoinRequest(worker_id=OTHER, job_name=JOB), timeout=CALL_TIMEOUT)
            hello = ps_pb2.AttachRequest(
                worker_id=OTHER,
                nonce=b"n" * 16,
                elements=ELEMENTS,
                model_digest=digest,
                data_socket=ps_pb2.DataSocket(),
            )
            port = stub.Attach(hello, timeout=CALL_TIMEOUT).data_port
        with ds.bell(("127.0.0.1", port)) as bell:
            assert bell.call(hello) == bytes([OK_BYTE])
            body = ps_pb2.ExchangeRequest(
                worker_id=OTHER, model_digest=digest, push=True, step=1, base_version=0
            ).SerializeToString()
            head = frames.REQUEST.pack(len(body), CALL_TIMEOUT, 4 * ELEMENTS) + body
            bell.sock.sendall(head + b"\0" * 2 * ELEMENTS)  # half the payload
            grad = {"w": torch.ones(ELEMENTS)}  # pushed as it is, then the new weights pulled into it
            client.push_pull(grad)  # waits for the buffer until the stall's deadline, if the stall took it first
            assert _closed_within(bell), "the shard kept a stalled push's connection"
        assert shard.version == 1 and float(grad["w"][0]) == -0.5 and float(grad["w"][-1]) == -0.5


# -- 2. handshakes ---------------------------------------------------------------------------------------------------


def test_a_hello_that_drips_in_is_cut_off_at_the_handshake_deadline(raw: Raw, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(socket_server, "HANDSHAKE_TIMEOUT", 1.0)
    registry = raw.shard.metrics.registry
    with ds.bell(ds.port(raw)) as bell:
        bell.sock.sendall(frames.REQUEST.pack(200, CALL_TIMEOUT, 0))  # a 200-byte hello, one byte at a time
        closed = False
        for _ in range(int(PATIENCE / 0.2)):
            try:
                bell.sock.sendall(b"\0")
            except (BrokenPipeError, ConnectionResetError):
                closed = True
                break
            time.sleep(0.2)  # the drip's pace: a byte every 0.2 s
        assert closed or _closed_within(bell), "a dripping hello kept its connection"
    assert _refused(registry, "data", "handshake_timeout") >= 1


def test_a_hello_announcing_more_than_a_hello_ends_the_connection_at_once(raw: Raw) -> None:
    with ds.bell(ds.port(raw)) as bell:
        bell.sock.sendall(frames.REQUEST.pack(frames.MAX_HELLO + 1, CALL_TIMEOUT, 0))
        assert _closed_within(bell), "the shard waited for a hello over its limit"


# -- 3. the cap on connections proving themselves ------------------------------------------------------------------


def test_connections_past_the_cap_are_closed_at_once_and_counted(
    ps_cluster_factory: Callable[..., LocalCluster],
) -> None:
    config = ServerConfig(mode="async", workers=1, optimizer="sgd", lr=0.5, job_name=JOB, max_pending_connections=3)
    cluster = ps_cluster_factory(config, shards=1)
    model = {"w": torch.zeros(10)}
    with PSClient(cluster.address, job_name=JOB, shared_memory=False) as first:
        first.register(model)
    port = cluster.servers[0].data_port
    silent = []
    try:
        for _ in range(10):
            sock = socket.create_connection(("127.0.0.1", port), timeout=CALL_TIMEOUT)
            silent.append(sock)
        closed: set[int] = set()
        deadline = time.monotonic() + PATIENCE
        while len(closed) < 7 and time.monotonic() < deadline:
            for i, sock in enumerate(silent):
                if i in closed:
                    continue
                sock.settimeout(0.05)
                try:
                    if sock.recv(1) == b"":
                        closed.add(i)
                except TimeoutError:
                    pass
                except ConnectionResetError:
                    closed.add(i)
        assert len(closed) >= 7, f"only {len(closed)} of the 7 connections past the cap of 3 were closed"
        registry = cluster.shards[0].metrics.registry
        assert _refused(registry, "data", "pending_cap") >= 7
    finally:
        for sock in silent:
            sock.close()
    with PSClient(cluster.address, job_name=JOB, shared_memory=False, timeout=PATIENCE) as client:
        client.register(model)
        client.push_pull({"w": torch.ones(10)})
        assert client.links[0].transport.kind == "data socket", "a real worker could not connect after the flood"


# -- 4. tickets ------------------------------------------------------------------------------------------------------


def test_a_ticket_proves_one_connection_only(raw: Raw) -> None:
    hello = ds.ticket(raw)
    ds.attach(raw, hello)
    with ds.session(raw, hello) as first:
        with ds.bell(ds.port(raw)) as second:
            status, kind, message = error(second.call(hello))
            assert (status, kind) == (FP, "NotAttached") and "proven its connection already" in message
        assert ds.ok(first.call(raw_request(raw, pull=True))).pulled.version == 0  # the first one serves on


def raw_request(raw: Raw, **fields: object) -> ps_pb2.ExchangeRequest:
    return ps_pb2.ExchangeRequest(worker_id=WORKER, model_digest=raw.digest, **fields)


def test_each_socket_takes_only_its_own_kind_of_attachment(raw: Raw) -> None:
    ticket = ds.ticket(raw)
    ds.attach(raw, ticket)
    doorbell = raw.attach(raw.segment(), OTHER).doorbell
    bell = Bell(doorbell)  # a data-socket ticket at the doorbell
    try:
        status, kind, message = error(bell.call(ticket))
        assert (status, kind) == (FP, "NotAttached") and "not data socket" in message
    finally:
        bell.close()
    seg = raw.segment()
    raw.attach(seg)  # WORKER's attachment is now this segment: present it at the data socket
    with ds.bell(ds.port(raw)) as bell:
        status, kind, message = error(bell.call(raw.hello(seg)))
        assert (status, kind) == (FP, "NotAttached") and "not shared memory" in message


def test_a_data_socket_ticket_relabelled_as_a_segment_is_refused_at_the_doorbell_and_kept(raw: Raw) -> None:
    """A raw-socket fuzzer's find: the ticket's nonce in a shared-memory hello with an empty name (a ticket's name)
    was taken at the doorbell, which then served the full weights, and the ticket was spent. Each kind's proof
    counts only as its own kind (SPEC.md section 10)."""
    ticket = ds.ticket(raw)
    ds.attach(raw, ticket)
    relabelled = ps_pb2.AttachRequest()
    relabelled.CopyFrom(ticket)
    relabelled.shared_memory.SetInParent()  # the oneof: now a segment hello, name "", the ticket's nonce
    bell = Bell(raw.attach(raw.segment(), OTHER).doorbell)
    try:
        status, kind, _ = error(bell.call(relabelled))
        assert (status, kind) == (FP, "NotAttached")
    finally:
        bell.close()
    with ds.session(raw, ticket) as served:  # the ticket still proves its own connection, once
        assert ds.ok(served.call(raw_request(raw, pull=True))).pulled.version == 0


def test_a_segment_relabelled_as_a_ticket_is_refused_at_the_data_socket_and_kept(raw: Raw) -> None:
    """The other direction: a segment's nonce in a data-socket hello (no name, as a ticket has none) is refused at
    the data socket, and the segment still proves its own doorbell connection, once (SPEC.md section 10)."""
    seg = raw.segment()
    doorbell = raw.attach(seg).doorbell
    relabelled = raw.hello(seg)
    relabelled.data_socket.SetInParent()  # the oneof: now a ticket hello, the segment's nonce
    with ds.bell(ds.port(raw)) as bell:
        status, kind, _ = error(bell.call(relabelled))
        assert (status, kind) == (FP, "NotAttached")
        assert bell.closed_by_peer(), "a refused hello must end the connection"
    served = Bell(doorbell)
    try:
        assert served.call(raw.hello(seg)) == bytes([OK_BYTE])
        assert ds.ok(served.call(raw_request(raw, pull=True))).pulled.version == 0
    finally:
        served.close()


def test_an_evicted_worker_loses_its_doorbell_connection(raw: Raw) -> None:
    seg = raw.segment()
    bell = Bell(raw.attach(seg).doorbell)
    try:
        assert bell.call(raw.hello(seg)) == bytes([OK_BYTE])
        raw.shard.tick(now=time.monotonic() + 3600)  # every lease ran out
        assert _closed_within(bell), "an evicted worker's doorbell connection stayed open"
    finally:
        bell.close()


# -- 5. step numbers -------------------------------------------------------------------------------------------------


def test_step_zero_is_refused_on_every_transport_and_changes_nothing(raw: Raw) -> None:
    before = raw.shard.state_bytes()
    with ds.session(raw) as bell:  # the data socket
        status, _, message = error(bell.call(raw_request(raw, push=True, step=0), payload=ds.f32(GRAD)))
        assert status == INV and "step starts at 1" in message
    seg = raw.segment()
    raw.attach(seg)
    with pytest.raises(grpc.RpcError) as info:  # shared memory, Exchange by gRPC
        raw.stub.Exchange(raw_request(raw, push=True, step=0), timeout=CALL_TIMEOUT)
    assert info.value.code() == grpc.StatusCode.INVALID_ARGUMENT
    inline = raw_request(raw, push=True, step=0, inline=True)
    for piece, (offset, length) in enumerate(((0, 12), (0, 3))):
        inline.chunks.add(piece=piece, offset=offset, data=ds.f32(GRAD[:length]))
    with pytest.raises(grpc.RpcError) as info:  # inline
        raw.stub.Exchange(inline, timeout=CALL_TIMEOUT)
    assert info.value.code() == grpc.StatusCode.INVALID_ARGUMENT
    assert raw.shard.state_bytes() == before


# -- 6. frames out of step -------------------------------------------------------------------------------------------


def test_two_interleaved_pushes_are_refused_by_the_end_marker_and_never_applied(raw: Raw) -> None:
    """The second push's header and message arrive where the first one's payload belongs: they read as finite
    floats of the right length, but the first frame's end marker is not where it must be."""
    before = raw.shard.state_bytes()
    with ds.session(raw) as bell:
        first = raw_request(raw, push=True, step=1, base_version=0).SerializeToString()
        second = raw_request(raw, push=True, step=2, base_version=0).SerializeToString()
        payload = raw.elements * 4  # 60 bytes: less than the second frame's header and message
        head_1 = frames.REQUEST.pack(len(first), CALL_TIMEOUT, payload) + first
        head_2 = frames.REQUEST.pack(len(second), CALL_TIMEOUT, payload) + second
        assert len(head_2) > payload
        bell.sock.sendall(head_1 + head_2 + ds.f32(GRAD) + frames.end_of(head_2))
        assert _closed_within(bell), "the shard answered a stream out of step"
    assert raw.shard.state_bytes() == before, "a frame out of step was applied"
