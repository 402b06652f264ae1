"""The applied-push log (exactly-once delivery): which (worker, step) pairs a shard has already taken.

`AppliedLog` on its own: a retried step is recognised within the window; at most REMEMBERED_STEPS steps per worker
(the oldest recorded forgotten first) and REMEMBERED_WORKERS workers (the least recently pushing forgotten first);
its checkpoint form (dump, a checkpoint file, restore) round-trips. Then through a `Shard` built with its public
methods and through real shards and PSClient: the same step pushed twice is applied once, and a step that fell out
of the window is a new push again. The windows are made small with monkeypatch (the log reads the module's
constants at each record).
"""

from __future__ import annotations

from collections.abc import Callable, Iterator
from pathlib import Path

import numpy as np
import pytest
import torch

from paramserver.config import ServerConfig
from paramserver.errors import InvalidArgument
from paramserver.placement import TensorSpec, place
from paramserver.server.cluster import LocalCluster
from paramserver.shard import membership
from paramserver.shard.durability import checkpoint
from paramserver.shard.membership import AppliedLog
from paramserver.shard.state import Shard
from worker import PSClient

SPECS = (TensorSpec("w", (4,)), TensorSpec("b", (2,)))
DIGEST = place(SPECS, 1).digest
CLIENT_TIMEOUT = 60.0


@pytest.fixture
def small_windows(monkeypatch: pytest.MonkeyPatch) -> tuple[int, int]:
    """Remember 3 steps per worker and 3 workers; return (steps, workers)."""
    monkeypatch.setattr(membership, "REMEMBERED_STEPS", 3)
    monkeypatch.setattr(membership, "REMEMBERED_WORKERS", 3)
    return 3, 3


def _log(pushes: list[tuple[str, int]]) -> AppliedLog:
    """A log that recorded these (worker, step) pushes in this order."""
    log = AppliedLog()
    for worker, step in pushes:
        log.record(worker, step)
    return log


def _seen(log: AppliedLog, worker: str, steps: range | list[int]) -> list[int]:
    """The steps of `steps` the log recognises for `worker`."""
    return [s for s in steps if log.seen(worker, s)]


# -- AppliedLog ------------------------------------------------------------------------------------------------


def test_a_recorded_step_is_recognised_for_its_worker_only() -> None:
    log = _log([("a", 1), ("a", 2), ("b", 7)])
    assert log.seen("a", 1) and log.seen("a", 2) and log.seen("b", 7)
    assert not log.seen("a", 3) and not log.seen("a", 7), "another step of the same worker"
    assert not log.seen("b", 1), "the same step of another worker"
    assert not log.seen("c", 1) and not AppliedLog().seen("a", 1), "a worker never seen"


def test_the_default_window_recognises_every_step_of_a_long_run_until_it_is_full() -> None:
    steps = membership.REMEMBERED_STEPS
    assert steps >= 16, "far more than a worker ever has in flight"
    log = _log([("a", s) for s in range(1, steps + 1)])
    assert _seen(log, "a", range(1, steps + 1)) == list(range(1, steps + 1))
    log.record("a", steps + 1)
    assert not log.seen("a", 1) and log.seen("a", 2) and log.seen("a", steps + 1)


def test_a_worker_keeps_its_latest_steps_and_forgets_the_oldest_first(small_windows: tuple[int, int]) -> None:
    steps, _ = small_windows
    log = _log([("a", s) for s in range(1, 6)])
    assert _seen(log, "a", range(0, 8)) == [3, 4, 5]
    assert len(log.dump()["a"]) == steps
    # Oldest means recorded first, not the smallest step: a worker's step counter may restart (a new client).
    log = _log([("b", 10), ("b", 1), ("b", 5), ("b", 7)])
    assert _seen(log, "b", [1, 5, 7, 10]) == [1, 5, 7]
    assert log.dump() == {"b": [1, 5, 7]}


def test_the_log_forgets_the_least_recently_pushing_worker_first(small_windows: tuple[int, int]) -> None:
    _, workers = small_windows
    log = _log([("a", 1), ("b", 1), ("c", 1), ("a", 2)])  # a pushed again: b is now the least recent
    log.record("d", 1)
    assert sorted(log.dump()) == ["a", "c", "d"] and len(log.dump()) == workers
    assert not log.seen("b", 1), "b pushed least recently and should be forgotten"
    assert log.seen("a", 1) and log.seen("a", 2) and log.seen("c", 1) and log.seen("d", 1)
    log.record("e", 1)  # now c is the least recent
    assert sorted(log.dump()) == ["a", "d", "e"]
    # Many more workers than the window: only the last three remain.
    for k in range(100):
        log.record(f"w{k}", 1)
    assert list(log.dump()) == ["w97", "w98", "w99"]


