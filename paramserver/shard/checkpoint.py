"""Atomic, checksummed shard checkpoints: a JSON header and raw tensor bytes, no pickle.

File layout (one file per shard and version, `shard-III-vVVVVVVVVVVVV.ckpt`):

    b"PSCKPT01" | u64 little-endian header length | header JSON | tensor bytes ... | sha256 of all before it

A file is written to a temporary name, fsynced, renamed into place and the directory fsynced
(paramserver.files.atomic_write), so a crash leaves either the old set or the new one; the newest `KEEP` files
stay, so a damaged newest file falls back to the one before it. A file whose checksum, header or sizes do not add
up is reported and skipped.
"""

from __future__ import annotations

import dataclasses
import hashlib
import json
import logging
import re
import struct
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, BinaryIO

import numpy as np
import torch

from paramserver.files import atomic_write
from paramserver.placement import TensorSpec
from paramserver.tables import TableSpec

log = logging.getLogger(__name__)

MAGIC = b"PSCKPT01"
KEEP = 2
_NAME = re.compile(r"^shard-(\d{3})-v(\d{12})\.ckpt$")
_DTYPES = {"float32": torch.float32, "float64": torch.float64, "int64": torch.int64, "int32": torch.int32}


class CorruptCheckpoint(Exception):
    """A checkpoint file that is truncated, altered or not a checkpoint at all."""


@dataclass
class Snapshot:
    """Everything a shard needs to carry on exactly where it was."""

    shard_index: int
    num_shards: int
    specs: tuple[TensorSpec, ...]
    digest: str
    version: int
    optimizer: str
    params: torch.Tensor  # flat float32, owned by the snapshot (a copy)
    optimizer_state: dict[str, Any]  # torch Optimizer.state_dict() with copied tensors
    ever_full: bool = False
    applied: dict[str, list[int]] = field(default_factory=dict)  # worker id -> steps already applied
    finished_workers: int = 0  # workers that completed their training (exit_when_done counts them)
    table_specs: tuple[TableSpec, ...] = ()  # the model's sparse tables
    tables: list[dict[str, np.ndarray]] = field(default_factory=list)  # each table's rows (ShardTables.snapshot)


def path_for(directory: Path, shard_index: int, version: int) -> Path:
    """The file name of one shard's checkpoint at one version."""
    return directory / f"shard-{shard_index:03d}-v{version:012d}.ckpt"


def _tensor_entries(state: dict[str, Any]) -> tuple[dict[str, Any], list[torch.Tensor]]:
    """Split an optimizer state_dict into JSON (tensors replaced by references) and the tensors."""
    tensors: list[torch.Tensor] = []

    def walk(value: Any) -> Any:
        if isinstance(value, torch.Tensor):
            tensors.append(value.detach().cpu().contiguous())
            return {"__tensor__": len(tensors) - 1}
        if isinstance(value, dict):
            return {"__dict__": [[walk(k), walk(v)] for k, v in value.items()]}
        if isinstance(value, tuple):
            return {"__tuple__": [walk(v) for v in value]}
        if isinstance(value, list):
            return [walk(v) for v in value]
        return value

    return walk(state), tensors


def _rebuild(doc: Any, tensors: list[torch.Tensor]) -> Any:
    if isinstance(doc, dict) and "__tensor__" in doc:
        return tensors[doc["__tensor__"]]
    if isinstance(doc, dict) and "__tuple__" in doc:
        return tuple(_rebuild(v, tensors) for v in doc["__tuple__"])
    if isinstance(doc, dict) and "__dict__" in doc:
        return {_rebuild(k, tensors): _rebuild(v, tensors) for k, v in doc["__dict__"]}
    if isinstance(doc, list):
        return [_rebuild(v, tensors) for v in doc]
    return doc


