"""A trained model in one safetensors file, tables included: `save` writes it from the shards, `load` serves it
without them.

The file holds every entry of the model's `state_dict()` (dense parameters and buffers) under its own name, and
each SparseEmbedding table as `<path>.ids` (int64 [n]) and `<path>.values` (float32 [n, dim]), with
`<path>.optimizer_state` (float32 [n, cols]) when asked for. The `__metadata__` says the format, each table's spec
(paramserver.tables.TableSpec: an ID the file lacks reads as its initial rule) and which rows each shard sent: the
IDs of shard s's segment are ascending, and they are those with mix64(ID) mod num_shards == s, so a lookup searches
one segment without sorting anything at load.

Why the writer is ours, not safetensors.save_file: that takes every tensor in memory, and a table of 10 M rows is
gigabytes. This one streams each table shard by shard: it reserves the header (its numbers at their widest), writes
each shard's rows where they go as they arrive, then fills the header in, padded with spaces as the format allows.
Memory stays at a message (about 1 MiB) per shard. The dense part is read back by safetensors itself, and the tests
read every file with safetensors' own reader.

`load` fills a converted model (each table answers from the file) or the plain model it was converted from (each
bounded table's rows copied into the nn.Embedding / nn.EmbeddingBag at its path: worker.client.plain), or either
of them inside the model that was saved (a LightningModule's `self.net`: worker.client.model_names).
"""

from __future__ import annotations

import json
import logging
import os
import struct
from collections.abc import Iterator
from dataclasses import asdict
from typing import TYPE_CHECKING, Any

import numpy as np
import torch
from torch import nn

from paramserver.files import temporary_beside
from paramserver.tables import Initialiser, TableSpec, shard_of
from paramserver.v1 import ps_pb2
from worker.client.model_names import file_prefix
from worker.client.plain import fill_embedding, plain_fit
from worker.client.sparse import SparseEmbedding, tables_of, without_rows

if TYPE_CHECKING:
    from worker.client.link import ShardLink
    from worker.client.psclient import PSClient

log = logging.getLogger(__name__)

FORMAT = "paramserver.model/1"
ATTEMPTS = 3  # tries at a table whose row count changes while it is saved (other workers training)
_CODES = {
    torch.float32: "F32",
    torch.float16: "F16",
    torch.bfloat16: "BF16",
    torch.float64: "F64",
    torch.int64: "I64",
    torch.int32: "I32",
    torch.int16: "I16",
    torch.int8: "I8",
    torch.uint8: "U8",
    torch.bool: "BOOL",
}
_WIDEST = 10**19  # a number at its widest in the reserved header (any offset or count of a file is below it)


class _Layout:
    """The tensors of the file in order, their shapes as they become known, and the header reserved for them."""

    def __init__(self) -> None:
        self.entries: dict[str, dict[str, Any]] = {}
        self.end = 0

    def rewind(self, name: str) -> None:
        """Forget `name` and every tensor placed after it (a table written again)."""
        if name in self.entries:
            names = list(self.entries)
            self.end = self.entries[name]["data_offsets"][0]
            for later in names[names.index(name) :]:
                del self.entries[later]

    def add(self, name: str, code: str, shape: list[int], nbytes: int) -> int:
        """Place a tensor after the last one; return its offset in the data."""
        start = self.end
        self.entries[name] = {"dtype": code, "shape": shape, "data_offsets": [start, start + nbytes]}
        self.end += nbytes
        return start

    @staticmethod
    def header(entries: dict[str, Any], metadata: dict[str, str]) -> bytes:
        return json.dumps({"__metadata__": metadata, **entries}, separators=(",", ":")).encode()


