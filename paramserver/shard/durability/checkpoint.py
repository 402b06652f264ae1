"""Atomic, checksummed shard checkpoints: safetensors files of the shard's tensors and a JSON description, no pickle.

File layout (one file per shard and version, `shard-III-vVVVVVVVVVVVV.ckpt`), a safetensors file that any
safetensors reader opens:

    u64 little-endian header length | header JSON (padded with spaces to 8 bytes) | tensor bytes ...

The header names each tensor with its dtype, shape and byte range: `params` (the shard's flat float32 part of
the model), `optimizer.<i>` (the tensors of the optimizer's state_dict) and `table.<t>.<key>` (each sparse table's
arrays). Its `__metadata__` holds three strings, the checksum first:

    {"__metadata__":{"sha256":"<64 hex digits>","format":"2","paramserver":"<JSON>"},"params":{...},...}

`paramserver` is everything else as JSON: the shard, the placement, the version, the optimizer's state_dict with
its tensors replaced by references, the applied-push log, the tables' specs and keys. `sha256` is the hash of the
whole file read with those 64 digits as "0"s, so that no byte anywhere (length, header, padding, tensor bytes) can
change, and no byte go missing or be added, unnoticed.

A file is written to a temporary name, fsynced, renamed into place and the directory fsynced
(paramserver.files.atomic_write), so a crash leaves either the old set or the new one; the newest `KEEP` files
stay, so a damaged newest file falls back to the one before it. A file whose checksum, header or sizes do not add
up is reported and skipped.

Reading lets safetensors parse and check the header (known dtypes, shapes that match the byte ranges, ranges that
tile the data exactly) and read each tensor with pread(2) straight into memory of its own: a restore holds the
checkpoint's size once, hashed where it lies, and no mapping of the file outlives the load (the optimizer keeps
the state tensors it is given, and a mapping would pin the file's disk space after rotation deletes it).

Files of the first format (`b"PSCKPT01" | u64 header length | header JSON | tensor bytes | sha256 of all before
it`) are still read, so that a shard upgraded in place resumes from the checkpoints it left.
"""

from __future__ import annotations

import dataclasses
import hashlib
import json
import logging
import os
import re
import struct
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, BinaryIO

import numpy as np
import torch
from safetensors import SafetensorError, safe_open

from paramserver.files import atomic_write, shard_files
from paramserver.placement import TensorSpec
from paramserver.tables import TableSpec

log = logging.getLogger(__name__)

FORMAT = "2"  # the `format` string of the safetensors metadata
LEGACY_MAGIC = b"PSCKPT01"  # the first format's files begin with it
KEEP = 2
_NAME = re.compile(r"^shard-(\d{3})-v(\d{12})\.ckpt$")
# Where the checksum's hex digits lie: right after the opening of the header, the same place in every file.
_SEAL_AT = b'{"__metadata__":{"sha256":"'
_UNSEALED = b"0" * 64
_HEX = re.compile(rb"[0-9a-f]{64}")
_MAX_HEADER = 100_000_000  # safetensors' own limit
# The dtypes a checkpoint holds: torch's, as safetensors names them.
_CODES = {torch.float32: "F32", torch.float64: "F64", torch.int64: "I64", torch.int32: "I32"}
_LEGACY_DTYPES = {"float32": torch.float32, "float64": torch.float64, "int64": torch.int64, "int32": torch.int32}


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
    claims: dict[str, Any] = field(default_factory=dict)  # the dataset claims (Claims.dump; shard 0 of --follow)


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


def _rebuild(doc: Any, tensor: Callable[[int], torch.Tensor]) -> Any:
    if isinstance(doc, dict) and "__tensor__" in doc:
        return tensor(doc["__tensor__"])
    if isinstance(doc, dict) and "__tuple__" in doc:
        return tuple(_rebuild(v, tensor) for v in doc["__tuple__"])
    if isinstance(doc, dict) and "__dict__" in doc:
        return {_rebuild(k, tensor): _rebuild(v, tensor) for k, v in doc["__dict__"]}
    if isinstance(doc, list):
        return [_rebuild(v, tensor) for v in doc]
    return doc


def _bytes_of(t: torch.Tensor) -> memoryview:
    """A contiguous tensor's bytes, without a copy."""
    return t.reshape(-1).view(torch.uint8).numpy().data


def save(directory: str | Path, snap: Snapshot, keep: int = KEEP) -> Path:
    """Write a snapshot atomically and prune this shard's older checkpoints beyond `keep`; return the path."""
    directory = Path(directory)
    directory.mkdir(parents=True, exist_ok=True)
    target = path_for(directory, snap.shard_index, snap.version)
    save_as(target, snap)
    for old in list_checkpoints(directory, snap.shard_index)[keep:]:
        old.unlink(missing_ok=True)
    return target


