"""A model's gradient as backward makes it, for an exchange that starts before backward ends (per-layer overlap).

Backward finishes the last layers' gradients first. DDP sends each bucket of gradients as soon as it is ready; a
`GradientFeed` lets a shard's push do the same: it hooks every parameter (`register_post_accumulate_grad_hook`), so
a push can send its pieces last first (`ExchangeRequest.last_piece_first`), each as soon as its tensor's gradient is
final, while backward computes the earlier layers. Over a link, the bytes of the last layers are on the wire before
backward is over.

A parameter's gradient is final when its hook has run (autograd accumulates every use of it first), or when
backward has returned (one it did not reach: zero, or what `.grad` held; the pieces after it in the push wait for
that). A frozen parameter's is final from the start. A buffer's value (BatchNorm's running
statistics) is final once forward is over: when the first hook runs. So the backward given must run one backward
pass and leave the gradients as it made them: a loop that accumulates micro-batches, clips or unscales the gradient
afterwards exchanges after its backward instead (worker.train.trainer decides).
"""

from __future__ import annotations

import threading
from collections.abc import Callable, Iterator
from concurrent import futures
from typing import Any, TypeVar

import numpy as np

from worker.client.binding import Binding

T = TypeVar("T")


class BackwardFailed(Exception):
    """Backward raised: the pushes that were streaming its gradient stop, their frames cut off (the shard drops
    them: nothing of them applies)."""


class GradientFeed:
    """Each tensor's flat float32 gradient (or buffer value) of one backward pass, handed out once it is final.

    Made before forward (it hooks the parameters); `close()` once backward has returned (every gradient is final
    then), `close(error)` if it raised. `submit` runs a shard's part of the exchange on the feed's threads, since
    the caller's runs backward meanwhile."""

    def __init__(self, binding: Binding, pool: futures.ThreadPoolExecutor) -> None:
        self._binding = binding
        self._pool = pool
        n = len(binding.tensors)
        self._final = [threading.Event() for _ in range(n)]
        self._flats: list[np.ndarray | None] = [None] * n
        self._locks = [threading.Lock() for _ in range(n)]
        self._error: BaseException | None = None
        self._started = False
        self._done = threading.Event()
        self._hooks: list[Any] = []
        binding.settle()  # the mirrors are written from here on
        for i, t in enumerate(binding.tensors):
            if binding.buffer[i]:
                continue  # final when forward is over
            if not t.requires_grad:
                self._final[i].set()  # a frozen parameter: backward leaves its .grad (zero, or None) as it is
                continue
            self._hooks.append(t.register_post_accumulate_grad_hook(lambda _, i=i: self._made(i)))

    def _made(self, i: int) -> None:
        if not self._started:  # backward has begun, so forward is over: the buffers hold this step's values
            self._started = True
            for j, is_buffer in enumerate(self._binding.buffer):
                if is_buffer:
                    self._final[j].set()
        self._final[i].set()

    def flat(self, i: int) -> np.ndarray:
        """Tensor i's gradient (a buffer's value), once final; BackwardFailed if backward raised first."""
        self._final[i].wait()
        if self._error is not None:
            raise BackwardFailed(f"backward failed: {self._error}") from self._error
        with self._locks[i]:  # a tensor sliced over several shards is asked for by each shard's thread
            flat = self._flats[i]
            if flat is None:
                flat = self._flats[i] = self._binding.gradient(i, of_module=True)
            return flat

    def last_first(self, shard: int, on_wait: Callable[[], object] | None = None) -> Iterator[np.ndarray]:
        """The gradient of `shard`'s pieces, last piece first, each as soon as it is final; `on_wait()` is called
        before waiting for one that is not final yet."""
        b = self._binding
        for p in reversed(b.placement.shards[shard]):
            i = b.index(p.name)
            if on_wait is not None and not self._final[i].is_set():
                on_wait()
            yield self.flat(i)[p.start : p.start + p.length]

    def all(self) -> list[np.ndarray]:
        """Every tensor's gradient, once backward is over."""
        self.wait()
        return [self.flat(i) for i in range(len(self._final))]

    def wait(self) -> None:
        """Wait until backward is over (nothing of the model is in use by it then); BackwardFailed if it raised."""
        self._done.wait()
        if self._error is not None:
            raise BackwardFailed(f"backward failed: {self._error}") from self._error

    def close(self, error: BaseException | None = None) -> None:
        """Backward is over (`error`: it raised): every gradient is final, or every wait raises BackwardFailed.
        Once: a second call does nothing."""
        if self._done.is_set():
            return
        for hook in self._hooks:
            hook.remove()
        self._hooks.clear()
        self._error = error
        for event in self._final:
            event.set()
        self._done.set()

    def submit(self, fn: Callable[..., T], *args: Any) -> futures.Future[T]:
        """Run `fn(*args)` on the feed's threads (one per shard)."""
        return self._pool.submit(fn, *args)

    def run(self, backward: Callable[[], object]) -> None:
        """Run `backward` here, then close the feed (with its error, which is raised)."""
        try:
            backward()
        except BaseException as exc:
            self.close(exc)
            raise
        self.close()
