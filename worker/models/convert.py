"""make_sparse: someone else's model, its embedding tables moved onto the parameter server in one call.

    model = make_sparse(DeepFM(...))          # every nn.Embedding / nn.EmbeddingBag is now a SparseEmbedding
    optimizer = PSOptimizer(model, client)    # registers it: the shards start from the model's own weights

A replaced module's weights become its table's initial rows (the first `register` sends them to the shards), so a
converted model starts exactly where the original stood. The replaced module's weight is emptied: a reference to it
that the model's code keeps elsewhere (deepctr-torch's regularisation list holds every table's weight) would
otherwise keep a whole copy of each table alive in every worker.
"""

from __future__ import annotations

from collections.abc import Iterable
from typing import Any

import torch
from torch import nn

from worker.client.sparse import SparseEmbedding

__all__ = ["make_sparse"]


def make_sparse(model: nn.Module, *, unbounded: Iterable[str] = (), **table_options: Any) -> nn.Module:
    """Replace every nn.Embedding and nn.EmbeddingBag in `model` (at any depth: ModuleDict, ModuleList, Sequential or
    any attribute) by a SparseEmbedding of the same width, ID bound, `mode`, `padding_idx` and `include_last_offset`,
    whose initial rows are the module's weights; return the model (changed in place).

    `unbounded`: paths of tables (as in `model.named_modules()`) to make unbounded instead (any int64 ID, rows made
    on first use by the table's initial rule, none sent). `table_options`: SparseEmbedding's policy options (init,
    init_scale, seed, optimizer, lr, admit_after, admit_probability, evict_after_versions, evict_after_seconds,
    capacity), for every table. ValueError for what cannot be converted exactly: `max_norm`, `scale_grad_by_freq`,
    mode "max", a frozen weight, a weight tied to another layer, or an `unbounded` name that is no embedding of
    the model.
    """
    wanted = set(unbounded)
    # Every path, so that a module registered under two names becomes one table under both.
    found = [
        (name, module)
        for name, module in model.named_modules(remove_duplicate=False)
        if isinstance(module, nn.Embedding | nn.EmbeddingBag) and name
    ]
    unknown = wanted - {name for name, _ in found}
    if unknown:
        raise ValueError(
            f"unbounded names {sorted(unknown)}, but the model's embeddings are {[name for name, _ in found]}"
        )
    if isinstance(model, nn.Embedding | nn.EmbeddingBag):
        raise ValueError("make_sparse converts the embeddings inside a model: wrap this one in a module")
    holders: dict[int, dict[int, str]] = {}  # each parameter's modules: a weight tied to another layer stays put
    for path, holder in model.named_modules(remove_duplicate=False):
        for param in holder.parameters(recurse=False):
            holders.setdefault(id(param), {})[id(holder)] = path
    for name, module in found:
        tied = [path for key, path in holders[id(module.weight)].items() if key != id(module)]
        _refuse_inexact(name, module, tied)
    tables: dict[int, SparseEmbedding] = {}
    for name, module in found:
        table = tables.get(id(module))
        if table is None:
            table = tables[id(module)] = _table_of(module, name in wanted, table_options)
        parent, _, attr = name.rpartition(".")
        setattr(model.get_submodule(parent) if parent else model, attr, table)
    for module in {id(m): m for _, m in found}.values():
        module.weight.data = torch.empty((0, module.embedding_dim), dtype=module.weight.dtype)
    return model


def _refuse_inexact(name: str, module: nn.Embedding | nn.EmbeddingBag, tied: list[str]) -> None:
    problems = []
    if tied:
        problems.append(f"a weight tied to {', '.join(sorted(tied))} (the table would leave that layer)")
    if module.max_norm is not None:
        problems.append("max_norm (renormalises rows in place at lookup)")
    if module.scale_grad_by_freq:
        problems.append("scale_grad_by_freq")
    if isinstance(module, nn.EmbeddingBag) and module.mode == "max":
        problems.append('mode "max"')
    if not module.weight.requires_grad:
        problems.append("a frozen weight (requires_grad False: the servers would train it)")
    if problems:
        raise ValueError(f"cannot convert {name!r} ({type(module).__name__}) exactly: it uses {', '.join(problems)}")


def _table_of(module: nn.Embedding | nn.EmbeddingBag, unbounded: bool, options: dict[str, Any]) -> SparseEmbedding:
    bag = isinstance(module, nn.EmbeddingBag)
    return SparseEmbedding(
        module.embedding_dim,
        None if unbounded else module.num_embeddings,
        mode=str(module.mode) if bag else None,
        padding_idx=module.padding_idx,
        include_last_offset=bool(getattr(module, "include_last_offset", False)),
        given=None if unbounded else module.weight.detach(),
        **options,
    )
