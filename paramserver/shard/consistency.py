"""Consistency policies: when a validated gradient becomes an update. One small class per mode, registered under
the mode's ps.proto value (POLICIES).

A policy is called by the Shard under the shard's lock, with a gradient that has already passed every check, and
raises before touching anything when it refuses a push, so a refused push changes nothing.
"""

from __future__ import annotations

import time
from collections.abc import Callable, Sequence
from typing import Protocol

import torch

from paramserver import modes
from paramserver.config import ServerConfig
from paramserver.errors import StaleRound
from paramserver.shard.membership import Membership
from paramserver.shard.sparse.row_blocks import RowBlock, combine
from paramserver.v1 import ps_pb2


class Applier(Protocol):
    """What a policy sees of the shard."""

    version: int
    membership: Membership

    def apply(
        self,
        grad: torch.Tensor,
        *,
        rows: Sequence[RowBlock] = (),
        straggler: str | None = None,
        waited: float | None = None,
        staleness: int | None = None,
    ) -> None:
        """Apply one update with this flat gradient (the optimizer on parameters; buffer elements carry values, set
        by the job's buffer rule) and these row gradients (each table's IDs unique), and bump the version (with
        what to record about it)."""

    def keep_scratch(self, grad: torch.Tensor) -> bool:
        """Keep `grad`, a lent scratch buffer, until `release_scratch`; False: it may not, and must copy it."""

    def release_scratch(self, grad: torch.Tensor) -> None:
        """Give back a buffer kept through `keep_scratch`."""


class Policy(Protocol):
    def reset(self, numel: int) -> None:
        """Forget any round in progress; the model now has `numel` elements."""

    def submit(
        self,
        shard: Applier,
        worker_id: str,
        base_version: int,
        grad: torch.Tensor,
        lent: bool = False,
        rows: Sequence[RowBlock] = (),
    ) -> None:
        """Take one worker's gradient (dense, and `rows`: its row gradients, which the policy may keep) computed on
        `base_version`; apply now or later. `lent`: `grad` is a scratch buffer the policy may keep, through
        `shard.keep_scratch`, instead of copying it (and must then give back through `shard.release_scratch` once
        done with it)."""

    def membership_changed(self, shard: Applier) -> None:
        """React to a worker joining or leaving."""

    def waiting_for(self, shard: Applier) -> str:
        """Say in words what the next version waits for (for timeouts and logs)."""

    def pending(self, worker_id: str) -> bool:
        """Whether this worker's gradient waits in the open round (applied with the next version, not yet)."""

    def in_progress(self) -> bool:
        """Whether a round has some but not all of its gradients."""

    def round_age(self) -> float:
        """Seconds the open round has waited so far."""

    def may_pull(self, shard: Applier, worker_id: str) -> bool:
        """Whether this worker's pull may return now (once it has its version); the shard waits until it may."""

    def stable_for(self, shard: Applier, worker_id: str) -> bool:
        """Whether no update can apply before this worker pushes again, so its pull may send the weights in place,
        outside the lock, instead of a copy taken under it."""


