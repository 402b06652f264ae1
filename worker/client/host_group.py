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

The group's socket is visible to every process of the host, so the leader proves each connection before it counts
it (worker/client/group_wire.py): the peer runs as the same user (SO_PEERCRED) and says the random token the
launcher put in its children's environment; every message either way is decoded by one checked function. A
connection that fails either is refused and closed, and the leader waits on for its members; a member the leader
cannot serve once the group formed (a message it cannot take, a segment it cannot open, a process gone) makes every
member fail at once with GroupBroken.
"""

from __future__ import annotations

import logging
import os
import secrets
import socket
import time
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

import numpy as np

from paramserver import errors
from paramserver.transport import shm
from worker.client.binding import Binding
from worker.client.group_wire import MAX_MESSAGE, BadMessage, GroupBroken, check_peer, recv, send

__all__ = ["ENV", "MAX_MESSAGE", "GroupBroken", "GroupSpec", "HostGroup"]

log = logging.getLogger(__name__)

# "<local rank>/<size>/<token>/<socket name>": set by ps-worker --nproc for each of its processes. The token (random,
# per group) proves a member is the launcher's child; the environment of a process is readable by its user alone.
ENV = "PS_HOST_GROUP"
HELLO_TIMEOUT = 10.0  # seconds a connection to the leader has to say its hello


@dataclass(frozen=True)
class GroupSpec:
    """Where a process stands in its host's group."""

    local_rank: int
    size: int
    address: str  # an abstract Unix socket name (a NUL byte first): the leader listens, the members connect
    token: str = ""  # the launcher's secret: a member proves it in its hello

    @classmethod
    def new(cls, size: int) -> list[GroupSpec]:
        """The specs of a new group of `size` processes."""
        address = f"\0paramserver-group-{os.getpid()}-{secrets.token_hex(8)}"
        token = secrets.token_hex(16)
        return [cls(i, size, address, token) for i in range(size)]

    def env(self) -> str:
        return f"{self.local_rank}/{self.size}/{self.token}/{self.address[1:]}"

    @classmethod
    def from_env(cls) -> GroupSpec | None:
        value = os.environ.get(ENV)
        if not value:
            return None
        parts = value.split("/", 3)
        if len(parts) != 4 or not all(p.isdigit() for p in parts[:2]) or not parts[2] or not parts[3]:
            raise ValueError(f"{ENV} is {value!r}, not <local rank>/<size>/<token>/<socket name> (set by --nproc)")
        return cls(int(parts[0]), int(parts[1]), "\0" + parts[3], parts[2])


