"""Per-layer overlap: an exchange that starts during backward (PSClient.push_pull(backward=...), worker/client/feed.py,
ExchangeRequest.last_piece_first, ps-worker --overlap-backward).

Covered:
- training with the exchange following backward gives bit-identical weights to backward-then-exchange, in sync mode,
  over the data socket and shared memory, in float32 and bf16, for a model with a sliced tensor, BatchNorm buffers,
  a frozen parameter and a parameter the step does not use;
- the feed hands out the last layer's gradient while backward is still computing the first layer's (the order the
  push sends them in), and a backward that raises stops the pushes: nothing applies, the error reaches the caller,
  and the next exchange works;
- a last-first payload on a raw data socket applies as the same gradient in piece order; last_piece_first is refused
  INVALID_ARGUMENT (nothing changes) without push, with compression, on the doorbell and in a gRPC Exchange;
- ps-worker's trainer with --overlap-backward ends where it ends without, and says when the flag cannot apply.
"""

from __future__ import annotations

import logging
import threading
from collections.abc import Callable, Iterator
from concurrent import futures

import grpc
import numpy as np
import pytest
import torch
from support import data_socket as ds
from support.data_socket import GRAD, MALFORMED
from support.raw_job import OK_BYTE, Bell, Raw, error
from support.waiting import wait_for
from torch import nn

from paramserver.config import ServerConfig
from paramserver.placement import TensorSpec, place
from paramserver.server.cluster import LocalCluster
from paramserver.transport.socket_client import FrameClient
from paramserver.v1 import ps_pb2
from paramserver.wire.chunks import BFLOAT16, FLOAT32, encode
from worker.client import PSClient
from worker.client.binding import Binding, tensors_of
from worker.client.feed import BackwardFailed, GradientFeed
from worker.client.turns import Turns
from worker.train.config import TrainConfig
from worker.train.trainer import train

pytestmark = pytest.mark.timeout(120)

JOB = "overlap-backward"


class _Net(nn.Module):
    """A sliced layer (over both shards of a two-shard job), BatchNorm, a frozen parameter and one no step uses."""

    def __init__(self) -> None:
        super().__init__()
        torch.manual_seed(0)
        self.first = nn.Linear(64, 1100)
        self.norm = nn.BatchNorm1d(1100)
        self.big = nn.Linear(1100, 1024)
        self.last = nn.Linear(1024, 10)
        self.frozen = nn.Parameter(torch.ones(3), requires_grad=False)
        self.unused = nn.Parameter(torch.zeros(5))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.last(torch.relu(self.big(torch.relu(self.norm(self.first(x)))))) * self.frozen.sum() / 3


def _batches(steps: int) -> list[tuple[torch.Tensor, torch.Tensor]]:
    gen = torch.Generator().manual_seed(1)
    return [(torch.randn(16, 64, generator=gen), torch.randint(0, 10, (16,), generator=gen)) for _ in range(steps)]


def _backward(model: nn.Module, x: torch.Tensor, y: torch.Tensor) -> Callable[[], None]:
    def run() -> None:
        model.zero_grad(set_to_none=False)
        nn.functional.cross_entropy(model(x), y).backward()

    return run


def _trained(
    cluster: LocalCluster, follow: bool, shared_memory: bool, dtype: str, in_turn: bool
) -> dict[str, torch.Tensor]:
    model = _Net()
    with PSClient(
        cluster.address, job_name=JOB, shared_memory=shared_memory, dtype=dtype, push_in_turn=in_turn
    ) as client:
        client.register(model)
        kinds = {link.transport.kind for link in client.links}
        assert kinds == {"shared memory" if shared_memory else "data socket"}, kinds
        for x, y in _batches(3):
            if follow:
                client.push_pull(model, backward=_backward(model, x, y))
            else:
                _backward(model, x, y)()
                client.push_pull(model)
    return {k: v.clone() for k, v in model.state_dict().items()}


