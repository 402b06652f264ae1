"""Reliability: exactly-once pushes, nothing lost under concurrent load, leases and eviction, backup workers.

Real shards run as threads (`ps_cluster_factory`) so the tests can look inside them; the lease logic is also
driven directly on a `Shard`, with no sleeping. Gradients are small multiples of 1/16 and the optimizer is SGD
with lr=1, so every expected weight is exact in float32 and compared with `torch.equal`.
"""

from __future__ import annotations

import contextlib
import logging
import signal
import threading
import time
from collections.abc import Callable, Iterator, Sequence

import grpc
import numpy as np
import pytest
import torch
from support.waiting import wait_for

from paramserver.config import ServerConfig
from paramserver.errors import ERROR_KEY, InvalidArgument, StaleRound, UnknownWorker
from paramserver.placement import TensorSpec, place
from paramserver.server.cluster import LocalCluster
from paramserver.shard.pool import BufferPool
from paramserver.shard.state import Shard
from paramserver.v1 import ps_pb2, ps_pb2_grpc
from worker.client import PSClient

pytestmark = pytest.mark.timeout(30)

CALL_TIMEOUT = 10.0  # seconds for any RPC or client call against a local thread cluster
SIXTEENTH = 2.0**-4


# -- helpers ----------------------------------------------------------------------------------------------------


def _in_threads(fns: Sequence[Callable[[], None]], timeout: float = 30.0) -> None:
    """Run each fn in its own thread; re-raise the first failure; fail if one hangs."""
    errors: list[BaseException] = []

    def run(fn: Callable[[], None]) -> None:
        try:
            fn()
        except BaseException as exc:  # noqa: BLE001 - re-raised below
            errors.append(exc)

    threads = [threading.Thread(target=run, args=(fn,), name=f"test-{i}") for i, fn in enumerate(fns)]
    for t in threads:
        t.start()
    deadline = time.monotonic() + timeout
    for t in threads:
        t.join(max(0.0, deadline - time.monotonic()))
    assert not any(t.is_alive() for t in threads), "a test thread hung"
    if errors:
        raise errors[0]


def _sixteenths(shape: tuple[int, ...], base: int) -> torch.Tensor:
    """A tensor of multiples of 1/16 that differ per element: (base + i % 3) / 16."""
    n = int(torch.Size(shape).numel())
    return ((torch.arange(n) % 3 + base) * SIXTEENTH).reshape(shape)


@pytest.fixture
def channels() -> Iterator[Callable[[str], ps_pb2_grpc.ParameterServerStub]]:
    """Open raw stubs to shard addresses; every channel is closed after the test."""
    opened: list[grpc.Channel] = []

    def stub(address: str) -> ps_pb2_grpc.ParameterServerStub:
        channel = grpc.insecure_channel(address)
        opened.append(channel)
        return ps_pb2_grpc.ParameterServerStub(channel)

    try:
        yield stub
    finally:
        for channel in opened:
            channel.close()


def _push_messages(
    worker_id: str, step: int, base_version: int, digest: str, values: np.ndarray
) -> list[ps_pb2.PushMessage]:
    """A complete push of a one-piece shard."""
    header = ps_pb2.PushHeader(
        worker_id=worker_id, step=step, base_version=base_version, model_digest=digest, dtype=ps_pb2.FLOAT32
    )
    chunk = ps_pb2.Chunk(piece=0, offset=0, data=values.astype("<f4").tobytes())
    return [ps_pb2.PushMessage(header=header), ps_pb2.PushMessage(chunk=chunk)]


# -- exactly once ---------------------------------------------------------------------------------------------------


