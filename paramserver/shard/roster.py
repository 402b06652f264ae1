"""The job's workers coming and going, as one shard acts on it: a worker joins, leaves (finished or not) or is
evicted when its lease runs out, and the shard follows.

Apart from the Shard because each change sets off the same chain, whichever way it came: the consistency policy
counts the round's workers again, pulls held back for a worker that is gone may go on, a finish is checkpointed at
once, and the last worker out ends the job. The registry itself (ranks, leases) is paramserver.shard.membership's,
pure bookkeeping; these are functions of the shard it lives in, under the shard's lock, typed against what they
touch of it (`RosterHost`), not the Shard.
"""

from __future__ import annotations

import logging
import threading
from typing import TYPE_CHECKING, Protocol

from paramserver.errors import WrongJob
from paramserver.shard.consistency import Applier

if TYPE_CHECKING:
    from paramserver.config import ServerConfig
    from paramserver.metrics import ShardMetrics
    from paramserver.shard.attachments import Attachments
    from paramserver.shard.claims import Claims
    from paramserver.shard.consistency import Policy
    from paramserver.shard.status import ShardStats


class RosterHost(Applier, Protocol):
    """What a worker's coming and going touches of its shard (and what the consistency policy sees of it)."""

    index: int
    config: ServerConfig
    policy: Policy
    metrics: ShardMetrics
    attachments: Attachments
    stats: ShardStats
    claims: Claims
    done: threading.Event
    finished_workers: int

    @property
    def lock(self) -> threading.Condition:
        """The shard's one lock."""

    def check_serving(self) -> None:
        """Raise NotPrimary where this process must not serve workers (under the lock)."""

    def checkpoint_locked(self) -> None:
        """Hand a snapshot to the checkpoint writer now (under the lock)."""


log = logging.getLogger(__name__)


def check_job(shard: RosterHost, worker_id: str, job_name: str) -> None:
    """Refuse a worker that names another job (WrongJob); an empty name is any."""
    if job_name and job_name != shard.config.job_name:
        raise WrongJob(
            f"worker {worker_id!r} belongs to job {job_name!r}, this shard serves job {shard.config.job_name!r}"
        )


def join(shard: RosterHost, worker_id: str, job_name: str) -> tuple[int, int]:
    """Add a worker to the job; return (rank, version)."""
    check_job(shard, worker_id, job_name)
    with shard.lock:
        shard.check_serving()
        new = worker_id not in shard.membership.live
        worker = shard.membership.join(worker_id)
        if new:
            live = len(shard.membership.live)
            log.info("shard %d: worker %s joined as rank %d (%d live)", shard.index, worker_id, worker.rank, live)
        shard.policy.membership_changed(shard)
        shard.metrics.live_workers.set(len(shard.membership.live))
        return worker.rank, shard.version


def leave(shard: RosterHost, worker_id: str, finished: bool = False) -> None:
    """Remove a worker; a sync round stops waiting for it. `finished`: it completed its training."""
    with shard.lock:
        shard.attachments.drop(worker_id)
        if shard.membership.leave(worker_id):
            shard.finished_workers += finished
            log.info(
                "shard %d: worker %s left%s (%d live)",
                shard.index,
                worker_id,
                " after finishing" if finished else "",
                len(shard.membership.live),
            )
            _release_claims(shard, worker_id, "left")
            if finished:
                # Saved at once: a shard restarted after this must still count it, or the job never ends.
                shard.checkpoint_locked()
            changed(shard)


def evict_expired(shard: RosterHost, now: float | None = None) -> None:
    """Evict the workers whose lease ran out by `now` (call under the lock)."""
    gone = shard.membership.evict_expired(shard.config.lease_timeout, now)
    for worker_id, silent in gone:
        shard.attachments.drop(worker_id)
        shard.stats.evictions += 1
        shard.metrics.evictions.inc()
        live = len(shard.membership.live)
        log.warning(
            "shard %d: evicted worker %s after %.1f s of silence (%d live)", shard.index, worker_id, silent, live
        )
        _release_claims(shard, worker_id, "was evicted")
    if gone:
        changed(shard)
    # Holders that never came back after a restart (the record outlived them): freed once a lease has passed.
    for index in shard.claims.expire(shard.membership.live, shard.config.lease_timeout, now):
        log.warning("shard %d: dataset shard %d released: its holder did not come back", shard.index, index)


def _release_claims(shard: RosterHost, worker_id: str, why: str) -> None:
    """Free the dataset shards a worker held: whoever claims next trains them again from their start."""
    for index in shard.claims.release(worker_id):
        log.warning("shard %d: dataset shard %d released: worker %s %s", shard.index, index, worker_id, why)


def changed(shard: RosterHost) -> None:
    """Follow a change of the round set: a worker joined, left, was evicted, or went idle or busy."""
    shard.policy.membership_changed(shard)
    shard.metrics.live_workers.set(len(shard.membership.live))
    shard.lock.notify_all()  # a pull held back (sync round, ssp) for a worker that is gone may go on
    if not shard.membership.live and shard.finished_workers >= shard.config.workers and not shard.done.is_set():
        log.info("shard %d: the job is done: %d workers finished, none live", shard.index, shard.finished_workers)
        shard.done.set()