def save(
    client: PSClient, model: nn.Module, path: str | os.PathLike[str], *, optimizer_state: bool = False
) -> dict[str, int]:
    """Write `model` (registered with `client`) to `path`: its dense tensors and buffers as the shards hold them
    now, and every table's rows, one table at a time, each as one version of every shard. Written to a
    temporary file of this writer's own beside `path` and renamed over it, so `path` is whole or absent, and
    workers saving to one path at once each leave a whole file there (the last one renamed). Returns rows
    written per table."""
    client.pull_own(model)  # this process's pull, in a host group too
    with without_rows():  # the tables are written below, shard by shard
        dense = {name: t.detach().to("cpu").contiguous() for name, t in model.state_dict().items()}
    tables = tables_of(model)
    specs, digest = client.placement(model).tables, client.digest(model)
    shards = len(client.links)
    layout = _Layout()
    reserved = _reserve(dense, tables, specs, shards, optimizer_state)
    data_at = 8 + len(reserved)
    written: dict[str, int] = {}
    segments: dict[str, list[int]] = {}
    fd, partial = temporary_beside(path)
    try:
        for name, t in dense.items():
            at = layout.add(name, _code(t.dtype, name), list(t.shape), t.numel() * t.element_size())
            os.pwrite(fd, t.reshape(-1).view(torch.uint8).numpy().tobytes(), data_at + at)
        for index, ((name, _), spec) in enumerate(zip(tables, specs, strict=True)):
            for _ in range(ATTEMPTS):
                counts = _table(client, fd, layout, data_at, digest, index, name, spec.dim, optimizer_state)
                if counts is not None:
                    break
                log.info("table %r: rows were made or dropped while saving it; saving it again", name)
            else:
                raise RuntimeError(
                    f"table {name!r} kept changing while it was saved ({ATTEMPTS} tries): other workers are "
                    "training; save when they are done, or between steps of a sync job"
                )
            written[name], segments[name] = sum(counts), counts
        metadata = _metadata(tables, specs, shards, segments, client.versions)
        header = _Layout.header(layout.entries, metadata)
        os.pwrite(fd, struct.pack("<Q", len(reserved)) + header.ljust(len(reserved)), 0)
        os.ftruncate(fd, data_at + layout.end)  # a table written again may have been longer the first time
        os.fsync(fd)
    except BaseException:
        os.close(fd)
        os.unlink(partial)
        raise
    os.close(fd)
    os.replace(partial, path)
    return written


def _table(
    client: PSClient,
    fd: int,
    layout: _Layout,
    data_at: int,
    digest: str,
    index: int,
    name: str,
    dim: int,
    optimizer_state: bool,
) -> list[int] | None:
    """Write one table's rows, shard after shard; return each shard's count, or None when a shard held another
    count than it said first (rows made or evicted meanwhile: the table is written again, over this one).

    Each shard says first how many rows it holds (a header alone), so that the table's place in the file is known
    before any row arrives; then the shards send their rows one after the other, so that only one stream's messages
    are in flight (gRPC would buffer an open stream's rows while another is read)."""
    links = client.links
    timeout = client.timeout
    heads = [next(_export(link, timeout, digest, index, optimizer_state, header_only=True)) for link in links]
    counts, cols = [int(h.count) for h in heads], int(heads[0].state_cols)
    n = sum(counts)
    layout.rewind(f"{name}.ids")
    ids_at = data_at + layout.add(f"{name}.ids", "I64", [n], 8 * n)
    values_at = data_at + layout.add(f"{name}.values", "F32", [n, dim], 4 * dim * n)
    state_at = data_at + (layout.add(f"{name}.optimizer_state", "F32", [n, cols], 4 * cols * n) if cols else 0)
    row = 0
    for link, count in zip(links, counts, strict=True):
        stream = _export(link, timeout, digest, index, optimizer_state)
        head = next(stream)
        if head.count != count:
            return None
        for part in stream:
            os.pwrite(fd, part.ids, ids_at + 8 * row)
            os.pwrite(fd, part.values, values_at + 4 * dim * row)
            if cols:
                os.pwrite(fd, part.state, state_at + 4 * cols * row)
            row += part.count
    if row != n:
        raise RuntimeError(f"table {name!r}: the shards announced {n} rows and sent {row}")
    return counts


