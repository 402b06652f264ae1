"""A shard's write-ahead log: what each version applied, written before any push it holds is acknowledged.

A record is one applied update (paramserver.shard.update.Update): the version it made, the (worker, step) pushes it
holds (so that a retry after a restart is still recognised), the flat gradient the optimizer got (for a sync round
its mean, once, not each worker's), and the row gradients of the sparse tables. A restarted shard replays the
records after its newest checkpoint through the same optimizer, which is deterministic on the CPU: it ends in
exactly the state it had.

Durability (`--wal-sync`): `write` hands each record to the kernel before the update is acknowledged, which
survives a SIGKILL of the shard process (the page cache outlives it) but not a crash of the host; `fsync` also
waits for fdatasync, done by one thread for every record written meanwhile (group commit), which survives a
host crash or power loss.

Files: `shard-III-wal-vVVVVVVVVVVVV.log` in the checkpoint directory, a new one started at each checkpoint (its
records are the versions after VVV...), the older ones deleted once that checkpoint is on disk. Record layout,
little-endian:

    u32 magic "PSWL" | u32 header length | u32 CRC-32 of the header | header (JSON: version, pushes, sizes;
    the dataset claims it changes, if any)
    | gradient bytes (float32) | for each table block: IDs (int64) then values (float32) | u64 version | "LEND"

The header's checksum covers every length; the trailer repeats the version. A record cut short (a kill in the
middle of a write) or not ended by its trailer ends the log: it was never acknowledged. The tensor bytes carry no
checksum of their own (a CRC over a 100 MB gradient costs more than writing it).
"""

from __future__ import annotations

import json
import logging
import mmap
import os
import re
import struct
import threading
import zlib
from collections.abc import Iterator, Sequence
from pathlib import Path
from typing import Any

import numpy as np

from paramserver.files import shard_files
from paramserver.shard.sparse.row_blocks import RowBlock
from paramserver.shard.update import Update

log = logging.getLogger(__name__)

MAGIC = b"PSWL"
END = b"LEND"
_HEAD = struct.Struct("<4sII")
_TAIL = struct.Struct("<Q4s")
_NAME = re.compile(r"^shard-(\d{3})-wal-v(\d{12})\.log$")
MAX_HEADER = 1 << 24


def path_for(directory: Path, shard_index: int, start: int) -> Path:
    return directory / f"shard-{shard_index:03d}-wal-v{start:012d}.log"


def segments(directory: str | Path, shard_index: int) -> list[tuple[int, Path]]:
    """This shard's log files as (start version, path), oldest first."""
    return shard_files(directory, _NAME, shard_index)


