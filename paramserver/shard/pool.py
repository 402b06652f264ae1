"""The scratch pool: gradient-sized buffers that pushes are received into, validated in, and summed in."""

from __future__ import annotations

import contextlib
import queue
import threading
from collections.abc import Iterator

import numpy as np


class BufferPool:
    """At most `size` gradient-sized scratch buffers, reused; a caller past the bound waits for one.

    Last in, first out: one worker at a time keeps reusing one warm buffer, and the others are only ever allocated
    (and paged in) when pushes really overlap. A borrower may `keep` the buffer it holds past its loan (a round's
    sum): it stays out of the pool, its slot taken, until `give_back`.
    """

    def __init__(self, size: int, numel: int) -> None:
        self.size = size
        self._numel = numel
        self._free: queue.LifoQueue[np.ndarray | None] = queue.LifoQueue()
        self._kept: set[int] = set()  # addresses of buffers on loan that stay out when their loan ends
        self._lock = threading.Lock()
        for _ in range(size):
            self._free.put(None)  # allocated on first use: an idle shard holds no scratch memory

    @contextlib.contextmanager
    def take(self) -> Iterator[np.ndarray]:
        """Lend a buffer (waiting while none is free); it returns to the pool when the block ends, unless kept."""
        buf = self._free.get()
        if buf is None:
            buf = np.empty(self._numel, dtype=np.float32)
        try:
            yield buf
        finally:
            with self._lock:
                kept = buf.ctypes.data in self._kept
                self._kept.discard(buf.ctypes.data)
            if not kept:
                self._free.put(buf)

    def keep(self, lent: np.ndarray) -> None:
        """Keep the buffer `lent` (on loan) when its loan ends; its slot stays taken until `give_back`."""
        with self._lock:
            self._kept.add(lent.ctypes.data)

    def give_back(self, kept: np.ndarray) -> None:
        """Return a buffer kept past its loan (or, if its loan has not ended yet, let the loan's end return it)."""
        if kept.shape != (self._numel,) or kept.dtype != np.float32:
            raise ValueError(f"a pool of {self._numel} float32 takes no {kept.dtype} buffer of {kept.shape}")
        with self._lock:
            on_loan = kept.ctypes.data in self._kept
            self._kept.discard(kept.ctypes.data)
        if not on_loan:
            self._free.put(kept)
