"""A model trained through the servers leaves as plain torch: `worker.load` fills the unconverted model (the trained
rows, the initial rule for the rest), `state_dict()` of the converted model carries its bounded tables (so
`torch.save(model.state_dict())` and Lightning checkpoints are whole) and refuses to drop an unbounded one, and a
model that does not fit a file is told what would.

Real shards on 127.0.0.1 (threads), the public API alone.
"""

from __future__ import annotations

import io
from collections.abc import Callable
from pathlib import Path

import numpy as np
import pytest
import torch
from safetensors.numpy import load_file
from torch import nn

from paramserver.config import ServerConfig
from paramserver.server.cluster import LocalCluster
from paramserver.tables import initial_rows
from worker import PSClient, PSOptimizer, SparseEmbedding, load, make_sparse

pytestmark = pytest.mark.timeout(120)

BATCH = 16


class Ranker(nn.Module):
    """Plain torch, as someone else wrote it: a table per ID, a pooled bag table, a small one, a dense head."""

    def __init__(self, seed: int = 0) -> None:
        super().__init__()
        torch.manual_seed(seed)
        self.item = nn.Embedding(400, 8, padding_idx=0)
        self.tags = nn.EmbeddingBag(120, 8, mode="mean")
        self.user = nn.Embedding(50, 4)
        self.fc = nn.Linear(20, 1)

    def forward(self, item: torch.Tensor, tags: torch.Tensor, user: torch.Tensor) -> torch.Tensor:
        return self.fc(torch.cat([self.item(item), self.tags(tags), self.user(user)], 1)).squeeze(-1)


def _batches(count: int, seed: int) -> list[tuple[torch.Tensor, ...]]:
    g = torch.Generator().manual_seed(seed)
    return [
        (
            torch.randint(0, 400, (BATCH,), generator=g),
            torch.randint(0, 120, (BATCH, 3), generator=g),  # bags of three tags
            torch.randint(0, 50, (BATCH,), generator=g),
            torch.randn(BATCH, generator=g),
        )
        for _ in range(count)
    ]


def _train(model: nn.Module, client: PSClient, batches: list[tuple[torch.Tensor, ...]]) -> None:
    opt = PSOptimizer(model, client)
    for *inputs, y in batches:
        opt.zero_grad()
        nn.functional.mse_loss(model(*inputs), y).backward()
        opt.step()


def _predict(model: nn.Module, batches: list[tuple[torch.Tensor, ...]]) -> torch.Tensor:
    with torch.no_grad():
        return torch.cat([model(*inputs) for *inputs, _ in batches])


def _config() -> ServerConfig:
    return ServerConfig(mode="sync", workers=1, optimizer="adagrad", lr=0.1)


def test_a_trained_model_loads_into_plain_torch_predicts_the_same_and_exports(
    ps_cluster_factory: Callable[..., LocalCluster], tmp_path: Path
) -> None:
    cluster = ps_cluster_factory(_config(), shards=2)
    model = make_sparse(Ranker())
    held_out = _batches(2, seed=9)
    path = tmp_path / "ranker.safetensors"
    with PSClient(cluster.address) as client:
        _train(model, client, _batches(4, seed=1))
        state = model.state_dict()  # mid-training, as a Lightning checkpoint takes it
        # The tables' weights are no dense tensors of the job: only the parameters travel to the shards.
        assert [s.name for s in client.placement(model).specs] == ["fc.weight", "fc.bias"]
        _train(model, client, _batches(2, seed=2))  # training goes on as before
        trained = _predict(model, held_out)
        state = model.state_dict()
        client.save(model, path)
    cluster.stop()
    assert {k: tuple(v.shape) for k, v in state.items()} == {
        k: tuple(v.shape) for k, v in Ranker().state_dict().items()
    }

    # The file into the plain model, built anew from another start: everything comes from the file.
    plain = load(Ranker(seed=123), path)
    assert all(isinstance(m, nn.Embedding | nn.EmbeddingBag) for m in (plain.item, plain.tags, plain.user))
    torch.testing.assert_close(_predict(plain, held_out), trained, atol=1e-6, rtol=0)

    # torch.export takes the filled plain model, and its program predicts the same.
    item, tags, user, _ = held_out[0]
    program = torch.export.export(plain.eval(), (item, tags, user))
    with torch.no_grad():
        torch.testing.assert_close(program.module()(item, tags, user), trained[:BATCH], atol=1e-6, rtol=0)

    # The converted model's state_dict, through torch.save as torch-rechub saves model.pth, loads into the plain
    # model as it is.
    buffer = io.BytesIO()
    torch.save(state, buffer)
    buffer.seek(0)
    other = Ranker(seed=77)
    other.load_state_dict(torch.load(buffer, weights_only=True))
    torch.testing.assert_close(_predict(other, held_out), trained, atol=1e-6, rtol=0)
    assert torch.equal(other.item.weight, plain.item.weight) and torch.equal(other.tags.weight, plain.tags.weight)


