"""Shared-memory segments: the same-host path for tensor bytes between a worker and a shard.

A worker creates one segment per shard (`Segment.create`), offers it with the Attach RPC, and unlinks the file once
the shard has mapped it (`Segment.open`): the memory lives while either side keeps its mapping, and nothing is left
in /dev/shm when a process dies. The layout is documented on AttachRequest in ps.proto. Plain files and mmap, not
multiprocessing.shared_memory: its resource tracker would unlink a segment that the other process still uses.
"""

from __future__ import annotations

import mmap
import os
import secrets
import struct
from pathlib import Path

import numpy as np

from paramserver.errors import SharedMemoryUnavailable

SHM_DIR = Path("/dev/shm")
PREFIX = "paramserver-"
MAGIC = b"PSSHM001"
HEADER_BYTES = 4096  # one page, so both regions start page-aligned
NONCE_BYTES = 16
_HEADER = struct.Struct("<8s16sQ")


def available() -> bool:
    """Whether this host has a shared-memory directory to create segments in."""
    return SHM_DIR.is_dir() and os.access(SHM_DIR, os.W_OK)


class Segment:
    """A mapped segment: `grad` and `weights`, float32 arrays of `elements` each, backed by shared memory."""

    def __init__(self, name: str, nonce: bytes, elements: int, mapping: mmap.mmap) -> None:
        self.name = name
        self.nonce = nonce
        self.elements = elements
        self._mapping = mapping
        nbytes = 4 * elements
        self.grad = np.frombuffer(mapping, dtype=np.float32, count=elements, offset=HEADER_BYTES)
        self.weights = np.frombuffer(mapping, dtype=np.float32, count=elements, offset=HEADER_BYTES + nbytes)

    @staticmethod
    def size(elements: int) -> int:
        return HEADER_BYTES + 8 * elements

    @classmethod
    def create(cls, elements: int) -> Segment:
        """Create a new segment file in /dev/shm (the worker's side); `unlink` it once the shard has opened it."""
        nonce = secrets.token_bytes(NONCE_BYTES)
        name = f"{PREFIX}{os.getpid()}-{secrets.token_hex(8)}"
        path = SHM_DIR / name
        fd = os.open(path, os.O_RDWR | os.O_CREAT | os.O_EXCL | os.O_NOFOLLOW, 0o600)
        try:
            os.ftruncate(fd, cls.size(elements))
            mapping = mmap.mmap(fd, cls.size(elements))
        except BaseException:
            os.unlink(path)
            raise
        finally:
            os.close(fd)
        mapping[: _HEADER.size] = _HEADER.pack(MAGIC, nonce, elements)
        return cls(name, nonce, elements, mapping)

    @classmethod
    def open(cls, name: str, nonce: bytes, elements: int) -> Segment:
        """Map a segment a worker offered (the shard's side); SharedMemoryUnavailable unless it is exactly that."""
        if not name.startswith(PREFIX) or "/" in name or name in (".", "..") or len(name) > 200:
            raise SharedMemoryUnavailable(f"{name!r} is not a paramserver segment name")
        if len(nonce) != NONCE_BYTES:
            raise SharedMemoryUnavailable(f"the segment nonce must be {NONCE_BYTES} bytes, not {len(nonce)}")
        try:
            fd = os.open(SHM_DIR / name, os.O_RDWR | os.O_NOFOLLOW)
        except OSError as exc:
            raise SharedMemoryUnavailable(
                f"cannot open segment {name} in {SHM_DIR} ({exc.strerror}): the worker is on another host"
            ) from None
        try:
            if os.fstat(fd).st_size != cls.size(elements):
                raise SharedMemoryUnavailable(f"segment {name} is not sized for {elements} elements per region")
            mapping = mmap.mmap(fd, cls.size(elements))
        finally:
            os.close(fd)
        if _HEADER.unpack_from(mapping) != (MAGIC, nonce, elements):
            mapping.close()
            raise SharedMemoryUnavailable(f"segment {name} carries another nonce: not the worker's segment")
        return cls(name, nonce, elements, mapping)

    def unlink(self) -> None:
        """Remove the file name; the memory stays while a mapping is open."""
        try:
            os.unlink(SHM_DIR / self.name)
        except FileNotFoundError:
            pass

    def close(self) -> None:
        """Drop this process's mapping (the arrays must not be used afterwards)."""
        del self.grad, self.weights
        try:
            self._mapping.close()
        except BufferError:
            # A view of the arrays is still alive somewhere; the mapping goes when it does.
            pass
