"""One exchange, whatever carries it: each transport supplies a gradient source and a weights sink; one handler
does the rest.

An exchange pushes a gradient, pulls the weights of a version, or both. Where the tensors are is all that differs
between the transports:

    transport                          gradient source                     weights sink
    shared memory (gRPC or doorbell)   the segment's gradient, in place    a copy into the segment under the lock
    data socket                        the frame's payload -> scratch      the weights, lent until the reply is sent
                                       (compressed: decoded into scratch)
    inline Exchange (gRPC)             the request's chunks -> scratch     chunks in the reply
    Push / Pull streams (gRPC)         the stream's chunks -> scratch      the weights, lent while the stream runs

A source validates everything it delivers (NaN and Inf included) before the handler applies any of it, so a refused
push changes nothing. The handler runs every exchange in one order: the model (`model`), then, in `exchange`, the
worker, the push, the pull (min_version with the incarnation rule, the timeout clamped to pull_timeout), the reply,
and the metrics (pulls, bytes in and out; refused requests through `rejected`).
"""

from __future__ import annotations

import contextlib
import dataclasses
import math
from abc import ABC, abstractmethod
from collections.abc import Callable, Iterator, Sequence
from dataclasses import dataclass
from typing import Protocol

import numpy as np

from paramserver.errors import MalformedStream, PSError
from paramserver.server import reads
from paramserver.shard.model import ShardModel
from paramserver.shard.replication.replicator import Forwarded
from paramserver.shard.sparse.row_blocks import RowBlock
from paramserver.shard.sparse.sparse_in import SparseIn
from paramserver.shard.state import Shard
from paramserver.transport import shm
from paramserver.v1 import ps_pb2
from paramserver.wire import compression
from paramserver.wire.chunks import ChunkReceiver, check_finite, itemsize, iter_chunks
from paramserver.wire.frames import Payload


@dataclass(frozen=True)
class Want:
    """What one exchange asks for, whatever carried it (an ExchangeRequest, a Push or a Pull header)."""

    worker_id: str  # "": a reader that did not join (Pull streams only)
    digest: str | None  # the model the request is for; None: whichever the shard holds (a Pull stream)
    step: int = 0  # push: see PushHeader.step
    base_version: int = 0  # push: the version the gradient was computed on
    min_version: int = 0  # pull: wait for at least this version
    incarnation: str = ""  # pull: the shard incarnation min_version refers to

    @classmethod
    def of(cls, request: ps_pb2.ExchangeRequest) -> Want:
        """What an ExchangeRequest asks for (its tensors aside)."""
        return cls(
            request.worker_id,
            request.model_digest,
            request.step,
            request.base_version,
            request.min_version,
            request.incarnation,
        )


class Progress(Protocol):
    """Told as a push's gradient arrives (Forwarded)."""

    def advance(self, ready: int) -> None: ...


# -- gradient sources --------------------------------------------------------------------------------------------


class GradientSource(ABC):
    """Where a push's gradient comes from: received into a scratch buffer (`fill`), or, `in_place`, used where it
    lies (`region`). Either way fully validated before the handler applies it."""

    in_place = False

    @property
    @abstractmethod
    def nbytes(self) -> int:
        """The bytes received for this push (for the metrics), once it is in."""

    def ready(self) -> None:  # noqa: B027 - not abstract: most sources have nothing to wait for
        """Wait, holding nothing, until the gradient can be received at once (a small payload all arrived)."""

    def fill(self, model: ShardModel, grad: np.ndarray, progress: Progress | None = None) -> None:
        """Write the whole gradient into `grad`, a scratch buffer of the model's size; raise if it is malformed.
        `progress.advance(n)`: where a source can, it says so as bytes [0, n) of `grad` are written."""
        raise NotImplementedError(f"{type(self).__name__} is used in place")

    def region(self, model: ShardModel) -> np.ndarray:
        """The validated gradient where it lies (in place only)."""
        raise NotImplementedError(f"{type(self).__name__} is received into a scratch buffer")

    def unchecked(self) -> np.ndarray:
        """The gradient where it lies, before `region` validates it (in place only): what a backup is forwarded
        while it is validated (and told to drop if it is refused)."""
        raise NotImplementedError(f"{type(self).__name__} is received into a scratch buffer")


class SegmentGradient(GradientSource):
    """A segment's gradient region, validated and applied in place, with no scratch buffer: only the worker's own
    user can open its memfd (through /proc), and could as well write into this process; the client never touches
    the segment during a call."""

    in_place = True

    def __init__(self, segment: shm.Segment) -> None:
        self._grad = segment.grad

    @property
    def nbytes(self) -> int:
        return int(self._grad.nbytes)

    def region(self, model: ShardModel) -> np.ndarray:
        check_finite(model.views(self._grad), model.labels)
        return self._grad

    def unchecked(self) -> np.ndarray:
        return self._grad


