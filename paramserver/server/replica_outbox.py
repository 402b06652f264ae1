"""What a primary writes to its live backup, in order, from one sender thread: pushes forwarded while they arrive,
then the small records that apply them, whole records, heartbeats (paramserver.server.replica_leader).

Why a thread of its own: the backup should receive a push while the primary receives it (from a data socket) or
while it applies it and writes the pull (from shared memory), as chain replication forwards while it receives,
instead of after the update applied. So a push's bytes are queued as a `Forward` the moment they are known to be
final and sent by this thread as they become so; the record that applies them follows them on the same connection,
so the backup always has a push whole before the record naming it. Everything the link carries goes through this
one queue, so the order on the wire is the order things were queued in.

A forwarded push's bytes are read from where they lie (a scratch buffer, a worker's shared-memory segment) until
`Forward.wait_sent` says they are on their way (in the kernel's buffer); whoever owns that memory waits for it
before reusing it, or `abort`s the forward.
"""

from __future__ import annotations

import collections
import socket
import struct
import threading
from collections.abc import Callable, Sequence

_PART = struct.Struct("<QQI")  # forward id, offset, bytes
_ID = struct.Struct("<Q")
CHUNK = 4 << 20  # a forwarded push goes out in pieces of at most this many bytes, as they become final


class Forward:
    """One push on its way to the backup: bytes [0, ready) of `data` are final and may be sent."""

    def __init__(self, outbox: Outbox, ident: int, data: memoryview) -> None:
        self.outbox = outbox
        self.id = ident
        self.data = data
        self.ready = 0
        self.sent = 0
        self.aborted = False
        self.finished = False  # the sender is done with it: all sent, or dropped
        self.sending = False  # the sender is writing a piece of it (reading its memory)
        self.settled = False  # named by a record or aborted: no longer counted as held by the backup

    @property
    def nbytes(self) -> int:
        return len(self.data)

    def advance(self, ready: int) -> None:
        """Bytes [0, ready) hold their final values (the receiver calls this as a push arrives)."""
        with self.outbox.cond:
            if ready > self.ready:
                self.ready = min(ready, len(self.data))
                self.outbox.cond.notify_all()

    def complete(self) -> None:
        """The whole push is final."""
        self.advance(len(self.data))

    def wait_sent(self) -> bool:
        """Wait until every byte is handed to the connection (the memory may be reused then); False where the
        link failed first (the backup is then dropped and takes the whole state again)."""
        with self.outbox.cond:
            self.outbox.cond.wait_for(lambda: self.finished)
            return not self.aborted and self.sent == len(self.data)

    def abort(self) -> None:
        """The push will not apply (refused, a retry of one applied before, its round dropped): stop sending it,
        tell the backup to drop what it has of it, and return once the sender no longer reads its memory."""
        box = self.outbox
        with box.cond:
            if self.aborted:
                return
            self.aborted = True
            if not self.settled:
                self.settled = True
                box.outstanding -= 1
            if self.finished:  # all of it sent (or the link failed): the backup drops it on a word
                if self.sent and not box.failed and not box.closed:
                    box.queue_drop(self.id)
                return
            if not self.sending and not self.sent:  # the sender has not reached it: it skips it
                self.finished = True
            box.cond.notify_all()
            box.cond.wait_for(lambda: self.finished)


