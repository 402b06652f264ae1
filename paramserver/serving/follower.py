"""A serving copy following its shard: one thread per shard asks the shard's primary for what changed since the
version it holds (the Follow RPC, a long poll that answers as soon as a newer version shows) and applies it.

It never acknowledges anything, so training never waits for it. Where the shard stops answering it tries the
shard's other copies (--replicas 2: the new primary after a failover) and keeps serving what it holds meanwhile;
where the shard restarted without a log (its history is another), it takes a full state again.
"""

from __future__ import annotations

import logging
import threading
import time
from collections.abc import Callable, Sequence

import grpc

from paramserver.serving.copy import ShardCopy
from paramserver.v1 import ps_pb2, ps_pb2_grpc

log = logging.getLogger(__name__)

POLL_MS = 1000  # how long one Follow waits for a newer version before it answers "nothing new"
INTERVAL_S = 0.1  # the least time between two answers: changes coalesce over it (a row written often goes once)


class Follower:
    """Keep `copy` following shard `copy.index`, whose copies answer at `addresses` (the first that serves)."""

    def __init__(
        self,
        copy: ShardCopy,
        addresses: Sequence[str],
        channel: Callable[[str], grpc.Channel],
        interval: float = INTERVAL_S,
    ) -> None:
        self.copy = copy
        self.addresses = list(addresses)
        self._channel = channel
        self.interval = interval
        self._at = 0
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, name=f"follow-shard-{copy.index}", daemon=True)
        self.error = ""  # why the last Follow failed ("" while it follows)

    def start(self) -> None:
        self._thread.start()

    def stop(self, wait: bool = True) -> None:
        """Stop following (`wait`: until the thread ended, at most one long poll and a little more)."""
        self._stop.set()
        if wait and self._thread.is_alive():
            self._thread.join(timeout=POLL_MS / 1000 + 5)

    def _run(self) -> None:
        backoff = 0.05
        while not self._stop.is_set():
            address = self.addresses[self._at % len(self.addresses)]
            channel = self._channel(address)
            try:
                stub = ps_pb2_grpc.ParameterServerStub(channel)
                while not self._stop.is_set():
                    began = time.monotonic()
                    self._follow_once(stub)
                    backoff = 0.05
                    if not self.copy.position()[4]:  # a copy catching up asks again at once
                        self._stop.wait(max(0.0, self.interval - (time.monotonic() - began)))
            except grpc.RpcError as err:
                code = err.code() if hasattr(err, "code") else grpc.StatusCode.UNKNOWN
                self.error = f"{address}: {code.name}: {err.details() if hasattr(err, 'details') else err}"
                if code in (grpc.StatusCode.UNAVAILABLE, grpc.StatusCode.DEADLINE_EXCEEDED):
                    self._at += 1  # a backup, a stopped shard: try the shard's next copy
                log.debug("shard %d: follow failed: %s", self.copy.index, self.error)
                self._stop.wait(backoff)
                backoff = min(backoff * 2, 1.0)
            except ValueError as exc:  # a stream that does not fit: take the whole state again
                log.warning("shard %d: %s; taking its whole state again", self.copy.index, exc)
                self.copy.start_over()
                self._stop.wait(backoff)
            finally:
                channel.close()

    def _follow_once(self, stub: ps_pb2_grpc.ParameterServerStub) -> None:
        c = self.copy
        digest, since, incarnation, full, catching_up = c.position()
        request = ps_pb2.FollowRequest(
            model_digest=digest,
            since_version=since,
            incarnation=incarnation,
            wait_ms=0 if catching_up else POLL_MS,
            full=full,
        )
        c.take(stub.Follow(request, timeout=POLL_MS / 1000 + 60))
        self.error = ""


def wait_until(condition: Callable[[], bool], timeout: float) -> bool:
    """Poll `condition` until it holds or `timeout` seconds pass."""
    deadline = time.monotonic() + timeout
    while not condition():
        if time.monotonic() > deadline:
            return False
        time.sleep(0.01)
    return True