class WriteAheadLog:
    """Append records to the current segment; with `fsync`, a thread syncs them in groups.

    `durable` is the newest version whose record is as durable as the log promises (written; or, with fsync,
    synced); `wait_durable(v)` blocks until it reaches v.
    """

    def __init__(self, directory: str | Path, shard_index: int, start: int, fsync: bool = False) -> None:
        self.directory = Path(directory)
        self.directory.mkdir(parents=True, exist_ok=True)
        self.shard_index = shard_index
        self.fsync = fsync
        self.bytes = 0  # in the current segment
        self.durable = start
        self._written = start
        self._cond = threading.Condition()
        self._closed = False
        self._fd = -1
        self._start = start
        self._open(start)
        self._syncer: threading.Thread | None = None
        if fsync:
            self._syncer = threading.Thread(target=self._sync_loop, name="wal-fsync", daemon=True)
            self._syncer.start()

    def _open(self, start: int) -> None:
        path = path_for(self.directory, self.shard_index, start)
        # A file of this name holds nothing to keep: at most a torn record a restart found and stopped at.
        self._fd = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_TRUNC | os.O_APPEND, 0o644)
        self._start = start
        self.bytes = 0
        if self.fsync:  # the new file's name must survive a crash too
            dir_fd = os.open(self.directory, os.O_RDONLY)
            try:
                os.fsync(dir_fd)
            finally:
                os.close(dir_fd)

    def append(self, version: int, parts: Sequence[memoryview | bytes]) -> None:
        """Write one encoded record (`encode`; call in version order, under the shard's lock)."""
        total = sum(len(p) for p in parts)
        _write_all(self._fd, list(parts), total)
        self.bytes += total
        with self._cond:
            self._written = version
            if not self.fsync:
                self.durable = version
            self._cond.notify_all()  # waiters; with fsync, the syncer

    def _sync_loop(self) -> None:
        while True:
            with self._cond:
                self._cond.wait_for(lambda: self._closed or self._written > self.durable)
                if self._closed:
                    return
                target, fd = self._written, os.dup(self._fd)  # a rotation may close the original meanwhile
            try:
                os.fdatasync(fd)  # every record written so far, whoever wrote it: one sync for the group
            finally:
                os.close(fd)
            with self._cond:
                self.durable = max(self.durable, target)
                self._cond.notify_all()

    def wait_durable(self, version: int, timeout: float) -> bool:
        """Wait until the record of `version` is durable; False after `timeout` seconds."""
        with self._cond:
            return self._cond.wait_for(lambda: self.durable >= version or self._closed, timeout=timeout)

    def rotate(self, version: int) -> None:
        """Start a new segment for the versions after `version` (a checkpoint of `version` is being taken; call
        under the shard's lock, so no record is being written)."""
        if version == self._start:
            return
        with self._cond:
            old = self._fd
            if self.fsync:
                os.fdatasync(old)  # the old segment's records are durable before the syncer moves on
                self.durable = max(self.durable, self._written)
                self._cond.notify_all()
            self._open(version)
        os.close(old)

    def drop_before(self, version: int) -> None:
        """Delete the segments whose every record is in the checkpoint of `version`, now on disk."""
        found = segments(self.directory, self.shard_index)
        for (start, path), nxt in zip(found, found[1:], strict=False):
            if nxt[0] <= version and start < version:
                path.unlink(missing_ok=True)

    def close(self) -> None:
        with self._cond:
            self._closed = True
            self._cond.notify_all()
        if self._syncer is not None:
            self._syncer.join(timeout=10)
        if self._fd >= 0:
            if self.fsync:
                os.fdatasync(self._fd)
            os.close(self._fd)
            self._fd = -1
            if not self.bytes:  # a segment started by the final checkpoint and left empty: nothing to replay
                path_for(self.directory, self.shard_index, self._start).unlink(missing_ok=True)


def encode(
    version: int,
    pushes: Sequence[tuple[str, int]],
    grad: np.ndarray,
    rows: Sequence[RowBlock],
    wall: float,
    claims: Sequence[dict[str, Any]] = (),
) -> list[memoryview | bytes]:
    """One record as buffers to write in order (views of `grad` and the rows, not copies): what the log writes
    and what a primary streams to its backup. `claims`: the dataset claims it changes (in the header; absent
    when none, so the records of other jobs stay as they were)."""
    doc: dict[str, Any] = {
        "version": version,
        "time": wall,
        "pushes": [[w, s] for w, s in pushes],
        "grad": int(grad.size),
        "rows": [[b.table, len(b.ids), int(b.values.shape[1]) if b.values is not None else 0] for b in rows],
    }
    if claims:
        doc["claims"] = list(claims)
    header = json.dumps(doc, separators=(",", ":")).encode()
    parts: list[memoryview | bytes] = [_HEAD.pack(MAGIC, len(header), zlib.crc32(header)), header]
    parts.append(np.ascontiguousarray(grad, dtype=np.float32).data.cast("B"))
    for b in rows:
        assert b.values is not None
        parts.append(np.ascontiguousarray(b.ids, dtype=np.int64).data.cast("B"))
        parts.append(np.ascontiguousarray(b.values, dtype=np.float32).data.cast("B"))
    parts.append(_TAIL.pack(version, END))
    return parts


def header_size(head: bytes) -> int:
    """The length of a record's header from its first HEAD_BYTES bytes; ValueError if they start no record."""
    magic, hlen, _ = _HEAD.unpack(head)
    if magic != MAGIC or hlen > MAX_HEADER:
        raise ValueError("not the start of a write-ahead log record")
    return int(hlen)


