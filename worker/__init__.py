"""The worker side of paramserver: `PSClient` to talk to the shards, `Overlap` to exchange in the background
while the next step computes, `SparseEmbedding` for embedding tables held by the shards, and the `ps-worker`
training loop.

The three names load on first use, so that what needs none of them (ps-prepare, which never trains) does not load
torch: 1.9 s and about 200 MB of a ps-prepare process otherwise.
"""

from __future__ import annotations

import importlib
from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:
    from worker.client import PSClient
    from worker.client.sparse import SparseEmbedding
    from worker.train.overlap import Overlap

__all__ = ["Overlap", "PSClient", "SparseEmbedding"]

_WHERE = {"PSClient": "worker.client", "SparseEmbedding": "worker.client.sparse", "Overlap": "worker.train.overlap"}


def __getattr__(name: str) -> Any:
    if name in _WHERE:
        return getattr(importlib.import_module(_WHERE[name]), name)
    raise AttributeError(f"module 'worker' has no attribute {name!r}")