def save(directory: str | Path, snap: Snapshot, keep: int = KEEP) -> Path:
    """Write a snapshot atomically and prune this shard's older checkpoints beyond `keep`; return the path."""
    directory = Path(directory)
    directory.mkdir(parents=True, exist_ok=True)
    opt_doc, opt_tensors = _tensor_entries(snap.optimizer_state)
    blobs = [snap.params.detach().contiguous(), *opt_tensors]
    # Each table's arrays follow, in sorted key order; the header names them.
    table_keys = [sorted(state) for state in snap.tables]
    for state, keys in zip(snap.tables, table_keys, strict=True):
        blobs += [torch.from_numpy(np.ascontiguousarray(state[k])) for k in keys]
    layout, offset = [], 0
    for t in blobs:
        nbytes = t.numel() * t.element_size()
        layout.append(
            {"dtype": str(t.dtype).removeprefix("torch."), "shape": list(t.shape), "offset": offset, "nbytes": nbytes}
        )
        offset += nbytes
    header = json.dumps(
        {
            "format": 1,
            "shard_index": snap.shard_index,
            "num_shards": snap.num_shards,
            "specs": [[s.name, list(s.shape), "buffer"] if s.buffer else [s.name, list(s.shape)] for s in snap.specs],
            "digest": snap.digest,
            "version": snap.version,
            "optimizer": snap.optimizer,
            "optimizer_state": opt_doc,
            "ever_full": snap.ever_full,
            "applied": snap.applied,
            "finished_workers": snap.finished_workers,
            "table_specs": [dataclasses.asdict(t) for t in snap.table_specs],
            "tables": table_keys,
            "tensors": layout,
            "created": time.time(),
        }
    ).encode()
    target = path_for(directory, snap.shard_index, snap.version)

    def write(f: BinaryIO) -> None:
        digest = hashlib.sha256()
        for part in (MAGIC, struct.pack("<Q", len(header)), header):
            f.write(part)
            digest.update(part)
        for t in blobs:
            view = t.reshape(-1).view(torch.uint8).numpy().data if t.numel() else memoryview(b"")
            f.write(view)
            digest.update(view)
        f.write(digest.digest())

    atomic_write(target, write, durable=True)
    for old in list_checkpoints(directory, snap.shard_index)[keep:]:
        old.unlink(missing_ok=True)
    return target


def list_checkpoints(directory: str | Path, shard_index: int) -> list[Path]:
    """This shard's checkpoint files, newest version first."""
    directory = Path(directory)
    if not directory.is_dir():
        return []
    found = []
    for p in directory.iterdir():
        m = _NAME.match(p.name)
        if m and int(m.group(1)) == shard_index:
            found.append((int(m.group(2)), p))
    return [p for _, p in sorted(found, reverse=True)]


def _spec(entry: list[Any]) -> TensorSpec:
    """A tensor spec as the header writes it: [name, shape], or [name, shape, "buffer"] for a buffer."""
    name, shape, *kind = entry
    if kind not in ([], ["buffer"]):
        raise ValueError(f"unknown kind of tensor {kind!r} for {name!r}")
    return TensorSpec(str(name), tuple(int(d) for d in shape), buffer=bool(kind))


