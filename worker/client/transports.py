"""The three ways a worker exchanges tensors with one shard, behind one interface.

- `SharedMemory`: a shard on this host. The gradient and the weights stay in a shared-memory segment; a small
  Exchange message (over the doorbell, a Unix socket, or gRPC) says what to do with them.
- `DataSocket`: a shard on another host that serves a data socket. The gradient goes out of the model's own
  memory and the weights land straight in it, raw bytes over TCP (optionally TLS).
- `Grpc`: always there, the path of last resort. One unary Exchange per step when the shard's part is small
  (inline), else a Push stream and a Pull stream of ~1 MiB chunks.

A transport knows nothing of versions, retries or fallbacks (`ShardLink` does): `begin` starts one shard's part
of an exchange and returns what waits for the shard's ExchangeResponse.
"""

from __future__ import annotations

import functools
from abc import ABC, abstractmethod
from collections.abc import Callable, Generator, Iterable, Iterator
from concurrent import futures
from dataclasses import dataclass

import grpc
import numpy as np

from paramserver.errors import MalformedStream, ModelMismatch, PSError, RemoteError
from paramserver.transport import shm
from paramserver.transport.socket_client import FrameClient
from paramserver.v1 import ps_pb2, ps_pb2_grpc
from paramserver.wire import codec
from paramserver.wire.chunks import CHUNK_BYTES, ChunkReceiver, itemsize, iter_chunks
from worker.client.binding import Binding
from worker.client.compress import Encoded
from worker.client.feed import GradientFeed
from worker.client.rows import SparseJob
from worker.client.turns import TURN_BELOW, Turns

# A shard's part of the model up to this many wire bytes goes inline in one unary Exchange per step (a small model
# on another host: one call, not two streams); larger parts are streamed in chunks.
INLINE_BYTES = CHUNK_BYTES

Answer = Callable[[], ps_pb2.ExchangeResponse]
_SERVICE = "/paramserver.v1.ParameterServer/"
# The shard whose part of an exchange runs in the caller's thread, the others' in pool threads: fan_out begins it
# last, so that theirs are under way while it runs.
CALLER_SHARD = 0


@dataclass
class Job:
    """One shard's part of one exchange, as a transport carries it."""

    request: ps_pb2.ExchangeRequest  # push/pull, step, versions, incarnation, digest, dtype: filled by the link
    binding: Binding
    shard: int
    address: str  # the shard's, for error messages
    grads: list[np.ndarray] | None  # the model's flat float32 gradients, when pushing
    flats: list[np.ndarray] | None  # the model's flat float32 weights to write into, when pulling
    turns: Turns
    timeout: float
    sparse: SparseJob | None = None  # rows pushed with the gradient, rows looked up
    # The push's part compressed (worker/client/compress.py), from its pieces' gradients: None where it goes whole.
    # Set for a transport that `compresses` (the data socket); elsewhere the part goes whole.
    compress: Callable[[list[np.ndarray]], Encoded | None] | None = None
    # The push's gradient as backward makes it (`grads` is None then): see Transport.exchange_as_ready.
    feed: GradientFeed | None = None

    @property
    def in_caller(self) -> bool:
        """Whether this part runs in the caller's thread (CALLER_SHARD's), not in a pool thread."""
        return self.shard == CALLER_SHARD

    @property
    def pushes(self) -> bool:
        """Whether the exchange pushes a gradient."""
        return self.grads is not None or self.feed is not None

    @property
    def shards(self) -> int:
        """How many shards the exchange spans."""
        return self.binding.placement.num_shards

    @property
    def dense(self) -> bool:
        """Whether the exchange pushes or pulls the dense part (else it only looks rows up)."""
        return self.pushes or self.flats is not None

    @property
    def small(self) -> bool:
        """Whether this shard's part (and the rows) fits one message (INLINE_BYTES) in the request's dtype."""
        dense = self.binding.elements[self.shard] * itemsize(self.request.dtype) if self.dense else 0
        return dense + (self.sparse.nbytes if self.sparse is not None else 0) <= INLINE_BYTES

    def check(self, header: ps_pb2.PullHeader) -> None:
        """Refuse pulled weights of another model, before they are written (every transport calls this)."""
        if header.model_digest != self.binding.digest:
            raise ModelMismatch(
                f"shard {self.address} holds another model than the one being pulled "
                f"into ({header.model_digest[:12]} vs {self.binding.digest[:12]})"
            )