def _raised(doc: dict[str, Any]) -> Exception:
    """The leader's error, as the member raises it: the same paramserver error type where it is one."""
    kind, message = doc["error"], doc["message"]
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
        stands; return this process's (rank, world). A connection that is not a member of this group (another
        user, a wrong token, a bad or repeated hello) is refused and closed, and the leader waits on for its
        members."""
        server = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
        joined: dict[int, socket.socket] = {}
        deadline = time.monotonic() + connect_timeout
        try:
            server.bind(self.spec.address)
            server.listen(self.size)
            while len(joined) < self.size - 1:
                server.settimeout(max(0.01, deadline - time.monotonic()))
                try:
                    conn, _ = server.accept()
                except TimeoutError:
                    raise GroupBroken(
                        f"{self.size - 1 - len(joined)} of this host's {self.size} processes did not join within "
                        f"{connect_timeout:.0f} s"
                    ) from None
                try:
                    local = self._welcome(conn, joined, min(HELLO_TIMEOUT, max(0.01, deadline - time.monotonic())))
                except GroupBroken as exc:
                    log.warning("this host's group refused a connection: %s", exc)
                    self._refuse(conn, exc)
                    continue
                joined[local] = conn
            self._members = [joined[i] for i in range(1, self.size)]
        except BaseException:
            for conn in joined.values():
                conn.close()
            raise
        finally:
            server.close()
        for conn in self._members:
            conn.settimeout(None)  # a member may compute for as long as its step takes
            send(conn, {"rank": rank, "world": world})
        return rank * self.size, world * self.size

    def _welcome(self, conn: socket.socket, joined: dict[int, socket.socket], timeout: float) -> int:
        """A new connection's local rank, once it proved itself a member of this group (BadMessage otherwise)."""
        who = "a process connecting to this host's group"
        check_peer(conn, who)
        conn.settimeout(timeout)
        _, hello = recv(conn, ["hello"], who)
        if not secrets.compare_digest(hello["token"].encode(), self.spec.token.encode()):
            raise BadMessage(f"{who} did not give this group's token: not a process ps-worker --nproc started")
        local = hello["hello"]
        if not 0 < local < self.size or local in joined:
            raise BadMessage(f"{who} said it is local rank {local} of {self.size}, twice or out of range")
        return int(local)

    @staticmethod
    def _refuse(conn: socket.socket, why: Exception) -> None:
        """Answer a refused connection why, and close it."""
        try:
            conn.settimeout(1.0)
            send(conn, {"error": "GroupBroken", "message": f"refused: {why}"})
        except (GroupBroken, OSError):
            pass
        finally:
            conn.close()

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
        leader = "the group's first process"
        check_peer(sock, leader)
        send(sock, {"hello": self.spec.local_rank, "token": self.spec.token}, leader)
        kind, where = recv(sock, ["where", "error"], leader)
        if kind == "error":
            raise GroupBroken(f"{leader} refused this process: {where['message']}")
        return where["rank"] * self.size + self.spec.local_rank, where["world"] * self.size

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
        leader = "the group's first process"
        send(self._sock, {"push": grads is not None, "pull": pull, "digest": b.digest, **offer}, leader)
        kind, reply = recv(self._sock, ["told", "error"], leader)
        if kind == "error":
            raise _raised(reply)
        if "weights" in reply:  # the leader's weights segment, new (the first pull, or another model)
            if self._weights is not None:
                self._weights.close()
                self._weights = None
            if "nonce" not in reply:
                raise BadMessage(f"{leader} named its weights segment without its nonce")
            try:
                self._weights = shm.Segment.open(reply["weights"], bytes.fromhex(reply["nonce"]), n)
            except Exception as exc:  # noqa: BLE001 - whatever the reason, this process cannot follow its group
                raise GroupBroken(f"{leader}'s weights segment cannot be opened here: {exc}") from None
        if pull:
            assert self._weights is not None, "the leader sends its weights segment with the first pull"
            at = 0
            for flat in b.flats():
                flat[:] = self._weights.weights[at : at + len(flat)]
                at += len(flat)
            b.unmirror_weights()
        self.versions = list(reply["versions"])
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
        try:
            asked = [self._asked(i, conn) for i, conn in enumerate(self._members, start=1)]
        except GroupBroken as exc:
            # A member the leader cannot serve (gone, out of step, a message it cannot take, a segment it cannot
            # open): every member is told at once, rather than left waiting for an answer.
            self._tell_all({"error": "GroupBroken", "message": str(exc)})
            raise
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

    def _asked(self, i: int, conn: socket.socket) -> tuple[bool, bool, str]:
        """Member i's request for this exchange (its segment opened when it offers a new one); GroupBroken for
        anything the leader cannot serve."""
        who = f"process {i} of this host's group"
        _, doc = recv(conn, ["ask"], who)
        if "segment" in doc:
            if "nonce" not in doc or "elements" not in doc:
                raise BadMessage(f"{who} offered a segment without its nonce and elements")
            old = self._segments.pop(i, None)
            if old is not None:
                old.close()
            try:
                self._segments[i] = shm.Segment.open(doc["segment"], bytes.fromhex(doc["nonce"]), doc["elements"])
            except Exception as exc:  # noqa: BLE001 - whatever the reason, the group cannot go on without it
                raise GroupBroken(f"{who}'s segment cannot be opened by the first process: {exc}") from None
        elif i not in self._segments:
            raise BadMessage(f"{who} asked for an exchange before offering its segment")
        return doc["push"], doc["pull"], doc["digest"]

    def _tell_all(self, doc: dict[str, Any]) -> None:
        for conn in self._members:
            try:
                send(conn, doc)
            except (GroupBroken, OSError):
                pass  # a member that is gone: the next exchange finds out

    def close(self) -> None:
        for conn in [*self._members, *([self._sock] if self._sock is not None else [])]:
            conn.close()
        self._members, self._sock = [], None
        for seg in [*self._segments.values(), *([self._weights] if self._weights is not None else [])]:
            seg.close()
        self._segments, self._weights = {}, None
