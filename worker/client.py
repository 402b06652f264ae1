"""PSClient: a worker's view of the parameter server: topology, join, register, pull and push to every shard.

Each call fans out to all shards at once. A shard on this host gets the tensor bytes through a shared-memory
segment and one small Exchange message (over a Unix socket, or gRPC); any other shard gets one Push or Pull stream
per call.
Weights are written straight into the model's own CPU tensors, and gradients are read straight from them; CUDA
tensors go through a host mirror.
"""

from __future__ import annotations

import functools
import json
import logging
import secrets
import threading
import time
import uuid
from collections.abc import Callable, Iterator, Mapping, Sequence
from concurrent import futures
from dataclasses import dataclass, field
from types import TracebackType
from typing import Any, TypeVar

import grpc
import numpy as np
import torch

from paramserver import codec, shm
from paramserver.doorbell import DoorbellClient, split_host
from paramserver.errors import (
    AlreadyInitialized,
    DataSocketUnavailable,
    InitInProgress,
    JobFull,
    MalformedStream,
    ModelMismatch,
    NotAttached,
    NotInitialized,
    PSError,
    PullTimeout,
    RemoteError,
    SharedMemoryUnavailable,
    UnknownWorker,
    Unreachable,
    from_rpc_error,
)
from paramserver.placement import SLICE_ELEMENTS, Placement, TensorSpec, place
from paramserver.security import channel_credentials, client_ssl_context, open_channel
from paramserver.v1 import ps_pb2, ps_pb2_grpc
from paramserver.wire import CHUNK_BYTES, ChunkReceiver, itemsize, iter_chunks, wire_dtype

log = logging.getLogger(__name__)

T = TypeVar("T")
Tensors = torch.nn.Module | Mapping[str, torch.Tensor]

# Unary calls retry UNAVAILABLE (a shard restarting) with backoff, declared once for the channel. Streams are
# retried by PSClient._on_shard instead; a push is safe to resend because the server dedupes (worker, step).
_SERVICE_CONFIG = json.dumps(
    {
        "methodConfig": [
            {
                # Unary calls only: gRPC's own retry of a server stream (Pull) waiting when its shard dies was
                # seen to never return, not even at its deadline. Streams are retried by PSClient._on_shard.
                "name": [
                    {"service": "paramserver.v1.ParameterServer", "method": m}
                    for m in ("GetTopology", "Join", "Leave", "Heartbeat", "Attach")
                ],
                "retryPolicy": {
                    "maxAttempts": 5,
                    "initialBackoff": "0.1s",
                    "maxBackoff": "2s",
                    "backoffMultiplier": 2,
                    "retryableStatusCodes": ["UNAVAILABLE"],
                },
            }
        ]
    }
)

_MODES = {ps_pb2.SYNC: "sync", ps_pb2.ASYNC: "async", ps_pb2.SSP: "ssp"}

# A shard's part of the model up to this many wire bytes goes inline in one unary Exchange per step (a small model
# on another host: one call, not two streams); larger parts are streamed in chunks.
INLINE_BYTES = CHUNK_BYTES
# How soon a worker asks again while another worker's Init of a shard runs: soon at first (a small model's Init
# takes milliseconds, and the round of a sync job waits for the last worker), then less often, down to the cap.
INIT_POLL_FIRST_S = 0.005
INIT_POLL_S = 0.1
CONNECT_S = 5.0  # how long connecting to a data socket (or one try at the first shard) may take
# The first contact with a shard that does not answer (not started yet, or a wrong address): tried again after
# this long, then twice as long each time up to the cap, each try logged, until PSClient's connect_timeout.
CONNECT_RETRY_S = 1.0
CONNECT_RETRY_MAX_S = 5.0
# How long a worker that settled for gRPC with a shard (no data socket served or reached) keeps to it before it
# tries again, doubling after each try that fails, up to the cap: a shard restarted at the wrong moment, or a port
# opened late, costs a while at gRPC speed, not the whole run, and a port whose packets are dropped stalls a step
# for CONNECT_S ever more rarely.
RETRY_LINK_S = 30.0
RETRY_LINK_MAX_S = 900.0
# How long a Join waits for a place in a full job: three of the shards' default lease timeouts (10 s), so that the
# place of a worker that died just before (its lease still running) frees meanwhile.
JOB_FULL_WAIT_S = 30.0
# A push waiting for its turn starts once the push before it has fewer bytes than this unacknowledged by its shard.
TURN_BELOW = 64 * 1024


def channel_options(max_message_bytes: int = 4 * 1024 * 1024 + 4096) -> list[tuple[str, Any]]:
    """Options of every channel the client opens."""
    return [
        ("grpc.max_receive_message_length", max_message_bytes),
        ("grpc.max_send_message_length", max_message_bytes),
        ("grpc.enable_retries", 1),
        # Reconnect fast after a short outage, so heartbeats resume well within a lease.
        ("grpc.initial_reconnect_backoff_ms", 200),
        ("grpc.max_reconnect_backoff_ms", 1000),
        ("grpc.service_config", _SERVICE_CONFIG),
    ]


_SERVICE = "/paramserver.v1.ParameterServer/"


class _RawStreams:
    """The streaming RPCs of one channel with raw-bytes messages on the tensor side, encoded and decoded by
    paramserver.codec: no protobuf object ever holds a chunk's data."""

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


@dataclass
class _OnGrpc:
    """A shard this worker exchanges tensors with over gRPC for now: when it tries shared memory and the data
    socket again, how long it waits after that try should it fail too, and why it fell back, as the user was told
    (once per cause, not at every try)."""

    until: float = 0.0
    wait: float = field(default_factory=lambda: RETRY_LINK_S)  # read when a shard falls back, not at import
    told: str = ""


