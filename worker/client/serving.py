"""Reading a model from serving copies (ps-serve): `ServingClient` for lookups and pulls, `serve(model, address)` for a
converted model (make_sparse, SparseEmbedding) whose forward reads its rows from them.

A serving copy follows training (the rows trained a moment ago), never trains and never waits for the shards; each
answer is every shard's at one version (`versions`).
"""

from __future__ import annotations

import logging
import socket
import struct
import threading
import time
from collections.abc import Mapping, Sequence
from typing import Any

import grpc
import numpy as np
import torch
from torch import nn

from paramserver.errors import FailedPrecondition, from_rpc_error, from_status
from paramserver.placement import place
from paramserver.tables import TableSpec, shard_of, spec_from_proto
from paramserver.transport.socket_client import split_host
from paramserver.v1 import ps_pb2, ps_pb2_grpc
from paramserver.wire.frames import recv_exact
from paramserver.wire.specs import specs_from_proto
from worker.client.served_rows import ServedRows, grouped_reads
from worker.client.sparse import SparseEmbedding, tables_of, without_rows

_OPTIONS = [("grpc.max_receive_message_length", 8 << 20), ("grpc.max_send_message_length", 8 << 20)]
SOCKET_PAUSE_S = 30.0  # a lookup socket that failed is tried again after this (gRPC meanwhile)
_LENGTH = struct.Struct("<I")  # the lookup socket's frame length (paramserver.serving.lookup_socket)
log = logging.getLogger(__name__)


def _socket_error(body: bytes, address: str) -> Exception:
    """The PSError a lookup socket's error body names (paramserver.wire.frames.error_body)."""
    code = next((c for c in grpc.StatusCode if c.value[0] == body[0]), grpc.StatusCode.UNKNOWN) if body else None
    named = body[2 : 2 + body[1]].decode() if len(body) > 1 else ""
    detail = body[2 + body[1] :].decode(errors="replace") if len(body) > 1 else "an empty error"
    return from_status(code or grpc.StatusCode.UNKNOWN, detail, named or None, address)


class _Copies:
    """One ps-serve process: its channel, its lookup socket (when it has one this client reaches), and the shards
    it holds copies of."""

    def __init__(self, address: str) -> None:
        self.address = address
        self.channel = grpc.insecure_channel(address, options=_OPTIONS)
        self.stub = ps_pb2_grpc.ServingStub(self.channel)
        self.held: tuple[int, ...] = ()
        self.lookup_port = 0
        self._socket: socket.socket | None = None
        self._socket_lock = threading.Lock()
        self._socket_again = 0.0  # after a failure, gRPC alone until then

    def lookup(self, request: ps_pb2.LookupRequest, timeout: float) -> ps_pb2.LookupReply:
        """A Lookup over the process's lookup socket (SPEC.md section 17), or over gRPC where that cannot be
        reached (a port not exposed, a process of before the socket)."""
        if self.lookup_port and time.monotonic() >= self._socket_again:
            body = request.SerializeToString()
            with self._socket_lock:
                try:
                    kind, answer = self._over_socket(body, timeout)
                except OSError as exc:
                    log.info("the lookup socket of %s failed (%s): gRPC for %.0f s", self.address, exc, SOCKET_PAUSE_S)
                    self._drop_socket()
                    self._socket_again = time.monotonic() + SOCKET_PAUSE_S
                else:
                    if kind == 0:
                        return ps_pb2.LookupReply.FromString(answer)
                    raise _socket_error(answer, self.address)
        try:
            return self.stub.Lookup(request, timeout=timeout)
        except grpc.RpcError as err:
            raise from_rpc_error(err, self.address) from None

    def _over_socket(self, body: bytes, timeout: float) -> tuple[int, bytes]:
        if self._socket is None:
            self._socket = socket.create_connection((split_host(self.address), self.lookup_port), timeout=timeout)
            self._socket.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
        sock = self._socket
        sock.settimeout(timeout)
        sock.sendall(_LENGTH.pack(len(body)) + body)
        head = recv_exact(sock, _LENGTH.size)
        if head is None:
            raise ConnectionError("the lookup socket closed")
        (length,) = _LENGTH.unpack(head)
        answer = recv_exact(sock, length)
        if answer is None or not length:
            raise ConnectionError("the lookup socket closed mid-answer")
        return answer[0], answer[1:]

    def _drop_socket(self) -> None:
        if self._socket is not None:
            self._socket.close()
            self._socket = None

    def close(self) -> None:
        with self._socket_lock:
            self._drop_socket()
        self.channel.close()

    def wait_ready(self, deadline: float) -> ps_pb2.ServingStatus:
        while True:
            try:
                left = max(0.1, deadline - time.monotonic())
                status = self.stub.Status(ps_pb2.ServingStatusRequest(), timeout=left)
                if status.ready:
                    # A process of before `held` holds every shard.
                    self.held = tuple(status.held) if status.held else tuple(range(status.shards))
                    self.lookup_port = status.lookup_port
                    return status
            except grpc.RpcError as err:
                if err.code() not in (grpc.StatusCode.UNAVAILABLE, grpc.StatusCode.DEADLINE_EXCEEDED):
                    raise from_rpc_error(err, self.address) from None
            if time.monotonic() > deadline:
                raise TimeoutError(f"the serving copies at {self.address} were not ready in time")
            time.sleep(0.05)


