"""The worker side of paramserver: `PSClient` to talk to the shards, `Overlap` to exchange in the background
while the next step computes, `SparseEmbedding` for embedding tables held by the shards, and the `ps-worker`
training loop. For a model and a loop written for plain torch: `make_sparse` (its embeddings onto the shards),
`PSOptimizer` (a torch.optim.Optimizer whose step is an exchange), `prefetching` (each batch's rows brought by the
exchange before it), `PSClient.save` and `load` (the trained model,
tables included, in one safetensors file, served without servers); `ParameterServerStrategy` for PyTorch
Lightning's Trainer (it alone loads Lightning); `ServingClient` and `serve` read a model from serving copies that
follow training (ps-serve).

These names load on first use, so that what needs none of them (ps-prepare, which never trains) does not load
torch: 1.9 s and about 200 MB of a ps-prepare process otherwise.
"""

from __future__ import annotations

import importlib
from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:
    from worker.client import PSClient
    from worker.client.model_file import load
    from worker.client.serving import ServingClient, serve
    from worker.client.sparse import SparseEmbedding
    from worker.lightning import ParameterServerStrategy
    from worker.models.convert import make_sparse
    from worker.prefetch import grouped_lookups, prefetching
    from worker.train.optimizer import PSOptimizer
    from worker.train.overlap import Overlap

__all__ = [
    "Overlap",
    "PSClient",
    "ParameterServerStrategy",
    "PSOptimizer",
    "ServingClient",
    "SparseEmbedding",
    "grouped_lookups",
    "load",
    "make_sparse",
    "prefetching",
    "serve",
]

_WHERE = {
    "PSClient": "worker.client",
    "SparseEmbedding": "worker.client.sparse",
    "Overlap": "worker.train.overlap",
    "PSOptimizer": "worker.train.optimizer",
    "make_sparse": "worker.models.convert",
    "prefetching": "worker.prefetch",
    "grouped_lookups": "worker.prefetch",
    "load": "worker.client.model_file",
    "ServingClient": "worker.client.serving",
    "serve": "worker.client.serving",
    "ParameterServerStrategy": "worker.lightning",
}


def __getattr__(name: str) -> Any:
    if name in _WHERE:
        return getattr(importlib.import_module(_WHERE[name]), name)
    raise AttributeError(f"module 'worker' has no attribute {name!r}")
