"""The gRPC servicer: a thin layer from RPCs to the Shard and the exchange handler (paramserver.server.exchange);
every error goes through errors.rpc_errors."""

from __future__ import annotations

import math
from collections.abc import Callable, Iterable, Iterator, Sequence
from dataclasses import dataclass
from typing import Any

import grpc
import numpy as np

from paramserver import modes
from paramserver.errors import DataSocketUnavailable, InvalidArgument, MalformedStream, TooLarge, rpc_errors
from paramserver.placement import SLICE_ELEMENTS
from paramserver.server import heap
from paramserver.server.exchange import (
    ChunksGradient,
    ChunksWeights,
    ExchangeHandler,
    GradientSource,
    LentWeights,
    StreamGradient,
    Want,
    WeightsSink,
    segment_route,
)
from paramserver.server.export import Exports, export_rows
from paramserver.server.follow import Followers
from paramserver.server.streams import SharedWeights, StreamGate, caps
from paramserver.shard import schedules
from paramserver.shard.model import ShardModel
from paramserver.shard.sparse.given_rows import GivenRows
from paramserver.shard.sparse.sparse_in import SparseIn
from paramserver.shard.state import Shard
from paramserver.tables import TableSpec, spec_from_proto, spec_to_proto
from paramserver.v1 import ps_pb2, ps_pb2_grpc
from paramserver.wire import bounds, codec
from paramserver.wire.carriers import Carrier, check_fields
from paramserver.wire.chunks import CHUNK_BYTES, ChunkReceiver, itemsize, wire_dtype
from paramserver.wire.specs import specs_from_proto, specs_to_proto


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
        return self._decode(data)  # Undecodable, OutOfBounds (see paramserver.wire.bounds)

    def header(self) -> Any:
        """Return the header that must open the stream."""
        first = self._next()
        if first is None or isinstance(first, codec.Chunk) or first.WhichOneof("kind") != "header":
            raise MalformedStream(f"a {self._kind} stream must start with its header")
        return first.header

    def receive(
        self,
        targets: Sequence[np.ndarray],
        names: Sequence[str],
        dtype: int,
        rows: Callable[[ps_pb2.Rows], None] | None = None,
    ) -> None:
        """Write every remaining message, all chunks, into the targets (validated, NaN/Inf refused by a
        ChunkReceiver), and hand any Rows message to `rows` (an Init's given rows); raise unless the chunks end up
        complete."""
        receiver = ChunkReceiver(targets, names, wire_dtype(dtype), check_finite=True)
        while (msg := self._next()) is not None:
            if isinstance(msg, codec.Chunk):
                receiver.add(msg.piece, msg.offset, msg.data)
            elif rows is not None and msg.WhichOneof("kind") == "rows":
                rows(msg.rows)
            else:
                raise MalformedStream("only chunks" + (" and rows" if rows else "") + " may follow the header")
        receiver.finish()


def tables_from_proto(tables: Iterable[ps_pb2.TableSpec]) -> list[TableSpec]:
    """Convert wire table specs, refusing (InvalidArgument) values outside their ranges."""
    try:
        return [spec_from_proto(t) for t in tables]
    except ValueError as exc:
        raise InvalidArgument(str(exc)) from None


@dataclass
class Endpoints:
    """Where a shard's frame transports listen, as Attach announces them to workers.

    The ShardServer that opens the doorbell and the data socket creates this, hands it to the servicer at
    construction, and fills in each field once that transport listens; the servicer only reads it. Empty: none
    (not yet, or disabled).
    """

    doorbell: str = ""  # the doorbell's abstract Unix socket address (paramserver.transport.socket_server)
    data_port: int = 0  # the data socket's TCP port