class Native(nn.Module):
    """A model written for the servers: its bounded table's rows are made as IDs arrive (no given rows)."""

    def __init__(self) -> None:
        super().__init__()
        torch.manual_seed(3)
        self.item = SparseEmbedding(dim=4, num_embeddings=1000, init_scale=0.2, seed=11)
        self.fc = nn.Linear(4, 1)

    def forward(self, item: torch.Tensor) -> torch.Tensor:
        return self.fc(self.item(item)).squeeze(-1)


class NativePlain(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.item = nn.Embedding(1000, 4)
        self.fc = nn.Linear(4, 1)

    def forward(self, item: torch.Tensor) -> torch.Tensor:
        return self.fc(self.item(item)).squeeze(-1)


def test_rows_the_file_lacks_take_the_tables_initial_rule_as_the_shards_answer(
    ps_cluster_factory: Callable[..., LocalCluster], tmp_path: Path
) -> None:
    cluster = ps_cluster_factory(_config(), shards=2)
    model = Native()
    touched = torch.arange(0, 40)
    path = tmp_path / "native.safetensors"
    with PSClient(cluster.address) as client:
        opt = PSOptimizer(model, client)
        for _ in range(2):
            opt.zero_grad()
            (model(touched) ** 2).mean().backward()
            opt.step()
        everything = torch.arange(1000)
        served = _predict(model, [(everything, None)])
        shards_rows = client.lookup(model, 0, np.arange(1000))
        weight = model.state_dict()["item.weight"]
        client.save(model, path)
    cluster.stop()
    assert sorted(load_file(str(path))["item.ids"]) == list(range(40))  # the file holds the touched rows alone
    assert np.array_equal(weight.numpy(), shards_rows)

    plain = load(NativePlain(), path)
    assert np.array_equal(plain.item.weight.detach().numpy(), shards_rows)
    spec = model.item.spec("item")
    untouched = np.arange(40, 1000)
    assert np.array_equal(plain.item.weight.detach().numpy()[40:], initial_rows(spec, untouched))
    torch.testing.assert_close(_predict(plain, [(everything, None)]), served, atol=1e-6, rtol=0)


def test_an_unbounded_table_is_refused_by_the_plain_model_and_by_state_dict_saying_what_to_do(
    ps_cluster_factory: Callable[..., LocalCluster], tmp_path: Path
) -> None:
    # Not registered, an unbounded table holds no rows: nothing to lose, no entry.
    fresh = make_sparse(Ranker(), unbounded=["user"])
    assert set(fresh.state_dict()) == {"item.weight", "tags.weight", "fc.weight", "fc.bias"}

    cluster = ps_cluster_factory(_config(), shards=1)
    model = make_sparse(Ranker(), unbounded=["user"])
    path = tmp_path / "ranker.safetensors"
    with PSClient(cluster.address) as client:
        _train(model, client, _batches(2, seed=1))
        with pytest.raises(
            RuntimeError, match=r"table 'user' is unbounded.*client\.save\(model, path\).*in_state_dict"
        ):
            model.state_dict()
        model.user.in_state_dict = False  # left out on purpose: its rows are in the file below
        assert set(model.state_dict()) == {"item.weight", "tags.weight", "fc.weight", "fc.bias"}
        client.save(model, path)
    cluster.stop()

    with pytest.raises(ValueError, match=r"table 'user' in .* is unbounded.*worker\.load\(make_sparse\(model, "):
        load(Ranker(), path)
    served = load(make_sparse(Ranker(), unbounded=["user"]), path)  # what the message says works
    with pytest.raises(RuntimeError, match=r"table 'user' is unbounded"):
        served.state_dict()  # a loaded table holds rows too
    with pytest.raises(RuntimeError, match=r"table 'user' is unbounded: a weight cannot be loaded"):
        served.load_state_dict({**Ranker().state_dict()})


def test_load_state_dict_gives_an_unregistered_model_its_rows_and_refuses_to_change_registered_ones(
    ps_cluster_factory: Callable[..., LocalCluster],
) -> None:
    first = ps_cluster_factory(_config(), shards=1)
    model = make_sparse(Ranker())
    held_out = _batches(1, seed=9)
    with PSClient(first.address) as client:
        _train(model, client, _batches(2, seed=1))
        state = {k: v.clone() for k, v in model.state_dict().items()}  # its dense entries alias the model's
        trained = _predict(model, held_out)
        model.load_state_dict(state)  # its own state: taken (nothing changes)
        with pytest.raises(RuntimeError, match=r"table 'item' is registered.*before client\.register"):
            model.load_state_dict(Ranker(seed=5).state_dict())
    first.stop()

    # A new job from a checkpoint: the converted model, not registered yet, takes the rows; register sends them.
    second = ps_cluster_factory(_config(), shards=2)
    again = make_sparse(Ranker(seed=42))
    again.load_state_dict(state)
    with PSClient(second.address) as client:
        client.register(again)
        torch.testing.assert_close(_predict(again, held_out), trained, atol=1e-6, rtol=0)
    with pytest.raises(RuntimeError, match=r"size mismatch for item\.weight"):
        make_sparse(Ranker()).load_state_dict({**state, "item.weight": torch.zeros(3, 8)})
    with pytest.raises(RuntimeError, match=r"Missing key\(s\) in state_dict: \"item\.weight\""):
        make_sparse(Ranker()).load_state_dict({k: v for k, v in state.items() if k != "item.weight"})


def test_a_model_that_does_not_fit_the_file_is_told_how_to_build_one_that_does(
    ps_cluster_factory: Callable[..., LocalCluster], tmp_path: Path
) -> None:
    cluster = ps_cluster_factory(_config(), shards=1)
    model = make_sparse(Ranker())
    path = tmp_path / "ranker.safetensors"
    with PSClient(cluster.address) as client:
        PSOptimizer(model, client)
        client.save(model, path)
    cluster.stop()
    fix = r"build the model as the saved one was built.*make_sparse\(model, unbounded=\[\.\.\.\]\).*plain model"
    with pytest.raises(ValueError, match=rf"holds tables \['item', 'tags', 'user'\], the model \[\]: {fix}"):
        load(nn.Sequential(nn.Linear(20, 1)), path)
    partly = Ranker()
    partly.user = SparseEmbedding(dim=4, num_embeddings=50)
    partly.extra = SparseEmbedding(dim=4)
    with pytest.raises(ValueError, match=rf"the model \['extra', 'item', 'tags', 'user'\]: {fix}"):
        load(partly, path)
    bigger = Ranker()
    bigger.item = nn.Embedding(500, 8)
    with pytest.raises(ValueError, match=r"table 'item': the file's is \[400, 8\], the model's Embedding \[500, 8\]"):
        load(bigger, path)
