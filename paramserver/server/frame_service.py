"""The doorbell's and the data socket's Exchanges (paramserver.transport.socket_server): the frame transport's
counterpart of the gRPC servicer, a thin layer from frames to the exchange handler."""

from __future__ import annotations

from collections.abc import Callable

from paramserver.errors import MalformedStream
from paramserver.server.exchange import (
    CompressedGradient,
    ExchangeHandler,
    LentWeights,
    PayloadGradient,
    Want,
    segment_route,
)
from paramserver.shard.sparse.tables import MAX_ROWS_BYTES
from paramserver.transport import shm
from paramserver.v1 import ps_pb2
from paramserver.wire.carriers import Carrier, check_fields
from paramserver.wire.chunks import FLOAT32, wire_dtype
from paramserver.wire.frames import Payload, Reply


class FrameService:
    """Verify a connection's hello and answer its Exchange frames, for one shard."""

    def __init__(self, handler: ExchangeHandler) -> None:
        self.handler = handler
        self.shard = handler.shard

    def verify(self, hello: ps_pb2.AttachRequest, close: Callable[[], None]) -> None:
        """Accept a connection that presents its worker's attachment, once (NotAttached otherwise); `close` ends
        it when the attachment ends."""
        kind = str(hello.WhichOneof("kind"))
        self.shard.attachments.verify(hello.worker_id, kind, hello.shared_memory.name, hello.nonce, close)

    def payload_limit(self, request: ps_pb2.ExchangeRequest | None = None) -> int:
        """The most payload bytes a data-socket frame carrying `request` may have (SPEC 10.3 and 16): the shard's part
        of the model in float32, plus the bytes of the rows and IDs the request announces (at most MAX_ROWS_BYTES);
        without a request (one that could not be decoded), MAX_ROWS_BYTES where the model has tables. Past it the
        frame is RESOURCE_EXHAUSTED and its connection ends, whatever the push's compression."""
        model = self.shard.model
        return 0 if model is None else model.numel * 4 + self.rows_payload_limit(request)

    def rows_payload_limit(self, request: ps_pb2.ExchangeRequest | None = None) -> int:
        """The most payload bytes a doorbell frame may carry (its dense part is in the segment): the rows and IDs
        `request` announces, of a model with tables."""
        model = self.shard.model
        if model is None or not model.tables:
            return 0
        if request is None:
            return MAX_ROWS_BYTES
        specs = model.tables.specs
        widest = max(s.dim for s in specs)
        total = 0
        for entries, values in ((request.rows, True), (request.lookup, False)):
            for e in entries:
                # An unknown table is refused by the handler (InvalidArgument, the connection in step): its rows are
                # allowed the widest table's bytes here, so that the refusal is that one and not this bound's.
                dim = specs[e.table].dim if e.table < len(specs) else widest
                total += e.count * (8 + (4 * dim if values else 0))
        return min(total, MAX_ROWS_BYTES)

    def exchange(self, request: ps_pb2.ExchangeRequest, timeout: float, payload: Payload) -> Reply:
        """An Exchange from a doorbell or data-socket connection: through the worker's segment, or with the
        gradient in the frame's payload and the weights in the reply's (a worker on another host), lent until
        the reply is sent."""
        want = Want.of(request)
        model = self.handler.model(request.model_digest)
        attached = self.shard.attachments.get(request.worker_id, model)
        check_fields(request, Carrier.SEGMENT if isinstance(attached, shm.Segment) else Carrier.PAYLOAD)
        sparse = model.tables.plan(request.rows, request.lookup)
        if isinstance(attached, shm.Segment):
            # The dense part travels in the segment; the payload holds the rows and IDs alone.
            payload.read_into([], FLOAT32, sparse.targets())
            source, sink = segment_route(attached, request, model)
            reply = self.handler.exchange(want, model, source, sink, timeout, sparse)
            return Reply(reply, raw=sparse.answers)
        dtype = wire_dtype(request.dtype)
        if request.HasField("compression"):
            source = CompressedGradient(payload, dtype, request.compression, sparse.targets())
        elif request.push:
            source = PayloadGradient(payload, dtype, sparse.targets(), last_first=request.last_piece_first)
        else:
            if payload.size != sparse.nbytes:
                raise MalformedStream(
                    f"an Exchange without push carries no gradient payload ({payload.size} bytes where its rows and "
                    f"IDs take {sparse.nbytes})"
                )
            source = None
            payload.read_into([], dtype, sparse.targets())  # a pull or lookup carries no gradient: IDs at most
        lent = LentWeights(dtype) if request.pull else None
        reply = self.handler.exchange(want, model, source, lent, timeout, sparse)
        if lent is None:
            return Reply(reply, raw=sparse.answers)
        return Reply(reply, [lent.flat], dtype, raw=sparse.answers, release=lent.release)
