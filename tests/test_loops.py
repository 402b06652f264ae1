"""Other people's loops, as cheap as ps-worker's: `worker.prefetching` brings each batch's rows with the exchange
before it, a forward pass with none fetched looks all its tables up at once, and PSOptimizer catches up as ps-worker
does when its worker is evicted mid-run. Real shards on 127.0.0.1 (threads); each run is compared with the same
loop trained locally (torch's SGD on nn.Embedding) on the same batches."""

from __future__ import annotations

from collections.abc import Callable, Iterator
from concurrent.futures import ThreadPoolExecutor
from typing import Any

import pytest
import torch
from torch import nn
from torch.utils.data import DataLoader, DistributedSampler, TensorDataset

from paramserver.config import ServerConfig
from paramserver.server.cluster import LocalCluster
from worker import PSClient, PSOptimizer, make_sparse, prefetching

pytestmark = pytest.mark.timeout(120)

LR = 0.1
BATCH = 32
STEPS = 8


class Clicks(nn.Module):
    """Plain torch: three tables (one a bag) and an MLP."""

    def __init__(self) -> None:
        super().__init__()
        torch.manual_seed(3)
        self.user = nn.Embedding(300, 8)
        self.item = nn.Embedding(200, 8)
        self.tags = nn.EmbeddingBag(50, 8, mode="mean")
        self.mlp = nn.Sequential(nn.Linear(24, 16), nn.ReLU(), nn.Dropout(0.0), nn.Linear(16, 1))

    def forward(self, user: torch.Tensor, item: torch.Tensor, tags: torch.Tensor) -> torch.Tensor:
        return self.mlp(torch.cat([self.user(user), self.item(item), self.tags(tags)], 1)).squeeze(-1)


def _data() -> TensorDataset:
    g = torch.Generator().manual_seed(5)
    n = BATCH * STEPS
    user, item = torch.randint(0, 300, (n,), generator=g), torch.randint(0, 200, (n,), generator=g)
    tags = torch.randint(0, 50, (n, 3), generator=g)
    return TensorDataset(user, item, tags, ((user + item) % 3 == 0).float())


def _local() -> nn.Module:
    model = Clicks()
    opt = torch.optim.SGD(model.parameters(), lr=LR)
    for *x, y in DataLoader(_data(), batch_size=BATCH):
        opt.zero_grad()
        nn.functional.binary_cross_entropy_with_logits(model(*x), y).backward()
        opt.step()
    return model


class Lookups:
    """Counts the client's lookup exchanges (each table's own, and grouped ones), calling the real ones."""

    def __init__(self, client: PSClient, monkeypatch: pytest.MonkeyPatch) -> None:
        self.single = self.grouped = 0
        single, grouped = client._lookup, client._lookup_group

        def count_single(*args: Any) -> Any:
            self.single += 1
            return single(*args)

        def count_grouped(*args: Any) -> Any:
            self.grouped += 1
            return grouped(*args)

        monkeypatch.setattr(client, "_lookup", count_single)
        monkeypatch.setattr(client, "_lookup_group", count_grouped)


def _train(cluster: LocalCluster, monkeypatch: pytest.MonkeyPatch, wrap: Callable[[Any, nn.Module], Any]) -> Any:
    model = make_sparse(Clicks())
    with PSClient(cluster.address) as client:
        opt = PSOptimizer(model, client)
        lookups = Lookups(client, monkeypatch)
        for *x, y in wrap(DataLoader(_data(), batch_size=BATCH), model):
            opt.zero_grad()
            nn.functional.binary_cross_entropy_with_logits(model(*x), y).backward()
            opt.step()
        probe = _data().tensors[:3]
        with torch.no_grad():
            got = model(*(t[:64] for t in probe))
        client.leave(finished=True)
    return got, lookups


@pytest.mark.parametrize("wrapped", [True, False], ids=["prefetching", "grouped"])
def test_a_plain_loop_reads_its_rows_with_the_exchange_or_in_one_lookup_and_equals_local(
    wrapped: bool, ps_cluster_factory: Callable[..., LocalCluster], monkeypatch: pytest.MonkeyPatch
) -> None:
    cluster = ps_cluster_factory(ServerConfig(mode="sync", workers=1, optimizer="sgd", lr=LR), shards=2)
    got, lookups = _train(cluster, monkeypatch, prefetching if wrapped else (lambda batches, model: batches))
    reference = _local()
    with torch.no_grad():
        want = reference(*(t[:64] for t in _data().tensors[:3]))
    assert torch.allclose(got, want, atol=1e-5), (got - want).abs().max()
    assert lookups.single == 0, "a table looked its rows up alone"
    # prefetching: only the first batch (nothing fetched before it) and the probe; else one per forward pass
    assert lookups.grouped == (2 if wrapped else STEPS + 1), lookups.grouped


def _ahead(batches: Any, model: nn.Module) -> Iterator[Any]:
    """A loop that reads one batch ahead of its steps, as Lightning's fit loop does."""
    it = iter(prefetching(batches, model))
    held = next(it, None)
    while held is not None:
        following = next(it, None)
        yield held
        held = following