class _Turns:
    """The pushes of one exchange over data sockets, one shard at a time in shard order: shard k sends its gradient
    once shard k-1's has been taken by its shard but for the last TURN_BELOW bytes (or failed, or did not need a
    turn). Over a link, two pushes at once share it and both end late, and only then do the weights come back; in
    turn, shard k-1's weights come down while shard k's gradient goes up (full duplex): over 400 Mbit/s, 25 MB
    push_pull on 2 shards 0.82 s against 1.01 s, 4 MB 118 against 136-144 ms."""

    def __init__(self, shards: int, limit: float) -> None:
        self._sent = [threading.Event() for _ in range(shards)]
        self._limit = limit  # a safety net: a turn is an ordering hint, never a reason to hang

    def wait(self, k: int) -> None:
        if 0 < k < len(self._sent):
            self._sent[k - 1].wait(self._limit)

    def done(self, k: int) -> None:
        if k < len(self._sent):
            self._sent[k].set()


_NO_TURNS = _Turns(0, 0.0)  # an exchange with no part large enough to take turns (no events to make: a small model)


@dataclass
class _Binding:
    """How one model's tensors map onto the shards' pieces (computed once per model object)."""

    names: list[str]
    tensors: list[torch.Tensor]
    placement: Placement
    host: list[torch.Tensor | None]  # a CPU float32 mirror for tensors that are not CPU-contiguous
    largest_part: int = 0  # elements of the largest shard's part

    def __post_init__(self) -> None:
        self.largest_part = max(self.placement.shard_elements(k) for k in range(self.placement.num_shards))

    def flat(self, i: int, tensor: torch.Tensor | None = None) -> np.ndarray:
        """A float32 numpy view of tensor i (or of `tensor`, shaped like it), via the mirror if needed."""
        t = self.tensors[i] if tensor is None else tensor
        mirror = self.host[i]
        if mirror is None:
            return t.detach().view(-1).numpy()
        return mirror.numpy()

    def views(self, shard: int, flats: Sequence[np.ndarray]) -> list[np.ndarray]:
        """One view per piece of `shard`, into the flat arrays of the tensors."""
        index = {n: i for i, n in enumerate(self.names)}
        return [flats[index[p.name]][p.start : p.start + p.length] for p in self.placement.shards[shard]]

    def labels(self, shard: int) -> list[str]:
        return [f"{p.name}[{p.start}:{p.start + p.length}]" for p in self.placement.shards[shard]]

    def regions(self, shard: int, region: np.ndarray) -> list[np.ndarray]:
        """One view per piece of `shard`, into a segment region (the pieces back to back, as the shard stores)."""
        out, at = [], 0
        for p in self.placement.shards[shard]:
            out.append(region[at : at + p.length])
            at += p.length
        return out


def _tensors_of(obj: Tensors) -> tuple[list[str], list[torch.Tensor]]:
    if isinstance(obj, torch.nn.Module):
        items = list(obj.named_parameters())
    elif isinstance(obj, Mapping):
        items = list(obj.items())  # type: ignore[arg-type]
    else:
        raise TypeError(f"expected an nn.Module or a mapping of name -> tensor, not {type(obj).__name__}")
    if not items:
        raise ValueError("the model has no parameters")
    for name, t in items:
        if not isinstance(t, torch.Tensor):
            raise TypeError(f"{name} is a {type(t).__name__}, not a tensor")
        if t.dtype != torch.float32:
            raise TypeError(f"{name} is {t.dtype}; the parameter server holds float32 tensors")
    return [n for n, _ in items], [t for _, t in items]


def _first_contact(stub: ps_pb2_grpc.ParameterServerStub, address: str, limit: float) -> ps_pb2.Topology:
    """Ask the shard at `address` for the topology, asking again while nothing answers there (it may still be
    starting), with a warning per try that says why and when the worker gives up; Unreachable after `limit` s.

    No wait_for_ready: with it a refused connection is silent until the deadline, and then reads as a timeout."""
    began = time.monotonic()
    delay, why = CONNECT_RETRY_S, ""
    while True:
        left = began + limit - time.monotonic()
        try:
            return stub.GetTopology(ps_pb2.GetTopologyRequest(), timeout=max(min(CONNECT_S, left), 0.1))
        except grpc.RpcError as err:
            if err.code() not in (grpc.StatusCode.UNAVAILABLE, grpc.StatusCode.DEADLINE_EXCEEDED):
                raise from_rpc_error(err, address) from None
            # A try cut short by the give-up time says less than the refusal before it.
            if err.code() == grpc.StatusCode.UNAVAILABLE or not why:
                why = _why_unreachable(err)
        left = began + limit - time.monotonic()
        if left <= 0:
            raise Unreachable(
                f"cannot connect to {address} ({why}); gave up after {time.monotonic() - began:.0f} s: is ps-server "
                "running there, and is the address right?"
            )
        wait = min(delay, left)
        log.warning("cannot connect to %s (%s); trying again in %.1f s, giving up in %.0f s", address, why, wait, left)
        time.sleep(wait)
        delay = min(2 * delay, CONNECT_RETRY_MAX_S)


def _why_unreachable(err: grpc.RpcError) -> str:
    """The reason in a failed connection's status, as a person would say it ("connection refused")."""
    if err.code() == grpc.StatusCode.DEADLINE_EXCEEDED:
        return "no answer in time"
    detail = (err.details() or "").strip() if hasattr(err, "details") else ""
    reason = detail.rsplit(": ", 1)[-1].strip(" []()") if detail else ""
    reason = reason or "unavailable"
    return reason[:1].lower() + reason[1:]


def _begin_and_wait(start: Callable[[int], Callable[[], T]], k: int) -> T:
    return start(k)()


