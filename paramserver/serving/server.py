"""ps-serve's process: a serving copy of every shard of a running job (or of one: --shard-index), each following its
shard, answering the Serving service's reads and refusing every write of the ParameterServer service.

Reads take every shard copy's lock for the length of the read, so the rows of one answer are each shard's of one
version, whatever the followers apply meanwhile.
"""

from __future__ import annotations

import contextlib
import logging
import time
from collections.abc import Callable, Iterator, Sequence
from concurrent import futures
from typing import Any

import grpc
import numpy as np

from paramserver.errors import FailedPrecondition, InvalidArgument, ShuttingDown, TooLarge, rpc_errors
from paramserver.server.service import method_handler
from paramserver.serving.copy import ShardCopy
from paramserver.serving.follower import INTERVAL_S, Follower, wait_until
from paramserver.tables import TableSpec, shard_of, spec_from_proto, spec_to_proto
from paramserver.v1 import ps_pb2, ps_pb2_grpc
from paramserver.wire import bounds
from paramserver.wire.chunks import CHUNK_BYTES

log = logging.getLogger(__name__)

MAX_MESSAGE_BYTES = 4 << 20
_OPTIONS = [
    ("grpc.max_receive_message_length", MAX_MESSAGE_BYTES + 4096),
    ("grpc.max_send_message_length", MAX_MESSAGE_BYTES + 4096),
    ("grpc.initial_reconnect_backoff_ms", 100),
    ("grpc.max_reconnect_backoff_ms", 1000),
]
REFUSED = (
    "this is a serving copy (ps-serve): it answers reads only (the Serving service: Lookup, Pull, Status); "
    "point ps-worker at the training servers (ps-server) instead"
)


def channel_to(address: str) -> grpc.Channel:
    return grpc.insecure_channel(address, options=_OPTIONS)


