"""PSClient, the worker's view of the parameter server (see worker.client.psclient)."""

from __future__ import annotations

from worker.client.binding import TensorDict
from worker.client.psclient import INLINE_BYTES, PSClient, Tensors

__all__ = ["INLINE_BYTES", "PSClient", "TensorDict", "Tensors"]
