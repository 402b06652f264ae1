"""The data socket: each shard's TCP listener for workers on other hosts (paramserver/transport/socket_server.py,
the servicer's Attach and exchange_frame, Shard.attach_socket).

Real shards on 127.0.0.1 (threads, so `state_bytes()` shows that a refused request changed nothing); a client with
shared_memory=False stands in for a worker on another host. Covered:

- training over the data socket gives exactly the weights of SGD computed here, with small and sliced models;
  a shard without shared memory sends a default client there; bf16 on the data socket is bit-identical to bf16
  on the gRPC streams;
- raw frames over TCP: the hello must present this worker's ticket; a payload of the wrong size, NaN or Inf, a
  payload on a pull, an inline request, an unknown dtype, another model or another worker's id are refused with
  their status and error type, change nothing and leave the connection in step; a frame announcing more than
  the shard's part of the model is TooLarge and ends the connection;
- Attach(data_socket) refusals, and a worker that left;
- falling back to gRPC: a shard with no data socket, one whose data socket cannot be reached;
- a lost connection re-attaches; a refused push keeps the connection; TLS, mutual TLS (and the handshake timeout)
  and the bearer token hold for the data socket as for gRPC; a shard bound to an IPv6 host (gRPC's bracketed form).
"""

from __future__ import annotations

import contextlib
import logging
import secrets
import socket
import ssl
import threading
import time
from collections.abc import Callable
from pathlib import Path

import grpc
import numpy as np
import pytest
import torch
from support import data_socket as ds
from support.data_socket import GRAD, MALFORMED
from support.models import big_model, clone, like
from support.raw_job import (
    CALL_TIMEOUT,
    JOB,
    OK_BYTE,
    OTHER,
    REPLY_HEAD,
    REQUEST_HEAD,
    WORKER,
    Bell,
    Raw,
    error,
    refusal,
    small_model,
)
from support.references import local_sgd
from support.waiting import wait_for

from paramserver.config import ServerConfig
from paramserver.errors import NonFiniteGradient, NotAttached
from paramserver.security import client_ssl_context
from paramserver.server.cluster import LocalCluster
from paramserver.server.shard_server import ShardServer
from paramserver.shard.attachments import Ticket
from paramserver.transport import shm, socket_client, socket_server
from paramserver.transport.socket_client import FrameClient
from paramserver.v1 import ps_pb2, ps_pb2_grpc
from paramserver.wire import frames
from paramserver.wire.chunks import BFLOAT16, FLOAT32, encode
from worker.client import PSClient
from worker.client import link as link_module
from worker.client.transports import DataSocket

pytestmark = pytest.mark.timeout(60)

INV, FP, ABORTED = grpc.StatusCode.INVALID_ARGUMENT, grpc.StatusCode.FAILED_PRECONDITION, grpc.StatusCode.ABORTED
NOT_ATTACHED = (FP.value[0], "NotAttached")
UNKNOWN_WORKER = (ABORTED.value[0], "UnknownWorker")
Model = dict[str, torch.Tensor]


# -- helpers ----------------------------------------------------------------------------------------------------------


def _refused_hello(raw: Raw, hello: ps_pb2.AttachRequest) -> tuple[int, str]:
    """(status byte, error type) of a refused hello, which must end its connection."""
    with ds.bell(ds.port(raw)) as bell:
        got = error(bell.call(hello))[:2]
        assert bell.closed_by_peer(), "a refused hello must end the connection"
    return got


def _on_data_socket(client: PSClient) -> bool:
    return all(link.transport.kind == "data socket" and link.fallback is None for link in client.links)


def _transports(client: PSClient) -> list[object]:
    """The transport object of each shard's link: a new one after each (re-)attachment."""
    return [link.transport for link in client.links]


def _connections(client: PSClient) -> list[FrameClient]:
    """Each shard's data-socket connection (every shard on the data socket)."""
    out = []
    for link in client.links:
        assert isinstance(link.transport, DataSocket), link.transport.kind
        out.append(link.transport.connection)
    return out


def _equal(got: Model, want: Model) -> None:
    for name, value in want.items():
        assert torch.equal(got[name], value), name


def _train(client: PSClient, model: Model, lr: float = 0.1) -> None:
    """register, push, pull, push_pulls: after each, the weights are SGD's computed here."""
    start, grads = clone(model), [like(model, s) for s in (1, 2, 3)]
    assert client.register(model) == 0
    assert client.push(grads[0]) == 1
    assert client.pull(model) == 1
    _equal(model, local_sgd(start, grads[:1], lr))
    for n in (2, 3):
        g = clone(grads[n - 1])
        assert client.push_pull(g) == n
        _equal(g, local_sgd(start, grads[:n], lr))
    assert client.pull(model) == 3
    _equal(model, local_sgd(start, grads, lr))


def _config(**changes: object) -> ServerConfig:
    return ServerConfig(mode="sync", workers=1, optimizer="sgd", lr=0.1, job_name=JOB).replace(**changes)


def _client(cluster: LocalCluster, **options: object) -> PSClient:
    """A worker 'on another host': no shared memory."""
    return PSClient(cluster.address, job_name=JOB, shared_memory=False, timeout=CALL_TIMEOUT, **options)