class ParameterServerServicer(ps_pb2_grpc.ParameterServerServicer):
    """Serve one Shard over gRPC: decode, pick an exchange's gradient source and weights sink, call the handler."""

    def __init__(
        self, shard: Shard, endpoints: Endpoints | None = None, handler: ExchangeHandler | None = None
    ) -> None:
        self.shard = shard
        self.endpoints = endpoints or Endpoints()
        self.handler = handler or ExchangeHandler(shard)
        self._init_stream = bounds.stream_decoder(ps_pb2.InitMessage, "Init")
        self._push_stream = bounds.stream_decoder(ps_pb2.PushMessage, "Push")
        # Pull and ExportRows streams: capped, and cancelled when their reader stalls (paramserver.server.streams);
        # exports of one table at one version share one copy.
        self.streams = StreamGate(*caps(shard.config.workers))
        self.exports = Exports()
        self.followers = Followers(shard)  # serving copies' feeds (ps-serve)

    # Read (and, by tests, redirected) through the servicer; the ShardServer sets them in `endpoints`.
    @property
    def doorbell(self) -> str:
        """The doorbell address Attach announces ("": none)."""
        return self.endpoints.doorbell

    @property
    def data_port(self) -> int:
        """The data-socket port Attach announces (0: none)."""
        return self.endpoints.data_port

    @data_port.setter
    def data_port(self, port: int) -> None:
        self.endpoints.data_port = port

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
            with rpc_errors(context, rpc, self.handler.rejected):
                limit = self.shard.config.max_message_bytes
                if len(raw) > limit:
                    raise TooLarge(
                        f"{rpc}: a {kind} of {len(raw)} bytes is over the limit of {limit} (max_message_bytes)"
                    )
                request = decode(raw)
            return behaviour(request, context)

        return handle

    def GetTopology(self, request: ps_pb2.GetTopologyRequest, context: grpc.ServicerContext) -> ps_pb2.Topology:
        with rpc_errors(context, "GetTopology", self.handler.rejected):
            c = self.shard.config
            d = self.shard.describe()
            return ps_pb2.Topology(
                shards=self.shard.addresses,
                shard_index=self.shard.index,
                job=ps_pb2.JobInfo(
                    mode=modes.mode_wire(c.mode),
                    workers=c.workers,
                    optimizer=c.optimizer,
                    job_name=c.job_name,
                    **{name: getattr(c, name) for name in schedules.FIELDS},
                ),
                initialized=d.initialized,
                model_digest=d.digest,
                specs=specs_to_proto(d.specs),
                version=d.version,
                slice_elements=SLICE_ELEMENTS,
                tables=[spec_to_proto(t) for t in d.tables],
                replicas=self.shard.replica_addresses,
            )

    def Join(self, request: ps_pb2.JoinRequest, context: grpc.ServicerContext) -> ps_pb2.JoinResponse:
        with rpc_errors(context, "Join", self.handler.rejected):
            rank, version = self.shard.join(request.worker_id, request.job_name)
            return ps_pb2.JoinResponse(
                rank=rank,
                world_size=self.shard.config.workers,
                version=version,
                lease_timeout_s=self.shard.config.lease_timeout,
                incarnation=self.shard.incarnation,
            )

    def Leave(self, request: ps_pb2.LeaveRequest, context: grpc.ServicerContext) -> ps_pb2.LeaveResponse:
        with rpc_errors(context, "Leave", self.handler.rejected):
            self.shard.leave(request.worker_id, request.finished)
            return ps_pb2.LeaveResponse()

    def Heartbeat(self, request: ps_pb2.HeartbeatRequest, context: grpc.ServicerContext) -> ps_pb2.HeartbeatResponse:
        with rpc_errors(context, "Heartbeat", self.handler.rejected):
            return ps_pb2.HeartbeatResponse(version=self.shard.heartbeat(request.worker_id, request.idle))

    def Claim(self, request: ps_pb2.ClaimRequest, context: grpc.ServicerContext) -> ps_pb2.ClaimResponse:
        with rpc_errors(context, "Claim", self.handler.rejected):
            finish = request.finish if request.HasField("finish") else -1
            holding = request.holding if request.HasField("holding") else -1
            shard = self.shard.claim(
                request.worker_id, request.job_name, request.dataset, request.listed, finish, request.samples, holding
            )
            return ps_pb2.ClaimResponse(shard=-1 if shard is None else shard, version=self.shard.version)

    def Claims(self, request: ps_pb2.ClaimsRequest, context: grpc.ServicerContext) -> ps_pb2.ClaimsRecord:
        with rpc_errors(context, "Claims", self.handler.rejected):
            dataset, entries = self.shard.claim_record()
            claims = [
                ps_pb2.ShardClaim(shard=c.shard, state=c.state, worker_id=c.worker, tries=c.tries, samples=c.samples)
                for c in entries
            ]
            return ps_pb2.ClaimsRecord(dataset=dataset, claims=claims)

    def Init(
        self, request_iterator: Iterator[ps_pb2.InitMessage], context: grpc.ServicerContext
    ) -> ps_pb2.InitResponse:
        try:
            with rpc_errors(context, "Init", self.handler.rejected), self.shard.initialising():
                stream = self._stream(request_iterator, self._init_stream, "InitMessage", context)
                header = stream.header()
                self.shard.check_worker(header.worker_id)
                model = self.shard.prepare_init(
                    specs_from_proto(header.specs),
                    header.num_shards,
                    header.model_digest,
                    tables_from_proto(header.tables),
                )
                given = GivenRows(model.tables)
                stream.receive(model.views(model.params.numpy()), model.labels, header.dtype, given.add)
                given.finish()
                return ps_pb2.InitResponse(version=self.shard.commit_init(model))
        finally:
            # An Init, taken or refused, leaves the slices gRPC read its stream into free but resident.
            heap.release_free_memory()

    def _timeout(self, context: grpc.ServicerContext) -> float:
        """How long a pull may wait: the call's deadline (the handler caps it at the shard's pull_timeout)."""
        remaining = context.time_remaining()
        return math.inf if remaining is None else remaining

    def Pull(self, request: ps_pb2.PullRequest, context: grpc.ServicerContext) -> Iterator[bytes]:
        with rpc_errors(context, "Pull", self.handler.rejected), self.streams.open(context, "Pull") as stream:
            want = Want(request.worker_id, None, min_version=request.min_version, incarnation=request.incarnation)
            sink = SharedWeights(wire_dtype(request.dtype), self.streams.weights)
            reply = self.handler.exchange(want, None, None, sink, self._timeout(context))
            try:
                yield from stream.sent(self._pulled(reply, sink))
            finally:
                sink.release()

    @staticmethod
    def _pulled(reply: ps_pb2.ExchangeResponse, sink: LentWeights) -> Iterator[bytes]:
        yield ps_pb2.PullMessage(header=reply.pulled).SerializeToString()
        for piece, offset, data in sink.chunks():
            yield codec.encode_chunk(piece, offset, data)

    def ExportRows(self, request: ps_pb2.ExportRowsRequest, context: grpc.ServicerContext) -> Iterator[bytes]:
        r = request
        with rpc_errors(context, "ExportRows", self.handler.rejected), self.streams.open(context, "ExportRows") as s:
            rows = export_rows(
                self.shard, r.model_digest, r.table, r.optimizer_state, r.header_only, exports=self.exports
            )
            yield from s.sent(m.SerializeToString() for m in rows)

    def Follow(self, request: ps_pb2.FollowRequest, context: grpc.ServicerContext) -> Iterator[bytes]:
        with rpc_errors(context, "Follow", self.handler.rejected), self.followers.gate.open(context, "Follow") as s:
            yield from s.sent(self.followers.follow(request))

    def Push(
        self, request_iterator: Iterator[ps_pb2.PushMessage], context: grpc.ServicerContext
    ) -> ps_pb2.PushResponse:
        with rpc_errors(context, "Push", self.handler.rejected):
            stream = self._stream(request_iterator, self._push_stream, "PushMessage", context)
            header = stream.header()
            want = Want(header.worker_id, header.model_digest, header.step, header.base_version)
            model = self.handler.model(header.model_digest)
            sparse = self._inline_sparse(model, header.rows, ())
            source = StreamGradient(stream, header.dtype)
            reply = self.handler.exchange(want, model, source, None, self._timeout(context), sparse)
            return ps_pb2.PushResponse(version=reply.version, applied=reply.applied)

    def Attach(self, request: ps_pb2.AttachRequest, context: grpc.ServicerContext) -> ps_pb2.AttachResponse:
        with rpc_errors(context, "Attach", self.handler.rejected):
            kind = request.WhichOneof("kind")
            if kind is None:
                raise InvalidArgument("an AttachRequest names its kind: shared_memory or data_socket")
            attachments = self.shard.attachments
            if kind == "data_socket":
                port = self.endpoints.data_port
                if not port:
                    raise DataSocketUnavailable(
                        f"shard {self.shard.index} serves no data socket (--no-data-socket): use the streams"
                    )
                attachments.attach_socket(request.worker_id, request.nonce, request.elements, request.model_digest)
                return ps_pb2.AttachResponse(data_port=port)
            name = request.shared_memory.name
            attachments.attach_segment(request.worker_id, name, request.nonce, request.elements, request.model_digest)
            return ps_pb2.AttachResponse(doorbell=self.endpoints.doorbell)

    def Exchange(self, request: ps_pb2.ExchangeRequest, context: grpc.ServicerContext) -> ps_pb2.ExchangeResponse:
        with rpc_errors(context, "Exchange", self.handler.rejected):
            model = self.handler.model(request.model_digest)
            check_fields(request, Carrier.GRPC)
            if request.inline:
                source, sink = self._inline_route(request, model)
            elif request.push or request.pull:
                source, sink = segment_route(self.shard.attachments.segment(request.worker_id, model), request, model)
            else:
                source, sink = None, None  # a lookup alone needs no segment
            sparse = self._inline_sparse(model, request.rows, request.lookup)
            reply = self.handler.exchange(Want.of(request), model, source, sink, self._timeout(context), sparse)
            if sparse is not None:
                sparse.answer_inline(reply)
            return reply

    def _inline_sparse(
        self, model: ShardModel, rows: Sequence[ps_pb2.Rows], lookups: Sequence[ps_pb2.Rows]
    ) -> SparseIn | None:
        """The rows and lookups a gRPC message carries, received from its bytes (checked by the handler). Looked-up
        rows that would not fit one reply message are refused (TooLarge) before anything is applied."""
        if not rows and not lookups:
            return None
        sparse = model.tables.plan(rows, lookups)
        answer = sum(b.ids.size * 4 * model.tables.specs[b.table].dim for b in sparse.lookups)
        limit = self.shard.config.max_message_bytes
        if answer + 64 * 1024 > limit:
            raise TooLarge(
                f"the rows looked up ({answer} bytes) would not fit one message of {limit} bytes (max_message_bytes): "
                "look up fewer IDs per call"
            )
        sparse.fill_inline(rows, lookups)
        return sparse

    def _inline_route(
        self, request: ps_pb2.ExchangeRequest, model: ShardModel
    ) -> tuple[GradientSource | None, WeightsSink | None]:
        """The source and sink of an Exchange with the tensors in its messages (a small model, a worker with no
        segment). A reply that could not fit one message is refused before the push, not after it applied."""
        size, limit = request.ByteSize(), self.shard.config.max_message_bytes
        if size > limit:
            raise TooLarge(
                f"an inline Exchange of {size} bytes is over the limit of {limit} (max_message_bytes); use the Push "
                "and Pull streams"
            )
        dtype = wire_dtype(request.dtype)
        if request.pull:
            # The weights, and at most a chunk message's framing per piece and per MiB, and the reply's header.
            reply = model.numel * itemsize(dtype) + 32 * (len(model.pieces) + model.numel * 4 // CHUNK_BYTES) + 1024
            if reply > limit:
                raise TooLarge(
                    f"an inline pull of this shard's part ({model.numel * itemsize(dtype)} bytes) would not fit one "
                    f"message of {limit} bytes (max_message_bytes); pull with the Pull stream"
                )
        return (
            ChunksGradient(request.chunks, dtype, size) if request.push else None,
            ChunksWeights(dtype) if request.pull else None,
        )


def method_handler(method: Any) -> Callable[..., grpc.RpcMethodHandler]:
    """grpc's maker of a handler for this RPC's stream shape (a MethodDescriptor of ps.proto)."""
    return {
        (False, False): grpc.unary_unary_rpc_method_handler,
        (False, True): grpc.unary_stream_rpc_method_handler,
        (True, False): grpc.stream_unary_rpc_method_handler,
    }[(method.client_streaming, method.server_streaming)]


def add_to_server(servicer: ParameterServerServicer, server: grpc.Server) -> None:
    """Register the servicer for every RPC of the proto. Every request arrives as raw wire bytes, decoded and
    bound-checked by paramserver.wire.bounds (unary requests: see ParameterServerServicer.decoding; client streams: see
    ClientStream), so that no malformed request gets gRPC's own INTERNAL; server streams yield bytes."""
    service = ps_pb2.DESCRIPTOR.services_by_name["ParameterServer"]
    handlers = {}
    for method in service.methods:
        request = getattr(ps_pb2, method.input_type.name)
        response = getattr(ps_pb2, method.output_type.name)
        make = method_handler(method)
        behaviour = getattr(servicer, method.name)
        handlers[method.name] = make(
            behaviour if method.client_streaming else servicer.decoding(method.name, request, behaviour),
            request_deserializer=None,
            response_serializer=None if method.server_streaming else response.SerializeToString,
        )
    server.add_generic_rpc_handlers((grpc.method_handlers_generic_handler(service.full_name, handlers),))
