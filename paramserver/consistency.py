"""Consistency policies: when a validated gradient becomes an update. One small class per mode.

A policy is called by the Shard under the shard's lock, with a gradient that has already passed every check, and
raises before touching anything when it refuses a push, so a refused push changes nothing.
"""

from __future__ import annotations

from typing import Protocol

import torch

from paramserver.errors import InvalidArgument, StaleRound
from paramserver.membership import Membership


class Applier(Protocol):
    """What a policy sees of the shard."""

    version: int
    membership: Membership

    def apply(self, grad: torch.Tensor) -> None:
        """Run one optimizer step with this flat gradient and bump the version."""


class Policy(Protocol):
    def reset(self, numel: int) -> None:
        """Forget any round in progress; the model now has `numel` elements."""

    def submit(self, shard: Applier, worker_id: str, base_version: int, grad: torch.Tensor) -> None:
        """Take one worker's gradient computed on `base_version`; apply now or later."""

    def membership_changed(self, shard: Applier) -> None:
        """React to a worker joining or leaving."""

    def waiting_for(self, shard: Applier) -> str:
        """Say in words what the next version waits for (for timeouts and logs)."""


class SyncPolicy:
    """Bulk-synchronous: one in-place sum per round; the mean applies once every live worker has pushed.

    Memory is one gradient-sized buffer whatever the number of workers.
    """

    def __init__(self) -> None:
        self._sum: torch.Tensor | None = None
        self._contributors: set[str] = set()

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
        self._contributors.add(worker_id)
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

    def _close_if_complete(self, shard: Applier) -> None:
        if not self._contributors or not shard.membership.live <= self._contributors:
            return
        if not shard.membership.ever_full and len(self._contributors) < shard.membership.world_size:
            return
        assert self._sum is not None
        self._sum.div_(len(self._contributors))
        self._contributors = set()
        shard.apply(self._sum)


class AsyncPolicy:
    """Asynchronous: every gradient applies on arrival, whatever version it was computed on."""

    def reset(self, numel: int) -> None:
        pass

    def submit(self, shard: Applier, worker_id: str, base_version: int, grad: torch.Tensor) -> None:
        if base_version > shard.version:
            raise InvalidArgument(
                f"push computed on version {base_version}, newer than the shard's "
                f"{shard.version}: it cannot come from this shard"
            )
        shard.apply(grad)

    def membership_changed(self, shard: Applier) -> None:
        pass

    def waiting_for(self, shard: Applier) -> str:
        return f"version {shard.version + 1} comes with the next push"


def make_policy(mode: str) -> Policy:
    """Return the policy object for a mode name."""
    policies: dict[str, type[SyncPolicy] | type[AsyncPolicy]] = {"sync": SyncPolicy, "async": AsyncPolicy}
    return policies[mode]()
