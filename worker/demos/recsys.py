"""A DLRM-style recommendation workload: click logs from a planted model, trained locally and on 2 shards x 2 workers.

`python -m worker.demos.recsys` is the demo of the sparse tables: it generates click logs, trains the same model
locally (torch's sparse nn.Embedding / nn.EmbeddingBag + Adagrad) and through ps-server (worker.SparseEmbedding
tables, the servers' Adagrad), and prints the held-out AUC of both next to the ceiling: the AUC of the planted
model's own click probabilities, which no model of the data can beat. `--local-only` trains just the local copy.

Why a planted model: real click logs have no known ceiling, so "close to the best achievable" could not be
checked. Here labels are Bernoulli(sigmoid(planted logit)), and the planted logit puts most of its signal where it
can be learned from the data (dense features, categories, tags, items, the head users and their taste for
categories) while the Zipf tail of users, most of the million-plus IDs, carries little: a model trained on the logs
can come within a few percent of the ceiling, and a distributed run that drifted from the local one would show.

The two runs see exactly the same samples in the same steps: sample i belongs to rank i % world, every rank shuffles
its own part with the same permutation each epoch, and local step t trains on the concatenation of the ranks' step-t
batches (`rank_batches`, `local_batches`). Sync mode averages the workers' gradients, each the mean over its own
batch, which is the mean over the combined batch that local training takes; both start from the same weights (the
dense ones from the seed, the rows from `paramserver.tables.initial_rows`), so the two differ only by float
rounding and the order of sums.
"""

from __future__ import annotations

import argparse
import json
import math
import signal
import subprocess
import sys
import tempfile
import time
from collections.abc import Iterator, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING, Any

import numpy as np
import torch
import torch.nn.functional as F
from torch import nn

from paramserver.tables import TableSpec, initial_rows, mix64
from worker.client.sparse import SparseEmbedding
from worker.models.clicks import mlp

if TYPE_CHECKING:
    from worker.client import PSClient

# -- the planted world ------------------------------------------------------------------------------------------

USER_RANKS = 10**9  # users are Zipf ranks 1..USER_RANKS, hashed to int64 IDs
NUM_ITEMS = 100_000
NUM_CATEGORIES = 1_000
NUM_TAGS = 10_000
NUM_DENSE = 4
MAX_TAGS = 4  # tags per sample: 1..MAX_TAGS
TASTE_DIM = 4  # the planted user x category interaction's rank

USER_ZIPF = 1.0  # exponents of the rank distributions
ITEM_ZIPF = 1.0
TAG_ZIPF = 1.0
# Effects of a user or item shrink past these ranks as sqrt(head / rank): the head, seen often, carries the signal;
# the tail, seen once or never in training, carries little (its effects cannot be learned, only guessed at).
USER_HEAD = 300
ITEM_HEAD = 2_000

BASE_LOGIT = -1.0  # about 30 % clicks
USER_BIAS_STD = 0.7
USER_TASTE_STD = 0.6
ITEM_BIAS_STD = 0.5
CATEGORY_BIAS_STD = 0.5
TAG_BIAS_STD = 0.8


@dataclass(frozen=True, eq=False)
class Batch:
    """One batch as the model takes it: torch tensors, IDs raw (the model maps them to rows)."""

    dense: torch.Tensor  # float32 [B, NUM_DENSE]
    user: torch.Tensor  # int64 [B], unbounded IDs
    item: torch.Tensor  # int64 [B], 0..NUM_ITEMS-1
    category: torch.Tensor  # int64 [B], 0..NUM_CATEGORIES-1
    tags: torch.Tensor  # int64 [T], every sample's tags one after the other
    tag_offsets: torch.Tensor  # int64 [B], where each sample's tags start in `tags` (nn.EmbeddingBag's offsets)
    label: torch.Tensor  # float32 [B], 1.0 for a click

    def __len__(self) -> int:
        return len(self.label)