def save_as(target: Path, snap: Snapshot, durable: bool = True) -> None:
    """Write a snapshot to `target` atomically (what a primary sends its backup, too)."""
    opt_doc, opt_tensors = _tensor_entries(snap.optimizer_state)
    named = [("params", snap.params.detach().contiguous())]
    named += [(f"optimizer.{i}", t) for i, t in enumerate(opt_tensors)]
    # Each table's arrays, named by table and key; the description lists the keys.
    table_keys = [sorted(state) for state in snap.tables]
    for i, (state, keys) in enumerate(zip(snap.tables, table_keys, strict=True)):
        named += [(f"table.{i}.{k}", torch.from_numpy(np.ascontiguousarray(state[k]))) for k in keys]
    # The widest elements first (safetensors' own writer does the same): every tensor then starts at a multiple of
    # its element size, and a reader that maps the file may view it in place.
    named.sort(key=lambda item: -item[1].element_size())
    description = json.dumps(
        {
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
            "claims": snap.claims,
            "table_specs": [dataclasses.asdict(t) for t in snap.table_specs],
            "tables": table_keys,
            "created": time.time(),
        }
    )
    # The checksum comes first, so that it lies at the same offset in every file: written as "0"s, then filled in.
    header: dict[str, Any] = {
        "__metadata__": {"sha256": _UNSEALED.decode(), "format": FORMAT, "paramserver": description}
    }
    offset = 0
    for name, t in named:
        if t.dtype not in _CODES:
            raise ValueError(f"a checkpoint cannot hold {name}, a tensor of {t.dtype}")
        nbytes = t.numel() * t.element_size()
        header[name] = {"dtype": _CODES[t.dtype], "shape": list(t.shape), "data_offsets": [offset, offset + nbytes]}
        offset += nbytes
    raw = json.dumps(header, separators=(",", ":")).encode()
    raw += b" " * (-len(raw) % 8)  # the tensor bytes start 8-byte aligned, as safetensors pads them
    head = struct.pack("<Q", len(raw)) + raw

    def write(f: BinaryIO) -> None:
        digest = hashlib.sha256(head)
        f.write(head)
        for _, t in named:
            if t.numel():
                view = _bytes_of(t)
                f.write(view)
                digest.update(view)
        f.seek(8 + len(_SEAL_AT))
        f.write(digest.hexdigest().encode())

    atomic_write(target, write, durable=durable)


def list_checkpoints(directory: str | Path, shard_index: int) -> list[Path]:
    """This shard's checkpoint files, newest version first."""
    return [p for _, p in reversed(shard_files(directory, _NAME, shard_index))]


def _spec(entry: list[Any]) -> TensorSpec:
    """A tensor spec as the header writes it: [name, shape], or [name, shape, "buffer"] for a buffer."""
    name, shape, *kind = entry
    if kind not in ([], ["buffer"]):
        raise ValueError(f"unknown kind of tensor {kind!r} for {name!r}")
    return TensorSpec(str(name), tuple(int(d) for d in shape), buffer=bool(kind))


def _snapshot(
    doc: dict[str, Any], params: torch.Tensor, tensor: Callable[[int], torch.Tensor], tables: list[dict[str, Any]]
) -> Snapshot:
    """The snapshot a file's description (and its tensors) make; KeyError, ValueError... where they do not fit."""
    if params.dtype != torch.float32 or params.dim() != 1:
        raise ValueError(f"the parameters are {params.dtype}{list(params.shape)}, not a flat float32 tensor")
    return Snapshot(
        shard_index=int(doc["shard_index"]),
        num_shards=int(doc["num_shards"]),
        specs=tuple(_spec(entry) for entry in doc["specs"]),
        digest=str(doc["digest"]),
        version=int(doc["version"]),
        optimizer=str(doc["optimizer"]),
        params=params,
        optimizer_state=_rebuild(doc["optimizer_state"], tensor),
        ever_full=bool(doc["ever_full"]),
        applied={str(k): [int(s) for s in v] for k, v in doc["applied"].items()},
        finished_workers=int(doc.get("finished_workers", 0)),  # absent from files of earlier versions
        table_specs=tuple(TableSpec(**t) for t in doc.get("table_specs", [])),
        tables=tables,
        claims=dict(doc.get("claims") or {}),  # absent from files of earlier versions
    )


_MALFORMED = (KeyError, ValueError, TypeError, IndexError, RuntimeError, AttributeError)


