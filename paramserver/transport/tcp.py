"""Socket settings both ends use: TCP keepalive on a data socket, the buffers of a doorbell's Unix socket."""

from __future__ import annotations

import socket

# TCP keepalive: a peer gone without a word (a host powered off, a partition) is noticed within about 25 s while
# the connection is idle, and data it never acknowledges fails the send after 30 s.
KEEPALIVE = ((socket.SO_KEEPALIVE, 1),)
TCP_KEEPALIVE = (("TCP_KEEPIDLE", 10), ("TCP_KEEPINTVL", 5), ("TCP_KEEPCNT", 3), ("TCP_USER_TIMEOUT", 30_000))
# A worker's connection to a copy of a replicated shard: a copy that went silent (cut off, its host gone) is
# noticed within about 3 s while the connection waits, so the worker turns to the other copy, which took over in
# half a second; data never acknowledged fails the send after 3 s.
FAST_KEEPALIVE = (("TCP_KEEPIDLE", 1), ("TCP_KEEPINTVL", 1), ("TCP_KEEPCNT", 2), ("TCP_USER_TIMEOUT", 3_000))


def keep_alive(sock: socket.socket, fast: bool = False) -> None:
    """Turn on TCP keepalive and a user timeout (see KEEPALIVE; `fast`: FAST_KEEPALIVE) where the system has them."""
    for option, value in KEEPALIVE:
        sock.setsockopt(socket.SOL_SOCKET, option, value)
    for name, value in FAST_KEEPALIVE if fast else TCP_KEEPALIVE:
        if hasattr(socket, name):
            sock.setsockopt(socket.IPPROTO_TCP, getattr(socket, name), value)


# A doorbell's Unix socket: a whole frame of rows (a few hundred KiB a table) fits the send buffer, so the sender
# hands it over in one call instead of waking the reader for every 200 KiB (the default) and waiting for it.
UNIX_BUFFER_BYTES = 4 << 20


def unix_buffers(sock: socket.socket) -> None:
    """Give a Unix stream socket a send buffer of UNIX_BUFFER_BYTES (the system may grant less: net.core.wmem_max)."""
    try:
        sock.setsockopt(socket.SOL_SOCKET, socket.SO_SNDBUF, UNIX_BUFFER_BYTES)
    except OSError:
        pass