class PayloadGradient(GradientSource):
    """A data-socket frame's payload: the pieces back to back in the request's dtype, then the raw arrays of the
    exchange's rows and lookup IDs (`raw`, filled in the same read). `last_first`: the pieces come last first (a
    worker sending each layer's gradient as backward makes it); the backup is then forwarded the push once it is
    all in, not as it arrives (a forward goes from the front of the buffer)."""

    def __init__(self, payload: Payload, dtype: int, raw: Sequence[np.ndarray] = (), last_first: bool = False) -> None:
        self._payload = payload
        self._dtype = dtype
        self._raw = raw
        self._last_first = last_first

    @property
    def nbytes(self) -> int:
        return self._payload.size

    def ready(self) -> None:
        self._payload.wait_arrival()  # a stalled small push then holds no scratch buffer

    def fill(self, model: ShardModel, grad: np.ndarray, progress: Progress | None = None) -> None:
        if self._last_first:
            self._payload.read_into(model.views(grad)[::-1], self._dtype, self._raw)
        else:
            self._payload.read_into([grad], self._dtype, self._raw, progress.advance if progress is not None else None)
        check_finite(model.views(grad), model.labels)


class CompressedGradient(PayloadGradient):
    """A data-socket frame's compressed payload (ExchangeRequest.compression): the floats and raw arrays its layout
    names (paramserver/wire/compression.py), then the exchange's rows, decoded into the scratch buffer."""

    def __init__(
        self, payload: Payload, dtype: int, compression: ps_pb2.Compression, raw: Sequence[np.ndarray] = ()
    ) -> None:
        super().__init__(payload, dtype, raw)
        self._compression = compression

    def fill(self, model: ShardModel, grad: np.ndarray, progress: Progress | None = None) -> None:
        specs = {s.name: s for s in model.placement.specs}
        layout = compression.layout(self._compression, model.pieces, specs)  # refused before a byte is read
        values, extra = np.empty(layout.values, np.float32), layout.raw()
        self._payload.read_into([values], self._dtype, [*extra, *self._raw])
        layout.decode(values, extra, grad)
        check_finite(model.views(grad), model.labels)


class ChunkStream(Protocol):
    """A client stream of chunks after its header (paramserver.server.service.ClientStream)."""

    bytes: int  # raw bytes received so far

    def receive(self, targets: Sequence[np.ndarray], names: Sequence[str], dtype: int) -> None: ...


class StreamGradient(GradientSource):
    """The chunks of a Push stream, validated (NaN and Inf refused) as they arrive."""

    def __init__(self, stream: ChunkStream, dtype: int) -> None:
        self._stream = stream
        self._dtype = dtype

    @property
    def nbytes(self) -> int:
        return self._stream.bytes

    def fill(self, model: ShardModel, grad: np.ndarray, progress: Progress | None = None) -> None:
        self._stream.receive(model.views(grad), model.labels, self._dtype)


class ChunksGradient(GradientSource):
    """The chunks of an inline Exchange request, validated (NaN and Inf refused) as they are written."""

    def __init__(self, chunks: Sequence[ps_pb2.Chunk], dtype: int, nbytes: int) -> None:
        self._chunks = chunks
        self._dtype = dtype
        self._nbytes = nbytes

    @property
    def nbytes(self) -> int:
        return self._nbytes

    def fill(self, model: ShardModel, grad: np.ndarray, progress: Progress | None = None) -> None:
        receiver = ChunkReceiver(model.views(grad), model.labels, self._dtype, check_finite=True)
        for chunk in self._chunks:
            receiver.add(chunk.piece, chunk.offset, memoryview(chunk.data))
        receiver.finish()


# -- weights sinks -----------------------------------------------------------------------------------------------


class WeightsSink(ABC):
    """Where a pull's weights go."""

    @abstractmethod
    def pull(
        self, shard: Shard, min_version: int, timeout: float, worker_id: str, reply: ps_pb2.ExchangeResponse
    ) -> tuple[int, ShardModel]:
        """Wait for `min_version` (at most `timeout` seconds), put the weights where they go; return the version
        and the model they are of."""

    @abstractmethod
    def nbytes(self, reply: ps_pb2.ExchangeResponse) -> int:
        """The bytes this pull sends (for the metrics)."""

    def release(self) -> None:  # noqa: B027 - not abstract: most sinks hold nothing past their pull
        """Give back whatever the sink still holds of the shard's (called once they are sent, or on failure)."""