def test_a_retried_push_moves_the_weights_once(
    ps_cluster_factory: Callable[..., LocalCluster], channels: Callable[[str], ps_pb2_grpc.ParameterServerStub]
) -> None:
    cluster = ps_cluster_factory(ServerConfig(mode="async", workers=1, optimizer="sgd", lr=1.0), shards=1)
    shard = cluster.shards[0]
    digest = place([TensorSpec("w", (8,))], 1).digest
    initial = torch.arange(8, dtype=torch.float32)
    g5, g6 = _sixteenths((8,), 1), _sixteenths((8,), 5)
    with PSClient(cluster.address, worker_id="retrier", timeout=CALL_TIMEOUT) as client:
        model = {"w": initial.clone()}
        client.register(model)
        stub = channels(cluster.address)

        def push(step: int, grad: torch.Tensor) -> ps_pb2.PushResponse:
            messages = _push_messages("retrier", step, 0, digest, grad.numpy())
            return stub.Push(iter(messages), timeout=CALL_TIMEOUT)

        # Sequential retry: the second is acknowledged but not applied.
        first, again = push(5, g5), push(5, g5)
        assert (first.version, first.applied) == (1, True)
        assert (again.version, again.applied) == (1, False)

        # Four concurrent copies of one push: exactly one applies, whichever wins the lock.
        replies: list[ps_pb2.PushResponse] = []
        start = threading.Barrier(4)

        def racer() -> None:
            start.wait(5)
            replies.append(push(6, g6))

        _in_threads([racer] * 4)
        assert sorted(r.applied for r in replies) == [False, False, False, True]
        assert {r.version for r in replies if r.applied} == {2}

        # The client's own retry of step 5 is also recognised.
        assert client.push({"w": g5.clone()}, step=5) == 2

        assert client.pull(model) == 2
        assert torch.equal(model["w"], initial - g5 - g6)
    assert shard.describe().version == 2
    assert shard.describe().stats.duplicate_pushes == 1 + 3 + 1


def test_workers_registering_at_once_build_the_model_once(ps_cluster_factory: Callable[..., LocalCluster]) -> None:
    """Concurrent Inits of one shard: one builds the model, the others are told to retry (InitInProgress,
    UNAVAILABLE) and then adopt it; every worker ends with the same weights and nothing is applied twice."""
    config = ServerConfig(mode="async", workers=4, optimizer="sgd", lr=1.0)
    cluster = ps_cluster_factory(config, shards=2)
    big = {"w": torch.arange(600_000, dtype=torch.float32), "b": torch.ones(5)}  # Inits that take a while
    clients = [PSClient(cluster.address, timeout=CALL_TIMEOUT) for _ in range(4)]
    models = [{name: t.clone() + (i if name == "b" else 0) for name, t in big.items()} for i in range(4)]
    try:
        start = threading.Barrier(4)

        def registrar(i: int) -> Callable[[], None]:
            def run() -> None:
                start.wait(5)
                clients[i].register(models[i])

            return run

        _in_threads([registrar(i) for i in range(4)])
        winners = {float(m["b"][0]) for m in models}
        assert len(winners) == 1, "every worker must hold the one model the shards were initialised with"
        for m in models:
            assert torch.equal(m["w"], big["w"])
        for server in cluster.servers:
            assert server.shard.describe().version == 0
    finally:
        for client in clients:
            client.close()


def test_a_worker_kept_waiting_by_another_init_asks_again_soon_then_less_often(
    ps_cluster_factory: Callable[..., LocalCluster], monkeypatch: pytest.MonkeyPatch
) -> None:
    """While another worker's Init holds a shard, a registering worker asks again after 5 ms, then twice as long
    each time up to 0.1 s (a small model's Init is over in milliseconds, and a sync job's first round waits for
    its last worker to register); once the slot is free, it initialises the shard itself."""
    cluster = ps_cluster_factory(ServerConfig(mode="async", workers=1, optimizer="sgd", lr=1.0), shards=1)
    waits: list[float] = []
    real_sleep = time.sleep

    def sleep(seconds: float) -> None:
        waits.append(seconds)  # every thread's: nothing else in this process sleeps while the test waits
        real_sleep(seconds)

    monkeypatch.setattr(time, "sleep", sleep)  # the time module's own: the link's backoff reads it
    model = {"w": torch.arange(8, dtype=torch.float32)}
    with PSClient(cluster.address, timeout=CALL_TIMEOUT) as client:
        registered = threading.Event()

        def register() -> None:
            client.register(model)
            registered.set()

        with cluster.servers[0].shard.initialising():  # another worker's Init, as far as the shard can tell
            thread = threading.Thread(target=register, daemon=True)
            thread.start()
            deadline = time.monotonic() + CALL_TIMEOUT
            while len(waits) < 7 and time.monotonic() < deadline:
                registered.wait(0.01)
            assert not registered.is_set(), "registered while the shard's Init slot was held"
        thread.join(CALL_TIMEOUT)
        assert registered.is_set()
        assert waits[:7] == pytest.approx([0.005, 0.01, 0.02, 0.04, 0.08, 0.1, 0.1])
        assert cluster.servers[0].shard.describe().initialized
        assert torch.equal(model["w"], torch.arange(8, dtype=torch.float32))


