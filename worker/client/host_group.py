"""One member of the job per host: `ps-worker --nproc N` reduces its N processes' gradients on the host and
exchanges with the shards once (`PSClient(group=HostGroup.from_env())`), as BytePS and Horovod's hierarchical
all-reduce do, and as TF's MultiWorkerMirroredStrategy counts a host as one worker.

The group's first process (local rank 0, the *leader*) joins the job and holds the links to the shards; the others
(*members*) never talk to the shards. Each member offers the leader a shared-memory segment
(paramserver/transport/shm.py, the segment a worker offers a shard on its host): at every exchange it writes its
gradient (and its buffers' values) into the segment's gradient region and says so over a Unix socket; the leader
averages the N gradients, runs the exchange, writes the pulled weights once into a segment of its own that every
member has mapped, and answers each member with the version (or the error it got, which the member raises as its
own). A member copies the weights out before it sends its next exchange, and the leader writes them only once every
member has sent it, so one weights region serves them all. So the servers see
one worker per host (`ps-server --workers` counts hosts), and a sync round still averages every process's gradient
with equal weight: with equal batches it equals local training on the combined batch.

Ranks: the host's rank r of W hosts becomes rank r * N + i of W * N for process i, so the host's part of the data
is split among its processes exactly as N separate workers would split it.

Every process of a group makes the same exchanges in the same order (they run the same loop); one that falls out
of step, or a process that dies, ends the group: the others get GroupBroken (the socket tells at once), stop, and
the leader leaves the job. A new `ps-worker --nproc N` resumes from the servers' state.
"""

from __future__ import annotations

import json
import os
import secrets
import socket
import struct
import time
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

import numpy as np

from paramserver import errors
from paramserver.transport import shm
from worker.client.binding import Binding

ENV = "PS_HOST_GROUP"  # "<local rank>/<size>/<socket name>": set by ps-worker --nproc for each of its processes
_LENGTH = struct.Struct("<I")
MAX_MESSAGE = 1 << 16


class GroupBroken(ConnectionError):
    """A process of this host's group is gone, or out of step: the group stops."""


@dataclass(frozen=True)
class GroupSpec:
    """Where a process stands in its host's group."""

    local_rank: int
    size: int
    address: str  # an abstract Unix socket name (a NUL byte first): the leader listens, the members connect

    @classmethod
    def new(cls, size: int) -> list[GroupSpec]:
        """The specs of a new group of `size` processes."""
        address = f"\0paramserver-group-{os.getpid()}-{secrets.token_hex(8)}"
        return [cls(i, size, address) for i in range(size)]

    def env(self) -> str:
        return f"{self.local_rank}/{self.size}/{self.address[1:]}"

    @classmethod
    def from_env(cls) -> GroupSpec | None:
        value = os.environ.get(ENV)
        if not value:
            return None
        rank, size, name = value.split("/", 2)
        return cls(int(rank), int(size), "\0" + name)


def _gone(who: str) -> GroupBroken:
    return GroupBroken(f"{who} is gone: this host's group stops (start ps-worker --nproc again to resume)")


def _send(sock: socket.socket, doc: dict[str, Any], who: str = "the other end") -> None:
    body = json.dumps(doc).encode()
    try:
        sock.sendall(_LENGTH.pack(len(body)) + body)
    except OSError:  # a peer killed with our bytes unread resets the connection
        raise _gone(who) from None


def _recv_exact(sock: socket.socket, n: int, who: str) -> bytes:
    data = bytearray()
    while len(data) < n:
        try:
            chunk = sock.recv(n - len(data))
        except OSError:  # a reset (the peer died with bytes of ours unread), not only an orderly close
            raise _gone(who) from None
        if not chunk:
            raise _gone(who)
        data += chunk
    return bytes(data)


def _recv(sock: socket.socket, who: str) -> dict[str, Any]:
    (n,) = _LENGTH.unpack(_recv_exact(sock, _LENGTH.size, who))
    if n > MAX_MESSAGE:
        raise GroupBroken(f"{who} sent a message of {n} bytes: not a process of this group")
    doc: dict[str, Any] = json.loads(_recv_exact(sock, n, who))
    return doc