def test_dump_and_restore_round_trip_with_the_order_that_decides_what_is_forgotten(
    small_windows: tuple[int, int],
) -> None:
    log = _log([("a", 1), ("b", 4), ("a", 2), ("c", 9), ("b", 5), ("a", 3), ("a", 4)])
    dumped = log.dump()
    assert dumped == {"c": [9], "b": [4, 5], "a": [2, 3, 4]}  # least recently pushing first, steps in order

    again = AppliedLog.restore(dumped)

    assert again.dump() == dumped
    for worker in ("a", "b", "c", "d"):
        assert _seen(again, worker, range(12)) == _seen(log, worker, range(12)), worker
    # Both forget the same things next: the same worker, and the same step.
    for copy in (log, again):
        copy.record("d", 1)
        copy.record("a", 5)
    assert again.dump() == log.dump() == {"b": [4, 5], "d": [1], "a": [3, 4, 5]}


def test_the_log_survives_a_checkpoint_file(tmp_path: Path) -> None:
    """The checkpoint form: dump -> Snapshot.applied -> file (JSON) -> load -> restore."""
    log = _log([("worker-a", 1), ("worker-b", 3), ("worker-a", 2), ("worker-a", 3)])
    shard = _shard(ServerConfig(mode="async", optimizer="sgd", lr=0.5))
    try:
        snap = shard.snapshot()
    finally:
        shard.close()
    snap.applied = log.dump()

    loaded = checkpoint.load(checkpoint.save(tmp_path, snap))

    assert loaded.applied == log.dump()
    assert AppliedLog.restore(loaded.applied).dump() == log.dump()


# -- through a Shard -------------------------------------------------------------------------------------------


def _shard(config: ServerConfig) -> Shard:
    """A one-shard job holding a 6-element model of zeros, with worker "w" joined (the caller closes it)."""
    shard = Shard(config, 0, ("127.0.0.1:1",))
    shard.commit_init(shard.prepare_init(SPECS, 1, DIGEST))
    shard.join("w", "")
    return shard


@pytest.fixture
def shard() -> Iterator[Shard]:
    """An async job of two workers (every push applies on arrival) with SGD, lr 1/2."""
    s = _shard(ServerConfig(mode="async", workers=2, optimizer="sgd", lr=0.5))
    try:
        yield s
    finally:
        s.close()


def _grad(value: float) -> np.ndarray:
    return np.full(6, value, dtype=np.float32)


def test_the_same_step_pushed_twice_is_applied_once(shard: Shard) -> None:
    assert shard.push("w", 1, 0, _grad(1.0), DIGEST) == (1, True)
    after = shard.state_bytes()

    assert shard.push("w", 1, 0, _grad(1.0), DIGEST) == (1, False)
    assert shard.push("w", 1, 1, _grad(3.0), DIGEST) == (1, False), "a retry is recognised by its step alone"

    assert shard.state_bytes() == after
    assert shard.describe().stats.duplicate_pushes == 2
    assert torch.equal(shard.require_model().params, torch.full((6,), -0.5))
    assert shard.push("w", 2, 1, _grad(1.0), DIGEST) == (2, True), "the next step is a new push"


def test_step_zero_names_no_push_and_is_refused(shard: Shard) -> None:
    before = shard.state_bytes()
    with pytest.raises(InvalidArgument, match="step starts at 1"):
        shard.push("w", 0, 0, _grad(1.0), DIGEST)
    assert shard.state_bytes() == before and shard.applied.dump() == {}


def test_another_worker_with_the_same_step_is_a_new_push(shard: Shard) -> None:
    shard.join("v", "")
    assert shard.push("w", 1, 0, _grad(1.0), DIGEST) == (1, True)
    assert shard.push("v", 1, 1, _grad(1.0), DIGEST) == (2, True)


def test_a_step_that_fell_out_of_the_window_applies_again(shard: Shard, small_windows: tuple[int, int]) -> None:
    steps, _ = small_windows
    for step in range(1, steps + 2):
        assert shard.push("w", step, step - 1, _grad(1.0), DIGEST) == (step, True)
    assert shard.push("w", steps + 1, steps + 1, _grad(1.0), DIGEST) == (steps + 1, False), "still in the window"
    # Step 1 was forgotten (the window holds the last `steps`): a retry that late counts as a new push.
    assert shard.push("w", 1, steps + 1, _grad(1.0), DIGEST) == (steps + 2, True)
    assert shard.describe().stats.duplicate_pushes == 1


