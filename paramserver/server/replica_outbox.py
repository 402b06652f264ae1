"""What a primary writes to its live backup, from one sender thread: pushes forwarded while they arrive, the
records that apply them, whole records, heartbeats (paramserver.server.replica_leader).

Why a thread of its own: the backup should receive a push while the primary receives it (from a data socket) or
while it checks and applies it and writes the pull (from shared memory), as chain replication forwards while it
receives, instead of after the update applied. A push's bytes are queued as a `Forward` the moment the exchange
starts and sent piece by piece as they become final; messages (records, drops, heartbeats) go out in the order
they were posted, each once the forwarded pushes it names are whole on the wire, so the backup always holds a
push before the record naming it. Between messages, the pieces of all pushes in flight take turns: a push arriving
slowly over one worker's link holds up neither another worker's push nor the records.

A forwarded push's bytes are read from where they lie (a scratch buffer, a worker's shared-memory segment) until
`Forward.wait_sent` says they are on their way (in the kernel's buffer); whoever owns that memory waits for it
before reusing it, or `abort`s the forward.
"""

from __future__ import annotations

import collections
import socket
import threading
from collections.abc import Callable, Sequence

from paramserver.server.replica_stream import DROP, FORWARD, PART, U64

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

    @property
    def whole(self) -> bool:
        """Every byte is on the wire."""
        return self.sent == len(self.data) and not self.aborted

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
            return self.whole

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
            if not self.sending and not self.sent:  # the sender has not reached it: it is skipped
                box.retire(self)
            box.cond.notify_all()
            box.cond.wait_for(lambda: self.finished)


class Outbox:
    """The sender thread of one live backup connection. `on_fail(why)` is called (once, from the sender) when a
    write fails; from then on nothing more is sent and every waiter is released."""

    def __init__(self, sock: socket.socket, timeout: float, on_fail: Callable[[str], None]) -> None:
        self.cond = threading.Condition()
        self._sock = sock
        self._timeout = timeout
        self._on_fail = on_fail
        self._messages: collections.deque[_Message] = collections.deque()
        self._forwards: list[Forward] = []  # unfinished, in turn order
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
            self._forwards.append(fwd)
            self.cond.notify_all()
            return fwd

    def post(self, parts: Sequence[memoryview | bytes], wait: bool = False, needs: Sequence[Forward] = ()) -> bool:
        """Queue one message (its buffers in order; copied unless `wait`, which returns once it is written), to go
        out once the forwarded pushes it `needs` are whole on the wire. False where the link failed (before it
        was written, when waiting)."""
        message = _Message(list(parts) if wait else [b"".join(bytes(p) for p in parts)], needs)
        with self.cond:
            if self.failed or self.closed:
                return False
            self._messages.append(message)
            self.cond.notify_all()
            if wait:
                self.cond.wait_for(lambda: message.done)
                return message.written
            return True

    def queue_drop(self, ident: int) -> None:
        """Tell the backup to drop a forwarded push it holds whole (under `cond`)."""
        self._messages.append(_Message([DROP + U64.pack(ident)]))
        self.cond.notify_all()

    def retire(self, fwd: Forward) -> None:
        """The sender is done with `fwd` (under `cond`)."""
        fwd.finished = True
        if fwd in self._forwards:
            self._forwards.remove(fwd)
        self.cond.notify_all()

    def settle(self, forwards: Sequence[Forward]) -> None:
        """These forwarded pushes were named by a record (the backup lets go of them once it applied it)."""
        with self.cond:
            for f in forwards:
                if not f.settled:
                    f.settled = True
                    self.outstanding -= 1

    def close(self) -> None:
        """Stop the sender (the connection is being dropped and closed, which ends a write in progress): nothing
        more is sent, and every waiter is released."""
        with self.cond:
            self.closed = True
            self.cond.notify_all()

    # -- the sender -------------------------------------------------------------------------------------------

    def _run(self) -> None:
        try:
            while True:
                with self.cond:
                    self.cond.wait_for(lambda: self.closed or self._next() is not None)
                    if self.closed:
                        break
                    item = self._next()
                    assert item is not None
                    if isinstance(item, _Message):
                        if any(not f.whole for f in item.needs):
                            raise OSError("a record names a forwarded push that was dropped")
                        self._messages.popleft()
                if isinstance(item, _Message):
                    self._send(item.parts)
                    with self.cond:
                        item.done = item.written = True
                        self.cond.notify_all()
                else:
                    self._serve(item)
        except OSError as exc:
            with self.cond:
                self.failed = str(exc) or type(exc).__name__
            self._on_fail(f"sending to the backup failed: {self.failed}")
        finally:
            with self.cond:
                self.failed = self.failed or "the link was closed"
                for fwd in list(self._forwards):
                    self.retire(fwd)
                for message in self._messages:
                    message.done = True
                self._messages.clear()
                self.cond.notify_all()

    def _next(self) -> _Message | Forward | None:
        """What to send next (under `cond`): the first message once what it names is on the wire; else a piece of
        a push with bytes ready (one the first message waits for, else whichever's turn it is)."""
        head = self._messages[0] if self._messages else None
        if head is not None and all(f.finished for f in head.needs):
            return head
        for fwd in [*(head.needs if head is not None else ()), *self._forwards]:
            if not fwd.finished and (fwd.aborted or fwd.ready > fwd.sent):
                return fwd
        return None

    def _serve(self, fwd: Forward) -> None:
        """Send the next piece of `fwd`, or, aborted, tell the backup to drop what it has of it."""
        with self.cond:
            aborting = fwd.aborted
            if not aborting:
                start, end = fwd.sent, min(fwd.ready, fwd.sent + CHUNK)
                fwd.sending = True
        if aborting:
            if fwd.sent:  # the backup holds part of it: tell it to drop that
                self._send([DROP + U64.pack(fwd.id)])
            with self.cond:
                self.retire(fwd)
            return
        try:
            self._send([FORWARD + PART.pack(fwd.id, start, end - start), fwd.data[start:end]])
        finally:
            with self.cond:
                fwd.sending = False
        with self.cond:
            fwd.sent = end
            if end == len(fwd.data):
                self.retire(fwd)
            elif fwd in self._forwards:  # its turn is over: the others' pieces go next
                self._forwards.remove(fwd)
                self._forwards.append(fwd)
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
    def __init__(self, parts: list[memoryview | bytes], needs: Sequence[Forward] = ()) -> None:
        self.parts = parts
        self.needs = list(needs)
        self.done = False
        self.written = False