def _raised(doc: dict[str, Any]) -> Exception:
    """The leader's error, as the member raises it: the same paramserver error type where it is one."""
    kind, message = str(doc["error"]), str(doc.get("message", ""))
    cls = getattr(errors, kind, None)
    if isinstance(cls, type) and issubclass(cls, errors.PSError) and cls is not errors.RemoteError:
        return cls(message)
    return GroupBroken(f"the group's first process failed: {kind}: {message}")


class HostGroup:
    """This process's end of its host's group (see the module's docstring)."""

    def __init__(self, spec: GroupSpec, timeout: float = 120.0) -> None:
        if not 0 <= spec.local_rank < spec.size:
            raise ValueError(f"local rank {spec.local_rank} outside a group of {spec.size}")
        self.spec = spec
        self.timeout = timeout
        self.versions: list[int] = []  # a member's: what the leader's last exchange returned
        self._members: list[socket.socket] = []  # the leader's, by local rank - 1
        self._segments: dict[int, shm.Segment] = {}  # the leader's: each member's; a member's: its own, as [0]
        self._weights: shm.Segment | None = None  # the leader's, mapped by every member: the pulled weights
        self._sock: socket.socket | None = None  # a member's connection to the leader
        self._sums: dict[int, list[np.ndarray]] = {}

    @classmethod
    def from_env(cls, timeout: float = 120.0) -> HostGroup | None:
        """The group ps-worker --nproc put this process in, if any."""
        spec = GroupSpec.from_env()
        return cls(spec, timeout) if spec is not None and spec.size > 1 else None

    @property
    def leader(self) -> bool:
        return self.spec.local_rank == 0

    @property
    def size(self) -> int:
        return self.spec.size

    # -- forming the group -------------------------------------------------------------------------------------

    def lead(self, rank: int, world: int, connect_timeout: float) -> tuple[int, int]:
        """The leader, joined as rank `rank` of `world` hosts: take every member's hello, tell each where the host
        stands; return this process's (rank, world)."""
        server = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
        try:
            server.bind(self.spec.address)
            server.listen(self.size)
            server.settimeout(connect_timeout)
            joined: dict[int, socket.socket] = {}
            while len(joined) < self.size - 1:
                try:
                    conn, _ = server.accept()
                except TimeoutError:
                    raise GroupBroken(
                        f"{self.size - 1 - len(joined)} of this host's {self.size} processes did not join within "
                        f"{connect_timeout:.0f} s"
                    ) from None
                conn.settimeout(connect_timeout)
                local = int(_recv(conn, "a process of this host")["hello"])
                if not 0 < local < self.size or local in joined:
                    conn.close()
                    raise GroupBroken(f"a process said it is local rank {local} of {self.size}, twice or out of range")
                joined[local] = conn
        finally:
            server.close()
        self._members = [joined[i] for i in range(1, self.size)]
        for conn in self._members:
            conn.settimeout(None)  # a member may compute for as long as its step takes
            _send(conn, {"rank": rank, "world": world})
        return rank * self.size, world * self.size

    def follow(self, connect_timeout: float) -> tuple[int, int]:
        """A member: reach the leader (it may still be joining the job), say hello; return (rank, world)."""
        deadline = time.monotonic() + connect_timeout
        while True:
            sock = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
            try:
                sock.connect(self.spec.address)
                break
            except OSError:
                sock.close()
                if time.monotonic() > deadline:
                    raise GroupBroken(
                        f"the first process of this host's group did not listen within {connect_timeout:.0f} s"
                    ) from None
                time.sleep(0.05)
        self._sock = sock
        _send(sock, {"hello": self.spec.local_rank})
        where = _recv(sock, "the group's first process")
        return int(where["rank"]) * self.size + self.spec.local_rank, int(where["world"]) * self.size

    # -- exchanges ---------------------------------------------------------------------------------------------

    def member_exchange(self, b: Binding, grads: list[np.ndarray] | None, pull: bool) -> int:
        """A member's exchange: its gradient into its segment, the leader runs the exchange for the group, the
        weights out of the leader's weights segment."""
        assert self._sock is not None, "join the group first"
        n = sum(int(t.numel()) for t in b.tensors)
        seg = self._segments.get(0)
        offer: dict[str, Any] = {}
        if seg is None or seg.elements != n:
            if seg is not None:
                seg.close()
            seg = self._segments[0] = shm.Segment.create(n)
            offer = {"segment": seg.name, "nonce": seg.nonce.hex(), "elements": n}
        if grads is not None:
            np.concatenate(grads, out=seg.grad) if len(grads) > 1 else np.copyto(seg.grad, grads[0])
        _send(
            self._sock,
            {"push": grads is not None, "pull": pull, "digest": b.digest, **offer},
            "the group's first process",
        )
        reply = _recv(self._sock, "the group's first process")
        if "error" in reply:
            raise _raised(reply)
        if "weights" in reply:  # the leader's weights segment, new (the first pull, or another model)
            if self._weights is not None:
                self._weights.close()
            self._weights = shm.Segment.open(str(reply["weights"]), bytes.fromhex(reply["nonce"]), n)
        if pull:
            assert self._weights is not None, "the leader sends its weights segment with the first pull"
            at = 0
            for flat in b.flats():
                flat[:] = self._weights.weights[at : at + len(flat)]
                at += len(flat)
            b.unmirror_weights()
        self.versions = [int(v) for v in reply["versions"]]
        return int(reply["version"])

    def lead_exchange(
        self,
        b: Binding,
        grads: list[np.ndarray] | None,
        pull: bool,
        run: Callable[[list[np.ndarray] | None], int],
        versions: Callable[[], list[int]],
    ) -> int:
        """The leader's exchange: every member's gradient averaged with its own, `run` (the exchange with the
        shards) on the mean, the weights once into the weights segment every member reads."""
        n = sum(int(t.numel()) for t in b.tensors)
        asked = []
        for i, conn in enumerate(self._members, start=1):
            doc = _recv(conn, f"process {i} of this host's group")
            if "segment" in doc:
                old = self._segments.pop(i, None)
                if old is not None:
                    old.close()
                nonce, elements = bytes.fromhex(doc["nonce"]), int(doc["elements"])
                self._segments[i] = shm.Segment.open(str(doc["segment"]), nonce, elements)
            asked.append((doc["push"], doc["pull"], doc["digest"]))
        mine = (grads is not None, pull, b.digest)
        if any(a != mine for a in asked) or any(self._segments[i].elements != n for i in range(1, self.size)):
            self._tell_all({"error": "GroupBroken", "message": "the group's processes are out of step"})
            raise GroupBroken(f"this host's processes are out of step: {mine} here, {asked} in the others")
        mean: list[np.ndarray] | None = None
        if grads is not None:
            mean = self._sums.get(id(b))
            if mean is None or [len(m) for m in mean] != [len(g) for g in grads]:
                mean = self._sums[id(b)] = [np.empty_like(g) for g in grads]
            at = 0
            for out, g in zip(mean, grads, strict=True):
                np.copyto(out, g)
                for i in range(1, self.size):
                    out += self._segments[i].grad[at : at + len(g)]
                out *= np.float32(1.0 / self.size)
                at += len(g)
        try:
            version = run(mean)
        except Exception as exc:
            self._tell_all({"error": type(exc).__name__, "message": str(exc)})
            raise
        told: dict[str, Any] = {"version": version, "versions": versions()}
        if pull:
            if self._weights is None or self._weights.elements != n:
                if self._weights is not None:
                    self._weights.close()
                self._weights = shm.Segment.create(n)
                told |= {"weights": self._weights.name, "nonce": self._weights.nonce.hex()}
            weights = b.flats()
            np.concatenate(weights, out=self._weights.weights) if len(weights) > 1 else np.copyto(
                self._weights.weights, weights[0]
            )
        self._tell_all(told)
        return version

    def _tell_all(self, doc: dict[str, Any]) -> None:
        for conn in self._members:
            try:
                _send(conn, doc)
            except OSError:
                pass  # a member that is gone: the next exchange finds out

    def close(self) -> None:
        for conn in [*self._members, *([self._sock] if self._sock is not None else [])]:
            conn.close()
        self._members, self._sock = [], None
        for seg in [*self._segments.values(), *([self._weights] if self._weights is not None else [])]:
            seg.close()
        self._segments, self._weights = {}, None
