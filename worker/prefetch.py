"""Prefetch for loops that someone else owns: each exchange also fetches the next batch's rows, and a forward pass
that finds none fetched makes one lookup for all its tables.

    for batch in worker.prefetching(loader, model):   # any iterable of batches: a DataLoader, a DataModule's
        optimizer.zero_grad()                         # loader, torch-rechub's, ...
        loss_fn(model(*batch[:-1]), batch[-1]).backward()
        optimizer.step()                              # PSOptimizer: the exchange brings the next batch's rows

Both stand on a capture pass: the model's forward run on a batch with every module in eval mode and no gradient,
its tables noting the IDs they are given and answering zeros, stopped once every table has spoken. It reads no row
and changes nothing (dropout draws nothing in eval mode, batch norm keeps its statistics), and costs the part of the
forward pass before the last table's lookup. A model whose forward pass fails on zeros is looked up table by table,
as before.

- `grouped_lookups(model)` (PSOptimizer installs it): before a forward pass of the model (or of the smallest
  module holding all its tables, as a LightningModule's `net`) that finds no fetched rows, a capture pass on the same
  inputs, then one exchange per shard for every table's IDs. This is the path of a loop that builds its own loader
  (deepctr-torch's `fit()`).
- `prefetching(batches, model)`: reads one batch ahead, captures it, and tells the tables to expect its IDs: each
  push fetches the rows of the oldest batch read whose forward pass has not run yet, so a loop that itself reads
  ahead (Lightning reads one batch ahead) gets the right rows too. Rows fetched before the latest update are never
  read (worker.client.sparse).
"""

from __future__ import annotations

import logging
from collections import deque
from collections.abc import Callable, Iterable, Iterator
from typing import Any, TypeVar

import torch
from torch import nn

from worker.client.sparse import CAPTURING, Prepared, SparseEmbedding, tables_of

log = logging.getLogger(__name__)

B = TypeVar("B")

__all__ = ["capture", "grouped_lookups", "prefetching"]

_HOOKED = "_paramserver_grouped_lookups"  # set on a model whose modules carry the hooks


class _Captured(BaseException):
    """Every table has spoken: the rest of the forward pass need not run (a BaseException: a model's `except
    Exception` does not swallow it)."""


class _Recorder:
    """Each table's IDs in a capture pass (worker.client.sparse.CAPTURING)."""

    def __init__(self, tables: list[SparseEmbedding]) -> None:
        self.wanted = {id(t) for t in tables}
        self.seen: dict[int, tuple[SparseEmbedding, torch.Tensor]] = {}

    def record(self, table: SparseEmbedding, ids: torch.Tensor, offsets: torch.Tensor | None) -> torch.Tensor:
        self.seen.setdefault(id(table), (table, ids.detach().clone()))
        if self.wanted <= set(self.seen):
            raise _Captured
        if table.mode is None:
            shape: tuple[int, ...] = (*ids.shape, table.dim)
        elif offsets is None:
            shape = (ids.shape[0], table.dim)
        else:
            shape = (offsets.shape[0] - int(table.include_last_offset), table.dim)
        return torch.zeros(shape, device=ids.device)


def capture(module: nn.Module, call: Callable[[], object]) -> list[tuple[SparseEmbedding, torch.Tensor]] | None:
    """Run `call` (a forward pass of `module`) as a capture pass: each of the module's tables' first IDs, in the order
    they were looked up; None where the forward pass failed on zeros (it is then left to look up table by table)."""
    tables = [t for _, t in tables_of(module)]
    recorder = _Recorder(tables)
    modes = [(m, m.training) for m in module.modules()]
    token = CAPTURING.set(recorder)
    try:
        module.eval()
        with torch.no_grad():
            call()
    except _Captured:
        pass
    except Exception as exc:  # noqa: BLE001 - a model that cannot run on zeros is looked up table by table
        log.debug("capture pass of %s failed: %r", type(module).__name__, exc)
        return None
    finally:
        CAPTURING.reset(token)
        for m, training in modes:
            m.training = training
    return list(recorder.seen.values())


def _fetch_together(found: list[tuple[SparseEmbedding, torch.Tensor]]) -> None:
    """One lookup for the tables' IDs, per client and model: each table then holds the rows for its forward pass."""
    groups: dict[tuple[int, int], list[tuple[SparseEmbedding, Prepared]]] = {}
    sources: dict[tuple[int, int], Any] = {}
    for table, ids in found:
        source = table.source
        key = getattr(source, "group", None)
        if key is None:
            continue  # a file's or a serving copy's rows: looked up by the table itself
        prepared = table.expect(ids, queue=False)  # the forward pass finds its unique IDs there
        groups.setdefault(key, []).append((table, prepared))
        sources[key] = source
    for key, wanted in groups.items():
        sources[key].lookup_group(wanted)


def _holders(model: nn.Module) -> list[nn.Module]:
    """The modules whose forward pass runs every table of `model`: the smallest module holding them all and those
    above it, each with a forward of its own (a ModuleDict has none)."""
    tables = {id(t) for _, t in tables_of(model)}
    out = []
    for module in model.modules():
        if type(module).forward is nn.Module.forward:
            continue
        if tables and tables <= {id(t) for _, t in tables_of(module)}:
            out.append(module)
    return out


def grouped_lookups(model: nn.Module) -> nn.Module:
    """Make a forward pass of `model` that finds no fetched rows look every table up at once (see the module
    docstring); return the model. Idempotent; a model without tables is left alone."""
    if getattr(model, _HOOKED, False):
        return model
    for holder in _holders(model):
        tables = [t for _, t in tables_of(holder)]

        def before(module: nn.Module, args: tuple[Any, ...], kwargs: dict[str, Any], tables: Any = tables) -> None:
            if CAPTURING.get() is not None or any(t.has_ready_rows() for t in tables):
                return
            if any(t.source is None or not t.source.trains for t in tables):
                return  # not registered (its forward says so), or reading a file: table by table
            found = capture(module, lambda: module.forward(*args, **kwargs))
            if found:
                _fetch_together(found)

        holder.register_forward_pre_hook(before, with_kwargs=True)
    object.__setattr__(model, _HOOKED, True)
    return model


def _forward_of(model: nn.Module) -> Callable[[Any], object]:
    """How a batch is fed to the model by default: a tuple or list (inputs..., target) as model(*inputs), a dict or
    a tensor as model(batch)."""

    def call(batch: Any) -> object:
        if isinstance(batch, tuple | list):
            return model(*batch[:-1]) if len(batch) > 1 else model(batch[0])
        return model(batch)

    return call


def prefetching(batches: Iterable[B], model: nn.Module, forward: Callable[[B], object] | None = None) -> Iterator[B]:
    """Yield `batches` unchanged, reading one ahead, so that each exchange (`PSOptimizer.step`,
    `client.push_pull(model)`) also fetches the rows of the next batch's IDs, and its forward pass makes no round
    trip. `forward(batch)`: runs the model on a batch (default: a tuple or list `(inputs..., target)` as
    `model(*inputs)`, anything else as `model(batch)`); it is run as a capture pass, reading no rows (see the module
    docstring). A forward pass whose IDs were not expected (another batch, a validation pass) looks its rows up in
    one exchange for all its tables."""
    grouped_lookups(model)
    call = forward or _forward_of(model)
    it = iter(batches)
    window: deque[B] = deque()

    def read() -> None:
        for batch in it:
            window.append(batch)
            found = capture(model, lambda batch=batch: call(batch))  # type: ignore[misc]
            for table, ids in found or ():
                table.expect(ids)
            return

    read()
    while window:
        read()
        yield window.popleft()
