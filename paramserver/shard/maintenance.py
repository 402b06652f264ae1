"""A shard's maintenance: the background thread that evicts silent workers, says what a long round waits for, and
takes the time-based checkpoints. Each tick runs under the shard's lock; it is given what it acts on (the shard's
lock and closing flag, and what evicts, times the round and checkpoints), not the shard."""

from __future__ import annotations

import logging
import threading
import time
from collections.abc import Callable
from dataclasses import dataclass

log = logging.getLogger(__name__)

# A sync round waiting longer than this says in the log which workers it waits for (and again as often).
WAIT_LOG_SECONDS = 5.0


@dataclass(frozen=True)
class Duties:
    """What a tick does to its shard (each called under the shard's lock)."""

    evict: Callable[[float | None], None]  # evict the workers whose lease ran out by then (None: now)
    round_age: Callable[[], float]  # how long the current round has waited (0: none waits)
    waiting_for: Callable[[], str]  # what it waits for, in words
    checkpoint_due: Callable[[], bool]  # whether a time-based checkpoint is due
    checkpoint: Callable[[], None]  # take one


class Maintenance:
    """Tick a shard every `interval` seconds from `start` until `closed()` or `stop`."""

    def __init__(
        self, index: int, interval: float, lock: threading.Condition, closed: Callable[[], bool], duties: Duties
    ) -> None:
        self._index = index
        self._interval = interval
        self._lock = lock  # the shard's
        self._closed = closed
        self._duties = duties
        self._thread: threading.Thread | None = None
        self._last_wait_log = 0.0
        # Its own event to sleep on, not the shard's condition: that one is notified at every version a push makes,
        # and a tick per update (under the shard's lock) is work the step does not need.
        self._stopping = threading.Event()

    def start(self) -> None:
        """Start the thread (once)."""
        if self._thread is None:
            name = f"shard{self._index}-leases"
            self._thread = threading.Thread(target=self._run, name=name, daemon=True)
            self._thread.start()

    def _run(self) -> None:
        while not self._stopping.wait(self._interval):  # `stop` wakes it at once
            with self._lock:
                if self._closed():
                    return
                self.tick()

    def stop(self) -> None:
        """End the thread's sleep now (the shard is closing)."""
        self._stopping.set()

    def tick(self, now: float | None = None) -> None:
        """Evict workers whose lease ran out, log a long wait, take a checkpoint when one is due."""
        duties = self._duties
        with self._lock:
            duties.evict(now)
            waited = duties.round_age()
            clock = time.monotonic()
            if waited > WAIT_LOG_SECONDS and clock - self._last_wait_log > WAIT_LOG_SECONDS:
                self._last_wait_log = clock
                log.warning("shard %d: waiting %.0f s: %s", self._index, waited, duties.waiting_for())
            if duties.checkpoint_due():
                duties.checkpoint()

    def join(self, timeout: float) -> None:
        """Wait for the thread to end (once the shard is closed)."""
        if self._thread is not None:
            self._thread.join(timeout=timeout)