def _ipv6() -> bool:
    try:
        with socket.socket(socket.AF_INET6) as probe:
            probe.bind(("::1", 0))
        return True
    except OSError:
        return False


# -- 1. training over the data socket ------------------------------------------------------------------------------


@pytest.mark.parametrize("make", [small_model, big_model], ids=["small", "sliced"])
def test_a_client_on_another_host_trains_over_the_data_socket(
    ps_cluster_factory: Callable[..., LocalCluster], make: Callable[[], Model]
) -> None:
    cluster = ps_cluster_factory(_config(), shards=2)
    with _client(cluster) as client:
        model = make()
        client.register(model)
        assert _on_data_socket(client)
        bells = _transports(client)
        _train(client, model)  # registers again: the shards hold the model
        assert _on_data_socket(client) and _transports(client) == bells, "the client reconnected without a cause"
        for server, connection in zip(cluster.servers, _connections(client), strict=True):
            assert connection.peer == ("127.0.0.1", server.data_port)
            ticket = server.shard.attachments.get(client.worker_id, server.shard.model)
            assert isinstance(ticket, Ticket) and ticket.elements == server.shard.model.numel and ticket.name == ""


@pytest.mark.skipif(not shm.available(), reason="no memfd or /proc on this host")
def test_a_shard_without_shared_memory_sends_a_default_client_to_the_data_socket(
    ps_cluster_factory: Callable[..., LocalCluster],
) -> None:
    cluster = ps_cluster_factory(_config(shared_memory=False), shards=2)
    with PSClient(cluster.address, job_name=JOB, timeout=CALL_TIMEOUT) as client:
        assert client.shared_memory
        _train(client, big_model())
        assert all(link.shared_memory_refused for link in client.links) and _on_data_socket(client)


def test_a_refused_push_keeps_the_data_socket_connection(ps_cluster_factory: Callable[..., LocalCluster]) -> None:
    cluster = ps_cluster_factory(_config(), shards=2)
    model = big_model()
    with _client(cluster) as client:
        client.register(model)
        bells, before = _transports(client), [s.state_bytes() for s in cluster.shards]
        bad = like(model, 1)
        bad["big"][0, 5] = bad["big"][-1, 5] = float("nan")  # on both shards' slices
        with pytest.raises(NonFiniteGradient):
            client.push_pull(bad)
        assert [s.state_bytes() for s in cluster.shards] == before
        g, good = clone(like(model, 2)), like(model, 2)
        assert client.push_pull(g) == 1
        _equal(g, local_sgd(model, [good], 0.1))
        assert _transports(client) == bells, "a refusal ended a connection that was in step"


def _bf16_steps(client: PSClient) -> list[Model]:
    model = big_model()
    client.register(model)
    seen = [clone(model)]
    for seed in (1, 2, 3):
        g = like(model, seed)
        client.push_pull(g)
        seen.append(clone(g))
    client.push(like(model, 4))
    client.pull(model)
    return [*seen, clone(model)]


def test_bf16_over_the_data_socket_is_bit_identical_to_bf16_over_the_streams(
    ps_cluster_factory: Callable[..., LocalCluster],
) -> None:
    config = _config(optimizer="adam", lr=0.01, weight_decay=0.01)
    fast, slow = ps_cluster_factory(config, shards=2), ps_cluster_factory(config, shards=2)
    with _client(fast, dtype="bf16") as a, _client(slow, dtype="bf16", data_socket=False) as b:
        runs = _bf16_steps(a), _bf16_steps(b)
        assert _on_data_socket(a)
        assert all(link.fallback is not None and link.transport.kind == "gRPC" for link in b.links)
    for step, (x, y) in enumerate(zip(*runs, strict=True)):
        for name in x:
            assert torch.equal(x[name], y[name]), f"{name} differs after step {step}"
            if step:  # pulled in bf16: the low half of every float32 is zero
                assert not (x[name].view(torch.int32) & 0xFFFF).any(), f"{name} was not pulled in bf16"
    assert not torch.equal(runs[0][0]["big"], runs[0][-1]["big"]), "training changed nothing"
    assert [s.state_bytes() for s in fast.shards] == [s.state_bytes() for s in slow.shards]


@pytest.mark.skipif(not _ipv6(), reason="no IPv6 loopback")
def test_a_shard_on_ipv6_serves_its_data_socket(ps_cluster_factory: Callable[..., LocalCluster]) -> None:
    cluster = ps_cluster_factory(_config(), shards=1, host="[::1]")
    assert cluster.address.startswith("[::1]:") and cluster.servers[0].data_port
    with _client(cluster) as client:
        _train(client, small_model())
        assert _on_data_socket(client)
        assert _connections(client)[0].peer == ("::1", cluster.servers[0].data_port)