def load(path: str | Path) -> Snapshot:
    """Read and verify one checkpoint file; raise CorruptCheckpoint if anything is off."""
    data = Path(path).read_bytes()
    if len(data) < len(MAGIC) + 8 + 32 or not data.startswith(MAGIC):
        raise CorruptCheckpoint(f"{path}: not a paramserver checkpoint (or truncated)")
    body, stored = data[:-32], data[-32:]
    if hashlib.sha256(body).digest() != stored:
        raise CorruptCheckpoint(f"{path}: checksum mismatch (truncated or altered)")
    (hlen,) = struct.unpack_from("<Q", body, len(MAGIC))
    start = len(MAGIC) + 8
    try:
        header = json.loads(body[start : start + hlen])
        if header.get("format") != 1:
            raise CorruptCheckpoint(f"{path}: unknown checkpoint format {header.get('format')!r}")
        payload = memoryview(body)[start + hlen :]
        tensors = []
        for entry in header["tensors"]:
            raw = payload[entry["offset"] : entry["offset"] + entry["nbytes"]]
            if len(raw) != entry["nbytes"]:
                raise CorruptCheckpoint(f"{path}: tensor bytes run past the end")
            dtype = _DTYPES[entry["dtype"]]
            if not entry["nbytes"]:  # an empty array (a table's admission counts...): no bytes to view
                tensors.append(torch.empty(entry["shape"], dtype=dtype))
                continue
            arr = np.frombuffer(raw, dtype=np.uint8).copy()
            tensors.append(torch.from_numpy(arr).view(dtype).reshape(entry["shape"]))
        # The tables' arrays are the last tensors; the optimizer's come before them.
        table_keys = header.get("tables", [])  # absent from files of earlier versions
        n_table = sum(len(keys) for keys in table_keys)
        table_tensors = tensors[len(tensors) - n_table :] if n_table else []
        tables, at = [], 0
        for keys in table_keys:
            tables.append({k: table_tensors[at + i].numpy() for i, k in enumerate(keys)})
            at += len(keys)
        opt_tensors = tensors[1 : len(tensors) - n_table]
        return Snapshot(
            shard_index=int(header["shard_index"]),
            num_shards=int(header["num_shards"]),
            specs=tuple(_spec(entry) for entry in header["specs"]),
            digest=str(header["digest"]),
            version=int(header["version"]),
            optimizer=str(header["optimizer"]),
            params=tensors[0],
            optimizer_state=_rebuild(header["optimizer_state"], opt_tensors),
            ever_full=bool(header["ever_full"]),
            applied={str(k): [int(s) for s in v] for k, v in header["applied"].items()},
            finished_workers=int(header.get("finished_workers", 0)),  # absent from files of earlier versions
            table_specs=tuple(TableSpec(**t) for t in header.get("table_specs", [])),
            tables=tables,
        )
    except CorruptCheckpoint:
        raise
    except (KeyError, ValueError, TypeError, IndexError, RuntimeError, AttributeError) as exc:
        raise CorruptCheckpoint(f"{path}: malformed header or tensors: {exc}") from None


def load_latest(directory: str | Path, shard_index: int) -> Snapshot | None:
    """Return the newest valid checkpoint of a shard, reporting and skipping damaged ones; None if none."""
    for path in list_checkpoints(directory, shard_index):
        try:
            snap = load(path)
        except CorruptCheckpoint as exc:
            log.error("skipping damaged checkpoint: %s", exc)
            continue
        if snap.shard_index != shard_index:
            log.error("skipping %s: it belongs to shard %d", path, snap.shard_index)
            continue
        return snap
    return None


class CheckpointWriter:
    """Write snapshots in a background thread, in order, so a checkpoint never stalls the shard for the disk.

    At most `depth` snapshots wait; a producer beyond that blocks (backpressure rather than unbounded memory).
    """

    def __init__(
        self, directory: str | Path, depth: int = 2, on_saved: Callable[[Snapshot], object] | None = None
    ) -> None:
        import queue
        import threading

        self.on_saved = on_saved  # called with each snapshot once its file is on disk
        self.directory = Path(directory)
        self.last_path: Path | None = None
        self.errors = 0
        self._queue: queue.Queue[Snapshot | None] = queue.Queue(maxsize=depth)
        self._thread = threading.Thread(target=self._run, name="checkpoint-writer", daemon=True)
        self._thread.start()

    def submit(self, snap: Snapshot) -> None:
        """Queue a snapshot for writing."""
        self._queue.put(snap)

    def flush(self) -> None:
        """Block until every queued snapshot is written."""
        self._queue.join()

    def close(self) -> None:
        """Write what is queued, then stop the thread."""
        self._queue.put(None)
        self._thread.join()

    def _run(self) -> None:
        while (snap := self._queue.get()) is not None:
            try:
                started = time.monotonic()
                self.last_path = save(self.directory, snap)
                if self.on_saved is not None:
                    self.on_saved(snap)
                log.info(
                    "shard %d: checkpoint at version %d written to %s in %.2f s",
                    snap.shard_index,
                    snap.version,
                    self.last_path,
                    time.monotonic() - started,
                )
            except Exception as exc:  # noqa: BLE001 - a failed write must never stop the writer (shards block on it)
                self.errors += 1
                log.error("shard %d: checkpoint at version %d failed: %s", snap.shard_index, snap.version, exc)
            finally:
                self._queue.task_done()
        self._queue.task_done()
