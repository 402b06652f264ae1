"""A model written for plain torch, trained through the servers with `make_sparse` and `PSOptimizer`, saved with
`PSClient.save` and served by `worker.load` with no server.

Real shards on 127.0.0.1 (threads). Each training test runs the same model locally with torch's own optimizer on
the same batches and asserts the two agree: converted tables start from the module's own weights and follow
nn.Embedding / nn.EmbeddingBag exactly (padding_idx, per_sample_weights, include_last_offset, 2-D bags).
"""

from __future__ import annotations

import copy
import json
import struct
from collections.abc import Callable
from pathlib import Path

import numpy as np
import pytest
import torch
from safetensors import safe_open
from safetensors.numpy import load_file
from torch import nn

from paramserver.config import ServerConfig
from paramserver.server.cluster import LocalCluster
from paramserver.shard.schedules import lr_at
from paramserver.tables import initial_rows
from worker import PSClient, PSOptimizer, SparseEmbedding, load, make_sparse

pytestmark = pytest.mark.timeout(90)

BATCH = 16


class Shop(nn.Module):
    """Plain torch: tables at several depths and of several kinds, one registered under two names."""

    def __init__(self) -> None:
        super().__init__()
        self.fields = nn.ModuleDict({"item": nn.Embedding(500, 8), "shop": nn.Embedding(40, 4, padding_idx=0)})
        self.tags = nn.ModuleList([nn.EmbeddingBag(300, 8, mode="sum")])
        self.words = nn.Sequential(nn.EmbeddingBag(200, 4, mode="mean", padding_idx=3, include_last_offset=True))
        self.same = self.fields["shop"]  # one module, two paths: one table
        self.fc = nn.Linear(24, 1)

    def forward(
        self, x: torch.Tensor, words: torch.Tensor, offsets: torch.Tensor, weights: torch.Tensor
    ) -> torch.Tensor:
        parts = [
            self.fields["item"](x[:, 0]),
            self.same(x[:, 1]),
            self.tags[0](x[:, 2:5], per_sample_weights=weights),
            self.words[0](words, offsets),
        ]
        return self.fc(torch.cat(parts, 1)).squeeze(-1)


def _batches(count: int, seed: int = 1) -> list[tuple[torch.Tensor, ...]]:
    g = torch.Generator().manual_seed(seed)
    out = []
    for _ in range(count):
        x = torch.stack(
            [
                torch.randint(0, 500, (BATCH,), generator=g),
                torch.randint(0, 6, (BATCH,), generator=g),  # padding ID 0 among them
                torch.randint(0, 300, (BATCH,), generator=g),
                torch.randint(0, 300, (BATCH,), generator=g),
                torch.randint(0, 300, (BATCH,), generator=g),
            ],
            1,
        )
        lengths = torch.randint(1, 4, (BATCH,), generator=g)
        words = torch.randint(0, 8, (int(lengths.sum()),), generator=g)  # padding ID 3 among them
        offsets = torch.cat([torch.zeros(1, dtype=torch.long), lengths.cumsum(0)])  # include_last_offset
        weights = torch.rand((BATCH, 3), generator=g)
        out.append((x, words, offsets, weights, torch.randn(BATCH, generator=g)))
    return out


def _loss(model: nn.Module, batch: tuple[torch.Tensor, ...]) -> torch.Tensor:
    *inputs, y = batch
    return nn.functional.mse_loss(model(*inputs), y)


@pytest.mark.parametrize(("optimizer", "local"), [("sgd", torch.optim.SGD), ("adagrad", torch.optim.Adagrad)])
def test_a_converted_model_trains_through_the_servers_as_torch_trains_it_locally(
    ps_cluster_factory: Callable[..., LocalCluster], optimizer: str, local: type[torch.optim.Optimizer]
) -> None:
    cluster = ps_cluster_factory(ServerConfig(mode="sync", workers=1, optimizer=optimizer, lr=0.1), shards=2)
    torch.manual_seed(0)
    reference = Shop()
    model = make_sparse(copy.deepcopy(reference))
    assert not [m for m in model.modules() if isinstance(m, nn.Embedding | nn.EmbeddingBag)]
    assert model.same is model.fields["shop"] and isinstance(model.same, SparseEmbedding)
    batches = _batches(4)
    with PSClient(cluster.address) as client:
        opt = PSOptimizer(model, client)
        torch_opt = local(reference.parameters(), lr=0.1)
        with torch.no_grad():
            assert torch.allclose(model(*batches[0][:-1]), reference(*batches[0][:-1]), atol=1e-6)
        for batch in batches:
            for m, o in ((model, opt), (reference, torch_opt)):
                o.zero_grad()
                _loss(m, batch).backward()
                o.step()
        with torch.no_grad():
            got, want = model(*batches[0][:-1]), reference(*batches[0][:-1])
            start = Shop()(*batches[0][:-1])
        assert torch.allclose(got, want, atol=1e-5), (got - want).abs().max()
        assert not torch.allclose(got, start, atol=1e-3)
        padding = client.lookup(model, 1, np.array([0]))  # shop's padding row: never trained
        assert np.array_equal(padding, reference.fields["shop"].weight[:1].detach().numpy())


