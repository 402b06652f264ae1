"""pytest plugin (registered through the `pytest11` entry point): real shards for your own tests.

    def test_my_training(ps_cluster):
        with PSClient(ps_cluster.address) as client:
            client.register(model)
            ...

`ps_cluster` starts real gRPC shards on 127.0.0.1 with OS-chosen ports (threads, so it is fast) and stops them
after the test, also when it fails. Override the `ps_cluster_config` or `ps_cluster_shards` fixtures in your
conftest.py (or a test module) to change the job; use `ps_cluster_factory` for several clusters or other setups.
"""

from __future__ import annotations

from collections.abc import Callable, Iterator
from typing import Any

import pytest

from paramserver.cluster import LocalCluster
from paramserver.config import ServerConfig


@pytest.fixture
def ps_cluster_config() -> ServerConfig:
    """The job `ps_cluster` runs: sync mode, one worker, SGD. Override to change it."""
    return ServerConfig(mode="sync", workers=1, optimizer="sgd", lr=0.1)


@pytest.fixture
def ps_cluster_shards() -> int:
    """How many shards `ps_cluster` starts. Override to change it."""
    return 2


@pytest.fixture
def ps_cluster_factory() -> Iterator[Callable[..., LocalCluster]]:
    """Start LocalClusters with any arguments; every one is stopped after the test."""
    started: list[LocalCluster] = []

    def start(config: ServerConfig | None = None, shards: int = 2, **kwargs: Any) -> LocalCluster:
        cluster = LocalCluster(config, shards, **kwargs)
        started.append(cluster)
        return cluster.start()

    try:
        yield start
    finally:
        for cluster in reversed(started):
            cluster.stop()


@pytest.fixture
def ps_cluster(
    ps_cluster_factory: Callable[..., LocalCluster], ps_cluster_config: ServerConfig, ps_cluster_shards: int
) -> LocalCluster:
    """A started LocalCluster (threads on 127.0.0.1, port 0) running `ps_cluster_config`."""
    return ps_cluster_factory(ps_cluster_config, ps_cluster_shards)