def test_a_sync_worker_waits_past_the_pull_timeout_for_a_worker_that_joins_late(
    ps_cluster_factory: Callable[..., LocalCluster], caplog: pytest.LogCaptureFixture
) -> None:
    """Pods of one job may start minutes apart: the first worker's first round waits for the second to join,
    through pulls that the servers time out (here after 0.3 s), logging the wait, and trains on once it joins;
    no push of it is refused or lost."""
    from worker.train.trainer import TrainConfig, train

    config = ServerConfig(mode="sync", workers=2, optimizer="sgd", lr=0.1, pull_timeout=0.3)
    cluster = ps_cluster_factory(config, shards=2)
    metrics: dict[str, dict] = {}

    def worker(name: str) -> Callable[[], None]:
        def run() -> None:
            settings = TrainConfig(server=cluster.address, model="logreg", steps=3, progress=False, timeout=10.0)
            metrics[name] = train(settings)

        return run

    early = threading.Thread(target=worker("early"), daemon=True)
    with caplog.at_level(logging.WARNING, logger="worker.train.trainer"):
        early.start()
        policy = cluster.servers[0].shard.policy
        wait_for(policy.in_progress, 30, "the first worker's gradient to wait in round 0", 0.02)
        time.sleep(1.0)  # the duration under test: three pull timeouts and more
        assert early.is_alive(), "the first worker gave up before the second one joined"
        _in_threads([worker("late")])
        early.join(30)
    assert set(metrics) == {"early", "late"}
    for m in metrics.values():
        assert m["steps"] == 3 and m["stale_pushes"] == 0 and m["server_version"] == 3, m
    waits = [r.getMessage() for r in caplog.records if "still waiting for the round to close" in r.getMessage()]
    assert len(waits) >= 2 and "1 of its 2 workers" in waits[0], waits


def test_a_sync_worker_gives_up_on_a_round_after_its_round_timeout(
    ps_cluster_factory: Callable[..., LocalCluster],
) -> None:
    from paramserver.errors import PullTimeout
    from worker.train.trainer import TrainConfig, train

    config = ServerConfig(mode="sync", workers=2, optimizer="sgd", lr=0.1, pull_timeout=0.3)
    cluster = ps_cluster_factory(config, shards=1)
    settings = TrainConfig(server=cluster.address, model="logreg", steps=3, progress=False, round_timeout=1.0)
    started = time.monotonic()
    with pytest.raises(PullTimeout, match=r"--round-timeout 1\b.*1 of its 2 workers"):
        train(settings)
    assert time.monotonic() - started >= 1.0
    assert cluster.servers[0].shard.describe().version == 0


# -- nothing lost under load ----------------------------------------------------------------------------------------

LOAD_THREADS = 16
LOAD_SECONDS = 4.0
LOAD_MAX_PUSHES = 400  # per thread, in case the machine is fast
NAN_EVERY = 7  # every 7th push of a thread is a NaN gradient, refused by both shards
LOAD_SHAPES = {"emb": (64, 4), "fc.weight": (16, 4), "fc.bias": (16,)}


