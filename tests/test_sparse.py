"""Sparse embedding tables end to end: sync training with SparseEmbedding equals local training with
nn.Embedding(sparse=True) / nn.EmbeddingBag and torch's own optimizer; every transport carries rows; async works."""

from __future__ import annotations

import threading
from collections.abc import Callable

import numpy as np
import pytest
import torch
from torch import nn

from paramserver.config import ServerConfig
from paramserver.tables import initial_rows, shard_of
from worker import PSClient, SparseEmbedding
from worker.client.sparse import UniqueCache

N, DIM, BAG_N = 64, 8, 40


class PSModel(nn.Module):
    """A table gathered per ID, a pooled bag table, and a dense head."""

    def __init__(self, bag_mode: str = "mean") -> None:
        super().__init__()
        self.fc = nn.Linear(2 * DIM, 1)
        self.item = SparseEmbedding(dim=DIM, num_embeddings=N, init_scale=0.3, seed=7)
        self.tags = SparseEmbedding(dim=DIM, num_embeddings=BAG_N, mode=bag_mode, init="uniform", init_scale=0.2)

    def forward(self, ids: torch.Tensor, bag: torch.Tensor, offsets: torch.Tensor) -> torch.Tensor:
        return self.fc(torch.cat([self.item(ids), self.tags(bag, offsets)], 1)).squeeze(-1)


class LocalModel(nn.Module):
    """The same model with torch's own sparse embeddings, starting from the same rows."""

    def __init__(self, ps: PSModel) -> None:
        super().__init__()
        self.fc = nn.Linear(2 * DIM, 1)
        self.fc.load_state_dict(ps.fc.state_dict())
        self.item = nn.Embedding(N, DIM, sparse=True)
        self.tags = nn.EmbeddingBag(BAG_N, DIM, mode=ps.tags.mode or "mean", sparse=True)
        with torch.no_grad():
            self.item.weight.copy_(torch.from_numpy(initial_rows(ps.item.spec("item"), np.arange(N))))
            self.tags.weight.copy_(torch.from_numpy(initial_rows(ps.tags.spec("tags"), np.arange(BAG_N))))

    def forward(self, ids: torch.Tensor, bag: torch.Tensor, offsets: torch.Tensor) -> torch.Tensor:
        return self.fc(torch.cat([self.item(ids), self.tags(bag, offsets)], 1)).squeeze(-1)


Batch = tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor]


def make_batches(steps: int, size: int, seed: int = 0) -> list[Batch]:
    """Zipf-ish IDs (repeats within and across batches), bags of 1-3 tags, targets."""
    g = torch.Generator().manual_seed(seed)
    out = []
    for _ in range(steps):
        ids = (torch.rand(size, generator=g) ** 3 * N).long()
        lengths = torch.randint(1, 4, (size,), generator=g)
        bag = torch.randint(0, BAG_N, (int(lengths.sum()),), generator=g)
        offsets = torch.cat([torch.zeros(1, dtype=torch.long), lengths.cumsum(0)[:-1]])
        out.append((ids, bag, offsets, torch.randn(size, generator=g)))
    return out


def split(batch: Batch, rank: int, world: int) -> Batch:
    """Rank `rank`'s half of a combined batch: samples rank, rank + world, ..."""
    ids, bag, offsets, y = batch
    ends = torch.cat([offsets[1:], torch.tensor([len(bag)])])
    keep = range(rank, len(ids), world)
    bags = [bag[offsets[i] : ends[i]] for i in keep]
    lengths = torch.tensor([len(b) for b in bags])
    return (
        ids[rank::world],
        torch.cat(bags),
        torch.cat([torch.zeros(1, dtype=torch.long), lengths.cumsum(0)[:-1]]),
        y[rank::world],
    )


def loss_of(model: nn.Module, batch: Batch) -> torch.Tensor:
    ids, bag, offsets, y = batch
    return ((model(ids, bag, offsets) - y) ** 2).mean()


def train_local(ps: PSModel, batches: list[Batch], optimizer: str, lr: float) -> LocalModel:
    local = LocalModel(ps)
    make: Callable[..., torch.optim.Optimizer] = {"sgd": torch.optim.SGD, "adagrad": torch.optim.Adagrad}[optimizer]
    opt = make(local.parameters(), lr=lr)
    for batch in batches:
        opt.zero_grad()
        loss_of(local, batch).backward()
        opt.step()
    return local


