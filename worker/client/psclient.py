"""PSClient: a worker's view of the parameter server: topology, join, register, pull and push to every shard.

Each call fans out to every shard's `ShardLink` at once; a link picks its transport (shared memory on this host,
the data socket on another, gRPC as the last resort: see worker.client.transports). Weights are written straight
into the model's own CPU tensors, and gradients are read straight from them; CUDA tensors and buffers go through a
host mirror. A module's tensors are its parameters, then its persistent buffers (BatchNorm's running statistics),
which push their values and pull the job's (see worker.client.binding).
"""

from __future__ import annotations

import logging
import os
import threading
import uuid
from collections.abc import Callable, Sequence
from concurrent import futures
from types import TracebackType
from typing import Any, TypeVar

import numpy as np
import torch

from paramserver.errors import ModelMismatch, PSError, PullTimeout
from paramserver.modes import mode_name
from paramserver.placement import SLICE_ELEMENTS, Placement, TensorSpec, place
from paramserver.security import channel_credentials, client_ssl_context
from paramserver.transport import shm
from paramserver.wire.chunks import CHUNK_BYTES, itemsize, wire_dtype
from worker.client import model_file
from worker.client.binding import Binding, TensorDict, Tensors, tensors_of
from worker.client.claims import DatasetClaims
from worker.client.compress import Compressor, Scheme
from worker.client.connect import connect_links
from worker.client.fanout import each, fan_out
from worker.client.feed import GradientFeed
from worker.client.host_group import HostGroup
from worker.client.link import Session, ShardLink
from worker.client.membership import Membership
from worker.client.model_names import registered_kind, unlike_registered
from worker.client.rows import SparseJob, TableRows, by_shard, lookup_jobs, row_jobs
from worker.client.sparse import Prepared, SparseEmbedding, tables_of
from worker.client.transports import INLINE_BYTES
from worker.client.turns import NO_TURNS, Turns

log = logging.getLogger(__name__)

T = TypeVar("T")

__all__ = ["INLINE_BYTES", "PSClient", "Tensors"]


class _Rows:
    """A registered SparseEmbedding's view of its client: lookups of its table (see worker.client.sparse.RowSource)."""

    trains = True

    def __init__(self, client: PSClient, binding: Binding, table: int) -> None:
        self._client = client
        self._binding = binding
        self._table = table

    def lookup(self, ids: np.ndarray) -> np.ndarray:
        return self._client._lookup(self._binding, self._table, ids)

    @property
    def group(self) -> tuple[int, int]:
        """Which tables can be looked up together with this one: those of the same model on the same client."""
        return (id(self._client), id(self._binding))

    def lookup_group(self, wanted: Sequence[tuple[SparseEmbedding, Prepared]]) -> None:
        """Fetch the rows of several of the model's tables (each with its prepared IDs) in one exchange per shard;
        each table holds its rows for its forward pass (SparseEmbedding.fetched)."""
        self._client._lookup_group(self._binding, wanted)