def _export(
    link: ShardLink, timeout: float, digest: str, table: int, optimizer_state: bool, header_only: bool = False
) -> Iterator[ps_pb2.ExportRowsMessage.Header | ps_pb2.ExportRowsMessage.Rows]:
    """One shard's rows of one table (ExportRows): its header first (retried while the shard is unavailable, or
    on its other copy), then (unless `header_only`) the rows, about 1 MiB at a time."""
    req = ps_pb2.ExportRowsRequest(
        model_digest=digest, table=table, optimizer_state=optimizer_state, header_only=header_only
    )
    stream: Iterator[ps_pb2.ExportRowsMessage] = iter(())

    def first() -> ps_pb2.ExportRowsMessage:
        nonlocal stream
        stream = link.rpc.stub.ExportRows(req, timeout=timeout)
        return next(stream)

    yield link.retry(first).header
    while (message := link.call(lambda: next(stream, None))) is not None:
        yield message.rows


def _reserve(
    dense: dict[str, torch.Tensor],
    tables: list[tuple[str, SparseEmbedding]],
    specs: tuple[TableSpec, ...] | list[TableSpec],
    shards: int,
    optimizer_state: bool,
) -> bytes:
    """The header at its widest (every unknown number with the most digits), padded so the data starts at a
    multiple of 8: the real header, written last, fits in it."""
    entries: dict[str, Any] = {}
    widest = {"shape": [_WIDEST, _WIDEST], "data_offsets": [_WIDEST, _WIDEST]}
    for name, t in dense.items():
        entries[name] = {"dtype": _code(t.dtype, name), "shape": list(t.shape), "data_offsets": widest["data_offsets"]}
    suffixes = ("ids", "values", "optimizer_state") if optimizer_state else ("ids", "values")
    for name, _ in tables:
        for suffix in suffixes:
            entries[f"{name}.{suffix}"] = {"dtype": "BOOL", **widest}  # "BOOL": the longest code used here
    segments = {name: [_WIDEST] * shards for name, _ in tables}
    metadata = _metadata(tables, specs, shards, segments, [_WIDEST] * shards)
    size = len(_Layout.header(entries, metadata))
    return b" " * (size + (-(8 + size) % 8))


def _metadata(
    tables: list[tuple[str, SparseEmbedding]],
    specs: tuple[TableSpec, ...] | list[TableSpec],
    shards: int,
    segments: dict[str, list[int]],
    versions: list[int],
) -> dict[str, str]:
    described = [
        {"path": name, "spec": asdict(spec), "segments": segments.get(name, [])}
        for (name, _), spec in zip(tables, specs, strict=True)
    ]
    return {
        "format": FORMAT,
        "num_shards": str(shards),
        "tables": json.dumps(described, separators=(",", ":")),
        "versions": json.dumps(versions),
    }


def _code(dtype: torch.dtype, name: str) -> str:
    code = _CODES.get(dtype)
    if code is None:
        raise ValueError(
            f"{name}: tensors of {dtype} cannot be saved (safetensors dtypes: {', '.join(_CODES.values())})"
        )
    return code


class FileRows:
    """A table's rows as a saved model holds them, memory-mapped: a lookup searches each ID's shard segment; an ID
    the file lacks reads as the table's initial rule (see worker.client.sparse.RowSource)."""

    trains = False

    def __init__(self, spec: TableSpec, ids: np.ndarray, values: np.ndarray, segments: list[int]) -> None:
        self.spec = spec
        self._ids = ids
        self._values = values
        self._starts = np.concatenate([[0], np.cumsum(segments)]).astype(np.int64)
        self._initial = Initialiser(spec)

    def lookup(self, ids: np.ndarray) -> np.ndarray:
        ids = np.ascontiguousarray(ids, dtype=np.int64)
        problem = self.spec.check_ids(ids)
        if problem:
            raise IndexError(problem)
        out = np.empty((len(ids), self.spec.dim), dtype=np.float32)
        found = np.zeros(len(ids), dtype=bool)
        shards = len(self._starts) - 1
        owner = shard_of(ids, shards) if shards > 1 else np.zeros(len(ids), np.int64)
        for s in range(shards):
            lo, hi = int(self._starts[s]), int(self._starts[s + 1])
            mine = np.flatnonzero(owner == s)
            if not len(mine) or hi == lo:
                continue
            segment = self._ids[lo:hi]
            at = np.minimum(np.searchsorted(segment, ids[mine]), hi - lo - 1)
            hit = segment[at] == ids[mine]
            out[mine[hit]] = self._values[lo + at[hit]]
            found[mine[hit]] = True
        if not found.all():
            out[~found] = self._initial.rows(ids[~found])
        return out


