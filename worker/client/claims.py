"""A worker's claims on the shards of a growing dataset (ps-worker --follow): which shard it trains next, recorded
on shard 0 of the job (SPEC.md section 18).

The record lives on the servers, so it outlives the worker: a worker that dies holding a shard has its claim freed
when it leaves or its lease runs out, and whoever claims next trains that shard from its start."""

from __future__ import annotations

import logging

from paramserver.errors import ClaimNotHeld
from paramserver.v1 import ps_pb2
from worker.client.link import Session, ShardLink

log = logging.getLogger(__name__)


class DatasetClaims:
    """Claim, finish and read the shards of one dataset through shard 0 of a job (PSClient.claims)."""

    def __init__(self, link: ShardLink, session: Session, dataset: str) -> None:
        self._link = link
        self._session = session
        self.dataset = dataset

    def claim(self, listed: int, finish: int = -1, samples: int = 0) -> int | None:
        """Record shard `finish` (>= 0) trained whole with `samples` samples, then claim the first of the `listed`
        shards nobody holds or finished; None: none is free. Safe to retry: a worker holding a shard is given it
        again, and a finish recorded before is harmless."""
        s, link = self._session, self._link
        request = ps_pb2.ClaimRequest(
            worker_id=s.worker_id,
            job_name=s.job_name,
            dataset=self.dataset,
            listed=listed,
            finish=finish,
            samples=samples,
        )
        reply = link.retry(lambda: link.rpc.stub.Claim(request, timeout=s.timeout))
        return None if reply.shard < 0 else int(reply.shard)

    def hold(self, index: int) -> bool:
        """Re-assert that this worker trains shard `index` (recorded again where a restart of shard 0 lost the
        claim); False where another worker holds it or it is done: stop training it."""
        s, link = self._session, self._link
        request = ps_pb2.ClaimRequest(worker_id=s.worker_id, job_name=s.job_name, dataset=self.dataset, holding=index)
        try:
            link.retry(lambda: link.rpc.stub.Claim(request, timeout=s.timeout))
        except ClaimNotHeld as exc:
            log.warning("%s", exc)
            return False
        return True

    def record(self) -> ps_pb2.ClaimsRecord:
        """The job's claims record, as shard 0 holds it."""
        link = self._link
        return link.retry(lambda: link.rpc.stub.Claims(ps_pb2.ClaimsRequest(), timeout=self._session.timeout))