class PSClient:
    """Talk to every shard of a parameter server, knowing any one shard's address.

    `with PSClient("host:50051") as client:` joins the job (a rank for data sharding) and leaves on exit.
    `register(model)` initialises the servers from the model or adopts what they hold; `pull(model)` copies the
    current weights (and buffers) into it in place; `push(model)` sends every parameter's `.grad` and every
    buffer's value; `push_pull(model)` does both in one exchange per shard (what a training step needs). Also works
    on a plain mapping of name -> float32 tensor (push then sends the tensors themselves as the gradient; a
    `TensorDict` names which entries are buffers, and which tables ride along).

    Shards on this host exchange tensors through shared memory (`shared_memory=False` turns that off); others
    through their data socket, raw bytes over TCP (`data_socket=False` turns that off); the rest through gRPC:
    one unary call per step for a small model, else Push and Pull streams. `dtype` ('float32', 'bf16', 'fp16')
    is the element type on the network; shared memory always holds float32. `links` has one `ShardLink` per
    shard: which transport each uses now, and what it has seen.

    `push_in_turn`: push a large model's parts to the data sockets one shard after the other, so that one shard's
    weights come back while the next one's gradient goes out (True), or to all at once (False); None (the
    default): in turn for shards reached over a network, where a link is the limit, at once for a shard on a
    loopback address, where memory copies on several cores are.

    `compress`: 'topk:RATIO' or 'powersgd:RANK' compresses each push over a data socket (a shard on another host),
    keeping what it leaves out for the next push (error feedback; worker/client/compress.py). None (the default):
    pushes go whole.

    `group`: this process's place in its host's group (`HostGroup.from_env()` under ps-worker --nproc): the
    group's processes are one member of the job, their gradients averaged on the host and exchanged once
    (worker/client/host_group.py); only the group's first process talks to the shards.
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
        compress: str | None = None,
        group: HostGroup | None = None,
    ) -> None:
        self.worker_id = worker_id or uuid.uuid4().hex
        self.job_name = job_name
        self.dtype: Any = wire_dtype(dtype)  # a ps_pb2.DType value
        self.timeout = timeout
        self.chunk_bytes = chunk_bytes
        # Offer each shard a shared-memory segment; shards on other hosts refuse it and get the data socket (or,
        # where they serve none or it cannot be reached, the gRPC streams).
        self.shared_memory = shared_memory and shm.available()
        self.data_socket = data_socket
        self.push_in_turn = push_in_turn
        # What error feedback holds back for each shard part: `compressor.remainder(digest, shard)`.
        self.compressor = Compressor(Scheme.parse(compress)) if compress else None
        self._session = Session(
            worker_id=self.worker_id,
            job_name=job_name,
            timeout=timeout,
            dtype=self.dtype,
            chunk_bytes=chunk_bytes,
            shared_memory=self.shared_memory,
            data_socket=data_socket,
            push_in_turn=push_in_turn,
            tls=client_ssl_context(tls_ca, tls_cert, tls_key),
            tls_server_name=tls_server_name,
            compressor=self.compressor,
        )
        self.rank = 0
        self.world_size = 1
        self.group = group
        self._connect_timeout = connect_timeout
        self._step = 0
        self._registered_kind = ""  # the registered model's class, for what save says of another model
        self._bindings: dict[int, Binding] = {}
        self._feed_pool: futures.ThreadPoolExecutor | None = None  # exchanges that follow backward (push_pull)
        # One exchange or lookup on the links at a time: a forward pass's lookup waits for an exchange that another
        # thread runs (worker.train.overlap). Re-entrant: a failed exchange's caller may pull on the same thread.
        self._links_busy = threading.RLock()
        self.links: tuple[ShardLink, ...] = ()
        credentials = channel_credentials(tls_ca, tls_cert, tls_key)
        self.topology, self.links, self._pool = connect_links(
            address, self._session, credentials, auth_token, connect_timeout
        )
        self.addresses: list[str] = list(self.topology.shards)
        self.mode = mode_name(self.topology.job.mode, "unknown")
        self._membership = Membership(self.links, self._session, self._pool)
        if join:
            try:
                self.join()
            except BaseException:
                self.close()
                raise

    @property
    def versions(self) -> list[int]:
        """What each shard's last pull returned."""
        if self._member:
            return list(self.group.versions) if self.group is not None else []
        return [link.version for link in self.links]

    @property
    def _member(self) -> bool:
        """Whether this process is a host group's member, not its first process: it never talks to the shards."""
        return self.group is not None and not self.group.leader

    # -- membership --------------------------------------------------------------------------------------------

    def join(self) -> None:
        """Join the job on every shard (shard 0 first: its rank is the one that counts), and renew the lease from
        then on (see worker.client.membership). In a host group, only its first process joins; the group's
        processes take ranks of their own within the host's (see worker.client.host_group)."""
        if self.group is None:
            self.rank, self.world_size = self._membership.join()
        elif self.group.leader:
            rank, world = self._membership.join()
            self.rank, self.world_size = self.group.lead(rank, world, self._connect_timeout)
        else:
            self.rank, self.world_size = self.group.follow(self._connect_timeout)

    def leave(self, finished: bool = False) -> None:
        """Leave the job on every shard; a sync round stops waiting for this worker.

        `finished=True` says the worker completed its training: once every worker of the job has, shards run
        with exit_when_done stop by themselves. A host group's member has nothing to leave: its first process
        leaves for the host.
        """
        if not self._member:
            self._membership.leave(finished)

    def set_idle(self, idle: bool) -> None:
        """Say on every shard whether this worker has nothing to train for now (ps-worker --follow, caught up):
        sync rounds stop waiting for an idle worker and SSP compares no clock of it, until it pushes again. Every
        heartbeat from then on says it too, so a restarted shard learns it within a third of the lease."""
        if self._session.idle != idle:
            self._session.idle = idle
            each(self._pool, self.links, lambda link: link.heartbeat(self._session.timeout))

    def claims(self, dataset: str) -> DatasetClaims:
        """The job's claims on the shards of a growing dataset (`dataset`: its key, `claims.dataset_key`), kept by
        shard 0; ValueError in a host group (each dataset shard is trained by one process)."""
        if self.group is not None:
            raise ValueError("--follow trains each dataset shard in one process: leave --nproc at 1")
        return DatasetClaims(self.links[0], self._session, dataset)

    # -- the model ---------------------------------------------------------------------------------------------

    def _bind(self, obj: Tensors) -> Binding:
        names, tensors, buffer = tensors_of(obj)
        b = self._bindings.get(id(obj))
        if (
            b is not None
            and b.names == names
            and b.buffer == buffer
            and all(x is y for x, y in zip(b.tensors, tensors, strict=True))
        ):
            return b
        specs = [TensorSpec(n, tuple(t.shape), is_b) for n, t, is_b in zip(names, tensors, buffer, strict=True)]
        tables = tables_of(obj) if isinstance(obj, torch.nn.Module) else []
        if isinstance(obj, TensorDict):  # a module's tensors as a mapping, its tables riding along
            tables = obj.tables
        table_specs = [module.spec(name or "table") for name, module in tables]
        slice_elements = int(self.topology.slice_elements) or SLICE_ELEMENTS
        placement = place(specs, len(self.links), slice_elements, table_specs)
        host = [
            None
            if (t.device.type == "cpu" and t.is_contiguous() and not is_b)
            else torch.empty(t.numel(), dtype=torch.float32, pin_memory=t.device.type == "cuda")
            for t, is_b in zip(tensors, buffer, strict=True)
        ]
        b = Binding(names, tensors, placement, host, tables=[module for _, module in tables])
        self._bindings[id(obj)] = b
        return b

    def placement(self, obj: Tensors) -> Placement:
        """Which pieces of `obj`'s tensors each shard holds (see paramserver.placement)."""
        return self._bind(obj).placement

    def digest(self, obj: Tensors) -> str:
        """The digest naming this model on these shards (protos/paramserver/v1/SPEC.md says how it is made)."""
        return self._bind(obj).digest

    def register(self, obj: Tensors) -> int:
        """Initialise every shard from `obj`, or adopt the weights the shards already hold; return the version."""
        b = self._bind(obj)
        if not self._member:  # a host group's member gets the weights from its first process, which registers
            each(self._pool, self.links, lambda link: link.init(b))
        self._session.registered, self._registered_kind = b, registered_kind(obj)
        for index, module in enumerate(b.tables):
            module.attach(_Rows(self, b, index), b.uniques)
            module.given = None  # on the shards now (or theirs were adopted): memory back
        return self.pull(obj)

    def save(self, model: torch.nn.Module, path: str | os.PathLike[str], *, optimizer_state: bool = False) -> None:
        """Write the registered `model` to one safetensors file at `path`: its dense tensors and buffers as the shards
        hold them, and every table's rows, streamed shard by shard (see worker.client.model_file). `worker.load`
        puts it into a model that then predicts with no server. `optimizer_state`: also each row's. ModelMismatch,
        saying which model was registered and how to save it, for another model (a LightningModule's inner one)."""
        if self._member:
            raise ValueError("a host group's model is saved by its first process (local rank 0), not by the others")
        registered = self._session.registered
        if registered is not None and registered.digest != self.digest(model):
            raise ModelMismatch(unlike_registered(model, registered, self._registered_kind))
        model_file.save(self, model, path, optimizer_state=optimizer_state)

    def pull_own(self, obj: Tensors) -> int:
        """As `pull`, through this process's own links even as a host group's first process (the group's other
        processes may be done): what `save` reads."""
        with self._links_busy:
            return self._exchange_now(self._bind(obj), None, 0, True, None)

    def lookup(self, obj: Tensors, table: int, ids: np.ndarray) -> np.ndarray:
        """The current rows of table `table` (its index among the model's SparseEmbedding modules) for these unique
        int64 IDs, float32 [len(ids), dim], each from the shard that holds it, all shards at once. A SparseEmbedding
        of a registered model calls this in its forward pass."""
        return self._lookup(self._bind(obj), table, ids)

    def _lookup(self, b: Binding, table: int, ids: np.ndarray) -> np.ndarray:
        with self._links_busy:
            return self._lookup_now(b, table, ids)

    def _lookup_now(self, b: Binding, table: int, ids: np.ndarray) -> np.ndarray:
        ids = np.ascontiguousarray(ids, dtype=np.int64)
        dim = b.placement.tables[table].dim
        out = np.empty((len(ids), dim), dtype=np.float32)
        if not len(ids):
            return out
        parts = by_shard(ids, len(self.links))
        jobs: list[SparseJob | None] = []
        for where in parts:
            if where is None:
                jobs.append(None)
            else:
                jobs.append(SparseJob([], [TableRows(table, ids[where], out=np.empty((len(where), dim), np.float32))]))
        busy = [link for link, job in zip(self.links, jobs, strict=True) if job is not None]
        fan_out(busy, lambda link: link.begin(b, None, 0, None, NO_TURNS, jobs[link.index]))
        for where, job in zip(parts, jobs, strict=True):
            if where is not None and job is not None:
                out[where] = job.lookups[0].out
        return out

    def _lookup_group(self, b: Binding, wanted: Sequence[tuple[SparseEmbedding, Prepared]]) -> None:
        index = {id(table): k for k, table in enumerate(b.tables)}
        jobs, deliver = lookup_jobs([(index[id(t)], t, p) for t, p in wanted], len(self.links))
        with self._links_busy:
            busy = [link for link, job in zip(self.links, jobs, strict=True) if job is not None]
            fan_out(busy, lambda link: link.begin(b, None, 0, None, NO_TURNS, jobs[link.index]))
        deliver()

    def pull(self, obj: Tensors) -> int:
        """Copy the shards' current weights into `obj` in place; return the lowest shard version.

        After a push, waits for the version that includes it (in sync mode: the end of that round).
        """
        return self._exchange(self._bind(obj), grads=None, step=0, pull=True)

    def push(self, obj: Tensors, step: int | None = None) -> int:
        """Send the gradient (each parameter's .grad and each buffer's value; a mapping's tensors themselves) to every
        shard.

        Returns the lowest shard version after the push. `step` identifies the push for exactly-once delivery
        (default: this client's own counter).
        """
        b = self._bind(obj)
        grads = b.gradients(isinstance(obj, torch.nn.Module))
        rows, deliver = row_jobs(b, len(self.links))
        version = self._exchange(b, grads=grads, step=self._next_step(step), pull=False, rows=rows)
        deliver()
        return version

    def push_pull(self, obj: Tensors, step: int | None = None, *, backward: Callable[[], object] | None = None) -> int:
        """Push the gradient, then pull the weights that include it into `obj`: one exchange per shard, all
        shards at once (one shard's pull overlaps another's push). Returns the lowest shard version pulled.

        Raises like `push`; after Aborted (the round closed without this push) call `pull` to catch up. After
        PullTimeout the push was taken but its round is still open (in sync mode: workers yet to join or to push);
        `pull` waits for that round again.

        A model's SparseEmbedding tables push the gradients of the rows their forward passes touched, and fetch
        the rows of the IDs named by their `prefetch` (the next batch's), read after this update applied.

        `backward`: what runs this step's backward pass (its forward too, if it likes), called here while the
        exchange goes: each shard's push sends first the gradients backward finishes first (the last layers'), each
        as soon as it is final, as DDP's buckets do; the weights are written once it has returned. It must run one
        backward pass and leave the gradients as it made them (worker/client/feed.py). Where a push cannot follow
        backward (`exchange_after_backward_because` says why), it runs first and the exchange after it.
        """
        b = self._bind(obj)
        if backward is not None:
            if not self.exchange_after_backward_because(obj):
                return self._exchange_following(b, backward, self._next_step(step))
            backward()
        grads = b.gradients(isinstance(obj, torch.nn.Module))
        rows, deliver = row_jobs(b, len(self.links))
        version = self._exchange(b, grads=grads, step=self._next_step(step), pull=True, rows=rows)
        deliver()
        return version

    def exchange_after_backward_because(self, obj: Tensors) -> list[str]:
        """Why `push_pull(obj, backward=...)` would run backward first and exchange after it, on this client (an
        empty list: the exchange starts during backward)."""
        if not isinstance(obj, torch.nn.Module):
            return ["a mapping's tensors are the gradient itself"]
        b = self._bind(obj)
        reasons = (
            ("the model's tables push rows set aside after backward", bool(b.tables)),
            ("the host's group averages the gradient first", self.group is not None),
            ("compression encodes the whole part", self.compressor is not None),
            ("each shard's part fits one message", not self._large(b)),
        )
        return [reason for reason, applies in reasons if applies]

    def _large(self, b: Binding) -> bool:
        """Whether some shard's part of the model is over one message on the wire (it then takes turns, or streams
        during backward)."""
        return b.largest_part * itemsize(self.dtype) > INLINE_BYTES

    def _exchange_following(self, b: Binding, backward: Callable[[], object], step: int) -> int:
        """push_pull with `backward` run meanwhile, each shard's push taking the gradients as they become final."""
        with self._links_busy:
            if self._feed_pool is None:
                self._feed_pool = futures.ThreadPoolExecutor(len(self.links), thread_name_prefix="ps-feed")
            feed = GradientFeed(b, self._feed_pool)
            try:
                return self._exchange_now(b, None, step, True, None, feed, lambda: feed.run(backward))
            finally:
                feed.close()  # already, unless the exchange failed before backward ran: its hooks go

    def _next_step(self, step: int | None) -> int:
        if step is None:
            self._step += 1
            return self._step
        return step

    def _exchange(
        self,
        b: Binding,
        grads: list[np.ndarray] | None,
        step: int,
        pull: bool,
        rows: list[SparseJob | None] | None = None,
    ) -> int:
        """Push `grads` (if given, with each shard's `rows`), then pull (if asked), on every shard at once; return
        the lowest version. In a host group, through its first process (worker.client.host_group)."""
        with self._links_busy:
            if self.group is None:
                return self._exchange_now(b, grads, step, pull, rows)
            if b.tables:
                raise ValueError(
                    "a model with sparse tables is not reduced on the host yet: run ps-worker --nproc N "
                    "--no-host-reduce (each process a worker of its own)"
                )
            if not self.group.leader:
                return self.group.member_exchange(b, grads, pull)
            return self.group.lead_exchange(
                b, grads, pull, lambda mean: self._exchange_now(b, mean, step, pull, rows), lambda: self.versions
            )

    def _exchange_now(
        self,
        b: Binding,
        grads: list[np.ndarray] | None,
        step: int,
        pull: bool,
        rows: list[SparseJob | None] | None,
        feed: GradientFeed | None = None,
        meanwhile: Callable[[], object] | None = None,
    ) -> int:
        flats = b.flats() if pull else None
        bases = self.versions
        pushed = grads is not None or feed is not None
        turns = Turns(len(self.links), self.timeout) if pushed and self._large(b) else NO_TURNS
        sparse = rows or [None] * len(self.links)
        try:
            versions = fan_out(
                self.links, lambda link: link.begin(b, grads, step, flats, turns, sparse[link.index], feed), meanwhile
            )
        except PullTimeout:
            if pushed:
                # A shard waits to answer a pull only once it has taken the push (or found its round closed).
                for link, base in zip(self.links, bases, strict=True):
                    link.pushed_without_answer(base)
            raise
        if pull:
            b.unmirror_weights()
        return min(versions)

    def close(self) -> None:
        """Leave the job and close every channel; a call still in flight on another thread fails instead of
        retrying."""
        if self.links:
            self._membership.stop()
        try:
            self.leave()
        except PSError as exc:
            log.warning("leaving the job failed: %s", exc)
        finally:
            if self.group is not None:
                self.group.close()
            self._session.closed = True  # after the leave, which may itself need a retry
            if self.links:
                self._pool.shutdown(wait=True)
            if self._feed_pool is not None:
                self._feed_pool.shutdown(wait=True)
            for link in self.links:
                link.close()

    def __enter__(self) -> PSClient:
        return self

    def __exit__(
        self, exc_type: type[BaseException] | None, exc: BaseException | None, tb: TracebackType | None
    ) -> None:
        self.close()