class Transport(ABC):
    """One shard's tensor path. `kind` names it for people: "shared memory", "data socket" or "gRPC".
    `compresses`: whether it carries compressed pushes (Job.compress)."""

    compresses = False

    kind: str = ""
    closed: bool = False

    @abstractmethod
    def begin(self, job: Job) -> Answer:
        """Start `job` (in the caller's thread, or in the pool) and return what waits for the shard's answer.
        Failures of the connection itself are raised as UNAVAILABLE (the transport is closed then). Marks
        `job.turns` done for its shard once its push no longer holds the link (at once if it takes no turns)."""

    def exchange_as_ready(self, job: Job) -> ps_pb2.ExchangeResponse:
        """Run `job`, whose gradient comes from `job.feed` as backward makes it, to its answer (on one of the feed's
        threads, while the caller's runs backward). This one pushes the whole gradient once backward is over; a
        transport that can send each piece as soon as it is final does so."""
        assert job.feed is not None
        job.grads = job.feed.all()
        return self.begin(job)()

    def close(self) -> None:
        """Release what the transport holds (a segment, a connection); it serves no further exchange. Idempotent."""
        self.closed = True

    def _lost(self, exc: BaseException, address: str) -> PSError:
        """The connection failed (the shard went away, or the stream is out of step after a timeout): close, and
        let the caller retry as UNAVAILABLE, which attaches afresh."""
        self.close()
        return RemoteError(f"shard {address}: connection lost: {exc}", grpc.StatusCode.UNAVAILABLE)


class _RawStreams:
    """The streaming RPCs of one channel with raw-bytes messages on the tensor side, encoded and decoded by
    paramserver.wire.codec: no protobuf object ever holds a chunk's data."""

    def __init__(self, channel: grpc.Channel) -> None:
        self.init = channel.stream_unary(
            _SERVICE + "Init", request_serializer=None, response_deserializer=ps_pb2.InitResponse.FromString
        )
        self.push = channel.stream_unary(
            _SERVICE + "Push", request_serializer=None, response_deserializer=ps_pb2.PushResponse.FromString
        )
        self.pull = channel.unary_stream(
            _SERVICE + "Pull", request_serializer=ps_pb2.PullRequest.SerializeToString, response_deserializer=None
        )


