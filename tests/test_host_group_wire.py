"""The host group's socket under broken and hostile local processes (issue 36, defect 5; worker/client/host_group.py
and worker/client/group_wire.py), in one process: the leader and real members as threads, a hostile process as a
raw socket on the group's abstract address (which any process of the host can read in /proc/net/unix).

- while the group forms, any malformed hello (bad JSON, a JSON list, string, NaN, 1e999 or null, 60,000 `[`, a
  missing key, a float or bool rank, a rank out of range, no token or a wrong one) and a peer of another user are
  refused with an error message and a closed connection; the leader never raises, and the real member still joins;
- once the group formed, a member's malformed request (non-JSON, a list, a nonce that is not hex, elements that are
  no integer, a missing key) or a segment the leader cannot open makes the leader raise GroupBroken and every other
  member fail at once with GroupBroken (not wait for the leader to exit);
- a group of two exchanges as before over the checked messages.
"""

from __future__ import annotations

import json
import os
import socket
import struct
import threading
from collections.abc import Callable, Iterator
from typing import Any

import numpy as np
import pytest
import torch

from paramserver.placement import TensorSpec, place
from worker.client import group_wire
from worker.client.binding import Binding
from worker.client.host_group import ENV, GroupBroken, GroupSpec, HostGroup

pytestmark = pytest.mark.timeout(120)

PATIENCE = 30.0  # seconds a thread may take to do what it must (a busy machine), never waited for on success
SPECS = [TensorSpec("w", (4,))]


class Runner:
    """A function on a thread of its own; its result or exception kept."""

    def __init__(self, fn: Callable[[], Any]) -> None:
        self.result: Any = None
        self.error: BaseException | None = None
        self.thread = threading.Thread(target=self._run, args=(fn,), daemon=True)
        self.thread.start()

    def _run(self, fn: Callable[[], Any]) -> None:
        try:
            self.result = fn()
        except BaseException as exc:  # noqa: BLE001 - kept for the test to look at
            self.error = exc

    def done(self, timeout: float = PATIENCE) -> Any:
        self.thread.join(timeout)
        assert not self.thread.is_alive(), "the thread did not finish in time"
        return self.result


@pytest.fixture
def groups() -> Iterator[list[HostGroup]]:
    """HostGroups made by a test, closed after it (which also ends any thread still waiting on them)."""
    made: list[HostGroup] = []
    try:
        yield made
    finally:
        for g in made:
            g.close()


def _binding() -> Binding:
    tensors = [torch.zeros(s.shape) for s in SPECS]
    return Binding([s.name for s in SPECS], tensors, place(SPECS, 1), [None] * len(SPECS))


def _raw(address: str) -> socket.socket:
    sock = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
    sock.settimeout(PATIENCE)
    sock.connect(address)
    return sock


def _frame(body: bytes) -> bytes:
    return struct.pack("<I", len(body)) + body


def _refused_and_closed(sock: socket.socket) -> str:
    """The refusal's message; the connection must end after it."""
    kind, doc = group_wire.recv(sock, ["error"], "the leader")
    assert kind == "error"
    try:
        rest = sock.recv(1)
    except ConnectionResetError:  # closed with bytes of ours unread: the kernel says so once its bytes are read
        rest = b""
    assert rest == b"", "the leader kept a refused connection open"
    return str(doc["message"])


def _connect_when_listening(address: str) -> socket.socket:
    for _ in range(int(PATIENCE / 0.05)):
        try:
            return _raw(address)
        except OSError:
            threading.Event().wait(0.05)
    raise AssertionError("the leader never listened")


def _bad_hellos(token: str) -> list[bytes]:
    def doc(**fields: object) -> bytes:
        return json.dumps(fields).encode()

    return [
        b"{}",
        b"\xff\xfe not utf-8",
        b"not json",
        b"[1]",
        b'"x"',
        b"NaN",
        b"1e999",
        b"null",
        b"[" * 60_000,
        b'{"hello": NaN, "token": "' + token.encode() + b'"}',
        b'{"hello": 1e999, "token": "' + token.encode() + b'"}',
        doc(hello=1),
        doc(hello=1, token="0" * 32),
        doc(hello=1.0, token=token),
        doc(hello=True, token=token),
        doc(hello=5, token=token),
        doc(hello=0, token=token),
        doc(hello="1", token=token),
        doc(hello=1, token=token, extra=[[[[1]]]]),
    ]


def test_malformed_hellos_are_refused_and_closed_and_the_member_still_joins(groups: list[HostGroup]) -> None:
    specs = GroupSpec.new(2)
    leader, member = HostGroup(specs[0]), HostGroup(specs[1])
    groups += [leader, member]
    lead = Runner(lambda: leader.lead(3, 4, connect_timeout=4 * PATIENCE))
    for i, body in enumerate(_bad_hellos(specs[0].token)):
        sock = _connect_when_listening(specs[0].address)
        with sock:
            sock.sendall(_frame(body))
            said = _refused_and_closed(sock)
        assert "refused" in said and lead.thread.is_alive(), (i, body[:40], said, lead.error)
    # An oversized announcement is refused too, without reading it.
    with _connect_when_listening(specs[0].address) as sock:
        sock.sendall(struct.pack("<I", 1 << 30))
        assert "over" in _refused_and_closed(sock)
    follow = Runner(lambda: member.follow(PATIENCE))
    assert follow.done() == (3 * 2 + 1, 8), follow.error
    assert lead.done() == (6, 8), lead.error


