"""TCP settings both ends of a data socket use."""

from __future__ import annotations

import socket

# TCP keepalive: a peer gone without a word (a host powered off, a partition) is noticed within about 25 s while
# the connection is idle, and data it never acknowledges fails the send after 30 s.
KEEPALIVE = ((socket.SO_KEEPALIVE, 1),)
TCP_KEEPALIVE = (("TCP_KEEPIDLE", 10), ("TCP_KEEPINTVL", 5), ("TCP_KEEPCNT", 3), ("TCP_USER_TIMEOUT", 30_000))


def keep_alive(sock: socket.socket) -> None:
    """Turn on TCP keepalive and a user timeout (see KEEPALIVE) where the system has them."""
    for option, value in KEEPALIVE:
        sock.setsockopt(socket.SOL_SOCKET, option, value)
    for name, value in TCP_KEEPALIVE:
        if hasattr(socket, name):
            sock.setsockopt(socket.IPPROTO_TCP, getattr(socket, name), value)
