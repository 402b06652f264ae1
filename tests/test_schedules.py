"""Learning-rate schedules on the shards, against torch.optim.lr_scheduler step for step, and a sync job with a
schedule against local training with torch's scheduler."""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import pytest
import torch
from support.references import torch_scheduler

from paramserver.config import ServerConfig
from paramserver.server.cluster import LocalCluster
from worker import PSClient

LR = 0.1


def _torch_rates(config: ServerConfig, steps: int) -> list[float]:
    """The rates torch's schedulers give a loop of `optimizer.step(); scheduler.step()`, one per update."""
    opt = torch.optim.SGD([torch.nn.Parameter(torch.zeros(1))], lr=config.lr)
    scheduler = torch_scheduler(opt, config)
    rates = []
    for _ in range(steps):
        rates.append(opt.param_groups[0]["lr"])
        opt.step()
        scheduler.step()
    return rates


@pytest.mark.parametrize(
    "settings",
    [
        {"lr_schedule": "constant", "warmup_versions": 10, "warmup_start_factor": 0.01},
        {"lr_schedule": "step", "step_every": 7, "gamma": 0.5},
        {"lr_schedule": "step", "step_every": 5, "gamma": 0.3, "warmup_versions": 4},
        {"lr_schedule": "cosine", "decay_versions": 40, "min_lr": 0.001},
        {"lr_schedule": "cosine", "decay_versions": 30, "warmup_versions": 8, "warmup_start_factor": 0.2},
        {"lr_schedule": "linear", "decay_versions": 25, "min_lr": 0.01, "warmup_versions": 5},
    ],
)
def test_each_schedule_gives_torchs_rates(settings: dict[str, Any]) -> None:
    config = ServerConfig(lr=LR, **settings)
    steps = config.warmup_versions + max(config.decay_versions, 30)  # within the decay: torch's cosine rises after
    expected = _torch_rates(config, steps)
    got = [config.lr_at(version) for version in range(1, steps + 1)]
    assert got == pytest.approx(expected, rel=1e-5, abs=1e-9)


def test_a_schedule_that_lacks_its_length_is_refused() -> None:
    with pytest.raises(ValueError, match="--decay-versions"):
        ServerConfig(lr_schedule="cosine")
    with pytest.raises(ValueError, match="--step-every"):
        ServerConfig(lr_schedule="step")
    with pytest.raises(ValueError, match="one of"):
        ServerConfig(lr_schedule="exponential")


def test_a_sync_job_with_a_schedule_equals_local_training_with_torchs_scheduler(
    ps_cluster_factory: Callable[..., LocalCluster],
) -> None:
    settings: dict[str, Any] = {"lr_schedule": "cosine", "warmup_versions": 5, "decay_versions": 20, "min_lr": 1e-4}
    config = ServerConfig(mode="sync", workers=1, optimizer="adam", lr=0.01, **settings)
    cluster = ps_cluster_factory(config, 2)
    torch.manual_seed(0)
    model = torch.nn.Sequential(torch.nn.Linear(8, 16), torch.nn.Tanh(), torch.nn.Linear(16, 3))
    local = torch.nn.Sequential(torch.nn.Linear(8, 16), torch.nn.Tanh(), torch.nn.Linear(16, 3))
    local.load_state_dict(model.state_dict())
    opt = torch.optim.Adam(local.parameters(), lr=config.lr)
    scheduler = torch_scheduler(opt, config)
    batches = [(torch.randn(16, 8), torch.randint(0, 3, (16,))) for _ in range(25)]
    with PSClient(cluster.address) as client:
        client.register(model)
        for x, y in batches:
            model.zero_grad()
            torch.nn.functional.cross_entropy(model(x), y).backward()
            client.push_pull(model)
            opt.zero_grad()
            torch.nn.functional.cross_entropy(local(x), y).backward()
            opt.step()
            scheduler.step()
    for served, ours in zip(model.parameters(), local.parameters(), strict=True):
        assert torch.allclose(served, ours, atol=1e-5), float((served - ours).abs().max())


def test_the_schedule_scales_the_tables_rates_as_torchs_scheduler_scales_a_sparse_optimizer(
    ps_cluster_factory: Callable[..., LocalCluster],
) -> None:
    """A table's rows follow the job's schedule: sync training with a SparseEmbedding (Adagrad) under a warmup and a
    step schedule equals nn.Embedding(sparse=True) with torch's Adagrad and torch's scheduler."""
    import numpy as np

    from paramserver.tables import initial_rows
    from worker import SparseEmbedding

    settings: dict[str, Any] = {"lr_schedule": "step", "step_every": 4, "gamma": 0.5, "warmup_versions": 3}
    config = ServerConfig(mode="sync", workers=1, optimizer="adagrad", lr=0.2, **settings)
    cluster = ps_cluster_factory(config, 2)
    table = SparseEmbedding(4, num_embeddings=20, seed=3)
    model = torch.nn.Module()
    model.table = table
    model.bias = torch.nn.Parameter(torch.zeros(1))  # a model has dense parameters; this one's gradient is 0
    local = torch.nn.Embedding(20, 4, sparse=True)
    with torch.no_grad():
        local.weight.copy_(torch.from_numpy(initial_rows(table.spec("table"), np.arange(20))))
    opt = torch.optim.Adagrad(local.parameters(), lr=config.lr)
    scheduler = torch_scheduler(opt, config)
    gen = torch.Generator().manual_seed(1)
    batches = [torch.randint(0, 20, (12,), generator=gen) for _ in range(14)]
    with PSClient(cluster.address) as client:
        client.register(model)
        for ids in batches:
            (table(ids).square().sum() + 0 * model.bias.sum()).backward()
            client.push_pull(model)
            opt.zero_grad()
            local(ids).square().sum().backward()
            opt.step()
            scheduler.step()
        rows = torch.from_numpy(client.lookup(model, 0, np.arange(20)))
    torch.testing.assert_close(rows, local.weight.detach(), rtol=0, atol=1e-5)