class PSClient:
    """Talk to every shard of a parameter server, knowing any one shard's address.

    `with PSClient("host:50051") as client:` joins the job (a rank for data sharding) and leaves on exit.
    `register(model)` initialises the servers from the model or adopts what they hold; `pull(model)` copies the
    current weights into it in place; `push(model)` sends every parameter's `.grad`; `push_pull(model)` does both
    in one exchange per shard (what a training step needs). Also works on a plain mapping of name -> float32
    tensor (push then sends the tensors themselves as the gradient).

    Shards on this host exchange tensors through shared memory (`shared_memory=False` turns that off); others
    through their data socket, raw bytes over TCP (`data_socket=False` turns that off); the rest through gRPC:
    one unary call per step for a small model, else Push and Pull streams. `dtype` ('float32', 'bf16', 'fp16')
    is the element type on the network; shared memory always holds float32.

    `push_in_turn`: push a large model's parts to the data sockets one shard after the other, so that one shard's
    weights come back while the next one's gradient goes out (True), or to all at once (False); None (the
    default): in turn for shards reached over a network, where a link is the limit, at once for a shard on a
    loopback address, where memory copies on several cores are.
    """

    def __init__(
        self,
        address: str,
        *,
        worker_id: str | None = None,
        job_name: str = "",
        join: bool = True,
        dtype: str = "float32",
        timeout: float = 120.0,
        connect_timeout: float = 30.0,
        chunk_bytes: int = CHUNK_BYTES,
        tls_ca: str | None = None,
        tls_cert: str | None = None,
        tls_key: str | None = None,
        tls_server_name: str | None = None,
        auth_token: str | None = None,
        shared_memory: bool = True,
        data_socket: bool = True,
        push_in_turn: bool | None = None,
    ) -> None:
        self.worker_id = worker_id or uuid.uuid4().hex
        # Offer each shard a shared-memory segment; shards on other hosts refuse it and get the data socket (or,
        # where they serve none or it cannot be reached, the gRPC streams).
        self.shared_memory = shared_memory and shm.available()
        self.data_socket = data_socket
        self.push_in_turn = push_in_turn
        self._credentials = channel_credentials(tls_ca, tls_cert, tls_key)
        self._tls = client_ssl_context(tls_ca, tls_cert, tls_key)
        self._tls_server_name = tls_server_name
        self._token = auth_token
        self._options = channel_options()
        if tls_server_name:
            self._options.append(("grpc.ssl_target_name_override", tls_server_name))
        self.job_name = job_name
        self.dtype: Any = wire_dtype(dtype)  # a ps_pb2.DType value
        self.timeout = timeout
        self.chunk_bytes = chunk_bytes
        self.rank = 0
        self.world_size = 1
        self._step = 0
        self._bindings: dict[int, _Binding] = {}
        self._channels: list[grpc.Channel] = []
        self._joined = False
        self._closing = threading.Event()
        self._registered: _Binding | None = None
        self._heartbeat: threading.Thread | None = None

        # The channel's own retries would keep each try at a refused address going for seconds, unsaid.
        no_retries = [(k, v) for k, v in self._options if k != "grpc.enable_retries"] + [("grpc.enable_retries", 0)]
        entry = open_channel(address, no_retries, self._credentials, self._token)
        try:
            topo = _first_contact(ps_pb2_grpc.ParameterServerStub(entry), address, connect_timeout)
        finally:
            entry.close()
        self.topology = topo
        self.addresses: list[str] = list(topo.shards)
        self.mode = _MODES.get(topo.job.mode, "unknown")
        self._channels = [open_channel(a, self._options, self._credentials, self._token) for a in self.addresses]
        self._stubs = [ps_pb2_grpc.ParameterServerStub(c) for c in self._channels]
        self._raw = [_RawStreams(c) for c in self._channels]
        self._pool = futures.ThreadPoolExecutor(max_workers=len(self.addresses), thread_name_prefix="ps-client")
        # Per shard: the attached shared-memory segment (one per worker and shard: the shard holds one model) and
        # its doorbell connection, or the data-socket connection; the model digest they are for; the shards that
        # cannot share memory; those that take only gRPC for now.
        self._segments: list[shm.Segment | None] = [None] * len(self.addresses)
        self._segment_digest = [""] * len(self.addresses)
        self._bells: list[DoorbellClient | None] = [None] * len(self.addresses)
        self._no_shm: set[int] = set()
        self._on_grpc: dict[int, _OnGrpc] = {}
        self.versions = [0] * len(self.addresses)  # what each shard's last pull returned
        self._min_next = [0] * len(self.addresses)  # the version a pull must wait for after a push
        self._incarnation = [""] * len(self.addresses)  # which run of each shard those versions belong to
        if join:
            try:
                self.join()
            except BaseException:
                self.close()
                raise

    # -- membership --------------------------------------------------------------------------------------------

    def join(self) -> None:
        """Join the job on every shard (shard 0 first: its rank is the one that counts)."""
        req = ps_pb2.JoinRequest(worker_id=self.worker_id, job_name=self.job_name)
        first = self._join_first(req)
        self.rank, self.world_size = first.rank, first.world_size
        leases = [first.lease_timeout_s]
        leases += [
            r.lease_timeout_s
            for r in self._each(
                lambda k: self._stubs[k].Join(req, timeout=self.timeout), range(1, len(self._stubs)), rejoin=False
            )
        ]
        self._joined = True
        lease = min(x for x in leases if x > 0) if any(x > 0 for x in leases) else 10.0
        if self._heartbeat is None:
            # Renew the lease while the worker computes or waits, well within the lease timeout.
            self._heartbeat = threading.Thread(target=self._beat, args=(lease / 3,), name="ps-heartbeat", daemon=True)
            self._heartbeat.start()

    def _join_first(self, req: ps_pb2.JoinRequest) -> ps_pb2.JoinResponse:
        """Join shard 0, waiting while the job is full: a place held by a worker that died (or by a Join that
        never came back) frees once its lease runs out, so a worker restarted at once gets in then."""
        began = time.monotonic()
        while True:
            try:
                return self._on_shard(0, lambda: self._stubs[0].Join(req, timeout=self.timeout), rejoin=False)
            except JobFull as exc:
                left = began + JOB_FULL_WAIT_S - time.monotonic()
                if left <= 0:
                    raise
                log.warning("%s; trying again in %.1f s, giving up in %.0f s", exc, min(1.0, left), left)
                time.sleep(min(1.0, left))

    def _beat(self, interval: float) -> None:
        req = ps_pb2.HeartbeatRequest(worker_id=self.worker_id)
        failing: set[int] = set()  # shards whose last heartbeat failed: an outage is logged when it starts and ends
        while not self._closing.wait(interval):
            for k, stub in enumerate(self._stubs):
                if not self._joined or self._closing.is_set():
                    break
                try:
                    stub.Heartbeat(req, timeout=interval)
                except grpc.RpcError as err:
                    exc = from_rpc_error(err, self.addresses[k])
                    if isinstance(exc, UnknownWorker):
                        try:
                            self._rejoin(k)
                        except PSError as again:
                            log.warning("re-joining shard %s failed: %s", self.addresses[k], again)
                    elif k not in failing:
                        failing.add(k)
                        log.warning(
                            "heartbeat to shard %s failed: %s; the shard evicts this worker if it hears nothing "
                            "for its lease timeout",
                            self.addresses[k],
                            exc,
                        )
                    else:
                        log.debug("heartbeat to %s failed again: %s", self.addresses[k], exc)
                    continue
                if k in failing:
                    failing.discard(k)
                    log.info("heartbeat to shard %s answered again", self.addresses[k])

    def _rejoin(self, k: int) -> None:
        """Join shard k again after it evicted or forgot this worker; its versions start afresh."""
        req = ps_pb2.JoinRequest(worker_id=self.worker_id, job_name=self.job_name)
        try:
            self._stubs[k].Join(req, timeout=self.timeout)
        except grpc.RpcError as err:
            raise from_rpc_error(err, self.addresses[k]) from None
        self._min_next[k] = 0
        fallback = self._on_grpc.get(k)
        if fallback is not None:  # a restarted shard may serve now what it did not: try at once
            fallback.until, fallback.wait = 0.0, RETRY_LINK_S
        log.warning(
            "worker %s re-joined shard %s (it had been evicted or the shard restarted)",
            self.worker_id[:8],
            self.addresses[k],
        )

    def leave(self, finished: bool = False) -> None:
        """Leave the job on every shard; a sync round stops waiting for this worker.

        `finished=True` says the worker completed its training: once every worker of the job has, shards run
        with exit_when_done stop by themselves.
        """
        if not self._joined:
            return
        self._joined = False
        req = ps_pb2.LeaveRequest(worker_id=self.worker_id, finished=finished)
        self._each(lambda k: self._stubs[k].Leave(req, timeout=10.0), rejoin=False)

    # -- the model ---------------------------------------------------------------------------------------------

    def _bind(self, obj: Tensors) -> _Binding:
        names, tensors = _tensors_of(obj)
        key = id(obj)
        b = self._bindings.get(key)
        if b is not None and b.names == names and all(x is y for x, y in zip(b.tensors, tensors, strict=True)):
            return b
        specs = [TensorSpec(n, tuple(t.shape)) for n, t in zip(names, tensors, strict=True)]
        placement = place(specs, len(self.addresses), int(self.topology.slice_elements) or SLICE_ELEMENTS)
        host = [
            None
            if (t.device.type == "cpu" and t.is_contiguous())
            else torch.empty(t.numel(), dtype=torch.float32, pin_memory=t.device.type == "cuda")
            for t in tensors
        ]
        b = _Binding(names, tensors, placement, host)
        self._bindings[key] = b
        return b

    def digest(self, obj: Tensors) -> str:
        """The digest naming this model on these shards."""
        return self._bind(obj).placement.digest

    def register(self, obj: Tensors) -> int:
        """Initialise every shard from `obj`, or adopt the weights the shards already hold; return the version."""
        b = self._bind(obj)
        self._each(lambda k: self._init_shard(b, k), rejoin=True)
        self._registered = b
        return self.pull(obj)

    def _init_shard(self, b: _Binding, k: int) -> None:
        """Send shard k its pieces of the bound model's current weights, unless it already holds the model."""
        digest = b.placement.digest
        topo = self._call(
            self.addresses[k], lambda: self._stubs[k].GetTopology(ps_pb2.GetTopologyRequest(), timeout=self.timeout)
        )
        if topo.initialized:
            if topo.model_digest != digest:
                raise ModelMismatch(
                    f"shard {self.addresses[k]} holds another model (digest {topo.model_digest[:12]}, yours "
                    f"{digest[:12]}): different tensor names or shapes; restart the servers to train a new model"
                )
            return
        for i, t in enumerate(b.tensors):
            mirror = b.host[i]
            if mirror is not None:
                mirror.copy_(t.detach().reshape(-1))
        flats = [b.flat(i) for i in range(len(b.tensors))]
        header = ps_pb2.InitHeader(
            worker_id=self.worker_id,
            specs=[ps_pb2.TensorSpec(name=s.name, shape=s.shape) for s in b.placement.specs],
            num_shards=len(self.addresses),
            model_digest=digest,
            dtype=ps_pb2.FLOAT32,
        )

        def messages() -> Iterator[bytes]:
            yield ps_pb2.InitMessage(header=header).SerializeToString()
            for piece, offset, data in iter_chunks(b.views(k, flats), ps_pb2.FLOAT32, self.chunk_bytes):
                yield codec.encode_chunk(piece, offset, data)

        try:
            self._call(self.addresses[k], lambda: self._raw[k].init(messages(), timeout=self.timeout))
        except AlreadyInitialized:
            pass  # another worker won the race with the same model: adopt it

    def pull(self, obj: Tensors) -> int:
        """Copy the shards' current weights into `obj` in place; return the lowest shard version.

        After a push, waits for the version that includes it (in sync mode: the end of that round).
        """
        return self._exchange(self._bind(obj), grads=None, step=0, pull=True)

    def push(self, obj: Tensors, step: int | None = None) -> int:
        """Send the gradient (each parameter's .grad; a mapping's tensors themselves) to every shard.

        Returns the lowest shard version after the push. `step` identifies the push for exactly-once delivery
        (default: this client's own counter).
        """
        b = self._bind(obj)
        return self._exchange(b, grads=self._gradients(obj, b), step=self._next_step(step), pull=False)

    def push_pull(self, obj: Tensors, step: int | None = None) -> int:
        """Push the gradient, then pull the weights that include it into `obj`: one exchange per shard, all
        shards at once (one shard's pull overlaps another's push). Returns the lowest shard version pulled.

        Raises like `push`; after Aborted (the round closed without this push) call `pull` to catch up. After
        PullTimeout the push was taken but its round is still open (in sync mode: workers yet to join or to push);
        `pull` waits for that round again.
        """
        b = self._bind(obj)
        return self._exchange(b, grads=self._gradients(obj, b), step=self._next_step(step), pull=True)

    def _next_step(self, step: int | None) -> int:
        if step is None:
            self._step += 1
            return self._step
        return step

    def _gradients(self, obj: Tensors, b: _Binding) -> list[np.ndarray]:
        """Flat float32 host views of each tensor's gradient (through the host mirror where needed)."""
        grads: list[np.ndarray] = []
        for i, t in enumerate(b.tensors):
            g = t.grad if isinstance(obj, torch.nn.Module) else t
            if g is None:
                g = torch.zeros_like(t)
            mirror = b.host[i]
            if mirror is not None or not g.is_contiguous() or g.device.type != "cpu":
                if mirror is None:
                    mirror = b.host[i] = torch.empty(t.numel(), dtype=torch.float32)
                mirror.copy_(g.detach().reshape(-1))
                grads.append(mirror.numpy())
            else:
                grads.append(g.detach().view(-1).numpy())
        return grads

    def _exchange(self, b: _Binding, grads: list[np.ndarray] | None, step: int, pull: bool) -> int:
        """Push `grads` (if given), then pull (if asked), on every shard at once; return the lowest version."""
        flats = [b.flat(i) for i in range(len(b.tensors))] if pull else None
        bases = list(self.versions)
        large = b.largest_part * itemsize(self.dtype) > INLINE_BYTES
        turns = _Turns(len(self.addresses), self.timeout) if grads is not None and large else _NO_TURNS
        try:
            versions = self._fan_out(lambda k: self._start(b, k, grads, step, flats, turns))
        except PullTimeout:
            if grads is not None:
                # A shard waits to answer a pull only once it has taken the push (or found its round closed), so
                # the next pull must wait for that round too, not hand back the weights the push was made on.
                for k, base in enumerate(bases):
                    self._min_next[k] = max(self._min_next[k], base + 1)
            raise
        if pull:
            with torch.no_grad():
                for i, t in enumerate(b.tensors):
                    mirror = b.host[i]
                    if mirror is not None:
                        t.copy_(mirror.view(t.shape).to(t.device, non_blocking=True))
        return min(versions)

    def _start(
        self,
        b: _Binding,
        k: int,
        grads: list[np.ndarray] | None,
        step: int,
        flats: list[np.ndarray] | None,
        turns: _Turns,
    ) -> Callable[[], int]:
        """Begin shard k's part of an exchange; return a function that waits for it and returns its version."""
        try:
            link = self._link(b, k)
        except BaseException:
            turns.done(k)
            raise
        if isinstance(link, DoorbellClient):
            return self._socket(b, k, link, grads, step, flats, turns)
        turns.done(k)  # only data sockets take turns
        if link is None:
            if b.placement.shard_elements(k) * itemsize(self.dtype) <= INLINE_BYTES:
                return self._inline(b, k, grads, step, flats)
            return self._pool.submit(self._streams, b, k, grads, step, flats).result
        segment = link
        base = self.versions[k]
        if grads is not None:
            for src, dst in zip(b.views(k, grads), b.regions(k, segment.grad), strict=True):
                np.copyto(dst, src)
        req = self._exchange_request(b, k, grads is not None, step, flats is not None)
        answer = self._ring(b, k, req)

        def finish() -> int:
            version = self._answered(b, k, answer(), base, grads is not None, flats is not None)
            if flats is not None:
                for src, dst in zip(b.regions(k, segment.weights), b.views(k, flats), strict=True):
                    np.copyto(dst, src)
            return version

        return finish

    def _socket(
        self,
        b: _Binding,
        k: int,
        bell: DoorbellClient,
        grads: list[np.ndarray] | None,
        step: int,
        flats: list[np.ndarray] | None,
        turns: _Turns,
    ) -> Callable[[], int]:
        """Shard k's part of an exchange over its data socket: the gradient goes out of the model's own memory and
        the weights land straight in it. A large push waits for its turn (see `push_in_turn`)."""
        base = self.versions[k]
        req = self._exchange_request(b, k, grads is not None, step, flats is not None)
        req.dtype = self.dtype
        sent = b.views(k, grads) if grads is not None else []

        def send() -> None:
            try:
                bell.send(req, self.timeout, sent, self.dtype)
            except OSError as exc:
                raise self._lost(k, exc) from None

        def finish() -> int:
            try:
                reply = bell.receive(b.views(k, flats) if flats is not None else (), self.dtype)
            except (OSError, ConnectionError) as exc:
                raise self._lost(k, exc) from None
            return self._answered(b, k, reply, base, grads is not None, flats is not None)

        if b.placement.shard_elements(k) * itemsize(self.dtype) <= INLINE_BYTES:
            try:
                send()  # a small part fits the socket buffers: ring every shard from this thread, then collect
            finally:
                turns.done(k)
            return finish
        in_turn = grads is not None and (self.push_in_turn if self.push_in_turn is not None else not bell.loopback)

        def exchange() -> int:
            if in_turn:
                turns.wait(k)
            try:
                send()
                if in_turn and k + 1 < len(self.addresses):  # the next shard's turn: once these bytes have crossed
                    bell.drain(TURN_BELOW, self.timeout)
            finally:
                turns.done(k)
            return finish()

        # A large part, pushed or pulled: the whole exchange in one thread per shard (shard 0 in the caller's), so
        # the transfers overlap; collected in one thread, shard 1's weights would wait in its socket for shard 0's.
        return exchange if k == 0 else self._pool.submit(exchange).result

    def _answered(
        self, b: _Binding, k: int, reply: ps_pb2.ExchangeResponse, base: int, pushed: bool, pulled: bool
    ) -> int:
        """Note what shard k's Exchange reply says; return its version."""
        version = int(reply.version)
        if pushed:
            self._min_next[k] = base + 1
        if pulled:
            self._check_digest(b, k, reply.pulled)
            self._pulled(b, k, reply.pulled)
            version = int(reply.pulled.version)
        return version

    def _lost(self, k: int, exc: BaseException) -> PSError:
        """Shard k's doorbell or data socket failed (the shard went away, or the connection is out of step after a
        timeout): forget it, and retry as UNAVAILABLE, which attaches afresh."""
        self._drop_segment(k)
        return RemoteError(f"shard {self.addresses[k]}: connection lost: {exc}", grpc.StatusCode.UNAVAILABLE)

    def _exchange_request(self, b: _Binding, k: int, push: bool, step: int, pull: bool) -> ps_pb2.ExchangeRequest:
        """Shard k's Exchange: a push on the version last pulled; a pull of the version that includes it."""
        base = self.versions[k]
        return ps_pb2.ExchangeRequest(
            worker_id=self.worker_id if self._joined else "",
            model_digest=b.placement.digest,
            push=push,
            step=step,
            base_version=base,
            pull=pull,
            min_version=base + 1 if push else self._min_next[k],
            incarnation=self._incarnation[k],
        )

    def _inline(
        self, b: _Binding, k: int, grads: list[np.ndarray] | None, step: int, flats: list[np.ndarray] | None
    ) -> Callable[[], int]:
        """Shard k's part of an exchange as one unary call with the tensors in the messages (a small model)."""
        base = self.versions[k]
        req = self._exchange_request(b, k, grads is not None, step, flats is not None)
        req.inline, req.dtype = True, self.dtype
        if grads is not None:
            for piece, offset, data in iter_chunks(b.views(k, grads), self.dtype, reuse=True):
                req.chunks.add(piece=piece, offset=offset, data=bytes(data))

        def finish() -> int:
            reply = self._stubs[k].Exchange(req, timeout=self.timeout)
            version = int(reply.version)
            if grads is not None:
                self._min_next[k] = base + 1
            if flats is not None:
                self._check_digest(b, k, reply.pulled)
                receiver = ChunkReceiver(b.views(k, flats), b.labels(k), self.dtype)
                for chunk in reply.chunks:
                    receiver.add(chunk.piece, chunk.offset, memoryview(chunk.data))
                receiver.finish()
                self._pulled(b, k, reply.pulled)
                version = int(reply.pulled.version)
            return version

        # Blocking calls, not gRPC futures (those start a thread per call when a channel is idle: milliseconds on
        # a busy machine). Shard 0 is started last (see _fan_out) and runs in the caller's thread meanwhile; the
        # others run in pool threads.
        return finish if k == 0 else self._pool.submit(finish).result

    def _ring(self, b: _Binding, k: int, req: ps_pb2.ExchangeRequest) -> Callable[[], ps_pb2.ExchangeResponse]:
        """Send an Exchange to shard k (by doorbell if connected, else by gRPC); return what waits for the reply."""
        bell = self._bells[k]
        if bell is None:
            return self._pool.submit(self._stubs[k].Exchange, req, timeout=self.timeout).result

        try:
            bell.send(req, self.timeout)
        except OSError as exc:
            raise self._lost(k, exc) from None

        def receive() -> ps_pb2.ExchangeResponse:
            try:
                return bell.receive()
            except (OSError, ConnectionError) as exc:
                raise self._lost(k, exc) from None

        return receive

    def _link(self, b: _Binding, k: int) -> shm.Segment | DoorbellClient | None:
        """Shard k's attachment for this model, attaching first if needed: a shared-memory segment (same host) or
        a data-socket connection; None: use gRPC."""
        if not self._joined:
            return None  # an attachment belongs to a joined worker: a reader that did not join uses gRPC
        fallback = self._on_grpc.get(k)
        if fallback is not None and fallback.until > time.monotonic():
            return None
        if self._segment_digest[k] == b.placement.digest and (self._segments[k] or self._bells[k]) is not None:
            return self._segments[k] or self._bells[k]
        self._drop_segment(k)
        link: shm.Segment | DoorbellClient | None = None
        if self.shared_memory and k not in self._no_shm:
            link = self._attach_segment(b, k)
        if link is None and self.data_socket:
            link = self._attach_socket(b, k)
        if link is None:
            fallback = self._on_grpc.setdefault(k, _OnGrpc())
            fallback.until = time.monotonic() + fallback.wait
            fallback.wait = min(2 * fallback.wait, RETRY_LINK_MAX_S)
            return None
        self._segment_digest[k] = b.placement.digest
        fallback = self._on_grpc.pop(k, None)
        if fallback is not None and fallback.told:
            way = "data socket" if isinstance(link, DoorbellClient) else "shared memory"
            log.info("shard %s: %s attached: leaving gRPC", self.addresses[k], way)
        return link

    def _attach_segment(self, b: _Binding, k: int) -> shm.Segment | None:
        """Offer shard k a shared-memory segment for this model; None if it cannot use one."""
        segment = shm.Segment.create(b.placement.shard_elements(k))
        req = ps_pb2.AttachRequest(
            worker_id=self.worker_id,
            name=segment.name,
            nonce=segment.nonce,
            elements=segment.elements,
            model_digest=b.placement.digest,
        )
        try:
            reply = self._on_shard(k, lambda: self._stubs[k].Attach(req, timeout=self.timeout))
        except SharedMemoryUnavailable as exc:
            log.info("shard %s cannot share memory with this worker (%s)", self.addresses[k], exc)
            self._no_shm.add(k)
            segment.close()
            return None
        except BaseException:
            segment.close()
            raise
        self._segments[k] = segment
        if reply.doorbell:
            try:
                self._bells[k] = DoorbellClient(reply.doorbell, req, self.addresses[k], timeout=self.timeout)
            except (OSError, ConnectionError, PSError) as exc:  # e.g. another network namespace: gRPC it is
                log.info("shard %s: no doorbell (%s); Exchanges go by gRPC", self.addresses[k], exc)
        return segment

    def _attach_socket(self, b: _Binding, k: int) -> DoorbellClient | None:
        """Ask shard k for its data socket and connect; None if it serves none or it cannot be reached."""
        req = ps_pb2.AttachRequest(
            worker_id=self.worker_id,
            nonce=secrets.token_bytes(shm.NONCE_BYTES),
            elements=b.placement.shard_elements(k),
            model_digest=b.placement.digest,
            socket=True,
        )
        try:
            reply = self._on_shard(k, lambda: self._stubs[k].Attach(req, timeout=self.timeout))
        except (DataSocketUnavailable, SharedMemoryUnavailable) as exc:  # the latter: a shard that predates it
            fallback = self._on_grpc.setdefault(k, _OnGrpc())
            level = logging.DEBUG if fallback.told == "none" else logging.INFO
            fallback.told = "none"
            log.log(level, "shard %s offers no data socket (%s): using gRPC", self.addresses[k], exc)
            return None
        where = (split_host(self.addresses[k]), int(reply.data_port))
        try:
            bell = DoorbellClient(
                where, req, self.addresses[k], min(self.timeout, CONNECT_S), self._tls, self._tls_server_name
            )
        except (OSError, ConnectionError, PSError) as exc:
            fallback = self._on_grpc.setdefault(k, _OnGrpc())
            if fallback.told != "unreachable":
                fallback.told = "unreachable"
                log.warning(
                    "shard %s: its data socket at %s:%d cannot be reached (%s); using gRPC (slower) and trying "
                    "again from time to time: open that port where the gRPC port is open",
                    self.addresses[k],
                    *where,
                    exc,
                )
            else:
                log.debug("shard %s: data socket at %s:%d still unreachable (%s)", self.addresses[k], *where, exc)
            return None
        self._bells[k] = bell
        return bell

    def _drop_segment(self, k: int) -> None:
        """Forget shard k's segment and doorbell (unmapping it); the next exchange attaches a new one."""
        segment, bell = self._segments[k], self._bells[k]
        self._segments[k] = self._bells[k] = None
        if bell is not None:
            bell.close()
        if segment is not None:
            segment.close()

    def _check_digest(self, b: _Binding, k: int, header: ps_pb2.PullHeader) -> None:
        if header.model_digest != b.placement.digest:
            raise ModelMismatch(
                f"shard {self.addresses[k]} holds another model than the one being pulled "
                f"into ({header.model_digest[:12]} vs {b.placement.digest[:12]})"
            )

    def _pulled(self, b: _Binding, k: int, header: ps_pb2.PullHeader) -> None:
        """Note shard k's version and incarnation after a pull (its digest already checked)."""
        if header.incarnation != self._incarnation[k]:
            self._incarnation[k] = header.incarnation
            self._min_next[k] = 0
        self.versions[k] = header.version

    def _streams(
        self, b: _Binding, k: int, grads: list[np.ndarray] | None, step: int, flats: list[np.ndarray] | None
    ) -> int:
        """Shard k's part of an exchange over gRPC: a Push stream, then a Pull stream."""
        version = 0
        if grads is not None:
            version = self._push_stream(b, k, grads, step)
        if flats is not None:
            version = self._pull_stream(b, k, flats)
        return version

    def _push_stream(self, b: _Binding, k: int, grads: list[np.ndarray], step: int) -> int:
        dtype = self.dtype
        base = self.versions[k]
        header = ps_pb2.PushHeader(
            worker_id=self.worker_id,
            step=step,
            base_version=base,
            model_digest=b.placement.digest,
            dtype=dtype,
        )

        def messages() -> Iterator[bytes]:
            yield ps_pb2.PushMessage(header=header).SerializeToString()
            for piece, offset, data in iter_chunks(b.views(k, grads), dtype, self.chunk_bytes, reuse=True):
                yield codec.encode_chunk(piece, offset, data)

        reply = self._raw[k].push(messages(), timeout=self.timeout)
        self._min_next[k] = base + 1
        return int(reply.version)

    def _pull_stream(self, b: _Binding, k: int, flats: list[np.ndarray]) -> int:
        dtype = self.dtype
        req = ps_pb2.PullRequest(
            worker_id=self.worker_id if self._joined else "",
            min_version=self._min_next[k],
            dtype=dtype,
            incarnation=self._incarnation[k],
        )
        stream = self._raw[k].pull(req, timeout=self.timeout)
        first = codec.decode(next(stream), ps_pb2.PullMessage)
        if isinstance(first, codec.Chunk) or first.WhichOneof("kind") != "header":
            raise MalformedStream(f"shard {self.addresses[k]} sent a pull stream without its header")
        self._check_digest(b, k, first.header)
        receiver = ChunkReceiver(b.views(k, flats), b.labels(k), dtype)
        for raw in stream:
            chunk = codec.decode(raw, ps_pb2.PullMessage)
            if not isinstance(chunk, codec.Chunk):
                raise MalformedStream(f"shard {self.addresses[k]} sent a second header in a pull stream")
            receiver.add(chunk.piece, chunk.offset, chunk.data)
        receiver.finish()
        self._pulled(b, k, first.header)
        return int(first.header.version)

    # -- plumbing ----------------------------------------------------------------------------------------------

    def _call(self, address: str, fn: Callable[[], T]) -> T:
        try:
            return fn()
        except grpc.RpcError as err:
            raise from_rpc_error(err, address) from None

    def _on_shard(self, k: int, fn: Callable[[], T], rejoin: bool = True, failed: PSError | None = None) -> T:
        """Run fn against shard k: retry UNAVAILABLE with backoff (a shard restarting) until the timeout, and
        (once each) join again, re-initialise or re-attach when the shard forgot this worker, the model or the
        segment. `failed`: fn already failed so once. Retrying a push is safe: the shard applies a (worker,
        step) once."""
        deadline = time.monotonic() + self.timeout
        delay, init_delay, recovered = 0.05, INIT_POLL_FIRST_S, set[type[PSError]]()
        while True:
            if failed is None:
                try:
                    return self._call(self.addresses[k], fn)
                except PSError as err:
                    failed = err
            exc, failed = failed, None
            if isinstance(exc, InitInProgress) and time.monotonic() + init_delay < deadline:
                # Not a fault: another worker is registering the same model; it is held once that ends.
                log.debug("shard %s is being initialised by another worker; asking again", self.addresses[k])
                time.sleep(init_delay)
                init_delay = min(2 * init_delay, INIT_POLL_S)
            elif exc.code == grpc.StatusCode.UNAVAILABLE and time.monotonic() + delay < deadline:
                log.info("shard %s unavailable (%s); retrying in %.2f s", self.addresses[k], exc, delay)
                time.sleep(delay)
                delay = min(2 * delay, 2.0)
            elif isinstance(exc, UnknownWorker) and rejoin and self._joined and UnknownWorker not in recovered:
                recovered.add(UnknownWorker)
                self._rejoin(k)
            elif isinstance(exc, NotInitialized) and self._registered is not None and NotInitialized not in recovered:
                recovered.add(NotInitialized)
                # The shard restarted with no checkpoint: give it this worker's current weights again.
                log.warning(
                    "shard %s lost the model (restarted without a checkpoint); re-initialising it", self.addresses[k]
                )
                reinit = functools.partial(self._init_shard, self._registered, k)
                self._on_shard(k, reinit, rejoin)  # retried: another worker may be re-initialising it too
                self._min_next[k] = 0
            elif isinstance(exc, NotAttached) and NotAttached not in recovered:
                recovered.add(NotAttached)  # the shard restarted or evicted us: the next try attaches anew
                self._drop_segment(k)
            else:
                raise exc

    def _fan_out(self, start: Callable[[int], Callable[[], T]]) -> list[T]:
        """Run an operation on every shard at once: `start(k)` begins it on shard k and returns a function that
        waits for its result. A shard that fails is then retried on its own (see _on_shard); the first failure
        that remains is raised, once every shard has finished."""
        waits: list[Callable[[], T] | PSError] = [PSError()] * len(self._stubs)
        for k in reversed(range(len(self._stubs))):  # shard 0 last: its wait may run in this thread
            try:
                waits[k] = self._call(self.addresses[k], functools.partial(start, k))
            except PSError as exc:
                waits[k] = exc
        results: list[T] = []
        error: PSError | None = None
        for k, wait in enumerate(waits):
            try:
                if isinstance(wait, PSError):
                    raise wait
                results.append(self._call(self.addresses[k], wait))
            except PSError as exc:
                try:
                    results.append(self._on_shard(k, functools.partial(_begin_and_wait, start, k), failed=exc))
                except PSError as final:
                    error = error or final
        if error is not None:
            raise error
        return results

    def _each(
        self, fn: Callable[[int], T], shards: Sequence[int] | range | None = None, rejoin: bool = True
    ) -> list[T]:
        """Run fn(k) for every shard k concurrently (with retries); raise the first failure as a PSError."""
        ks = list(range(len(self._stubs)) if shards is None else shards)
        futs = [self._pool.submit(self._on_shard, k, lambda k=k: fn(k), rejoin) for k in ks]
        results, error = [], None
        for f in futs:
            try:
                results.append(f.result())
            except PSError as exc:
                error = error or exc
        if error is not None:
            raise error
        return results

    def close(self) -> None:
        """Leave the job and close every channel."""
        self._closing.set()
        if self._heartbeat is not None:
            self._heartbeat.join(timeout=5)
        try:
            self.leave()
        except PSError as exc:
            log.warning("leaving the job failed: %s", exc)
        finally:
            self._pool.shutdown(wait=True)
            for k in range(len(self._segments)):
                self._drop_segment(k)
            for c in self._channels:
                c.close()

    def __enter__(self) -> PSClient:
        return self

    def __exit__(
        self, exc_type: type[BaseException] | None, exc: BaseException | None, tb: TracebackType | None
    ) -> None:
        self.close()