class ServingClient:
    """A connection to the serving copies of a job (ps-serve): one process's address ("host:port"), or several
    (a list, or "host:port,host:port"), such as one per shard (`ps-serve --shard-index I`). A read goes to the
    process holding each shard's copy: each shard's part of an answer is of one version, and so is the whole answer
    when one process holds every shard."""

    def __init__(self, address: str | Sequence[str], timeout: float = 30.0) -> None:
        addresses = [a.strip() for a in (address.split(",") if isinstance(address, str) else address) if a.strip()]
        if not addresses:
            raise ValueError("name the serving copies' address, host:port (or several)")
        self.address = ",".join(addresses)
        self.timeout = timeout
        self._processes = [_Copies(a) for a in addresses]
        self.versions: tuple[int, ...] = ()  # each shard's version, as the last answer gave them
        self._recent: tuple[int, ...] = ()
        self._recent_at = -float("inf")
        self._recent_lock = threading.Lock()
        self._status = self.wait_ready(timeout)
        self.tables: dict[str, TableSpec] = {t.name: spec_from_proto(t) for t in self._status.tables}

    def close(self) -> None:
        for p in self._processes:
            p.close()

    def __enter__(self) -> ServingClient:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

    def _call(self, copies: _Copies, method: Any, request: Any) -> Any:
        try:
            return method(request, timeout=self.timeout)
        except grpc.RpcError as err:
            raise from_rpc_error(err, copies.address) from None

    def status(self) -> ps_pb2.ServingStatus:
        """The copies' versions (each shard's from the process it is read from), readiness and model."""
        got = [self._call(p, p.stub.Status, ps_pb2.ServingStatusRequest()) for p in self._processes]
        return self._merged(got)

    def _merged(self, got: list[ps_pb2.ServingStatus]) -> ps_pb2.ServingStatus:
        status = ps_pb2.ServingStatus()
        status.CopyFrom(got[0])
        by_address = dict(zip((p.address for p in self._processes), got, strict=True))
        versions = [
            by_address[self._reader[s].address].versions[s] if s in self._reader else 0 for s in range(status.shards)
        ]
        del status.versions[:]
        status.versions.extend(versions)
        status.ready = all(g.ready for g in got)
        del status.held[:]
        status.held.extend(sorted(self._reader))
        self.versions = tuple(versions)
        return status

    def wait_ready(self, timeout: float) -> ps_pb2.ServingStatus:
        """Wait until every process's copies hold a whole version (TimeoutError after `timeout` seconds); check
        that the processes serve one model. A lookup of IDs of a shard none of them holds is refused."""
        deadline = time.monotonic() + timeout
        got = [p.wait_ready(deadline) for p in self._processes]
        first = got[0]
        for p, g in zip(self._processes, got, strict=True):
            if g.model_digest != first.model_digest or g.shards != first.shards:
                raise ValueError(
                    f"{p.address} serves model {g.model_digest[:12]} of {g.shards} shard(s), "
                    f"{self._processes[0].address} model {first.model_digest[:12]} of {first.shards}: "
                    "name the copies of one job"
                )
        self._shards = first.shards
        self._reader: dict[int, _Copies] = {}
        for p in self._processes:
            for shard in p.held:
                self._reader.setdefault(shard, p)
        return self._merged(got)

    def recent_versions(self, max_age: float) -> tuple[int, ...]:
        """Each shard's version as an answer at most `max_age` seconds old gave them (asked anew when older): what
        every table's cache of a served model checks, one Status call for all of them."""
        with self._recent_lock:
            if time.monotonic() - self._recent_at > max_age:
                self._recent = tuple(self.status().versions)
                self._recent_at = time.monotonic()
            return self._recent

    @property
    def version(self) -> int:
        """The oldest shard copy's version (every shard's is at least this)."""
        return min(self.status().versions, default=0)

    def lookup_many(self, asked: Mapping[str, np.ndarray | torch.Tensor]) -> dict[str, np.ndarray]:
        """Rows of several tables in one request (one per process holding their shards), by table name:
        {name: float32 [len(ids), dim]}."""
        names = list(asked)
        for n in names:
            if n not in self.tables:
                raise ValueError(f"no table named {n!r} (the model's tables: {', '.join(self.tables) or 'none'})")
        ids = [np.ascontiguousarray(np.asarray(asked[n]), dtype="<i8").reshape(-1) for n in names]
        out = {n: np.empty((len(i), self.tables[n].dim), np.float32) for n, i in zip(names, ids, strict=True)}
        readers = sorted({id(p): p for p in self._reader.values()}.values(), key=lambda p: p.address)
        whole = len(readers) == 1 and len(self._reader) == self._shards  # one process holds every shard
        owners = [] if whole else [shard_of(i, self._shards) for i in ids]
        lacking = sorted({int(s) for o in owners for s in np.unique(o)} - set(self._reader))
        if lacking:
            raise FailedPrecondition(
                f"no serving process at {self.address} holds a copy of shard(s) {lacking}: start ps-serve "
                "--shard-index for them, or name the process that holds them"
            )
        versions = [0] * self._shards
        for p in readers:
            mine = [np.isin(o, [s for s, r in self._reader.items() if r is p]) for o in owners]
            sent = [i[m] for i, m in zip(ids, mine, strict=True)] if mine else ids
            request = ps_pb2.LookupRequest(
                tables=[ps_pb2.ServingIds(table=n, ids=i.tobytes()) for n, i in zip(names, sent, strict=True)]
            )
            reply = p.lookup(request, self.timeout)
            for k, (n, raw) in enumerate(zip(names, reply.rows, strict=True)):
                rows = np.frombuffer(raw, "<f4").reshape(-1, self.tables[n].dim)
                out[n][mine[k] if mine else slice(None)] = rows
            for s, r in self._reader.items():
                if r is p:
                    versions[s] = reply.versions[s]
        self.versions = tuple(versions)
        return out

    def lookup(
        self, model: nn.Module | None, table: str | SparseEmbedding, ids: np.ndarray | torch.Tensor
    ) -> torch.Tensor:
        """The rows of `ids` in one table (by its name in `model`, or the SparseEmbedding itself), [*ids.shape, dim]."""
        name = table if isinstance(table, str) else _name_in(model, table)
        flat = np.asarray(ids.detach().cpu() if isinstance(ids, torch.Tensor) else ids).reshape(-1)
        rows = self.lookup_many({name: flat})[name]
        return torch.from_numpy(rows.copy()).reshape(*np.shape(ids), -1)

    def pull(self, model: nn.Module) -> tuple[int, ...]:
        """Copy the served dense weights and buffers into `model` (the same architecture the job trains); return each
        shard's version they are of."""
        status = self.status()
        with without_rows():  # the dense tensors alone: the tables stay where they are read
            state = model.state_dict()
        specs = specs_from_proto(status.specs)
        missing = [sp.name for sp in specs if sp.name not in state or tuple(state[sp.name].shape) != sp.shape]
        if missing:
            raise ValueError(
                f"the served model's tensors {missing[:5]} are not in this model as shaped there: build the model "
                "the job trains"
            )
        placement = place(specs, status.shards, tables=tuple(self.tables.values()))
        versions = []
        with torch.no_grad():
            for shard in range(status.shards):
                version, flat = self._pull_shard(shard)
                versions.append(version)
                at = 0
                for piece in placement.shards[shard]:
                    target = state[piece.name].view(-1)[piece.start : piece.start + piece.length]
                    target.copy_(torch.from_numpy(flat[at : at + piece.length]))
                    at += piece.length
        self.versions = tuple(versions)
        return self.versions

    def _pull_shard(self, shard: int) -> tuple[int, np.ndarray]:
        reader = self._reader.get(shard)
        if reader is None:
            raise FailedPrecondition(f"no serving process at {self.address} holds a copy of shard {shard}")
        try:
            messages = iter(reader.stub.Pull(ps_pb2.ServingPullRequest(shard=shard), timeout=self.timeout))
            head = next(messages).header
            flat = np.empty(head.dense_elements, np.float32)
            for m in messages:
                data = np.frombuffer(m.dense.data, "<f4")
                flat[m.dense.offset : m.dense.offset + len(data)] = data
        except grpc.RpcError as err:
            raise from_rpc_error(err, reader.address) from None
        return head.version, flat


def _name_in(model: nn.Module | None, table: SparseEmbedding) -> str:
    for name, module in tables_of(model) if model is not None else []:
        if module is table:
            return name
    raise ValueError("the table is not one of the model's SparseEmbeddings: name it instead")


def serve(model: nn.Module, address: str | ServingClient, refresh: float = 0.05) -> nn.Module:
    """Make a converted model (make_sparse, SparseEmbedding) read from the serving copies at `address`: its dense
    weights pulled now, each table's rows looked up as forward passes need them (a cache per table that holds for
    one version, checked every `refresh` s; the rows a forward pass lacks, of every table, in one request).
    Returns the model; call again (or `client.pull(model)`) to refresh the dense weights."""
    client = address if isinstance(address, ServingClient) else ServingClient(address)
    mine = dict(tables_of(model))
    if set(mine) != set(client.tables):
        raise ValueError(
            f"the served model holds tables {sorted(client.tables)}, this model {sorted(mine)}: build the model the "
            "job trains (converted with make_sparse as it was)"
        )
    client.pull(model)
    sources = {}
    for name, module in mine.items():
        sources[id(module)] = ServedRows(client, name, refresh)
        module.attach(sources[id(module)])
        module.given = None
    return grouped_reads(model, sources)