class Grpc(Transport):
    """Tensors in gRPC messages: inline in one unary Exchange (a small part) or in Push and Pull streams."""

    kind = "gRPC"

    def __init__(self, channel: grpc.Channel, address: str, pool: futures.ThreadPoolExecutor, chunk_bytes: int) -> None:
        self.stub = ps_pb2_grpc.ParameterServerStub(channel)
        self.raw = _RawStreams(channel)
        self.address = address
        self.pool = pool
        self._chunk_bytes = chunk_bytes

    def close(self) -> None:
        pass  # the channel belongs to the link; gRPC is never closed while the link lives

    def begin(self, job: Job) -> Answer:
        job.turns.done(job.shard)  # only data sockets take turns
        if job.small or not job.dense:
            return self._inline(job)
        return self.pool.submit(self._streams, job).result

    def init(
        self, header: ps_pb2.InitHeader, views: list[np.ndarray], timeout: float, rows: Iterable[bytes] = ()
    ) -> None:
        """Send an Init stream: the header, then the initial weights in chunks, then `rows` (InitMessages giving
        tables' initial rows)."""

        def messages() -> Iterator[bytes]:
            yield ps_pb2.InitMessage(header=header).SerializeToString()
            for piece, offset, data in iter_chunks(views, ps_pb2.FLOAT32, self._chunk_bytes):
                yield codec.encode_chunk(piece, offset, data)
            yield from rows

        self.raw.init(messages(), timeout=timeout)

    def _inline(self, job: Job) -> Answer:
        """The exchange as one unary call with the tensors in the messages (a small part)."""
        req, b, k = job.request, job.binding, job.shard
        req.inline = True
        if job.grads is not None:
            for piece, offset, data in iter_chunks(b.views(k, job.grads), req.dtype, reuse=True):
                req.chunks.add(piece=piece, offset=offset, data=bytes(data))
        if job.sparse is not None:
            job.sparse.add_to(req, inline=True)

        def finish() -> ps_pb2.ExchangeResponse:
            reply: ps_pb2.ExchangeResponse = self.stub.Exchange(req, timeout=job.timeout)
            if job.sparse is not None:
                job.sparse.take(reply, self.address)
            if job.flats is not None:
                job.check(reply.pulled)
                receiver = ChunkReceiver(b.views(k, job.flats), b.labels(k), req.dtype)
                for chunk in reply.chunks:
                    receiver.add(chunk.piece, chunk.offset, memoryview(chunk.data))
                receiver.finish()
            return reply

        # Blocking calls, not gRPC futures (those start a thread per call when a channel is idle: milliseconds on
        # a busy machine): the caller's shard in its thread, begun last, the others in pool threads meanwhile.
        return finish if job.in_caller else self.pool.submit(finish).result

    def _streams(self, job: Job) -> ps_pb2.ExchangeResponse:
        """A Push stream, then a Pull stream."""
        req, b, k = job.request, job.binding, job.shard
        reply = ps_pb2.ExchangeResponse()
        if job.grads is not None:
            header = ps_pb2.PushHeader(
                worker_id=req.worker_id,
                step=req.step,
                base_version=req.base_version,
                model_digest=req.model_digest,
                dtype=req.dtype,
                rows=job.sparse.entries(inline=True)[0] if job.sparse is not None else (),
            )
            views = b.views(k, job.grads)

            def messages() -> Iterator[bytes]:
                yield ps_pb2.PushMessage(header=header).SerializeToString()
                for piece, offset, data in iter_chunks(views, req.dtype, self._chunk_bytes, reuse=True):
                    yield codec.encode_chunk(piece, offset, data)

            pushed = self.raw.push(messages(), timeout=job.timeout)
            reply.version, reply.applied = pushed.version, pushed.applied
        if job.flats is not None:
            # A retry of a push taken before is answered with the version that includes it (maybe older).
            wait_for = req.min_version if reply.applied or job.grads is None else min(req.min_version, reply.version)
            pull = ps_pb2.PullRequest(
                worker_id=req.worker_id, min_version=wait_for, dtype=req.dtype, incarnation=req.incarnation
            )
            stream = self.raw.pull(pull, timeout=job.timeout)
            first = codec.decode(next(stream), ps_pb2.PullMessage)
            if isinstance(first, codec.Chunk) or first.WhichOneof("kind") != "header":
                raise MalformedStream(f"shard {self.address} sent a pull stream without its header")
            job.check(first.header)
            receiver = ChunkReceiver(b.views(k, job.flats), b.labels(k), req.dtype)
            for raw in stream:
                chunk = codec.decode(raw, ps_pb2.PullMessage)
                if not isinstance(chunk, codec.Chunk):
                    raise MalformedStream(f"shard {self.address} sent a second header in a pull stream")
                receiver.add(chunk.piece, chunk.offset, chunk.data)
            receiver.finish()
            reply.pulled.CopyFrom(first.header)
        if job.sparse is not None and job.sparse.lookups:
            # The streams carry no lookups: one more call, after the pull, waiting for the same version.
            ask = ps_pb2.ExchangeRequest(
                worker_id=req.worker_id,
                model_digest=req.model_digest,
                min_version=reply.pulled.version if job.flats is not None else req.min_version,
                incarnation=req.incarnation,
                inline=True,
                lookup=job.sparse.entries(inline=True)[1],
            )
            looked: ps_pb2.ExchangeResponse = self.stub.Exchange(ask, timeout=job.timeout)
            job.sparse.take(looked, self.address)
            reply.rows_version = looked.rows_version
        return reply


