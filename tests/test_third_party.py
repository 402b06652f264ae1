"""Other people's code, unchanged, trained through the servers: deepctr-torch 0.3.0's DeepFM by its own `fit()`, a
LightningModule by PyTorch Lightning's Trainer (automatic optimization), and torch-rechub 0.9.0's DeepFM by its
CTRTrainer. Each with nothing but `make_sparse` and `PSOptimizer`; two workers in a sync job (threads, each with its
own client and model) equal the same code trained locally with torch's SGD on the combined batches.

The libraries are installed by the Makefile (deepctr-torch with --no-deps: its declared dependencies would pull
more than the torch, tqdm and scikit-learn it uses; torch-rechub as the dev extra names it, adding pandas).
deepctr-torch asks PyPI for its latest version on import, in a thread: the test imports it with requests.get
failing at once, and waits for that thread.
"""

from __future__ import annotations

import copy
import threading
from collections.abc import Callable
from typing import Any
from unittest import mock

import numpy as np
import pytest
import torch
from torch import nn
from torch.utils.data import DataLoader, TensorDataset

from paramserver.config import ServerConfig
from paramserver.server.cluster import LocalCluster
from worker import PSClient, PSOptimizer, make_sparse

pytestmark = pytest.mark.timeout(180)

LR = 0.05
WORKERS = 2
BATCH = 64  # per worker; the local run's batches are twice this, the two workers' step-k batches one after the other
STEPS = 12


def _in_threads(work: list[Callable[[], None]]) -> None:
    errors: list[BaseException] = []

    def run(fn: Callable[[], None]) -> None:
        try:
            fn()
        except BaseException as exc:  # noqa: BLE001 - re-raised in the test's thread
            errors.append(exc)

    threads = [threading.Thread(target=run, args=(fn,), daemon=True) for fn in work]
    for t in threads:
        t.start()
    for t in threads:
        t.join(150)
    assert not any(t.is_alive() for t in threads), "a worker did not finish"
    if errors:
        raise errors[0]


def _combined(parts: list[np.ndarray]) -> np.ndarray:
    """The workers' rows as the local run sees them: step k's batch is worker 0's step-k batch, then worker 1's."""
    blocks = [p[k * BATCH : (k + 1) * BATCH] for k in range(STEPS) for p in parts]
    return np.concatenate(blocks)


# -- deepctr-torch ---------------------------------------------------------------------------------------------------


@pytest.fixture(scope="module")
def deepctr() -> Any:
    before = set(threading.enumerate())
    with mock.patch("requests.get", side_effect=OSError("no network in the tests")):
        import deepctr_torch

        for thread in set(threading.enumerate()) - before:  # its version check, failing at once
            thread.join(10)
    return deepctr_torch


FIELDS = {"user": 300, "item": 500, "city": 40, "device": 7}
DENSE = ("age", "price")


def _click_data(rows: int, seed: int = 0) -> tuple[dict[str, np.ndarray], np.ndarray]:
    rng = np.random.default_rng(seed)
    x: dict[str, np.ndarray] = {name: rng.integers(0, size, rows) for name, size in FIELDS.items()}
    for name in DENSE:
        x[name] = rng.random(rows).astype(np.float32)
    logit = np.sin(x["user"] * 0.7) + np.cos(x["item"] * 1.3) + (x["device"] == 3) + x["age"] - 0.5
    y = (rng.random(rows) < 1 / (1 + np.exp(-logit))).astype(np.float32)
    return x, y


def _deepfm(deepctr: Any) -> nn.Module:
    from deepctr_torch.inputs import DenseFeat, SparseFeat

    columns = [SparseFeat(name, size, embedding_dim=4) for name, size in FIELDS.items()]
    columns += [DenseFeat(name, 1) for name in DENSE]
    return deepctr.models.DeepFM(
        columns,
        columns,
        task="binary",
        dnn_hidden_units=(16, 8),
        l2_reg_linear=0.0,
        l2_reg_embedding=0.0,
        l2_reg_dnn=0.0,
        dnn_dropout=0.0,
        seed=1024,
        device="cpu",
    )