def _timed_sends(client: PSClient, delay: float = 0.0, fail_first: bool = False) -> list[tuple[int, float, float]]:
    """Record (shard, start, end) of every gradient the client's data sockets send from now on; shard 0's first
    one is held `delay` seconds before it goes out, or fails as a lost connection with `fail_first`."""
    sends: list[tuple[int, float, float]] = []
    for k, bell in enumerate(_connections(client)):
        real = bell.send

        def send(request, timeout, arrays=(), dtype=FLOAT32, raw=(), k=k, real=real):  # noqa: ANN001, ANN202
            start = time.monotonic()
            if arrays and k == 0 and not any(s[0] == 0 for s in sends):
                time.sleep(delay)
                if fail_first:
                    sends.append((k, start, time.monotonic()))
                    raise ConnectionResetError("cut off by the test")
            real(request, timeout, arrays, dtype, raw)
            if arrays:
                sends.append((k, start, time.monotonic()))

        bell.send = send  # type: ignore[method-assign]
    return sends


def _timed_drains(client: PSClient) -> list[tuple[int, float]]:
    """Record (shard, end) of every wait for a push's bytes to be taken (a turn's end) from now on."""
    drains: list[tuple[int, float]] = []
    for k, bell in enumerate(_connections(client)):
        real = bell.drain

        def drain(below: int, limit: float, k: int = k, real: Callable[[int, float], None] = real) -> None:
            real(below, limit)
            drains.append((k, time.monotonic()))

        bell.drain = drain  # type: ignore[method-assign]
    return drains


@pytest.mark.parametrize("push_in_turn", [True, None], ids=["in-turn", "auto-on-loopback"])
def test_pushes_in_turn_go_out_one_shard_after_the_other(
    ps_cluster_factory: Callable[..., LocalCluster], push_in_turn: bool | None
) -> None:
    cluster = ps_cluster_factory(_config(), shards=2)
    model = big_model()  # each shard's part is over 1 MiB: sent from a thread of its own
    start, grads = clone(model), [like(model, s) for s in (1, 2)]
    with _client(cluster, push_in_turn=push_in_turn) as client:
        client.register(model)
        client.push_pull(clone(grads[0]))
        assert all(c.loopback for c in _connections(client))
        sends, drains = _timed_sends(client, delay=0.3), _timed_drains(client)
        g = clone(grads[1])
        assert client.push_pull(g) == 2
        _equal(g, local_sgd(start, grads, 0.1))
    (_, start0, end0), (_, start1, _) = sorted(sends)
    if push_in_turn:
        # Shard 1's turn begins once shard 0 has taken its gradient, not merely once the kernel holds it (the last
        # shard has no one to wait for it).
        assert [k for k, _ in drains] == [0]
        assert end0 <= drains[0][1] <= start1, "shard 1's gradient went out before shard 0's was taken"
    else:  # a loopback address: copies, not a link, are the limit, so every shard's push goes at once
        assert start1 < end0 - 0.2, "shard 1 waited for shard 0's turn on a loopback address"
        assert drains == []


def test_a_push_that_fails_in_its_turn_holds_no_other_shard_back(
    ps_cluster_factory: Callable[..., LocalCluster],
) -> None:
    cluster = ps_cluster_factory(_config(), shards=2)
    model = big_model()
    start, grads = clone(model), [like(model, s) for s in (1, 2)]
    with _client(cluster, push_in_turn=True) as client:
        client.register(model)
        client.push_pull(clone(grads[0]))
        sends = _timed_sends(client, fail_first=True)
        began = time.monotonic()
        g = clone(grads[1])
        assert client.push_pull(g) == 2  # shard 0 attached again and was retried; its push applied once
        assert time.monotonic() - began < 5.0, "shard 1 waited out the turn's safety limit"
        _equal(g, local_sgd(start, grads, 0.1))
    assert [s[0] for s in sorted(sends, key=lambda s: s[1])][:2] == [0, 1]
    assert [s.version for s in cluster.shards] == [2, 2]


def test_drain_waits_until_the_peer_has_taken_the_bytes() -> None:
    with socket.create_server(("127.0.0.1", 0)) as listener:
        listener.setsockopt(socket.SOL_SOCKET, socket.SO_RCVBUF, 64 * 1024)
        sender = socket.create_connection(listener.getsockname())
        peer, _ = listener.accept()
        with sender, peer:
            assert socket_client.drain(sender, 1, 1.0)  # nothing sent: nothing to wait for
            sender.setblocking(False)
            sent = 0
            with contextlib.suppress(BlockingIOError):
                while sent < 8 << 20:
                    sent += sender.send(bytes(1 << 16))
            sender.setblocking(True)
            began = time.monotonic()
            assert not socket_client.drain(sender, 64 * 1024, 0.3), "the peer has read nothing, yet drain returned"
            assert time.monotonic() - began >= 0.3
            got = 0

            def read() -> None:
                nonlocal got
                while got < sent:
                    got += len(peer.recv(1 << 20))

            reader = threading.Thread(target=read)
            reader.start()
            assert socket_client.drain(sender, 64 * 1024, 10.0)
            reader.join(10)
            assert got == sent > 64 * 1024


@pytest.mark.parametrize(
    ("host", "loopback"),
    [("127.0.0.1", True), ("127.3.4.5", True), ("::1", True), ("::ffff:127.0.0.1", True), ("10.213.77.20", False)]
    + [("::ffff:10.0.0.1", False), ("fe80::1%eth0", False), ("2001:db8::1", False)],
)
def test_a_peer_is_on_a_loopback_address(host: str, loopback: bool) -> None:
    assert socket_client.is_loopback(host) is loopback


