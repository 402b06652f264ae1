"""The gRPC servicer: a thin layer from RPCs to Shard calls; every error goes through errors.rpc_errors."""

from __future__ import annotations

import contextlib
import math
from collections.abc import Callable, Iterable, Iterator, Sequence
from typing import Any

import grpc
import numpy as np

from paramserver import bounds, codec, heap, shm
from paramserver.doorbell import Payload, Reply
from paramserver.errors import DataSocketUnavailable, InvalidArgument, MalformedStream, PSError, TooLarge, rpc_errors
from paramserver.placement import SLICE_ELEMENTS, TensorSpec
from paramserver.shard import Shard, ShardModel
from paramserver.v1 import ps_pb2, ps_pb2_grpc
from paramserver.wire import ChunkReceiver, check_finite, itemsize, iter_chunks, wire_dtype

_MODES = {"sync": ps_pb2.SYNC, "async": ps_pb2.ASYNC, "ssp": ps_pb2.SSP}


class ClientStream:
    """The raw messages of a client stream (Init, Push), parsed, size- and bound-checked here rather than by gRPC.

    gRPC's own refusal of a message (unparsable, or over its size limit) ends the request iterator exactly as a
    client's normal end of stream does, so a handler could not tell a complete stream from a cut one. Parsing
    here turns each bad message into a status of our own, raised before anything is applied.
    """

    def __init__(
        self, raw: Iterator[bytes], decode: Callable[[bytes], Any], kind: str, limit: int, context: grpc.ServicerContext
    ) -> None:
        self._raw = raw
        self._decode = decode
        self._kind = kind
        self._limit = limit
        self._context = context
        self.bytes = 0  # raw bytes received so far

    def _next(self) -> Any | None:
        data = next(self._raw, None)
        if data is None:
            if not self._context.is_active():
                raise MalformedStream(f"the {self._kind} stream was cut off")
            return None
        self.bytes += len(data)
        if len(data) > self._limit:
            raise TooLarge(
                f"a {self._kind} of {len(data)} bytes is over the limit of {self._limit} "
                f"(max_message_bytes); send chunks of about 1 MiB"
            )
        return self._decode(data)  # Undecodable, OutOfBounds (see paramserver.bounds)

    def header(self) -> Any:
        """Return the header that must open the stream."""
        first = self._next()
        if first is None or isinstance(first, codec.Chunk) or first.WhichOneof("kind") != "header":
            raise MalformedStream(f"a {self._kind} stream must start with its header")
        return first.header

    def receive(self, targets: Sequence[np.ndarray], names: Sequence[str], dtype: int) -> None:
        """Write every remaining message, all chunks, into the targets (validated, NaN/Inf refused by a
        ChunkReceiver); raise unless they end up complete."""
        receiver = ChunkReceiver(targets, names, wire_dtype(dtype), check_finite=True)
        while (msg := self._next()) is not None:
            if not isinstance(msg, codec.Chunk):
                raise MalformedStream("only chunks may follow the header")
            receiver.add(msg.piece, msg.offset, msg.data)
        receiver.finish()


def specs_from_proto(specs: Iterable[ps_pb2.TensorSpec]) -> list[TensorSpec]:
    """Convert wire tensor specs, refusing empty names."""
    out = []
    for s in specs:
        if not s.name:
            raise InvalidArgument("every tensor needs a name")
        out.append(TensorSpec(s.name, tuple(int(d) for d in s.shape)))
    return out