def test_deepctr_deepfm_trained_by_its_own_fit_through_the_servers_equals_local_training(
    deepctr: Any, ps_cluster_factory: Callable[..., LocalCluster]
) -> None:
    config = ServerConfig(mode="sync", workers=WORKERS, optimizer="sgd", lr=LR)
    cluster = ps_cluster_factory(config, shards=2)
    x, y = _click_data(WORKERS * BATCH * STEPS + 512)
    held_out = {k: v[-512:] for k, v in x.items()}
    parts = [slice(r * BATCH * STEPS, (r + 1) * BATCH * STEPS) for r in range(WORKERS)]

    reference = _deepfm(deepctr)
    start = reference.predict(held_out, batch_size=512)
    reference.compile(torch.optim.SGD(reference.parameters(), lr=LR), "binary_crossentropy")
    local_x = {k: _combined([v[p] for p in parts]) for k, v in x.items()}
    reference.fit(
        local_x, _combined([y[p] for p in parts]), batch_size=WORKERS * BATCH, epochs=1, verbose=0, shuffle=False
    )
    want = reference.predict(held_out, batch_size=512)

    got: dict[int, np.ndarray] = {}
    # Built here, one after the other: a model's seed is torch's global one, which two threads would interleave.
    models = [_deepfm(deepctr) for _ in range(WORKERS)]

    def worker(rank: int) -> Callable[[], None]:
        def run() -> None:
            model = models[rank]
            embeddings = {id(m.weight) for m in model.modules() if isinstance(m, nn.Embedding)}
            listed = [w for weights, _, _ in model.regularization_weight for w in weights if id(w) in embeddings]
            assert listed, "deepctr no longer lists the tables' weights: the check below would tell nothing"
            model = make_sparse(model)
            assert not [m for m in model.modules() if isinstance(m, nn.Embedding)]
            assert all(w.numel() == 0 for w in listed)  # deepctr's own list of the tables holds no copy of them
            with PSClient(cluster.address) as client:
                model.compile(PSOptimizer(model, client, loss_reduction="sum"), "binary_crossentropy")
                mine = parts[client.rank]
                model.fit(
                    {k: v[mine] for k, v in x.items()}, y[mine], batch_size=BATCH, epochs=1, verbose=0, shuffle=False
                )
                got[client.rank] = model.predict(held_out, batch_size=512)
                client.leave(finished=True)

        return run

    _in_threads([worker(r) for r in range(WORKERS)])
    assert np.abs(want - start).max() > 1e-3, "training did not move the predictions: the test would not tell"
    for rank in range(WORKERS):
        print(f"deepctr rank {rank}: max |distributed - local| = {np.abs(got[rank] - want).max():.2e}")
        assert np.allclose(got[rank], want, atol=1e-5), np.abs(got[rank] - want).max()


# -- deepctr-torch's DeepFM as issue 37 converted it: Criteo-like fields, unbounded big tables, Adagrad ------------

CRITEO_SIZES = (200_000, 100_000, 1_000, 300, 50, 12, 7, 3_000)  # the first two fields made unbounded
CRITEO_WORKERS, CRITEO_BATCH, CRITEO_LR = 2, 500, 0.05
REGS: dict[str, float] = {"l2_reg_linear": 0.0, "l2_reg_embedding": 0.0}


def _criteo_like(rows: int, seed: int = 0) -> tuple[dict[str, np.ndarray], np.ndarray]:
    """Zipf IDs per field (most of the big fields' IDs seen once), 4 dense features, labels from a planted logit."""
    rng = np.random.default_rng(seed)
    x: dict[str, np.ndarray] = {}
    logit = np.full(rows, -1.0)
    for f, size in enumerate(CRITEO_SIZES):
        ids = (rng.zipf(1.2, rows) * 2_654_435_761 + f) % size
        x[f"C{f}"] = ids
        logit += np.sin(ids * (0.37 + f)) * (0.8 if f < 4 else 0.3) / np.sqrt(1 + ids / (50 if size > 1000 else 1e9))
    for d in range(4):
        x[f"I{d}"] = rng.standard_normal(rows).astype(np.float32)
        logit += 0.3 * x[f"I{d}"] if d < 2 else 0.0
    return x, (rng.random(rows) < 1 / (1 + np.exp(-logit))).astype(np.float32)