# eq=False: field-wise equality over arrays is ambiguous, identity is what a frozen holder needs.
@dataclass(frozen=True, eq=False)
class Clicks:
    """A split of the click logs, one row per impression, as numpy arrays (`batch` cuts torch batches)."""

    dense: np.ndarray  # float32 [n, NUM_DENSE], standard normal
    user: np.ndarray  # int64 [n], hashes of Zipf ranks: any int64, negative ones included
    item: np.ndarray  # int64 [n]
    category: np.ndarray  # int64 [n], the item's category
    tags: np.ndarray  # int64 [sum of bag sizes], flat
    tag_offsets: np.ndarray  # int64 [n + 1], sample i's tags are tags[tag_offsets[i]:tag_offsets[i + 1]]
    label: np.ndarray  # float32 [n]
    prob: np.ndarray  # float64 [n], the planted model's click probability (label ~ Bernoulli(prob))

    def __len__(self) -> int:
        return len(self.label)

    def batch(self, idx: np.ndarray) -> Batch:
        """The samples at `idx`, in that order, as a torch Batch (tags gathered bag by bag, vectorised)."""
        idx = np.asarray(idx, dtype=np.int64)
        starts, ends = self.tag_offsets[idx], self.tag_offsets[idx + 1]
        sizes = ends - starts
        offsets = np.zeros(len(idx), dtype=np.int64)
        np.cumsum(sizes[:-1], out=offsets[1:])
        # Position j of the gathered bags is tag starts[bag] + (j - offsets[bag]).
        flat = np.repeat(starts - offsets, sizes) + np.arange(int(sizes.sum()), dtype=np.int64)
        return Batch(
            dense=torch.from_numpy(self.dense[idx]),
            user=torch.from_numpy(self.user[idx]),
            item=torch.from_numpy(self.item[idx]),
            category=torch.from_numpy(self.category[idx]),
            tags=torch.from_numpy(self.tags[flat]),
            tag_offsets=torch.from_numpy(offsets),
            label=torch.from_numpy(self.label[idx]),
        )

    def distinct_ids(self) -> dict[str, int]:
        """Distinct IDs per table in this split."""
        return {
            "user": len(np.unique(self.user)),
            "item": len(np.unique(self.item)),
            "category": len(np.unique(self.category)),
            "tags": len(np.unique(self.tags)),
        }


@dataclass(frozen=True, eq=False)
class ClickLogs:
    """Training and held-out click logs drawn from one planted model, and that model's own held-out AUC."""

    train: Clicks
    test: Clicks
    seed: int
    ceiling_auc: float  # AUC of the planted probabilities on the test split: what a perfect model would score
    user_vocab: np.ndarray  # int64, sorted: every user ID of train and test (the local model's user rows)

    def distinct_train_ids(self) -> int:
        """Distinct IDs over all tables that training touches: the rows a run's tables come to hold."""
        return sum(self.train.distinct_ids().values())


def _zipf_ranks(rng: np.random.Generator, n: int, exponent: float, size: int) -> np.ndarray:
    """n ranks in 1..size with P(rank) roughly proportional to rank^-exponent (inverse CDF of the continuous
    power law, floored): vectorised and exact enough for a workload, where an exact sampler would need the table."""
    u = rng.random(n)
    if exponent == 1.0:
        r = np.exp(u * math.log(size + 1.0))
    else:
        a = 1.0 - exponent
        r = (u * ((size + 1.0) ** a - 1.0) + 1.0) ** (1.0 / a)
    return np.clip(np.floor(r), 1, size).astype(np.int64)


def _hash_normals(keys: np.ndarray, salt: int, k: int) -> np.ndarray:
    """Standard normals [len(keys), k], a fixed function of (key, salt): per-user effects for a billion possible
    users without a table (Box-Muller over SplitMix64 hashes of the key)."""
    base = mix64(keys.astype(np.uint64) ^ mix64(np.array([salt], dtype=np.uint64)))
    out = np.empty((len(keys), k), dtype=np.float64)
    for j in range(k):
        h1 = mix64(base + np.uint64(2 * j))
        h2 = mix64(base + np.uint64(2 * j + 1))
        u1 = (h1 >> np.uint64(11)).astype(np.float64) * 2.0**-53
        u2 = (h2 >> np.uint64(11)).astype(np.float64) * 2.0**-53
        out[:, j] = np.sqrt(-2.0 * np.log1p(-u1)) * np.cos(2.0 * math.pi * u2)
    return out


def _head_scale(ranks: np.ndarray, head: int) -> np.ndarray:
    """1 for ranks up to `head`, then sqrt(head / rank): how much of an ID's effect the planted model keeps."""
    return np.sqrt(np.minimum(1.0, head / ranks.astype(np.float64)))