class ServingCopies:
    """The serving copies of a job's shards, each following its shard."""

    def __init__(
        self, topology: ps_pb2.Topology, shards: Sequence[int] | None = None, interval: float = INTERVAL_S
    ) -> None:
        self.topology = topology
        self.num_shards = len(topology.shards)
        self.tables: tuple[TableSpec, ...] = tuple(spec_from_proto(t) for t in topology.tables)
        self._table_index = {t.name: i for i, t in enumerate(self.tables)}
        held = range(self.num_shards) if shards is None else shards
        wrong = sorted(set(held) - set(range(self.num_shards)))
        if wrong:
            raise InvalidArgument(f"no shard {wrong[0]}: the job has {self.num_shards} (0..{self.num_shards - 1})")
        self.copies: dict[int, ShardCopy] = {i: ShardCopy(i, self.tables) for i in held}
        replicas = list(topology.replicas)
        per = len(replicas) // self.num_shards if replicas else 0
        self.followers = [
            Follower(
                copy,
                replicas[i * per : (i + 1) * per] if per else [topology.shards[i]],
                channel_to,
                interval=interval,
            )
            for i, copy in self.copies.items()
        ]

    def start(self) -> None:
        for f in self.followers:
            f.start()

    def stop(self) -> None:
        for f in self.followers:
            f.stop(wait=False)  # all at once: each may be in a long poll
        for f in self.followers:
            f.stop()

    @property
    def ready(self) -> bool:
        return all(c.ready for c in self.copies.values())

    def wait_ready(self, timeout: float) -> bool:
        return wait_until(lambda: self.ready, timeout)

    @contextlib.contextmanager
    def one_version(self) -> Iterator[dict[int, ShardCopy]]:
        """Hold every copy's lock (in shard order): what is read meanwhile is each shard's of one version."""
        with contextlib.ExitStack() as stack:
            for i in sorted(self.copies):
                stack.enter_context(self.copies[i].lock)
            if not self.ready:
                raise ShuttingDown("the serving copies are not ready yet (taking their shards' state): try again")
            yield self.copies

    def table_index(self, name: str) -> int:
        if name not in self._table_index:
            known = ", ".join(self._table_index) or "none"
            raise InvalidArgument(f"no table named {name!r} (the model's tables: {known})")
        return self._table_index[name]

    def lookup(self, request: ps_pb2.LookupRequest) -> ps_pb2.LookupReply:
        """Each entry's rows, every shard's at one version."""
        asked = []
        total = 0
        for entry in request.tables:
            table = self.table_index(entry.table)
            if len(entry.ids) % 8:
                raise InvalidArgument(f"table {entry.table!r}: {len(entry.ids)} bytes of IDs, not a multiple of 8")
            ids = np.frombuffer(entry.ids, "<i8")
            spec = self.tables[table]
            if spec.bounded and len(ids) and (ids.min() < 0 or ids.max() >= spec.num_embeddings):
                raise InvalidArgument(f"table {entry.table!r}: IDs outside 0..{spec.num_embeddings - 1}")
            total += 4 * len(ids) * spec.dim
            asked.append((table, ids))
        if total > MAX_MESSAGE_BYTES:
            raise TooLarge(f"the rows asked for are {total} bytes, over the reply limit of {MAX_MESSAGE_BYTES}")
        # Every entry's IDs hashed to their shards at once; then each shard's part of every entry in one call.
        counts = [len(ids) for _, ids in asked]
        bounds = np.cumsum([0, *counts])
        owner = shard_of(np.concatenate([ids for _, ids in asked]), self.num_shards) if asked else np.empty(0, np.int64)
        with self.one_version() as copies:
            missing = {int(s) for s in np.unique(owner)} - set(copies)
            if missing:
                raise FailedPrecondition(f"this serving process holds no copy of shard(s) {sorted(missing)}")
            out = [np.empty((n, self.tables[t].dim), np.float32) for (t, _), n in zip(asked, counts, strict=True)]
            for s in np.unique(owner):
                mine = []
                for k, (table, ids) in enumerate(asked):
                    w = np.flatnonzero(owner[bounds[k] : bounds[k + 1]] == s)
                    if len(w):
                        mine.append((k, w, table, ids[w]))
                rows = copies[int(s)].lookup_many([(table, ids) for _, _, table, ids in mine])
                for (k, w, _, _), r in zip(mine, rows, strict=True):
                    out[k][w] = r
            versions = [copies[i].version if i in copies else 0 for i in range(self.num_shards)]
        return ps_pb2.LookupReply(versions=versions, rows=[r.astype("<f4", copy=False).tobytes() for r in out])

    def pull(self, request: ps_pb2.ServingPullRequest) -> Iterator[ps_pb2.ServingPullMessage]:
        with self.one_version() as copies:
            if request.shard not in copies:
                raise InvalidArgument(f"shard {request.shard}: this process holds copies of {sorted(copies)}")
            c = copies[request.shard]
            dense, version, digest = c.dense(), c.version, c.digest
        head = ps_pb2.FollowMessage.Header(version=version, model_digest=digest, dense_elements=len(dense))
        yield ps_pb2.ServingPullMessage(header=head)
        per = CHUNK_BYTES // 4
        for lo in range(0, len(dense), per):
            chunk = ps_pb2.FollowMessage.Dense(offset=lo, data=dense[lo : lo + per].astype("<f4").tobytes())
            yield ps_pb2.ServingPullMessage(dense=chunk)

    def status(self) -> ps_pb2.ServingStatus:
        now = time.monotonic()
        t = self.topology
        fresh = sorted(f for c in self.copies.values() for f in list(c.freshness))
        p50 = fresh[len(fresh) // 2] if fresh else 0.0
        p99 = fresh[min(len(fresh) - 1, int(len(fresh) * 0.99))] if fresh else 0.0
        return ps_pb2.ServingStatus(
            versions=[self.copies[i].version if i in self.copies else 0 for i in range(self.num_shards)],
            ready=self.ready,
            model_digest=t.model_digest,
            tables=[spec_to_proto(s) for s in self.tables],
            specs=list(t.specs),
            shards=self.num_shards,
            silent_seconds=[now - self.copies[i].heard if i in self.copies else 0.0 for i in range(self.num_shards)],
            freshness_p50=p50,
            freshness_p99=p99,
            freshness_answers=len(fresh),
        )


def _unary(rpc: str, message: type[Any], behaviour: Callable[[Any], Any], serialize: bool = True) -> Any:
    decode = bounds.decoder(message, rpc)

    def handle(raw: bytes, context: grpc.ServicerContext) -> Any:
        with rpc_errors(context, rpc):
            if len(raw) > MAX_MESSAGE_BYTES:
                raise TooLarge(f"{rpc}: a request of {len(raw)} bytes is over the limit of {MAX_MESSAGE_BYTES}")
            return behaviour(decode(raw))

    return handle


def _stream(rpc: str, message: type[Any], behaviour: Callable[[Any], Iterator[Any]]) -> Any:
    decode = bounds.decoder(message, rpc)

    def handle(raw: bytes, context: grpc.ServicerContext) -> Iterator[bytes]:
        with rpc_errors(context, rpc):
            for m in behaviour(decode(raw)):
                yield m.SerializeToString()

    return handle


def _refuse(rpc: str) -> Callable[..., Any]:
    def handle(request: Any, context: grpc.ServicerContext) -> Any:
        with rpc_errors(context, rpc):
            raise FailedPrecondition(f"{rpc} refused: {REFUSED}")

    return handle


def add_to_server(copies: ServingCopies, server: grpc.Server, address: str) -> None:
    """Register the Serving service and the refusing ParameterServer service for `copies` on `server`."""
    serving = {
        "Lookup": grpc.unary_unary_rpc_method_handler(
            _unary("Lookup", ps_pb2.LookupRequest, copies.lookup), response_serializer=_serialize
        ),
        "Pull": grpc.unary_stream_rpc_method_handler(_stream("Pull", ps_pb2.ServingPullRequest, copies.pull)),
        "Status": grpc.unary_unary_rpc_method_handler(
            _unary("Status", ps_pb2.ServingStatusRequest, lambda _: copies.status()), response_serializer=_serialize
        ),
    }
    service = ps_pb2.DESCRIPTOR.services_by_name["Serving"]
    server.add_generic_rpc_handlers((grpc.method_handlers_generic_handler(service.full_name, serving),))

    def topology(_: ps_pb2.GetTopologyRequest) -> ps_pb2.Topology:
        t = ps_pb2.Topology()
        t.CopyFrom(copies.topology)
        del t.shards[:]
        del t.replicas[:]
        t.shards.extend([address] * copies.num_shards)  # the copy itself: a worker sent here is refused, not sent on
        return t

    ps_service = ps_pb2.DESCRIPTOR.services_by_name["ParameterServer"]
    handlers = {}
    for method in ps_service.methods:
        make = method_handler(method)
        if method.name == "GetTopology":
            handlers[method.name] = make(
                _unary("GetTopology", ps_pb2.GetTopologyRequest, topology), response_serializer=_serialize
            )
        else:
            handlers[method.name] = make(_refuse(method.name))
    server.add_generic_rpc_handlers((grpc.method_handlers_generic_handler(ps_service.full_name, handlers),))


def _serialize(message: Any) -> bytes:
    return bytes(message.SerializeToString())


def contact(address: str, timeout: float) -> ps_pb2.Topology:
    """The job's topology from any of its shards, once it holds a model (waits up to `timeout` seconds)."""
    deadline = time.monotonic() + timeout
    why = ""
    while time.monotonic() < deadline:
        with channel_to(address) as channel:
            try:
                t = ps_pb2_grpc.ParameterServerStub(channel).GetTopology(ps_pb2.GetTopologyRequest(), timeout=5)
                if t.initialized:
                    return t
                why = "it holds no model yet (no worker registered one)"
            except grpc.RpcError as err:
                why = f"{err.code().name}: {err.details()}"
        time.sleep(0.2)
    raise ShuttingDown(f"no model to serve from {address} after {timeout:.0f} s: {why}")


def serve(
    address: str,
    host: str = "127.0.0.1",
    port: int = 0,
    shards: Sequence[int] | None = None,
    timeout: float = 60,
    interval: float = INTERVAL_S,
) -> tuple[grpc.Server, ServingCopies, int]:
    """Start serving copies of the job at `address`, each asking its shard for changes at most every `interval`
    seconds: return the started server, the copies, and the bound port."""
    copies = ServingCopies(contact(address, timeout), shards, interval)
    server = grpc.server(futures.ThreadPoolExecutor(max_workers=16), options=_OPTIONS)
    bound = server.add_insecure_port(f"{host}:{port}")
    if not bound:
        raise OSError(f"cannot listen on {host}:{port}")
    add_to_server(copies, server, f"{host}:{bound}")
    copies.start()
    server.start()
    return server, copies, bound
