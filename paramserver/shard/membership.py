"""Membership: which workers are in the job, their ranks and leases, and which pushes were already applied.

Pure bookkeeping with no lock of its own: the Shard calls it under its lock.
"""

from __future__ import annotations

import time
from collections import OrderedDict, deque
from dataclasses import dataclass

from paramserver.errors import InvalidArgument, JobFull, UnknownWorker

# Pushes remembered per worker for exactly-once: far more than a worker ever has in flight.
REMEMBERED_STEPS = 256
# Workers whose applied pushes are remembered (least recently pushing forgotten first).
REMEMBERED_WORKERS = 4096


@dataclass
class Worker:
    """One live worker."""

    worker_id: str
    rank: int
    last_seen: float


class AppliedLog:
    """The (worker, step) pairs already applied, bounded per worker and in workers; outlives membership.

    A worker that was evicted, or a shard that restarted from a checkpoint, must still recognise a retried push.
    """

    def __init__(self) -> None:
        self._by_worker: OrderedDict[str, tuple[set[int], deque[int]]] = OrderedDict()

    def seen(self, worker_id: str, step: int) -> bool:
        entry = self._by_worker.get(worker_id)
        return entry is not None and step in entry[0]

    def record(self, worker_id: str, step: int) -> None:
        entry = self._by_worker.get(worker_id)
        if entry is None:
            entry = self._by_worker[worker_id] = (set(), deque())
            if len(self._by_worker) > REMEMBERED_WORKERS:
                self._by_worker.popitem(last=False)
        self._by_worker.move_to_end(worker_id)
        steps, order = entry
        steps.add(step)
        order.append(step)
        if len(order) > REMEMBERED_STEPS:
            steps.discard(order.popleft())

    def dump(self) -> dict[str, list[int]]:
        """Return the log as plain data (for checkpoints)."""
        return {w: list(order) for w, (_, order) in self._by_worker.items()}

    @classmethod
    def restore(cls, data: dict[str, list[int]]) -> AppliedLog:
        log = cls()
        for worker_id, steps in data.items():
            for step in steps:
                log.record(worker_id, step)
        return log


class Membership:
    """The job's live workers; ranks 0..world_size-1 go to the lowest free slot."""

    def __init__(self, world_size: int) -> None:
        self.world_size = world_size
        self._workers: dict[str, Worker] = {}
        # Live workers with nothing to train for now (ps-worker --follow, caught up): out of the rounds' count.
        self._idle: set[str] = set()
        # A sync job starts once it has had all its workers; until then a round waits for `expected` of them.
        self.ever_full = False
        self.expected = world_size  # fewer after a restart of a job some of whose workers have finished

    def rejoin_all(self, finished: int) -> None:
        """After a restart from a checkpoint: wait, as at the start, for the job's workers (but the `finished` ones)
        to join again before a sync round closes. A round closed by the first worker back would hold its step
        alone, and the others' pushes of that step would be refused here while another shard took them: the
        shards' rounds would then hold different steps, each waiting for a worker stuck on the other."""
        self.ever_full = False
        self.expected = max(1, self.world_size - finished)

    def join(self, worker_id: str) -> Worker:
        """Add a worker (or renew one that is already in) and return it with its rank."""
        if not worker_id:
            raise InvalidArgument("a worker id is required to join")
        known = self._workers.get(worker_id)
        if known is not None:
            known.last_seen = time.monotonic()
            return known
        used = {w.rank for w in self._workers.values()}
        free = [r for r in range(self.world_size) if r not in used]
        if not free:
            raise JobFull(
                f"the job already has its {self.world_size} workers; start the servers with a larger --workers "
                f"to add more, or wait for a dead worker's lease to run out"
            )
        worker = Worker(worker_id, free[0], time.monotonic())
        self._workers[worker_id] = worker
        if len(self._workers) >= self.expected:
            self.ever_full = True
        return worker

    def leave(self, worker_id: str) -> bool:
        """Remove a worker; return whether it was in."""
        self._idle.discard(worker_id)
        return self._workers.pop(worker_id, None) is not None

    def set_idle(self, worker_id: str, idle: bool) -> bool:
        """Say whether a live worker is idle (it pushes nothing until it is not); return whether that changed."""
        if idle == (worker_id in self._idle) or worker_id not in self._workers:
            return False
        if idle:
            self._idle.add(worker_id)
        else:
            self._idle.discard(worker_id)
        return True

    def get(self, worker_id: str) -> Worker:
        """Return a live worker, renewing its lease, or raise UnknownWorker."""
        worker = self._workers.get(worker_id)
        if worker is None:
            raise UnknownWorker(
                f"worker {worker_id!r} is not in the job (never joined, left, evicted, or the shard restarted); "
                f"join again"
            )
        worker.last_seen = time.monotonic()
        return worker

    def touch(self, worker_id: str) -> bool:
        """Renew a worker's lease if it is live; return whether it is."""
        worker = self._workers.get(worker_id)
        if worker is not None:
            worker.last_seen = time.monotonic()
        return worker is not None

    def evict_expired(self, lease_timeout: float, now: float | None = None) -> list[tuple[str, float]]:
        """Remove every worker silent for longer than the lease; return (id, seconds silent) of each."""
        now = time.monotonic() if now is None else now
        gone = [(w.worker_id, now - w.last_seen) for w in self._workers.values() if now - w.last_seen > lease_timeout]
        for worker_id, _ in gone:
            del self._workers[worker_id]
            self._idle.discard(worker_id)
        return gone

    def rank_of(self, worker_id: str) -> int:
        """The rank of a live worker, -1 for one that is gone."""
        worker = self._workers.get(worker_id)
        return worker.rank if worker is not None else -1

    @property
    def live(self) -> set[str]:
        """Ids of the live workers."""
        return set(self._workers)

    @property
    def active(self) -> set[str]:
        """Ids of the live workers that are not idle: those a sync round waits for, whose clocks SSP compares."""
        return set(self._workers) - self._idle