@pytest.mark.timeout(60)
def test_under_concurrent_load_every_acknowledged_push_is_applied_exactly_once(
    ps_cluster_factory: Callable[..., LocalCluster],
) -> None:
    config = ServerConfig(mode="async", workers=LOAD_THREADS, optimizer="sgd", lr=1.0)
    cluster = ps_cluster_factory(config, shards=2)
    initial = {name: _sixteenths(shape, 100) for name, shape in LOAD_SHAPES.items()}
    grads = [{name: _sixteenths(shape, i + 1) for name, shape in LOAD_SHAPES.items()} for i in range(LOAD_THREADS)]
    nan = {name: torch.full(shape, float("nan")) for name, shape in LOAD_SHAPES.items()}
    acked = [0] * LOAD_THREADS
    refused = [0] * LOAD_THREADS

    clients: list[PSClient] = []
    try:
        for _ in range(LOAD_THREADS):
            clients.append(PSClient(cluster.address, timeout=30.0))
        clients[0].register({name: t.clone() for name, t in initial.items()})
        deadline = time.monotonic() + LOAD_SECONDS

        def pusher(i: int) -> Callable[[], None]:
            def run() -> None:
                attempt = 0
                while time.monotonic() < deadline and attempt < LOAD_MAX_PUSHES:
                    attempt += 1
                    if attempt % NAN_EVERY == 0:
                        with pytest.raises(InvalidArgument, match="NaN"):
                            clients[i].push(nan)
                        refused[i] += 1
                    else:
                        clients[i].push(grads[i])
                        acked[i] += 1

            return run

        _in_threads([pusher(i) for i in range(LOAD_THREADS)], timeout=45.0)
    finally:
        for client in clients:
            client.close()

    assert all(n > 0 for n in acked), acked
    assert sum(refused) > 0
    expected = {
        name: (t.double() - sum(n * g[name].double() for n, g in zip(acked, grads, strict=True))).float()
        for name, t in initial.items()
    }
    pulled = {name: torch.zeros(shape) for name, shape in LOAD_SHAPES.items()}
    with PSClient(cluster.address, join=False, timeout=CALL_TIMEOUT) as reader:
        assert reader.pull(pulled) == sum(acked)
    for name in LOAD_SHAPES:
        assert torch.equal(pulled[name], expected[name]), name
    for shard in cluster.shards:
        status = shard.describe()
        assert status.version == sum(acked)  # each acknowledged push once, no refused one
        assert status.stats.duplicate_pushes == 0


# -- leases and eviction, driven directly (no sleeping) -------------------------------------------------------------


SHARD_SPECS = (TensorSpec("w", (4,)),)
SHARD_DIGEST = place(SHARD_SPECS, 1).digest


@contextlib.contextmanager
def _sync_job(workers: Sequence[str] = ("A", "B"), max_concurrent_pushes: int = 2) -> Iterator[Shard]:
    """A one-shard sync job of these workers, SGD lr=1, weights [1, 2, 3, 4], every worker joined in order."""
    config = ServerConfig(
        mode="sync",
        workers=len(workers),
        optimizer="sgd",
        lr=1.0,
        lease_timeout=10.0,
        max_concurrent_pushes=max_concurrent_pushes,
    )
    shard = Shard(config, 0, ("local:0",))
    try:
        model = shard.prepare_init(SHARD_SPECS, 1, SHARD_DIGEST)
        model.params.copy_(torch.tensor([1.0, 2.0, 3.0, 4.0]))
        shard.commit_init(model)
        for rank, worker_id in enumerate(workers):
            assert shard.join(worker_id, "") == (rank, 0)
        yield shard
    finally:
        shard.close()


@pytest.fixture
def sync_shard() -> Iterator[Shard]:
    """A one-shard sync job of 2 workers, SGD lr=1, weights [1, 2, 3, 4], both workers joined (A rank 0)."""
    with _sync_job() as shard:
        yield shard


def _grad(*sixteenths: float) -> np.ndarray:
    """A flat float32 gradient of these multiples of 1/16."""
    return (np.array(sixteenths, dtype=np.float64) * SIXTEENTH).astype(np.float32)


def _go_silent(shard: Shard, worker_id: str) -> None:
    """Backdate a worker's last RPC to just past the lease timeout: it has been silent that long."""
    shard.membership.get(worker_id).last_seen -= shard.config.lease_timeout + 1.0