def test_a_process_of_another_user_is_refused(groups: list[HostGroup], monkeypatch: pytest.MonkeyPatch) -> None:
    specs = GroupSpec.new(2)
    leader, member = HostGroup(specs[0]), HostGroup(specs[1])
    groups += [leader, member]
    lead = Runner(lambda: leader.lead(0, 1, connect_timeout=4 * PATIENCE))
    real_uid = os.getuid()
    with monkeypatch.context() as patch:
        patch.setattr(group_wire.os, "getuid", lambda: real_uid + 1)  # the leader sees a peer of another user
        with _connect_when_listening(specs[0].address) as sock:
            try:
                sock.sendall(_frame(json.dumps({"hello": 1, "token": specs[0].token}).encode()))
            except (BrokenPipeError, ConnectionResetError):
                pass  # refused at accept, before the hello: the refusal is still there to read
            assert "runs as user" in _refused_and_closed(sock)
    follow = Runner(lambda: member.follow(PATIENCE))
    assert follow.done() == (1, 2), follow.error
    assert lead.done() == (0, 2), lead.error


def _bad_asks(digest: str) -> list[bytes]:
    good: dict[str, object] = {"push": True, "pull": True, "digest": digest}
    offer = {"segment": f"{os.getpid()}/999999", "nonce": "ab" * 16, "elements": 4}
    return [
        b"not json",
        b"[1]",
        json.dumps({**good, **offer, "nonce": "zz" * 16}).encode(),
        json.dumps({**good, **offer, "elements": "abc"}).encode(),
        json.dumps({"pull": True, "digest": digest, **offer}).encode(),
        json.dumps(good).encode(),  # no segment ever offered
        json.dumps({**good, **offer}).encode(),  # a segment the leader cannot open
    ]


@pytest.mark.parametrize("case", range(len(_bad_asks(""))))
def test_a_member_the_leader_cannot_serve_fails_every_member_fast(groups: list[HostGroup], case: int) -> None:
    specs = GroupSpec.new(3)
    leader, member = HostGroup(specs[0]), HostGroup(specs[1])
    groups += [leader, member]
    b_lead, b_member = _binding(), _binding()
    grads = [np.ones(4, np.float32)]

    def lead_and_exchange() -> int:
        leader.lead(0, 1, connect_timeout=4 * PATIENCE)
        return leader.lead_exchange(b_lead, grads, True, lambda mean: 1, lambda: [1])

    def follow_and_exchange() -> int:
        member.follow(PATIENCE)
        return member.member_exchange(b_member, grads, True)

    lead = Runner(lead_and_exchange)
    follow = Runner(follow_and_exchange)
    with _connect_when_listening(specs[0].address) as evil:  # the group's third process, gone wrong
        evil.sendall(_frame(json.dumps({"hello": 2, "token": specs[0].token}).encode()))
        assert group_wire.recv(evil, ["where"], "the leader")[0] == "where"
        evil.sendall(_frame(_bad_asks(b_lead.digest)[case]))
        lead.done()
        follow.done()
        assert isinstance(lead.error, GroupBroken), repr(lead.error)
        assert isinstance(follow.error, GroupBroken), repr(follow.error)
        kind, told = group_wire.recv(evil, ["error"], "the leader")  # it is told as well
        assert kind == "error" and told["error"] == "GroupBroken"


def test_a_group_of_two_exchanges_over_the_checked_messages(groups: list[HostGroup]) -> None:
    specs = GroupSpec.new(2)
    leader, member = HostGroup(specs[0]), HostGroup(specs[1])
    groups += [leader, member]
    b_lead, b_member = _binding(), _binding()
    b_lead.tensors[0].copy_(torch.arange(4.0))  # the leader's "pulled" weights

    def lead_and_exchange() -> int:
        leader.lead(0, 1, connect_timeout=PATIENCE)
        return leader.lead_exchange(b_lead, [np.full(4, 1.0, np.float32)], True, lambda mean: 5, lambda: [5, 5])

    def follow_and_exchange() -> int:
        member.follow(PATIENCE)
        return member.member_exchange(b_member, [np.full(4, 3.0, np.float32)], True)

    lead, follow = Runner(lead_and_exchange), Runner(follow_and_exchange)
    assert (lead.done(), follow.done()) == (5, 5), (lead.error, follow.error)
    assert member.versions == [5, 5]
    assert b_member.tensors[0].tolist() == [0.0, 1.0, 2.0, 3.0]


def test_the_environment_carries_the_token_and_a_malformed_one_is_refused(monkeypatch: pytest.MonkeyPatch) -> None:
    spec = GroupSpec.new(2)[1]
    monkeypatch.setenv(ENV, spec.env())
    assert GroupSpec.from_env() == spec and len(spec.token) == 32
    for bad in ("1/2/x", "a/2/t/name", "1/2//name", "1"):
        monkeypatch.setenv(ENV, bad)
        with pytest.raises(ValueError, match=ENV):
            GroupSpec.from_env()