def load(path: str | Path) -> Snapshot:
    """Read and verify one checkpoint file; raise CorruptCheckpoint if anything is off."""
    with open(path, "rb") as f:
        size = os.fstat(f.fileno()).st_size
        first = f.read(8)
        if first == LEGACY_MAGIC:
            f.seek(0)
            return _load_legacy(path, f.read())
        if len(first) < 8:
            raise CorruptCheckpoint(f"{path}: not a paramserver checkpoint (or truncated)")
        (hlen,) = struct.unpack("<Q", first)
        if hlen > min(size - 8, _MAX_HEADER):
            raise CorruptCheckpoint(f"{path}: a header of {hlen} bytes in a file of {size}: truncated or altered")
        raw = f.read(hlen)
    seal = raw[len(_SEAL_AT) : len(_SEAL_AT) + 64]
    if not raw.startswith(_SEAL_AT) or not _HEX.fullmatch(seal):
        raise CorruptCheckpoint(f"{path}: not a paramserver checkpoint (no checksum where it belongs)")
    digest = hashlib.sha256(first)
    digest.update(raw[: len(_SEAL_AT)] + _UNSEALED + raw[len(_SEAL_AT) + 64 :])
    tensors: dict[str, torch.Tensor] = {}
    try:
        with safe_open(str(path), framework="pt", backend="pread") as st:
            metadata = st.metadata() or {}
            for name in st.offset_keys():  # in file order, so that the hash runs over the bytes as they lie
                dtype = st.get_slice(name).get_dtype()
                if dtype not in _CODES.values():
                    raise CorruptCheckpoint(f"{path}: tensor {name!r} is of dtype {dtype}, which no checkpoint holds")
                tensors[name] = t = st.get_tensor(name)
                if t.numel():
                    digest.update(_bytes_of(t))
    except (SafetensorError, *_MALFORMED) as exc:
        raise CorruptCheckpoint(f"{path}: damaged or not a checkpoint: {exc}") from None
    payload = sum(t.numel() * t.element_size() for t in tensors.values())
    if 8 + hlen + payload != size or digest.hexdigest().encode() != seal or metadata.get("sha256") != seal.decode():
        raise CorruptCheckpoint(f"{path}: checksum mismatch (truncated or altered)")
    if metadata.get("format") != FORMAT:
        raise CorruptCheckpoint(f"{path}: unknown checkpoint format {metadata.get('format')!r}")
    try:
        doc = json.loads(metadata["paramserver"])
        used = {"params"}

        def tensor(name: str) -> torch.Tensor:
            used.add(name)
            return tensors[name]

        tables = [{k: tensor(f"table.{i}.{k}").numpy() for k in keys} for i, keys in enumerate(doc["tables"])]
        snap = _snapshot(doc, tensors["params"], lambda i: tensor(f"optimizer.{int(i)}"), tables)
    except _MALFORMED as exc:
        raise CorruptCheckpoint(f"{path}: malformed description or tensors: {exc!r}") from None
    if set(tensors) != used:
        raise CorruptCheckpoint(f"{path}: tensors the description does not name: {sorted(set(tensors) - used)}")
    return snap


def _load_legacy(path: str | Path, data: bytes) -> Snapshot:
    """Read and verify a file of the first format (b"PSCKPT01", a JSON header, the tensors, a sha256 trailer)."""
    magic = len(LEGACY_MAGIC)
    if len(data) < magic + 8 + 32:
        raise CorruptCheckpoint(f"{path}: not a paramserver checkpoint (or truncated)")
    body = memoryview(data)[:-32]
    if hashlib.sha256(body).digest() != data[-32:]:
        raise CorruptCheckpoint(f"{path}: checksum mismatch (truncated or altered)")
    (hlen,) = struct.unpack_from("<Q", body, magic)
    start = magic + 8
    try:
        header = json.loads(bytes(body[start : start + hlen]))
        if header.get("format") != 1:
            raise CorruptCheckpoint(f"{path}: unknown checkpoint format {header.get('format')!r}")
        payload = body[start + hlen :]
        tensors = []
        for entry in header["tensors"]:
            raw = payload[entry["offset"] : entry["offset"] + entry["nbytes"]]
            if len(raw) != entry["nbytes"]:
                raise CorruptCheckpoint(f"{path}: tensor bytes run past the end")
            dtype = _LEGACY_DTYPES[entry["dtype"]]
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
        return _snapshot(header, tensors[0], lambda i: opt_tensors[i], tables)
    except CorruptCheckpoint:
        raise
    except _MALFORMED as exc:
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