# -- 2. raw frames over TCP ------------------------------------------------------------------------------------------


@pytest.mark.parametrize("dtype", [FLOAT32, BFLOAT16], ids=["float32", "bf16"])
def test_a_small_frame_goes_out_whole_through_partial_sends_and_many_pieces(dtype: int) -> None:
    # 1100 pieces (more buffers than one sendmsg may take: IOV_MAX is 1024) through a 4 KiB send buffer (many
    # partial sends).
    arrays = [np.arange(i, i + 100, dtype=np.float32) / 7 for i in range(1100)]
    head = b"frame head"
    a, b = socket.socketpair()
    with a, b:
        a.setsockopt(socket.SOL_SOCKET, socket.SO_SNDBUF, 4096)
        a.settimeout(10.0)  # as every data socket has: a non-blocking descriptor, which sends what fits
        got = bytearray()

        def drain() -> None:
            want = len(head) + frames.payload_bytes(arrays, dtype) + frames.END.size
            while len(got) < want:
                got.extend(b.recv(1000))

        reader = threading.Thread(target=drain)
        reader.start()
        frames.send_frame(a, head, arrays, dtype)
        reader.join(timeout=10)
    assert bytes(got) == head + b"".join(encode(x, dtype) for x in arrays) + frames.end_of(head)


def test_data_socket_hello_must_present_the_workers_ticket(raw: Raw) -> None:
    mine, theirs = ds.ticket(raw), ds.ticket(raw, OTHER)
    assert ds.attach(raw, mine) == ds.port(raw)[1]
    ds.attach(raw, theirs)
    cases = [
        (ds.ticket(raw), NOT_ATTACHED),  # a nonce never attached
        (ds.ticket(raw, nonce=theirs.nonce), NOT_ATTACHED),  # another worker's 16-byte ticket
        (ds.ticket(raw, OTHER, nonce=mine.nonce), NOT_ATTACHED),  # my ticket, claiming to be OTHER
        (ds.ticket(raw, nonce=mine.nonce[:15]), NOT_ATTACHED),
        (ds.ticket(raw, nonce=mine.nonce, name="1/3"), NOT_ATTACHED),  # a segment's name: no ticket has one
        (ds.ticket(raw, "stranger", nonce=mine.nonce), UNKNOWN_WORKER),
    ]
    for hello, want in cases:
        assert _refused_hello(raw, hello) == want, hello
    with ds.session(raw, mine) as bell:
        reply = ds.ok(bell.call(raw.request(pull=True)))
        assert (reply.pulled.version, reply.pulled.model_digest) == (0, raw.digest)
        assert reply.pulled.incarnation == raw.shard.incarnation
        assert bell.payload == raw.params().tobytes()


def test_a_payload_of_the_wrong_size_is_refused_and_the_connection_stays_in_step(raw: Raw) -> None:
    w0, before = raw.params(), raw.shard.state_bytes()
    with ds.session(raw) as bell:
        push = raw.request(push=True, step=1, base_version=0, pull=True, min_version=1)
        wrong = [
            (FLOAT32, ds.f32(GRAD[:-1])),  # one element short
            (FLOAT32, b""),  # a push with no gradient at all
            (FLOAT32, ds.f32(GRAD)[:-2]),  # no whole number of elements
            (FLOAT32, encode(GRAD, BFLOAT16)),  # bf16 bytes sent as float32
            (BFLOAT16, ds.f32(GRAD)),  # float32 bytes (the largest payload allowed) sent as bf16
        ]
        for dtype, payload in wrong:
            push.dtype = dtype
            status, kind, message = error(bell.call(push, payload=payload))
            assert (status, kind) == MALFORMED, (dtype, len(payload), message)
            assert f"{len(payload)} bytes" in message and bell.payload == b""
            assert raw.shard.state_bytes() == before
        # The same connection, in step: a correct push and pull.
        push.dtype = FLOAT32
        reply = ds.ok(bell.call(push, payload=ds.f32(GRAD)))
        assert (reply.version, reply.applied, reply.pulled.version) == (1, True, 1)
        assert np.array_equal(raw.params(), ds.sgd(w0, GRAD))
        assert bell.payload == raw.params().tobytes()
        # And in bf16: the gradient and the weights both travel as 2 bytes an element.
        w1 = raw.params()
        request = raw.request(push=True, step=2, base_version=1, pull=True, min_version=2, dtype=BFLOAT16)
        reply = ds.ok(bell.call(request, payload=encode(GRAD, BFLOAT16)))
        assert (reply.version, reply.applied, reply.pulled.version) == (2, True, 2)
        assert np.array_equal(raw.params(), ds.sgd(w1, GRAD))
        assert bell.payload == encode(raw.params(), BFLOAT16)


