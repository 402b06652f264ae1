"""Claims: which worker trains each shard of a growing dataset (`ps-worker --follow`), recorded on the job's shard 0
so that the record outlives any worker.

A dataset shard's claim is one small entry: who holds it (while it is trained), whether it is done, how often it
was claimed (a claim released by a worker's death and claimed again counts twice) and the samples its finisher
trained. Every change is one `event`: the entry as it is after the change (so applying an event twice changes
nothing, and a snapshot may hold an event its log record holds too). The live shard applies an event at once and
hands it to the next `Update` (`take_events`), whose record the write-ahead log keeps and the backup applies, as
it does the pushes: so the record is as durable as the model, and no push of a shard's samples is acknowledged
before the claim it trains under is in the log (the claimer's first push is in that update or a later one).

Pure bookkeeping with no lock of its own: the Shard calls it under its lock.
"""

from __future__ import annotations

import time
from collections.abc import Iterable
from dataclasses import asdict, dataclass
from typing import Any

from paramserver.errors import ClaimNotHeld, InvalidArgument, OtherDataset

FREE, HELD, DONE = "free", "held", "done"
# A dataset key names the data a job follows (the worker derives it from the manifest); one per job.
MAX_DATASET_KEY = 256
MAX_SHARDS = 1 << 31  # shards a dataset may list


@dataclass
class Claim:
    """One dataset shard's entry."""

    shard: int
    state: str = FREE  # free (released by a worker that left or went silent), held or done
    worker: str = ""  # the holder while held; the finisher once done
    tries: int = 0  # how often it was claimed: 1 for a shard trained once, 2 after one holder's death, ...
    samples: int = 0  # the samples its finisher trained (what the worker said in its finish)