def _criteo_deepfm(deepctr: Any, zero_tables: bool = False) -> nn.Module:
    from deepctr_torch.inputs import DenseFeat, SparseFeat

    columns = [SparseFeat(f"C{f}", size, embedding_dim=8) for f, size in enumerate(CRITEO_SIZES)]
    columns += [DenseFeat(f"I{d}", 1) for d in range(4)]
    model = deepctr.models.DeepFM(
        columns, columns, task="binary", dnn_hidden_units=(64, 32), init_std=1e-4, seed=1024, device="cpu", **REGS
    )
    if zero_tables:
        for module in model.modules():
            if isinstance(module, nn.Embedding):
                nn.init.zeros_(module.weight)
    return model


def _big_tables(model: nn.Module) -> list[str]:
    return [
        path
        for path, module in model.named_modules()
        if isinstance(module, nn.Embedding) and path.rsplit(".", 1)[-1] in ("C0", "C1")
    ]


def _mean_bce(pred: torch.Tensor, target: torch.Tensor, reduction: str = "sum") -> torch.Tensor:
    """deepctr's fit asks for a summed loss; this one averages the batch (what loss_reduction="mean" says)."""
    return nn.functional.binary_cross_entropy(pred, target, reduction="mean")


def _deepfm_through_servers(
    deepctr: Any,
    cluster: LocalCluster,
    x: dict[str, np.ndarray],
    y: np.ndarray,
    held_out: dict[str, np.ndarray],
    *,
    unbounded: bool,
    reduction: str,
    zero_tables: bool = False,
) -> np.ndarray:
    """Rank 0's predictions on `held_out` after each worker's fit() over its half of (x, y)."""
    got: dict[int, np.ndarray] = {}
    models = [_criteo_deepfm(deepctr, zero_tables) for _ in range(CRITEO_WORKERS)]
    rows = len(y) // CRITEO_WORKERS

    def worker(index: int) -> Callable[[], None]:
        def run() -> None:
            model = models[index]
            model = make_sparse(model, unbounded=_big_tables(model) if unbounded else ())
            with PSClient(cluster.address) as client:
                loss = _mean_bce if reduction == "mean" else "binary_crossentropy"
                model.compile(PSOptimizer(model, client, loss_reduction=reduction), loss)
                mine = slice(client.rank * rows, (client.rank + 1) * rows)
                part = {k: v[mine] for k, v in x.items()}
                model.fit(part, y[mine], batch_size=CRITEO_BATCH, epochs=1, verbose=0, shuffle=False)
                got[client.rank] = model.predict(held_out, batch_size=4096)
                client.leave(finished=True)

        return run

    _in_threads([worker(r) for r in range(CRITEO_WORKERS)])
    return got[0]


def _criteo_local(
    deepctr: Any, x: dict[str, np.ndarray], y: np.ndarray, zero_tables: bool = False, reduction: str = "sum"
) -> nn.Module:
    """The same DeepFM fit() locally with torch's Adagrad on the combined batches (each worker's step-k batch, one
    after the other)."""
    rows = len(y) // CRITEO_WORKERS
    steps = rows // CRITEO_BATCH
    order = np.concatenate(
        [
            np.arange(r * rows + k * CRITEO_BATCH, r * rows + (k + 1) * CRITEO_BATCH)
            for k in range(steps)
            for r in (0, 1)
        ]
    )
    model = _criteo_deepfm(deepctr, zero_tables)
    loss = _mean_bce if reduction == "mean" else "binary_crossentropy"
    model.compile(torch.optim.Adagrad(model.parameters(), lr=CRITEO_LR), loss)
    batch = CRITEO_WORKERS * CRITEO_BATCH
    model.fit({k: v[order] for k, v in x.items()}, y[order], batch_size=batch, epochs=1, verbose=0, shuffle=False)
    return model


