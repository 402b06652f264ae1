"""Catching up after a step's exchange failed by the job's progress, not by a fault: the one function that ps-worker's
steps and PSOptimizer (the loops that others own: Lightning, deepctr-torch's fit, a plain loop) both call.

- The push was refused (Aborted: its round closed without it, this worker was evicted, a shard restarted): the
  step's gradient is dropped, the weights of the round that closed are pulled, and training goes on. (An evicted
  worker joins again inside the client, ShardLink.retry, before its push is retried; what reaches here is a push
  that still could not count.)
- The push was taken but its round stays open (PullTimeout: in sync mode, workers yet to join or to push): the pull
  is made again, each time logged, until `round_timeout` seconds have passed.
"""

from __future__ import annotations

import logging
import time
from collections.abc import Callable

from paramserver.errors import Aborted, PullTimeout
from worker.client import PSClient, Tensors

log = logging.getLogger(__name__)

__all__ = ["ROUND_TIMEOUT", "exchange", "pull_once_closed"]

ROUND_TIMEOUT = 600.0  # PSOptimizer's default: how long a step waits for its round, as ps-worker --round-timeout


def pull_once_closed(
    client: PSClient, model: Tensors, began: float, limit: float, timed_out: PullTimeout | None = None
) -> None:
    """Pull the weights of the round this step's push went into, however long it stays open (a sync round waits
    for every worker to have joined, and for each live one to push; a dead one is evicted when its lease runs
    out): each pull the servers time out is logged and made again, until `limit` seconds after `began`."""
    while True:
        if timed_out is not None:
            waited = time.monotonic() - began
            if waited >= limit:
                raise PullTimeout(f"gave up on a round after {waited:.1f} s (--round-timeout {limit:g}): {timed_out}")
            log.warning("still waiting for the round to close after %.1f s: %s", waited, timed_out)
        try:
            client.pull(model)
            return
        except PullTimeout as exc:
            timed_out = exc


def exchange(
    client: PSClient, target: Tensors, round_timeout: float, backward: Callable[[], object] | None = None
) -> bool:
    """Push the gradient held by `target` and pull the weights that include it into `target`, catching up when the
    push was refused or its round stays open; return whether it was refused (a stale push). `backward`: what makes
    the gradient, run while the push goes (PSClient.push_pull)."""
    began = time.monotonic()
    try:
        client.push_pull(target, backward=backward)
    except Aborted as exc:
        # The round closed without us (too slow, evicted, or a shard restarted): catch up, go on.
        log.debug("push refused: %s", exc)
        pull_once_closed(client, target, began, round_timeout)
        return True
    except PullTimeout as exc:
        pull_once_closed(client, target, began, round_timeout, exc)
    return False