def train_on_cluster(
    address: str, ps_models: list[PSModel], batches: list[Batch], clients: list[PSClient], **client_kwargs: object
) -> list[PSModel]:
    """Each model trained by its own worker (a thread) on its rank's half of each batch; returns them. Each
    worker's client is added to `clients`, for the caller to close once done with the models."""
    errors: list[BaseException] = []
    world = len(ps_models)

    def work(model: PSModel) -> None:
        try:
            client = PSClient(address, **client_kwargs)  # type: ignore[arg-type]
            clients.append(client)
            client.register(model)
            for batch in batches:
                model.zero_grad(set_to_none=True)
                loss_of(model, split(batch, client.rank, world)).backward()
                client.push_pull(model)
        except BaseException as exc:  # noqa: BLE001 - reported by the test
            errors.append(exc)

    threads = [threading.Thread(target=work, args=(m,)) for m in ps_models]
    for t in threads:
        t.start()
    for t in threads:
        t.join(timeout=120)
    if errors:
        raise errors[0]
    assert not any(t.is_alive() for t in threads), "a worker hung"
    return ps_models


@pytest.mark.parametrize("optimizer,lr", [("sgd", 0.2), ("adagrad", 0.1)])
def test_sync_training_equals_local_training_with_torch_sparse_embeddings(
    ps_cluster_factory: Callable[..., object], optimizer: str, lr: float
) -> None:
    """Two workers in sync mode on halves of each batch = one local model on the whole batch (1e-5)."""
    cluster = ps_cluster_factory(ServerConfig(mode="sync", workers=2, optimizer=optimizer, lr=lr), shards=2)
    torch.manual_seed(0)
    models = [PSModel(), PSModel()]
    models[1].fc.load_state_dict(models[0].fc.state_dict())
    batches = make_batches(steps=6, size=32)
    local = train_local(models[0], batches, optimizer, lr)  # before training: the same starting point
    clients: list[PSClient] = []
    try:
        trained = train_on_cluster(cluster.address, models, batches, clients)  # type: ignore[attr-defined]
        with torch.no_grad():
            for model in trained:
                torch.testing.assert_close(model.fc.weight, local.fc.weight, atol=1e-5, rtol=1e-5)
                torch.testing.assert_close(model.fc.bias, local.fc.bias, atol=1e-5, rtol=1e-5)
                torch.testing.assert_close(model.item(torch.arange(N)), local.item.weight, atol=1e-5, rtol=1e-5)
                torch.testing.assert_close(
                    model.tags(torch.arange(BAG_N), torch.arange(BAG_N)), local.tags.weight, atol=1e-5, rtol=1e-5
                )
    finally:
        for client in clients:  # else its heartbeats go on, into later tests' logs, once the shards are gone
            client.close()


@pytest.mark.parametrize(
    "transport,kwargs",
    [
        ("shared memory", {}),
        ("data socket", {"shared_memory": False}),
        ("gRPC", {"shared_memory": False, "data_socket": False}),
    ],
)
def test_every_transport_carries_rows(
    ps_cluster_factory: Callable[..., object], transport: str, kwargs: dict[str, bool]
) -> None:
    """One worker's training is the same over each transport, and equals local training."""
    cluster = ps_cluster_factory(ServerConfig(mode="sync", workers=1, optimizer="adagrad", lr=0.1), shards=2)
    torch.manual_seed(1)
    model = PSModel(bag_mode="sum")
    batches = make_batches(steps=4, size=16, seed=3)
    local = train_local(model, batches, "adagrad", 0.1)
    with PSClient(cluster.address, **kwargs) as client:  # type: ignore[attr-defined]
        client.register(model)
        for batch in batches:
            model.zero_grad(set_to_none=True)
            loss_of(model, batch).backward()
            client.push_pull(model)
        assert [link.transport.kind for link in client.links] == [transport, transport]
        with torch.no_grad():
            torch.testing.assert_close(model.item(torch.arange(N)), local.item.weight, atol=1e-5, rtol=1e-5)
            torch.testing.assert_close(model.fc.weight, local.fc.weight, atol=1e-5, rtol=1e-5)


