"""The worker side of paramserver: `PSClient` to talk to the shards, `Overlap` to exchange in the background
while the next step computes, `SparseEmbedding` for embedding tables held by the shards, and the `ps-worker`
training loop."""

from __future__ import annotations

from worker.client import PSClient
from worker.client.sparse import SparseEmbedding
from worker.train.overlap import Overlap

__all__ = ["Overlap", "PSClient", "SparseEmbedding"]
