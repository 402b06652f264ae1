"""The sender thread a primary writes to its live backup with (paramserver.server.replica_outbox), against a real
socket pair read by a parser of the link's messages: pushes' pieces take turns, a record waits only for the pushes
it names, aborted pushes are dropped on the wire, and a broken link releases every waiter."""

from __future__ import annotations

import socket
import struct
import threading
import time
from collections.abc import Iterator

import numpy as np
import pytest

from paramserver.server.replica_outbox import CHUNK, Outbox

pytestmark = pytest.mark.timeout(60)

PART, DROP, MESSAGE = b"P", b"X", b"M"
_PART = struct.Struct("<QQI")


class Backup:
    """The other end: reads pieces (P id offset n bytes), drops (X id) and 9-byte messages (M + u64) in order."""

    def __init__(self, sock: socket.socket) -> None:
        self.sock = sock
        self.events: list[tuple[str, int, int]] = []  # (kind, id or message number, bytes so far of that id)
        self.held: dict[int, bytearray] = {}
        self.cond = threading.Condition()
        self.thread = threading.Thread(target=self._read, daemon=True)
        self.thread.start()

    def _exact(self, n: int) -> bytes:
        out = bytearray()
        while len(out) < n:
            got = self.sock.recv(n - len(out))
            if not got:
                raise ConnectionError
            out += got
        return bytes(out)

    def _read(self) -> None:
        try:
            while True:
                tag = self._exact(1)
                if tag == PART:
                    ident, offset, n = _PART.unpack(self._exact(_PART.size))
                    buf = self.held.setdefault(ident, bytearray())
                    assert offset == len(buf), "pieces of a push out of order"
                    buf += self._exact(n)
                    event = ("part", ident, len(buf))
                elif tag == DROP:
                    (ident,) = struct.unpack("<Q", self._exact(8))
                    event = ("drop", ident, len(self.held.pop(ident, b"")))
                else:
                    assert tag == MESSAGE, tag
                    (number,) = struct.unpack("<Q", self._exact(8))
                    event = ("message", number, 0)
                with self.cond:
                    self.events.append(event)
                    self.cond.notify_all()
        except (ConnectionError, OSError):
            return

    def wait_for(self, event: tuple[str, int, int], timeout: float = 10.0) -> list[tuple[str, int, int]]:
        with self.cond:
            assert self.cond.wait_for(lambda: event in self.events, timeout), (event, self.events)
            return list(self.events)


@pytest.fixture
def link() -> Iterator[tuple[Outbox, Backup, list[str]]]:
    a, b = socket.socketpair()
    failures: list[str] = []
    box = Outbox(a, timeout=5.0, on_fail=failures.append)
    backup = Backup(b)
    try:
        yield box, backup, failures
    finally:
        box.close()
        a.close()
        b.close()


def _message(number: int) -> bytes:
    return MESSAGE + struct.pack("<Q", number)


def _data(chunks: int, fill: int) -> memoryview:
    return memoryview(np.full(chunks * CHUNK, fill, dtype=np.uint8)).cast("B")


def test_a_slow_push_holds_up_neither_another_push_nor_the_record_naming_it(
    link: tuple[Outbox, Backup, list[str]],
) -> None:
    box, backup, _ = link
    slow = box.forward(_data(3, 1), limit=4)
    fast = box.forward(_data(2, 2), limit=4)
    assert slow is not None and fast is not None
    slow.advance(CHUNK)  # only its first piece has arrived
    fast.complete()
    assert fast.wait_sent()
    assert box.post([_message(7)], needs=[fast])
    events = backup.wait_for(("message", 7, 0))
    assert ("part", fast.id, 2 * CHUNK) in events
    assert max(n for kind, ident, n in events if kind == "part" and ident == slow.id) == CHUNK
    slow.complete()
    backup.wait_for(("part", slow.id, 3 * CHUNK))
    assert bytes(backup.held[slow.id]) == bytes(slow.data) and bytes(backup.held[fast.id]) == bytes(fast.data)


def test_a_record_goes_out_only_once_the_pushes_it_names_are_whole(link: tuple[Outbox, Backup, list[str]]) -> None:
    box, backup, _ = link
    fwd = box.forward(_data(4, 3), limit=4)
    assert fwd is not None
    assert box.post([_message(1)], needs=[fwd])  # queued while none of the push is final
    time.sleep(0.2)  # a while, in which nothing may go out: the record waits for the push it names
    assert backup.events == []
    fwd.complete()
    events = backup.wait_for(("message", 1, 0))
    assert events[-2:] == [("part", fwd.id, 4 * CHUNK), ("message", 1, 0)]


def test_aborted_pushes_are_dropped_on_the_wire_and_no_longer_held(link: tuple[Outbox, Backup, list[str]]) -> None:
    box, backup, _ = link
    partly, whole, unsent = (box.forward(_data(2, k), limit=3) for k in (1, 2, 3))
    assert partly is not None and whole is not None and unsent is not None
    assert box.forward(_data(1, 4), limit=3) is None, "a fourth push past the limit of 3 was forwarded"
    partly.advance(CHUNK)
    whole.complete()
    assert whole.wait_sent()
    backup.wait_for(("part", partly.id, CHUNK))
    partly.abort()  # returns once the sender let go of its memory
    whole.abort()
    unsent.abort()
    backup.wait_for(("drop", partly.id, CHUNK))
    events = backup.wait_for(("drop", whole.id, 2 * CHUNK))
    assert not any(ident == unsent.id for _, ident, _ in events), "a push never started went on the wire"
    assert not partly.wait_sent() and box.outstanding == 0
    assert box.forward(_data(1, 5), limit=3) is not None  # aborted pushes no longer count


def test_a_broken_link_releases_every_waiter(link: tuple[Outbox, Backup, list[str]]) -> None:
    box, backup, failures = link
    fwd = box.forward(_data(64, 6), limit=2)  # 256 MiB: more than the socket buffers hold
    assert fwd is not None
    fwd.complete()
    backup.sock.close()  # the backup is gone mid-push
    assert not fwd.wait_sent()
    assert not box.post([_message(2)], wait=True)
    assert box.forward(_data(1, 7), limit=2) is None
    assert len(failures) == 1 and "sending to the backup failed" in failures[0]