@pytest.mark.parametrize("shared_memory", [True, False], ids=["shared-memory", "data-socket"])
def test_unbounded_ids_of_any_int64_and_their_shards(
    ps_cluster_factory: Callable[..., object], shared_memory: bool
) -> None:
    """Hash-like IDs (negative, huge) work; each row lives on the shard shard_of names, and only there. Shard 1
    holds none of the dense part (one element), so its exchanges carry rows alone."""
    cluster = ps_cluster_factory(ServerConfig(mode="async", workers=1, optimizer="sgd", lr=0.5), shards=2)

    class Users(nn.Module):
        def __init__(self) -> None:
            super().__init__()
            self.bias = nn.Parameter(torch.zeros(1))
            self.user = SparseEmbedding(dim=3, init="zeros")

        def forward(self, ids: torch.Tensor) -> torch.Tensor:
            return self.user(ids).sum(1) + self.bias

    ids = torch.tensor([-(2**63), -1, 0, 7, 2**62 + 12345, 2**63 - 1])
    model = Users()
    with PSClient(cluster.address, shared_memory=shared_memory) as client:  # type: ignore[attr-defined]
        client.register(model)
        model(ids).sum().backward()
        client.push_pull(model)
        with torch.no_grad():
            rows = model.user(ids)
    torch.testing.assert_close(rows, torch.full((len(ids), 3), -0.5))  # one SGD step of gradient 1 from zeros
    owners = shard_of(ids.numpy(), 2)
    held = [shard.describe().table_rows[0] for shard in cluster.shards]  # type: ignore[attr-defined]
    assert held == [int((owners == 0).sum()), int((owners == 1).sum())]


def test_gradient_accumulation_over_two_forward_passes(ps_cluster_factory: Callable[..., object]) -> None:
    """Two forward passes before one push: one row per ID, gradients summed, as torch accumulates them."""
    cluster = ps_cluster_factory(ServerConfig(mode="sync", workers=1, optimizer="sgd", lr=0.1), shards=2)
    torch.manual_seed(2)
    model = PSModel()
    a, b = make_batches(steps=2, size=8, seed=5)
    local = LocalModel(model)
    opt = torch.optim.SGD(local.parameters(), lr=0.1)
    (loss_of(local, a) + loss_of(local, b)).backward()
    opt.step()
    with PSClient(cluster.address) as client:  # type: ignore[attr-defined]
        client.register(model)
        loss_of(model, a).backward()
        loss_of(model, b).backward()
        client.push_pull(model)
        with torch.no_grad():
            torch.testing.assert_close(model.item(torch.arange(N)), local.item.weight, atol=1e-5, rtol=1e-5)


def test_a_table_forward_before_register_says_what_to_do() -> None:
    with pytest.raises(RuntimeError, match="client.register"):
        SparseEmbedding(dim=4)(torch.tensor([1]))


@pytest.mark.parametrize("kwargs", [{}, {"shared_memory": False, "data_socket": False}], ids=["shm", "grpc"])
def test_prefetching_the_next_batch_rows_changes_nothing_but_the_round_trips(
    ps_cluster_factory: Callable[..., object], kwargs: dict[str, bool]
) -> None:
    """With prefetch, the rows of the next batch come with push_pull (read after its update) and the forward pass
    asks the shards nothing; training is the same as without."""
    cluster = ps_cluster_factory(ServerConfig(mode="sync", workers=1, optimizer="adagrad", lr=0.1), shards=2)
    torch.manual_seed(4)
    model = PSModel()
    batches = make_batches(steps=5, size=16, seed=9)
    local = train_local(model, batches, "adagrad", 0.1)
    shards = cluster.shards  # type: ignore[attr-defined]

    def lookups() -> int:
        return sum(
            int(s.metrics.registry.get_sample_value("paramserver_lookups_total", {"shard": str(s.index)}) or 0)
            for s in shards
        )

    with PSClient(cluster.address, **kwargs) as client:  # type: ignore[attr-defined]
        client.register(model)
        for t, batch in enumerate(batches):
            model.zero_grad(set_to_none=True)
            loss_of(model, batch).backward()
            if t + 1 < len(batches):
                ids, bag, _, _ = batches[t + 1]
                model.item.prefetch(ids)
                model.tags.prefetch(bag)
            client.push_pull(model)
        # The first batch's forward pass: one lookup exchange per table and shard; then one per push_pull and shard.
        assert lookups() == 2 * 2 + 2 * (len(batches) - 1)
        with torch.no_grad():
            torch.testing.assert_close(model.item(torch.arange(N)), local.item.weight, atol=1e-5, rtol=1e-5)
            torch.testing.assert_close(model.fc.weight, local.fc.weight, atol=1e-5, rtol=1e-5)