def _tick(shard: Shard) -> None:
    # Shard.tick runs under the shard's lock, as its maintenance thread calls it (see its docstring).
    with shard._cond:
        shard.tick(now=time.monotonic())


def test_eviction_of_a_silent_worker_closes_the_pending_round(sync_shard: Shard) -> None:
    shard = sync_shard
    assert shard.push("A", 1, 0, _grad(1, 2, 3, 4), SHARD_DIGEST) == (0, True)
    assert shard.policy.in_progress() and shard.version == 0  # the round waits for B

    _go_silent(shard, "B")
    _tick(shard)

    status = shard.describe()
    assert status.version == 1, "the round closed with A's gradient alone"
    assert status.live_workers == 1 and shard.membership.live == {"A"}
    assert status.stats.evictions == 1
    after_round = torch.tensor([1.0, 2.0, 3.0, 4.0]) - torch.tensor([1.0, 2.0, 3.0, 4.0]) * SIXTEENTH
    assert torch.equal(shard.model.params, after_round)

    # The evicted worker's push is refused and changes nothing.
    before = shard.state_bytes()
    with pytest.raises(UnknownWorker, match="'B'.*join again"):
        shard.push("B", 1, 1, _grad(8, 8, 8, 8), SHARD_DIGEST)
    assert shard.state_bytes() == before

    # It joins again (its old rank is free) and takes part in the next round.
    assert shard.join("B", "") == (1, 1)
    assert shard.push("A", 2, 1, _grad(2, 2, 2, 2), SHARD_DIGEST) == (1, True)
    assert shard.push("B", 1, 1, _grad(4, 4, 4, 4), SHARD_DIGEST) == (2, True)
    assert torch.equal(shard.model.params, after_round - 3 * SIXTEENTH)  # the mean of 2/16 and 4/16
    assert shard.describe().stats.evictions == 1


def _push_lent(shard: Shard, worker_id: str, step: int, base: int, grad: np.ndarray) -> tuple[tuple[int, bool], int]:
    """Push as the network paths do, received into a scratch buffer; return (the answer, that buffer's address)."""
    with shard.scratch() as buf:
        buf[:] = grad
        return shard.push(worker_id, step, base, buf, SHARD_DIGEST, lent=True), buf.ctypes.data


def test_a_rounds_first_gradient_in_a_scratch_buffer_becomes_the_sum_and_buffers_never_alias(
    sync_shard: Shard,
) -> None:
    shard = sync_shard
    weights = torch.tensor([1.0, 2.0, 3.0, 4.0])
    for round_, (a, b) in enumerate([((1, 2, 3, 4), (3, 2, 1, 0)), ((8, 8, 8, 8), (0, 0, 0, 16))]):
        answer, first = _push_lent(shard, "A", round_ + 1, round_, _grad(*a))
        assert answer == (round_, True)
        held = shard.policy._sum  # type: ignore[attr-defined]
        assert held.data_ptr() == first, "the first gradient was copied, not kept as the round's sum"
        assert torch.equal(held, torch.from_numpy(_grad(*a)))
        # A refused push (a round it did not compute on) leaves the sum and the pool as they were.
        with pytest.raises(StaleRound):
            _push_lent(shard, "B", 99, round_ + 5, _grad(16, 16, 16, 16))
        answer, second = _push_lent(shard, "B", round_ + 1, round_, _grad(*b))
        assert answer == (round_ + 1, True)
        assert second != first, "the second gradient was received into the round's sum"
        weights -= (torch.from_numpy(_grad(*a)) + torch.from_numpy(_grad(*b))) / 2
        assert torch.equal(shard.model.params, weights)


def _blocks(take: Callable[[], object], seconds: float = 0.3) -> threading.Thread:
    """Start `take` in a thread; return the thread, asserting that it is still waiting after `seconds`."""
    thread = threading.Thread(target=take, daemon=True)
    thread.start()
    thread.join(seconds)
    assert thread.is_alive(), "a scratch buffer was lent past the pool's bound"
    return thread


