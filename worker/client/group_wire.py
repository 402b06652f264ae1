"""The host group's messages (worker/client/host_group.py): length-prefixed JSON over an abstract Unix socket.

The socket's name can be read in /proc/net/unix by any process of the host, so nothing that arrives on it is
trusted: a peer is first proved (`check_peer`: the same user, by SO_PEERCRED; then the launcher's random token in
its hello), and every message, from either side, is decoded by one checked function (`decode`) against the fields
of the kinds the reader expects. Bad JSON, a NaN, a float where an integer belongs, a missing or unknown key,
nesting past a few levels, an oversized message: each is `BadMessage` (a GroupBroken), never a KeyError or
RecursionError in the leader.
"""

from __future__ import annotations

import json
import math
import os
import re
import socket
import struct
from collections.abc import Sequence
from typing import Any

_LENGTH = struct.Struct("<I")
MAX_MESSAGE = 1 << 16  # bytes of one message
MAX_TEXT = 4096  # characters of one string field (an error's message is cut to this)
_HEX16 = re.compile(r"[0-9a-f]{32}")
_INT64 = 1 << 63


class GroupBroken(ConnectionError):
    """A process of this host's group is gone, or out of step: the group stops."""


class BadMessage(GroupBroken):
    """A message that is not one a process of this group sends (undecodable, or a field missing or of another
    type): the connection it came on ends."""


# Each kind of message, by its fields: name -> (type, required). "hex16" is 16 bytes as 32 lowercase hex digits.
KINDS: dict[str, dict[str, tuple[str, bool]]] = {
    # member -> leader, once: its local rank and the launcher's token
    "hello": {"hello": ("int", True), "token": ("str", True)},
    # leader -> member, once: where the host stands in the job
    "where": {"rank": ("int", True), "world": ("int", True)},
    # member -> leader, every exchange: what it asks, and its segment when new
    "ask": {
        "push": ("bool", True),
        "pull": ("bool", True),
        "digest": ("str", True),
        "segment": ("str", False),
        "nonce": ("hex16", False),
        "elements": ("int", False),
    },
    # leader -> member, every exchange: the versions, and the weights segment when new
    "told": {
        "version": ("int", True),
        "versions": ("ints", True),
        "weights": ("str", False),
        "nonce": ("hex16", False),
    },
    # either way: a refusal or a failure
    "error": {"error": ("str", True), "message": ("str", True)},
}


def _refuse_constant(name: str) -> float:
    raise ValueError(f"{name} is not a number this group sends")


def _finite(text: str) -> float:
    value = float(text)
    if not math.isfinite(value):
        raise ValueError(f"{text} is not a finite number")
    return value


def _typed(kind: str, value: Any) -> bool:
    if kind == "int":
        return type(value) is int and -_INT64 <= value < _INT64
    if kind == "bool":
        return type(value) is bool
    if kind == "str":
        return type(value) is str and len(value) <= MAX_TEXT
    if kind == "hex16":
        return type(value) is str and _HEX16.fullmatch(value) is not None
    if kind == "ints":
        return type(value) is list and len(value) <= 1 << 16 and all(_typed("int", v) for v in value)
    raise AssertionError(kind)


def decode(raw: bytes, kinds: Sequence[str], who: str) -> tuple[str, dict[str, Any]]:
    """The one decoder of the group's messages: `raw` as one of `kinds` (see KINDS), as (kind, fields); BadMessage
    naming `who` sent it and what is wrong, for anything else."""
    try:
        doc = json.loads(raw.decode("utf-8"), parse_constant=_refuse_constant, parse_float=_finite)
    except (UnicodeDecodeError, ValueError, RecursionError) as exc:
        raise BadMessage(f"{who} sent a message that is not this group's JSON: {type(exc).__name__}") from None
    if type(doc) is not dict:
        raise BadMessage(f"{who} sent a JSON {type(doc).__name__} where this group sends an object")
    keys = set(doc)
    for kind in kinds:
        fields = KINDS[kind]
        required = {k for k, (_, needed) in fields.items() if needed}
        if required <= keys <= set(fields):
            for key, value in doc.items():
                if not _typed(fields[key][0], value):
                    raise BadMessage(f"{who} sent a {kind} message whose {key!r} is not a {fields[key][0]}")
            return kind, doc
    expected = " or ".join(f"{k} ({', '.join(KINDS[k])})" for k in kinds)
    raise BadMessage(f"{who} sent a message with the keys {sorted(keys)[:8]}, where this group sends {expected}")


def gone(who: str) -> GroupBroken:
    return GroupBroken(f"{who} is gone: this host's group stops (start ps-worker --nproc again to resume)")


def send(sock: socket.socket, doc: dict[str, Any], who: str = "the other end") -> None:
    if isinstance(doc.get("message"), str):
        doc = {**doc, "message": doc["message"][:MAX_TEXT]}
    body = json.dumps(doc, allow_nan=False).encode()
    try:
        sock.sendall(_LENGTH.pack(len(body)) + body)
    except OSError:  # a peer killed with our bytes unread resets the connection
        raise gone(who) from None


def _recv_exact(sock: socket.socket, n: int, who: str) -> bytes:
    data = bytearray()
    while len(data) < n:
        try:
            chunk = sock.recv(n - len(data))
        except TimeoutError:
            raise GroupBroken(f"{who} did not send its message in time") from None
        except OSError:  # a reset (the peer died with bytes of ours unread), not only an orderly close
            raise gone(who) from None
        if not chunk:
            raise gone(who)
        data += chunk
    return bytes(data)


def recv(sock: socket.socket, kinds: Sequence[str], who: str) -> tuple[str, dict[str, Any]]:
    """The next message on `sock`, decoded as one of `kinds` (BadMessage otherwise; GroupBroken if the peer is
    gone)."""
    (n,) = _LENGTH.unpack(_recv_exact(sock, _LENGTH.size, who))
    if n > MAX_MESSAGE:
        raise BadMessage(f"{who} sent a message of {n} bytes, over {MAX_MESSAGE}: not a process of this group")
    return decode(_recv_exact(sock, n, who), kinds, who)


def check_peer(sock: socket.socket, who: str) -> int:
    """The pid of the process at the other end of a connected Unix socket, which must run as this process's user
    (SO_PEERCRED, set by the kernel at connect); BadMessage otherwise."""
    raw = sock.getsockopt(socket.SOL_SOCKET, socket.SO_PEERCRED, struct.calcsize("3i"))
    pid, uid, _ = struct.unpack("3i", raw)
    if uid != os.getuid():
        raise BadMessage(f"{who} (pid {pid}) runs as user {uid}, not {os.getuid()}: not a process of this group")
    return int(pid)