class ParameterServerServicer(ps_pb2_grpc.ParameterServerServicer):
    """Serve one Shard."""

    def __init__(self, shard: Shard) -> None:
        self.shard = shard
        self.doorbell = ""  # the address of the shard's doorbell (paramserver.doorbell), once it listens
        self.data_port = 0  # the port of its data socket, once it listens
        self._init_stream = bounds.stream_decoder(ps_pb2.InitMessage, "Init")
        self._push_stream = bounds.stream_decoder(ps_pb2.PushMessage, "Push")

    def rejected(self, exc: PSError) -> None:
        """Count a refused request in the shard's metrics."""
        self.shard.metrics.rejected_for(type(exc).__name__)

    def _stream(
        self, raw: Iterator[bytes], decode: Callable[[bytes], Any], kind: str, context: grpc.ServicerContext
    ) -> ClientStream:
        return ClientStream(raw, decode, kind, self.shard.config.max_message_bytes, context)

    def decoding(self, rpc: str, message: type[Any], behaviour: Callable[[Any, grpc.ServicerContext], Any]) -> Any:
        """`behaviour` as a handler of raw request bytes: the one place a unary request is decoded. Bytes over
        max_message_bytes are TooLarge, bytes that are no `message` Undecodable, a field past its bound in ps.proto
        OutOfBounds, each refused (and counted) before the behaviour runs."""
        decode = bounds.decoder(message, rpc)
        kind = message.DESCRIPTOR.name

        def handle(raw: bytes, context: grpc.ServicerContext) -> Any:
            with rpc_errors(context, rpc, self.rejected):
                limit = self.shard.config.max_message_bytes
                if len(raw) > limit:
                    raise TooLarge(
                        f"{rpc}: a {kind} of {len(raw)} bytes is over the limit of {limit} (max_message_bytes)"
                    )
                request = decode(raw)
            return behaviour(request, context)

        return handle

    def GetTopology(self, request: ps_pb2.GetTopologyRequest, context: grpc.ServicerContext) -> ps_pb2.Topology:
        with rpc_errors(context, "GetTopology", self.rejected):
            c = self.shard.config
            d = self.shard.describe()
            return ps_pb2.Topology(
                shards=self.shard.addresses,
                shard_index=self.shard.index,
                job=ps_pb2.JobInfo(
                    mode=_MODES[c.mode],
                    workers=c.workers,
                    optimizer=c.optimizer,
                    lr=c.lr,
                    job_name=c.job_name,
                ),
                initialized=d.initialized,
                model_digest=d.digest,
                specs=[ps_pb2.TensorSpec(name=s.name, shape=s.shape) for s in d.specs],
                version=d.version,
                slice_elements=SLICE_ELEMENTS,
            )

    def Join(self, request: ps_pb2.JoinRequest, context: grpc.ServicerContext) -> ps_pb2.JoinResponse:
        with rpc_errors(context, "Join", self.rejected):
            rank, version = self.shard.join(request.worker_id, request.job_name)
            return ps_pb2.JoinResponse(
                rank=rank,
                world_size=self.shard.config.workers,
                version=version,
                lease_timeout_s=self.shard.config.lease_timeout,
                incarnation=self.shard.incarnation,
            )

    def Leave(self, request: ps_pb2.LeaveRequest, context: grpc.ServicerContext) -> ps_pb2.LeaveResponse:
        with rpc_errors(context, "Leave", self.rejected):
            self.shard.leave(request.worker_id, request.finished)
            return ps_pb2.LeaveResponse()

    def Heartbeat(self, request: ps_pb2.HeartbeatRequest, context: grpc.ServicerContext) -> ps_pb2.HeartbeatResponse:
        with rpc_errors(context, "Heartbeat", self.rejected):
            return ps_pb2.HeartbeatResponse(version=self.shard.heartbeat(request.worker_id))

    def Init(
        self, request_iterator: Iterator[ps_pb2.InitMessage], context: grpc.ServicerContext
    ) -> ps_pb2.InitResponse:
        try:
            with rpc_errors(context, "Init", self.rejected), self.shard.initialising():
                stream = self._stream(request_iterator, self._init_stream, "InitMessage", context)
                header = stream.header()
                self.shard.check_worker(header.worker_id)
                model = self.shard.prepare_init(
                    specs_from_proto(header.specs),
                    header.num_shards,
                    header.model_digest,
                )
                stream.receive(model.views(model.params.numpy()), model.labels, header.dtype)
                return ps_pb2.InitResponse(version=self.shard.commit_init(model))
        finally:
            # An Init, taken or refused, leaves the slices gRPC read its stream into free but resident.
            heap.release_free_memory()

    def _timeout(self, context: grpc.ServicerContext) -> float:
        """How long a pull may wait: the shard's limit, or less if the call's deadline comes first."""
        remaining = context.time_remaining()
        limit = self.shard.config.pull_timeout
        return limit if remaining is None else min(remaining, limit)

    def _min_version(self, min_version: int, incarnation: str) -> int:
        # A version asked of an earlier incarnation (the shard restarted from an older checkpoint since) may never
        # come: answer with the current weights instead.
        stale = bool(incarnation) and incarnation != self.shard.incarnation
        return 0 if stale else min_version

    def Pull(self, request: ps_pb2.PullRequest, context: grpc.ServicerContext) -> Iterator[bytes]:
        with rpc_errors(context, "Pull", self.rejected):
            dtype = wire_dtype(request.dtype)
            min_version = self._min_version(request.min_version, request.incarnation)
            with self.shard.weights(min_version, self._timeout(context), request.worker_id) as (version, model, flat):
                header = ps_pb2.PullHeader(
                    version=version, model_digest=model.digest, incarnation=self.shard.incarnation
                )
                yield ps_pb2.PullMessage(header=header).SerializeToString()
                sent = 0
                for piece, offset, data in iter_chunks(model.views(flat), dtype, reuse=True):
                    sent += len(data)
                    yield codec.encode_chunk(piece, offset, data)
            self.shard.metrics.pulls.inc()
            self.shard.metrics.bytes_out.inc(sent)

    def Push(
        self, request_iterator: Iterator[ps_pb2.PushMessage], context: grpc.ServicerContext
    ) -> ps_pb2.PushResponse:
        with rpc_errors(context, "Push", self.rejected):
            stream = self._stream(request_iterator, self._push_stream, "PushMessage", context)
            header = stream.header()
            model = self.shard.require_model(header.model_digest)
            self.shard.check_worker(header.worker_id)
            with self.shard.scratch() as grad:
                stream.receive(model.views(grad), model.labels, header.dtype)
                version, applied = self.shard.push(
                    header.worker_id, header.step, header.base_version, grad, header.model_digest, lent=True
                )
            self.shard.metrics.bytes_in.inc(stream.bytes)
            return ps_pb2.PushResponse(version=version, applied=applied)

    def Attach(self, request: ps_pb2.AttachRequest, context: grpc.ServicerContext) -> ps_pb2.AttachResponse:
        with rpc_errors(context, "Attach", self.rejected):
            if request.socket:
                if not self.data_port:
                    raise DataSocketUnavailable(
                        f"shard {self.shard.index} serves no data socket (--no-data-socket): use the streams"
                    )
                self.shard.attach_socket(request.worker_id, request.nonce, request.elements, request.model_digest)
                return ps_pb2.AttachResponse(data_port=self.data_port)
            self.shard.attach(request.worker_id, request.name, request.nonce, request.elements, request.model_digest)
            return ps_pb2.AttachResponse(doorbell=self.doorbell)

    def Exchange(self, request: ps_pb2.ExchangeRequest, context: grpc.ServicerContext) -> ps_pb2.ExchangeResponse:
        with rpc_errors(context, "Exchange", self.rejected):
            return self.exchange(request, self._timeout(context))

    def payload_limit(self) -> int:
        """The most payload bytes a data-socket frame may carry: the shard's part of the model in float32."""
        model = self.shard.model
        return 0 if model is None else model.numel * 4

    def exchange_frame(self, request: ps_pb2.ExchangeRequest, timeout: float, payload: Payload) -> Reply:
        """An Exchange from a doorbell or data-socket connection: through the worker's segment, or with the
        gradient in the frame's payload and the weights in the reply's (a worker on another host)."""
        model = self.shard.require_model(request.model_digest)
        if request.inline:
            raise MalformedStream("inline Exchanges go over gRPC; a data socket carries the tensors as payloads")
        if isinstance(self.shard.attachment(request.worker_id, model), shm.Segment):
            if payload.size:
                raise MalformedStream("the gradient of a worker with a segment travels in the segment, not the frame")
            return Reply(self.exchange(request, timeout))
        dtype = wire_dtype(request.dtype)
        reply = ps_pb2.ExchangeResponse()
        if request.push:

            def fill(grad: np.ndarray) -> None:
                payload.read_into([grad], dtype)
                check_finite(model.views(grad), model.labels)

            reply.version, reply.applied = self._push_scratch(request, fill)
            self.shard.metrics.bytes_in.inc(payload.size)
        elif payload.size:
            raise MalformedStream("an Exchange without push carries no gradient payload")
        if not request.pull:
            return Reply(reply)
        lent = contextlib.ExitStack()  # the weights stay lent until the reply's payload is sent
        try:
            held, flat = lent.enter_context(
                self._pulling(request, reply, _clamp(timeout, self.shard.config.pull_timeout))
            )
        except BaseException:
            lent.close()
            raise
        self.shard.metrics.bytes_out.inc(held.numel * itemsize(dtype))
        return Reply(reply, [flat], dtype, release=lent.close)

    def exchange(self, request: ps_pb2.ExchangeRequest, timeout: float) -> ps_pb2.ExchangeResponse:
        """Push and/or pull through the worker's attached segment, or inline (for the Exchange RPC and the
        doorbell); a pull waits at most `timeout` seconds, and never longer than the shard's pull_timeout."""
        timeout = _clamp(timeout, self.shard.config.pull_timeout)
        model = self.shard.require_model(request.model_digest)
        if request.inline:
            return self._exchange_inline(request, model, timeout)
        segment = self.shard.segment(request.worker_id, model)
        reply = ps_pb2.ExchangeResponse()
        if request.push:
            # Validated and applied in place, with no scratch buffer: only the worker's own user can open its
            # memfd (through /proc), and could as well write into this process; the client never touches the
            # segment during a call.
            check_finite(model.views(segment.grad), model.labels)
            reply.version, reply.applied = self.shard.push(
                request.worker_id, request.step, request.base_version, segment.grad, request.model_digest
            )
            self.shard.metrics.bytes_in.inc(segment.grad.nbytes)
        if request.pull:
            min_version = self._min_version(request.min_version, request.incarnation)
            reply.pulled.version = self.shard.pull_into(segment.weights, min_version, timeout, request.worker_id)
            reply.pulled.model_digest = model.digest
            reply.pulled.incarnation = self.shard.incarnation
            self.shard.metrics.pulls.inc()
            self.shard.metrics.bytes_out.inc(segment.weights.nbytes)
        return reply

    def _push_scratch(self, request: ps_pb2.ExchangeRequest, fill: Callable[[np.ndarray], None]) -> tuple[int, bool]:
        """Push a gradient that `fill` writes (and validates) into a scratch buffer: a refusal changes nothing."""
        self.shard.check_worker(request.worker_id)
        with self.shard.scratch() as grad:
            fill(grad)
            return self.shard.push(
                request.worker_id, request.step, request.base_version, grad, request.model_digest, lent=True
            )

    @contextlib.contextmanager
    def _pulling(
        self, request: ps_pb2.ExchangeRequest, reply: ps_pb2.ExchangeResponse, timeout: float
    ) -> Iterator[tuple[ShardModel, np.ndarray]]:
        """Wait for the version a pull asks for; note it in the reply; lend the model and its weights to send."""
        min_version = self._min_version(request.min_version, request.incarnation)
        with self.shard.weights(min_version, timeout, request.worker_id) as (version, held, flat):
            reply.pulled.version = version
            reply.pulled.model_digest = held.digest
            reply.pulled.incarnation = self.shard.incarnation
            self.shard.metrics.pulls.inc()
            yield held, flat

    def _exchange_inline(
        self, request: ps_pb2.ExchangeRequest, model: ShardModel, timeout: float
    ) -> ps_pb2.ExchangeResponse:
        """Exchange with the tensors in the messages (a small model, a worker without a segment)."""
        size = request.ByteSize()
        if size > self.shard.config.max_message_bytes:
            raise TooLarge(
                f"an inline Exchange of {size} bytes is over the limit of {self.shard.config.max_message_bytes} "
                f"(max_message_bytes); use the Push and Pull streams"
            )
        dtype = wire_dtype(request.dtype)
        reply = ps_pb2.ExchangeResponse()
        if request.push:

            def fill(grad: np.ndarray) -> None:
                receiver = ChunkReceiver(model.views(grad), model.labels, dtype, check_finite=True)
                for chunk in request.chunks:
                    receiver.add(chunk.piece, chunk.offset, memoryview(chunk.data))
                receiver.finish()

            reply.version, reply.applied = self._push_scratch(request, fill)
            self.shard.metrics.bytes_in.inc(size)
        elif request.chunks:
            raise MalformedStream("an Exchange without push carries no gradient chunks")
        if request.pull:
            with self._pulling(request, reply, timeout) as (held, flat):
                for piece, offset, data in iter_chunks(held.views(flat), dtype, reuse=True):
                    reply.chunks.add(piece=piece, offset=offset, data=bytes(data))
            self.shard.metrics.bytes_out.inc(reply.ByteSize())
        return reply