class SyncPolicy:
    """Bulk-synchronous: one in-place sum per round; the mean applies once every live worker has pushed (but those
    idle: a --follow worker with no dataset shard to train leaves the round set until it pushes again).

    With `backup_workers` B, a round applies once all live workers but B have pushed; pushes for a closed round
    are refused. Memory is one gradient-sized buffer whatever the number of workers: a round's first gradient
    received into a scratch buffer becomes the sum as it is (no copy) and goes back to the scratch pool once the
    round applies, so between rounds the shard holds no sum; one that arrived in place (shared memory) is copied
    into a buffer of the policy's own.
    """

    def __init__(self, backup_workers: int = 0) -> None:
        self.backup_workers = backup_workers
        self._numel = 0
        self._sum: torch.Tensor | None = None  # the open round's sum: `_own`, or a kept scratch buffer
        self._own: torch.Tensor | None = None  # allocated on first use: network pushes may never need it
        self._contributors: set[str] = set()
        self._last: str | None = None  # the latest contributor: the round's straggler when it closes
        self._opened = 0.0  # when the round's first gradient arrived
        self._rows: list[RowBlock] = []  # the open round's row gradients, summed when it closes

    def reset(self, numel: int) -> None:
        self._numel = numel
        self._sum = self._own = None  # a kept buffer belonged to the scratch pool of the model replaced
        self._contributors = set()
        self._rows = []

    def submit(
        self,
        shard: Applier,
        worker_id: str,
        base_version: int,
        grad: torch.Tensor,
        lent: bool = False,
        rows: Sequence[RowBlock] = (),
    ) -> None:
        if base_version != shard.version:
            raise StaleRound(
                f"push computed on version {base_version}, but the shard is at version {shard.version}: "
                f"that round has closed; pull and compute the gradient again"
            )
        if worker_id in self._contributors:
            raise StaleRound(
                f"worker {worker_id!r} already pushed for round {base_version}; pull version "
                f"{base_version + 1} before pushing again"
            )
        if not self._contributors and self._complete(shard, {worker_id}):
            # A round of this one gradient (one live worker): apply it as it is, sparing a copy into the sum.
            self._last = worker_id
            shard.apply(grad, rows=rows, straggler=worker_id, waited=0.0)
            return
        if self._contributors:
            assert self._sum is not None
            self._sum.add_(grad)
        else:
            if lent and shard.keep_scratch(grad):  # in a scratch buffer: it becomes the sum, sparing a copy
                self._sum = grad
            else:
                if self._own is None:
                    self._own = torch.empty(self._numel, dtype=torch.float32)
                self._sum = self._own
                self._sum.copy_(grad)
            self._opened = time.monotonic()
        self._contributors.add(worker_id)
        self._rows.extend(rows)
        self._last = worker_id
        self._close_if_complete(shard)

    def membership_changed(self, shard: Applier) -> None:
        self._close_if_complete(shard)

    def waiting_for(self, shard: Applier) -> str:
        missing = sorted(shard.membership.active - self._contributors)
        have = len(self._contributors)
        if not shard.membership.ever_full:
            return (
                f"round {shard.version} has {have} gradient(s); the job has had only "
                f"{len(shard.membership.live)} of its {shard.membership.expected} workers join"
            )
        return f"round {shard.version} has {have} gradient(s), waiting for workers {missing}"

    def pending(self, worker_id: str) -> bool:
        return worker_id in self._contributors

    def in_progress(self) -> bool:
        return bool(self._contributors)

    def may_pull(self, shard: Applier, worker_id: str) -> bool:
        return True

    def stable_for(self, shard: Applier, worker_id: str) -> bool:
        # No round closes without a live worker's gradient, unless backup workers let rounds close without it.
        return self.backup_workers == 0 and worker_id in shard.membership.active

    def round_age(self) -> float:
        """Seconds since the open round's first gradient (0 when none is open)."""
        return time.monotonic() - self._opened if self._contributors else 0.0

    def _complete(self, shard: Applier, contributors: set[str]) -> bool:
        """Whether a round with gradients from these workers may apply."""
        if len(shard.membership.active - contributors) > self.backup_workers:
            return False
        return shard.membership.ever_full or len(contributors) >= shard.membership.expected - self.backup_workers

    def _close_if_complete(self, shard: Applier) -> None:
        if not self._contributors or not self._complete(shard, self._contributors):
            return
        total, self._sum = self._sum, None
        assert total is not None
        if len(self._contributors) > 1:  # the mean of one gradient is itself: spare a pass over the buffer
            total.div_(len(self._contributors))
        rows = combine(self._rows, len(self._contributors)) if self._rows else ()
        self._contributors = set()
        self._rows = []
        try:
            shard.apply(total, rows=rows, straggler=self._last, waited=time.monotonic() - self._opened)
        finally:
            if total is not self._own:
                shard.release_scratch(total)


