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
from paramserver.serving.lookup_socket import LookupSocket
from paramserver.serving.seed import seed, topology_of
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
        self,
        topology: ps_pb2.Topology,
        shards: Sequence[int] | None = None,
        interval: float = INTERVAL_S,
        follow: bool = True,
    ) -> None:
        self.topology = topology
        self.num_shards = len(topology.shards)
        self.tables: tuple[TableSpec, ...] = tuple(spec_from_proto(t) for t in topology.tables)
        self._table_index = {t.name: i for i, t in enumerate(self.tables)}
        self._dims = np.array([t.dim for t in self.tables], np.int64)
        # An unbounded table takes any int64 ID: its bounds check nothing (negative IDs included).
        big = np.iinfo(np.int64)
        self._lows = np.array([0 if t.bounded else big.min for t in self.tables], np.int64)
        self._limits = np.array([t.num_embeddings if t.bounded else big.max for t in self.tables], np.int64)
        held = range(self.num_shards) if shards is None else shards
        wrong = sorted(set(held) - set(range(self.num_shards)))
        if wrong:
            raise InvalidArgument(f"no shard {wrong[0]}: the job has {self.num_shards} (0..{self.num_shards - 1})")
        self.copies: dict[int, ShardCopy] = {i: ShardCopy(i, self.tables) for i in held}
        self._locks = [self.copies[i].lock for i in sorted(self.copies)]
        self.lookup_socket: LookupSocket | None = None  # serve() opens it
        replicas = list(topology.replicas)
        per = len(replicas) // self.num_shards if replicas else 0
        self.followers = (
            []
            if not follow
            else [
                Follower(
                    copy,
                    replicas[i * per : (i + 1) * per] if per else [topology.shards[i]],
                    channel_to,
                    interval=interval,
                )
                for i, copy in self.copies.items()
            ]
        )

    def start(self) -> None:
        for f in self.followers:
            f.start()

    def stop(self) -> None:
        if self.lookup_socket is not None:
            self.lookup_socket.close()
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
        locks = self._locks
        taken = 0
        try:
            for lock in locks:
                lock.acquire()
                taken += 1
            if not self.ready:
                raise ShuttingDown("the serving copies are not ready yet (taking their shards' state): try again")
            yield self.copies
        finally:
            for lock in locks[:taken]:
                lock.release()

    def table_index(self, name: str) -> int:
        if name not in self._table_index:
            known = ", ".join(self._table_index) or "none"
            raise InvalidArgument(f"no table named {name!r} (the model's tables: {known})")
        return self._table_index[name]

    def lookup(self, request: ps_pb2.LookupRequest) -> ps_pb2.LookupReply:
        """Each entry's rows, every shard's at one version. The entries' IDs are handled as one array (each ID's
        table beside it): one hash to shards, one lookup per shard and width, whatever the number of tables."""
        tables, ids, counts = self._asked(request)
        widths = self._dims[tables]
        # The rows of one width are gathered into one array, in request order: each ID's place in it.
        distinct = np.unique(widths)
        place = np.arange(len(ids)) if len(distinct) == 1 else np.empty(len(ids), np.int64)
        out: dict[int, np.ndarray] = {}
        for w in distinct:
            members = np.flatnonzero(widths == w) if len(distinct) > 1 else place
            place[members] = np.arange(len(members))
            out[int(w)] = np.empty((len(members), int(w)), np.float32)
        owner = shard_of(ids, self.num_shards)
        held = np.unique(owner)
        with self.one_version() as copies:
            missing = {int(s) for s in held} - set(copies)
            if missing:
                raise FailedPrecondition(f"this serving process holds no copy of shard(s) {sorted(missing)}")
            for s in held:
                mine = np.flatnonzero(owner == s) if len(held) > 1 else np.arange(len(ids))
                for at, rows in copies[int(s)].lookup_tagged(tables[mine], ids[mine]):
                    out[rows.shape[1]][place[mine[at]]] = rows
            versions = [copies[i].version if i in copies else 0 for i in range(self.num_shards)]
        return ps_pb2.LookupReply(versions=versions, rows=self._entries(out, tables, place, counts))

    def _entries(
        self, out: dict[int, np.ndarray], tables: np.ndarray, place: np.ndarray, counts: list[int]
    ) -> list[bytes]:
        """Each request entry's rows as bytes: slices of its width's rows (one copy out of numpy per width)."""
        blobs = {w: rows.astype("<f4", copy=False).tobytes() for w, rows in out.items()}
        entries, at = [], 0
        for n in counts:
            if not n:
                entries.append(b"")
                continue
            w = int(self._dims[tables[at]])
            first = int(place[at]) * 4 * w
            entries.append(blobs[w][first : first + 4 * w * n])
            at += n
        return entries

    def _asked(self, request: ps_pb2.LookupRequest) -> tuple[np.ndarray, np.ndarray, list[int]]:
        """A request's IDs as one array, each ID's table index beside it, and each entry's count; checked."""
        entries = request.tables
        index = [self._table_index.get(e.table, -1) for e in entries]
        if -1 in index:
            self.table_index(entries[index.index(-1)].table)  # raises, naming the tables there are
        raw = [e.ids for e in entries]
        sizes = [len(r) for r in raw]
        for e, size in zip(entries, sizes, strict=True):
            if size % 8:
                raise InvalidArgument(f"table {e.table!r}: {size} bytes of IDs, not a multiple of 8")
        counts = [size >> 3 for size in sizes]
        tables = np.repeat(np.array(index, np.int64), counts)
        ids = np.frombuffer(b"".join(raw), "<i8")
        total = 4 * int(self._dims[tables].sum())
        if total > MAX_MESSAGE_BYTES:
            raise TooLarge(f"the rows asked for are {total} bytes, over the reply limit of {MAX_MESSAGE_BYTES}")
        outside = (ids < self._lows[tables]) | (ids >= self._limits[tables])
        if outside.any():
            spec = self.tables[int(tables[np.argmax(outside)])]
            raise InvalidArgument(f"table {spec.name!r}: IDs outside 0..{spec.num_embeddings - 1}")
        return tables, ids, counts

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
            held=sorted(self.copies),
            lookup_port=self.lookup_socket.port if self.lookup_socket is not None else 0,
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
    address: str | None,
    host: str = "127.0.0.1",
    port: int = 0,
    shards: Sequence[int] | None = None,
    timeout: float = 60,
    interval: float = INTERVAL_S,
    seed_from: str | None = None,
    lookup_port: int | None = 0,
) -> tuple[grpc.Server, ServingCopies, int]:
    """Start serving copies of the job at `address`, each asking its shard for changes at most every `interval`
    seconds: return the started server, the copies, and the bound port. With `seed_from` (a model file of the job's
    model: PSClient.save), they serve its values at once, until each has taken its shard's whole state; with it and
    no `address`, they serve the file alone, following nothing. Lookups are also answered on a TCP socket at
    `lookup_port` (0: any free port; None: none), named in ServingStatus."""
    if address is None:
        if seed_from is None:
            raise ValueError("name the job to follow, or a model file to serve")
        copies = ServingCopies(topology_of(seed_from), shards, interval, follow=False)
    else:
        copies = ServingCopies(contact(address, timeout), shards, interval)
    if seed_from is not None:
        seed(copies.copies, copies.topology, copies.tables, seed_from)
    if lookup_port is not None:
        copies.lookup_socket = LookupSocket(copies.lookup, host, lookup_port, MAX_MESSAGE_BYTES)
    server = grpc.server(futures.ThreadPoolExecutor(max_workers=16), options=_OPTIONS)
    bound = server.add_insecure_port(f"{host}:{port}")
    if not bound:
        raise OSError(f"cannot listen on {host}:{port}")
    add_to_server(copies, server, f"{host}:{bound}")
    copies.start()
    server.start()
    return server, copies, bound