def _clamp(timeout: float, limit: float) -> float:
    """A pull's wait: the caller's timeout within [0, limit]; NaN or inf mean the limit."""
    return min(max(timeout, 0.0), limit) if math.isfinite(timeout) else limit


def add_to_server(servicer: ParameterServerServicer, server: grpc.Server) -> None:
    """Register the servicer for every RPC of the proto. Every request arrives as raw wire bytes, decoded and
    bound-checked by paramserver.bounds (unary requests: see ParameterServerServicer.decoding; client streams: see
    ClientStream), so that no malformed request gets gRPC's own INTERNAL; server streams yield bytes."""
    service = ps_pb2.DESCRIPTOR.services_by_name["ParameterServer"]
    kinds = {
        (False, False): grpc.unary_unary_rpc_method_handler,
        (False, True): grpc.unary_stream_rpc_method_handler,
        (True, False): grpc.stream_unary_rpc_method_handler,
    }
    handlers = {}
    for method in service.methods:
        request = getattr(ps_pb2, method.input_type.name)
        response = getattr(ps_pb2, method.output_type.name)
        make = kinds[(method.client_streaming, method.server_streaming)]
        behaviour = getattr(servicer, method.name)
        handlers[method.name] = make(
            behaviour if method.client_streaming else servicer.decoding(method.name, request, behaviour),
            request_deserializer=None,
            response_serializer=None if method.server_streaming else response.SerializeToString,
        )
    server.add_generic_rpc_handlers((grpc.method_handlers_generic_handler(service.full_name, handlers),))
