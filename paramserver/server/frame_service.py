"""The doorbell's and the data socket's Exchanges (paramserver.transport.socket_server): the frame transport's
counterpart of the gRPC servicer, a thin layer from frames to the exchange handler."""

from __future__ import annotations

from collections.abc import Callable

from paramserver.errors import MalformedStream
from paramserver.server.exchange import ExchangeHandler, LentWeights, PayloadGradient, Want, segment_route
from paramserver.transport import shm
from paramserver.v1 import ps_pb2
from paramserver.wire.chunks import wire_dtype
from paramserver.wire.frames import Payload, Reply


class FrameService:
    """Verify a connection's hello and answer its Exchange frames, for one shard."""

    def __init__(self, handler: ExchangeHandler) -> None:
        self.handler = handler
        self.shard = handler.shard

    def verify(self, hello: ps_pb2.AttachRequest, close: Callable[[], None]) -> None:
        """Accept a connection that presents its worker's attachment, once (NotAttached otherwise); `close` ends
        it when the attachment ends."""
        self.shard.attachments.verify(hello.worker_id, hello.shared_memory.name, hello.nonce, close)

    def payload_limit(self) -> int:
        """The most payload bytes a data-socket frame may carry: the shard's part of the model in float32."""
        model = self.shard.model
        return 0 if model is None else model.numel * 4

    def exchange(self, request: ps_pb2.ExchangeRequest, timeout: float, payload: Payload) -> Reply:
        """An Exchange from a doorbell or data-socket connection: through the worker's segment, or with the
        gradient in the frame's payload and the weights in the reply's (a worker on another host), lent until
        the reply is sent."""
        want = Want.of(request)
        model = self.handler.model(request.model_digest)
        if request.inline:
            raise MalformedStream("inline Exchanges go over gRPC; a data socket carries the tensors as payloads")
        attached = self.shard.attachments.get(request.worker_id, model)
        if isinstance(attached, shm.Segment):
            if payload.size:
                raise MalformedStream("the gradient of a worker with a segment travels in the segment, not the frame")
            source, sink = segment_route(attached, request, model)
            return Reply(self.handler.exchange(want, model, source, sink, timeout))
        dtype = wire_dtype(request.dtype)
        if not request.push and payload.size:
            raise MalformedStream("an Exchange without push carries no gradient payload")
        source = PayloadGradient(payload, dtype) if request.push else None
        lent = LentWeights(dtype) if request.pull else None
        reply = self.handler.exchange(want, model, source, lent, timeout)
        if lent is None:
            return Reply(reply)
        return Reply(reply, [lent.flat], dtype, release=lent.release)