def load(model: nn.Module, path: str | os.PathLike[str]) -> nn.Module:
    """Put a file `PSClient.save` wrote into `model`, with no server, and return the model. `model` is built as the
    saved one was: converted (make_sparse as it was, or its own SparseEmbeddings), each table then answering
    lookups from the file (memory-mapped: rows are read as lookups touch them); or the plain model before
    make_sparse, each bounded table then filling the weight of the nn.Embedding / nn.EmbeddingBag at its path (the
    file's rows, and the table's initial rule for every row the file lacks: what the shards would answer), so that
    it predicts as the trained model and torch.export, ONNX or TorchServe take it. The dense tensors and buffers
    are copied in. A file saved from a wrapper (a LightningModule whose PSOptimizer(self, client) registered it)
    also loads into the model it wraps (`self.net`): its entries under the one prefix that holds every name of the
    model are taken, the prefix taken off (worker.client.model_names). ValueError when the file is no such model
    file or does not fit this model (an unbounded table fits no plain module), saying what would."""
    from safetensors import safe_open

    header, data_at = _read_header(path)
    metadata = header.get("__metadata__", {})
    if metadata.get("format") != FORMAT:
        raise ValueError(f"{path} is not a model file written by PSClient.save (format {metadata.get('format')!r})")
    header, saved, under = _under_prefix(model, header, json.loads(metadata["tables"]), path)
    mine, plain = _targets(model, saved, path)
    specs = {name: TableSpec(**saved[name]["spec"]) for name in saved}
    for name, module in plain.items():
        problem = plain_fit(module, name, specs[name], os.fspath(path))
        if problem:
            raise ValueError(problem)
    for name, table in mine.items():
        if specs[name].dim != table.dim:
            raise ValueError(f"table {name!r}: the file's rows are {specs[name].dim} wide, the model's {table.dim}")
    with without_rows():
        state = model.state_dict()
    filled = {id(m) for m in plain.values()}
    for prefix, module in model.named_modules(remove_duplicate=False):
        if id(module) in filled:
            state.pop(f"{prefix}.weight", None)  # the table's rows fill it, below
    table_keys = {f"{name}.{s}" for name in saved for s in ("ids", "values", "optimizer_state")}
    dense_keys = set(header) - table_keys - {"__metadata__"}
    if dense_keys != set(state):
        raise ValueError(
            f"{path} does not fit the model: missing {sorted(set(state) - dense_keys)[:5]}, unexpected "
            f"{sorted(dense_keys - set(state))[:5]}"
        )
    with safe_open(os.fspath(path), framework="pt") as f, torch.no_grad():
        for name, target in state.items():
            value = f.get_tensor(under + name)
            if value.shape != target.shape:
                raise ValueError(f"{name}: the file's is {list(value.shape)}, the model's {list(target.shape)}")
            target.copy_(value)
    for name in saved:
        ids = _mapped(path, header, data_at, f"{name}.ids", np.int64)
        values = _mapped(path, header, data_at, f"{name}.values", np.float32)
        if name in plain:
            fill_embedding(plain[name], specs[name], ids, values)
        else:
            mine[name].attach(FileRows(specs[name], ids, values, saved[name]["segments"]))
            mine[name].given = None  # the file's rows replace the ones the model was built with
    return model


