"""Bounds on a shard's server-side gRPC streams (Pull, ExportRows), so that no reader, however slow or stalled,
starves GetTopology, Heartbeat or an exchange of the server's threads.

A gRPC sync server runs each streaming call on a thread of its pool, and that thread waits while a message it
yielded is still unsent, which it stays while the client does not read (HTTP/2 flow control). So:

- at most `total` streams at once (well below the pool's threads) and `per_peer` from one host; past either the
  call is RESOURCE_EXHAUSTED (TooLarge) before it takes anything;
- each message must be taken by the reader within STALL_FLOOR_S plus its bytes at MIN_BYTES_PER_S (the data
  socket's deadlines, paramserver/transport/socket_server.py); a watchdog thread cancels a stream that overruns,
  which frees its thread, its slot and what it held (a Pull's lent weights, an export's share of its snapshot).

A stream's wait for its version before its first message (a sync Pull) is the pull's own deadline, not a stall.

A Pull stream whose weights cannot be lent in place sends a copy taken under the shard's lock, shared by every Pull
stream of that version (`WeightCopies`), not one of the push scratch buffers (--max-concurrent-pushes, 2 by default):
readers that stall must not hold what pushes need.
"""

from __future__ import annotations

import contextlib
import logging
import threading
import time
from collections.abc import Iterable, Iterator
from typing import TYPE_CHECKING

import grpc
import numpy as np

from paramserver.errors import TooLarge
from paramserver.server import reads
from paramserver.server.exchange import LentWeights

if TYPE_CHECKING:
    from paramserver.shard.model import ShardModel
    from paramserver.shard.state import Shard

log = logging.getLogger(__name__)

STALL_FLOOR_S = 10.0  # seconds any one message may take to be read, plus its bytes at MIN_BYTES_PER_S
MIN_BYTES_PER_S = 1 << 20


def caps(workers: int) -> tuple[int, int]:
    """(total, per peer host) streams for a job of `workers`, whose gRPC pool has max(16, 4 x workers + 8)
    threads (paramserver.server.shard_server): a Pull and an export per worker fit, half the pool stays free."""
    return 2 * workers + 4, workers + 2


def peer_host(peer: str) -> str:
    """The host part of grpc's peer string ("ipv4:127.0.0.1:5000", "ipv6:[::1]:5000", "unix:/path")."""
    kind, _, rest = peer.partition(":")
    if kind in ("ipv4", "ipv6"):
        return rest.rsplit(":", 1)[0]
    return peer


class Stream:
    """One admitted stream: its messages timed by the gate's watchdog while they wait for the reader."""

    def __init__(self, gate: StreamGate, context: grpc.ServicerContext, rpc: str, host: str) -> None:
        self._gate = gate
        self.context = context
        self.rpc = rpc
        self.host = host
        self.due: float | None = None  # when the message in flight must have been taken (None: none in flight)
        self.closed = False

    def sent(self, messages: Iterable[bytes]) -> Iterator[bytes]:
        """The messages, each given a deadline from when it is handed to gRPC until the next is asked for."""
        for message in messages:
            self.due = time.monotonic() + STALL_FLOOR_S + len(message) / MIN_BYTES_PER_S
            self._gate.watch()
            yield message
            self.due = None

    def close(self) -> None:
        self._gate.release(self)


class StreamGate:
    """The shard's open server streams, capped in total and per peer host, and their watchdog."""

    def __init__(self, total: int, per_peer: int) -> None:
        self.total = total
        self.per_peer = per_peer
        self._lock = threading.Lock()
        self._open: set[Stream] = set()
        self._watching = False  # whether the watchdog thread runs (it ends once no stream is open)
        self.weights = WeightCopies()  # what Pull streams send
        self.cancelled = 0  # streams the watchdog ended (tests, logs)

    @contextlib.contextmanager
    def open(self, context: grpc.ServicerContext, rpc: str) -> Iterator[Stream]:
        """Admit a stream (TooLarge past a cap), closed when the block ends or the call does."""
        host = peer_host(context.peer() or "")
        with self._lock:
            mine = sum(1 for s in self._open if s.host == host)
            if len(self._open) >= self.total or mine >= self.per_peer:
                raise TooLarge(
                    f"{rpc}: this shard already serves {len(self._open)} streams ({mine} to {host}), its limit is "
                    f"{self.total} in all and {self.per_peer} per host: finish or cancel a stream, then retry"
                )
            stream = Stream(self, context, rpc, host)
            self._open.add(stream)
        context.add_callback(stream.close)  # however the call ends, also when gRPC never resumes the stream
        try:
            yield stream
        finally:
            stream.close()

    def release(self, stream: Stream) -> None:
        with self._lock:
            stream.closed = True
            self._open.discard(stream)

    @property
    def streams(self) -> int:
        with self._lock:
            return len(self._open)

    def watch(self) -> None:
        """Have the watchdog running (it stops by itself once no stream is open)."""
        with self._lock:
            if not self._watching:
                self._watching = True
                threading.Thread(target=self._watch, name="stream-watchdog", daemon=True).start()

    def _watch(self) -> None:
        while True:
            with self._lock:
                if not self._open:
                    self._watching = False
                    return
                now = time.monotonic()
                late = [s for s in self._open if s.due is not None and s.due < now]
                for s in late:
                    self._open.discard(s)
                    s.closed = True
                step = min(1.0, STALL_FLOOR_S / 4)
            for s in late:
                self.cancelled += 1
                log.warning(
                    "%s to %s: the reader took none of the stream's message in time; the stream is cancelled",
                    s.rpc,
                    s.host,
                )
                s.context.cancel()
            time.sleep(step)


class WeightCopies:
    """Copies of a shard's weights, one per (model, version), shared by the Pull streams sending that version."""

    def __init__(self) -> None:
        self._lock = threading.Lock()
        self._copies: dict[tuple[str, int], tuple[np.ndarray, list[int]]] = {}

    @property
    def copies(self) -> int:
        with self._lock:
            return len(self._copies)

    @contextlib.contextmanager
    def lend(
        self, shard: Shard, min_version: int, timeout: float, worker_id: str
    ) -> Iterator[tuple[int, ShardModel, np.ndarray]]:
        """As reads.weights: wait for the version, then lend the weights in place where the policy allows, else a
        copy of one version, shared."""
        version, model = reads.wait_for(shard, min_version, timeout, worker_id)
        with shard.lock:
            if shard.policy.stable_for(shard, worker_id):
                flat, key = model.params.numpy(), None
            else:
                model = shard.require_model()
                version = shard.version  # at least min_version: versions only grow
                key = (model.digest, version)
                with self._lock:
                    if key not in self._copies:
                        self._copies[key] = (model.params.numpy().copy(), [0])
                    flat, readers = self._copies[key]
                    readers[0] += 1
        try:
            yield version, model, flat
        finally:
            if key is not None:
                with self._lock:
                    readers[0] -= 1
                    if not readers[0]:
                        self._copies.pop(key, None)


class SharedWeights(LentWeights):
    """A Pull stream's weights: lent in place, or a copy shared with the other Pull streams of that version."""

    def __init__(self, dtype: int, copies: WeightCopies) -> None:
        super().__init__(dtype)
        self._copies = copies

    def pull(
        self, shard: Shard, min_version: int, timeout: float, worker_id: str, reply: object
    ) -> tuple[int, ShardModel]:
        version, self._model, self._flat = self._lent.enter_context(
            self._copies.lend(shard, min_version, timeout, worker_id)
        )
        return version, self._model