def test_rows_come_right_when_the_loop_itself_reads_ahead(
    ps_cluster_factory: Callable[..., LocalCluster], monkeypatch: pytest.MonkeyPatch
) -> None:
    cluster = ps_cluster_factory(ServerConfig(mode="sync", workers=1, optimizer="sgd", lr=LR), shards=2)
    got, lookups = _train(cluster, monkeypatch, _ahead)
    reference = _local()
    with torch.no_grad():
        want = reference(*(t[:64] for t in _data().tensors[:3]))
    assert torch.allclose(got, want, atol=1e-5), (got - want).abs().max()
    assert lookups.single == 0 and lookups.grouped == 2, (lookups.single, lookups.grouped)


# -- each rank its part of the data: torch's DistributedSampler with the client's rank and world size ---------------


def test_a_distributed_sampler_with_the_clients_rank_gives_each_worker_its_half_and_equals_local(
    ps_cluster_factory: Callable[..., LocalCluster],
) -> None:
    workers, steps = 2, STEPS // 2
    cluster = ps_cluster_factory(ServerConfig(mode="sync", workers=workers, optimizer="sgd", lr=LR), shards=2)
    data = _data()
    models = [make_sparse(Clicks()) for _ in range(workers)]  # one after the other: Clicks seeds torch's global RNG

    def worker(model: nn.Module) -> tuple[int, list[int], torch.Tensor]:
        seen: list[int] = []
        with PSClient(cluster.address) as client:
            sampler = DistributedSampler(data, num_replicas=client.world_size, rank=client.rank, seed=0)
            opt = PSOptimizer(model, client)
            sampler.set_epoch(0)
            for *x, y in DataLoader(data, batch_size=BATCH // workers, sampler=sampler):
                opt.zero_grad()
                nn.functional.binary_cross_entropy_with_logits(model(*x), y).backward()
                opt.step()
            seen.extend(sampler)
            with torch.no_grad():
                got = model(*(t[:64] for t in data.tensors[:3]))
            client.leave(finished=True)
            return client.rank, seen, got

    with ThreadPoolExecutor(workers) as pool:
        runs = [pool.submit(worker, m) for m in models]
        outcomes = [run.result(timeout=100) for run in runs]

    # locally: the combined batches, in the one order the ranks' shuffles share (seed 0, epoch 0)
    everyone = list(DistributedSampler(data, num_replicas=1, rank=0, seed=0))
    reference = Clicks()
    opt = torch.optim.SGD(reference.parameters(), lr=LR)
    for *x, y in DataLoader(data, batch_size=BATCH, sampler=everyone):
        opt.zero_grad()
        nn.functional.binary_cross_entropy_with_logits(reference(*x), y).backward()
        opt.step()
    with torch.no_grad():
        want = reference(*(t[:64] for t in data.tensors[:3]))
    assert sorted(rank for rank, _, _ in outcomes) == [0, 1]
    halves = [seen for _, seen, _ in outcomes]
    assert len(halves[0]) == len(halves[1]) == BATCH * steps and not set(halves[0]) & set(halves[1])
    for rank, _, got in outcomes:
        assert torch.allclose(got, want, atol=1e-5), (rank, (got - want).abs().max())


# -- PSOptimizer catches up: a Lightning job's worker evicted mid-run -------------------------------------------------


def _lightning_run(cluster: LocalCluster, evict_at: int | None) -> torch.Tensor:
    import pytorch_lightning as pl

    net = make_sparse(Clicks())
    with PSClient(cluster.address) as client:

        class Task(pl.LightningModule):
            def __init__(self) -> None:
                super().__init__()
                self.net = net

            def training_step(self, batch: list[torch.Tensor], batch_idx: int) -> torch.Tensor:
                *x, y = batch
                return nn.functional.binary_cross_entropy_with_logits(self.net(*x), y)

            def configure_optimizers(self) -> torch.optim.Optimizer:
                return PSOptimizer(self, client)

            def on_train_batch_end(self, outputs: Any, batch: Any, batch_idx: int) -> None:
                if batch_idx == evict_at:  # every shard forgets this worker, as when its lease runs out
                    for shard in cluster.shards:
                        shard.tick(now=1e12)

        trainer = pl.Trainer(
            max_epochs=1,
            accelerator="cpu",
            logger=False,
            enable_checkpointing=False,
            enable_progress_bar=False,
            enable_model_summary=False,
        )
        trainer.fit(Task(), DataLoader(_data(), batch_size=BATCH))
        with torch.no_grad():
            got = net(*(t[:64] for t in _data().tensors[:3]))
        client.leave(finished=True)
    return got


def test_a_lightning_jobs_worker_evicted_mid_run_rejoins_and_finishes_as_without_the_eviction(
    ps_cluster_factory: Callable[..., LocalCluster],
) -> None:
    config = ServerConfig(mode="sync", workers=1, optimizer="sgd", lr=LR)
    want = _lightning_run(ps_cluster_factory(config, shards=2), evict_at=None)
    cluster = ps_cluster_factory(config, shards=2)
    got = _lightning_run(cluster, evict_at=3)
    assert sum(shard.stats.evictions for shard in cluster.shards) == 2  # it was evicted on both shards
    assert torch.allclose(got, want, atol=1e-6), (got - want).abs().max()
