"""What each worker attached to a shard for its Exchanges: a same-host worker's shared-memory segment, or another
host's data-socket ticket, by worker id. A doorbell or data-socket connection proves itself against this table."""

from __future__ import annotations

import hmac
import logging
import threading
from collections.abc import Callable
from dataclasses import dataclass
from typing import TYPE_CHECKING

from paramserver.errors import InvalidArgument, NotAttached, SharedMemoryUnavailable
from paramserver.transport import shm

if TYPE_CHECKING:
    from paramserver.shard.membership import Membership
    from paramserver.shard.model import ShardModel

log = logging.getLogger(__name__)


@dataclass(frozen=True)
class Ticket:
    """A worker's data-socket attachment: the nonce its connection must present (paramserver.transport)."""

    nonce: bytes
    elements: int
    name: str = ""  # no segment


Attachment = shm.Segment | Ticket


class Attachments:
    """The shard's attachments, under the shard's lock.

    An entry is replaced by the worker's next attachment and dropped (not closed) when the worker goes: an Exchange
    in flight keeps a segment's mapping alive until it ends. Each attachment proves one connection (a doorbell or
    data-socket hello) and no other; that connection is ended when the attachment is replaced or dropped (the
    worker attached again, left, or was evicted).
    """

    def __init__(
        self,
        index: int,
        shared_memory: bool,
        lock: threading.Condition,
        membership: Membership,
        require_model: Callable[[str], ShardModel],
        check_worker: Callable[[str], None],
    ) -> None:
        self._index = index
        self._shared_memory = shared_memory  # --no-shared-memory: False
        self._lock = lock  # the shard's
        self._membership = membership
        self._require_model = require_model  # the held model, checked against a digest
        self._check_worker = check_worker  # a live worker of a shard that serves
        self._by_worker: dict[str, Attachment] = {}
        self._connection: dict[str, Callable[[], None]] = {}  # worker -> what ends its proven connection

    def attach_segment(self, worker_id: str, name: str, nonce: bytes, elements: int, digest: str) -> None:
        """Map a live worker's shared-memory segment for its Exchanges (replacing any earlier attachment)."""
        if not self._shared_memory:
            raise SharedMemoryUnavailable(f"shard {self._index} runs with shared memory disabled (--no-shared-memory)")
        self._check(worker_id, elements, digest)
        self._put(worker_id, shm.Segment.open(name, nonce, elements))
        log.debug("shard %d: worker %s attached shared-memory segment %s", self._index, worker_id, name)

    def attach_socket(self, worker_id: str, nonce: bytes, elements: int, digest: str) -> None:
        """Take a live worker's data-socket ticket (replacing any earlier attachment)."""
        self._check(worker_id, elements, digest)
        if len(nonce) != shm.NONCE_BYTES:
            raise InvalidArgument(f"a data-socket ticket is {shm.NONCE_BYTES} random bytes, not {len(nonce)}")
        self._put(worker_id, Ticket(bytes(nonce), elements))

    def _check(self, worker_id: str, elements: int, digest: str) -> None:
        model = self._require_model(digest)
        if elements != model.numel:
            raise InvalidArgument(f"an attachment for {elements} elements to a shard of {model.numel}")
        self._check_worker(worker_id)

    def _put(self, worker_id: str, attachment: Attachment) -> None:
        with self._lock:
            self._membership.get(worker_id)  # it may have left meanwhile
            self._by_worker[worker_id] = attachment
            self._end_connection(worker_id)

    def verify(self, worker_id: str, kind: str, name: str, nonce: bytes, close: Callable[[], None]) -> None:
        """Raise NotAttached unless the live worker's attachment is of this kind ("shared_memory": a segment,
        "data_socket": a ticket), is this segment or ticket, and has not proven a connection yet (a connection's
        proof on the doorbell or data socket); `close` ends the connection once the attachment does."""
        with self._lock:
            self._membership.get(worker_id)
            attached = self._by_worker.get(worker_id)
            # The kind first: a ticket's name is "", so a segment hello named "" with a ticket's nonce would
            # otherwise pass as that ticket.
            of_kind = isinstance(attached, shm.Segment if kind == "shared_memory" else Ticket)
            if (
                attached is None
                or not of_kind
                or attached.name != name
                or not hmac.compare_digest(attached.nonce, nonce)
            ):
                raise NotAttached(f"worker {worker_id} has no such attachment on shard {self._index}")
            if worker_id in self._connection:
                raise NotAttached(
                    f"worker {worker_id}'s attachment on shard {self._index} has proven its connection "
                    "already: attach again for another"
                )
            self._connection[worker_id] = close

    def _end_connection(self, worker_id: str) -> None:
        close = self._connection.pop(worker_id, None)
        if close is not None:
            close()

    def get(self, worker_id: str, model: ShardModel) -> Attachment:
        """The live worker's segment or ticket for `model`; NotAttached if it has none."""
        with self._lock:
            self._membership.get(worker_id)
            attached = self._by_worker.get(worker_id)
        if attached is None or attached.elements != model.numel:
            raise NotAttached(f"worker {worker_id} has nothing attached for this model on shard {self._index}")
        return attached

    def segment(self, worker_id: str, model: ShardModel) -> shm.Segment:
        """The live worker's attached segment for `model`; NotAttached if it has none."""
        attached = self.get(worker_id, model)
        if not isinstance(attached, shm.Segment):
            raise NotAttached(f"worker {worker_id} has no shared-memory segment attached on shard {self._index}")
        return attached

    def drop(self, worker_id: str) -> None:
        """Forget a worker's attachment (it left or was evicted) and end its connection; call under the lock."""
        self._by_worker.pop(worker_id, None)
        self._end_connection(worker_id)

    def clear(self) -> None:
        """Forget every attachment (the shard is closing); call under the lock."""
        self._by_worker.clear()
        for worker_id in list(self._connection):
            self._end_connection(worker_id)