def body_size(head: bytes, header: bytes) -> int:
    """How many bytes follow a record's header (tensors and trailer); ValueError for a damaged header."""
    _, _, crc = _HEAD.unpack(head)
    if zlib.crc32(header) != crc:
        raise ValueError("a write-ahead log record's header fails its checksum")
    try:
        doc = json.loads(header)
        size = 4 * int(doc["grad"]) + sum(8 * int(n) + 4 * int(n) * int(d) for _, n, d in doc["rows"])
    except (KeyError, TypeError, ValueError) as exc:
        raise ValueError(f"a write-ahead log record's header does not parse: {exc}") from None
    return size + _TAIL.size


HEAD_BYTES = _HEAD.size


def decode(data: memoryview, at: int = 0) -> tuple[Update, int] | None:
    """The record starting at byte `at` of `data` and the offset after it; None where no whole, intact record
    starts there (a torn tail). The arrays are views of `data`."""
    if at + _HEAD.size > len(data):
        return None
    magic, hlen, crc = _HEAD.unpack_from(data, at)
    if magic != MAGIC or hlen > MAX_HEADER or at + _HEAD.size + hlen > len(data):
        return None
    header = bytes(data[at + _HEAD.size : at + _HEAD.size + hlen])
    if zlib.crc32(header) != crc:
        return None
    try:
        doc = json.loads(header)
        body = at + _HEAD.size + hlen
        n = int(doc["grad"])
        grad = np.frombuffer(data[body : body + 4 * n], dtype=np.float32)
        body += 4 * n
        rows = []
        for table, count, dim in doc["rows"]:
            ids = np.frombuffer(data[body : body + 8 * count], dtype=np.int64)
            body += 8 * count
            values = np.frombuffer(data[body : body + 4 * count * dim], dtype=np.float32).reshape(count, dim)
            body += 4 * count * dim
            rows.append(RowBlock(int(table), ids, values))
        if body + _TAIL.size > len(data) or len(grad) != n:
            return None
        version, end = _TAIL.unpack_from(data, body)
        if end != END or version != doc["version"]:
            return None
        pushes = [(str(w), int(s)) for w, s in doc["pushes"]]
        claims = [dict(c) for c in doc.get("claims", [])]
    except (KeyError, TypeError, ValueError):
        return None
    update = Update(int(doc["version"]), pushes, grad, rows, float(doc.get("time", 0.0)), claims=claims)
    return update, body + _TAIL.size


def _write_all(fd: int, parts: list[memoryview | bytes], total: int) -> None:
    """writev until every byte is written (a large record takes several calls)."""
    done = 0
    views = [memoryview(p).cast("B") if not isinstance(p, memoryview) else p for p in parts]
    while done < total:
        sent = os.writev(fd, views[:1024])
        done += sent
        while views and sent >= len(views[0]):
            sent -= len(views[0])
            views.pop(0)
        if sent:
            views[0] = views[0][sent:]


def records(directory: str | Path, shard_index: int, after: int) -> Iterator[Update]:
    """The logged records of versions after `after`, in order, from every segment; stops at a torn or damaged
    record (logged and never acknowledged) or at a gap."""
    expected = after + 1
    for _, path in segments(directory, shard_index):
        for rec in _read(path):
            if rec.version < expected:
                continue
            if rec.version != expected:
                log.warning(
                    "write-ahead log %s: version %d where %d was expected: stopping there", path, rec.version, expected
                )
                return
            expected += 1
            yield rec


def _read(path: Path) -> Iterator[Update]:
    try:
        if not path.stat().st_size:
            return
        with open(path, "rb") as f:  # mapped, not read: a log can hold many versions of a large model
            data = memoryview(mmap.mmap(f.fileno(), 0, access=mmap.ACCESS_READ))
    except FileNotFoundError:  # deleted since it was listed (a checkpoint covering it landed): a gap ends the log
        log.warning("write-ahead log %s vanished while being read", path)
        return
    at = 0
    while (found := decode(data, at)) is not None:
        rec, at = found
        yield rec
    if at < len(data):
        log.warning("write-ahead log %s: a torn record at byte %d (never acknowledged) ends it", path, at)
