"""Shared-memory segments: the same-host path for tensor bytes between a worker and a shard.

A worker creates one segment per shard (`Segment.create`): a memfd (anonymous shared memory, no file anywhere),
sealed so that nobody can ever shrink or grow it, since a shard reading a page that was truncated away would die
of SIGBUS. The worker offers it with the Attach RPC as "<pid>/<fd>"; the shard opens /proc/<pid>/fd/<fd>
(`Segment.open`), which works only from the same host and process namespace, and refuses anything that is not
such a sealed segment carrying the worker's nonce. The memory lives while either side keeps it mapped, and goes
with the last process that does: nothing is left behind when a process dies. Layout: see AttachRequest in
ps.proto.
"""

from __future__ import annotations

import fcntl
import mmap
import os
import re
import secrets
import stat
import struct

import numpy as np

from paramserver.errors import SharedMemoryUnavailable

MAGIC = b"PSSHM001"
HEADER_BYTES = 4096  # one page, so both regions start page-aligned
NONCE_BYTES = 16
_HEADER = struct.Struct("<8s16sQ")
_SEALS = fcntl.F_SEAL_SHRINK | fcntl.F_SEAL_GROW | fcntl.F_SEAL_SEAL
_NAME = re.compile(r"([1-9][0-9]{0,9})/([0-9]{1,9})")


def available() -> bool:
    """Whether this host can create segments (Linux memfd and /proc)."""
    return hasattr(os, "memfd_create") and os.path.isdir("/proc/self/fd")


class Segment:
    """A mapped segment: `grad` and `weights`, float32 arrays of `elements` each, backed by shared memory."""

    def __init__(self, name: str, nonce: bytes, elements: int, mapping: mmap.mmap, fd: int | None = None) -> None:
        self.name = name
        self.nonce = nonce
        self.elements = elements
        self._mapping = mapping
        self._fd = fd  # the creator keeps its memfd open: its "<pid>/<fd>" name stays valid for the shard
        nbytes = 4 * elements
        self.grad = np.frombuffer(mapping, dtype=np.float32, count=elements, offset=HEADER_BYTES)
        self.weights = np.frombuffer(mapping, dtype=np.float32, count=elements, offset=HEADER_BYTES + nbytes)

    @staticmethod
    def size(elements: int) -> int:
        return HEADER_BYTES + 8 * elements

    @classmethod
    def create(cls, elements: int) -> Segment:
        """Create a new sealed segment (the worker's side)."""
        nonce = secrets.token_bytes(NONCE_BYTES)
        fd = os.memfd_create("paramserver-segment", os.MFD_CLOEXEC | os.MFD_ALLOW_SEALING)
        try:
            os.ftruncate(fd, cls.size(elements))
            fcntl.fcntl(fd, fcntl.F_ADD_SEALS, _SEALS)
            mapping = mmap.mmap(fd, cls.size(elements))
        except BaseException:
            os.close(fd)
            raise
        mapping[: _HEADER.size] = _HEADER.pack(MAGIC, nonce, elements)
        return cls(f"{os.getpid()}/{fd}", nonce, elements, mapping, fd)

    @classmethod
    def open(cls, name: str, nonce: bytes, elements: int) -> Segment:
        """Map a segment a worker offered (the shard's side); SharedMemoryUnavailable unless it is exactly that."""
        match = _NAME.fullmatch(name)
        if match is None:
            raise SharedMemoryUnavailable(f"{name[:80]!r} is not a segment name (<pid>/<fd>)")
        if len(nonce) != NONCE_BYTES:
            raise SharedMemoryUnavailable(f"the segment nonce must be {NONCE_BYTES} bytes, not {len(nonce)}")
        path = f"/proc/{match[1]}/fd/{match[2]}"
        size = cls.size(elements)
        try:
            # Look before opening: opening some other kind of file (a device, a FIFO) could have side effects.
            if not _is_segment_file(os.stat(path), size):
                raise SharedMemoryUnavailable(f"{name} is not a segment sized for {elements} elements per region")
            fd = os.open(path, os.O_RDWR | os.O_NOCTTY | os.O_NONBLOCK | os.O_CLOEXEC)
        except OSError as exc:
            raise SharedMemoryUnavailable(
                f"cannot open segment {name} ({exc.strerror}): the worker runs on another host or in another "
                f"process namespace"
            ) from None
        try:
            if not _is_segment_file(os.fstat(fd), size):
                raise SharedMemoryUnavailable(f"{name} is not a segment sized for {elements} elements per region")
            try:
                seals = fcntl.fcntl(fd, fcntl.F_GET_SEALS)
            except OSError:
                seals = 0  # not a memfd
            if seals & _SEALS != _SEALS:
                raise SharedMemoryUnavailable(f"{name} is not a sealed segment: it could shrink under the shard")
            mapping = mmap.mmap(fd, size)
        finally:
            os.close(fd)
        if _HEADER.unpack_from(mapping) != (MAGIC, nonce, elements):
            mapping.close()
            raise SharedMemoryUnavailable(f"segment {name} carries another nonce: not the worker's segment")
        return cls(name, nonce, elements, mapping)

    def close(self) -> None:
        """Drop this process's mapping (the arrays must not be used afterwards)."""
        del self.grad, self.weights
        try:
            self._mapping.close()
        except BufferError:
            pass  # a view of the arrays is still alive somewhere; the mapping goes when it does
        if self._fd is not None:
            os.close(self._fd)
            self._fd = None


def _is_segment_file(st: os.stat_result, size: int) -> bool:
    return stat.S_ISREG(st.st_mode) and st.st_size == size