class AsyncPolicy:
    """Asynchronous: every gradient applies on arrival, whatever version it was computed on (up to
    `max_staleness` versions old, when that is not 0)."""

    def __init__(self, max_staleness: int = 0) -> None:
        self.max_staleness = max_staleness

    def reset(self, numel: int) -> None:
        pass

    def pending(self, worker_id: str) -> bool:
        return False  # every gradient applies on arrival

    def in_progress(self) -> bool:
        return False

    def round_age(self) -> float:
        return 0.0

    def may_pull(self, shard: Applier, worker_id: str) -> bool:
        return True

    def stable_for(self, shard: Applier, worker_id: str) -> bool:
        return False  # any other worker's push applies at once

    def submit(
        self,
        shard: Applier,
        worker_id: str,
        base_version: int,
        grad: torch.Tensor,
        lent: bool = False,
        rows: Sequence[RowBlock] = (),
    ) -> None:
        staleness = self._check(shard, base_version)
        shard.apply(grad, rows=rows, staleness=staleness)

    def _check(self, shard: Applier, base_version: int) -> int:
        """Refuse a push that cannot apply (before anything changes); return its staleness."""
        if base_version > shard.version:
            # Only a shard that restarted from an older checkpoint can be behind its workers: catch up first.
            raise StaleRound(
                f"push computed on version {base_version}, newer than the shard's {shard.version} (the shard "
                f"restarted from a checkpoint); pull and compute the gradient again"
            )
        staleness = shard.version - base_version
        if self.max_staleness and staleness > self.max_staleness:
            raise StaleRound(
                f"push computed on version {base_version} is {staleness} versions old, over the job's "
                f"--max-staleness {self.max_staleness}; pull and compute the gradient again"
            )
        return staleness

    def membership_changed(self, shard: Applier) -> None:
        pass

    def waiting_for(self, shard: Applier) -> str:
        return f"version {shard.version + 1} comes with the next push"


class SSPPolicy(AsyncPolicy):
    """Stale synchronous parallel (bounded staleness): every gradient applies on arrival, as in async mode, but
    a worker whose pushes run more than `staleness` ahead of the slowest live worker's waits at its pull until
    that one catches up (or leaves, or is evicted).

    A worker's clock is the number of its pushes applied here. A worker that joins starts at the slowest live
    worker's clock, so it holds nobody back; one that leaves takes its clock with it.
    """

    def __init__(self, staleness: int, max_staleness: int = 0) -> None:
        super().__init__(max_staleness)
        self.staleness = staleness
        self._clock: dict[str, int] = {}

    def reset(self, numel: int) -> None:
        self._clock = {}

    def submit(
        self,
        shard: Applier,
        worker_id: str,
        base_version: int,
        grad: torch.Tensor,
        lent: bool = False,
        rows: Sequence[RowBlock] = (),
    ) -> None:
        staleness = self._check(shard, base_version)
        self._track(shard)
        shard.apply(grad, rows=rows, staleness=staleness)
        self._clock[worker_id] = self._clock.get(worker_id, self._slowest()) + 1

    def may_pull(self, shard: Applier, worker_id: str) -> bool:
        self._track(shard)
        clock = self._clock.get(worker_id)
        return clock is None or clock - self._slowest() <= self.staleness

    def membership_changed(self, shard: Applier) -> None:
        self._track(shard)

    def _track(self, shard: Applier) -> None:
        """Follow the live workers: newcomers start at the slowest clock, the departed are forgotten."""
        live = shard.membership.active  # an idle worker (--follow, caught up) holds nobody back
        start = self._slowest(live)
        self._clock = {w: self._clock.get(w, start) for w in live}

    def _slowest(self, among: set[str] | None = None) -> int:
        clocks = [c for w, c in self._clock.items() if among is None or w in among]
        return min(clocks, default=0)

    def waiting_for(self, shard: Applier) -> str:
        slowest = self._slowest()
        behind = sorted(w for w, c in self._clock.items() if c == slowest)
        return (
            f"workers more than {self.staleness} pushes ahead of the slowest live workers {behind} "
            f"({slowest} pushes) wait for them"
        )


# The policy of each mode, keyed by ps.proto's Mode (paramserver.modes): a new mode is one entry here and one there.
POLICIES: dict[int, Callable[[ServerConfig], Policy]] = {
    ps_pb2.SYNC: lambda c: SyncPolicy(c.backup_workers),
    ps_pb2.ASYNC: lambda c: AsyncPolicy(c.max_staleness),
    ps_pb2.SSP: lambda c: SSPPolicy(c.staleness, c.max_staleness),
}
if set(POLICIES) != set(modes.BY_WIRE):
    raise ImportError("paramserver.shard.consistency: every mode of paramserver.modes needs exactly one policy")


def make_policy(config: ServerConfig) -> Policy:
    """Return the policy object for the job's mode."""
    return POLICIES[modes.mode_wire(config.mode)](config)