def test_unbounded_tables_train_as_local_adagrad_does_with_a_summed_or_averaged_loss(
    deepctr: Any, ps_cluster_factory: Callable[..., LocalCluster]
) -> None:
    """Exact: the DeepFM's tables zeroed (so an unbounded table's inferred rule, zeros, is the module's own start),
    two workers' fit() through the servers equal a local fit() with torch's Adagrad on the same loss, summed or
    averaged. A row gradient scaled or divided otherwise than the dense part's, or a row optimizer unlike torch's,
    fails it. (A summed and an averaged loss are not the same training for Adagrad itself: at deepctr's init_std
    1e-4 an averaged loss leaves gradients near Adagrad's eps, 1e-10, which then damps their steps.)"""
    x, y = _criteo_like(CRITEO_WORKERS * CRITEO_BATCH * 6 + 1000)
    train = {k: v[:-1000] for k, v in x.items()}
    held_out = {k: v[-1000:] for k, v in x.items()}
    for reduction in ("sum", "mean"):
        want = _criteo_local(deepctr, train, y[:-1000], True, reduction).predict(held_out, batch_size=4096)
        config = ServerConfig(mode="sync", workers=CRITEO_WORKERS, optimizer="adagrad", lr=CRITEO_LR)
        cluster = ps_cluster_factory(config, shards=2)
        got = _deepfm_through_servers(
            deepctr, cluster, train, y[:-1000], held_out, unbounded=True, reduction=reduction, zero_tables=True
        )
        cluster.stop()
        gap = np.abs(got - want).max()
        print(f"unbounded, {reduction}: max |distributed - local| = {gap:.2e}")
        assert gap < (1e-5 if reduction == "sum" else 1e-3), gap  # Adagrad near eps amplifies roundings


def test_the_deepfm_of_issue_37_reaches_local_auc_with_unbounded_tables_and_either_reduction(
    deepctr: Any, ps_cluster_factory: Callable[..., LocalCluster]
) -> None:
    """The issue's setup, smaller: deepctr's DeepFM (init_std 1e-4), its two big fields unbounded, fit() by two
    workers x two shards, sync Adagrad; held-out AUC against the same fit() locally."""
    from sklearn.metrics import roc_auc_score

    rows = CRITEO_WORKERS * CRITEO_BATCH * 20
    x, y = _criteo_like(rows + 5000)
    train = {k: v[:rows] for k, v in x.items()}
    held_out = {k: v[rows:] for k, v in x.items()}
    local = roc_auc_score(y[rows:], _criteo_local(deepctr, train, y[:rows]).predict(held_out, batch_size=4096))
    figures = {}
    for unbounded, reduction in ((False, "sum"), (True, "sum"), (True, "mean")):
        config = ServerConfig(mode="sync", workers=CRITEO_WORKERS, optimizer="adagrad", lr=CRITEO_LR)
        cluster = ps_cluster_factory(config, shards=2)
        got = _deepfm_through_servers(
            deepctr, cluster, train, y[:rows], held_out, unbounded=unbounded, reduction=reduction
        )
        cluster.stop()
        figures[("unbounded" if unbounded else "bounded", reduction)] = roc_auc_score(y[rows:], got)
    print(f"DeepFM AUC: local {local:.4f}, " + ", ".join(f"{u} {r} {a:.4f}" for (u, r), a in figures.items()))
    assert local > 0.6, "the data carries too little signal: the test would not tell"
    for auc in figures.values():
        assert auc >= local - 0.01, figures


# -- PyTorch Lightning -----------------------------------------------------------------------------------------------


class Ranker(nn.Module):
    """Plain torch: a user table, a bag of tags, and an MLP."""

    def __init__(self) -> None:
        super().__init__()
        torch.manual_seed(7)
        self.user = nn.Embedding(200, 8)
        self.tags = nn.EmbeddingBag(100, 8, mode="mean")
        self.mlp = nn.Sequential(nn.Linear(16, 16), nn.ReLU(), nn.Linear(16, 1))

    def forward(self, user: torch.Tensor, tags: torch.Tensor) -> torch.Tensor:
        return self.mlp(torch.cat([self.user(user), self.tags(tags)], 1)).squeeze(-1)


def _ranking_data(rows: int) -> TensorDataset:
    g = torch.Generator().manual_seed(3)
    user = torch.randint(0, 200, (rows,), generator=g)
    tags = torch.randint(0, 100, (rows, 3), generator=g)
    y = ((user % 7) < 3).float() + 0.1 * torch.randn(rows, generator=g)
    return TensorDataset(user, tags, y)