def _under_prefix(
    model: nn.Module, header: dict[str, Any], tables: list[dict[str, Any]], path: str | os.PathLike[str]
) -> tuple[dict[str, Any], dict[str, Any], str]:
    """The file's header entries and tables that are `model`'s, named as in the model, and the prefix taken off
    their names: a file saved from a wrapper (a LightningModule's `self.net`) fits the model inside it
    (worker.client.model_names states the rule)."""
    table_keys = {f"{t['path']}.{s}" for t in tables for s in ("ids", "values", "optimizer_state")}
    shapes = {name: tuple(e["shape"]) for name, e in header.items() if name not in table_keys | {"__metadata__"}}
    for t in tables:
        shapes[f"{t['path']}.weight"] = (t["spec"].get("num_embeddings", 0), t["spec"]["dim"])
    try:
        prefix = file_prefix(model, shapes)
    except ValueError as exc:
        raise ValueError(f"{path}: {exc}") from None
    if prefix:
        log.info("the file's entries under %r are the model's (the rest left out)", prefix)
    cut = len(prefix)
    entries = {
        name[cut:]: entry for name, entry in header.items() if name.startswith(prefix) and name != "__metadata__"
    }
    saved = {t["path"][cut:]: t for t in tables if t["path"].startswith(prefix)}
    return entries, saved, prefix


def _targets(
    model: nn.Module, saved: dict[str, Any], path: str | os.PathLike[str]
) -> tuple[dict[str, SparseEmbedding], dict[str, nn.Embedding | nn.EmbeddingBag]]:
    """Where each saved table goes: the model's SparseEmbedding at its path, or a plain nn.Embedding /
    nn.EmbeddingBag there. ValueError, naming the fix, when the model's tables are not the file's."""
    mine = dict(tables_of(model))
    modules = dict(model.named_modules())
    plain = {
        name: m
        for name in saved
        if name not in mine and isinstance(m := modules.get(name), nn.Embedding | nn.EmbeddingBag)
    }
    if set(saved) != set(mine) | set(plain):
        others = [n for n, m in modules.items() if n not in mine and isinstance(m, nn.Embedding | nn.EmbeddingBag)]
        raise ValueError(
            f"{path} holds tables {sorted(saved)}, the model {sorted(set(mine) | set(others))}: build the model "
            "as the saved one was built, so that each table of the file names a module of it, and no other "
            "SparseEmbedding is there: the same class converted by the same make_sparse(model, unbounded=[...]) "
            "call (or with the same SparseEmbeddings), or the plain model before make_sparse (each bounded table "
            "then fills the nn.Embedding / nn.EmbeddingBag at its path)"
        )
    return mine, plain


def _read_header(path: str | os.PathLike[str]) -> tuple[dict[str, Any], int]:
    with open(path, "rb") as f:
        raw = f.read(8)
        if len(raw) != 8:
            raise ValueError(f"{path} is too short to be a safetensors file")
        (size,) = struct.unpack("<Q", raw)
        if size > 100 << 20:
            raise ValueError(f"{path}: a header of {size} bytes is no safetensors header")
        text = f.read(size)
    try:
        return json.loads(text), 8 + size
    except ValueError as exc:
        raise ValueError(f"{path}: its header is not JSON ({exc})") from None


def _mapped(
    path: str | os.PathLike[str], header: dict[str, Any], data_at: int, name: str, dtype: type[np.generic]
) -> np.ndarray:
    entry = header[name]
    lo, hi = entry["data_offsets"]
    shape = tuple(entry["shape"])
    if hi - lo != int(np.prod(shape)) * np.dtype(dtype).itemsize:
        raise ValueError(f"{path}: {name} has {hi - lo} bytes for shape {list(shape)}")
    if hi == lo:
        return np.empty(shape, dtype=dtype)
    return np.memmap(path, dtype=dtype, mode="r", offset=data_at + lo, shape=shape)