@pytest.mark.parametrize(
    ("shared_memory", "dtype", "in_turn"),
    [(False, "float32", False), (False, "bf16", True), (True, "float32", False)],
    ids=["socket", "bf16-in-turn", "shm"],
)
def test_an_exchange_during_backward_trains_exactly_as_one_after_it(
    ps_cluster_factory: Callable[..., LocalCluster], shared_memory: bool, dtype: str, in_turn: bool
) -> None:
    config = ServerConfig(mode="sync", workers=1, optimizer="sgd", lr=0.1, job_name=JOB)
    after = _trained(ps_cluster_factory(config, shards=2), False, shared_memory, dtype, in_turn)
    during = _trained(ps_cluster_factory(config, shards=2), True, shared_memory, dtype, in_turn)
    assert after.keys() == during.keys()
    for name, value in after.items():
        assert torch.equal(during[name], value), name
    start = _Net().state_dict()
    assert not torch.equal(during["big.weight"], start["big.weight"]), "nothing trained"
    assert not torch.equal(during["norm.running_mean"], start["norm.running_mean"]), "the buffers did not travel"
    assert torch.equal(during["frozen"], start["frozen"]) and torch.equal(during["unused"], start["unused"])


class _Hold(torch.autograd.Function):
    """The identity, whose backward (computed after the layers above it) waits until `released` is set."""

    released = threading.Event()

    @staticmethod
    def forward(ctx: object, t: torch.Tensor) -> torch.Tensor:
        return t.view_as(t)

    @staticmethod
    def backward(ctx: object, grad: torch.Tensor) -> torch.Tensor:
        assert _Hold.released.wait(30), "the last layer's gradient was not handed out while backward ran"
        return grad


def test_the_feed_hands_out_the_last_layer_while_backward_computes_the_first() -> None:
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(8, 16), nn.BatchNorm1d(16), nn.Linear(16, 4))
    x, y = torch.randn(5, 8), torch.randint(0, 4, (5,))
    names, tensors, buffer = tensors_of(model)
    specs = [TensorSpec(n, tuple(t.shape), b) for n, t, b in zip(names, tensors, buffer, strict=True)]
    binding = Binding(names, tensors, place(specs, 1), [None] * len(tensors))
    _Hold.released.clear()
    handed: list[np.ndarray] = []

    def take() -> None:
        for piece in feed.last_first(0):
            handed.append(piece.copy())
            if len(handed) == 3:  # the buffers' three, final once forward is over
                assert not _Hold.released.is_set()
            if len(handed) == 4:  # the last layer's bias, final while backward still waits in _Hold
                grad = model[2].bias.grad
                assert grad is not None and np.array_equal(piece, grad.numpy())
                _Hold.released.set()

    def backward() -> None:
        model.zero_grad(set_to_none=False)
        out = model[2](model[1](_Hold.apply(model[0](x))))
        nn.functional.cross_entropy(out, y).backward()

    with futures.ThreadPoolExecutor(1) as pool:
        feed = GradientFeed(binding, pool)
        taking = feed.submit(take)
        feed.run(backward)
        taking.result(timeout=30)
    assert len(handed) == len(tensors)
    want = [binding.gradient(i, of_module=True) for i in range(len(tensors))]
    assert all(np.array_equal(got, w) for got, w in zip(reversed(handed), want, strict=True))
    assert np.array_equal(handed[-1], model[0].weight.grad.numpy().reshape(-1))


@pytest.mark.parametrize("in_turn", [False, True], ids=["at-once", "in-turn"])
def test_the_client_sends_the_push_while_backward_is_still_computing(
    ps_cluster_factory: Callable[..., LocalCluster], monkeypatch: pytest.MonkeyPatch, in_turn: bool
) -> None:
    """Backward waits in its first layer until a piece of the push is on its way (a frame that streams); a client
    that exchanged after backward would leave it waiting (30 s, then the assertion in _Hold)."""
    sent = FrameClient.send_as_ready
    streamed: list[bool] = []

    def watched(self: FrameClient, request: ps_pb2.ExchangeRequest, timeout: float, arrays: Iterator[np.ndarray],
                size: int, dtype: int) -> None:  # fmt: skip
        streamed.append(request.last_piece_first)

        def pieces() -> Iterator[np.ndarray]:
            for array in arrays:
                _Hold.released.set()
                yield array

        sent(self, request, timeout, pieces(), size, dtype)

    monkeypatch.setattr(FrameClient, "send_as_ready", watched)
    config = ServerConfig(mode="sync", workers=1, optimizer="sgd", lr=0.1, job_name=JOB)
    cluster = ps_cluster_factory(config, shards=2)
    model = _Net()
    (x, y), *_ = _batches(1)
    with PSClient(cluster.address, job_name=JOB, shared_memory=False, push_in_turn=in_turn) as client:
        client.register(model)
        assert client.exchange_after_backward_because(model) == []
        _Hold.released.clear()

        def backward() -> None:
            model.zero_grad(set_to_none=False)
            out = model.last(torch.relu(model.big(torch.relu(model.norm(_Hold.apply(model.first(x)))))))
            nn.functional.cross_entropy(out, y).backward()

        assert client.push_pull(model, backward=backward) == 1
    assert streamed and all(streamed), streamed


