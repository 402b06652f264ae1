"""One `ShardLink` per shard: everything a worker knows about one shard and how it reaches it.

A link owns its channel, its transport (attached shared memory or data socket, else gRPC), the versions it has
seen, and the recovery from a shard that restarted, evicted the worker or forgot the model. `PSClient` fans an
operation out to its links and never asks which transport one uses.
"""

from __future__ import annotations

import functools
import logging
import secrets
import ssl
import time
from collections.abc import Callable
from concurrent import futures
from dataclasses import dataclass, field
from typing import Any, TypeVar

import grpc
import numpy as np

from paramserver.errors import (
    AlreadyInitialized,
    DataSocketUnavailable,
    InitInProgress,
    ModelMismatch,
    NotAttached,
    NotInitialized,
    PSError,
    PullTimeout,
    SharedMemoryUnavailable,
    UnknownWorker,
    from_rpc_error,
)
from paramserver.tables import spec_to_proto
from paramserver.transport import shm
from paramserver.transport.socket_client import FrameClient, split_host
from paramserver.v1 import ps_pb2
from paramserver.wire.specs import specs_to_proto
from worker.client.binding import Binding
from worker.client.compress import Compressor
from worker.client.feed import GradientFeed
from worker.client.rows import SparseJob, given_rows
from worker.client.transports import Answer, DataSocket, Grpc, Job, SharedMemory, Transport
from worker.client.turns import Turns

log = logging.getLogger(__name__)

T = TypeVar("T")

# How soon a worker asks again while another worker's Init of a shard runs: soon at first (a small model's Init
# takes milliseconds, and the round of a sync job waits for the last worker), then less often, down to the cap.
INIT_POLL_FIRST_S = 0.005
INIT_POLL_S = 0.1
CONNECT_S = 5.0  # how long connecting to a data socket (or one try at the first shard) may take
# How long a worker that settled for gRPC with a shard (no data socket served or reached) keeps to it before it
# tries again, doubling after each try that fails, up to the cap: a shard restarted at the wrong moment, or a port
# opened late, costs a while at gRPC speed, not the whole run, and a port whose packets are dropped stalls a step
# for CONNECT_S ever more rarely.
RETRY_LINK_S = 30.0
RETRY_LINK_MAX_S = 900.0
# How long a worker waits at most between tries while it looks for a replicated shard's primary (the other copy
# takes over within --replica-timeout, half a second by default).
COPY_RETRY_MAX_S = 0.2


@dataclass
class Session:
    """What every link of one PSClient shares: who the worker is and how it wants to talk."""

    worker_id: str
    job_name: str
    timeout: float
    dtype: Any  # a ps_pb2.DType value: the element type on the network
    chunk_bytes: int
    shared_memory: bool
    data_socket: bool
    push_in_turn: bool | None
    tls: ssl.SSLContext | None
    tls_server_name: str | None
    joined: bool = False
    idle: bool = False  # nothing to train for now (ps-worker --follow, caught up): said in every heartbeat
    registered: Binding | None = None  # the model to re-initialise a shard with that lost it
    compressor: Compressor | None = None  # compresses pushes on the data socket (PSClient's `compress`)
    # Set by PSClient.close: a call still in flight on another thread then ends at its first failure instead of
    # retrying, joining again or re-initialising (a server that later takes the port would otherwise see it).
    closed: bool = False


@dataclass
class Fallback:
    """A shard this worker exchanges tensors with over gRPC for now: when it tries shared memory and the data
    socket again, how long it waits after that try should it fail too, and why it fell back, as the user was told
    (once per cause, not at every try)."""

    until: float = 0.0
    wait: float = field(default_factory=lambda: RETRY_LINK_S)  # read when a shard falls back, not at import
    told: str = ""


