"""A served model's rows (worker.serve): each table's cache of the rows it read from the serving copies, valid for
one version, and one request for the rows a forward pass lacks in every table.

The tables' IDs are learned before the forward pass by a capture pass (worker.prefetch.capture: the forward run
with the tables answering zeros, stopped once every table has spoken), so a model of 26 tables asks the copies once
per forward pass, not 26 times.
"""

from __future__ import annotations

import threading
import time
from typing import TYPE_CHECKING, Any

import numpy as np
from torch import nn

from paramserver.shard.sparse.id_hash import IdHash
from worker.client.sparse import CAPTURING

if TYPE_CHECKING:
    from worker.client.serving import ServingClient


class ServedRows:
    """A table's rows read from serving copies (a RowSource: worker.client.sparse), with a cache of the rows read
    that holds for one version: emptied once an answer shows another, and checked at most every `refresh` s. The
    cache is an IdHash over a block of rows: a batch's IDs are found, fetched and kept a whole array at a time."""

    trains = False

    def __init__(self, client: ServingClient, name: str, refresh: float = 0.05, cache_rows: int = 1 << 20) -> None:
        self.client = client
        self.name = name
        self.refresh = refresh
        self.cache_rows = cache_rows
        self.dim = client.tables[name].dim
        self._index = IdHash(np.int64)
        self._rows = np.empty((0, self.dim), np.float32)
        self._held = 0  # rows of _rows in use
        self._versions: tuple[int, ...] = ()
        self._checked = 0.0
        self._lock = threading.Lock()
        self.hits = 0
        self.misses = 0

    def lookup(self, ids: np.ndarray) -> np.ndarray:
        ids = np.ascontiguousarray(ids, dtype=np.int64).reshape(-1)
        with self._lock:
            if time.monotonic() - self._checked > self.refresh:
                self._valid_for(self.client.recent_versions(self.refresh))
            unique, inverse, counts = np.unique(ids, return_inverse=True, return_counts=True)
            slots = self._index.get(unique) if self._held else np.full(len(unique), -1, np.int64)
            missing = slots < 0
            self.misses += int(counts[missing].sum())
            self.hits += len(ids) - int(counts[missing].sum())
            if not missing.any():
                return self._rows[slots][inverse]
            rows = np.empty((len(unique), self.dim), np.float32)
            fetched = self.client.lookup_many({self.name: unique[missing]})[self.name]
            if self._valid_for(self.client.versions):  # another version: every row of this answer from it
                rows = self.client.lookup_many({self.name: unique})[self.name]
                self._valid_for(self.client.versions)
                missing = np.ones(len(unique), bool)
                fetched = rows
            else:
                rows[~missing] = self._rows[slots[~missing]]
                rows[missing] = fetched
            self._keep(unique[missing], fetched)
            return rows[inverse]

    def missing(self, ids: np.ndarray) -> np.ndarray:
        """Which of these unique IDs the cache lacks (after checking its version)."""
        with self._lock:
            if time.monotonic() - self._checked > self.refresh:
                self._valid_for(self.client.recent_versions(self.refresh))
            return ids[self._index.get(ids) < 0] if self._held else ids

    def take(self, ids: np.ndarray, rows: np.ndarray, versions: tuple[int, ...]) -> None:
        """Keep rows read together with other tables' at `versions` (the cache is emptied first if that is another
        version than it holds)."""
        with self._lock:
            self._valid_for(versions)
            known = self._index.get(ids) >= 0 if self._held else np.zeros(len(ids), bool)
            self._keep(ids[~known], rows[~known])

    def _keep(self, ids: np.ndarray, rows: np.ndarray) -> None:
        """Cache these rows (IDs not cached yet) while the cache has room."""
        if self._held + len(ids) > self.cache_rows:
            return
        end = self._held + len(ids)
        if end > len(self._rows):
            grown = np.empty((max(end, 2 * len(self._rows), 1024), self.dim), np.float32)
            grown[: self._held] = self._rows[: self._held]
            self._rows = grown
        self._rows[self._held : end] = rows
        self._index.insert(ids, np.arange(self._held, end, dtype=np.int64))
        self._held = end

    def _valid_for(self, versions: tuple[int, ...]) -> bool:
        """Note the versions the rows are of; True when they changed (the cache is emptied)."""
        self._checked = time.monotonic()
        if versions == self._versions:
            return False
        self._index = IdHash(np.int64)
        self._held = 0
        self._versions = versions
        return True


def grouped_reads(model: nn.Module, sources: dict[int, ServedRows]) -> nn.Module:
    """Before each forward pass of `model`, a capture pass learns every table's IDs, and the rows its tables' caches
    lack are read in one request (`sources`: each table's ServedRows, by id of the table). Returns the model."""
    from worker.prefetch import capture  # worker.prefetch imports the tables' module, as this one does

    def before(module: nn.Module, args: tuple[Any, ...], kwargs: dict[str, Any]) -> None:
        if CAPTURING.get() is not None:
            return
        found = capture(module, lambda: module.forward(*args, **kwargs))
        if not found:
            return
        asked: dict[str, tuple[ServedRows, np.ndarray]] = {}
        for table, given in found:
            source = sources.get(id(table))
            if source is not None:
                unique = np.unique(np.asarray(given.detach().cpu(), dtype=np.int64).reshape(-1))
                lacking = source.missing(unique)
                if len(lacking):
                    asked[source.name] = (source, lacking)
        if not asked:
            return
        client = next(iter(asked.values()))[0].client
        rows = client.lookup_many({name: lacking for name, (_, lacking) in asked.items()})
        for name, (source, lacking) in asked.items():
            source.take(lacking, rows[name], client.versions)

    model.register_forward_pre_hook(before, with_kwargs=True)
    return model
