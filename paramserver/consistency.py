"""Consistency policies: when a validated gradient becomes an update. One small class per mode.

A policy is called by the Shard under the shard's lock, with a gradient that has already passed every check, and
raises before touching anything when it refuses a push, so a refused push changes nothing.
"""

from __future__ import annotations

import time
from typing import Protocol

import torch

from paramserver.errors import StaleRound
from paramserver.membership import Membership


class Applier(Protocol):
    """What a policy sees of the shard."""

    version: int
    membership: Membership

    def apply(
        self,
        grad: torch.Tensor,
        *,
        straggler: str | None = None,
        waited: float | None = None,
        staleness: int | None = None,
    ) -> None:
        """Run one optimizer step with this flat gradient and bump the version (with what to record about it)."""


class Policy(Protocol):
    def reset(self, numel: int) -> None:
        """Forget any round in progress; the model now has `numel` elements."""

    def submit(self, shard: Applier, worker_id: str, base_version: int, grad: torch.Tensor) -> None:
        """Take one worker's gradient computed on `base_version`; apply now or later."""

    def membership_changed(self, shard: Applier) -> None:
        """React to a worker joining or leaving."""

    def waiting_for(self, shard: Applier) -> str:
        """Say in words what the next version waits for (for timeouts and logs)."""

    def in_progress(self) -> bool:
        """Whether a round has some but not all of its gradients."""

    def round_age(self) -> float:
        """Seconds the open round has waited so far."""


class SyncPolicy:
    """Bulk-synchronous: one in-place sum per round; the mean applies once every live worker has pushed.

    With `backup_workers` B, a round applies once all live workers but B have pushed; pushes for a closed round
    are refused. Memory is one gradient-sized buffer whatever the number of workers.
    """

    def __init__(self, backup_workers: int = 0) -> None:
        self.backup_workers = backup_workers
        self._sum: torch.Tensor | None = None
        self._contributors: set[str] = set()
        self._last: str | None = None  # the latest contributor: the round's straggler when it closes
        self._opened = 0.0  # when the round's first gradient arrived

    def reset(self, numel: int) -> None:
        self._sum = torch.empty(numel, dtype=torch.float32)
        self._contributors = set()

    def submit(self, shard: Applier, worker_id: str, base_version: int, grad: torch.Tensor) -> None:
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
        assert self._sum is not None, "reset() before submit()"
        if self._contributors:
            self._sum.add_(grad)
        else:
            self._sum.copy_(grad)
            self._opened = time.monotonic()
        self._contributors.add(worker_id)
        self._last = worker_id
        self._close_if_complete(shard)

    def membership_changed(self, shard: Applier) -> None:
        self._close_if_complete(shard)

    def waiting_for(self, shard: Applier) -> str:
        missing = sorted(shard.membership.live - self._contributors)
        have = len(self._contributors)
        if not shard.membership.ever_full:
            return (
                f"round {shard.version} has {have} gradient(s); the job has had only "
                f"{len(shard.membership.live)} of its {shard.membership.world_size} workers join"
            )
        return f"round {shard.version} has {have} gradient(s), waiting for workers {missing}"

    def in_progress(self) -> bool:
        return bool(self._contributors)

    def round_age(self) -> float:
        """Seconds since the open round's first gradient (0 when none is open)."""
        return time.monotonic() - self._opened if self._contributors else 0.0

    def _close_if_complete(self, shard: Applier) -> None:
        if not self._contributors:
            return
        if len(shard.membership.live - self._contributors) > self.backup_workers:
            return
        if (
            not shard.membership.ever_full
            and len(self._contributors) < shard.membership.world_size - self.backup_workers
        ):
            return
        assert self._sum is not None
        if len(self._contributors) > 1:  # the mean of one gradient is itself: spare a pass over the buffer
            self._sum.div_(len(self._contributors))
        self._contributors = set()
        shard.apply(self._sum, straggler=self._last, waited=time.monotonic() - self._opened)


class AsyncPolicy:
    """Asynchronous: every gradient applies on arrival, whatever version it was computed on."""

    def reset(self, numel: int) -> None:
        pass

    def in_progress(self) -> bool:
        return False

    def round_age(self) -> float:
        return 0.0

    def submit(self, shard: Applier, worker_id: str, base_version: int, grad: torch.Tensor) -> None:
        if base_version > shard.version:
            # Only a shard that restarted from an older checkpoint can be behind its workers: catch up first.
            raise StaleRound(
                f"push computed on version {base_version}, newer than the shard's {shard.version} (the shard "
                f"restarted from a checkpoint); pull and compute the gradient again"
            )
        shard.apply(grad, staleness=shard.version - base_version)

    def membership_changed(self, shard: Applier) -> None:
        pass

    def waiting_for(self, shard: Applier) -> str:
        return f"version {shard.version + 1} comes with the next push"


def make_policy(mode: str, backup_workers: int = 0) -> Policy:
    """Return the policy object for a mode name."""
    if mode == "sync":
        return SyncPolicy(backup_workers)
    if mode == "async":
        return AsyncPolicy()
    raise ValueError(f"unknown mode {mode!r}")
