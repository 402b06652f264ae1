"""Lightning's conventions through the servers: `Trainer(strategy=ParameterServerStrategy(address))` joins the job,
converts the module's embeddings, wraps the optimizer `configure_optimizers` returns and gives each rank its half of
the data; a model registered inside a wrapper (a LightningModule's `self.net`) is saved as the wrapper and loads into
the inner model, and saving the inner one says so. Real shards on 127.0.0.1 (threads), two workers as two threads
each with its own client and Trainer, against the same model trained locally by torch's SGD on the combined batches.
"""

from __future__ import annotations

import re
from collections.abc import Callable
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path
from typing import Any

import pytest
import torch
from torch import nn
from torch.utils.data import DataLoader, DistributedSampler, TensorDataset

from paramserver.config import ServerConfig
from paramserver.errors import ModelMismatch
from paramserver.server.cluster import LocalCluster
from worker import ParameterServerStrategy, PSClient, load, make_sparse

pytestmark = pytest.mark.timeout(180)

LR = 0.05
WORKERS = 2
BATCH = 16  # per worker: the local run's batches are twice this
STEPS = 6


class Ranker(nn.Module):
    """Plain torch: a user table, a bag of tags, and an MLP."""

    def __init__(self) -> None:
        super().__init__()
        torch.manual_seed(7)
        self.user = nn.Embedding(100, 8)
        self.tags = nn.EmbeddingBag(40, 8, mode="mean")
        self.mlp = nn.Sequential(nn.Linear(16, 16), nn.ReLU(), nn.Linear(16, 1))

    def forward(self, user: torch.Tensor, tags: torch.Tensor) -> torch.Tensor:
        return self.mlp(torch.cat([self.user(user), self.tags(tags)], 1)).squeeze(-1)


def _data() -> TensorDataset:
    """Rows numbered by their first column, so that each rank's share can be told."""
    n = WORKERS * BATCH * STEPS
    g = torch.Generator().manual_seed(3)
    user, tags = torch.randint(0, 100, (n,), generator=g), torch.randint(0, 40, (n, 3), generator=g)
    return TensorDataset(torch.arange(n), user, tags, ((user % 7) < 3).float())


def _probe() -> tuple[torch.Tensor, torch.Tensor]:
    _, user, tags, _ = _data().tensors
    return user[:64], tags[:64]


def _shuffled(rank: int, ranks: int) -> list[int]:
    """The rows a rank trains on, in order: Lightning puts a DistributedSampler on a train loader, shuffled (seed 0,
    epoch 0) as it does for DDP; with one rank, every row in that order, the ranks' step-k batches one after the
    other."""
    return list(DistributedSampler(_data(), num_replicas=ranks, rank=rank, shuffle=True, seed=0))


def _local() -> tuple[torch.Tensor, torch.Tensor]:
    """The predictions before and after training locally on the combined batches."""
    model = Ranker()
    with torch.no_grad():
        start = model(*_probe())
    opt = torch.optim.SGD(model.parameters(), lr=LR)
    for _, user, tags, y in DataLoader(_data(), batch_size=WORKERS * BATCH, sampler=_shuffled(0, 1)):
        opt.zero_grad()
        nn.functional.mse_loss(model(user, tags), y).backward()
        opt.step()
    with torch.no_grad():
        return start, model(*_probe())


def _task(net: nn.Module, seen: list[int]) -> Any:
    """A LightningModule as its author wrote it, for one machine: its own SGD, no knowledge of the servers."""
    import pytorch_lightning as pl

    class Task(pl.LightningModule):
        def __init__(self) -> None:
            super().__init__()
            self.net = net

        def training_step(self, batch: list[torch.Tensor], batch_idx: int) -> torch.Tensor:
            index, user, tags, y = batch
            seen.extend(index.tolist())
            return nn.functional.mse_loss(self.net(user, tags), y)

        def configure_optimizers(self) -> torch.optim.Optimizer:
            return torch.optim.SGD(self.parameters(), lr=LR)

    return Task()


def _trainer(strategy: ParameterServerStrategy) -> Any:
    import pytorch_lightning as pl

    return pl.Trainer(
        strategy=strategy,
        accelerator="cpu",
        devices=1,
        max_epochs=1,
        logger=False,
        enable_checkpointing=False,
        enable_progress_bar=False,
        enable_model_summary=False,
    )