class SharedMemory(Transport):
    """A segment on the shard's host: the gradient and weights regions are copied to and from the model; the
    Exchange goes over the doorbell (`bell`) when the shard offers one, else as a gRPC call."""

    kind = "shared memory"

    def __init__(self, segment: shm.Segment, bell: FrameClient | None, rpc: Grpc, address: str) -> None:
        self.segment = segment
        self.doorbell = bell
        self._rpc = rpc
        self._address = address

    def close(self) -> None:
        if self.closed:
            return
        self.closed = True
        if self.doorbell is not None:
            self.doorbell.close()
        self.segment.close()

    def begin(self, job: Job) -> Answer:
        job.turns.done(job.shard)  # only data sockets take turns
        b, k = job.binding, job.shard
        if job.grads is not None:
            for src, dst in zip(b.views(k, job.grads), b.regions(k, self.segment.grad), strict=True):
                np.copyto(dst, src)
        return self._ring_then_copy(job)

    def exchange_as_ready(self, job: Job) -> ps_pb2.ExchangeResponse:
        """Each piece's gradient is copied into the segment as soon as backward has made it, last piece first."""
        assert job.feed is not None
        job.turns.done(job.shard)
        regions = job.binding.regions(job.shard, self.segment.grad)
        for src, dst in zip(job.feed.last_first(job.shard), reversed(regions), strict=True):
            np.copyto(dst, src)
        return self._ring_then_copy(job)()

    def _ring_then_copy(self, job: Job) -> Answer:
        b, k, segment = job.binding, job.shard, self.segment
        answer = self._ring(job)

        def finish() -> ps_pb2.ExchangeResponse:
            reply = answer()
            if job.sparse is not None and self.doorbell is None:
                job.sparse.take(reply, self._address)
            if job.flats is not None:
                job.check(reply.pulled)
                if job.feed is not None:
                    job.feed.wait()  # the weights go into the model once backward no longer reads it
                for src, dst in zip(b.regions(k, segment.weights), b.views(k, job.flats), strict=True):
                    np.copyto(dst, src)
            return reply

        return finish

    def _ring(self, job: Job) -> Answer:
        bell, sparse = self.doorbell, job.sparse
        if bell is None:
            if sparse is not None:
                sparse.add_to(job.request, inline=True)
            return self._rpc.pool.submit(self._rpc.stub.Exchange, job.request, timeout=job.timeout).result
        if sparse is not None:
            sparse.add_to(job.request, inline=False)
        try:
            bell.send(job.request, job.timeout, raw=sparse.raw_out() if sparse is not None else ())
        except OSError as exc:
            raise self._lost(exc, self._address) from None

        def receive() -> ps_pb2.ExchangeResponse:
            try:
                return bell.receive(raw=sparse.raw_in() if sparse is not None else ())
            except (OSError, ConnectionError) as exc:
                raise self._lost(exc, self._address) from None

        return receive


