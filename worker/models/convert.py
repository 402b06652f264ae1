"""make_sparse: someone else's model, its embedding tables moved onto the parameter server in one call.

    model = make_sparse(DeepFM(...))          # every nn.Embedding / nn.EmbeddingBag is now a SparseEmbedding
    optimizer = PSOptimizer(model, client)    # registers it: the shards start from the model's own weights

A replaced module's weights become its table's initial rows (the first `register` sends them to the shards), so a
converted model starts exactly where the original stood. An unbounded table has no rows to send: its rows start from
the distribution of the module's own weights (normal or uniform, and its scale, read from them: `initial_rule`), and
each table from a seed of its own (its path's), so that two tables never start an ID on the same row.

The replaced module's weight is emptied: a reference to it that the model's code keeps elsewhere (deepctr-torch's
regularisation list holds every table's weight) would otherwise keep a whole copy of each table alive in every
worker. A loss term computed from such a reference sees an empty tensor: deepctr-torch's `l2_reg_embedding` no longer
applies to the tables (its other terms do).
"""

from __future__ import annotations

import math
import zlib
from collections.abc import Iterable
from typing import Any

import torch
from torch import nn

from worker.client.sparse import SparseEmbedding

__all__ = ["initial_rule", "make_sparse"]

SAMPLED = 1 << 20  # weights read to infer an unbounded table's initial rule (a strided sample of a larger table)
# Excess kurtosis of a uniform distribution is -1.2, of a normal 0: weights whose kurtosis is under the midpoint are
# read as uniform.
UNIFORM_KURTOSIS = -0.6
# An inferred scale is rounded to the nearest of these times a power of ten: every worker's model, its weights drawn
# with another seed, must name the same rule (a table's spec is part of the model the shards check).
SCALE_STEPS = (1.0, 1.2, 1.5, 2.0, 2.5, 3.0, 4.0, 5.0, 6.0, 8.0, 10.0)


def make_sparse(model: nn.Module, *, unbounded: Iterable[str] = (), **table_options: Any) -> nn.Module:
    """Replace every nn.Embedding and nn.EmbeddingBag in `model` (at any depth: ModuleDict, ModuleList, Sequential or
    any attribute) by a SparseEmbedding of the same width, ID bound, `mode`, `padding_idx` and `include_last_offset`,
    whose initial rows are the module's weights; return the model (changed in place).

    `unbounded`: paths of tables (as in `model.named_modules()`) to make unbounded instead (any int64 ID, rows made
    on first use by the table's initial rule, none sent). An unbounded table starts its rows as the module's weights
    were drawn: `init` and `init_scale` inferred from them (`initial_rule`: "normal" with their standard deviation,
    "uniform" with their bound, or "zeros"), and a `seed` from its path; `init`, `init_scale` or `seed` given here
    override that. `table_options`: SparseEmbedding's policy options (init, init_scale, seed, optimizer, lr,
    admit_after, admit_probability, evict_after_versions, evict_after_seconds, capacity), for every table.

    ValueError for what cannot be converted exactly: `max_norm`, `scale_grad_by_freq`, mode "max", a frozen weight,
    a weight tied to another layer, or an `unbounded` name that is no embedding of the model.
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
            options = table_options
            if name in wanted:
                init, scale = initial_rule(module.weight, module.padding_idx)
                own: dict[str, Any] = {"init": init, "init_scale": scale, "seed": zlib.crc32(name.encode())}
                if "init" in table_options:  # a rule named without its scale takes the table's default scale
                    del own["init_scale"]
                options = {**own, **table_options}
            table = tables[id(module)] = _table_of(module, name in wanted, options)
        parent, _, attr = name.rpartition(".")
        setattr(model.get_submodule(parent) if parent else model, attr, table)
    for module in {id(m): m for _, m in found}.values():
        module.weight.data = torch.empty((0, module.embedding_dim), dtype=module.weight.dtype)
    return model


def initial_rule(weight: torch.Tensor, padding_idx: int | None = None) -> tuple[str, float]:
    """The initial rule an unbounded table takes from a module's weights: ("zeros", 0.0) when they are all zero,
    ("uniform", bound) when they look uniform on [-bound, bound] (excess kurtosis under -0.6; nn.init.uniform_,
    xavier_uniform_), else ("normal", their standard deviation about zero) (nn.Embedding's N(0, 1),
    deepctr-torch's N(0, init_std)). The padding row is left out; a table of over a million values is read through a
    strided sample of about a million. The scale is rounded to two figures on a fixed grid (1, 1.2, 1.5, 2, 2.5, 3,
    4, 5, 6, 8 times a power of ten), so that models drawn with other seeds name the same rule."""
    w = weight.detach()
    if padding_idx is not None and w.shape[0] > 1:
        w = torch.cat([w[:padding_idx], w[padding_idx + 1 :]])
    flat = w.reshape(-1)
    if flat.numel() > SAMPLED:
        flat = flat[:: math.ceil(flat.numel() / SAMPLED)]
    flat = flat.to(torch.float64)
    if not flat.numel() or not bool(flat.any()):
        return "zeros", 0.0
    rms = float(flat.pow(2).mean().sqrt())
    kurtosis = float(flat.pow(4).mean()) / rms**4 - 3.0
    if kurtosis < UNIFORM_KURTOSIS:
        return "uniform", _rounded(float(flat.abs().max()))
    return "normal", _rounded(rms)


def _rounded(scale: float) -> float:
    """The nearest of SCALE_STEPS times a power of ten, nearest by ratio."""
    power = 10.0 ** math.floor(math.log10(scale))
    step = min(SCALE_STEPS, key=lambda s: abs(math.log(scale / (s * power))))
    return float(f"{step * power:.3g}")


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
