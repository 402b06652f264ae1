"""Membership: which workers are in the job, their ranks, and the pushes each already had applied.

Pure bookkeeping with no lock of its own: the Shard calls it under its lock.
"""

from __future__ import annotations

import time
from collections import deque
from dataclasses import dataclass, field

from paramserver.errors import TooLarge, UnknownWorker

# Pushes remembered per worker for exactly-once: far more than a worker ever has in flight.
REMEMBERED_STEPS = 256


@dataclass
class Worker:
    """One live worker."""

    worker_id: str
    rank: int
    last_seen: float
    _steps: set[int] = field(default_factory=set)
    _order: deque[int] = field(default_factory=deque)

    def seen_step(self, step: int) -> bool:
        """Return whether a push with this step was already taken."""
        return step in self._steps

    def record_step(self, step: int) -> None:
        """Remember that a push with this step was taken, forgetting the oldest beyond the bound."""
        self._steps.add(step)
        self._order.append(step)
        if len(self._order) > REMEMBERED_STEPS:
            self._steps.discard(self._order.popleft())


class Membership:
    """The job's live workers; ranks 0..world_size-1 go to the lowest free slot."""

    def __init__(self, world_size: int) -> None:
        self.world_size = world_size
        self._workers: dict[str, Worker] = {}
        # A sync job starts once it has had all its workers; until then a round waits for world_size of them.
        self.ever_full = False

    def join(self, worker_id: str) -> Worker:
        """Add a worker (or renew one that is already in) and return it with its rank."""
        if not worker_id:
            raise UnknownWorker("a worker id is required to join")
        known = self._workers.get(worker_id)
        if known is not None:
            known.last_seen = time.monotonic()
            return known
        used = {w.rank for w in self._workers.values()}
        free = [r for r in range(self.world_size) if r not in used]
        if not free:
            raise TooLarge(
                f"the job already has its {self.world_size} workers; start the servers with a larger "
                f"--workers to add more"
            )
        worker = Worker(worker_id, free[0], time.monotonic())
        self._workers[worker_id] = worker
        if len(self._workers) >= self.world_size:
            self.ever_full = True
        return worker

    def leave(self, worker_id: str) -> bool:
        """Remove a worker; return whether it was in."""
        return self._workers.pop(worker_id, None) is not None

    def get(self, worker_id: str) -> Worker:
        """Return a live worker, renewing it, or raise UnknownWorker."""
        worker = self._workers.get(worker_id)
        if worker is None:
            raise UnknownWorker(f"worker {worker_id!r} is not in the job (never joined, left or evicted); join again")
        worker.last_seen = time.monotonic()
        return worker

    def touch(self, worker_id: str) -> None:
        """Renew a worker's lease if it is live."""
        worker = self._workers.get(worker_id)
        if worker is not None:
            worker.last_seen = time.monotonic()

    @property
    def live(self) -> set[str]:
        """Ids of the live workers."""
        return set(self._workers)
