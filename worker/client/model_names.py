"""Models told apart by their tensors' names: the prefix rule by which `worker.load` puts a file saved from a
wrapper (a LightningModule holding the model as `self.net`) into the model inside it, and what `PSClient.save` says
when asked to save another model than the one its client registered.

The prefix rule: a file fits a model when every name of the model (each `state_dict` entry, and `<path>.weight` for
each table) is a name of the file. Failing that, when there is exactly one prefix P (ending in ".") under which every
name of the model is in the file, with the model's shape (a table's: its rows, 0 for unbounded, and its width), the
file's entries under P are the model's, P taken off, and the file's other entries are left out (the wrapper's own
layers, a loss's weights). No such prefix leaves the file as it is, and `load` says what differs; several (a
wrapper holding two copies of the model) are refused, named.
"""

from __future__ import annotations

from collections.abc import Mapping

from torch import nn

from worker.client.binding import Binding, tensors_of
from worker.client.sparse import tables_of, without_rows

SHOWN = 4  # names a message lists of each side


Shapes = Mapping[str, tuple[int, ...]]  # tensors by name; a table as `<path>.weight` of [rows (0: unbounded), dim]


def shapes_of(model: nn.Module) -> dict[str, tuple[int, ...]]:
    """What a model file holds for `model`, by name: its `state_dict` entries without the tables' rows, and
    `<path>.weight` for each table, converted (SparseEmbedding) or not (nn.Embedding, nn.EmbeddingBag)."""
    with without_rows():
        shapes = {name: tuple(t.shape) for name, t in model.state_dict().items()}
    for path, table in tables_of(model):
        spec = table.spec(path)
        shapes[f"{path}.weight"] = (spec.num_embeddings, spec.dim)
    return shapes


def prefixes(inner: Shapes, outer: Shapes) -> list[str]:
    """Every prefix P ("" or ending in ".") under which each of `inner`'s names is one of `outer`'s, of its shape."""
    if not inner:
        return []
    first = next(iter(inner))
    found = {
        name[: len(name) - len(first)]
        for name in outer
        if name.endswith(first) and (name == first or name[-len(first) - 1] == ".")
    }
    return sorted(p for p in found if all(outer.get(p + name) == shape for name, shape in inner.items()))


def file_prefix(model: nn.Module, file_shapes: Shapes) -> str:
    """The prefix under which a file holding `file_shapes` (each table as `<path>.weight`) holds `model`: "" when it
    holds every name of the model as it is, else the one prefix of the module docstring's rule; "" when there is
    none; ValueError, naming them, when there are several."""
    mine = shapes_of(model)
    if set(mine) <= set(file_shapes):
        return ""
    found = prefixes(mine, file_shapes)
    if len(found) > 1:
        listed = ", ".join(map(repr, found))
        raise ValueError(
            f"the file holds the {type(model).__name__}'s tensors under {len(found)} prefixes ({listed}): "
            "a file loads into a model inside the saved one only when one prefix holds all of them"
        )
    return found[0] if found else ""


def _shapes(binding: Binding) -> dict[str, tuple[int, ...]]:
    """What a binding's model holds, by name: its tensors' shapes, and each table as `<path>.weight` of [rows
    (0: unbounded), dim]."""
    shapes = {name: tuple(t.shape) for name, t in zip(binding.names, binding.tensors, strict=True)}
    for spec in binding.placement.tables:
        shapes[f"{spec.name}.weight"] = (spec.num_embeddings, spec.dim)
    return shapes


def _model_shapes(model: nn.Module) -> dict[str, tuple[int, ...]]:
    names, tensors, _ = tensors_of(model)
    shapes = {name: tuple(t.shape) for name, t in zip(names, tensors, strict=True)}
    for path, table in tables_of(model):
        spec = table.spec(path or "table")
        shapes[f"{spec.name}.weight"] = (spec.num_embeddings, spec.dim)
    return shapes


def unlike_registered(model: nn.Module, registered: Binding, kind: str) -> str:
    """Why `model` is not the model the client registered (`registered`, a `kind`), and how to save: which tensors
    differ, and, where `model` sits inside the registered one under one prefix (a LightningModule's `self.net`),
    that saving the registered model gives a file `worker.load` puts into `model`."""
    mine, theirs = _model_shapes(model), _shapes(registered)
    own = type(model).__name__
    inside = [p for p in prefixes(mine, theirs) if p]
    if len(inside) == 1:
        under = inside[0]
        besides = [n for n in theirs if not n.startswith(under)]
        what = (
            f"every tensor of the {own} is one of the {kind}'s under {under!r} ({_listed([under + n for n in mine])})"
        )
        if besides:
            what += f", and the {kind} holds {_listed(besides)} besides"
    else:
        what = _differences(mine, theirs, own, kind)
    message = (
        f"this client registered a {kind}, not this {own}: the shards hold the {kind}'s tensors ({what}). "
        f"Save the model that was registered: client.save(<the {kind}>, path)"
    )
    if len(inside) == 1:
        message += (
            f"; the {own} is the {kind}'s {inside[0][:-1]!r} (as PSOptimizer(self, client) in a LightningModule "
            f"registers the LightningModule), and worker.load(<a {own}>, path) takes that file, the {inside[0]!r} "
            "prefix taken off its names"
        )
    return message


def _differences(mine: dict[str, tuple[int, ...]], theirs: dict[str, tuple[int, ...]], own: str, kind: str) -> str:
    only_mine = [n for n in mine if n not in theirs]
    only_theirs = [n for n in theirs if n not in mine]
    reshaped = [n for n in mine if n in theirs and mine[n] != theirs[n]]
    differ = []
    if only_mine:
        differ.append(f"the {own} has {_listed(only_mine)}, which the {kind} lacks")
    if only_theirs:
        differ.append(f"the {kind} has {_listed(only_theirs)}, which the {own} lacks")
    if reshaped:
        shapes = ", ".join(f"{mine[n]} against {theirs[n]}" for n in reshaped[:SHOWN])
        differ.append(f"{_listed(reshaped)} differ in shape ({shapes})")
    return "; ".join(differ) or "their tensors' names and shapes agree, but not their tables' options"


def _listed(names: list[str]) -> str:
    shown = ", ".join(repr(n) for n in names[:SHOWN])
    return shown + (f" and {len(names) - SHOWN} more" if len(names) > SHOWN else "")


def registered_kind(obj: object) -> str:
    """How a message names a registered model: its class, or "mapping of tensors"."""
    return type(obj).__name__ if isinstance(obj, nn.Module) else "mapping of tensors"
