"""A shard's maintenance: the background thread that evicts silent workers, says what a long round waits for, and
takes the time-based checkpoints. Each tick runs under the shard's lock."""

from __future__ import annotations

import logging
import threading
import time
from typing import TYPE_CHECKING

from paramserver.shard import roster

if TYPE_CHECKING:
    from paramserver.shard.state import Shard

log = logging.getLogger(__name__)

# A sync round waiting longer than this says in the log which workers it waits for (and again as often).
WAIT_LOG_SECONDS = 5.0


class Maintenance:
    """Tick a shard every min(1 s, lease_timeout / 4) from `start` until the shard closes."""

    def __init__(self, shard: Shard, lock: threading.Condition) -> None:
        self._shard = shard
        self._lock = lock
        self._thread: threading.Thread | None = None
        self._last_wait_log = 0.0
        # Its own event to sleep on, not the shard's condition: that one is notified at every version a push makes,
        # and a tick per update (under the shard's lock) is work the step does not need.
        self._stopping = threading.Event()

    def start(self) -> None:
        """Start the thread (once)."""
        if self._thread is None:
            name = f"shard{self._shard.index}-leases"
            self._thread = threading.Thread(target=self._run, name=name, daemon=True)
            self._thread.start()

    def _run(self) -> None:
        interval = min(1.0, self._shard.config.lease_timeout / 4)
        while not self._stopping.wait(interval):  # `stop` wakes it at once
            with self._lock:
                if self._shard.closed:
                    return
                self.tick()

    def stop(self) -> None:
        """End the thread's sleep now (the shard is closing)."""
        self._stopping.set()

    def tick(self, now: float | None = None) -> None:
        """Evict workers whose lease ran out, log a long wait, take a checkpoint when one is due."""
        shard = self._shard
        with self._lock:
            roster.evict_expired(shard, now)
            waited = shard.policy.round_age()
            clock = time.monotonic()
            if waited > WAIT_LOG_SECONDS and clock - self._last_wait_log > WAIT_LOG_SECONDS:
                self._last_wait_log = clock
                log.warning("shard %d: waiting %.0f s: %s", shard.index, waited, shard.policy.waiting_for(shard))
            if shard.checkpoints.due_now():
                shard.checkpoint_locked()

    def join(self, timeout: float) -> None:
        """Wait for the thread to end (once the shard is closed)."""
        if self._thread is not None:
            self._thread.join(timeout=timeout)