def make_click_logs(n_train: int, n_test: int, seed: int = 0) -> ClickLogs:
    """Draw n_train + n_test i.i.d. impressions from the planted model of `seed` (the same logs for the same
    arguments, on every machine) and split them; the ceiling is the planted probabilities' AUC on the test split.

    Each impression: a user (Zipf over USER_RANKS ranks, hashed to int64), an item (Zipf over NUM_ITEMS, through a
    fixed permutation), the item's category, 1..MAX_TAGS tags (Zipf over NUM_TAGS) and NUM_DENSE standard normal
    features. The planted logit: BASE_LOGIT + a nonlinear function of the dense features + category, item and
    mean tag biases + the user's bias + the user's taste for the category (a TASTE_DIM dot product), user and item
    effects shrinking past their head ranks.
    """
    if n_train < 1 or n_test < 1:
        raise ValueError(f"need at least one training and one test sample, not {n_train} and {n_test}")
    n = n_train + n_test
    world = np.random.default_rng([seed, 0])  # the planted model
    rng = np.random.default_rng([seed, 1])  # the impressions
    salt = int(world.integers(0, 2**63))

    item_ids = world.permutation(NUM_ITEMS)  # the item at popularity rank r is item_ids[r - 1]
    item_rank = np.empty(NUM_ITEMS, dtype=np.int64)
    item_rank[item_ids] = np.arange(1, NUM_ITEMS + 1)
    item_category = world.integers(0, NUM_CATEGORIES, NUM_ITEMS)
    item_bias = world.normal(0.0, ITEM_BIAS_STD, NUM_ITEMS) * _head_scale(item_rank, ITEM_HEAD)
    category_bias = world.normal(0.0, CATEGORY_BIAS_STD, NUM_CATEGORIES)
    category_taste = world.normal(0.0, 1.0, (NUM_CATEGORIES, TASTE_DIM))
    tag_ids = world.permutation(NUM_TAGS)
    tag_bias = world.normal(0.0, TAG_BIAS_STD, NUM_TAGS)

    user_rank = _zipf_ranks(rng, n, USER_ZIPF, USER_RANKS)
    user = (mix64(user_rank.astype(np.uint64) ^ np.uint64(salt))).view(np.int64)
    item = item_ids[_zipf_ranks(rng, n, ITEM_ZIPF, NUM_ITEMS) - 1]
    category = item_category[item]
    sizes = rng.integers(1, MAX_TAGS + 1, n)
    tag_offsets = np.zeros(n + 1, dtype=np.int64)
    np.cumsum(sizes, out=tag_offsets[1:])
    tags = tag_ids[_zipf_ranks(rng, int(tag_offsets[-1]), TAG_ZIPF, NUM_TAGS) - 1]
    dense = rng.standard_normal((n, NUM_DENSE)).astype(np.float32)

    x = dense.astype(np.float64)
    logit = BASE_LOGIT + 0.6 * x[:, 0] - 0.5 * x[:, 1] + 0.4 * x[:, 2] + 0.4 * np.tanh(2.0 * x[:, 3])
    logit += 0.3 * x[:, 0] * x[:, 1]
    logit += category_bias[category] + item_bias[item]
    logit += np.add.reduceat(tag_bias[tags], tag_offsets[:-1]) / sizes
    effects = _hash_normals(user_rank, salt, 1 + TASTE_DIM) * _head_scale(user_rank, USER_HEAD)[:, None]
    logit += USER_BIAS_STD * effects[:, 0]
    taste = (effects[:, 1:] * category_taste[category]).sum(axis=1) / math.sqrt(TASTE_DIM)
    logit += USER_TASTE_STD * taste
    prob = 1.0 / (1.0 + np.exp(-logit))
    label = (rng.random(n) < prob).astype(np.float32)

    def split(lo: int, hi: int) -> Clicks:
        offs = tag_offsets[lo : hi + 1]
        return Clicks(
            dense=dense[lo:hi],
            user=user[lo:hi],
            item=item[lo:hi],
            category=category[lo:hi],
            tags=tags[offs[0] : offs[-1]],
            tag_offsets=offs - offs[0],
            label=label[lo:hi],
            prob=prob[lo:hi],
        )

    train, test = split(0, n_train), split(n_train, n)
    return ClickLogs(
        train=train, test=test, seed=seed, ceiling_auc=auc(test.label, test.prob), user_vocab=np.unique(user)
    )


def auc(labels: np.ndarray, scores: np.ndarray) -> float:
    """ROC AUC (scikit-learn's roc_auc_score), 0.5 where the labels are all one class."""
    from sklearn.metrics import roc_auc_score

    if labels.min() == labels.max():
        return 0.5
    return float(roc_auc_score(labels, scores))


# -- batching: the same samples in the same steps, locally and on the workers --------------------------------------