def test_a_restored_shard_still_recognises_the_pushes_it_had_applied(tmp_path: Path) -> None:
    config = ServerConfig(mode="async", optimizer="sgd", lr=0.5, checkpoint_dir=str(tmp_path), checkpoint_every="0")
    first = _shard(config)
    try:
        for step in (1, 2, 3):
            assert first.push("w", step, step - 1, _grad(1.0), DIGEST) == (step, True)
        saved, log = first.state_bytes(), first.applied.dump()
    finally:
        first.close()  # writes the final checkpoint
    again = Shard(config, 0, ("127.0.0.1:1",))
    try:
        assert again.restore() is True
        assert again.applied.dump() == log == {"w": [1, 2, 3]}
        again.join("w", "")
        assert again.push("w", 3, 2, _grad(1.0), DIGEST) == (3, False)
        assert again.state_bytes() == saved
    finally:
        again.close()


# -- through real shards and PSClient ----------------------------------------------------------------------------


def _model() -> dict[str, torch.Tensor]:
    return {"w": torch.zeros(8), "b": torch.zeros(3)}


def _ones() -> dict[str, torch.Tensor]:
    return {"w": torch.ones(8), "b": torch.ones(3)}


def test_a_client_pushing_the_same_step_twice_moves_the_version_once(ps_cluster: LocalCluster) -> None:
    model = _model()
    with PSClient(ps_cluster.address, timeout=CLIENT_TIMEOUT) as client:
        client.register(model)
        assert client.push(_ones(), step=5) == 1
        after = [s.state_bytes() for s in ps_cluster.shards]

        assert client.push(_ones(), step=5) == 1, "a retried step must not apply again"

        assert [s.state_bytes() for s in ps_cluster.shards] == after
        assert [s.describe().stats.duplicate_pushes for s in ps_cluster.shards] == [1, 1]
        assert client.pull(model) == 1
        assert torch.equal(model["w"], torch.full((8,), -0.1)) and torch.equal(model["b"], torch.full((3,), -0.1))
        assert client.push(_ones(), step=6) == 2


def test_a_client_step_that_fell_out_of_the_window_applies_again(
    ps_cluster_factory: Callable[..., LocalCluster], small_windows: tuple[int, int]
) -> None:
    steps, _ = small_windows
    # A pull_timeout short enough that a step wrongly taken as a retry fails soon (no new version would come).
    cluster = ps_cluster_factory(ServerConfig(mode="sync", workers=1, optimizer="sgd", lr=0.1, pull_timeout=10))
    model = _model()
    with PSClient(cluster.address, timeout=CLIENT_TIMEOUT) as client:
        client.register(model)
        for step in range(1, steps + 2):
            assert client.push_pull(_ones(), step=step) == step
        assert client.push(_ones(), step=steps + 1) == steps + 1, "the latest step is still remembered"
        assert client.push_pull(_ones(), step=1) == steps + 2, "step 1 is forgotten: a new push"
    assert [s.describe().stats.duplicate_pushes for s in cluster.shards] == [1, 1]


def test_a_pull_after_a_push_of_an_old_step_returns_the_current_weights(
    ps_cluster_factory: Callable[..., LocalCluster],
) -> None:
    cluster = ps_cluster_factory(ServerConfig(mode="sync", workers=1, optimizer="sgd", lr=0.1, pull_timeout=2))
    model = _model()
    with PSClient(cluster.address, timeout=CLIENT_TIMEOUT) as client:
        client.register(model)
        assert client.push_pull(_ones(), step=1) == 1
        assert client.push_pull(_ones(), step=2) == 2
        assert client.push(_ones(), step=1) == 2, "step 1 was applied already: not again"
        assert client.pull(model) == 2
        again = _ones()
        assert client.push_pull(again, step=2) == 2, "a retried step in one exchange: its pull does not wait"
        assert torch.equal(again["w"], model["w"])
    assert torch.equal(model["w"], torch.full((8,), -0.2))


def test_the_applied_log_is_bounded_in_workers_on_a_real_shard(
    ps_cluster_factory: Callable[..., LocalCluster], small_windows: tuple[int, int]
) -> None:
    """Workers that come and go (each a new id) never grow the log past REMEMBERED_WORKERS."""
    _, workers = small_windows
    cluster = ps_cluster_factory(ServerConfig(mode="async", workers=1, optimizer="sgd", lr=0.1), shards=1)
    for k in range(workers + 2):
        with PSClient(cluster.address, worker_id=f"worker-{k}", timeout=CLIENT_TIMEOUT) as client:
            if k == 0:
                client.register(_model())
            client.push(_ones(), step=1)
    (shard,) = cluster.shards
    assert list(shard.applied.dump()) == [f"worker-{k}" for k in range(2, workers + 2)]
    assert shard.describe().version == workers + 2