def test_a_forward_pass_on_other_ids_than_prefetched_looks_them_up(ps_cluster_factory: Callable[..., object]) -> None:
    """prefetch also computes the IDs' torch.unique for the forward pass; IDs changed in place since, or another
    tensor, are looked up and gathered as they are now."""
    cluster = ps_cluster_factory(ServerConfig(mode="sync", workers=1, optimizer="sgd", lr=0.5), shards=2)
    table = SparseEmbedding(dim=3, seed=2)
    model = torch.nn.ModuleDict({"t": table, "fc": torch.nn.Linear(1, 1)})
    with PSClient(cluster.address) as client:  # type: ignore[attr-defined]
        client.register(model)
        table(torch.tensor([1, 2, 3])).sum().backward()
        ids = torch.tensor([[4, 5], [5, 6]])
        table.prefetch(ids)
        client.push_pull(model)
        want = {i: client.lookup(model, 0, np.array([i]))[0] for i in (4, 5, 6, 7, 9)}
        np.testing.assert_array_equal(table(ids).detach().numpy(), [[want[4], want[5]], [want[5], want[6]]])
        table.prefetch(ids)
        ids[0, 0] = 9  # after prefetch: the forward pass must see 9, not 4
        np.testing.assert_array_equal(table(ids).detach().numpy(), [[want[9], want[5]], [want[5], want[6]]])
        table.prefetch(ids)
        np.testing.assert_array_equal(table(torch.tensor([7])).detach().numpy(), [want[7]])


@pytest.mark.timeout(180)
def test_a_shard_killed_mid_training_comes_back_with_every_row_it_acknowledged(tmp_path: object) -> None:
    """SIGKILL a shard process of a sparse model; restarted (its newest checkpoint and the write-ahead log after
    it), it serves exactly the rows and version it had acknowledged, and the worker trains on to the end."""
    from pathlib import Path

    from paramserver.server.cluster import LocalCluster

    ckpt = Path(str(tmp_path)) / "ckpt"
    config = ServerConfig(
        mode="async", workers=1, optimizer="adagrad", lr=0.1, checkpoint_dir=str(ckpt), checkpoint_every="7"
    )
    torch.manual_seed(6)
    model = PSModel()
    batches = make_batches(steps=30, size=16, seed=11)
    ids = torch.arange(N)
    with LocalCluster(config, shards=2, processes=True) as cluster, PSClient(cluster.address) as client:
        client.register(model)
        for batch in batches[:20]:
            model.zero_grad(set_to_none=True)
            loss_of(model, batch).backward()
            client.push_pull(model)
        with torch.no_grad():
            before = model.item(ids)
        versions = list(client.versions)
        cluster.kill(1)
        assert cluster.procs[1].wait(timeout=10) < 0
        cluster.restart(1)
        with torch.no_grad():
            after = model.item(ids)
        np.testing.assert_array_equal(after.numpy(), before.numpy())
        assert client.pull(model) == min(versions) and client.versions == versions
        for batch in batches[20:]:
            model.zero_grad(set_to_none=True)
            loss_of(model, batch).backward()
            client.push_pull(model)
        assert client.versions == [30, 30]


def test_lazy_adam_rows_equal_torch_sparse_adam_even_where_a_step_brings_a_shard_no_rows(
    ps_cluster_factory: Callable[..., object],
) -> None:
    """SparseAdam's bias correction counts every step of the table: a shard that got none of a step's rows still
    counts it, so its rows move as torch's do."""
    cluster = ps_cluster_factory(ServerConfig(mode="sync", workers=1, optimizer="adam", lr=0.05), shards=2)

    class Tiny(nn.Module):
        def __init__(self) -> None:
            super().__init__()
            self.bias = nn.Parameter(torch.zeros(1))
            self.item = SparseEmbedding(dim=4, num_embeddings=16, init_scale=0.5)

        def forward(self, ids: torch.Tensor) -> torch.Tensor:
            return self.item(ids).sum(1) + self.bias

    owners = shard_of(np.arange(16), 2)
    on0, on1 = np.flatnonzero(owners == 0), np.flatnonzero(owners == 1)
    # Steps whose IDs all live on one shard, then on the other, then on both.
    steps = [torch.from_numpy(on0[:3]), torch.from_numpy(on0[1:4]), torch.from_numpy(on1[:2]), torch.arange(16)]
    model = Tiny()
    emb = nn.Embedding(16, 4, sparse=True)
    with torch.no_grad():
        emb.weight.copy_(torch.from_numpy(initial_rows(model.item.spec("item"), np.arange(16))))
    bias = nn.Parameter(torch.zeros(1))
    dense, rows = torch.optim.Adam([bias], lr=0.05), torch.optim.SparseAdam([emb.weight], lr=0.05)
    with PSClient(cluster.address) as client:  # type: ignore[attr-defined]
        client.register(model)
        for ids in steps:
            model.zero_grad(set_to_none=True)
            (model(ids) ** 2).mean().backward()
            client.push_pull(model)
            dense.zero_grad()
            rows.zero_grad()
            ((emb(ids).sum(1) + bias) ** 2).mean().backward()
            dense.step()
            rows.step()
        with torch.no_grad():
            torch.testing.assert_close(model.item(torch.arange(16)), emb.weight, atol=1e-6, rtol=1e-5)