def _lightning(net: nn.Module, optimizer: Callable[[nn.Module], torch.optim.Optimizer]) -> Any:
    import pytorch_lightning as pl

    class Task(pl.LightningModule):
        def __init__(self) -> None:
            super().__init__()
            self.net = net

        def training_step(self, batch: tuple[torch.Tensor, ...], batch_idx: int) -> torch.Tensor:
            user, tags, y = batch
            return nn.functional.mse_loss(self.net(user, tags), y)

        def configure_optimizers(self) -> torch.optim.Optimizer:
            return optimizer(self)

    return Task()


def _trainer() -> Any:
    import pytorch_lightning as pl

    return pl.Trainer(
        max_epochs=1,
        accelerator="cpu",
        devices=1,
        logger=False,
        enable_checkpointing=False,
        enable_progress_bar=False,
        enable_model_summary=False,
    )


def test_a_lightning_module_trained_by_lightnings_trainer_through_the_servers_equals_local_training(
    ps_cluster_factory: Callable[..., LocalCluster],
) -> None:
    config = ServerConfig(mode="sync", workers=WORKERS, optimizer="sgd", lr=LR)
    cluster = ps_cluster_factory(config, shards=2)
    data = _ranking_data(WORKERS * BATCH * STEPS)
    tensors = [t.numpy() for t in data.tensors]
    parts = [slice(r * BATCH * STEPS, (r + 1) * BATCH * STEPS) for r in range(WORKERS)]
    local = TensorDataset(*(torch.from_numpy(_combined([t[p] for p in parts])) for t in tensors))
    probe = data.tensors[0][:64], data.tensors[1][:64]

    reference = Ranker()
    with torch.no_grad():
        start = reference(*probe)
    task = _lightning(reference, lambda m: torch.optim.SGD(m.parameters(), lr=LR))
    _trainer().fit(task, DataLoader(local, batch_size=WORKERS * BATCH, shuffle=False))
    with torch.no_grad():
        want = reference(*probe)

    got: dict[int, torch.Tensor] = {}
    nets = [make_sparse(Ranker()) for _ in range(WORKERS)]  # one after the other: Ranker seeds torch's global RNG

    def worker(index: int) -> Callable[[], None]:
        def run() -> None:
            net = nets[index]
            with PSClient(cluster.address) as client:
                task = _lightning(net, lambda m: PSOptimizer(m, client))
                mine = TensorDataset(*(torch.from_numpy(t[parts[client.rank]]) for t in tensors))
                _trainer().fit(task, DataLoader(mine, batch_size=BATCH, shuffle=False))
                with torch.no_grad():
                    got[client.rank] = net(*probe)
                client.leave(finished=True)

        return run

    _in_threads([worker(r) for r in range(WORKERS)])
    assert (want - start).abs().max() > 1e-3, "training did not move the predictions: the test would not tell"
    for rank in range(WORKERS):
        print(f"lightning rank {rank}: max |distributed - local| = {(got[rank] - want).abs().max():.2e}")
        assert torch.allclose(got[rank], want, atol=1e-5), (got[rank] - want).abs().max()


@pytest.mark.parametrize(
    "scheduler",
    [
        lambda opt: torch.optim.lr_scheduler.StepLR(opt, step_size=2),
        lambda opt: torch.optim.lr_scheduler.CosineAnnealingLR(opt, T_max=10),
    ],
    ids=["StepLR", "CosineAnnealingLR"],
)
def test_a_torch_lr_scheduler_on_the_ps_optimizer_is_refused_saying_where_schedules_run(
    scheduler: Callable[[torch.optim.Optimizer], Any], ps_cluster_factory: Callable[..., LocalCluster]
) -> None:
    cluster = ps_cluster_factory(ServerConfig(mode="sync", workers=1, optimizer="sgd", lr=LR), shards=1)
    model = make_sparse(copy.deepcopy(Ranker()))
    with PSClient(cluster.address) as client:
        optimizer = PSOptimizer(model, client)
        with pytest.raises(TypeError, match=r"ps-server --lr-schedule"):
            scheduler(optimizer)


# -- torch-rechub ----------------------------------------------------------------------------------------------------