def test_a_shard_holds_at_most_its_scratch_pool_with_the_rounds_sum_among_it() -> None:
    with _sync_job(("A", "B", "C")) as shard:
        weights = torch.tensor([1.0, 2.0, 3.0, 4.0])
        for round_ in range(2):
            assert _push_lent(shard, "A", round_ + 1, round_, _grad(3, 3, 3, 3))[0] == (round_, True)
            # The sum holds one of the 2 buffers: one push at a time may land in the other.
            with shard.scratch() as landing:
                landed = threading.Event()

                def second_landing(landed: threading.Event = landed) -> None:
                    with shard.scratch():
                        landed.set()

                waiter = _blocks(second_landing)
                landing[:] = _grad(6, 6, 6, 6)
                assert shard.push("B", round_ + 1, round_, landing, SHARD_DIGEST, lent=True) == (round_, True)
            waiter.join(5)
            assert landed.is_set(), "the landing buffer did not go back to the pool"
            assert _push_lent(shard, "C", round_ + 1, round_, _grad(9, 9, 9, 9))[0] == (round_ + 1, True)
            weights -= 6 * SIXTEENTH
            assert torch.equal(shard.model.params, weights)
            # The round applied: its sum went back, and both buffers may be lent at once again.
            with shard.scratch() as one, shard.scratch() as two:
                assert one.ctypes.data != two.ctypes.data


def test_a_pool_of_one_buffer_copies_the_first_gradient_and_never_waits_on_itself() -> None:
    with _sync_job(max_concurrent_pushes=1) as shard:
        done = threading.Event()

        def round_of_two() -> None:
            assert _push_lent(shard, "A", 1, 0, _grad(2, 2, 2, 2))[0] == (0, True)
            assert _push_lent(shard, "B", 1, 0, _grad(4, 4, 4, 4))[0] == (1, True)
            done.set()

        thread = threading.Thread(target=round_of_two, daemon=True)
        thread.start()
        thread.join(5)
        assert done.is_set(), "the second push waited for the buffer that the round's sum holds"
        assert torch.equal(shard.model.params, torch.tensor([1.0, 2.0, 3.0, 4.0]) - 3 * SIXTEENTH)


def test_a_kept_buffer_given_back_while_still_on_loan_returns_once_when_the_loan_ends() -> None:
    pool = BufferPool(2, 4)
    with pool.take() as first:
        pool.keep(first)
        pool.give_back(first)  # the round closed (in another thread) before this loan ended
        with pool.take() as second:
            assert second.ctypes.data != first.ctypes.data, "a buffer still on loan was lent again"
    with pool.take() as a, pool.take() as b:
        assert {a.ctypes.data, b.ctypes.data} == {first.ctypes.data, second.ctypes.data}
        _blocks(lambda: pool.take().__enter__())


def test_tick_keeps_workers_within_their_lease(sync_shard: Shard) -> None:
    shard = sync_shard
    shard.push("A", 1, 0, _grad(1, 1, 1, 1), SHARD_DIGEST)
    before = shard.state_bytes()

    _tick(shard)

    assert shard.membership.live == {"A", "B"}
    assert shard.describe().stats.evictions == 0
    assert shard.state_bytes() == before and shard.policy.in_progress()


def test_tick_can_be_called_without_holding_the_lock(sync_shard: Shard) -> None:
    shard = sync_shard
    shard.push("A", 1, 0, _grad(1, 1, 1, 1), SHARD_DIGEST)

    shard.tick(now=time.monotonic() + shard.config.lease_timeout + 1.0)

    assert shard.membership.live == set()


# -- leases with real time, through the RPCs ------------------------------------------------------------------------