def test_tables_prefetching_the_same_ids_share_their_unique_ids_until_the_ids_change() -> None:
    cache = UniqueCache(num_shards=2)
    buffer = np.array([[5, 3], [5, 9], [8, 1]], dtype=np.int64)
    ids = torch.from_numpy(buffer)
    first = cache.of(ids[:, 0])
    assert cache.of(ids[:, 0]) is first  # another view of the same IDs: computed once
    assert sorted(first.ids.tolist()) == [5, 8]
    buffer[1, 0] = 7  # written through numpy: torch's version counter does not see it, the kept copy does
    again = cache.of(ids[:, 0])
    assert again is not first
    # Grouped by shard, each shard's IDs ascending and one slice; the inverse gathers the given IDs back.
    assert sorted(again.ids.tolist()) == [5, 7, 8]
    np.testing.assert_array_equal(again.ids[again.inverse.numpy()], [5, 7, 8])
    assert again.parts is not None
    for k, part in enumerate(again.parts):
        mine = again.ids[part] if part is not None else np.empty(0, np.int64)
        assert (shard_of(mine, 2) == k).all() and (np.diff(mine) > 0).all()
    assert sum(len(again.ids[p]) for p in again.parts if p is not None) == 3


def test_a_table_survives_deepcopy_and_pickling_without_its_steps_in_flight(
    ps_cluster_factory: Callable[..., object],
) -> None:
    """A copy (an EMA or evaluation copy) reads rows where the original does; a pickled model comes back
    unregistered, saying so at its forward pass."""
    import copy
    import pickle

    cluster = ps_cluster_factory(ServerConfig(mode="async", workers=1, optimizer="sgd", lr=0.1), shards=2)
    model = PSModel()
    batch = make_batches(1, 8)[0]
    with PSClient(cluster.address) as client:  # type: ignore[attr-defined]
        client.register(model)
        model.item.prefetch(batch[0])
        twin = copy.deepcopy(model)
        torch.testing.assert_close(twin(*batch[:3]), model(*batch[:3]))
        thawed = pickle.loads(pickle.dumps(model))
        with pytest.raises(RuntimeError, match="not registered"):
            thawed(*batch[:3])


def test_ids_of_any_integer_dtype_and_shape_are_taken_and_float_ids_refused(
    ps_cluster_factory: Callable[..., object],
) -> None:
    """What nn.Embedding takes: int16 and uint8 IDs, a [B, 1] column; a float tensor of IDs (deepctr-torch casts its
    inputs to float32, which rounds IDs of 2^24 and above) is refused saying why."""
    cluster = ps_cluster_factory(ServerConfig(mode="async", workers=1, optimizer="sgd", lr=0.1), shards=2)
    model = PSModel()
    ids = torch.tensor([3, 5, 3, 60])
    with PSClient(cluster.address) as client:  # type: ignore[attr-defined]
        client.register(model)
        want = model.item(ids)
        for dtype in (torch.int16, torch.uint8, torch.int32):
            torch.testing.assert_close(model.item(ids.to(dtype)), want)
        column = model.item(ids.reshape(-1, 1))
        assert column.shape == (4, 1, DIM)
        torch.testing.assert_close(column.reshape(4, DIM), want)
        model.item.prefetch(ids.reshape(-1, 1).to(torch.int16))
        torch.testing.assert_close(model.item(ids.reshape(-1, 1).to(torch.int16)).reshape(4, DIM), want)
        with pytest.raises(TypeError, match="embedding IDs are integers, not torch.float32.*2\\^24"):
            model.item(ids.float())
