"""A serving copy's first state from a model file (`PSClient.save`, `ps-worker --save-model`): served at once,
while the copy takes its shard's whole state beside it and swaps that in once whole.

The file's rows were read while the job went on, each table at its own moment (paramserver.serving.copy.ShardCopy
holds one version at a time, and a file holds none exactly), so the file is never continued with a delta: it is
what a copy serves until its first whole state has arrived, and no longer. The file is read with safetensors
itself, a table at a time.
"""

from __future__ import annotations

import json
import os
from collections.abc import Mapping
from typing import Any

import numpy as np
from safetensors import safe_open

from paramserver.placement import TensorSpec, digest, place
from paramserver.serving.copy import ShardCopy
from paramserver.tables import TableSpec, shard_of, spec_to_proto
from paramserver.v1 import ps_pb2
from paramserver.wire.specs import specs_from_proto, specs_to_proto

FORMAT = "paramserver.model/1"  # worker.client.model_file writes it


def seed(
    copies: Mapping[int, ShardCopy],
    topology: ps_pb2.Topology,
    tables: tuple[TableSpec, ...],
    path: str | os.PathLike[str],
) -> None:
    """Fill each of `copies` (ShardCopy by shard index) from the model file at `path`, which must hold the model
    `topology` describes (ValueError saying what differs otherwise)."""
    with _open(path) as f:
        meta = f.metadata() or {}
        if meta.get("format") != FORMAT:
            raise ValueError(f"{path} is not a model file PSClient.save wrote (format {meta.get('format')!r})")
        saved = _tables(meta, path)
        by_name = {t.name: t for t in tables}
        if sorted(saved) != sorted(by_name) or any(
            saved[n][1].digest_entry() != by_name[n].digest_entry() for n in saved
        ):
            raise ValueError(
                f"{path} holds tables {sorted(saved)}, the job {sorted(by_name)} (or their specs differ): start from "
                "a file this job's model was saved to"
            )
        specs = specs_from_proto(topology.specs)
        dense = {s.name: _tensor(f, s, path) for s in specs}
        shards = len(topology.shards)
        placement = place(specs, shards, tables=tables)
        versions = json.loads(meta.get("versions", "[]"))
        same_shards = int(meta.get("num_shards", "0")) == shards and len(versions) == shards
        rows: dict[int, list[tuple[int, np.ndarray, np.ndarray]]] = {i: [] for i in copies}
        index = {t.name: k for k, t in enumerate(tables)}
        for name, (key, spec) in saved.items():
            ids = np.ascontiguousarray(f.get_tensor(f"{key}.ids"), dtype=np.int64)
            values = np.ascontiguousarray(f.get_tensor(f"{key}.values"), dtype=np.float32)
            if values.shape != (len(ids), spec.dim):
                raise ValueError(f"{path}: table {name!r} holds {len(ids)} IDs and values of {list(values.shape)}")
            owner = shard_of(ids, shards)
            for i in copies:
                mine = np.flatnonzero(owner == i)
                rows[i].append((index[name], ids[mine], values[mine]))
    for i, copy in copies.items():
        flat = [dense[p.name].reshape(-1)[p.start : p.start + p.length] for p in placement.shards[i]]
        version = int(versions[i]) if same_shards else 0
        copy.seed(np.concatenate(flat) if flat else np.empty(0, np.float32), rows[i], version, topology.model_digest)


def topology_of(path: str | os.PathLike[str]) -> ps_pb2.Topology:
    """What a model file holds, as a job's topology (no addresses): its tables, its dense tensors (as parameters: a
    file does not say which were buffers), its shards, and a digest of these, to serve it with no job."""
    with _open(path) as f:
        meta = f.metadata() or {}
        if meta.get("format") != FORMAT:
            raise ValueError(f"{path} is not a model file PSClient.save wrote (format {meta.get('format')!r})")
        saved = _tables(meta, path)
        table_keys = {f"{key}.{part}" for key, _ in saved.values() for part in ("ids", "values", "optimizer_state")}
        specs = [TensorSpec(name, tuple(f.get_slice(name).get_shape())) for name in f.keys() if name not in table_keys]
    shards = int(meta.get("num_shards", "1") or 1)
    tables = [spec for _, spec in saved.values()]
    return ps_pb2.Topology(
        shards=[""] * shards,
        initialized=True,
        model_digest=digest(specs, shards, tables=tables),
        specs=specs_to_proto(specs),
        tables=[spec_to_proto(t) for t in tables],
    )


def _open(path: str | os.PathLike[str]) -> Any:
    try:
        return safe_open(os.fspath(path), framework="numpy")
    except OSError:
        raise
    except Exception as exc:  # safetensors' own error for bytes that are no safetensors file
        raise ValueError(f"{path} is not a model file PSClient.save wrote ({exc})") from None


def _tables(meta: dict[str, str], path: str | os.PathLike[str]) -> dict[str, tuple[str, TableSpec]]:
    """The file's tables by name: (their key in the file, their spec)."""
    try:
        described = json.loads(meta.get("tables", "[]"))
        return {d["spec"]["name"]: (d["path"], TableSpec(**d["spec"])) for d in described}
    except (ValueError, KeyError, TypeError) as exc:
        raise ValueError(f"{path}: its table list cannot be read ({exc})") from None


def _tensor(f: Any, spec: TensorSpec, path: str | os.PathLike[str]) -> np.ndarray:
    try:
        value = f.get_tensor(spec.name)
    except Exception:  # safetensors raises its own error for a missing name
        raise ValueError(
            f"{path} has no tensor {spec.name!r}: start from a file this job's model was saved to"
        ) from None
    if tuple(value.shape) != spec.shape:
        raise ValueError(f"{path}: {spec.name} is {list(value.shape)}, the job's {list(spec.shape)}")
    return np.asarray(value, dtype=np.float32)