class DataSocket(Transport):
    """A data-socket connection: the gradient goes out of the model's own memory and the weights land straight in
    it. A large push waits for its turn (`in_turn`)."""

    kind = "data socket"
    compresses = True  # the path between hosts, where bytes cost

    def __init__(
        self, bell: FrameClient, pool: futures.ThreadPoolExecutor, address: str, push_in_turn: bool | None
    ) -> None:
        self.connection = bell
        self._pool = pool
        self._address = address
        # In turn over a network, where a link is the limit; at once on a loopback address, where memory copies on
        # several cores are (see PSClient's push_in_turn).
        self.in_turn = push_in_turn if push_in_turn is not None else not bell.loopback

    def close(self) -> None:
        self.closed = True
        self.connection.close()  # closing a closed socket does nothing

    def begin(self, job: Job) -> Answer:
        if job.sparse is not None:
            job.sparse.add_to(job.request, inline=False)
        if job.small:
            try:
                self._send(job)  # a small part fits the socket buffers: ring every shard from this thread, then collect
            finally:
                job.turns.done(job.shard)
            return functools.partial(self._receive, job)
        # A large part, pushed or pulled: the whole exchange in one thread per shard (the caller's shard in its own),
        # so the transfers overlap; collected in one thread, shard 1's weights would wait in its socket for shard 0's.
        exchange = functools.partial(self._large, job)
        return exchange if job.in_caller else self._pool.submit(exchange).result

    def exchange_as_ready(self, job: Job) -> ps_pb2.ExchangeResponse:
        """A large part's pieces go last first (ExchangeRequest.last_piece_first), each as soon as backward has
        made it; a small one whole once backward is over."""
        if job.small or job.sparse is not None:
            return super().exchange_as_ready(job)
        job.request.last_piece_first = True
        return self._large(job)

    def _large(self, job: Job) -> ps_pb2.ExchangeResponse:
        k = job.shard
        in_turn = job.pushes and self.in_turn
        if in_turn and not job.request.last_piece_first:  # which takes the link a piece at a time (Turns.take)
            job.turns.wait(k)
        try:
            self._send(job)
            if in_turn and k + 1 < job.shards:  # the next shard's turn: once these bytes have crossed
                self.connection.drain(TURN_BELOW, job.timeout)
        finally:
            job.turns.give(k)
            job.turns.done(k)
        return self._receive(job)

    def _as_ready(self, job: Job) -> Generator[np.ndarray, None, None]:
        """The part's pieces last first as backward makes them, each in the link's turn where pushes take turns."""
        assert job.feed is not None
        turns, k = job.turns, job.shard
        if not self.in_turn:
            yield from job.feed.last_first(k)
            return
        for piece in job.feed.last_first(k, on_wait=lambda: turns.give(k)):
            turns.take(k)
            yield piece

    def _send(self, job: Job) -> None:
        bell, req, sparse = self.connection, job.request, job.sparse
        raw = sparse.raw_out() if sparse is not None else []
        try:
            if req.last_piece_first:
                self._send_as_ready(job)
                return
            arrays = job.binding.views(job.shard, job.grads) if job.grads is not None else []
            encoded = job.compress(arrays) if job.compress is not None and arrays else None
            if encoded is not None:
                req.compression.CopyFrom(encoded.message)
                arrays, raw = [encoded.values], [*encoded.raw, *raw]
            bell.send(req, job.timeout, arrays, req.dtype, raw)
        except OSError as exc:
            raise self._lost(exc, self._address) from None

    def _send_as_ready(self, job: Job) -> None:
        size = job.binding.elements[job.shard] * itemsize(job.request.dtype)
        pieces = self._as_ready(job)
        try:
            self.connection.send_as_ready(job.request, job.timeout, pieces, size, job.request.dtype)
        except BaseException:
            self.close()  # cut off mid-frame (BackwardFailed, a lost link): the shard drops the frame
            raise
        finally:
            pieces.close()

    def _receive(self, job: Job) -> ps_pb2.ExchangeResponse:
        b, k, req, sparse = job.binding, job.shard, job.request, job.sparse
        if job.feed is not None:
            job.feed.wait()  # the weights go into the model once backward no longer reads it
        try:
            reply = self.connection.receive(
                b.views(k, job.flats) if job.flats is not None else (),
                req.dtype,
                sparse.raw_in() if sparse is not None else [],
            )
        except (OSError, ConnectionError) as exc:
            raise self._lost(exc, self._address) from None
        if job.flats is not None:
            job.check(reply.pulled)
        return reply
