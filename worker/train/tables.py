"""The trainer's care of sparse tables: it knows which feature feeds which table, so it prefetches the rows of the
batch a coming exchange should bring, with no code of the user's.

A model with a `prefetch(features)` method (the built-in click models, worker.models.clicks) is given the coming
batch's Features and prefetches its tables itself, applying what its forward pass does to the IDs (a bounded
table's hashing). Any other model's tables are matched to the categorical features by name: a table whose module
path ends in a feature's name (`embeddings.C1`, `linear.C1`) prefetches that feature's IDs as they are.

The next exchange brings the rows of the next batch; an overlapped one (worker.train.overlap) the batch after next,
since the next step runs while it is in flight. So the loop reads batches that far ahead (`ahead`).
"""

from __future__ import annotations

import itertools
from collections import deque
from collections.abc import Iterable, Iterator
from typing import Any

from torch import nn

from worker.client.sparse import SparseEmbedding, tables_of
from worker.data.features import Features
from worker.models.clicks import feature_key


class TablePrefetch:
    """Prefetch a model's tables for a coming batch of Features."""

    def __init__(self, model: nn.Module, features: Iterable[str]) -> None:
        own = getattr(model, "prefetch", None)
        self._own = own if callable(own) else None
        names = set(features)
        # A table whose path's last part names a feature (as a module name: worker.models.clicks.feature_key).
        keys = {feature_key(name): name for name in names}
        self._tables: list[tuple[str, SparseEmbedding]] = [
            (keys[path.rsplit(".", 1)[-1]], table)
            for path, table in tables_of(model)
            if path.rsplit(".", 1)[-1] in keys
        ]
        self.active = self._own is not None or bool(self._tables)

    def __call__(self, coming: Features) -> None:
        """Name the coming batch's IDs to the tables: the next push_pull brings their rows."""
        if self._own is not None:
            self._own(coming)
            return
        for name, table in self._tables:
            table.prefetch(coming.ids[name])


def lookahead(batches: Iterable[tuple[Any, Any]], ahead: int) -> Iterator[tuple[Any, Any, Any]]:
    """(x, y, the x of the batch `ahead` later, or None where the iterable ends first) for each batch, reading at
    most `ahead` batches past the one yielded."""
    it = iter(batches)
    window: deque[tuple[Any, Any]] = deque(itertools.islice(it, ahead + 1))
    while window:
        x, y = window[0]
        yield x, y, (window[ahead][0] if len(window) > ahead else None)
        window.popleft()
        window.extend(itertools.islice(it, 1))