class SegmentWeights(WeightsSink):
    """A segment's weights region: the weights of one version copied in under the shard's lock."""

    def __init__(self, segment: shm.Segment, model: ShardModel) -> None:
        self._weights = segment.weights
        self._model = model

    def pull(
        self, shard: Shard, min_version: int, timeout: float, worker_id: str, reply: ps_pb2.ExchangeResponse
    ) -> tuple[int, ShardModel]:
        return reads.pull_into(shard, self._weights, min_version, timeout, worker_id), self._model

    def nbytes(self, reply: ps_pb2.ExchangeResponse) -> int:
        return int(self._weights.nbytes)


class LentWeights(WeightsSink):
    """The weights lent (Shard.weights: in place where the policy allows, else a scratch copy) until `release`:
    a data-socket reply's payload, a Pull stream's chunks."""

    def __init__(self, dtype: int) -> None:
        self.dtype = dtype
        self._lent = contextlib.ExitStack()
        self._model: ShardModel | None = None
        self._flat: np.ndarray | None = None

    def pull(
        self, shard: Shard, min_version: int, timeout: float, worker_id: str, reply: ps_pb2.ExchangeResponse
    ) -> tuple[int, ShardModel]:
        version, self._model, self._flat = self._lent.enter_context(
            reads.weights(shard, min_version, timeout, worker_id)
        )
        return version, self._model

    @property
    def flat(self) -> np.ndarray:
        """The lent weights, the pieces back to back (float32)."""
        if self._flat is None:
            raise RuntimeError("no weights are lent before the pull")
        return self._flat

    def chunks(self) -> Iterator[tuple[int, int, bytes | memoryview]]:
        """The lent weights as chunks in the sink's dtype (each valid until the next is asked for)."""
        assert self._model is not None
        return iter_chunks(self._model.views(self.flat), self.dtype, reuse=True)

    def nbytes(self, reply: ps_pb2.ExchangeResponse) -> int:
        return len(self.flat) * itemsize(self.dtype)

    def release(self) -> None:
        self._lent.close()


class ChunksWeights(WeightsSink):
    """Chunks in an inline Exchange reply, encoded while the weights are lent."""

    def __init__(self, dtype: int) -> None:
        self._dtype = dtype

    def pull(
        self, shard: Shard, min_version: int, timeout: float, worker_id: str, reply: ps_pb2.ExchangeResponse
    ) -> tuple[int, ShardModel]:
        with reads.weights(shard, min_version, timeout, worker_id) as (version, held, flat):
            for piece, offset, data in iter_chunks(held.views(flat), self._dtype, reuse=True):
                reply.chunks.add(piece=piece, offset=offset, data=bytes(data))
        return version, held

    def nbytes(self, reply: ps_pb2.ExchangeResponse) -> int:
        return reply.ByteSize()


def segment_route(
    segment: shm.Segment, request: ps_pb2.ExchangeRequest, model: ShardModel
) -> tuple[GradientSource | None, WeightsSink | None]:
    """The source and sink of an Exchange through the worker's attached segment."""
    return (
        SegmentGradient(segment) if request.push else None,
        SegmentWeights(segment, model) if request.pull else None,
    )


# -- the handler -------------------------------------------------------------------------------------------------


