"""A pull returns the weights of one version, even while other workers' pushes apply during the transfer (async
mode: no round holds them back). Every path that sends weights from the shard's memory is covered: the data
socket, the Pull stream and the inline Exchange.

The model makes a torn read visible: SGD with lr 1 on a gradient of ones moves every element by -1 per version, so
the weights of version v are exactly -v everywhere, and any mix of two versions shows as unequal elements.
"""

from __future__ import annotations

import threading
from collections.abc import Callable

import pytest
import torch

from paramserver import ServerConfig
from paramserver.server.cluster import LocalCluster
from worker import PSClient

BIG = 4_000_000  # 16 MB: each pull takes several milliseconds, while pushes apply in between
SMALL = 50_000  # inline: one unary Exchange


def _pull_while_pushing(cluster: LocalCluster, numel: int, **reader: object) -> list[tuple[int, float, float]]:
    """(version, min, max) of the weights of each pull taken while another worker pushes all along."""
    stop = threading.Event()
    errors: list[BaseException] = []

    def push() -> None:
        try:
            with PSClient(cluster.address, data_socket=False, shared_memory=False) as pusher:
                ones = {"w": torch.ones(numel)}
                while not stop.is_set():
                    pusher.push(ones)
        except BaseException as exc:  # noqa: BLE001 - reported below
            errors.append(exc)

    seen = []
    with PSClient(cluster.address, worker_id="registrar", shared_memory=False) as registrar:
        registrar.register({"w": torch.zeros(numel)})
    with PSClient(cluster.address, shared_memory=False, **reader) as client:  # type: ignore[arg-type]
        thread = threading.Thread(target=push, daemon=True)
        thread.start()
        try:
            model = {"w": torch.empty(numel)}
            while len(seen) < 12 or seen[-1][0] < 8:
                version = client.pull(model)
                seen.append((version, float(model["w"].min()), float(model["w"].max())))
                assert len(seen) < 500, "the pusher made no progress"
        finally:
            stop.set()
            thread.join(timeout=30)
    assert not errors, errors
    return seen


@pytest.mark.parametrize(
    ("numel", "reader"),
    [
        pytest.param(BIG, {}, id="data-socket"),
        pytest.param(BIG, {"data_socket": False}, id="pull-stream"),
        pytest.param(SMALL, {"data_socket": False}, id="inline"),
        pytest.param(BIG, {"join": False}, id="reader-that-did-not-join"),
    ],
)
def test_a_pull_returns_one_version_while_pushes_apply(
    ps_cluster_factory: Callable[..., LocalCluster], numel: int, reader: dict[str, object]
) -> None:
    cluster = ps_cluster_factory(ServerConfig(mode="async", workers=3, optimizer="sgd", lr=1.0), shards=1)
    seen = _pull_while_pushing(cluster, numel, **reader)
    torn = [(v, lo, hi) for v, lo, hi in seen if lo != hi]
    assert not torn, f"pulls mixed versions (version, min, max): {torn[:5]}"
    wrong = [(v, lo) for v, lo, _ in seen if lo != -float(v)]
    assert not wrong, f"pulled weights are not those of the version they name: {wrong[:5]}"
    assert seen[-1][0] > seen[0][0], "no push applied while pulling"
