"""Bounded staleness: ssp mode holds a worker that runs too far ahead at its pull; --max-staleness refuses pushes
computed on weights that are too old (async and ssp).

Real shards in threads on 127.0.0.1 (so `Shard.state_bytes` shows that a refused push changed nothing).
"""

from __future__ import annotations

import threading
from collections.abc import Callable, Iterator
from contextlib import contextmanager

import pytest
import torch

from paramserver import ServerConfig
from paramserver.errors import PullTimeout, StaleRound
from paramserver.server.cluster import LocalCluster
from paramserver.v1 import ps_pb2
from worker import PSClient

HELD_S = 0.4  # how long a held pull must stay held to count as held
DONE_S = 60.0  # how long a pull that must not be held may take on a heavily loaded machine


def _model() -> dict[str, torch.Tensor]:
    return {"w": torch.zeros(8), "b": torch.zeros(3)}


def _grad(value: float) -> dict[str, torch.Tensor]:
    return {"w": torch.full((8,), value), "b": torch.full((3,), value)}


@contextmanager
def _clients(cluster: LocalCluster, n: int) -> Iterator[list[PSClient]]:
    clients = [PSClient(cluster.address, timeout=30.0) for _ in range(n)]
    try:
        clients[0].register(_model())
        for c in clients[1:]:
            c.register(_model())
        yield clients
    finally:
        for c in clients:
            c.close()


class Step:
    """One push then pull (only the pull when `value` is None) in a thread of its own, so a test can see whether
    the shard holds it."""

    def __init__(self, client: PSClient, value: float | None) -> None:
        self.model = _model()
        self.version: int | None = None
        self.error: BaseException | None = None
        self._thread = threading.Thread(target=self._run, args=(client, value), daemon=True)
        self._thread.start()

    def _run(self, client: PSClient, value: float | None) -> None:
        try:
            if value is not None:
                client.push(_grad(value))
            self.version = client.pull(self.model)
        except BaseException as exc:  # noqa: BLE001 - reported by done()
            self.error = exc

    def done(self, timeout: float) -> bool:
        self._thread.join(timeout)
        if self.error is not None:
            raise self.error
        return not self._thread.is_alive()


def _ssp(staleness: int, workers: int = 2, **changes: object) -> ServerConfig:
    return ServerConfig(mode="ssp", workers=workers, optimizer="sgd", lr=0.1, staleness=staleness, **changes)  # type: ignore[arg-type]


def test_a_worker_too_far_ahead_waits_at_its_pull_until_the_slowest_catches_up(
    ps_cluster_factory: Callable[..., LocalCluster],
) -> None:
    cluster = ps_cluster_factory(_ssp(staleness=1), shards=2)
    with _clients(cluster, 2) as (fast, slow):
        assert fast.mode == "ssp"
        assert Step(fast, 1.0).done(5), "one push ahead is within the bound"
        held = Step(fast, 1.0)  # two ahead of `slow`, which has pushed nothing
        assert not held.done(HELD_S), "a worker 2 pushes ahead of the slowest (staleness 1) was not held"
        # Every push applied on arrival all the same (async semantics): both of fast's are in the weights.
        assert [s.version for s in cluster.shards] == [2, 2]
        Step(slow, 1.0).done(5)
        assert held.done(5), "the held pull did not return once the slowest worker caught up"
        assert held.version is not None and held.version >= 2
        torch.testing.assert_close(held.model["w"], torch.full((8,), -0.1 * 3))


def test_a_held_pull_goes_on_when_the_slowest_worker_leaves(ps_cluster_factory: Callable[..., LocalCluster]) -> None:
    cluster = ps_cluster_factory(_ssp(staleness=0), shards=1)
    with _clients(cluster, 2) as (fast, slow):
        held = Step(fast, 1.0)
        assert not held.done(HELD_S)
        slow.leave()
        assert held.done(5), "leaving did not release the worker held behind it"
        # Alone now, the worker is its own slowest: it never waits.
        for _ in range(3):
            assert Step(fast, 1.0).done(5)


def test_a_worker_that_joins_starts_at_the_slowest_clock(ps_cluster_factory: Callable[..., LocalCluster]) -> None:
    cluster = ps_cluster_factory(_ssp(staleness=1, workers=3), shards=1)
    with _clients(cluster, 2) as (a, b):
        for _ in range(4):
            assert Step(a, 1.0).done(5) and Step(b, 1.0).done(5)
        with PSClient(cluster.address, timeout=30.0) as late:
            late.register(_model())
            # The newcomer has pushed nothing, but counts as 4: a is not held behind it.
            assert Step(a, 1.0).done(5)
            assert not Step(a, 1.0).done(HELD_S), "6 pushes against the slowest's 4 (staleness 1) must wait"


