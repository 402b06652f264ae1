"""The worker side of paramserver: `PSClient` to talk to the shards, and the `ps-worker` training loop."""

from __future__ import annotations

from worker.client import PSClient

__all__ = ["PSClient"]