def rank_batches(n: int, batch_size: int, rank: int, world: int, *, seed: int, epoch: int) -> Iterator[np.ndarray]:
    """Sample indices of rank `rank`'s batches in one epoch: its part (samples i with i % world == rank, the
    first n // world of them, so every rank runs the same number of steps) shuffled by a permutation of
    (seed, epoch) that every rank shares, cut into batches of `batch_size` (the last may be short)."""
    if world < 1 or not 0 <= rank < world:
        raise ValueError(f"rank must be in 0..world-1, not {rank} of {world}")
    if batch_size < 1:
        raise ValueError(f"batch_size must be at least 1, not {batch_size}")
    per_rank = n // world
    order = np.random.default_rng([seed, epoch, 7]).permutation(per_rank)
    for start in range(0, per_rank, batch_size):
        yield rank + world * order[start : start + batch_size]


def local_batches(n: int, batch_size: int, world: int, *, seed: int, epoch: int) -> Iterator[np.ndarray]:
    """The local run's batches of one epoch: step t is the concatenation, in rank order, of every rank's step-t
    batch (`rank_batches`), world x batch_size samples, so local step t sees what the sync round t averages."""
    ranks = [rank_batches(n, batch_size, r, world, seed=seed, epoch=epoch) for r in range(world)]
    for parts in zip(*ranks, strict=True):
        yield np.concatenate(parts)


