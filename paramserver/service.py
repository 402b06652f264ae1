"""The gRPC servicer: a thin layer from RPCs to Shard calls; every error goes through errors.rpc_errors."""

from __future__ import annotations

from collections.abc import Iterable, Iterator
from typing import Any

import grpc

from paramserver.errors import InvalidArgument, MalformedStream, rpc_errors
from paramserver.placement import SLICE_ELEMENTS, TensorSpec
from paramserver.shard import Shard
from paramserver.v1 import ps_pb2, ps_pb2_grpc
from paramserver.wire import ChunkReceiver, iter_chunks, wire_dtype

_MODES = {"sync": ps_pb2.SYNC, "async": ps_pb2.ASYNC}


def _header(stream: Iterator[Any], kind: str) -> Any:
    """Return the header that must open a client stream."""
    first = next(stream, None)
    if first is None or first.WhichOneof("kind") != "header":
        raise MalformedStream(f"a {kind} stream must start with its header")
    return first.header


def _receive(stream: Iterator[Any], receiver: ChunkReceiver) -> None:
    """Feed every remaining message of a client stream, all chunks, into the receiver."""
    for msg in stream:
        if msg.WhichOneof("kind") != "chunk":
            raise MalformedStream("only chunks may follow the header")
        chunk = msg.chunk
        receiver.add(chunk.piece, chunk.offset, chunk.data)
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

    def GetTopology(self, request: ps_pb2.GetTopologyRequest, context: grpc.ServicerContext) -> ps_pb2.Topology:
        with rpc_errors(context, "GetTopology"):
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
        with rpc_errors(context, "Join"):
            rank, version = self.shard.join(request.worker_id, request.job_name)
            return ps_pb2.JoinResponse(rank=rank, world_size=self.shard.config.workers, version=version)

    def Leave(self, request: ps_pb2.LeaveRequest, context: grpc.ServicerContext) -> ps_pb2.LeaveResponse:
        with rpc_errors(context, "Leave"):
            self.shard.leave(request.worker_id)
            return ps_pb2.LeaveResponse()

    def Init(
        self, request_iterator: Iterator[ps_pb2.InitMessage], context: grpc.ServicerContext
    ) -> ps_pb2.InitResponse:
        with rpc_errors(context, "Init"):
            header = _header(request_iterator, "Init")
            self.shard.check_worker(header.worker_id)
            model = self.shard.prepare_init(
                specs_from_proto(header.specs),
                header.num_shards,
                header.model_digest,
            )
            receiver = ChunkReceiver(
                model.views(model.params.numpy()), model.labels, wire_dtype(header.dtype), check_finite=True
            )
            _receive(request_iterator, receiver)
            return ps_pb2.InitResponse(version=self.shard.commit_init(model))

    def Pull(self, request: ps_pb2.PullRequest, context: grpc.ServicerContext) -> Iterator[ps_pb2.PullMessage]:
        with rpc_errors(context, "Pull"):
            dtype = wire_dtype(request.dtype)
            remaining = context.time_remaining()
            timeout = (
                self.shard.config.pull_timeout if remaining is None else min(remaining, self.shard.config.pull_timeout)
            )
            version, model = self.shard.wait_for(request.min_version, timeout, request.worker_id)
            yield ps_pb2.PullMessage(header=ps_pb2.PullHeader(version=version, model_digest=model.digest))
            for piece, offset, data in iter_chunks(model.views(model.params.numpy()), dtype):
                yield ps_pb2.PullMessage(chunk=ps_pb2.Chunk(piece=piece, offset=offset, data=data))

    def Push(
        self, request_iterator: Iterator[ps_pb2.PushMessage], context: grpc.ServicerContext
    ) -> ps_pb2.PushResponse:
        with rpc_errors(context, "Push"):
            header = _header(request_iterator, "Push")
            model = self.shard.require_model(header.model_digest)
            self.shard.check_worker(header.worker_id)
            with self.shard.scratch() as grad:
                receiver = ChunkReceiver(
                    model.views(grad),
                    model.labels,
                    wire_dtype(header.dtype),
                    check_finite=True,
                )
                _receive(request_iterator, receiver)
                version, applied = self.shard.push(
                    header.worker_id,
                    header.step,
                    header.base_version,
                    grad,
                    header.model_digest,
                )
            return ps_pb2.PushResponse(version=version, applied=applied)