class _Clicks(torch.utils.data.Dataset[tuple[dict[str, torch.Tensor], torch.Tensor]]):
    """torch-rechub's batches: a dict of feature name -> IDs, and the label."""

    def __init__(self, rows: dict[str, np.ndarray], y: np.ndarray) -> None:
        self.rows, self.y = rows, y

    def __len__(self) -> int:
        return len(self.y)

    def __getitem__(self, i: int) -> tuple[dict[str, torch.Tensor], torch.Tensor]:
        return {k: torch.tensor(v[i]) for k, v in self.rows.items()}, torch.tensor(self.y[i])


def _rechub_deepfm() -> nn.Module:
    from torch_rechub.basic.features import SparseFeature
    from torch_rechub.models.ranking import DeepFM

    torch.manual_seed(11)  # its tables draw their rows from torch's global RNG (N(0, 1e-4))
    fields = [SparseFeature(name, vocab, embed_dim=8) for name, vocab in (("user", 100), ("item", 60), ("cat", 12))]
    deep = [SparseFeature(f"deep_{f.name}", f.vocab_size, embed_dim=8) for f in fields]
    # No hidden layer: torch-rechub's MLP puts a BatchNorm1d after each, whose batch statistics differ between two
    # workers' halves and the combined batch (a worker's step is not the local step on the combined batch then).
    return DeepFM(deep, fields, {"dims": []})


def _rechub_rows(rows: int) -> tuple[dict[str, np.ndarray], np.ndarray]:
    g = np.random.default_rng(5)
    ids = {name: g.integers(0, vocab, rows) for name, vocab in (("user", 100), ("item", 60), ("cat", 12))}
    ids.update({f"deep_{name}": v for name, v in list(ids.items())})
    y = ((ids["user"] % 3 == 0) ^ (ids["cat"] < 4)).astype(np.float32)
    return ids, y


@pytest.mark.parametrize("wrapped", [False, True], ids=["grouped", "prefetching"])
def test_torch_rechubs_ctr_trainer_with_the_ps_optimizer_equals_local_training(
    wrapped: bool, ps_cluster_factory: Callable[..., LocalCluster], tmp_path: Any
) -> None:
    from torch_rechub.trainers import CTRTrainer

    from worker import prefetching

    ids, y = _rechub_rows(WORKERS * BATCH * STEPS)
    parts = [slice(r * BATCH * STEPS, (r + 1) * BATCH * STEPS) for r in range(WORKERS)]
    combined = _Clicks({k: _combined([v[p] for p in parts]) for k, v in ids.items()}, _combined([y[p] for p in parts]))
    probe = {k: torch.from_numpy(v[:64]) for k, v in ids.items()}

    reference = _rechub_deepfm()
    with torch.no_grad():
        start = reference(probe)
    local = CTRTrainer(reference, torch.optim.SGD, {"lr": LR}, n_epoch=1, model_path=str(tmp_path))
    local.fit(DataLoader(combined, batch_size=WORKERS * BATCH, shuffle=False))
    with torch.no_grad():
        want = reference(probe)

    config = ServerConfig(mode="sync", workers=WORKERS, optimizer="sgd", lr=LR)
    cluster = ps_cluster_factory(config, shards=2)
    models = [make_sparse(_rechub_deepfm()) for _ in range(WORKERS)]
    got: dict[int, torch.Tensor] = {}

    def worker(index: int) -> Callable[[], None]:
        def run() -> None:
            model = models[index]
            with PSClient(cluster.address) as client:
                mine = _Clicks({k: v[parts[client.rank]] for k, v in ids.items()}, y[parts[client.rank]])
                trainer = CTRTrainer(
                    model, lambda params, **_: PSOptimizer(model, client), n_epoch=1, model_path=str(tmp_path)
                )
                loader = DataLoader(mine, batch_size=BATCH, shuffle=False)
                trainer.fit(prefetching(loader, model) if wrapped else loader)
                with torch.no_grad():
                    got[client.rank] = model(probe)
                client.leave(finished=True)

        return run

    _in_threads([worker(r) for r in range(WORKERS)])
    assert (want - start).abs().max() > 1e-3, "training did not move the predictions: the test would not tell"
    for rank in range(WORKERS):
        assert torch.allclose(got[rank], want, atol=1e-5), (rank, (got[rank] - want).abs().max())