def steps_per_epoch(n: int, batch_size: int, world: int) -> int:
    """Steps each rank (and the local run) takes per epoch."""
    return -(-(n // world) // batch_size)


# -- the model ----------------------------------------------------------------------------------------------------

EMBEDDING_DIM = 16


@dataclass(frozen=True)
class Table:
    """One embedding table of the Recommender, as both the local and the distributed model build it."""

    name: str  # the module's attribute, so the table's name in the model
    num_embeddings: int | None  # None: unbounded int64 IDs
    mode: str | None  # None: one ID per sample; "sum" | "mean": a bag per sample
    seed: int
    init_scale: float = 0.0  # 0: 1/sqrt(dim)

    def spec(self, dim: int) -> TableSpec:
        """The TableSpec the SparseEmbedding of this table has (initial_rows reads init, scale, seed and dim)."""
        return TableSpec(
            name=self.name,
            dim=dim,
            num_embeddings=self.num_embeddings or 0,
            init="normal",
            init_scale=self.init_scale,
            seed=self.seed,
        )


def tables(seed: int) -> tuple[Table, ...]:
    """The Recommender's tables, in construction order, each with its own initialisation seed."""
    base = 1000 * seed
    return (
        Table("user", None, None, base + 1),
        Table("item", NUM_ITEMS, None, base + 2),
        Table("category", NUM_CATEGORIES, None, base + 3),
        Table("tags", NUM_TAGS, "mean", base + 4),
    )


class _LocalTable(nn.Module):
    """A table of the local model: torch's sparse nn.Embedding / nn.EmbeddingBag holding exactly the rows the
    distributed table starts with; an unbounded table keeps one row per ID of `vocab` (sorted raw IDs) and
    maps raw IDs to rows by binary search."""

    vocab: torch.Tensor | None  # a buffer: the sorted raw IDs of an unbounded table's rows

    def __init__(self, table: Table, dim: int, vocab: np.ndarray | None) -> None:
        super().__init__()
        spec = table.spec(dim)
        if table.num_embeddings is None:
            if vocab is None:
                raise ValueError(f"the local model's unbounded table {table.name!r} needs the IDs it will see")
            ids = np.asarray(vocab, dtype=np.int64)
            self.register_buffer("vocab", torch.from_numpy(ids), persistent=False)
        else:
            ids = np.arange(table.num_embeddings, dtype=np.int64)
            self.register_buffer("vocab", None)
        # Chunks keep the float64 temporaries of initial_rows small for a million-row table.
        chunk = 1 << 18
        weight = torch.empty(len(ids), dim)
        for i in range(0, len(ids), chunk):
            weight[i : i + chunk] = torch.from_numpy(initial_rows(spec, ids[i : i + chunk]))
        # from_pretrained draws nothing from torch's RNG: the dense weights stay those of the distributed model.
        self.embedding: nn.Embedding | nn.EmbeddingBag
        if table.mode is None:
            self.embedding = nn.Embedding.from_pretrained(weight, freeze=False, sparse=True)
        else:
            self.embedding = nn.EmbeddingBag.from_pretrained(weight, freeze=False, sparse=True, mode=table.mode)

    def rows(self, ids: torch.Tensor) -> torch.Tensor:
        """Row numbers of raw IDs."""
        return ids if self.vocab is None else torch.searchsorted(self.vocab, ids)

    def forward(self, ids: torch.Tensor, offsets: torch.Tensor | None = None) -> torch.Tensor:
        if offsets is None:
            return self.embedding(self.rows(ids))
        return self.embedding(self.rows(ids), offsets)


class Recommender(nn.Module):
    """DLRM: the dense features through a bottom MLP; the user, item, category and tag-bag embeddings; the
    pairwise dot products of those five vectors (DLRM's interaction: how a user's taste meets a category) and the
    vectors themselves into a top MLP, to one click logit.

    local=False: the tables are worker.SparseEmbedding, rows on the shards. local=True: torch's sparse embeddings
    starting at the same rows (`user_vocab`, the sorted user IDs the local model will ever see, is then required).
    The dense weights come from `seed` alone, so both kinds start identical.
    """

    pairs: torch.Tensor  # a buffer: flat indices of the pairs (i < j) in the [vectors, vectors] dot products

    def __init__(
        self, *, local: bool, user_vocab: np.ndarray | None = None, dim: int = EMBEDDING_DIM, seed: int = 0
    ) -> None:
        super().__init__()
        self.local = local
        self.dim = dim
        self.table_defs = tables(seed)
        # The dense layers first, from their own seed, without disturbing the caller's RNG.
        with torch.random.fork_rng(devices=[]):
            torch.manual_seed(seed)
            self.bottom = mlp([NUM_DENSE, 64, dim], last_relu=True)
            vectors = 1 + len(self.table_defs)
            self.top = mlp([vectors * dim + vectors * (vectors - 1) // 2, 128, 64, 1], last_relu=False)
        for table in self.table_defs:
            module: nn.Module
            if local:
                module = _LocalTable(table, dim, user_vocab if table.name == "user" else None)
            else:
                module = SparseEmbedding(dim, table.num_embeddings, mode=table.mode, seed=table.seed)
                if module.spec(table.name) != table.spec(dim):  # the local model would start from other rows
                    raise RuntimeError(f"{table.name}: {module.spec(table.name)} differs from {table.spec(dim)}")
            self.add_module(table.name, module)
        pairs = torch.triu_indices(vectors, vectors, offset=1)
        self.register_buffer("pairs", pairs[0] * vectors + pairs[1], persistent=False)

    def specs(self) -> list[TableSpec]:
        """The TableSpecs of the model's tables (those the distributed model registers)."""
        return [table.spec(self.dim) for table in self.table_defs]

    def sparse_parameters(self) -> list[torch.Tensor]:
        """The local model's embedding weights (sparse gradients); empty for the distributed model."""
        return [m.weight for m in self.modules() if isinstance(m, nn.Embedding | nn.EmbeddingBag)]

    def dense_parameters(self) -> list[torch.Tensor]:
        """Every other parameter: the MLPs'."""
        sparse = {id(p) for p in self.sparse_parameters()}
        return [p for p in self.parameters() if id(p) not in sparse]

    def forward(self, batch: Batch) -> torch.Tensor:
        vectors = [
            self.bottom(batch.dense),
            self.get_submodule("user")(batch.user),
            self.get_submodule("item")(batch.item),
            self.get_submodule("category")(batch.category),
            self.get_submodule("tags")(batch.tags, batch.tag_offsets),
        ]
        stacked = torch.stack(vectors, dim=1)  # [B, 5, dim]
        dots = torch.bmm(stacked, stacked.transpose(1, 2)).flatten(1)[:, self.pairs]  # [B, 10]
        return self.top(torch.cat([*vectors, dots], dim=1)).squeeze(1)


# -- training and evaluation --------------------------------------------------------------------------------------


def _bar(total: int, desc: str, enabled: bool) -> Any:
    """A tqdm bar when asked for and stderr is a terminal; None otherwise."""
    if not (enabled and sys.stderr.isatty()):
        return None
    from tqdm import tqdm

    return tqdm(total=total, desc=desc, unit="step", dynamic_ncols=True, mininterval=0.25, leave=False)


def train_local(
    logs: ClickLogs,
    *,
    epochs: int,
    batch_size: int,
    lr: float,
    seed: int,
    world: int = 2,
    dim: int = EMBEDDING_DIM,
    progress: bool = False,
) -> Recommender:
    """Train Recommender(local=True) on the whole training split as the distributed run of `world` workers with
    `batch_size` each trains it: the same batches (world x batch_size per step), Adagrad with the same `lr` on the
    dense weights and (sparse) on the rows, the mean BCE loss. Returns the trained model."""
    model = Recommender(local=True, user_vocab=logs.user_vocab, dim=dim, seed=seed)
    model.train()
    dense_opt = torch.optim.Adagrad(model.dense_parameters(), lr=lr)
    sparse_opt = torch.optim.Adagrad(model.sparse_parameters(), lr=lr)
    n = len(logs.train)
    bar = _bar(epochs * steps_per_epoch(n, batch_size, world), "local", progress)
    try:
        # Adagrad builds its sparse updates from coalesced gradients: no invariant checks (nor a warning on them).
        with torch.sparse.check_sparse_tensor_invariants(enable=False):
            for epoch in range(epochs):
                for idx in local_batches(n, batch_size, world, seed=seed, epoch=epoch):
                    batch = logs.train.batch(idx)
                    dense_opt.zero_grad(set_to_none=True)
                    sparse_opt.zero_grad(set_to_none=True)
                    loss = F.binary_cross_entropy_with_logits(model(batch), batch.label)
                    loss.backward()
                    dense_opt.step()
                    sparse_opt.step()
                    if bar is not None:
                        bar.update(1)
                        bar.set_postfix(loss=f"{loss.item():.4f}", refresh=False)
    finally:
        if bar is not None:
            bar.close()
    return model


def _table(model: nn.Module, name: str) -> SparseEmbedding:
    table = model.get_submodule(name)
    assert isinstance(table, SparseEmbedding), f"{name} is no SparseEmbedding: a local model trains with train_local"
    return table


def train_worker(
    client: PSClient,
    model: nn.Module,
    logs: ClickLogs,
    rank: int,
    world: int,
    *,
    epochs: int,
    batch_size: int,
    seed: int,
    progress: bool = False,
) -> float:
    """One worker's share of the distributed run: register the model (dense tensors and tables), then per batch
    of its rank (`rank_batches`) a forward pass, the mean BCE loss's gradients, and one push_pull (dense gradients
    and the rows this batch touched). Returns the last batch's loss."""
    client.register(model)
    model.train()
    n = len(logs.train)
    bar = _bar(epochs * steps_per_epoch(n, batch_size, world), f"worker {rank}", progress and rank == 0)
    loss_value = float("nan")
    order = [idx for epoch in range(epochs) for idx in rank_batches(n, batch_size, rank, world, seed=seed, epoch=epoch)]
    try:
        for t, idx in enumerate(order):
            batch = logs.train.batch(idx)
            model.zero_grad(set_to_none=True)
            loss = F.binary_cross_entropy_with_logits(model(batch), batch.label)
            loss.backward()
            if t + 1 < len(order):  # the next batch's rows come back with this push_pull: one round trip a step
                coming = logs.train.batch(order[t + 1])
                for name, ids in (("user", coming.user), ("item", coming.item), ("category", coming.category)):
                    _table(model, name).prefetch(ids)
                _table(model, "tags").prefetch(coming.tags)
            client.push_pull(model)
            loss_value = loss.item()
            if bar is not None:
                bar.update(1)
                bar.set_postfix(loss=f"{loss_value:.4f}", refresh=False)
    finally:
        if bar is not None:
            bar.close()
    return loss_value


@torch.no_grad()
def evaluate_auc(model: nn.Module, logs: ClickLogs, batch_size: int = 65536) -> float:
    """The model's AUC on the held-out split (batched, no gradients; the distributed model looks its rows up)."""
    was_training = model.training
    model.eval()
    try:
        scores = [
            model(logs.test.batch(np.arange(i, min(i + batch_size, len(logs.test))))).numpy()
            for i in range(0, len(logs.test), batch_size)
        ]
    finally:
        model.train(was_training)
    return auc(logs.test.label, np.concatenate(scores))


def fraction_of_ceiling(model_auc: float, ceiling: float) -> float:
    """How far from chance (0.5) to the ceiling a model got: 1.0 is as good as the planted model itself."""
    return (model_auc - 0.5) / (ceiling - 0.5)


# -- the command line ---------------------------------------------------------------------------------------------

TARGET_FRACTION = 0.9  # of the way from 0.5 to the ceiling
TARGET_GAP = 0.01  # |distributed AUC - local AUC|


def _parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="python -m worker.demos.recsys", description=__doc__.split("\n\n")[0])
    run = parser.add_mutually_exclusive_group()
    run.add_argument("--local-only", action="store_true", help="train only the local model")
    run.add_argument("--worker", action="store_true", help="be one worker of a distributed run (needs --server)")
    parser.add_argument("--train-samples", type=int, default=2_400_000, help="training impressions")
    parser.add_argument("--test-samples", type=int, default=200_000, help="held-out impressions")
    parser.add_argument("--epochs", type=int, default=1, help="passes over the training impressions")
    parser.add_argument(
        "--batch-size", type=int, default=4096, help="impressions per worker and step (the local run takes 2x)"
    )
    parser.add_argument("--lr", type=float, default=0.05, help="Adagrad's learning rate, dense weights and rows")
    parser.add_argument("--dim", type=int, default=EMBEDDING_DIM, help="embedding width")
    parser.add_argument("--seed", type=int, default=0, help="seed of the click logs, the weights and the batches")
    parser.add_argument("--port", type=int, default=0, help="port of shard 0 (default: 0, free ports)")
    parser.add_argument(
        "--threads", type=int, default=1, help="torch CPU threads per process (1 is fastest where the cores are shared)"
    )
    parser.add_argument("--no-progress", action="store_true", help="no progress bars")
    parser.add_argument("--server", help="--worker: address of any one shard")
    parser.add_argument(
        "--rank-hint",
        type=int,
        default=0,
        help="--worker: the rank expected, to name this worker until the servers gave it its rank",
    )
    parser.add_argument("--result", help="--worker: JSON file rank 0 writes the trained model's test AUC to")
    return parser


def _logs(args: argparse.Namespace) -> ClickLogs:
    return make_click_logs(args.train_samples, args.test_samples, seed=args.seed)


def _describe(logs: ClickLogs, seconds: float) -> None:
    counts = logs.train.distinct_ids()
    print(
        f"click logs: {len(logs.train):,} training and {len(logs.test):,} held-out impressions in {seconds:.1f} s, "
        f"{sum(counts.values()):,} distinct IDs in training ("
        + ", ".join(f"{name} {count:,}" for name, count in counts.items())
        + f"); ceiling AUC (the planted model's own) {logs.ceiling_auc:.4f}",
        flush=True,
    )


def _train_locally(args: argparse.Namespace, logs: ClickLogs) -> float:
    start = time.perf_counter()
    model = train_local(
        logs,
        epochs=args.epochs,
        batch_size=args.batch_size,
        lr=args.lr,
        seed=args.seed,
        dim=args.dim,
        progress=not args.no_progress,
    )
    seconds = time.perf_counter() - start
    local_auc = evaluate_auc(model, logs)
    print(
        f"local: AUC {local_auc:.4f} after {args.epochs} epoch(s) in {seconds:.1f} s, "
        f"{fraction_of_ceiling(local_auc, logs.ceiling_auc):.3f} of the way from 0.5 to the ceiling",
        flush=True,
    )
    return local_auc


def run_local(args: argparse.Namespace) -> int:
    """--local-only: generate, train locally, print; 0 when the local model reaches TARGET_FRACTION."""
    torch.set_num_threads(args.threads)
    start = time.perf_counter()
    logs = _logs(args)
    _describe(logs, time.perf_counter() - start)
    local_auc = _train_locally(args, logs)
    return 0 if fraction_of_ceiling(local_auc, logs.ceiling_auc) >= TARGET_FRACTION else 1


def run_worker(args: argparse.Namespace) -> int:
    """--worker: join the job at --server, train this rank's part, and (rank 0) write the model's test AUC."""
    from worker import PSClient

    if not args.server:
        print("--worker needs --server", file=sys.stderr)
        return 2
    torch.set_num_threads(args.threads)
    logs = _logs(args)
    model = Recommender(local=False, dim=args.dim, seed=args.seed)
    try:
        client = PSClient(args.server)
    except Exception as exc:
        print(f"worker {args.rank_hint}: could not join the job at {args.server}: {exc}", file=sys.stderr)
        return 1
    with client:
        rank, world = client.rank, client.world_size  # the servers' ranks, by order of joining
        start = time.perf_counter()
        loss = train_worker(
            client,
            model,
            logs,
            rank,
            world,
            epochs=args.epochs,
            batch_size=args.batch_size,
            seed=args.seed,
            progress=not args.no_progress,
        )
        seconds = time.perf_counter() - start
        if rank == 0:
            model_auc = evaluate_auc(model, logs)
            if args.result:
                doc = {"rank": rank, "world_size": world, "auc": model_auc, "seconds": seconds, "final_loss": loss}
                Path(args.result).write_text(json.dumps(doc, indent=2) + "\n")
        client.leave(finished=True)
    return 0


def run_distributed(args: argparse.Namespace) -> int:
    """The demo: train locally, then ps-server with 2 shards (sync, Adagrad) and 2 worker processes on the same
    samples; print the ceiling, both AUCs, their difference and how far the distributed one got; 0 when
    |difference| <= TARGET_GAP and the distributed model is at least TARGET_FRACTION of the way to the ceiling."""
    from worker.demos.demo import _address_of, _stop

    torch.set_num_threads(args.threads)
    start = time.perf_counter()
    logs = _logs(args)
    _describe(logs, time.perf_counter() - start)
    local_auc = _train_locally(args, logs)
    ceiling = logs.ceiling_auc
    del logs  # the workers make their own copies; free this one's memory for them

    server_cmd = [
        sys.executable,
        "-m",
        "paramserver.server.cli",
        "--shards",
        "2",
        "--workers",
        "2",
        "--mode",
        "sync",
        "--optimizer",
        "adagrad",
        "--lr",
        str(args.lr),
        "--port",
        str(args.port),
        "--log-level",
        "WARNING",
    ]
    print(f"$ ps-server --shards 2 --workers 2 --mode sync --optimizer adagrad --lr {args.lr} --port {args.port}")
    sys.stdout.flush()
    server = subprocess.Popen(server_cmd, stdout=subprocess.PIPE, text=True, bufsize=1)
    workers: list[subprocess.Popen[bytes]] = []
    try:
        try:
            address = _address_of(server)
        except (RuntimeError, TimeoutError) as exc:
            print(f"recsys: {exc}", file=sys.stderr)
            return 1
        with tempfile.TemporaryDirectory(prefix="ps-recsys-") as tmp:
            result = Path(tmp) / "result.json"
            common = [
                "--train-samples",
                str(args.train_samples),
                "--test-samples",
                str(args.test_samples),
                "--epochs",
                str(args.epochs),
                "--batch-size",
                str(args.batch_size),
                "--lr",
                str(args.lr),
                "--dim",
                str(args.dim),
                "--seed",
                str(args.seed),
                "--threads",
                str(args.threads),
                "--result",
                str(result),
            ]
            if args.no_progress:
                common.append("--no-progress")
            print(f"$ python -m worker.demos.recsys --worker --server {address} (x2)", flush=True)
            start = time.perf_counter()
            for k in range(2):
                cmd = [
                    sys.executable,
                    "-m",
                    "worker.demos.recsys",
                    "--worker",
                    "--server",
                    address,
                    "--rank-hint",
                    str(k),
                ]
                workers.append(subprocess.Popen([*cmd, *common]))
            codes = [w.wait() for w in workers]
            seconds = time.perf_counter() - start
            for k, code in enumerate(codes):
                if code != 0:
                    print(f"worker {k} failed with exit status {code}", file=sys.stderr)
                    return 1
            doc = json.loads(result.read_text())
    except KeyboardInterrupt:
        print("\ninterrupted: stopping workers and servers", file=sys.stderr)
        return 130
    finally:
        for w in workers:
            _stop(w, signal.SIGINT)
        server_status = _stop(server, signal.SIGTERM)
    distributed_auc = float(doc["auc"])
    gap = abs(distributed_auc - local_auc)
    fraction = fraction_of_ceiling(distributed_auc, ceiling)
    ok = gap <= TARGET_GAP and fraction >= TARGET_FRACTION
    print(
        f"\ndistributed (2 shards, 2 workers, sync): AUC {distributed_auc:.4f} in {seconds:.1f} s\n"
        f"ceiling AUC {ceiling:.4f}, local AUC {local_auc:.4f}, distributed AUC {distributed_auc:.4f}, "
        f"|difference| {gap:.4f} (target <= {TARGET_GAP}), {fraction:.3f} of the way from 0.5 to the ceiling "
        f"(target >= {TARGET_FRACTION}): {'reached' if ok else 'MISSED'}; servers stopped with status {server_status}"
    )
    return 0 if ok and server_status == 0 else 1


def main(argv: Sequence[str] | None = None) -> int:
    """python -m worker.demos.recsys [--local-only | --worker --server ADDR]: the demo, its local half, or a worker."""
    args = _parser().parse_args(argv)
    if args.worker:
        return run_worker(args)
    if args.local_only:
        return run_local(args)
    return run_distributed(args)


if __name__ == "__main__":
    sys.exit(main())