def test_a_dead_worker_is_evicted_and_no_longer_blocks_the_sync_round(
    ps_cluster_factory: Callable[..., LocalCluster], channels: Callable[[str], ps_pb2_grpc.ParameterServerStub]
) -> None:
    config = ServerConfig(mode="sync", workers=2, optimizer="sgd", lr=1.0, lease_timeout=2.0)
    cluster = ps_cluster_factory(config, shards=2)
    initial = {"w": _sixteenths((6,), 10), "b": _sixteenths((3,), 20)}
    grad = {"w": _sixteenths((6,), 1), "b": _sixteenths((3,), 2)}
    model = {name: t.clone() for name, t in initial.items()}
    with PSClient(cluster.address, worker_id="alive", timeout=CALL_TIMEOUT) as alive:
        alive.register(model)
        # The dead worker joins every shard, then never speaks again (no heartbeat).
        for address in cluster.addresses:
            channels(address).Join(ps_pb2.JoinRequest(worker_id="dead"), timeout=CALL_TIMEOUT)
        assert alive.push(grad) == 0, "the round waits for the dead worker until its lease runs out"

        # The round closes once the lease runs out (well before the pull's own timeout, which would raise).
        assert alive.pull(model) == 1

    for name in initial:
        assert torch.equal(model[name], initial[name] - grad[name]), name
    for shard in cluster.shards:
        assert shard.describe().stats.evictions == 1
        assert "dead" not in shard.membership.live


@pytest.mark.timeout(60)
def test_heartbeats_keep_an_idle_worker_in_the_job(ps_cluster_factory: Callable[..., LocalCluster]) -> None:
    config = ServerConfig(mode="sync", workers=1, optimizer="sgd", lr=1.0, lease_timeout=2.0)
    cluster = ps_cluster_factory(config, shards=2)
    with PSClient(cluster.address, worker_id="idle", timeout=CALL_TIMEOUT):
        time.sleep(6.0)  # the duration under test: three lease timeouts without a single pull or push
        statuses = [s.describe() for s in cluster.shards]
    assert [s.live_workers for s in statuses] == [1, 1]
    assert [s.stats.evictions for s in statuses] == [0, 0]


def test_a_heartbeat_outage_is_logged_when_it_starts_and_when_it_ends(caplog: pytest.LogCaptureFixture) -> None:
    config = ServerConfig(mode="sync", workers=1, optimizer="sgd", lr=1.0, lease_timeout=3.0)
    with LocalCluster(config, shards=1, processes=True) as cluster:
        with (
            caplog.at_level(logging.DEBUG, logger="worker.client"),
            PSClient(cluster.address, timeout=CALL_TIMEOUT),
        ):
            cluster.kill(0, signal.SIGSTOP)  # the shard hears nothing and answers nothing: every heartbeat times out
            try:
                # The stall under test: two heartbeats or more (one every 2 s: a 1 s wait, then a 1 s timeout) fail.
                time.sleep(5.0)
            finally:
                cluster.kill(0, signal.SIGCONT)
            wait_for(
                lambda: any(f"{cluster.address} answered again" in r.getMessage() for r in caplog.records),
                30,
                "the client to log that the shard answered again",
                0.1,
            )
    # This client's lines (another test's client left in this process may log its own shards' outages).
    messages = [
        (r.levelno, r.getMessage())
        for r in caplog.records
        if r.name.startswith("worker.client") and cluster.address in r.getMessage()
    ]
    failed = [m for level, m in messages if "heartbeat to shard" in m and level == logging.WARNING]
    assert len(failed) == 1 and "lease timeout" in failed[0], messages
    assert sum("failed again" in m for _, m in messages) >= 1, messages  # the rest of the outage at debug level
    assert any(level == logging.INFO and "answered again" in m for level, m in messages), messages