def test_a_gradient_cut_off_mid_payload_is_never_applied(raw: Raw) -> None:
    before = raw.shard.state_bytes()
    with ds.session(raw) as bell:
        push = raw.request(push=True, step=1, base_version=0)
        body, whole = push.SerializeToString(), ds.f32(GRAD)
        bell.sock.sendall(REQUEST_HEAD.pack(len(body), CALL_TIMEOUT, len(whole)) + body + whole[: len(whole) // 2])
        bell.sock.shutdown(socket.SHUT_WR)  # the worker's host goes away mid-gradient
        assert bell.reply() is None, "the shard answered a cut-off gradient instead of closing"
    assert raw.shard.state_bytes() == before
    # The shard serves on: a new connection's push applies.
    with ds.session(raw) as bell:
        reply = ds.ok(bell.call(raw.request(push=True, step=1, base_version=0), payload=ds.f32(GRAD)))
        assert (reply.version, reply.applied) == (1, True)


@pytest.mark.parametrize(("dtype", "bad"), [(FLOAT32, np.nan), (BFLOAT16, np.inf)], ids=["f32-nan", "bf16-inf"])
def test_a_non_finite_gradient_is_refused_and_changes_nothing(raw: Raw, dtype: int, bad: float) -> None:
    w0, before = raw.params(), raw.shard.state_bytes()
    grad = GRAD.copy()
    grad[3] = bad
    with ds.session(raw) as bell:
        request = raw.request(push=True, step=1, base_version=0, pull=True, min_version=1, dtype=dtype)
        status, kind, message = error(bell.call(request, payload=encode(grad, dtype)))
        assert (status, kind) == (INV.value[0], "NonFiniteGradient") and "NaN or Inf" in message
        assert raw.shard.state_bytes() == before and raw.shard.version == 0
        # Step 1 again, finite: applied (the refused push was never recorded), on the same connection.
        reply = ds.ok(bell.call(request, payload=encode(GRAD, dtype)))
        assert (reply.version, reply.applied) == (1, True)
        assert np.array_equal(raw.params(), ds.sgd(w0, GRAD))


def test_a_frame_announcing_more_than_the_model_is_too_large_and_ends_the_connection(raw: Raw) -> None:
    hello = ds.ticket(raw)
    ds.attach(raw, hello)
    before = raw.shard.state_bytes()
    body = raw.request(push=True, step=1, base_version=0).SerializeToString()
    for size in (raw.elements * 4 + 1, 1 << 40):
        ds.attach(raw, hello)  # a ticket proves one connection: each new one is attached anew
        with ds.session(raw, hello) as bell:
            bell.sock.sendall(REQUEST_HEAD.pack(len(body), CALL_TIMEOUT, size) + body)  # the header only
            reply = bell.reply()
            assert reply is not None, "the shard closed the connection without saying why"
            assert error(reply)[:2] == (grpc.StatusCode.RESOURCE_EXHAUSTED.value[0], "TooLarge"), size
            assert bell.closed_by_peer(), "the connection must end after a TooLarge frame"
        assert raw.shard.state_bytes() == before
    rejected = raw.shard.metrics.registry.get_sample_value(
        "paramserver_rejected_total", {"shard": "0", "reason": "TooLarge"}
    )
    assert rejected == 2
    ds.attach(raw, hello)
    with ds.session(raw, hello) as bell:  # attached again, a connection works again
        assert ds.ok(bell.call(raw.request(pull=True))).pulled.version == 0


def test_requests_the_data_socket_refuses_change_nothing_and_keep_the_connection(raw: Raw) -> None:
    ds.attach(raw, ds.ticket(raw, OTHER))  # OTHER is live and attached: only the connection's identity is wrong
    w0, before = raw.params(), raw.shard.state_bytes()
    grad = ds.f32(GRAD)
    denied = grpc.StatusCode.PERMISSION_DENIED.value[0]
    push = {"push": True, "step": 1, "base_version": 0}
    other_model = ps_pb2.ExchangeRequest(worker_id=WORKER, model_digest="0" * 64, pull=True, **push)
    cases = [
        (raw.request(pull=True), grad, MALFORMED, "without push"),
        (raw.request(pull=True), b"\0" * 4, MALFORMED, "without push"),
        (raw.request(pull=True, inline=True), b"", MALFORMED, "inline"),
        (raw.request(pull=True, inline=True, **push), grad, MALFORMED, "inline"),
        (raw.request(dtype=7, **push), grad, MALFORMED, "dtype"),
        (raw.request(OTHER, pull=True, **push), grad, (denied, ""), WORKER),
        (raw.request(OTHER, pull=True), b"", (denied, ""), WORKER),
        (other_model, grad, (FP.value[0], "ModelMismatch"), "0" * 12),
    ]
    with ds.session(raw) as bell:
        for request, payload, want, said in cases:
            status, kind, message = error(bell.call(request, payload=payload))
            assert (status, kind) == want and said in message, (request, message)
            assert bell.payload == b"" and raw.shard.state_bytes() == before
        reply = ds.ok(bell.call(raw.request(pull=True, min_version=1, **push), payload=grad))
        assert (reply.version, reply.applied, reply.pulled.version) == (1, True, 1)
        assert bell.payload == raw.params().tobytes() and np.array_equal(raw.params(), ds.sgd(w0, GRAD))


def test_socket_attach_refusals_attach_nothing(raw: Raw) -> None:
    cases = [
        (ds.ticket(raw, nonce=secrets.token_bytes(15)), INV, "InvalidArgument"),
        (ds.ticket(raw, nonce=secrets.token_bytes(17)), INV, "OutOfBounds"),  # past ps.proto's bound: not decoded
        (ds.ticket(raw, nonce=b""), INV, "InvalidArgument"),
        (ds.ticket(raw, elements=raw.elements + 1), INV, "InvalidArgument"),
        (ds.ticket(raw, elements=0), INV, "InvalidArgument"),
        (ds.ticket(raw, model_digest="0" * 64), FP, "ModelMismatch"),
        (ds.ticket(raw, "stranger"), ABORTED, "UnknownWorker"),
    ]
    model = raw.shard.model
    for ticket, code, kind in cases:
        assert raw.refused(lambda t=ticket: ds.attach(raw, t))[:2] == (code, kind), ticket
        with pytest.raises(NotAttached):
            raw.shard.attachments.get(WORKER, model)
        want = UNKNOWN_WORKER if ticket.worker_id == "stranger" else NOT_ATTACHED
        if len(ticket.nonce) > 16:
            want = (INV.value[0], "OutOfBounds")
        assert _refused_hello(raw, ticket) == want
    # A good ticket is taken; a second one replaces it.
    first, second = ds.ticket(raw), ds.ticket(raw)
    ds.attach(raw, first)
    assert raw.shard.attachments.get(WORKER, model) == Ticket(first.nonce, raw.elements)
    ds.attach(raw, second)
    assert _refused_hello(raw, first) == NOT_ATTACHED
    with ds.session(raw, second):
        pass


def test_a_worker_that_leaves_loses_its_ticket(raw: Raw) -> None:
    hello = ds.ticket(raw)
    ds.attach(raw, hello)
    with ds.session(raw, hello) as bell:  # connected before it leaves: the shard ends the connection
        before = raw.shard.state_bytes()
        raw.stub.Leave(ps_pb2.LeaveRequest(worker_id=WORKER), timeout=CALL_TIMEOUT)
        assert bell.closed_by_peer(), "the connection of a worker that left stayed open"
        assert _refused_hello(raw, hello) == UNKNOWN_WORKER
        # Back in the job, the ticket stays dropped.
        raw.stub.Join(ps_pb2.JoinRequest(worker_id=WORKER, job_name=JOB), timeout=CALL_TIMEOUT)
        assert _refused_hello(raw, hello) == NOT_ATTACHED
        assert raw.shard.state_bytes() == before
    ds.attach(raw, hello)
    with ds.session(raw, hello) as bell:
        assert ds.ok(bell.call(raw.request(pull=True))).pulled.version == 0


# -- 3. falling back to gRPC, and losing the connection ---------------------------------------------------------------


def test_a_shard_without_a_data_socket_refuses_the_attach_and_the_client_uses_grpc(
    ps_cluster_factory: Callable[..., LocalCluster],
) -> None:
    cluster = ps_cluster_factory(_config(data_socket=False), shards=2)
    assert [s.data_port for s in cluster.servers] == [0, 0]
    with _client(cluster) as client:
        _train(client, big_model())
        assert all(link.fallback is not None and link.transport.kind == "gRPC" for link in client.links)
    shard = cluster.shards[0]
    with grpc.insecure_channel(cluster.address) as channel:
        stub = ps_pb2_grpc.ParameterServerStub(channel)
        stub.Join(ps_pb2.JoinRequest(worker_id=WORKER, job_name=JOB), timeout=CALL_TIMEOUT)
        with pytest.raises(grpc.RpcError) as info:
            stub.Attach(ds.hello(WORKER, shard), timeout=CALL_TIMEOUT)
    assert refusal(info.value) == (FP, "DataSocketUnavailable")
    with pytest.raises(NotAttached):
        shard.attachments.get(WORKER, shard.model)


@pytest.mark.parametrize("how", ["listener-closed", "nothing-listens"])
def test_an_unreachable_data_socket_falls_back_to_grpc_with_a_warning(
    ps_cluster_factory: Callable[..., LocalCluster], caplog: pytest.LogCaptureFixture, how: str
) -> None:
    cluster = ps_cluster_factory(_config(), shards=2)
    server: ShardServer = cluster.servers[0]
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as blocker:  # bound, never listening: refused
        if how == "listener-closed":
            assert server._data is not None
            server._data.close()
        else:
            blocker.bind(("127.0.0.1", 0))
            server.servicer.data_port = blocker.getsockname()[1]
        port = server.data_port
        with caplog.at_level(logging.WARNING, logger="worker.client"), _client(cluster) as client:
            _train(client, big_model())
            assert [link.fallback is not None for link in client.links] == [True, False]
            assert [link.transport.kind for link in client.links] == ["gRPC", "data socket"]
    warnings = [
        r.getMessage() for r in caplog.records if r.name.startswith("worker.client") and r.levelno == logging.WARNING
    ]
    assert len(warnings) == 1, warnings
    assert f"127.0.0.1:{port}" in warnings[0] and "cannot be reached" in warnings[0]


def test_a_worker_on_grpc_tries_the_data_socket_again_and_leaves_grpc_once_it_is_reached(
    ps_cluster_factory: Callable[..., LocalCluster], caplog: pytest.LogCaptureFixture, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setattr(link_module, "RETRY_LINK_S", 0.5)
    cluster = ps_cluster_factory(_config(), shards=2)
    servicer = cluster.servers[0].servicer
    port = servicer.data_port
    model = big_model()
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as blocker:  # bound, never listening: refused
        blocker.bind(("127.0.0.1", 0))
        servicer.data_port = blocker.getsockname()[1]
        with caplog.at_level(logging.DEBUG, logger="worker.client"), _client(cluster) as client:
            client.register(model)
            client.push_pull(like(model, 1))
            assert [link.fallback is not None for link in client.links] == [True, False]
            assert client.links[0].transport.kind == "gRPC"
            time.sleep(0.6)  # past the first wait: the next step tries again, fails, and waits twice as long
            client.push_pull(like(model, 2))
            fallback = client.links[0].fallback
            assert client.links[0].transport.kind == "gRPC" and fallback is not None and fallback.wait >= 2.0
            servicer.data_port = port  # the port is open now: the next try, once the wait is over, reaches it
            client.push_pull(like(model, 3))
            assert client.links[0].transport.kind == "gRPC", "tried again before its wait was over"
            time.sleep(max(0.0, fallback.until - time.monotonic()) + 0.05)
            assert client.push_pull(like(model, 4)) == 4
            assert _on_data_socket(client)
            assert client.pull(model) == 4
    records = [r for r in caplog.records if r.name.startswith("worker.client")]
    warned = [r.getMessage() for r in records if r.levelno == logging.WARNING]
    assert len(warned) == 1 and "cannot be reached" in warned[0], warned  # told once, not at every try
    assert any(r.levelno == logging.INFO and "leaving gRPC" in r.getMessage() for r in records)


def test_a_worker_on_grpc_tries_the_data_socket_at_once_when_a_restarted_shard_forgot_it(
    ps_cluster_factory: Callable[..., LocalCluster], monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setattr(link_module, "RETRY_LINK_S", 600.0)  # no timed retry within the test
    cluster = ps_cluster_factory(_config(), shards=2)
    servicer = cluster.servers[0].servicer
    port = servicer.data_port
    model = big_model()
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as blocker:  # bound, never listening: refused
        blocker.bind(("127.0.0.1", 0))
        servicer.data_port = blocker.getsockname()[1]
        with _client(cluster) as client:
            client.register(model)
            assert client.push_pull(like(model, 1)) == 1
            assert [link.fallback is not None for link in client.links] == [True, False]
            servicer.data_port = port
            # What a restarted shard does: it no longer knows the worker, which joins again on its next call.
            cluster.shards[0].leave(client.worker_id)
            assert client.push_pull(like(model, 2)) == 2
            assert _on_data_socket(client), "the worker waited out its retry after re-joining a restarted shard"


def _cut(server: ShardServer) -> int:
    """Shut down the shard's side of every data-socket connection; return how many there were."""
    assert server._data is not None
    with server._data._lock:
        conns = list(server._data._conns)
    for conn in conns:
        conn.shutdown(socket.SHUT_RDWR)
    return len(conns)


@pytest.mark.parametrize("make", [small_model, big_model], ids=["small", "sliced"])
def test_a_lost_connection_is_attached_again_and_training_goes_on(
    ps_cluster_factory: Callable[..., LocalCluster], make: Callable[[], Model]
) -> None:
    cluster = ps_cluster_factory(_config(), shards=2)
    model = make()
    start, grads = clone(model), [like(model, s) for s in (1, 2, 3)]
    with _client(cluster) as client:
        client.register(model)
        assert client.push_pull(clone(grads[0])) == 1
        old = _transports(client)
        assert _cut(cluster.servers[0]) == 1
        g = clone(grads[1])
        assert client.push_pull(g) == 2
        _equal(g, local_sgd(start, grads[:2], 0.1))
        assert _on_data_socket(client) and _transports(client)[0] is not old[0] and _transports(client)[1] is old[1]
        old = _transports(client)
        assert [_cut(s) for s in cluster.servers] == [1, 1]
        g = clone(grads[2])
        assert client.push_pull(g) == 3
        _equal(g, local_sgd(start, grads, 0.1))
        assert _on_data_socket(client) and all(b is not o for b, o in zip(_transports(client), old, strict=True))
        assert [s.version for s in cluster.shards] == [3, 3]
        wait_for(
            lambda: [len(s._data._conns) for s in cluster.servers] == [1, 1], 30, "the cut connections to go", 0.05
        )


# -- 4. TLS, mutual TLS, the bearer token ------------------------------------------------------------------------------


def _answered(bell: Bell, hello: ps_pb2.AttachRequest) -> bytes:
    """Send a hello; return all the shard sends back before it ends the connection (b"": nothing)."""
    data = b""
    try:
        bell.send(hello)
        while chunk := bell.sock.recv(4096):
            data += chunk
    except (ConnectionError, ssl.SSLError):
        pass
    return data


@pytest.mark.parametrize("mutual", [False, True], ids=["tls", "mutual-tls"])
def test_the_data_socket_speaks_tls_when_the_grpc_port_does(
    ps_cluster_factory: Callable[..., LocalCluster], pki: dict[str, str], mutual: bool
) -> None:
    ca, cert, key = pki["ca"], pki["client_cert"] if mutual else None, pki["client_key"] if mutual else None
    config = _config(tls_cert=pki["server_cert"], tls_key=pki["server_key"], tls_ca=ca if mutual else None)
    cluster = ps_cluster_factory(config, shards=2)
    with _client(cluster, tls_ca=ca, tls_cert=cert, tls_key=key) as client:
        _train(client, small_model())
        assert _on_data_socket(client)
        assert all(c.tls for c in _connections(client))
    shard, address = cluster.shards[0], ("127.0.0.1", cluster.servers[0].data_port)
    read = [Path(f).read_bytes() if f else None for f in (ca, key, cert)]
    with grpc.secure_channel(cluster.address, grpc.ssl_channel_credentials(*read)) as channel:
        stub = ps_pb2_grpc.ParameterServerStub(channel)
        stub.Join(ps_pb2.JoinRequest(worker_id=WORKER, job_name=JOB), timeout=CALL_TIMEOUT)
        hello = ds.hello(WORKER, shard)
        assert stub.Attach(hello, timeout=CALL_TIMEOUT).data_port == address[1]
    with ds.bell(address) as bell:  # plaintext, even with the right ticket: no reply frame, the connection ends
        assert not _answered(bell, hello).startswith(REPLY_HEAD.pack(1, 0))
    if mutual:  # TLS without a client certificate: refused in the handshake, or right after it
        with (
            contextlib.suppress(ssl.SSLError, ConnectionError),
            ds.bell(address, client_ssl_context(ca, None, None)) as b,
        ):
            assert _answered(b, hello) == b""
    with ds.bell(address, client_ssl_context(ca, cert, key)) as bell:
        assert bell.call(hello) == bytes([OK_BYTE])
        request = ps_pb2.ExchangeRequest(worker_id=WORKER, model_digest=shard.model.digest, pull=True)
        assert ds.ok(bell.call(request)).pulled.version == 3
        assert bell.payload == shard.model.params.numpy().tobytes()


def test_a_tls_handshake_never_finished_is_let_go(
    ps_cluster_factory: Callable[..., LocalCluster], pki: dict[str, str], monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setattr(socket_server, "HANDSHAKE_TIMEOUT", 0.5)
    cluster = ps_cluster_factory(_config(tls_cert=pki["server_cert"], tls_key=pki["server_key"]), shards=1)
    data = cluster.servers[0]._data
    assert data is not None
    with ds.bell(("127.0.0.1", cluster.servers[0].data_port)) as bell:
        connected = time.monotonic()
        bell.sock.sendall(b"\x16\x03\x01")  # the start of a TLS record, never finished
        assert bell.closed_by_peer(), "the shard kept a connection that never finished its handshake"
        assert time.monotonic() - connected > 0.3  # held for the handshake's time limit, not refused at once
    wait_for(lambda: not data._conns, 30, "the shard to let the connection go", 0.05)


def test_a_peer_that_never_says_its_hello_is_let_go(
    ps_cluster_factory: Callable[..., LocalCluster], monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setattr(socket_server, "HANDSHAKE_TIMEOUT", 0.5)
    cluster = ps_cluster_factory(_config(), shards=1)
    data = cluster.servers[0]._data
    assert data is not None
    for sent in (b"", frames.REQUEST.pack(40, 1.0, 0)):  # nothing; a head whose message never comes
        with ds.bell(("127.0.0.1", cluster.servers[0].data_port)) as bell:
            connected = time.monotonic()
            bell.sock.sendall(sent)
            assert bell.closed_by_peer(), f"the shard kept a connection that sent {sent!r} and no hello"
            # Held for the hello's time limit (from its accept, just after the connect), not refused at once.
            assert time.monotonic() - connected > 0.3
        wait_for(lambda: not data._conns, 30, "the shard to let the connection go", 0.05)


def test_a_socket_attach_needs_the_bearer_token(
    ps_cluster_factory: Callable[..., LocalCluster], tmp_path: Path
) -> None:
    token = tmp_path / "token"
    token.write_text("s3cret-token\n")
    cluster = ps_cluster_factory(_config(auth_token_file=str(token)), shards=2)
    shard = cluster.shards[0]
    with _client(cluster, auth_token="s3cret-token") as client:
        _train(client, small_model())
        assert _on_data_socket(client)
        held = shard.attachments.get(client.worker_id, shard.model)
        with grpc.insecure_channel(cluster.address) as channel:
            stub = ps_pb2_grpc.ParameterServerStub(channel)
            for metadata in ((), (("authorization", "Bearer wrong-token"),)):
                with pytest.raises(grpc.RpcError) as info:
                    stub.Attach(ds.hello(client.worker_id, shard), timeout=CALL_TIMEOUT, metadata=metadata)
                assert refusal(info.value) == (grpc.StatusCode.UNAUTHENTICATED, "Unauthenticated"), metadata
        assert shard.attachments.get(client.worker_id, shard.model) is held, "a refused Attach replaced the ticket"
        model = small_model()
        client.register(model)
        assert client.push_pull(like(model, 9)) == 4 and _on_data_socket(client)