class ExchangeHandler:
    """Run exchanges against one shard, and count them (and the requests refused) in its metrics."""

    def __init__(self, shard: Shard) -> None:
        self.shard = shard

    def rejected(self, exc: PSError) -> None:
        """Count a refused request in the shard's metrics."""
        self.shard.metrics.rejected_for(type(exc).__name__)

    def model(self, digest: str) -> ShardModel:
        """The held model an exchange is for (FAILED_PRECONDITION for another, or before init): the first step of
        every exchange that names one; the transport then picks its source and sink for it."""
        return self.shard.require_model(digest)

    def exchange(
        self,
        want: Want,
        model: ShardModel | None,
        source: GradientSource | None,
        sink: WeightsSink | None,
        timeout: float,
        sparse: SparseIn | None = None,
    ) -> ps_pb2.ExchangeResponse:
        """Push through `source` (when given, with the row gradients of `sparse`), then pull through `sink` (when
        given), then read the rows `sparse` looks up (into `sparse.answers`; the reply's `rows` name them), waiting
        at most `timeout` seconds and never longer than the shard's pull_timeout; return the reply. A sink's lent
        weights stay lent until its `release` unless this raises. The rows of `sparse` are received (inline, or
        by the source's read of a frame's payload) but not yet checked: they are checked here, before anything
        applies."""
        reply = ps_pb2.ExchangeResponse()
        metrics = self.shard.metrics
        rows: list[RowBlock] = sparse.rows if sparse is not None else []
        if rows and source is None:
            raise MalformedStream("rows are pushed with a push: set push")
        durable: int | None = None
        if source is not None:
            if model is None:
                raise ValueError("a push names its model: see ExchangeHandler.model")
            reply.version, reply.applied = self._push(want, model, source, rows)
            metrics.bytes_in.inc(source.nbytes + sum(b.nbytes for b in rows))
            durable = self.shard.durable_target(want.worker_id)
            if not reply.applied:  # a retry of a push taken before: its version may be older than base + 1
                want = dataclasses.replace(want, min_version=min(want.min_version, reply.version))
        wait = _clamp(timeout, self.shard.config.pull_timeout)
        if sink is not None:
            self._pull(want, sink, wait, reply)
        try:
            if sparse is not None and sparse.lookups:
                self._lookup(want, model, sparse, wait, reply)
            # Acknowledged only once the update holding the push is logged (a shard with a checkpoint_dir) and
            # held by the backup: waited for last, so the backup receives it while the pull is written. Nothing
            # reaches the worker before this returns (the reply, the segment's doorbell).
            if durable is not None:
                self.shard.wait_durable(durable, wait)
        except BaseException:
            if sink is not None:
                sink.release()
            raise
        return reply

    def _push(
        self, want: Want, model: ShardModel, source: GradientSource, rows: Sequence[RowBlock]
    ) -> tuple[int, bool]:
        shard = self.shard
        if source.in_place:
            # The segment was found through the worker's live attachment, which checked the worker. Its gradient
            # stays as it is until the worker hears back, which waits for the backup: it goes to the backup from
            # where it lies while it is validated and applied and the pull is written.
            forward = shard.forward(source.unchecked())
            if forward is not None:
                forward.complete()

            def push_in_place() -> tuple[int, bool]:
                region = source.region(model)
                model.tables.check(rows)
                return shard.push(
                    want.worker_id, want.step, want.base_version, region, model.digest, rows=rows, forward=forward
                )

            return _settled(forward, push_in_place)
        # Before a scratch buffer is taken and the gradient received (Shard.push checks both again).
        shard.check_step(want.step)
        shard.check_worker(want.worker_id)
        source.ready()
        with shard.scratch() as grad:
            forward = shard.forward(grad)  # sent to the backup as it arrives

            def push() -> tuple[int, bool]:
                source.fill(model, grad, forward)  # a refusal here changes nothing: the buffer is the pool's
                model.tables.check(rows)
                if forward is not None:
                    forward.complete()
                    forward.wait_sent()  # a round may add into this buffer (its sum), or give it back, after
                return shard.push(
                    want.worker_id, want.step, want.base_version, grad, model.digest, lent=True, rows=rows,
                    forward=forward,
                )  # fmt: skip

            return _settled(forward, push)

    def _lookup(
        self, want: Want, model: ShardModel | None, sparse: SparseIn, timeout: float, reply: ps_pb2.ExchangeResponse
    ) -> None:
        shard = self.shard
        held = model if model is not None else shard.require_model(want.digest)
        held.tables.check(sparse.lookups)
        min_version = reads.wanted(shard, want.min_version, want.incarnation)
        if reply.HasField("pulled"):
            min_version = reply.pulled.version  # the rows of the weights' version, or a later one
        reply.rows_version, sparse.answers = reads.lookup(shard, sparse.lookups, min_version, timeout, want.worker_id)
        for block in sparse.lookups:
            reply.rows.add(table=block.table, count=len(block.ids))
        shard.metrics.lookups.inc()
        shard.metrics.bytes_out.inc(sum(int(a.nbytes) for a in sparse.answers))

    def _pull(self, want: Want, sink: WeightsSink, timeout: float, reply: ps_pb2.ExchangeResponse) -> None:
        shard = self.shard
        # A version of another incarnation may never come: the current weights instead (reads.wanted).
        min_version = reads.wanted(shard, want.min_version, want.incarnation)
        version, model = sink.pull(shard, min_version, timeout, want.worker_id, reply)
        try:
            reply.pulled.version = version
            reply.pulled.model_digest = model.digest
            reply.pulled.incarnation = shard.incarnation
            shard.metrics.pulls.inc()
            shard.metrics.bytes_out.inc(sink.nbytes(reply))
        except BaseException:
            sink.release()
            raise


def _settled(forward: Forwarded | None, push: Callable[[], tuple[int, bool]]) -> tuple[int, bool]:
    """Run `push`; a forwarded push that it did not apply (refused, or a retry of one applied before) is aborted,
    so the backup drops it."""
    try:
        version, applied = push()
    except BaseException:
        if forward is not None:
            forward.abort()
        raise
    if forward is not None and not applied:
        forward.abort()
    return version, applied


def _clamp(timeout: float, limit: float) -> float:
    """A pull's wait: the caller's timeout within [0, limit]; NaN or inf mean the limit."""
    return min(max(timeout, 0.0), limit) if math.isfinite(timeout) else limit