def test_the_strategy_trains_a_lightning_module_unchanged_on_each_ranks_half_and_equals_local(
    ps_cluster_factory: Callable[..., LocalCluster], tmp_path: Path
) -> None:
    cluster = ps_cluster_factory(ServerConfig(mode="sync", workers=WORKERS, optimizer="sgd", lr=LR), shards=2)
    nets = [Ranker() for _ in range(WORKERS)]  # one after the other: Ranker seeds torch's global RNG
    seen: list[list[int]] = [[] for _ in range(WORKERS)]
    tasks = [_task(net, s) for net, s in zip(nets, seen, strict=True)]
    saved = tmp_path / "task.safetensors"

    def worker(index: int) -> tuple[int, torch.Tensor]:
        with ParameterServerStrategy(cluster.address, sparse=True) as strategy:
            _trainer(strategy).fit(tasks[index], DataLoader(_data(), batch_size=BATCH))
            with torch.no_grad():
                got = nets[index](*_probe())
            rank = strategy.client.rank
            if rank == 0:  # after training: the job left, the client still open
                strategy.client.save(tasks[index], saved)
            return rank, got

    with ThreadPoolExecutor(WORKERS) as pool:
        runs = [pool.submit(worker, i) for i in range(WORKERS)]
        outcomes = [run.result(timeout=150) for run in runs]

    start, want = _local()
    assert (want - start).abs().max() > 1e-3, "training did not move the predictions: the test would not tell"
    results = dict(outcomes)
    assert sorted(results) == list(range(WORKERS))
    for rank, got in results.items():
        assert torch.allclose(got, want, atol=1e-5), (rank, (got - want).abs().max())
    ranks = {rank: seen[index] for index, (rank, _) in enumerate(outcomes)}
    for rank, rows in ranks.items():
        assert rows == _shuffled(rank, WORKERS), rank  # its own half, each row once
    assert sorted(ranks[0] + ranks[1]) == list(range(WORKERS * BATCH * STEPS)), "the halves overlap or miss rows"
    for inner in (Ranker(), make_sparse(Ranker())):  # the LightningModule's file, into the plain or converted net
        with torch.no_grad():
            assert torch.allclose(load(inner, saved)(*_probe()), want, atol=1e-5)


def test_the_strategy_refuses_several_devices_and_a_local_lr_scheduler(
    ps_cluster_factory: Callable[..., LocalCluster],
) -> None:
    import pytorch_lightning as pl

    cluster = ps_cluster_factory(ServerConfig(mode="sync", workers=1, optimizer="sgd", lr=LR), shards=1)
    with ParameterServerStrategy(cluster.address) as strategy:
        trainer = pl.Trainer(strategy=strategy, accelerator="cpu", devices=2, logger=False, max_epochs=1)
        with pytest.raises(ValueError, match="one device per process"):
            trainer.fit(_task(Ranker(), []), DataLoader(_data(), batch_size=BATCH))

    class Scheduled(_task(Ranker(), []).__class__):  # type: ignore[misc]
        def configure_optimizers(self) -> Any:
            opt = torch.optim.SGD(self.parameters(), lr=LR)
            return [opt], [torch.optim.lr_scheduler.StepLR(opt, step_size=2)]

    with ParameterServerStrategy(cluster.address) as strategy, pytest.raises(TypeError, match="--lr-schedule"):
        _trainer(strategy).fit(Scheduled(), DataLoader(_data(), batch_size=BATCH))


class Wrapper(nn.Module):
    """What a LightningModule is to PSClient: a module holding the model (`net`) and a layer of its own."""

    def __init__(self, net: nn.Module, twin: nn.Module | None = None) -> None:
        super().__init__()
        self.net = net
        self.head = nn.Linear(1, 1)
        if twin is not None:
            self.twin = twin


def test_saving_the_inner_model_of_a_registered_wrapper_says_which_was_registered_and_how_to_save(
    ps_cluster_factory: Callable[..., LocalCluster], tmp_path: Path
) -> None:
    cluster = ps_cluster_factory(ServerConfig(mode="sync", workers=1, optimizer="sgd", lr=LR), shards=2)
    net = make_sparse(Ranker())
    wrapper = Wrapper(net)
    path = tmp_path / "wrapper.safetensors"
    with PSClient(cluster.address) as client:
        client.register(wrapper)
        with pytest.raises(ModelMismatch) as refused:
            client.save(net, path)
        client.save(wrapper, path)
        with torch.no_grad():
            want = net(*_probe())
        client.leave(finished=True)
    message = str(refused.value)
    assert "registered a Wrapper, not this Ranker" in message, message
    assert "'net.mlp.0.weight'" in message and "'head.weight'" in message, message  # the names that differ
    assert re.search(r"client\.save\(<the Wrapper>, path\)", message), message
    assert "the Ranker is the Wrapper's 'net'" in message and "worker.load(<a Ranker>, path)" in message, message
    for inner in (Ranker(), make_sparse(Ranker())):
        with torch.no_grad():
            assert torch.allclose(load(inner, path)(*_probe()), want, atol=1e-6)


def test_a_file_holding_the_model_under_two_prefixes_is_not_guessed(
    ps_cluster_factory: Callable[..., LocalCluster], tmp_path: Path
) -> None:
    cluster = ps_cluster_factory(ServerConfig(mode="sync", workers=1, optimizer="sgd", lr=LR), shards=1)
    twins = Wrapper(make_sparse(Ranker()), twin=make_sparse(Ranker()))
    path = tmp_path / "twins.safetensors"
    with PSClient(cluster.address) as client:
        client.register(twins)
        client.save(twins, path)
        client.leave(finished=True)
    with pytest.raises(ValueError, match=r"tensors under 2 prefixes \('net\.', 'twin\.'\)"):
        load(Ranker(), path)
