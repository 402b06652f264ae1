"""A converted model's tables as plain torch holds them: the `<path>.weight` a bounded table puts in `state_dict()`
(shaped as the nn.Embedding / nn.EmbeddingBag it replaced), what `load_state_dict` does with one, and a saved file's
table filling a plain module's weight (worker.load of an unconverted model).

A table's rows are exactly what its shards would answer: the rows they hold, and for every other ID the table's
initial rule (paramserver.tables.Initialiser). An unbounded table (any int64 ID) has no such weight: its
`state_dict()` raises once it holds rows (registered, loaded or served), pointing to PSClient.save, unless it is
left out on purpose (`table.in_state_dict = False`).
"""

from __future__ import annotations

from typing import TYPE_CHECKING

import numpy as np
import torch
from torch import nn

from paramserver.tables import Initialiser, TableSpec

if TYPE_CHECKING:
    from worker.client.sparse import SparseEmbedding

GATHER_BYTES = 4 << 20  # rows a state_dict asks the row source for at once


def unbounded_in_state_dict(name: str) -> str:
    return (
        f"table {name!r} is unbounded (any int64 ID, rows made as IDs arrive): state_dict() has no weight to "
        "carry it in, and leaving it out would silently drop its trained rows. Save the model with "
        "client.save(model, path) (PSClient.save: the dense tensors and every table's rows in one safetensors "
        "file, read back by worker.load), or leave the table out of state_dict on purpose: "
        f"`model.get_submodule({name!r}).in_state_dict = False` (its rows then live on the shards alone)"
    )


def table_weight(table: SparseEmbedding, name: str) -> torch.Tensor | None:
    """The `<name>.weight` a table puts in state_dict: float32 [num_embeddings, dim] as its row source answers now
    (the shards, through the registered client; a saved file; serving copies), or, not registered yet, the rows
    the first register would give (the converted module's weights, else the initial rule). None for an unbounded
    table that holds no rows yet (nothing to lose: its rows are its initial rule); RuntimeError for one that does."""
    n = table.num_embeddings
    source = table._step.source
    if n is None:
        if source is None:
            return None
        raise RuntimeError(unbounded_in_state_dict(name))
    if source is None:
        if table.given is not None:
            return table.given.detach()
        return torch.from_numpy(Initialiser(table.spec(name)).rows(np.arange(n, dtype=np.int64)))
    out = np.empty((n, table.dim), np.float32)
    step = max(1, GATHER_BYTES // (4 * table.dim))
    for lo in range(0, n, step):
        ids = np.arange(lo, min(n, lo + step), dtype=np.int64)
        out[lo : lo + len(ids)] = source.lookup(ids)
    return torch.from_numpy(out)


def load_weight(table: SparseEmbedding, name: str, value: torch.Tensor) -> str | None:
    """Take a `<name>.weight` from load_state_dict; return why not (None: taken). Not registered yet, the rows
    become the table's given rows (the first register sends them to a new job's shards, as make_sparse's are); a
    registered table's rows live on its shards, so only the rows it holds already are taken (a checkpoint of this
    very state), others refused."""
    n = table.num_embeddings
    if n is None:
        return (
            f"table {name!r} is unbounded: a weight cannot be loaded into it (its rows are saved and loaded with "
            "PSClient.save and worker.load)"
        )
    if tuple(value.shape) != (n, table.dim):
        return f"size mismatch for {name}.weight: a weight of {list(value.shape)}, the table holds [{n}, {table.dim}]"
    rows = value.detach().to("cpu", torch.float32)
    if table._step.source is None:
        table.given = rows.clone()
        return None
    held = table_weight(table, name)
    if held is not None and torch.equal(held, rows):
        return None
    return (
        f"table {name!r} is registered: its rows live on the shards (or in the file or serving copies it reads), "
        "and load_state_dict cannot change them. Load the state dict into the model before client.register / "
        "PSOptimizer (the first register of a new job sends its rows to the shards), or serve a file PSClient.save "
        "wrote with worker.load"
    )


def fill_embedding(
    module: nn.Embedding | nn.EmbeddingBag, spec: TableSpec, ids: np.ndarray, values: np.ndarray
) -> None:
    """Copy a saved table into a plain module's weight: the file's rows where it has them, the table's initial rule
    (what the shards would answer) for every other ID."""
    weight = Initialiser(spec).rows(np.arange(spec.num_embeddings, dtype=np.int64))
    if len(ids):
        weight[np.asarray(ids)] = values
    with torch.no_grad():
        module.weight.copy_(torch.from_numpy(weight))


def plain_fit(module: nn.Embedding | nn.EmbeddingBag, name: str, spec: TableSpec, path: str) -> str | None:
    """Why a saved table cannot fill this plain module (None: it can)."""
    kind = type(module).__name__
    if spec.num_embeddings == 0:
        return (
            f"table {name!r} in {path} is unbounded (any int64 ID: make_sparse(..., unbounded=[{name!r}]) or "
            f"SparseEmbedding(num_embeddings=None)), so a plain {kind} of {module.num_embeddings} rows cannot hold "
            f"it. Load the file into the converted model instead, worker.load(make_sparse(model, "
            f"unbounded=[{name!r}]), path), or serve the job's rows from serving copies (ps-serve, then "
            "worker.serve(converted_model, address))"
        )
    if (spec.num_embeddings, spec.dim) != (module.num_embeddings, module.embedding_dim):
        return (
            f"table {name!r}: the file's is [{spec.num_embeddings}, {spec.dim}], the model's {kind} "
            f"[{module.num_embeddings}, {module.embedding_dim}]"
        )
    return None