def test_a_client_says_why_an_exchange_waits_for_backward(ps_cluster_factory: Callable[..., LocalCluster]) -> None:
    cluster = ps_cluster_factory(ServerConfig(mode="sync", workers=1, optimizer="sgd", lr=0.1), shards=2)
    small = nn.Linear(4, 3)
    with PSClient(cluster.address, shared_memory=False) as client:
        client.register(small)
        assert client.exchange_after_backward_because(small) == ["each shard's part fits one message"]
        assert client.exchange_after_backward_because(dict(small.named_parameters())) == [
            "a mapping's tensors are the gradient itself"
        ]
    with PSClient(cluster.address, shared_memory=False, compress="topk:0.1", join=False) as client:
        assert "compression encodes the whole part" in client.exchange_after_backward_because(small)


def test_a_feed_whose_backward_raises_fails_its_waiters() -> None:
    model = nn.Linear(3, 2)
    names, tensors, buffer = tensors_of(model)
    specs = [TensorSpec(n, tuple(t.shape), b) for n, t, b in zip(names, tensors, buffer, strict=True)]
    with futures.ThreadPoolExecutor(1) as pool:
        feed = GradientFeed(Binding(names, tensors, place(specs, 1), [None, None]), pool)
        waiting = feed.submit(lambda: list(feed.last_first(0)))
        with pytest.raises(ZeroDivisionError):
            feed.run(lambda: 1 / 0)
        with pytest.raises(BackwardFailed, match="division by zero"):
            waiting.result(timeout=30)
    assert not model.weight._post_accumulate_grad_hooks, "the feed's hooks stay on the model"


class _Fail(torch.autograd.Function):
    """The identity, whose backward fails."""

    @staticmethod
    def forward(ctx: object, t: torch.Tensor) -> torch.Tensor:
        return t.view_as(t)

    @staticmethod
    def backward(ctx: object, grad: torch.Tensor) -> torch.Tensor:
        raise RuntimeError("out of memory in the first layer")


def test_a_backward_that_raises_applies_nothing_and_the_next_exchange_works(
    ps_cluster_factory: Callable[..., LocalCluster],
) -> None:
    config = ServerConfig(mode="sync", workers=1, optimizer="sgd", lr=0.1, job_name=JOB)
    cluster = ps_cluster_factory(config, shards=2)
    model = _Net()
    (x, y), (x2, y2) = _batches(2)
    with PSClient(cluster.address, job_name=JOB, shared_memory=False) as client:
        client.register(model)
        before = [shard.state_bytes() for shard in cluster.shards]

        def broken() -> None:
            model.zero_grad(set_to_none=False)
            out = model.last(torch.relu(model.big(torch.relu(model.norm(_Fail.apply(model.first(x)))))))
            nn.functional.cross_entropy(out, y).backward()  # the last layers' pieces go, then the first layer fails

        with pytest.raises(RuntimeError, match="out of memory in the first layer"):
            client.push_pull(model, backward=broken)
        assert [shard.state_bytes() for shard in cluster.shards] == before
        assert client.push_pull(model, backward=_backward(model, x2, y2)) == 1
        assert all(shard.version == 1 for shard in cluster.shards)


# -- the wire ---------------------------------------------------------------------------------------------------------


def test_a_last_first_payload_applies_as_the_gradient_in_piece_order(raw: Raw) -> None:
    w0 = raw.params()
    # The raw job's model: fc.weight (12 elements), then fc.bias (3): last first is the bias, then the weight.
    with ds.session(raw) as bell:
        for step, dtype in ((1, FLOAT32), (2, BFLOAT16)):
            w = raw.params()
            request = raw.request(
                push=True, step=step, base_version=step - 1, pull=True, min_version=step, dtype=dtype,
                last_piece_first=True,
            )  # fmt: skip
            reply = ds.ok(bell.call(request, payload=encode(np.concatenate([GRAD[12:], GRAD[:12]]), dtype)))
            assert (reply.version, reply.applied) == (step, True)
            assert np.array_equal(raw.params(), ds.sgd(w, GRAD))
            assert bell.payload == encode(raw.params(), dtype), "the weights come back in piece order"
    assert not np.array_equal(raw.params(), w0)


