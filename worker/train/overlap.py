"""Overlap: run each step's exchange with the servers while the next step computes (async and ssp jobs).

Without it a worker computes, then waits for its push and pull, then computes again: the network and the shards
sit idle while it computes, and its cores while it waits. With it, step t's gradient travels (and step t's new
weights come back) while step t+1 runs forward and backward on the weights of step t-1's exchange, so each step
costs about max(compute, exchange) instead of their sum. The price is one step more of staleness per gradient,
which async and bounded-staleness training tolerate by design; a sync round must see the gradients of its own
weights, so sync jobs do not overlap.

No parameter is copied for it. Each parameter has three storages that take turns: the weights the model computes
on, the gradient that backward fills, and the one in flight (sent as the gradient, then overwritten by the
weights the servers answer with). Once an exchange is back its storage becomes the parameter's data, the old data
becomes the next gradient, and this step's gradient goes out. A buffer (BatchNorm's running statistics), which the
forward pass updates in place, is copied instead: its value now goes out with the gradient, and the value the
servers answer with is copied into it when the exchange is back.

A model's sparse tables (worker.client.sparse.SparseEmbedding) ride along: each step's exchange pushes the gradients of
the rows its forward pass touched (set aside by `seal` on the caller's thread before the exchange starts, so the
next forward pass cannot mix in) and fetches the rows its tables were told to `prefetch`. Prefetch two batches
ahead: the exchange sent after step t's backward brings the rows of batch t+2, which step t+2 uses with the dense
weights of that same exchange. A forward pass on IDs nobody prefetched looks its rows up, after the exchange in
flight (one exchange on a client's links at a time): correct, but that step does not overlap.
"""

from __future__ import annotations

from collections.abc import Callable
from concurrent import futures
from types import TracebackType
from typing import Generic, TypeVar

import torch

from worker.client.binding import TensorDict, buffers_of
from worker.client.sparse import tables_of

T = TypeVar("T")
Exchange = Callable[[dict[str, torch.Tensor]], T]


class Overlap(Generic[T]):
    """Exchange each gradient in the background while the model computes the next one.

    `exchange(tensors)` must send `tensors` as the gradient and write the weights it pulls into them, in place (what
    `PSClient.push_pull` does with a mapping); its result is handed back by the next `step` or by `finish`.
    After `backward()`, call `step()`; after the last one, `finish()` puts the last exchange's weights into the model.
    Leaving the `with` block waits for the exchange in flight, so the client can be closed after it.
    """

    def __init__(self, model: torch.nn.Module, exchange: Exchange[T]) -> None:
        # Every parameter (a frozen one sends zeros), then every buffer, as PSClient registers a module, so the dicts
        # name the same model.
        self._params = list(model.named_parameters())
        if not self._params:
            raise ValueError("the model has no parameters")
        self._buffers = buffers_of(model)
        self._tables = tables_of(model)
        self._exchange = exchange
        self._pool = futures.ThreadPoolExecutor(max_workers=1, thread_name_prefix="ps-overlap")
        # Each set of storages is one dict of tensors, the same objects from step to step (so the client binds each
        # dict once): the set the parameters alias, the set backward fills, the set in flight with its result.
        # `.data`, not detach(): a detached tensor shares the parameter's version counter, and an exchange writing
        # into this set later (a CUDA or strided tensor's weights are copied in with torch) would count as changing
        # the parameter under the backward pass of the step then running.
        self._data: dict[str, torch.Tensor] = self._storages({name: p.data for name, p in self._params})
        self._grads: dict[str, torch.Tensor] = {}
        self._in_flight: tuple[futures.Future[T], dict[str, torch.Tensor]] | None = None

    def _storages(self, params: dict[str, torch.Tensor]) -> TensorDict:
        """One set: these parameter storages, and a storage of each buffer's own (its value is copied in)."""
        return TensorDict(
            [*params.items(), *((name, b.detach().clone()) for name, b in self._buffers)],
            buffers=(name for name, _ in self._buffers),
            tables=self._tables,
        )

    def step(self) -> T | None:
        """Send this step's gradients, and put the weights of the previous exchange into the model (waiting for it
        if it is still on its way); return that exchange's result, or None on the first step."""
        grads = self._grads
        for name, p in self._params:
            if p.grad is None:  # a parameter this step did not use: its gradient is zero
                p.grad = torch.zeros_like(p)
            grads[name] = p.grad  # the same object as before, unless something replaced .grad
        if not isinstance(grads, TensorDict):  # the first step's set
            grads = self._grads = self._storages(grads)
        with torch.no_grad():
            for name, b in self._buffers:
                grads[name].copy_(b)  # the value this step's forward left: it goes out with the gradient
        result, freed = self._land()
        # What this step's exchange sends of each table, set aside before the next forward pass touches rows (and
        # after the last exchange took its own).
        for _, table in self._tables:
            table.seal()
        self._in_flight = (self._pool.submit(self._exchange, grads), grads)
        # Backward accumulates into .grad in place, so the next step needs a storage of its own: the data just
        # replaced (on the first step, a new one). The caller zeroes it with zero_grad as usual.
        self._grads = freed if freed is not None else self._storages({n: torch.zeros_like(p) for n, p in self._params})
        for name, p in self._params:
            p.grad = self._grads[name]
        return result

    def finish(self) -> T | None:
        """Wait for the exchange in flight and make its weights the model's; return its result (None if none)."""
        return self._land()[0]

    def _land(self) -> tuple[T | None, dict[str, torch.Tensor] | None]:
        """Wait for the exchange in flight and make its set the model's data; return its result and the set the
        parameters aliased until now (None and None when nothing was in flight)."""
        if self._in_flight is None:
            return None, None
        future, tensors = self._in_flight
        self._in_flight = None
        result = future.result()
        with torch.no_grad():
            for name, p in self._params:
                p.data = tensors[name]
            for name, b in self._buffers:
                b.copy_(tensors[name])
        freed, self._data = self._data, tensors
        return result, freed

    def close(self) -> None:
        """Wait for the exchange in flight (its failure is dropped: the caller is leaving anyway) and stop."""
        if self._in_flight is not None:
            futures.wait([self._in_flight[0]])
            self._in_flight = None
        self._pool.shutdown(wait=True)

    def __enter__(self) -> Overlap[T]:
        return self

    def __exit__(
        self, exc_type: type[BaseException] | None, exc: BaseException | None, tb: TracebackType | None
    ) -> None:
        self.close()