def test_make_sparse_empties_what_it_replaced_and_makes_the_named_tables_unbounded() -> None:
    model = Shop()
    kept = [model.fields["item"].weight, model.tags[0].weight]  # a library's own list of them (regularisation)
    original = model.fields["item"].weight.detach().clone()
    make_sparse(model, unbounded=["tags.0"], optimizer="adagrad", lr=0.05)
    assert all(w.numel() == 0 for w in kept)
    item, tags = model.fields["item"], model.tags[0]
    assert isinstance(item, SparseEmbedding) and isinstance(tags, SparseEmbedding)
    assert item.num_embeddings == 500 and item.given is not None and torch.equal(item.given, original)
    assert tags.num_embeddings is None and tags.given is None and tags.mode == "sum"
    assert item.spec("item").optimizer == "adagrad" and item.spec("item").lr == 0.05


class Tied(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.emb = nn.Embedding(10, 4)
        self.out = nn.Linear(4, 10, bias=False)
        self.out.weight = self.emb.weight


@pytest.mark.parametrize(
    ("build", "said"),
    [
        (lambda: nn.Sequential(nn.Embedding(10, 4, max_norm=1.0)), r"cannot convert '0' \(Embedding\).*max_norm"),
        (lambda: nn.Sequential(nn.Embedding(10, 4, scale_grad_by_freq=True)), r"scale_grad_by_freq"),
        (lambda: nn.Sequential(nn.EmbeddingBag(10, 4, mode="max")), r'mode "max"'),
        (lambda: nn.Sequential(nn.Embedding.from_pretrained(torch.ones(10, 4))), r"frozen weight"),
        (Tied, r"cannot convert 'emb'.*tied to out"),
    ],
    ids=["max-norm", "scale-grad", "bag-max", "frozen", "tied"],
)
def test_what_cannot_be_converted_exactly_is_refused_and_the_model_is_left_alone(
    build: Callable[[], nn.Module], said: str
) -> None:
    model = build()
    before = {k: v.clone() for k, v in model.state_dict().items()}
    with pytest.raises(ValueError, match=said):
        make_sparse(model)
    assert not [m for m in model.modules() if isinstance(m, SparseEmbedding)]
    assert all(torch.equal(before[k], v) for k, v in model.state_dict().items())


def test_an_unbounded_name_that_is_no_embedding_is_refused() -> None:
    with pytest.raises(ValueError, match=r"unbounded names \['tag'\], but the model's embeddings are \['fields.item'"):
        make_sparse(Shop(), unbounded=["tag"])


def test_the_optimizer_shows_the_servers_schedule_and_refuses_a_local_one(
    ps_cluster_factory: Callable[..., LocalCluster],
) -> None:
    config = ServerConfig(
        mode="sync", workers=1, optimizer="sgd", lr=0.2, lr_schedule="cosine", decay_versions=6, warmup_versions=2
    )
    cluster = ps_cluster_factory(config, shards=1)
    model = make_sparse(Shop())
    batch = _batches(1)[0]
    with PSClient(cluster.address) as client:
        opt = PSOptimizer(model, client)
        assert opt.param_groups[0]["lr"] == pytest.approx(lr_at(config, 1))
        for version in range(1, 4):
            loss = opt.step(lambda: (opt.zero_grad(), _loss(model, batch).backward(), _loss(model, batch))[-1])
            assert isinstance(loss, torch.Tensor)
            assert client.versions == [version]
            assert opt.lr == pytest.approx(lr_at(config, version + 1))
        with pytest.raises(TypeError, match=r"--lr-schedule"):
            torch.optim.lr_scheduler.StepLR(opt, step_size=2)
        with pytest.raises(TypeError, match=r"lives on the parameter servers"):
            opt.param_groups[0]["lr"] = 1.0
        saved = opt.state_dict()
        assert saved["state"] == {} and saved["paramserver"]["versions"] == [3]
        opt.load_state_dict(saved)
        with pytest.raises(ValueError, match=r"groups of sizes \[1\], this one \[2\]"):
            opt.load_state_dict({"state": {}, "param_groups": [{"params": [0]}]})
        with pytest.raises(ValueError, match="loss_reduction must be one of mean, sum"):
            PSOptimizer(model, client, loss_reduction="none")


def test_a_saved_model_serves_without_servers_what_the_servers_served(
    ps_cluster_factory: Callable[..., LocalCluster], tmp_path: Path
) -> None:
    cluster = ps_cluster_factory(ServerConfig(mode="sync", workers=1, optimizer="adagrad", lr=0.1), shards=2)
    torch.manual_seed(0)
    model = make_sparse(Shop(), unbounded=["tags.0"])
    batches = _batches(3)
    path = tmp_path / "shop.safetensors"
    with PSClient(cluster.address) as client:
        opt = PSOptimizer(model, client)
        for batch in batches:
            opt.zero_grad()
            _loss(model, batch).backward()
            opt.step()
        with torch.no_grad():
            served = model(*batches[0][:-1])
        client.save(model, path, optimizer_state=True)
        held = client.lookup(model, 2, np.array([5, 6, 10**12]))
    cluster.stop()
    assert sorted(p.name for p in tmp_path.iterdir()) == ["shop.safetensors"]  # no temporary file left

    # safetensors' own reader takes the file: the dense tensors, each table's IDs, rows and optimizer state.
    arrays = load_file(str(path))
    assert set(arrays) >= {"fc.weight", "fc.bias", "fields.item.ids", "fields.item.values", "tags.0.optimizer_state"}
    assert arrays["fields.item.values"].shape == (500, 8) and sorted(arrays["fields.item.ids"]) == list(range(500))
    assert arrays["tags.0.optimizer_state"].shape == arrays["tags.0.values"].shape
    with safe_open(str(path), framework="pt") as f:
        assert f.metadata()["format"] == "paramserver.model/1"
        assert torch.equal(f.get_tensor("fc.bias"), model.fc.bias.detach())

    torch.manual_seed(123)  # another start: everything must come from the file
    fresh = load(make_sparse(Shop(), unbounded=["tags.0"]), path)
    with torch.no_grad():
        assert torch.equal(fresh(*batches[0][:-1]), served)
    tags = fresh.tags[0]
    rows = tags._step.source.lookup(np.array([5, 6, 10**12]))  # an ID never trained reads as its initial rule
    assert np.array_equal(rows, held)
    assert np.array_equal(rows[2:], initial_rows(tags.spec("tags.0"), np.array([10**12])))
    with pytest.raises(IndexError, match=r"ID 500 is outside table"):
        with torch.no_grad():
            fresh.fields["item"](torch.tensor([500]))


def test_a_file_that_does_not_fit_the_model_is_refused(
    ps_cluster_factory: Callable[..., LocalCluster], tmp_path: Path
) -> None:
    cluster = ps_cluster_factory(ServerConfig(mode="sync", workers=1, optimizer="sgd", lr=0.1), shards=1)
    model = make_sparse(Shop())
    path = tmp_path / "shop.safetensors"
    with PSClient(cluster.address) as client:
        PSOptimizer(model, client)
        client.save(model, path)
    other = nn.Sequential(SparseEmbedding(dim=8, num_embeddings=500))
    with pytest.raises(ValueError, match=r"holds tables .*'fields.item'.*the model \['0'\]"):
        load(other, path)
    bigger = make_sparse(Shop())
    bigger.fc = nn.Linear(24, 2)
    with pytest.raises(ValueError, match=r"fc.weight: the file's is \[1, 24\], the model's \[2, 24\]"):
        load(bigger, path)
    junk = tmp_path / "junk.safetensors"
    junk.write_bytes(struct.pack("<Q", 2) + b"{}")
    with pytest.raises(ValueError, match="not a model file written by PSClient.save"):
        load(make_sparse(Shop()), junk)
    header = json.loads(path.read_bytes()[8 : 8 + struct.unpack("<Q", path.read_bytes()[:8])[0]])
    assert json.loads(header["__metadata__"]["tables"])[0]["segments"] == [500]


def test_a_summed_loss_is_left_as_it_is_in_an_async_job(ps_cluster_factory: Callable[..., LocalCluster]) -> None:
    """loss_reduction="sum" scales by the job's workers only where a sync round averages them (tests/
    test_third_party.py); an async job of two workers applies each push on arrival, as a local step would."""
    cluster = ps_cluster_factory(ServerConfig(mode="async", workers=2, optimizer="sgd", lr=0.1), shards=1)
    batch = _batches(1)[0]
    torch.manual_seed(0)
    reference = Shop()
    model = make_sparse(copy.deepcopy(reference))
    start = reference.fc.weight.detach().clone()
    with PSClient(cluster.address) as client:
        assert client.world_size == 2
        opt = PSOptimizer(model, client, loss_reduction="sum")
        local = torch.optim.SGD(reference.parameters(), lr=0.1)
        for m, o in ((model, opt), (reference, local)):
            o.zero_grad()
            (_loss(m, batch) * BATCH).backward()
            o.step()
        assert torch.allclose(model.fc.weight, reference.fc.weight, atol=1e-6)
        assert not torch.allclose(model.fc.weight, start, atol=1e-3)
