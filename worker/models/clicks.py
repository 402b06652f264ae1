"""Click models built from a dataset's schema (worker.data.manifest.Schema): DLRM and DeepFM, one `SparseEmbedding`
per categorical feature, each taking `worker.data.features.Features` and giving one logit per sample.

`ps-worker --model dlrm` (or `deepfm`) builds them; `--model package.module:factory` calls the factory with
`schema=` (and `tables=`, the TableOptions of the flags) where it takes them. A table is fed by the categorical
feature whose name ends its module path (`embeddings.C1`, `linear.C1`): the trainer prefetches each table's IDs of
the next batch by that rule (worker.train.tables).
"""

from __future__ import annotations

import inspect
from collections.abc import Callable, Sequence
from dataclasses import dataclass

import torch
from torch import Tensor, nn

from worker.client.sparse import SparseEmbedding
from worker.data.features import Features
from worker.data.manifest import Categorical, Schema

CLICK_MODELS: tuple[str, ...] = ("dlrm", "deepfm")


@dataclass(frozen=True)
class TableOptions:
    """The tables of a click model, as ps-worker's flags set them (the servers' job sets the rest)."""

    dim: int = 16  # embedding width
    table_size: int = 0  # 0: unbounded tables keyed by the raw IDs; N: IDs hashed to N rows (ID mod N)
    optimizer: str = ""  # a row optimizer (SparseEmbedding's); "": the job's counterpart
    lr: float = 0.0  # 0: the job's learning rate
    admit_after: int = 0
    evict_after_versions: int = 0
    capacity: int = 0  # rows per shard per table, 0: no cap

    def table(self, feature: Categorical, dim: int | None = None, seed: int = 0) -> nn.Module:
        """The table of one feature (`dim` overrides the width: DeepFM's 1-wide linear part; `seed`: its initial
        rows', one per table so that an ID starts apart in each)."""
        return SparseEmbedding(
            dim or self.dim,
            seed=seed,
            num_embeddings=self.table_size or None,
            mode="sum" if feature.multi_hot else None,
            optimizer=self.optimizer,
            lr=self.lr,
            admit_after=self.admit_after,
            evict_after_versions=self.evict_after_versions,
            capacity=self.capacity,
        )


def feature_key(name: str) -> str:
    """A feature's name as a module name (no dots: a dot would read as a path in the model)."""
    return name.replace(".", "_") or "_"


def mlp(sizes: Sequence[int], *, last_relu: bool) -> nn.Sequential:
    """Linear layers of these sizes with ReLU between them (and after the last one, if `last_relu`)."""
    layers: list[nn.Module] = []
    for i, (a, b) in enumerate(zip(sizes[:-1], sizes[1:], strict=True)):
        layers.append(nn.Linear(a, b))
        if last_relu or i < len(sizes) - 2:
            layers.append(nn.ReLU())
    return nn.Sequential(*layers)


class _Tables(nn.Module):
    """One table per categorical feature, looked up from a batch's Features."""

    def __init__(self, schema: Schema, tables: TableOptions, dim: int | None = None, seed: int = 0) -> None:
        super().__init__()
        self.features = schema.categorical
        self.size = tables.table_size
        self.tables = nn.ModuleDict(
            {feature_key(f.name): tables.table(f, dim, seed + k) for k, f in enumerate(schema.categorical)}
        )

    def _ids(self, x: Features, name: str) -> Tensor:
        ids = x.ids[name]
        return ids.remainder(self.size) if self.size else ids  # a bounded table's hashing trick (MISSING_ID too)

    def forward(self, x: Features) -> list[Tensor]:
        """Each feature's rows, [B, dim] (a bag pooled)."""
        out = []
        for f in self.features:
            table = self.tables[feature_key(f.name)]
            ids = self._ids(x, f.name)
            out.append(table(ids, x.offsets[f.name]) if f.multi_hot else table(ids))
        return out

    def prefetch(self, x: Features) -> None:
        """Name the IDs a coming forward pass on `x` looks up (SparseEmbedding.prefetch), as it will look them up."""
        for f in self.features:
            table = self.tables[feature_key(f.name)]
            if isinstance(table, SparseEmbedding):  # (a local copy's tables have nothing to prefetch)
                table.prefetch(self._ids(x, f.name))


