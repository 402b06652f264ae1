"""The inline Exchange: a worker without a shared-memory segment (another host) whose part of the model on a shard
fits in one message sends its gradient and gets the weights back in one unary call per shard, when the shard
serves no data socket (or it cannot be reached).

Real shards on 127.0.0.1 (threads, so `Shard.state_bytes` can show that a refused call changed nothing); clients
with `shared_memory=False, data_socket=False` stand in for workers on another host without the data socket.
"""

from __future__ import annotations

from collections.abc import Callable

import grpc
import numpy as np
import pytest
import torch

from paramserver.config import ServerConfig
from paramserver.errors import ERROR_KEY, NonFiniteGradient
from paramserver.server.cluster import LocalCluster
from paramserver.v1 import ps_pb2, ps_pb2_grpc
from worker.client import INLINE_BYTES, PSClient

pytestmark = pytest.mark.timeout(60)

LR = 0.5
SGD = ServerConfig(mode="sync", workers=1, optimizer="sgd", lr=LR)


def _model() -> dict[str, torch.Tensor]:
    g = torch.Generator().manual_seed(1)
    return {
        "a.weight": torch.randn(300, 40, generator=g),
        "a.bias": torch.randn(40, generator=g),
        "b": torch.randn(7, generator=g),
    }


def _grads(step: int) -> dict[str, torch.Tensor]:
    g = torch.Generator().manual_seed(100 + step)
    return {name: torch.randn(t.shape, generator=g) for name, t in _model().items()}


def _states(cluster: LocalCluster) -> list[bytes]:
    return [s.shard.state_bytes() for s in cluster.servers]


def test_inline_steps_match_shared_memory_and_local_sgd(ps_cluster_factory: Callable[..., LocalCluster]) -> None:
    results = []
    for shared in (False, True):
        cluster = ps_cluster_factory(SGD, shards=2)
        weights = {k: v.clone() for k, v in _model().items()}
        with PSClient(cluster.address, shared_memory=shared, data_socket=False) as client:
            client.register(weights)
            placement = client.placement(weights)
            assert all(placement.shard_elements(k) * 4 <= INLINE_BYTES for k in range(2))
            for step in range(1, 4):
                assert client.push_pull(_grads(step)) == step
                client.pull(weights)
            assert (client.links[0].transport.kind == "shared memory") == shared
        results.append(weights)
    local = {k: v.clone() for k, v in _model().items()}
    for step in range(1, 4):
        for k, g in _grads(step).items():
            local[k].add_(g, alpha=-LR)  # what torch SGD does on the shard, in the same order
    for k in local:
        assert torch.equal(results[0][k], results[1][k]), k
        assert torch.equal(results[0][k], local[k]), k


def test_inline_bf16_wire_rounds_only_what_travels(ps_cluster_factory: Callable[..., LocalCluster]) -> None:
    cluster = ps_cluster_factory(SGD, shards=2)
    weights = {k: v.clone() for k, v in _model().items()}
    with PSClient(cluster.address, shared_memory=False, data_socket=False, dtype="bf16") as client:
        client.register(weights)
        client.push_pull(_grads(1))
        client.pull(weights)
    expected = {k: v - LR * _grads(1)[k].bfloat16().float() for k, v in _model().items()}
    for k in expected:
        torch.testing.assert_close(weights[k], expected[k].bfloat16().float(), rtol=0, atol=0)


def test_a_reader_that_did_not_join_pulls_inline(ps_cluster_factory: Callable[..., LocalCluster]) -> None:
    cluster = ps_cluster_factory(SGD, shards=2)
    with PSClient(cluster.address) as writer:
        writer.register(_model())
        writer.push_pull(_grads(1))
        with PSClient(cluster.address, join=False, shared_memory=False, data_socket=False) as reader:
            got = {k: torch.zeros_like(v) for k, v in _model().items()}
            assert reader.pull(got) == 1
    for k, v in _model().items():
        assert torch.equal(got[k], v - LR * _grads(1)[k])


@pytest.mark.parametrize("bad", [float("nan"), float("inf")])
def test_non_finite_inline_gradient_is_refused_and_changes_nothing(
    ps_cluster_factory: Callable[..., LocalCluster], bad: float
) -> None:
    cluster = ps_cluster_factory(ServerConfig(mode="sync", workers=1, optimizer="adam", lr=0.01), shards=2)
    with PSClient(cluster.address, shared_memory=False, data_socket=False) as client:
        client.register(_model())
        client.push_pull(_grads(1))
        before = _states(cluster)
        poisoned = _grads(2)
        for t in poisoned.values():
            t.view(-1)[3] = bad  # every tensor, so every shard has something to refuse
        with pytest.raises(NonFiniteGradient, match="NaN or Inf"):
            client.push_pull(poisoned)
        assert _states(cluster) == before
        assert client.push_pull(_grads(2)) == 2


