"""What a pull or a lookup reads of a shard, once the version it asks for is there: pulls wait under the shard's
lock (a sync round not yet closed, an ssp worker too far ahead), then read one version's weights or rows.

Functions of the Shard, under its lock: the exchange handler calls them; the policy says when a worker may read."""

from __future__ import annotations

import contextlib
from collections.abc import Iterator, Sequence
from typing import TYPE_CHECKING

import numpy as np

from paramserver.errors import PullTimeout, ShuttingDown
from paramserver.shard.model import ShardModel
from paramserver.shard.sparse.row_blocks import RowBlock

if TYPE_CHECKING:
    from paramserver.shard.state import Shard


def same_history(shard: Shard, incarnation: str) -> bool:
    """Whether the versions a peer names under `incarnation` are this shard's: the same run of its process, or a
    durable shard's (a restart resumes with every version it told of). Another run of a shard without a log may
    have restarted from an older checkpoint: a version it told of may never come again."""
    return incarnation == shard.incarnation or shard.durable


def wanted(shard: Shard, min_version: int, incarnation: str) -> int:
    """The version a pull or lookup waits for: `min_version`, or 0 (the current weights) where it names another
    history's version (see `same_history`; a request naming no incarnation means this one)."""
    return 0 if incarnation and not same_history(shard, incarnation) else min_version


def wait_for(shard: Shard, min_version: int, timeout: float, worker_id: str = "") -> tuple[int, ShardModel]:
    """Wait until the shard reaches `min_version`; return (version, model)."""
    with shard.lock:
        return wait_locked(shard, min_version, timeout, worker_id)


@contextlib.contextmanager
def weights(
    shard: Shard, min_version: int, timeout: float, worker_id: str = ""
) -> Iterator[tuple[int, ShardModel, np.ndarray]]:
    """Wait like `wait_for`, then lend (version, model, the flat weights of that one version) to send.

    Where the policy says no update can apply before this worker pushes again (a live worker in sync mode
    without backup workers), the weights are lent in place. Any other pull (async, ssp, backup workers, a
    reader that did not join) gets a copy taken under the lock into a scratch buffer, so an update applied
    while it is sent cannot tear it.
    """
    version, model = wait_for(shard, min_version, timeout, worker_id)  # before taking a buffer pushes need
    with shard.lock:
        in_place = shard.policy.stable_for(shard, worker_id)
    if in_place:
        yield version, model, model.params.numpy()
        return
    with shard.scratch() as buf:
        with shard.lock:
            model = shard.require_model()
            version = shard.version  # at least min_version: versions only grow
            np.copyto(buf, model.params.numpy())
        yield version, model, buf


def lookup(
    shard: Shard, blocks: Sequence[RowBlock], min_version: int, timeout: float, worker_id: str = ""
) -> tuple[int, list[np.ndarray]]:
    """Wait like `wait_for`, then read the rows of each block's IDs, all of one version; return it and them."""
    with shard.lock:
        version, model = wait_locked(shard, min_version, timeout, worker_id)
        return version, model.tables.lookup(blocks)


def pull_into(shard: Shard, dst: np.ndarray, min_version: int, timeout: float, worker_id: str = "") -> int:
    """Wait like `wait_for`, then copy the weights into `dst` under the lock (one consistent version)."""
    with shard.lock:
        version, model = wait_locked(shard, min_version, timeout, worker_id)
        np.copyto(dst, model.params.numpy())
        return version


def wait_locked(shard: Shard, min_version: int, timeout: float, worker_id: str) -> tuple[int, ShardModel]:
    """`wait_for`, with the shard's lock held."""
    shard.check_serving()
    if worker_id:
        shard.membership.get(worker_id)
    shard.require_model()

    # A worker's pull also waits while the policy holds it back (ssp: too far ahead of the slowest worker).
    def ready() -> bool:
        return shard.version >= min_version and (not worker_id or shard.policy.may_pull(shard, worker_id))

    reached = shard.lock.wait_for(lambda: shard.closed or ready(), timeout=timeout)
    if shard.closed:
        raise ShuttingDown(f"shard {shard.index} is shutting down")
    if not reached:
        if shard.version >= min_version:
            raise PullTimeout(
                f"shard {shard.index} held worker {worker_id}'s pull for {timeout:.1f} s: "
                f"{shard.policy.waiting_for(shard)}"
            )
        raise PullTimeout(
            f"shard {shard.index} is at version {shard.version}, not {min_version}, after "
            f"{timeout:.1f} s: {shard.policy.waiting_for(shard)}"
        )
    return shard.version, shard.require_model()