class DLRM(nn.Module):
    """DLRM (Naumov et al., 2019): a bottom MLP takes the dense features to a `dim` vector, each categorical feature
    looks up a `dim` row; the dot products of every pair of these vectors, with the bottom MLP's output, go through a
    top MLP to one logit."""

    def __init__(
        self,
        schema: Schema,
        tables: TableOptions = TableOptions(),
        bottom: Sequence[int] = (64, 32),
        top: Sequence[int] = (64, 32),
    ) -> None:
        super().__init__()
        dim = tables.dim
        dense = len(schema.dense)
        self.bottom = mlp([dense, *bottom, dim], last_relu=True) if dense else None
        self.embeddings = _Tables(schema, tables)
        vectors = len(schema.categorical) + (1 if dense else 0)
        # Which pairs of vectors interact (each once): not state, so not a buffer the shards would hold.
        self.pairs = torch.triu_indices(vectors, vectors, offset=1)
        self.top = mlp([(dim if dense else 0) + vectors * (vectors - 1) // 2, *top, 1], last_relu=False)

    def prefetch(self, x: Features) -> None:
        """Prefetch the tables' rows for a coming batch (the trainer calls this: worker.train.tables)."""
        self.embeddings.prefetch(x)

    def forward(self, x: Features) -> Tensor:
        rows = self.embeddings(x)
        bottom = self.bottom(x.dense) if self.bottom is not None else None
        vectors = torch.stack(rows if bottom is None else [bottom, *rows], 1)  # [B, n, dim]
        pairs = self.pairs.to(vectors.device)
        dots = torch.bmm(vectors, vectors.transpose(1, 2))[:, pairs[0], pairs[1]]
        return self.top(dots if bottom is None else torch.cat([bottom, dots], 1)).squeeze(1)


class DeepFM(nn.Module):
    """DeepFM (Guo et al., 2017): a linear part (a 1-wide table per feature and the dense features), a factorisation
    machine's pairwise interactions of the features' `dim` rows, and an MLP over those rows and the dense features,
    summed into one logit."""

    def __init__(self, schema: Schema, tables: TableOptions = TableOptions(), hidden: Sequence[int] = (64, 32)) -> None:
        super().__init__()
        dense = len(schema.dense)
        self.linear = _Tables(schema, tables, dim=1, seed=len(schema.categorical))
        self.embeddings = _Tables(schema, tables)
        self.dense_linear = nn.Linear(dense, 1) if dense else None
        self.deep = mlp([dense + len(schema.categorical) * tables.dim, *hidden, 1], last_relu=False)

    def prefetch(self, x: Features) -> None:
        """Prefetch the tables' rows for a coming batch (the trainer calls this: worker.train.tables)."""
        self.linear.prefetch(x)
        self.embeddings.prefetch(x)

    def forward(self, x: Features) -> Tensor:
        rows = torch.stack(self.embeddings(x), 1)  # [B, n, dim]
        fm = 0.5 * (rows.sum(1).square() - rows.square().sum(1)).sum(1)
        logit = torch.cat(self.linear(x), 1).sum(1) + fm
        if self.dense_linear is not None:
            logit = logit + self.dense_linear(x.dense).squeeze(1)
        deep = torch.cat([x.dense, rows.flatten(1)], 1)
        return logit + self.deep(deep).squeeze(1)


def build_click_model(name: str, schema: Schema, tables: TableOptions = TableOptions()) -> nn.Module:
    """`dlrm`, `deepfm`, or `package.module:factory` (called with schema= and tables= where it takes them)."""
    if name == "dlrm":
        return DLRM(schema, tables)
    if name == "deepfm":
        return DeepFM(schema, tables)
    if ":" in name:
        from worker.models.builtin import factory_of

        factory = factory_of(name)
        model = factory(**_kwargs(factory, schema=schema, tables=tables))
        if not isinstance(model, nn.Module):
            raise TypeError(f"model factory {name} returned {type(model).__name__}, expected a torch.nn.Module")
        return model
    raise ValueError(
        f"the dataset has categorical features: the model is one of {', '.join(CLICK_MODELS)}, or "
        f"package.module:factory (called with schema=), not {name!r}"
    )


def _kwargs(factory: Callable[..., object], **offered: object) -> dict[str, object]:
    """Those of `offered` that the factory takes by keyword."""
    try:
        params = inspect.signature(factory).parameters.values()
    except (TypeError, ValueError):
        return {}
    if any(p.kind is inspect.Parameter.VAR_KEYWORD for p in params):
        return offered
    names = {p.name for p in params if p.kind in (p.POSITIONAL_OR_KEYWORD, p.KEYWORD_ONLY)}
    return {k: v for k, v in offered.items() if k in names}