class ShardLink:
    """A worker's link to one shard.

    Public, read-only: `address` (with replicas, of the copy it talks to now); `copies`, every copy's address
    (one without replicas); `transport`, the path the next exchange takes (`transport.kind` is "shared
    memory", "data socket" or "gRPC"); `fallback`, set while the shard is on gRPC for want of a faster path;
    `shared_memory_refused`, once the shard said it cannot share memory with this worker; `version` and
    `incarnation`, what the last pull returned.
    """

    def __init__(
        self,
        index: int,
        address: str,
        channel: grpc.Channel,
        session: Session,
        pool: futures.ThreadPoolExecutor,
        copies: tuple[str, ...] = (),
        connect: Callable[[str], grpc.Channel] | None = None,
    ) -> None:
        self.index = index
        self.address = address
        self.copies = copies or (address,)
        self._connect = connect
        self._channel = channel
        self._session = session
        self._pool = pool
        self.rpc = Grpc(channel, address, pool, session.chunk_bytes)
        self._attached: Transport | None = None
        self._attached_digest = ""
        self.shared_memory_refused = False
        self.fallback: Fallback | None = None
        self.version = 0  # what the last pull returned
        self.incarnation = ""  # which run of the shard that version belongs to
        self._min_next = 0  # the version a pull must wait for after a push

    @property
    def transport(self) -> Transport:
        """The transport of the next exchange (before any attaching it may do)."""
        attached = self._attached
        return attached if attached is not None and not attached.closed else self.rpc

    # -- membership --------------------------------------------------------------------------------------------

    def join(self) -> ps_pb2.JoinResponse:
        """Join the job on this shard."""
        req = ps_pb2.JoinRequest(worker_id=self._session.worker_id, job_name=self._session.job_name)
        return self.call(lambda: self.rpc.stub.Join(req, timeout=self._session.timeout))

    def rejoin(self) -> None:
        """Join again after the shard evicted or forgot this worker; its versions start afresh."""
        req = ps_pb2.JoinRequest(worker_id=self._session.worker_id, job_name=self._session.job_name)
        self.call(lambda: self.rpc.stub.Join(req, timeout=self._session.timeout))
        self._min_next = 0
        if self.fallback is not None:  # a restarted shard may serve now what it did not: try at once
            self.fallback.until, self.fallback.wait = 0.0, RETRY_LINK_S
        log.warning(
            "worker %s re-joined shard %s (it had been evicted or the shard restarted)",
            self._session.worker_id[:8],
            self.address,
        )

    def heartbeat(self, timeout: float) -> None:
        """Renew this worker's lease (UnknownWorker once the shard evicted it)."""
        req = ps_pb2.HeartbeatRequest(worker_id=self._session.worker_id, idle=self._session.idle)
        self.call(lambda: self.rpc.stub.Heartbeat(req, timeout=timeout))

    def leave(self, finished: bool) -> None:
        """Leave the job on this shard."""
        req = ps_pb2.LeaveRequest(worker_id=self._session.worker_id, finished=finished)
        self.call(lambda: self.rpc.stub.Leave(req, timeout=10.0))

    # -- the model ---------------------------------------------------------------------------------------------

    def init(self, b: Binding) -> None:
        """Send this shard its pieces of the bound model's current weights, unless it already holds the model."""
        topo = self.call(lambda: self.rpc.stub.GetTopology(ps_pb2.GetTopologyRequest(), timeout=self._session.timeout))
        if topo.initialized:
            if topo.model_digest != b.digest:
                raise ModelMismatch(
                    f"shard {self.address} holds another model (digest {topo.model_digest[:12]}, yours "
                    f"{b.digest[:12]}): different tensor names or shapes; restart the servers to train a new model"
                )
            return
        k = self.index
        header = ps_pb2.InitHeader(
            worker_id=self._session.worker_id,
            specs=specs_to_proto(b.placement.specs),
            num_shards=b.placement.num_shards,
            model_digest=b.digest,
            dtype=ps_pb2.FLOAT32,
            tables=[spec_to_proto(t) for t in b.placement.tables],
        )
        try:
            n, timeout = b.placement.num_shards, self._session.timeout
            self.call(lambda: self.rpc.init(header, b.views(k, b.weights_now()), timeout, given_rows(b, k, n)))
        except AlreadyInitialized:
            pass  # another worker won the race with the same model: adopt it

    # -- exchanges ---------------------------------------------------------------------------------------------

    def begin(
        self,
        b: Binding,
        grads: list[np.ndarray] | None,
        step: int,
        flats: list[np.ndarray] | None,
        turns: Turns,
        sparse: SparseJob | None = None,
        feed: GradientFeed | None = None,
    ) -> Callable[[], int]:
        """Begin this shard's part of an exchange (with `sparse`: rows pushed with the gradient, rows looked up;
        with `feed` and no `grads`: the gradient as backward makes it, on the feed's threads); return what waits
        for it and returns the shard's version (of the weights pulled, else of the rows looked up, else after the
        push)."""
        try:
            transport = self._transport_for(b)
        except BaseException:
            turns.done(self.index)
            raise
        s = self._session
        base, pushed, pulled = self.version, grads is not None or feed is not None, flats is not None
        request = ps_pb2.ExchangeRequest(
            worker_id=s.worker_id if s.joined else "",
            model_digest=b.digest,
            push=pushed,
            step=step,
            base_version=base,
            pull=pulled,
            min_version=base + 1 if pushed else self._min_next,
            incarnation=self.incarnation,
            dtype=s.dtype,
        )
        job = Job(request, b, self.index, self.address, grads, flats, turns, s.timeout, sparse, feed=feed)
        if grads is not None and s.compressor is not None:
            compressor, k = s.compressor, self.index
            if transport.compresses:
                job.compress = lambda views: compressor.encode(b, k, views, step, s.dtype)
            else:  # a retry that fell back from the data socket: the push goes whole, the remainder as it was
                compressor.whole(b, k, b.views(k, grads) if grads is not None else [], step)
        answer: Answer = transport.begin(job) if feed is None else feed.submit(transport.exchange_as_ready, job).result

        def finish() -> int:
            reply = answer()
            if pushed:
                # A push taken now is in version base + 1 or later; a retry of one taken before, in the version
                # the shard names.
                self._min_next = base + 1 if reply.applied else int(reply.version)
            if not pulled:
                return int(reply.version if pushed else reply.rows_version)
            # (The transport checked reply.pulled's model before it wrote the weights: Job.check.)
            if reply.pulled.incarnation != self.incarnation:
                self.incarnation = reply.pulled.incarnation
                self._min_next = 0
            self.version = int(reply.pulled.version)
            return self.version

        return finish

    def pushed_without_answer(self, base: int) -> None:
        """A push was taken but its pull timed out: the next pull must wait for that round too, not hand back the
        weights the push was made on."""
        self._min_next = max(self._min_next, base + 1)

    # -- attaching ---------------------------------------------------------------------------------------------

    def _transport_for(self, b: Binding) -> Transport:
        """The transport for this model, attaching shared memory or the data socket first where possible."""
        if not self._session.joined:
            return self.rpc  # an attachment belongs to a joined worker: a reader that did not join uses gRPC
        if self.fallback is not None and self.fallback.until > time.monotonic():
            return self.rpc
        attached = self._attached
        if attached is not None and not attached.closed and self._attached_digest == b.digest:
            return attached
        self.drop()
        found: Transport | None = None
        if self._session.shared_memory and not self.shared_memory_refused:
            found = self._attach_segment(b)
        if found is None and self._session.data_socket:
            found = self._attach_socket(b)
        if found is None:
            fallback = self._fall_back()
            fallback.until = time.monotonic() + fallback.wait
            fallback.wait = min(2 * fallback.wait, RETRY_LINK_MAX_S)
            return self.rpc
        self._attached, self._attached_digest = found, b.digest
        was, self.fallback = self.fallback, None
        if was is not None and was.told:
            log.info("shard %s: %s attached: leaving gRPC", self.address, found.kind)
        return found

    def _fall_back(self) -> Fallback:
        """This shard's fallback state, made on its first fallback."""
        if self.fallback is None:
            self.fallback = Fallback()
        return self.fallback

    def _attach(self, req: ps_pb2.AttachRequest) -> ps_pb2.AttachResponse:
        return self.retry(lambda: self.rpc.stub.Attach(req, timeout=self._session.timeout))

    def _attach_segment(self, b: Binding) -> SharedMemory | None:
        """Offer the shard a shared-memory segment for this model; None if it cannot use one."""
        segment = shm.Segment.create(b.elements[self.index])
        req = ps_pb2.AttachRequest(
            worker_id=self._session.worker_id,
            shared_memory=ps_pb2.SharedMemory(name=segment.name),
            nonce=segment.nonce,
            elements=segment.elements,
            model_digest=b.digest,
        )
        try:
            reply = self._attach(req)
        except SharedMemoryUnavailable as exc:
            log.info("shard %s cannot share memory with this worker (%s)", self.address, exc)
            self.shared_memory_refused = True
            segment.close()
            return None
        except BaseException:
            segment.close()
            raise
        bell = None
        if reply.doorbell:
            try:
                bell = FrameClient(reply.doorbell, req, self.address, timeout=self._session.timeout)
            except (OSError, ConnectionError, PSError) as exc:  # e.g. another network namespace: gRPC it is
                log.info("shard %s: no doorbell (%s); Exchanges go by gRPC", self.address, exc)
        return SharedMemory(segment, bell, self.rpc, self.address)

    def _attach_socket(self, b: Binding) -> DataSocket | None:
        """Ask the shard for its data socket and connect; None if it serves none or it cannot be reached."""
        s = self._session
        req = ps_pb2.AttachRequest(
            worker_id=s.worker_id,
            nonce=secrets.token_bytes(shm.NONCE_BYTES),
            elements=b.elements[self.index],
            model_digest=b.digest,
            data_socket=ps_pb2.DataSocket(),
        )
        try:
            reply = self._attach(req)
        except (DataSocketUnavailable, SharedMemoryUnavailable) as exc:  # the latter: a shard that predates it
            fallback = self._fall_back()
            level = logging.DEBUG if fallback.told == "none" else logging.INFO
            fallback.told = "none"
            log.log(level, "shard %s offers no data socket (%s): using gRPC", self.address, exc)
            return None
        where = (split_host(self.address), int(reply.data_port))
        try:
            bell = FrameClient(
                where,
                req,
                self.address,
                min(s.timeout, CONNECT_S),
                s.tls,
                s.tls_server_name,
                fast_keepalive=len(self.copies) > 1,
            )
        except (OSError, ConnectionError, PSError) as exc:
            fallback = self._fall_back()
            if fallback.told != "unreachable":
                fallback.told = "unreachable"
                log.warning(
                    "shard %s: its data socket at %s:%d cannot be reached (%s); using gRPC (slower) and trying "
                    "again from time to time: open that port where the gRPC port is open",
                    self.address,
                    *where,
                    exc,
                )
            else:
                log.debug("shard %s: data socket at %s:%d still unreachable (%s)", self.address, *where, exc)
            return None
        return DataSocket(bell, self._pool, self.address, s.push_in_turn)

    def other_copy(self) -> bool:
        """Talk to the shard's next copy from now on (the one this link talked to did not answer, or is not the
        primary); False where the shard has one copy."""
        if len(self.copies) < 2 or self._connect is None:
            return False
        at = self.copies.index(self.address) if self.address in self.copies else -1
        self.drop()
        self._channel.close()
        self.address = self.copies[(at + 1) % len(self.copies)]
        self._channel = self._connect(self.address)
        self.rpc = Grpc(self._channel, self.address, self._pool, self._session.chunk_bytes)
        self.shared_memory_refused = False
        self.fallback = None
        return True

    def drop(self) -> None:
        """Forget the attached transport (unmapping its segment, closing its connection); the next exchange
        attaches anew."""
        attached, self._attached = self._attached, None
        if attached is not None:
            attached.close()

    # -- calls and recovery ------------------------------------------------------------------------------------

    def call(self, fn: Callable[[], T]) -> T:
        """Run fn, turning a gRPC error into the PSError it names."""
        try:
            return fn()
        except grpc.RpcError as err:
            raise from_rpc_error(err, self.address) from None

    def retry(self, fn: Callable[[], T], rejoin: bool = True, failed: PSError | None = None) -> T:
        """Run fn against this shard: retry UNAVAILABLE with backoff (a shard restarting) until the timeout, and
        (once each) join again, re-initialise or re-attach when the shard forgot this worker, the model or the
        attachment. `failed`: fn already failed so once. Retrying a push is safe: the shard applies a (worker,
        step) once."""
        s = self._session
        deadline = time.monotonic() + s.timeout
        delay, init_delay, recovered = 0.05, INIT_POLL_FIRST_S, set[type[PSError]]()
        while True:
            if failed is None:
                try:
                    return self.call(fn)
                except PSError as err:
                    failed = err
            exc, failed = failed, None
            if s.closed:
                raise exc
            if isinstance(exc, InitInProgress) and time.monotonic() + init_delay < deadline:
                # Not a fault: another worker is registering the same model; it is held once that ends.
                log.debug("shard %s is being initialised by another worker; asking again", self.address)
                time.sleep(init_delay)
                init_delay = min(2 * init_delay, INIT_POLL_S)
            elif (exc.code == grpc.StatusCode.UNAVAILABLE or self._silent(exc)) and time.monotonic() + delay < deadline:
                was = self.address
                if self.other_copy():
                    log.info("shard %d: copy %s unavailable (%s); trying copy %s", self.index, was, exc, self.address)
                    time.sleep(min(delay, COPY_RETRY_MAX_S))
                    delay = min(2 * delay, COPY_RETRY_MAX_S)
                    continue
                log.info("shard %s unavailable (%s); retrying in %.2f s", self.address, exc, delay)
                time.sleep(delay)
                delay = min(2 * delay, 2.0)
            elif isinstance(exc, UnknownWorker) and rejoin and s.joined and UnknownWorker not in recovered:
                recovered.add(UnknownWorker)
                self.rejoin()
            elif isinstance(exc, NotInitialized) and s.registered is not None and NotInitialized not in recovered:
                recovered.add(NotInitialized)
                # The shard restarted with no checkpoint: give it this worker's current weights again.
                log.warning(
                    "shard %s lost the model (restarted without a checkpoint); re-initialising it", self.address
                )
                self.retry(functools.partial(self.init, s.registered), rejoin)  # another worker may re-init it too
                self._min_next = 0
            elif isinstance(exc, NotAttached) and NotAttached not in recovered:
                recovered.add(NotAttached)  # the shard restarted or evicted us: the next try attaches anew
                self.drop()
            else:
                raise exc

    def _silent(self, exc: PSError) -> bool:
        """Whether a replicated shard's copy let a call's deadline run out without a word (cut off, or stopped):
        then the other copy may have taken over, and is tried like one that is UNAVAILABLE. A deadline the shard
        named itself (a pull waiting for its round) is not silence."""
        return len(self.copies) > 1 and isinstance(exc, PullTimeout) and not exc.named_by_server

    def close(self) -> None:
        """Drop the attachment and close the channel."""
        self.drop()
        self._channel.close()