class Claims:
    """The record of one job's dataset: each listed shard's claim, the events not yet in an update."""

    def __init__(self) -> None:
        self.dataset = ""
        self._claims: dict[int, Claim] = {}
        self._events: list[dict[str, Any]] = []
        self._absent: dict[str, float] = {}  # a holder not live: since when (monotonic), for `expire`
        self._quiet_until = 0.0  # monotonic: no new claim before (after a restart: see `hold_off`)

    # -- what workers ask ----------------------------------------------------------------------------------------

    def check(self, dataset: str, listed: int = 0) -> None:
        """Refuse a request naming a bad key, another dataset than the job's, or a bad shard count."""
        if not dataset or len(dataset) > MAX_DATASET_KEY:
            raise InvalidArgument(f"a dataset key of 1 to {MAX_DATASET_KEY} characters is required")
        if self.dataset and dataset != self.dataset:
            raise OtherDataset(
                f"this job follows dataset {self.dataset!r}, the worker names {dataset!r}: every worker of a job "
                "trains the same dataset (start the servers again for another one)"
            )
        if not 0 <= listed <= MAX_SHARDS:
            raise InvalidArgument(f"a worker lists {listed} shards of the dataset, not 0 to {MAX_SHARDS}")

    def claim(self, worker: str, dataset: str, listed: int) -> int | None:
        """Give `worker` the first of the `listed` shards that is neither held nor done (None: all are); the
        shard it already holds, if any (a claim whose answer was lost is asked again)."""
        self.check(dataset, listed)
        held = [c.shard for c in self._claims.values() if c.state == HELD and c.worker == worker]
        if held:
            return min(held)
        if time.monotonic() < self._quiet_until:
            return None  # the holders of claims a restart lost re-assert them first (`hold_off`)
        for index in range(listed):
            entry = self._claims.get(index)
            if entry is None or entry.state == FREE:
                self._adopt(dataset)
                self._change(Claim(index, HELD, worker, (entry.tries if entry is not None else 0) + 1))
                return index
        return None

    def finish(self, worker: str, dataset: str, index: int, samples: int) -> None:
        """Record that `worker` trained shard `index` whole (`samples` samples); again is harmless. ClaimNotHeld
        where another worker holds it or finished it."""
        if not 0 <= index < MAX_SHARDS:
            raise InvalidArgument(f"dataset shard {index} is not one of 0 to {MAX_SHARDS - 1}")
        self.check(dataset)
        entry = self._claims.get(index)
        if entry is not None and entry.state == DONE and entry.worker == worker:
            return  # a finish whose answer was lost, asked again
        if entry is not None and entry.state != FREE and entry.worker != worker:
            raise ClaimNotHeld(
                f"worker {worker!r} finished dataset shard {index}, which is {entry.state} by {entry.worker!r}: its "
                "claim was released (the worker left or went silent past its lease) and another worker took it"
            )
        # Held by this worker; or nobody's (its claim lost by a restart, or freed while it was silent, and not
        # taken since): the worker trained it whole all the same, so it is done.
        self._change(Claim(index, DONE, worker, entry.tries if entry is not None else 1, max(0, samples)))

    def hold_off(self, seconds: float) -> None:
        """Give out no new shard for `seconds` (a restarted shard 0, or a backup taking over): a claim made after
        the last logged update is not in the record, and its holder, training on, re-asserts it (`hold`) within
        that time; until then the shard looks free and must not go to another worker."""
        self._quiet_until = time.monotonic() + seconds

    def hold(self, worker: str, dataset: str, index: int) -> None:
        """Re-assert that `worker` trains shard `index`: recorded held by it where nobody holds it (its claim was
        lost by a restart before a log record held it, or freed while the worker was silent and not claimed
        since); ClaimNotHeld where another worker holds it or it is done."""
        if not 0 <= index < MAX_SHARDS:
            raise InvalidArgument(f"dataset shard {index} is not one of 0 to {MAX_SHARDS - 1}")
        self.check(dataset)
        entry = self._claims.get(index)
        if entry is not None and entry.state == HELD and entry.worker == worker:
            return
        if entry is not None and entry.state != FREE:
            raise ClaimNotHeld(
                f"worker {worker!r} trains dataset shard {index}, which is {entry.state} by {entry.worker!r}: its "
                "claim was released (the worker went silent past its lease) and another worker took it"
            )
        self._adopt(dataset)
        self._change(Claim(index, HELD, worker, entry.tries if entry is not None else 1))

    # -- workers gone --------------------------------------------------------------------------------------------

    def release(self, worker: str) -> list[int]:
        """Free the shards `worker` holds (it left, or its lease ran out); return them."""
        freed = [c.shard for c in self._claims.values() if c.state == HELD and c.worker == worker]
        for index in freed:
            self._change(Claim(index, FREE, "", self._claims[index].tries))
        self._absent.pop(worker, None)
        return freed

    def expire(self, live: Iterable[str], lease: float, now: float | None = None) -> list[int]:
        """Free the shards of holders that have not been live for `lease` seconds (a shard restarted and its
        holder never joined again); return them."""
        now = time.monotonic() if now is None else now
        live = set(live)
        holders = {c.worker for c in self._claims.values() if c.state == HELD}
        self._absent = {w: t for w, t in self._absent.items() if w in holders and w not in live}
        freed: list[int] = []
        for worker in holders - live:
            since = self._absent.setdefault(worker, now)
            if now - since > lease:
                freed += self.release(worker)
        return freed

    # -- the record: updates, snapshots, reads -------------------------------------------------------------------

    def take_events(self) -> list[dict[str, Any]]:
        """The changes since the last update, for the next one to carry; empty after."""
        events, self._events = self._events, []
        return events

    def apply_events(self, events: Iterable[dict[str, Any]]) -> None:
        """Apply the changes an update carries (replayed from the log, or streamed to a backup)."""
        for event in events:
            if "dataset" in event:
                self.dataset = str(event["dataset"])
            else:
                claim = _claim_of(event)
                self._claims[claim.shard] = claim

    def dump(self) -> dict[str, Any]:
        """The whole record as plain data (for checkpoints)."""
        return {"dataset": self.dataset, "claims": [asdict(c) for c in sorted(self._claims.values(), key=_index)]}

    @classmethod
    def restore(cls, doc: dict[str, Any] | None) -> Claims:
        """A record from `dump`'s data (None or empty: no dataset followed yet)."""
        claims = cls()
        if doc:
            claims.dataset = str(doc.get("dataset", ""))
            claims.apply_events(doc.get("claims", []))
        return claims

    def entries(self) -> list[Claim]:
        """Every shard's claim, by index."""
        return sorted(self._claims.values(), key=_index)

    def _adopt(self, dataset: str) -> None:
        """The job's first claim names the dataset it follows."""
        if not self.dataset:
            self.dataset = dataset
            self._events.append({"dataset": dataset})

    def _change(self, claim: Claim) -> None:
        self._claims[claim.shard] = claim
        self._events.append(asdict(claim))


def _claim_of(event: dict[str, Any]) -> Claim:
    return Claim(
        int(event["shard"]),
        str(event["state"]),
        str(event.get("worker", "")),
        int(event.get("tries", 0)),
        int(event.get("samples", 0)),
    )


def _index(claim: Claim) -> int:
    return claim.shard
