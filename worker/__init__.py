"""The worker side of paramserver: `PSClient` to talk to the shards, `Overlap` to exchange in the background
while the next step computes, and the `ps-worker` training loop."""

from __future__ import annotations

from worker.client import PSClient
from worker.overlap import Overlap

__all__ = ["Overlap", "PSClient"]
