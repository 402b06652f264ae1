"""A worker's membership of the job on every shard: joining (shard 0's rank counts; a full job is waited on while a
dead worker's place frees), the heartbeat that renews the lease meanwhile (and joins again where a shard forgot
this worker), and leaving."""

from __future__ import annotations

import logging
import threading
import time
from collections.abc import Sequence
from concurrent import futures

from paramserver.errors import JobFull, PSError, UnknownWorker
from paramserver.v1 import ps_pb2
from worker.client.fanout import each
from worker.client.link import Session, ShardLink

log = logging.getLogger(__name__)

# How long a Join waits for a place in a full job: three of the shards' default lease timeouts (10 s), so that the
# place of a worker that died just before (its lease still running) frees meanwhile.
JOB_FULL_WAIT_S = 30.0


class Membership:
    """Join, renew and leave on every shard of one client."""

    def __init__(self, links: Sequence[ShardLink], session: Session, pool: futures.Executor) -> None:
        self._links = links
        self._session = session
        self._pool = pool
        self._closing = threading.Event()
        self._heartbeat: threading.Thread | None = None

    def join(self) -> tuple[int, int]:
        """Join every shard (shard 0 first); return this worker's rank and the job's world size."""
        first = self._join_first()
        others = each(self._pool, self._links[1:], ShardLink.join, rejoin=False)
        leases = [first.lease_timeout_s] + [r.lease_timeout_s for r in others]
        self._session.joined = True
        lease = min(x for x in leases if x > 0) if any(x > 0 for x in leases) else 10.0
        if self._heartbeat is None:
            # Renew the lease while the worker computes or waits, well within the lease timeout.
            self._heartbeat = threading.Thread(target=self._beat, args=(lease / 3,), name="ps-heartbeat", daemon=True)
            self._heartbeat.start()
        return first.rank, first.world_size

    def _join_first(self) -> ps_pb2.JoinResponse:
        """Join shard 0, waiting while the job is full: a place held by a worker that died (or by a Join that
        never came back) frees once its lease runs out, so a worker restarted at once gets in then."""
        began = time.monotonic()
        first = self._links[0]
        while True:
            try:
                return first.retry(first.join, rejoin=False)
            except JobFull as exc:
                left = began + JOB_FULL_WAIT_S - time.monotonic()
                if left <= 0:
                    raise
                log.warning("%s; trying again in %.1f s, giving up in %.0f s", exc, min(1.0, left), left)
                time.sleep(min(1.0, left))

    def _beat(self, interval: float) -> None:
        failing: set[int] = set()  # shards whose last heartbeat failed: an outage is logged when it starts and ends
        while not self._closing.wait(interval):
            for k, link in enumerate(self._links):
                if not self._session.joined or self._closing.is_set():
                    break
                try:
                    link.heartbeat(interval)
                except UnknownWorker:
                    try:
                        link.rejoin()
                    except PSError as again:
                        log.warning("re-joining shard %s failed: %s", link.address, again)
                    continue
                except PSError as exc:
                    if k not in failing:
                        failing.add(k)
                        log.warning(
                            "heartbeat to shard %s failed: %s; the shard evicts this worker if it hears nothing "
                            "for its lease timeout",
                            link.address,
                            exc,
                        )
                    else:
                        log.debug("heartbeat to %s failed again: %s", link.address, exc)
                    continue
                if k in failing:
                    failing.discard(k)
                    log.info("heartbeat to shard %s answered again", link.address)

    def leave(self, finished: bool) -> None:
        """Leave every shard (once)."""
        if not self._session.joined:
            return
        self._session.joined = False
        each(self._pool, self._links, lambda link: link.leave(finished), rejoin=False)

    def stop(self) -> None:
        """Stop the heartbeat (the client is closing)."""
        self._closing.set()
        if self._heartbeat is not None:
            self._heartbeat.join(timeout=5)