def test_a_push_from_an_evicted_worker_is_aborted_and_changes_nothing(
    ps_cluster_factory: Callable[..., LocalCluster], channels: Callable[[str], ps_pb2_grpc.ParameterServerStub]
) -> None:
    # A lease no busy machine outlasts by accident: the eviction is the tick's, at a clock past it.
    config = ServerConfig(mode="sync", workers=1, optimizer="adam", lr=0.01, lease_timeout=600.0)
    cluster = ps_cluster_factory(config, shards=1)
    shard = cluster.shards[0]
    stub = channels(cluster.address)
    specs = (TensorSpec("w", (5,)),)
    digest = place(specs, 1).digest
    grad = np.linspace(-1.0, 1.0, 5, dtype=np.float32)
    stub.Join(ps_pb2.JoinRequest(worker_id="ghost"), timeout=CALL_TIMEOUT, wait_for_ready=True)
    header = ps_pb2.InitHeader(
        worker_id="ghost",
        specs=[ps_pb2.TensorSpec(name="w", shape=[5])],
        num_shards=1,
        model_digest=digest,
        dtype=ps_pb2.FLOAT32,
    )
    init = [
        ps_pb2.InitMessage(header=header),
        ps_pb2.InitMessage(chunk=ps_pb2.Chunk(piece=0, offset=0, data=np.ones(5, "<f4").tobytes())),
    ]
    stub.Init(iter(init), timeout=CALL_TIMEOUT)
    assert stub.Push(iter(_push_messages("ghost", 1, 0, digest, grad)), timeout=CALL_TIMEOUT).applied

    # Silent past its lease: the maintenance tick evicts it.
    shard.tick(now=time.monotonic() + 1200)
    assert shard.describe().stats.evictions == 1
    before = shard.state_bytes()

    with pytest.raises(grpc.RpcError) as info:
        stub.Push(iter(_push_messages("ghost", 2, 1, digest, grad)), timeout=CALL_TIMEOUT)

    assert info.value.code() == grpc.StatusCode.ABORTED, info.value.details()
    assert "'ghost'" in info.value.details() and "join again" in info.value.details()
    assert dict(info.value.trailing_metadata())[ERROR_KEY] == "UnknownWorker"
    assert shard.state_bytes() == before
    # Joining again recovers: the retried step 1 is still known (not applied twice), step 2 applies.
    stub.Join(ps_pb2.JoinRequest(worker_id="ghost"), timeout=CALL_TIMEOUT)
    retried = stub.Push(iter(_push_messages("ghost", 1, 1, digest, grad)), timeout=CALL_TIMEOUT)
    assert (retried.version, retried.applied) == (1, False)
    assert shard.state_bytes() == before
    fresh = stub.Push(iter(_push_messages("ghost", 2, 1, digest, grad)), timeout=CALL_TIMEOUT)
    assert (fresh.version, fresh.applied) == (2, True)


# -- backup workers -------------------------------------------------------------------------------------------------


def test_backup_worker_round_applies_without_the_straggler_and_refuses_it(
    ps_cluster_factory: Callable[..., LocalCluster],
) -> None:
    config = ServerConfig(mode="sync", workers=3, backup_workers=1, optimizer="sgd", lr=1.0)
    cluster = ps_cluster_factory(config, shards=2)
    shapes = {"w": (6,), "b": (2,)}
    initial = {name: _sixteenths(shape, 40) for name, shape in shapes.items()}
    grads = [{name: _sixteenths(shape, 2 * (i + 1)) for name, shape in shapes.items()} for i in range(3)]
    clients = [PSClient(cluster.address, worker_id=f"w{i}", timeout=CALL_TIMEOUT) for i in range(3)]
    try:
        models = [{name: t.clone() for name, t in initial.items()} for _ in clients]
        for client, model in zip(clients, models, strict=True):
            assert client.register(model) == 0

        assert clients[0].push(grads[0]) == 0, "one of three: the round waits"
        assert clients[1].push(grads[1]) == 1, "two of three with one backup worker: the round applies"
        after_round = [s.state_bytes() for s in cluster.shards]

        with pytest.raises(StaleRound, match="version 0.*version 1"):
            clients[2].push(grads[2])

        assert [s.state_bytes() for s in cluster.shards] == after_round
        assert clients[0].pull(models[0]) == 1
    finally:
        for client in clients:
            client.close()
    for name in shapes:
        mean = (grads[0][name] + grads[1][name]) / 2  # multiples of 1/16: exact
        assert torch.equal(models[0][name], initial[name] - mean), name
    for shard in cluster.shards:
        status = shard.describe()
        assert status.version == 1
        assert status.stats.late_pushes == 1