def test_last_piece_first_is_refused_where_it_means_nothing_and_changes_nothing(raw: Raw) -> None:
    before = raw.shard.state_bytes()
    grad = encode(GRAD, FLOAT32)
    topk = ps_pb2.Compression(kind=ps_pb2.Compression.TOP_K, count=1)
    push = {"push": True, "step": 1, "base_version": 0, "last_piece_first": True}
    with ds.session(raw) as bell:
        for request, payload in (
            (raw.request(pull=True, last_piece_first=True), b""),
            (raw.request(compression=topk, **push), grad[:4] + np.zeros(1, dtype="<u4").tobytes()),
        ):
            status, kind, message = error(bell.call(request, payload=payload))
            assert (status, kind) == MALFORMED and "last_piece_first" in message, message
            assert raw.shard.state_bytes() == before
    # The doorbell: the part lies in the segment, in piece order.
    seg = raw.segment()
    seg.grad[:] = GRAD
    bell = Bell(raw.attach(seg).doorbell)
    try:
        assert bell.call(raw.hello(seg)) == bytes([OK_BYTE])
        status, kind, message = error(bell.call(raw.request(**push)))
        assert (status, kind) == MALFORMED and "last_piece_first" in message, message
    finally:
        bell.close()
    code, kind, message = raw.refused(lambda: raw.exchange(inline=True, chunks=[], **push))
    assert (code, kind) == (grpc.StatusCode.INVALID_ARGUMENT, "MalformedStream") and "last_piece_first" in message
    assert raw.shard.state_bytes() == before
    ds.attach(raw, ds.ticket(raw))  # the data socket still takes a plain push
    with ds.session(raw) as bell:
        assert ds.ok(bell.call(raw.request(push=True, step=1, base_version=0), payload=grad)).applied


# -- the trainer ------------------------------------------------------------------------------------------------------


def _train(cluster: LocalCluster, **changes: object) -> dict[str, float]:
    """One epoch of a 1.1 M-parameter MLP on digits (each shard's part over 1 MiB: it streams)."""
    fields: dict[str, object] = {"model": "bench.models:mlp1m", "dataset": "digits", "epochs": 1, **changes}
    config = TrainConfig(
        server=cluster.address, batch_size=64, shared_memory=False, progress=False, **fields,  # type: ignore[arg-type]
    )  # fmt: skip
    return train(config)


def test_the_trainer_overlapping_backward_ends_where_it_ends_without(
    ps_cluster_factory: Callable[..., LocalCluster], caplog: pytest.LogCaptureFixture
) -> None:
    config = ServerConfig(mode="sync", workers=1, optimizer="sgd", lr=0.05)
    without = _train(ps_cluster_factory(config, shards=2))
    with_it = _train(ps_cluster_factory(config, shards=2), overlap_backward=True)
    assert with_it["test_loss"] == without["test_loss"] and with_it["test_accuracy"] == without["test_accuracy"]
    with caplog.at_level(logging.WARNING, logger="worker.train.trainer"):
        _train(ps_cluster_factory(config, shards=2), overlap_backward=True, clip_grad_norm=1.0)
    assert "--overlap-backward does not apply (--clip-grad-norm" in caplog.text
    caplog.clear()
    with caplog.at_level(logging.WARNING, logger="worker.train.trainer"):
        _train(ps_cluster_factory(config, shards=2), overlap_backward=True, model="mlp")
    assert "--overlap-backward does not apply (each shard's part fits one message)" in caplog.text


def test_pushes_following_backward_take_the_link_a_piece_at_a_time_lowest_shard_first() -> None:
    turns = Turns(3, 30.0)
    turns.take(2)  # a free link: shard 2's first piece is final before the others'
    turns.take(2)  # its next piece too: it keeps the link
    order: list[int] = []

    def piece(k: int) -> None:
        turns.take(k)
        order.append(k)
        turns.give(k)

    waiting = [threading.Thread(target=piece, args=(k,)) for k in (1, 0)]
    for t in waiting:
        t.start()
    wait_for(lambda: len(turns._asking) >= 2, 30, "both to ask while shard 2 sends", 0.01)
    assert order == []
    turns.give(2)  # shard 2 waits for backward: the lowest shard asking goes first
    for t in waiting:
        t.join(30)
    assert order == [0, 1]