def _raw(cluster: LocalCluster) -> tuple[PSClient, ps_pb2_grpc.ParameterServerStub, grpc.Channel, str]:
    client = PSClient(cluster.address, shared_memory=False, data_socket=False)
    client.register(_model())
    channel = grpc.insecure_channel(cluster.addresses[0])
    digest = client.digest(_model())
    return client, ps_pb2_grpc.ParameterServerStub(channel), channel, digest


def _refused(call: Callable[[], object]) -> tuple[grpc.StatusCode, str, str]:
    with pytest.raises(grpc.RpcError) as info:
        call()
    err = info.value
    named = dict(err.trailing_metadata() or ()).get(ERROR_KEY, "")  # type: ignore[attr-defined]
    return err.code(), named, err.details()  # type: ignore[attr-defined]


def test_malformed_inline_exchanges_are_refused_and_change_nothing(
    ps_cluster_factory: Callable[..., LocalCluster],
) -> None:
    cluster = ps_cluster_factory(SGD, shards=1)
    client, stub, channel, digest = _raw(cluster)
    try:
        pieces = client.placement(_model()).shards[0]
        ones = {p.name: np.ones(p.length, dtype="<f4") for p in pieces}

        def request(**changes: object) -> ps_pb2.ExchangeRequest:
            req = ps_pb2.ExchangeRequest(
                worker_id=client.worker_id, model_digest=digest, push=True, step=50, inline=True, dtype=ps_pb2.FLOAT32
            )
            for i, p in enumerate(pieces):
                req.chunks.add(piece=i, offset=0, data=ones[p.name].tobytes())
            for key, value in changes.items():
                if key == "chunks":
                    del req.chunks[:]
                    req.chunks.extend(value)  # type: ignore[arg-type]
                else:
                    setattr(req, key, value)
            return req

        before = _states(cluster)
        gap = [ps_pb2.Chunk(piece=0, offset=0, data=ones[pieces[0].name].tobytes())]  # the other pieces missing
        overlap = list(request().chunks) + [ps_pb2.Chunk(piece=0, offset=0, data=b"\0" * 8)]
        cases = [
            (request(chunks=gap), grpc.StatusCode.INVALID_ARGUMENT, "MalformedStream"),
            (request(chunks=overlap), grpc.StatusCode.INVALID_ARGUMENT, "MalformedStream"),
            (request(chunks=[ps_pb2.Chunk(piece=9, offset=0, data=b"\0" * 4)]), grpc.StatusCode.INVALID_ARGUMENT, ""),
            (request(push=False, pull=False), grpc.StatusCode.INVALID_ARGUMENT, "MalformedStream"),
            (
                request(chunks=[ps_pb2.Chunk(piece=0, offset=0, data=b"\0" * (5 << 20))]),
                grpc.StatusCode.RESOURCE_EXHAUSTED,
                "TooLarge",
            ),
            (request(model_digest="f" * 64), grpc.StatusCode.FAILED_PRECONDITION, "ModelMismatch"),
            (request(worker_id="nobody"), grpc.StatusCode.ABORTED, "UnknownWorker"),
            (request(dtype=99), grpc.StatusCode.INVALID_ARGUMENT, ""),
        ]
        for req, code, kind in cases:
            got_code, got_kind, details = _refused(lambda req=req: stub.Exchange(req, timeout=5))
            assert got_code == code, (details, req.chunks[:1])
            if kind:
                assert got_kind == kind, details
            assert details
            assert _states(cluster) == before, details
        # The same step, well formed, still applies: nothing of it was recorded by the refusals.
        reply = stub.Exchange(request(pull=True), timeout=5)
        assert reply.applied and reply.version == 1 and reply.pulled.version == 1
        assert len(reply.chunks) == len(pieces)
    finally:
        channel.close()
        client.close()


def test_an_inline_pull_that_would_not_fit_one_message_is_refused_as_too_large(
    ps_cluster_factory: Callable[..., LocalCluster],
) -> None:
    """A client in another language may ask any part inline: one whose weights cannot fit the reply is refused
    RESOURCE_EXHAUSTED (TooLarge, named) before anything happens, not failed by gRPC after the exchange ran."""
    config = ServerConfig(mode="sync", workers=1, optimizer="sgd", lr=LR, max_message_bytes=64 * 1024)
    cluster = ps_cluster_factory(config, shards=1)
    model = {"w": torch.zeros(20_000)}  # 80 KB of float32 on the one shard
    with PSClient(cluster.address, shared_memory=False, chunk_bytes=16 * 1024) as client:  # the data socket
        client.register(model)
        digest = client.digest(model)
    before = _states(cluster)
    with grpc.insecure_channel(cluster.address) as channel:
        stub = ps_pb2_grpc.ParameterServerStub(channel)
        with pytest.raises(grpc.RpcError) as info:
            stub.Exchange(ps_pb2.ExchangeRequest(model_digest=digest, pull=True, inline=True), timeout=30)
    assert info.value.code() == grpc.StatusCode.RESOURCE_EXHAUSTED
    assert dict(info.value.trailing_metadata())[ERROR_KEY] == "TooLarge"
    assert "Pull stream" in info.value.details()
    assert _states(cluster) == before