class Outbox:
    """The sender thread of one live backup connection. `on_fail(why)` is called (once, from the sender) when a
    write fails; from then on everything queued is dropped and every waiter released."""

    def __init__(
        self, sock: socket.socket, tags: tuple[bytes, bytes], timeout: float, on_fail: Callable[[str], None]
    ) -> None:
        self.cond = threading.Condition()
        self._sock = sock
        self._part_tag, self._drop_tag = tags
        self._timeout = timeout
        self._on_fail = on_fail
        self._queue: collections.deque[Forward | _Message] = collections.deque()
        self._next_id = 0
        self.outstanding = 0  # forwarded pushes the backup holds for a record to name
        self.failed = ""
        self.closed = False
        self._thread = threading.Thread(target=self._run, name="replication-send", daemon=True)
        self._thread.start()

    def forward(self, data: memoryview, limit: int) -> Forward | None:
        """Queue a push's bytes (a flat byte view) to go out as they become final; None once the link failed, or
        while `limit` forwarded pushes are held by the backup (neither applied nor dropped yet)."""
        with self.cond:
            if self.failed or self.closed or self.outstanding >= limit:
                return None
            self.outstanding += 1
            self._next_id += 1
            fwd = Forward(self, self._next_id, data)
            self._queue.append(fwd)
            self.cond.notify_all()
            return fwd

    def post(self, parts: Sequence[memoryview | bytes], wait: bool = False) -> bool:
        """Queue one message (its buffers in order; copied unless `wait`, which returns once it is written).
        False where the link failed (before it was written, when waiting)."""
        message = _Message(list(parts) if wait else [b"".join(bytes(p) for p in parts)])
        with self.cond:
            if self.failed or self.closed:
                return False
            self._queue.append(message)
            self.cond.notify_all()
            if wait:
                self.cond.wait_for(lambda: message.done)
                return message.written
            return True

    def queue_drop(self, ident: int) -> None:
        """Tell the backup to drop a forwarded push it holds (under `cond`)."""
        self._queue.append(_Message([self._drop_tag + _ID.pack(ident)]))
        self.cond.notify_all()

    def settle(self, forwards: Sequence[Forward]) -> None:
        """These forwarded pushes were named by a record (the backup lets go of them once it applied it)."""
        with self.cond:
            for f in forwards:
                if not f.settled:
                    f.settled = True
                    self.outstanding -= 1

    def close(self) -> None:
        """Stop the sender (the connection is being dropped and closed, which ends a write in progress):
        everything queued is dropped and its waiters released."""
        with self.cond:
            self.closed = True
            self.cond.notify_all()

    # -- the sender -------------------------------------------------------------------------------------------

    def _run(self) -> None:
        try:
            while True:
                with self.cond:
                    self.cond.wait_for(lambda: self.closed or bool(self._queue))
                    if self.closed:
                        break
                    item = self._queue[0]
                if isinstance(item, Forward):
                    self._send_forward(item)
                else:
                    self._send(item.parts)
                    with self.cond:
                        item.done = item.written = True
                with self.cond:
                    self._queue.popleft()
                    self.cond.notify_all()
        except OSError as exc:
            with self.cond:
                self.failed = str(exc) or type(exc).__name__
            self._on_fail(f"sending to the backup failed: {self.failed}")
        finally:
            with self.cond:
                self.failed = self.failed or "the link was closed"
                for item in self._queue:
                    if isinstance(item, Forward):
                        item.finished = True
                    else:
                        item.done = True
                self._queue.clear()
                self.cond.notify_all()

    def _send_forward(self, fwd: Forward) -> None:
        while True:
            with self.cond:
                self.cond.wait_for(lambda: self.closed or fwd.aborted or fwd.ready > fwd.sent)
                if self.closed:
                    raise OSError("the link was closed")
                if fwd.finished:  # aborted before it started
                    return
                if fwd.aborted:
                    break
                start, end = fwd.sent, min(fwd.ready, fwd.sent + CHUNK)
                fwd.sending = True
            try:
                self._send([self._part_tag + _PART.pack(fwd.id, start, end - start), fwd.data[start:end]])
            finally:
                with self.cond:
                    fwd.sending = False
            with self.cond:
                fwd.sent = end
                if end == len(fwd.data):
                    fwd.finished = True
                    self.cond.notify_all()
                    return
        if fwd.sent:  # the backup holds part of it: tell it to drop that
            self._send([self._drop_tag + _ID.pack(fwd.id)])
        with self.cond:
            fwd.finished = True
            self.cond.notify_all()

    def _send(self, parts: Sequence[memoryview | bytes]) -> None:
        """Write the buffers in order, gathered into as few system calls as the kernel takes."""
        views = [memoryview(p).cast("B") for p in parts if len(p)]
        self._sock.settimeout(self._timeout + sum(len(v) for v in views) / (20 << 20))
        while views:
            sent = self._sock.sendmsg(views[:64])
            while views and sent >= len(views[0]):
                sent -= len(views.pop(0))
            if sent:
                views[0] = views[0][sent:]


class _Message:
    def __init__(self, parts: list[memoryview | bytes]) -> None:
        self.parts = parts
        self.done = False
        self.written = False