def test_a_held_pull_times_out_naming_what_it_waits_for(ps_cluster_factory: Callable[..., LocalCluster]) -> None:
    cluster = ps_cluster_factory(_ssp(staleness=0, pull_timeout=0.3), shards=1)
    with _clients(cluster, 2) as (fast, _slow):
        fast.push(_grad(1.0))
        with pytest.raises(PullTimeout, match=r"held worker .* pull .*slowest live workers"):
            fast.pull(_model())


@pytest.mark.parametrize("mode", ["async", "ssp"])
def test_max_staleness_refuses_a_push_on_weights_too_old_and_changes_nothing(
    ps_cluster_factory: Callable[..., LocalCluster], mode: str
) -> None:
    config = ServerConfig(mode=mode, workers=2, optimizer="sgd", lr=0.1, staleness=10, max_staleness=1)
    cluster = ps_cluster_factory(config, shards=1)
    shard = cluster.shards[0]
    with _clients(cluster, 2) as (a, b):
        b.pull(_model())  # b computes on version 0
        a.push(_grad(1.0))
        b.push(_grad(2.0))  # 1 version old: within the bound
        a.pull(_model())
        a.push(_grad(1.0))
        assert shard.version == 3
        before = shard.state_bytes()
        # b's next push still names version 0: 3 versions old.
        with pytest.raises(StaleRound, match=r"3 versions old, over the job's --max-staleness 1"):
            b.push(_grad(5.0))
        assert shard.state_bytes() == before
        assert shard.stats.late_pushes == 1
        b.pull(_model())
        b.push(_grad(5.0))  # on fresh weights it applies
        assert shard.version == 4


def test_the_job_announces_ssp_and_refuses_negative_bounds() -> None:
    assert ps_pb2.SSP == 3
    for bad in ({"staleness": -1}, {"max_staleness": -2}):
        with pytest.raises(ValueError, match="must be >= 0"):
            ServerConfig(mode="ssp", **bad)  # type: ignore[arg-type]


@pytest.mark.parametrize(
    "config",
    [
        pytest.param(ServerConfig(mode="async", workers=2, optimizer="sgd", lr=0.1), id="async"),
        # In sync mode a worker can run ahead of another only where a round closes without it: a backup worker.
        pytest.param(ServerConfig(mode="sync", workers=2, backup_workers=1, optimizer="sgd", lr=0.1), id="sync"),
    ],
)
def test_sync_and_async_never_hold_a_pull(
    ps_cluster_factory: Callable[..., LocalCluster], config: ServerConfig
) -> None:
    """Only ssp holds a worker that runs ahead of the others: here, with `slow` pushing nothing, `fast` goes 5
    versions ahead and each of its pulls returns the version its push made (ssp with staleness 0 would hold the
    first until its pull_timeout), and `slow`, 5 versions behind, is not held either."""
    cluster = ps_cluster_factory(config, shards=1)
    with _clients(cluster, 2) as (fast, slow):
        assert fast.mode == config.mode
        for k in range(1, 6):
            step = Step(fast, 1.0)
            assert step.done(DONE_S), f"{config.mode}: the pull of step {k} was held"
            assert step.version == k == cluster.shards[0].version
            torch.testing.assert_close(step.model["w"], torch.full((8,), -0.1 * k))
        # The worker left 5 versions behind gets the newest weights at once.
        behind = Step(slow, None)
        assert behind.done(DONE_S) and behind.version == 5
        torch.testing.assert_close(behind.model["b"], torch.full((3,), -0.5))


def test_sync_holds_a_pull_only_until_the_version_it_asks_for(
    ps_cluster_factory: Callable[..., LocalCluster],
) -> None:
    """Sync without backup workers: a worker's pull after its push waits for its round to close (that version does
    not exist yet), never longer; a pull of a version that exists returns at once, round open or not."""
    cluster = ps_cluster_factory(ServerConfig(mode="sync", workers=2, optimizer="sgd", lr=0.1), shards=1)
    with _clients(cluster, 2) as (fast, slow):
        waiting = Step(fast, 1.0)
        assert not waiting.done(HELD_S), "round 1 cannot close before slow pushes"
        reader = Step(slow, None)  # slow has version 0, all it asks for
        assert reader.done(DONE_S) and reader.version == 0, "an open round held a pull of a version that exists"
        assert not waiting.done(0)
        closing = Step(slow, 3.0)
        assert closing.done(DONE_S) and waiting.done(DONE_S), "the round closed but its pulls were held"
        for step in (waiting, closing):
            assert step.version == 1
            torch.testing.assert_close(step.model["w"], torch.full((8,), -0.1 * (1.0 + 3.0) / 2))
